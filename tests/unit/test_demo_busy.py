"""`vllm-graft demo` over repeated, alternating runs (issue 35): the median and spread it prints,
and its verdict on what other processes used of the CPU, from given figures (no timing)."""
import argparse

from rich.console import Console

from vllm_graft.cli import engine_commands as run


def test_busy_when_any_timed_run_saw_other_processes_above_the_limit():
    quiet = run.disturbance([0.02, 0.05, None], limit=0.1)
    assert quiet["busy"] is False and quiet["max_cpus"] == 0.05
    assert "quiet" in quiet["text"] and "0.05" in quiet["text"]
    busy = run.disturbance([0.02, 0.9, 0.05], limit=0.1)
    assert busy["busy"] is True and busy["max_cpus"] == 0.9
    assert "the machine was busy" in busy["text"] and "not the plugins'" in busy["text"] and "0.90" in busy["text"]
    at_limit = run.disturbance([0.1], limit=0.1)
    assert at_limit["busy"] is False  # above the limit, not at it
    unknown = run.disturbance([None, None])
    assert unknown["busy"] is None and "not measured" in unknown["text"]
    assert run.disturbance([0.2])["busy"] is (0.2 > run.DEMO_BUSY_CPUS)


def _summary(runs, other):
    runs = list(runs)
    return {"output_tok_s": sorted(runs)[len(runs) // 2], "output_tok_s_runs": runs, "runs": len(runs),
            "output_tok_s_min": min(runs), "output_tok_s_max": max(runs), "other_cpus": other,
            "perplexity": 4.0}


def _result(other_cpus):
    def arm(runs, other):
        return {"summary": _summary(runs, other), "kv_blocks_per_step": [3, 2, 2],
                "requests": [{"output_text": " x"}]}

    ratio = {"ratio": 1.5, "min": 1.2, "max": 1.7, "runs": [1.2, 1.5, 1.7]}
    return {
        "workloads": [{"name": "code-completion", "num_prompts": 1, "prompts": [{"text": "def f():", "source": "a"}]}],
        "arms": {"plain": {"workloads": {"code-completion": arm([90.0, 100.0, 110.0], other_cpus[0])}},
                 "graft": {"workloads": {"code-completion": arm([140.0, 150.0, 160.0], other_cpus[1])}}},
        "comparison": {"workloads": {"code-completion": {
            "prompts": [{"identical": True, "first_diff": None}], "ratio": ratio, "n_identical": 1, "n": 1}}},
        "runtime_report": [], "wall_s": 30.0,
    }


def test_demo_prints_median_spread_speedup_spread_and_the_verdict():
    console = Console(record=True, width=220)
    result = _result([0.01, 0.03])
    run.print_demo(result, console)
    text = console.export_text()
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("code-completion "))
    assert row[1:7] == ["100", "(90-110)", "150", "(140-160)", "1.50x", "(1.20-1.70)"]
    assert "the median of 3 timed runs per arm" in text
    assert "the machine was quiet" in text and result["disturbance"]["busy"] is False

    console = Console(record=True, width=220)
    result = _result([0.01, 0.6])  # one arm's runs met a busy machine
    run.print_demo(result, console)
    text = console.export_text()
    assert "the machine was busy: other processes used up to 0.60 CPUs" in text
    assert "not the plugins'" in text and result["disturbance"]["busy"] is True


def test_demo_runs_each_arm_several_times_alternating(monkeypatch):
    seen = {}

    def fake_run_bench(args, out, err):
        seen.update(vars(args))
        return 4, None

    monkeypatch.setattr("vllm_graft.tools.bench.command.run_bench", fake_run_bench)
    ns = argparse.Namespace(deployment=None, quick=True, num_prompts=None, max_tokens=None, log_dir=None, repeat=None)
    assert run.cmd_demo(ns, Console(record=True, width=200)) == 4
    assert seen["repeat"] == run.DEMO_REPEATS >= 3 and seen["arms"] == "plain,graft"
    ns.repeat = 5
    run.cmd_demo(ns, Console(record=True, width=200))
    assert seen["repeat"] == 5


def test_timed_runs_start_from_fresh_cross_request_drafting_state(caplog):
    from vllm_graft.hooks import Kind, Proposer
    from vllm_graft.integration.runtime import Runtime

    class Shared(Proposer):  # drafts from every request's tokens (as lookahead's trie)
        def __init__(self, params):
            super().__init__(params)
            self.seen = []

        def propose(self, request_id, token_ids, max_tokens):
            self.seen.append(list(token_ids))
            return []

    class Own(Shared):
        per_request_drafts = True

    class Target(Shared):
        needs_target_weights = True

    rt = Runtime()
    shared, own, target = Shared({"n": 1}), Own(None), Target(None)
    rt.instances.update({(Kind.SPECULATIVE, "shared"): shared, (Kind.SPECULATIVE, "own"): own,
                         (Kind.SPECULATIVE, "target"): target})
    for p in (shared, own, target):
        p.propose("r", [1, 2, 3], 2)
    with caplog.at_level("INFO", logger="vllm_graft"):
        assert rt.fresh_cross_request_state() == ["shared"]
    assert shared.seen == [] and shared.params == {"n": 1}  # rebuilt in place: references stay valid
    assert rt.instances[(Kind.SPECULATIVE, "shared")] is shared
    assert own.seen == [[1, 2, 3]] and target.seen == [[1, 2, 3]]
    assert "'target' keeps its state between timed runs" in caplog.text
