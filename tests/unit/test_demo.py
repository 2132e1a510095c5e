"""`vllm-graft demo`'s summary: what it derives from a bench result (the run itself is the bench's,
tested in tests/e2e/test_bench.py; the whole command runs from an installed wheel in
tests/e2e/test_wheel.py)."""
import argparse

from rich.console import Console

from vllm_graft.cli import engine_commands as run


def _arm(tok_s, ppl, blocks, text):
    return {"summary": {"output_tok_s": tok_s, "perplexity": ppl}, "kv_blocks_per_step": blocks,
            "requests": [{"output_text": text}]}


def _result():
    return {
        "workloads": [
            {"name": "code-completion", "num_prompts": 1, "prompts": [{"text": "def f(x):\n    return", "source": "a.py:f"}]},
            {"name": "long-context", "num_prompts": 1, "prompts": [{"text": "x = 1\n" * 50, "source": "b.py@10"}]},
        ],
        "arms": {
            "plain": {"workloads": {"code-completion": _arm(100.0, 4.0, [1, 1, 1], " x + 1"),
                                    "long-context": _arm(50.0, 5.0, [15, 15, 15, 15], " y = 2")}},
            "graft": {"workloads": {"code-completion": _arm(150.0, 4.0, [1, 1, 1], " x + 1"),
                                    "long-context": _arm(60.0, 5.5, [15, 4, 4, 4], " z = 3")}},
        },
        "comparison": {"workloads": {
            "code-completion": {"prompts": [{"identical": True, "first_diff": None}], "ratio": {"ratio": 1.5},
                                "n_identical": 1, "n": 1},
            "long-context": {"prompts": [{"identical": False, "first_diff": 2}], "ratio": {"ratio": 1.2},
                             "n_identical": 0, "n": 1},
        }},
        "runtime_report": [
            {"kind": "speculative", "name": "lookahead", "events": {"propose": 10, "drafted": 40, "accepted": 13}},
            {"kind": "kvcompress", "name": "streaming", "events": {"blocks_freed": 11}},
        ],
        "wall_s": 12.5,
    }


def test_demo_summary_reports_speed_kv_held_acceptance_and_quality():
    console = Console(record=True, width=200)
    run.print_demo(_result(), console)
    text = console.export_text()
    row = {line.split()[0]: line.split() for line in text.splitlines()
           if line.strip().startswith(("code-completion ", "long-context "))}
    # speed, KV blocks held after the prefill step (15 -> 4: -73%), identical, ppl change
    assert row["code-completion"][1:4] == ["100", "150", "1.50x"]
    assert "15.0 -> 4.0 (-73%)" in " ".join(row["long-context"])
    assert row["long-context"][-2:] == ["0/1", "+10.0%"]
    assert row["code-completion"][-2:] == ["1/1", "+0.0%"]
    assert "13 of 40 drafted tokens accepted, 1.30 per step that drafted (10 steps)" in text
    assert "11 KV blocks freed" in text
    # a sample of both arms' text, and where they part
    assert "plain:  x + 1" in text and "graft:  z = 3" in text
    assert "outputs part at output token 2" in text and "identical tokens" in text


def test_decode_mean_leaves_out_the_prefill_step():
    assert run._decode_mean([15, 4, 4, 5]) == (4 + 4 + 5) / 3
    assert run._decode_mean([7]) == 7
    assert run._decode_mean([]) is None


def test_demo_defaults_and_quick(monkeypatch, tmp_path):
    seen = {}

    def fake_run_bench(args, out, err):
        seen.update(vars(args))
        return 4, None  # as a failed arm returns: the demo passes the exit code on

    monkeypatch.setattr("vllm_graft.tools.bench.command.run_bench", fake_run_bench)
    console = Console(record=True, width=200)
    assert run.cmd_demo(argparse.Namespace(deployment=None, quick=True, num_prompts=None, max_tokens=None,
                                           log_dir=None), console) == 4
    assert seen["workload"] == ["code-completion,long-context"] and seen["batch"] == 1
    assert (seen["num_prompts"], seen["max_tokens"], seen["arms"]) == (2, 48, "plain,graft")
    assert seen["deployment"].endswith("demo.yaml") and "lookahead" in console.export_text()


def test_demo_runs_on_the_real_model_once_fetched_and_says_so_when_not(monkeypatch, tmp_path):
    from vllm_graft.cli import real_model as rm

    monkeypatch.setenv(rm.CACHE_ENV, str(tmp_path / "cache"))
    console = Console(record=True, width=80)
    assert run.demo_deployment(console).endswith("deployments/demo.yaml")
    text = console.export_text()
    assert "smollm2-135m is not fetched" in text and "bundled tiny model instead" in text
    folder = rm.model_dir("smollm2-135m")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / rm.PROVENANCE).write_text("{}")
    assert run.demo_deployment(Console(record=True)).endswith("deployments/smollm2/demo.yaml")
