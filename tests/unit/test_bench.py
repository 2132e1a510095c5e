"""`vllm-graft bench` without an engine: workloads, metric aggregation, output comparison,
rendering (table, JSON, plot) and the command line's refusals before any engine starts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from vllm_graft.tools import bench
from vllm_graft.tools import workloads as W
from vllm_graft.cli.main import main
from vllm_graft.tools.bench.command import STEP_SPIN

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama"
PLAIN = ROOT / "deployments" / "plain.yaml"


@pytest.fixture(scope="module")
def tok():
    return W.Tokenizer.from_model(MODEL)


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def build(tok, names=None, n=4, max_tokens=32, seed=0, max_model_len=2048):
    return W.build(names or W.parse_names(None), tok, num_prompts=n, max_tokens=max_tokens,
                   max_model_len=max_model_len, seed=seed)


# ----------------------------------------------------------------------------- workloads
def test_workloads_are_deterministic(tok):
    a, b = build(tok, seed=3), build(tok, seed=3)
    assert [ps.name for ps in a] == ["chat", "shared-prefix", "long-context", "code-completion",
                                     "extractive", "long-recall"]
    for x, y in zip(a, b):
        assert [p.token_ids for p in x.prompts] == [p.token_ids for p in y.prompts]
        assert x.fingerprint() == y.fingerprint()
        assert len(x.prompts) == 4


def test_seed_changes_the_selection(tok):
    a, b = build(tok, seed=0), build(tok, seed=1)
    for x, y in zip(a, b):
        assert x.fingerprint() != y.fingerprint(), x.name


def test_prompt_lengths_fit_the_context(tok):
    for max_tokens in (8, 64, 300):
        for ps in build(tok, n=6, max_tokens=max_tokens):
            for p in ps.prompts:
                assert 1 <= p.max_tokens <= max_tokens
                assert len(p.token_ids) + p.max_tokens <= 2048 - 1, (ps.name, p.source)


def test_long_context_length(tok):
    (ps,) = build(tok, ["long-context"], n=3, max_tokens=64)
    assert {len(p.token_ids) for p in ps.prompts} == {W.LONG_CONTEXT_TOKENS}
    (ps,) = build(tok, ["long-context"], n=3, max_tokens=400)
    assert {len(p.token_ids) for p in ps.prompts} == {2048 - 400 - 1}  # shortened to fit
    assert all(p.max_tokens == 400 for p in ps.prompts)
    # windows of real stdlib files
    for p in ps.prompts:
        rel, _, start = p.source.partition("@")
        source = (W.stdlib_dir() / rel).read_text(encoding="utf-8", errors="replace")
        assert p.text[:200] in source


def test_long_context_refuses_when_nothing_fits(tok):
    with pytest.raises(W.WorkloadError, match="long-context"):
        build(tok, ["long-context"], n=1, max_tokens=1900)


def test_chat_prompts_are_short_and_round_trip(tok, hf_tok):
    (ps,) = build(tok, ["chat"], n=10)
    assert len({p.token_ids for p in ps.prompts}) == 10
    for p in ps.prompts:
        assert 5 <= len(p.token_ids) <= 64
        assert not p.text.endswith("\n")
        # the same ids as the model's own tokenizer gives
        assert list(p.token_ids) == hf_tok(p.text, add_special_tokens=False)["input_ids"]


def test_shared_prefix_groups_share_a_long_prefix(tok):
    (ps,) = build(tok, ["shared-prefix"], n=10)
    groups = {}
    for p in ps.prompts:
        groups.setdefault(p.group, []).append(p.token_ids)
    assert sorted(len(g) for g in groups.values()) == [2, W.SHARED_PREFIX_GROUP]
    for g in groups.values():
        common = W._common_prefix(g)
        assert len(common) >= 512
        assert all(len(ids) > len(common) for ids in g)  # then a different question each
        assert len({ids for ids in g}) == len(g)
    assert ps.stats["shared_prefix_tokens"][0] >= 512
    assert ps.prompts[0].text.startswith('"""You are a careful Python assistant')


def test_code_completion_prompts_are_function_heads(tok):
    (ps,) = build(tok, ["code-completion"], n=8)
    for p in ps.prompts:
        rel, _, qual = p.source.partition(":")
        assert (W.stdlib_dir() / rel).is_file()
        assert rel.split("/")[0] not in W.EXCLUDED_DIRS
        name = qual.split(".")[-1]
        assert f"def {name}(" in p.text
        assert len(p.token_ids) <= W.CODE_COMPLETION_MAX_TOKENS
        assert not p.text.endswith("\n")


def test_function_heads(tmp_path):
    (tmp_path / "m.py").write_text(textwrap.dedent('''\
        def short():
            return 1

        class K:
            @staticmethod
            def method(a,
                       b):
                """Add them."""
                c = a + b
                return c

        def nodoc(x):
            y = x * 2
            return y
        '''))
    heads = {h.qualname: h for h in W.function_heads(tmp_path, "m.py")}
    assert set(heads) == {"K.method", "nodoc"}  # `short` has nothing left to complete
    assert heads["K.method"].head == ('@staticmethod\ndef method(a,\n           b):\n    """Add them."""\n'
                                      '    c = a + b')
    assert heads["nodoc"].head == "def nodoc(x):\n    y = x * 2"
    assert heads["nodoc"].source.endswith("return y")


def test_stdlib_files_skip_tests(tmp_path):
    for rel in ("a.py", "pkg/b.py", "test/t.py", "pkg/tests/u.py", "site-packages/x.py", "c.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert W.stdlib_files(tmp_path) == ["a.py", "pkg/b.py"]


def test_parse_names():
    assert W.parse_names(None) == [n for n in W.WORKLOADS if n != "long-context-4k"]
    assert W.parse_names(["chat,long-context", "chat", " code-completion "]) == [
        "chat", "long-context", "code-completion"]
    assert W.parse_names(["all"]) == W.parse_names(None)
    assert W.parse_names(["long-context-4k", "all"])[0] == "long-context-4k"  # named, it runs
    with pytest.raises(W.UnknownWorkloadError) as e:
        W.parse_names(["chat,shared_prefix,bogus"])
    text = str(e.value)
    assert "'shared_prefix' (did you mean 'shared-prefix'?)" in text and "'bogus'" in text
    assert "accepted: chat, shared-prefix, long-context, code-completion" in text


def test_every_workload_is_described():
    for w in W.WORKLOADS.values():
        assert len(w.describe) > 80 and w.summary


# ---------------------------------------------------------------------- metric helpers
def test_token_gaps_split_multi_token_steps():
    assert bench.token_gaps([]) == []
    assert bench.token_gaps([5.0]) == []
    assert bench.token_gaps([0.0, 1.0, 3.0]) == [1.0, 2.0]
    # two tokens arrive together 2 s after the first: two gaps of 1 s
    assert bench.token_gaps([0.0, 2.0, 2.0, 2.5]) == [1.0, 1.0, 0.5]
    t = bench.request_timing(10.0, [10.5, 11.0, 11.0, 12.5])
    assert t["ttft_s"] == 0.5
    assert t["tpot_s"] == pytest.approx(2.0 / 3)
    assert sum(t["itl_s"]) == pytest.approx(2.0) and len(t["itl_s"]) == 3
    assert bench.request_timing(1.0, [1.25]) == {"ttft_s": 0.25, "tpot_s": None, "itl_s": []}


def test_percentile_and_summary():
    assert bench.percentile([], 50) is None
    assert bench.percentile([3, 1, 2], 50) == 2
    assert bench.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    reqs = [{"prompt_tokens": 10, "output_token_ids": [1, 2, 3], "ttft_s": 0.1, "tpot_s": 0.02,
             "itl_s": [0.01, 0.03], "nll": [1.0, 2.0, 3.0]},
            {"prompt_tokens": 5, "output_token_ids": [4], "ttft_s": 0.3, "tpot_s": None,
             "itl_s": [], "nll": [0.0]}]
    s = bench.summarize(reqs, 2.0)
    assert (s["requests"], s["prompt_tokens"], s["output_tokens"]) == (2, 15, 4)
    assert s["output_tok_s"] == 2.0
    assert s["ttft_mean_s"] == pytest.approx(0.2) and s["ttft_p90_s"] == pytest.approx(0.28)
    assert s["itl_mean_s"] == pytest.approx(0.02) and s["tpot_mean_s"] == pytest.approx(0.02)
    assert s["perplexity"] == pytest.approx(math.exp(6.0 / 4)) and s["scored_tokens"] == 4
    reqs[1]["nll"] = None  # not every request scored: no perplexity rather than a partial one
    assert bench.summarize(reqs, 2.0)["perplexity"] is None


def test_first_difference_and_comparison():
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert bench.first_difference([], []) is None
    c = bench.compare_outputs([[1, 2], [3, 4, 5], [6]], [[1, 2], [3, 4, 0], [6, 7]])
    assert (c["identical"], c["n_identical"], c["n"]) == (False, 1, 3)
    assert [p["first_diff"] for p in c["prompts"]] == [None, 2, 1]
    assert bench.compare_outputs([[1]], [[1]])["identical"] is True
    with pytest.raises(ValueError):
        bench.compare_outputs([[1]], [])


def test_nll_from_prompt_logprobs():
    class LP:
        def __init__(self, x):
            self.logprob = x

    ids = [7, 8, 9, 10]
    lps = [None, {8: LP(-1.0)}, {9: LP(-0.5)}, {10: LP(-2.0), 11: LP(-0.1)}]
    assert bench.nll_of(lps, ids, 2) == [0.5, 2.0]
    with pytest.raises(ValueError):
        bench.nll_of([None, {3: LP(-1.0)}], [7, 8], 1)


# ------------------------------------------------------------------ assembling/rendering
def _request(ids, ttft=0.05, step=0.01):
    times = [ttft + step * k for k in range(len(ids))]
    return {"output_token_ids": list(ids), "finish_reason": "length", "num_cached_tokens": 0,
            "submit_s": 0.0, "token_times_s": times, **bench.request_timing(0.0, times),
            "vllm_ttft_s": ttft, "vllm_tpot_s": step, "vllm_metrics": None}


def _arm(prompt_sets, outputs, wall, kv, rss, ttft=0.05, busy=0.1):
    return {"engine": {"load_s": 3.0, "warmup_s": 0.2, "num_blocks": 2047, "block_size": 128},
            "deployment_active": False, "peak_rss_mib": rss, "rss_after_load_mib": rss - 10,
            "workloads": {ps.name: {"wall_s": wall, "kv_blocks_peak": kv, "kv_blocks_per_step": [1, kv, 2, kv // 3],
                                    "kv_decode_steps": [False, False, True, True], "cpu_s": wall, "other_cpus": busy if ps.name == "chat" else 0.0,
                                    "requests": [_request(o, ttft) for o in outputs[ps.name]]}
                          for ps in prompt_sets}}


@pytest.fixture(scope="module")
def result(tok):
    sets = build(tok, ["chat", "code-completion"], n=3, max_tokens=4)
    plain = {"chat": [[10, 11, 12, 13]] * 3, "code-completion": [[20, 21, 22, 23]] * 3}
    graft = {"chat": [[10, 11, 12, 13], [10, 11, 99, 13], [10, 11, 12, 13]],
             "code-completion": [[20, 21, 22, 23]] * 3}
    scores = {}
    for arm, outs in (("plain", plain), ("graft", graft)):
        for name, rows in outs.items():
            for i, row in enumerate(rows):
                scores[f"{arm}/{name}/{i}"] = [0.5] * len(row)
    return bench.assemble(
        deployment="deployments/x.yaml", plan_info={"model": "m", "plugins": ["attention:fancy"], "engine_args": {}},
        settings={"arms": ["plain", "graft"], "workloads": ["chat", "code-completion"], "num_prompts": 3,
                  "max_tokens": 4, "batch": 0, "seed": 0, "ignore_eos": False, "max_model_len": 2048,
                  "perplexity": True, "temperature": 0.0},
        prompt_sets=sets,
        arm_results={"plain": _arm(sets, plain, wall=1.0, kv=6, rss=1000.0),
                     "graft": _arm(sets, graft, wall=0.5, kv=3, rss=900.0, ttft=0.1, busy=1.2)
                     | {"runtime_report": [{"kind": "attention", "name": "fancy", "params": {},
                                            "events": {"forward": 12}, "described": {"k": 1},
                                            "instantiated": True}]}},
        scores=scores, decode=tok.decode, wall_s=12.5)


def test_assemble(result):
    plain, graft = result["arms"]["plain"], result["arms"]["graft"]
    assert plain["workloads"]["chat"]["summary"]["output_tok_s"] == pytest.approx(12.0)
    assert graft["workloads"]["chat"]["summary"]["output_tok_s"] == pytest.approx(24.0)
    assert graft["overall"]["output_tok_s"] == pytest.approx(24 / 1.0)
    assert graft["overall"]["kv_blocks_peak"] == 3 and plain["overall"]["kv_blocks_peak"] == 6
    # the median over the decode steps only (the prefill's peak left out), per workload and overall
    assert graft["workloads"]["chat"]["summary"]["kv_blocks_decode_median"] == 1.5
    assert graft["overall"]["kv_blocks_decode_median"] == 1.5 and plain["overall"]["kv_blocks_decode_median"] == 2
    assert graft["workloads"]["chat"]["summary"]["ttft_mean_s"] == pytest.approx(0.1)
    assert plain["workloads"]["chat"]["summary"]["perplexity"] == pytest.approx(math.exp(0.5))
    cmp = result["comparison"]
    assert (cmp["identical"], cmp["n_identical"], cmp["n"]) == (False, 5, 6)
    chat = cmp["workloads"]["chat"]
    assert [p["first_diff"] for p in chat["prompts"]] == [None, 2, None]
    assert cmp["workloads"]["code-completion"]["identical"] is True
    req = graft["workloads"]["chat"]["requests"][1]
    assert req["output_token_ids"] == [10, 11, 99, 13] and isinstance(req["output_text"], str)
    assert req["prompt_tokens"] > 0 and req["source"].startswith("question")
    assert result["runtime_report"][0]["events"] == {"forward": 12}


def test_json_has_table_and_detail(result):
    data = json.loads(json.dumps(result))
    assert data["schema"] == bench.SCHEMA
    assert set(data["arms"]) == {"plain", "graft"}
    for arm in data["arms"].values():
        for key in ("output_tok_s", "ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p90_s",
                    "kv_blocks_peak", "kv_blocks_decode_median", "peak_rss_mib", "perplexity"):  # every table column
            assert arm["overall"][key] is not None
        assert "token_times_s" in arm["workloads"]["chat"]["requests"][0]
    assert set(data["measurement"]) >= {"ttft", "itl", "kv_blocks", "peak_rss", "perplexity", "identical"}
    assert data["workloads"][0]["fingerprint"] and data["workloads"][0]["prompts"][0]["text"]


def _text(renderable_or_fn):
    console = Console(record=True, width=250, highlight=False)
    if callable(renderable_or_fn):
        renderable_or_fn(console)
    else:
        console.print(renderable_or_fn)
    return console.export_text()


def test_table(result):
    text = _text(bench.render_table(result))
    rows = [line for line in text.splitlines() if "│" in line]
    chat = [r for r in rows if "chat" in r][0]
    cells = [c.strip() for c in chat.split("│")[1:-1]]
    assert cells[:3] == ["chat", "plain", "12.0"]
    assert cells[-1] == "reference"
    assert "2/3 no (#1@2)" in text
    assert "3/3 yes" in text and "5/6 no" in text  # code-completion, then all workloads
    assert "+100.0%" in text  # tokens/s doubled
    assert "-50.0%" in text  # KV blocks halved
    assert "attention:fancy" in text and "all" in text
    assert "1.649" in text  # perplexity exp(0.5)


def test_report(result):
    text = _text(lambda c: bench.render_report(result, c))
    assert "differ for 1 of 6 prompts" in text
    assert "chat #1" in text and "first difference at output token 2 (plain 12, graft 99" in text
    assert "fancy" in text and "forward=12" in text
    assert "How measured" in text
    # the graft arm's chat run shared the machine with 1.2 busy CPUs: flagged, nothing else
    assert "other processes used CPUs during the timed runs (graft chat 1.2 CPUs" in text


def test_system_busy_time_grows():
    import time

    a = bench.arm._system_busy_s()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.2:
        pass
    b = bench.arm._system_busy_s()
    assert a is not None and b - a >= 0.1  # this busy loop alone used 0.2 CPU seconds


def test_single_arm_table(tok):
    sets = build(tok, ["chat"], n=2, max_tokens=4)
    r = bench.assemble(deployment="d.yaml", plan_info={"plugins": []},
                       settings={"num_prompts": 2, "max_tokens": 4}, prompt_sets=sets,
                       arm_results={"graft": _arm(sets, {"chat": [[1, 2], [3]]}, 1.0, 2, 500.0)},
                       scores=None, decode=tok.decode, wall_s=1.0)
    assert r["comparison"] is None
    text = _text(bench.render_table(r))
    assert "change" not in text and "plain" not in text and "graft" in text
    assert r["arms"]["graft"]["overall"]["perplexity"] is None


def test_plot(result, tmp_path):
    path = tmp_path / "b.png"
    bench.write_plot(result, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    h, w = matplotlib.image.imread(str(path)).shape[:2]
    assert (w, h) == (1500, 800)


# ----------------------------------------------------------------- command line refusals
@pytest.fixture
def no_engine(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(bench.command, "ArmProcess", fail)


def test_bad_deployment_exits_1_before_any_engine(tmp_path, capsys, no_engine):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {MODEL}\nplatfrom: cpu\nkvcompress: {{plugin: noopp}}\n")
    assert main(["bench", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "2 problems" in err and "no engine started" in err
    assert "platfrom" in err and "noopp" in err
    assert main(["bench", str(tmp_path / "missing.yaml")]) == 1
    assert "file not found" in capsys.readouterr().err


def test_bad_deployment_never_imports_vllm(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: nowhere\nplatfrom: cpu\n")
    code = ("import sys; from vllm_graft.cli.main import main\n"
            f"rc = main(['bench', {str(bad)!r}])\n"
            "print(rc, sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "1 []", out.stderr


def test_unknown_workload_lists_names(capsys, no_engine):
    assert main(["bench", str(PLAIN), "--workload", "chat", "--workload", "chatt"]) == 2
    err = capsys.readouterr().err
    assert "unknown workload 'chatt' (did you mean 'chat'?)" in err
    assert "accepted: chat, shared-prefix, long-context, code-completion" in err


def test_bad_arms_and_sizes(capsys, no_engine):
    assert main(["bench", str(PLAIN), "--arms", "plain,grafted"]) == 2
    assert "unknown arm 'grafted'" in capsys.readouterr().err
    assert main(["bench", str(PLAIN), "--num-prompts", "0"]) == 2
    assert main(["bench", str(PLAIN), "--max-tokens", "5000"]) == 2
    assert "max_tokens must be between 1 and 2046" in capsys.readouterr().err
    assert main(["bench"]) == 2


def test_list_workloads(capsys, no_engine):
    assert main(["bench", "--list-workloads"]) == 0
    out = capsys.readouterr().out
    for name in W.WORKLOADS:
        assert name in out
    assert "standard library" in out


class FakeArm:
    """Stands in for ArmProcess: records every call in ``log``; its runs take ``walls[arm][r]``."""

    def __init__(self, job, log, walls=None):
        self.job, self.log, self.walls = job, log, walls or {}
        self.rounds = []
        log.append(("start", job["arm"], bool(job["workloads"])))

    def wait_ready(self):
        self.log.append(("ready", self.job["arm"]))

    def run_round(self, r):
        self.log.append(("run", self.job["arm"], r))
        self.rounds.append(r)

    def begin_round(self, r):  # --interleave step: both arms' rounds begun, then waited for
        self.run_round(r)

    def round_done(self):
        return True

    def finish(self, score=None):
        self.log.append(("finish", self.job["arm"], sorted(score or {})))
        walls = self.walls.get(self.job["arm"], [1.0] * len(self.rounds))
        ws = {}
        for w in self.job["workloads"]:
            runs = [{"wall_s": walls[r], "kv_blocks_peak": 1, "kv_blocks_per_step": [1], "other_cpus": 0.0,
                     "requests": [_request([5, 6]) for _ in w["prompts"]]} for r in self.rounds]
            ws[w["name"]] = bench.median_run(runs)
        out = {"engine": {"num_blocks": 10, "block_size": 128, "load_s": 1.0}, "peak_rss_mib": 1.0,
               "rss_after_load_mib": 1.0, "workloads": ws, "runtime_report": []}
        keys = list(score or {}) + ([f"{self.job['arm']}/{n}/{i}" for n, w in ws.items()
                                     for i in range(len(w["requests"]))] if self.job["score_own"] else [])
        if keys:
            out["scores"] = {k: [1.0, 1.0] for k in keys}
        return out

    def close(self):
        self.log.append(("close", self.job["arm"]))


@pytest.fixture
def fake_arms(monkeypatch):
    log, jobs, walls = [], [], {}

    def make(job, workdir, on_event, timeout=None, turn=None):
        jobs.append({**job, "turn_side": None if turn is None else turn.me})
        on_event(job["arm"], "phase", "done")
        return FakeArm(job, log, walls)

    monkeypatch.setattr(bench.command, "ArmProcess", make)
    return log, jobs, walls


def test_arm_jobs_differ_only_in_the_deployment(tmp_path, fake_arms, capsys):
    """The jobs the two arms get: same prompts and engine arguments; the graft arm alone
    carries the deployment; plain finishes second and scores both arms' outputs."""
    log, jobs, _ = fake_arms
    noop = ROOT / "deployments" / "noop.yaml"
    path = tmp_path / "r.json"
    rc = main(["bench", str(noop), "--workload", "chat", "--num-prompts", "2", "--max-tokens", "4",
               "--json", str(path)])
    assert rc == 0, capsys.readouterr()
    graft, plain, plain_again, graft_again = jobs  # --pairs 2 (default): a second pair, loaded plain first
    assert (graft["arm"], plain["arm"], plain_again["arm"], graft_again["arm"]) == ("graft", "plain", "plain", "graft")
    assert not plain_again["score_own"] and plain_again["llm_kwargs"] == plain["llm_kwargs"]
    assert graft_again["llm_kwargs"] == graft["llm_kwargs"]
    assert graft["workloads"] == plain["workloads"]
    assert "graft" in graft["llm_kwargs"]["additional_config"]
    assert "additional_config" not in plain["llm_kwargs"]
    from vllm_graft.launch.engine import SHARED_ENGINE_KEYS

    common = {k: v for k, v in graft["llm_kwargs"].items() if k != "additional_config"}
    assert {k: plain["llm_kwargs"].get(k) for k in common} == common
    # the plain twin may add execution-mode arguments the adapters set inside the graft engine
    assert set(plain["llm_kwargs"]) - set(common) <= set(SHARED_ENGINE_KEYS)
    assert plain["llm_kwargs"]["disable_log_stats"] is False
    assert plain["score_own"] and not graft["score_own"]
    assert ("finish", "plain", ["graft/chat/0", "graft/chat/1"]) in log
    data = json.loads(path.read_text())
    assert data["comparison"]["identical"] is True
    assert data["arms"]["graft"]["overall"]["perplexity"] == pytest.approx(math.e)
    assert data["settings"]["pairs"] == 2 and len(data["comparison"]["ratio"]["runs"]) == 2
    assert data["settings"]["order"] == [["graft", "plain"], ["plain", "graft"]]  # one round in each pair

    jobs.clear()
    log.clear()
    assert main(["bench", str(noop), "--workload", "chat", "--num-prompts", "2", "--arms", "graft"]) == 0
    assert [(j["arm"], bool(j["workloads"])) for j in jobs] == [("graft", True), ("plain", False)]  # scorer
    jobs.clear()
    assert main(["bench", str(noop), "--workload", "chat", "--num-prompts", "2", "--pairs", "1"]) == 0
    assert [j["arm"] for j in jobs] == ["graft", "plain"]
    assert log[-1] == ("finish", "plain", ["graft/chat/0", "graft/chat/1"])
    jobs.clear()
    assert main(["bench", str(noop), "--workload", "chat", "--num-prompts", "2", "--pairs", "3", "--repeat", "2",
                 "--json", str(path)]) == 0
    assert [j["arm"] for j in jobs] == ["graft", "plain", "plain", "graft", "graft", "plain"]  # loads alternate
    ratio = json.loads(path.read_text())["comparison"]["ratio"]
    assert len(ratio["runs"]) == 6 and len(ratio["by_pair"]) == 3  # each pair's own median beside the pooled one
    assert main(["bench", str(noop), "--workload", "chat", "--pairs", "0"]) == 2
    assert "--pairs must be at least 1" in " ".join(capsys.readouterr().err.split())
    jobs.clear()
    assert main(["bench", str(noop), "--workload", "chat", "--num-prompts", "2", "--arms", "graft",
                 "--no-ppl"]) == 0
    assert [j["arm"] for j in jobs] == ["graft"]


def test_baseline_decides_what_the_plain_arm_runs(tmp_path, fake_arms, capsys):
    """--baseline FILE: the plain arm runs that file's plain twin (here vLLM's own ngram
    speculation against plain vLLM); --baseline no-package: the deployment's twin with vLLM's
    plugin loader told to skip vllm-graft; a baseline on another model is refused."""
    _, jobs, _ = fake_arms
    ngram, plain = ROOT / "deployments" / "spec-vllm-ngram.yaml", ROOT / "deployments" / "plain.yaml"
    # run by run: the arms' env then carries nothing of step mode's (STEP_SPIN), only the baseline's
    args = ["--workload", "chat", "--num-prompts", "2", "--max-tokens", "4", "--no-ppl", "--interleave", "run"]
    assert main(["bench", str(ngram), "--baseline", str(plain), *args]) == 0, capsys.readouterr()
    by_arm = {j["arm"]: j for j in jobs}
    assert "speculative_config" in by_arm["graft"]["llm_kwargs"]
    assert "speculative_config" not in by_arm["plain"]["llm_kwargs"]
    assert by_arm["plain"]["env"] == {} == by_arm["graft"]["env"]

    jobs.clear()
    assert main(["bench", str(ROOT / "deployments" / "noop.yaml"), "--baseline", "no-package", *args]) == 0
    by_arm = {j["arm"]: j for j in jobs}
    allowed = by_arm["plain"]["env"]["VLLM_PLUGINS"].split(",")
    assert "vllm_graft" not in allowed and by_arm["graft"]["env"] == {}
    assert by_arm["plain"]["llm_kwargs"]["model"] == by_arm["graft"]["llm_kwargs"]["model"]

    jobs.clear()
    capsys.readouterr()
    other = tmp_path / "other.yaml"
    other.write_text(f"model: {ROOT / 'models' / 'graft-tiny-mixtral'}\n")
    assert main(["bench", str(plain), "--baseline", str(other), *args]) == 2
    assert "the baseline must run the same model" in capsys.readouterr().err and not jobs
    short = tmp_path / "short.yaml"
    short.write_text(f"model: {ROOT / 'models' / 'graft-tiny-llama'}\nengine: {{max_model_len: 512}}\n")
    assert main(["bench", str(plain), "--baseline", str(short), *args]) == 2
    assert "allows 512 tokens" in capsys.readouterr().err and not jobs


def test_baseline_as_is_runs_the_other_deployment_with_its_plugins(tmp_path, fake_arms, capsys):
    """--baseline OTHER.yaml --baseline-as-is: the plain arm runs OTHER.yaml with its plugins
    (two deployments side by side); neither arm scores, a plain engine (OTHER's twin) scores
    both arms' outputs; without a baseline file the flag is refused."""
    log, jobs, _ = fake_arms
    kv4 = ROOT / "deployments" / "kvcompress-kv4.yaml"
    streaming = ROOT / "deployments" / "kvcompress-kv4-streaming.yaml"
    path = tmp_path / "r.json"
    args = ["--workload", "chat", "--num-prompts", "2", "--max-tokens", "4", "--json", str(path)]
    assert main(["bench", str(streaming), "--baseline", str(kv4), "--baseline-as-is", *args]) == 0, capsys.readouterr()
    by_arm = {(j["arm"], bool(j["workloads"])): j for j in jobs}
    graft, baseline, scorer = by_arm[("graft", True)], by_arm[("plain", True)], by_arm[("plain", False)]
    assert "graft" in graft["llm_kwargs"]["additional_config"]
    assert "streaming" not in json.dumps(baseline["llm_kwargs"]["additional_config"])  # kv4 alone, as is
    assert "kv4" in json.dumps(baseline["llm_kwargs"]["additional_config"]) and baseline["report_plugins"]
    assert "additional_config" not in scorer["llm_kwargs"] and not scorer["report_plugins"]
    assert not baseline["score_own"] and not graft["score_own"] and not scorer["score_own"]
    assert ("finish", "plain", ["graft/chat/0", "graft/chat/1", "plain/chat/0", "plain/chat/1"]) in log
    data = json.loads(path.read_text())
    assert data["settings"]["baseline_as_is"] is True
    assert data["arms"]["plain"]["overall"]["perplexity"] == pytest.approx(math.e)
    capsys.readouterr()
    jobs.clear()
    assert main(["bench", str(streaming), "--baseline-as-is", *args]) == 2
    assert "--baseline-as-is needs --baseline" in capsys.readouterr().err and not jobs


def test_the_arm_applies_its_environment_before_vllm(monkeypatch):
    """The no-package baseline works only if VLLM_PLUGINS is set in the arm's process before
    vLLM reads it: _arm_run sets the job's env first thing (then fails here on purpose, at the
    first vLLM import, which the test replaces)."""
    import builtins
    import os

    from vllm_graft.tools.bench import arm

    seen = {}
    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "vllm":
            seen["VLLM_PLUGINS"] = os.environ.get("VLLM_PLUGINS")
            raise ImportError("stop here")
        return real_import(name, *a, **kw)

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="stop here"):
        arm._arm_run({"env": {"VLLM_PLUGINS": "lora_filesystem_resolver"}, "arm": "plain"},
                     lambda *a: None, lambda: ("finish", None))
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert seen == {"VLLM_PLUGINS": "lora_filesystem_resolver"}
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)


# ------------------------------------------------------------ alternating repeats, statistics
def test_arm_order_alternates():
    assert bench.arm_order(["graft", "plain"], 1) == [["graft", "plain"]]
    assert bench.arm_order(["graft", "plain"], 4) == [["graft", "plain"], ["plain", "graft"],
                                                      ["graft", "plain"], ["plain", "graft"]]
    assert bench.arm_order(["graft"], 3) == [["graft"]] * 3
    with pytest.raises(ValueError, match="at least 1"):
        bench.arm_order(["graft", "plain"], 0)


def test_repeats_take_turns_and_each_engine_loads_once(tmp_path, fake_arms, capsys):
    log, jobs, walls = fake_arms
    walls.update(plain=[2.0, 1.0, 4.0], graft=[1.0, 1.0, 1.0])  # per run: 12/wall tokens/s
    path = tmp_path / "r.json"
    assert main(["bench", str(ROOT / "deployments" / "noop.yaml"), "--workload", "chat", "--num-prompts", "3",
                 "--max-tokens", "4", "--repeat", "3", "--pairs", "1", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    steps = [e for e in log if e[0] in ("start", "ready", "run", "finish")]
    assert steps == [
        ("start", "graft", True), ("ready", "graft"), ("start", "plain", True), ("ready", "plain"),
        ("run", "graft", 0), ("run", "plain", 0),
        ("run", "plain", 1), ("run", "graft", 1),
        ("run", "graft", 2), ("run", "plain", 2),
        ("finish", "graft", []), ("finish", "plain", ["graft/chat/0", "graft/chat/1", "graft/chat/2"])]
    data = json.loads(path.read_text())
    assert data["settings"]["order"] == [["graft", "plain"], ["plain", "graft"], ["graft", "plain"]]
    plain = data["arms"]["plain"]["workloads"]["chat"]["summary"]
    assert plain["output_tok_s_runs"] == [3.0, 6.0, 1.5]  # 6 tokens per run, in run order
    assert plain["output_tok_s"] == 3.0 and (plain["output_tok_s_min"], plain["output_tok_s_max"]) == (1.5, 6.0)
    ratio = data["comparison"]["ratio"]
    assert ratio["ratio"] == pytest.approx(2.0)  # graft 6.0 / plain's median 3.0
    assert ratio["runs"] == pytest.approx([2.0, 1.0, 4.0]) and (ratio["min"], ratio["max"]) == (1.0, 4.0)
    assert "arms alternating: graft plain, plain graft, graft plain" in " ".join(text.split())
    assert "median of the 3 paired runs' ratios, range 1.000-4.000" in " ".join(text.split())


def test_median_spread_and_ratio():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4.0, 1.0, 2.0, 3.0]) == 2.5  # even count: the mean of the middle two
    assert bench.median([]) is None
    assert bench.spread([2.0, None, 5.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 5.0, "n": 3}
    assert bench.spread([]) == {"median": None, "min": None, "max": None, "n": 0}
    assert bench.paired_ratios([2.0, 4.0], [1.0, 8.0]) == [0.5, 2.0]
    with pytest.raises(ValueError):
        bench.paired_ratios([1.0], [1.0, 2.0])
    r = bench.ratio_of([100.0, 110.0, 90.0], [95.0, 99.0, 90.0])
    assert r["ratio"] == pytest.approx(95.0 / 100.0)
    assert (r["min"], r["max"]) == (pytest.approx(0.9), pytest.approx(1.0))
    assert bench.ratio_of([], [1.0]) is None and bench.ratio_of([0.0], [1.0]) is None
    assert bench.ratio_of([2.0], [3.0])["ratio"] == 1.5
    # the paired median, not the ratio of the medians: runs seconds apart share the machine's phase
    drift = bench.ratio_of([10.0, 40.0, 20.0], [11.0, 20.0, 44.0])
    assert drift["ratio"] == pytest.approx(1.1) and drift["of_medians"] == pytest.approx(1.0)
    # --pairs: the runs are the pairs' rounds one pair after the other
    assert bench.by_pair([1.0, 1.2, 0.9, 0.95, 1.1, 1.3], 3) == [pytest.approx(1.1), pytest.approx(0.925), pytest.approx(1.2)]
    assert bench.by_pair([1.0], 2) == []
    assert bench.ratio_of([10.0, 20.0], [30.0])["ratio"] == pytest.approx(30.0 / 15.0)  # unpaired: medians


def test_an_arm_failing_mid_run_closes_the_other(tmp_path, monkeypatch, capsys):
    log = []

    class Failing(FakeArm):
        def run_round(self, r):
            super().run_round(r)
            if self.job["arm"] == "plain" and r == 1:
                raise bench.ArmFailed("plain", "boom", str(tmp_path / "none.log"))

    monkeypatch.setattr(bench.command, "ArmProcess", lambda job, *a, **k: Failing(job, log))
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "2", "--repeat", "3"]) == 4
    assert "the plain arm failed" in capsys.readouterr().err
    assert ("close", "graft") in log and ("close", "plain") in log
    assert not any(e[0] == "finish" for e in log)


def test_median_run_and_repeat_rendering(tok):
    def run(wall, ids):
        return {"wall_s": wall, "kv_blocks_peak": 3, "kv_blocks_per_step": [3],
                "requests": [_request(ids)]}

    m = bench.median_run([run(3.0, [1, 2]), run(1.0, [1, 2]), run(2.0, [1, 2])])
    assert (m["wall_s"], m["repeat_index"], m["repeats_identical"]) == (2.0, 2, True)
    assert [r["wall_s"] for r in m["repeats"]] == [3.0, 1.0, 2.0]
    assert bench.median_run([run(1.0, [1]), run(2.0, [2])])["repeats_identical"] is False

    sets = build(tok, ["chat"], n=1, max_tokens=4)
    w = bench.median_run([run(4.0, [1, 2, 3, 4]), run(1.0, [1, 2, 3, 4]), run(2.0, [1, 2, 3, 4])])
    arm = {"engine": {"num_blocks": 9}, "peak_rss_mib": 1.0, "rss_after_load_mib": 1.0,
           "workloads": {"chat": w}}
    r = bench.assemble(deployment="d.yaml", plan_info={"plugins": []},
                       settings={"num_prompts": 1, "max_tokens": 4, "repeat": 3}, prompt_sets=sets,
                       arm_results={"plain": arm, "graft": arm}, scores=None, decode=tok.decode, wall_s=1.0)
    summary = r["arms"]["plain"]["workloads"]["chat"]["summary"]
    assert summary["output_tok_s"] == 2.0 and summary["runs"] == 3
    assert summary["output_tok_s_runs"] == [1.0, 4.0, 2.0]
    text = _text(bench.render_table(r))
    assert "median of 3 runs" in text and "(min-max)" in text and "1.0-4.0" in text
    assert "(min-max)" not in _text(bench.render_table(r | {"settings": {**r["settings"], "repeat": 1}}))


def test_kv_sampler_flags_decode_steps():
    from types import SimpleNamespace as NS

    from vllm_graft.tools.bench.arm import _KVSampler

    reqs = {"a": NS(num_computed_tokens=10, num_prompt_tokens=10),  # its prompt's last chunk: not decoding
            "b": NS(num_computed_tokens=11, num_prompt_tokens=10)}
    pool = NS(num_gpu_blocks=9, get_num_free_blocks=lambda: 4)
    sampler = _KVSampler(pool, NS(requests=reqs))
    outs = iter([NS(num_scheduled_tokens={"a": 2, "b": 1}), NS(num_scheduled_tokens={"b": 1}),
                 NS(num_scheduled_tokens={})])
    schedule = sampler.wrap(lambda: next(outs))
    for _ in range(3):
        schedule()
    assert sampler.steps == [4, 4, 4] and sampler.decode == [False, True, False]


def test_gemm_rows_to_warm_cover_a_decode_step_within_the_primitive_cache():
    from vllm_graft.tools.bench.arm import gemm_rows_to_warm

    # batch 32 with 4 drafts a request: up to 160 tokens a step, 5 shapes fit 163 row counts
    assert gemm_rows_to_warm(32, 4, shapes=5, capacity=1024) == 160
    assert gemm_rows_to_warm(8, 0, shapes=5, capacity=1024) == 8  # plain: one token a request
    assert gemm_rows_to_warm(256, 4, shapes=5, capacity=1024) == 163  # capped by the cache
    assert gemm_rows_to_warm(256, 4, shapes=5, capacity=4096) == 655
    assert gemm_rows_to_warm(32, 4, shapes=0, capacity=1024) == 0  # nothing dispatched to oneDNN


def test_warm_gemm_shapes_runs_each_distinct_linear_shape_at_every_row_count(monkeypatch):
    import torch

    from vllm_graft.tools.bench.arm import _warm_gemm_shapes

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)

    class Linear(torch.nn.Module):
        def __init__(self, k, n, calls):
            super().__init__()
            self.input_size_per_partition, self.output_size_per_partition = k, n
            self.params_dtype, self.bias, self.weight = torch.float32, None, torch.nn.Parameter(torch.empty(0))
            self.cpu_linear = lambda x, weight, bias: calls.append((k, n, x.shape[0])) or x.new_zeros(x.shape[0], n)

    class Head(torch.nn.Module):  # vLLM's ParallelLMHead names its sizes so
        def __init__(self, calls):
            super().__init__()
            self.embedding_dim, self.num_embeddings_per_partition, self.bias = 16, 64, None
            self.cpu_linear = lambda x, weight, bias: calls.append((16, 64, x.shape[0])) or x.new_zeros(x.shape[0], 64)

    calls: list = []
    model = torch.nn.Sequential(
        Linear(16, 48, calls), Linear(16, 16, calls), Linear(16, 48, calls), torch.nn.ReLU(), Head(calls)
    )
    worker = type("W", (), {"model_runner": type("R", (), {"model": model})()})()
    done = _warm_gemm_shapes(worker, 4, 2)  # 4 requests x (1 + 2 drafts) = 12 tokens at most
    assert (done["shapes"], done["rows"]) == (3, 12)  # the second 16x48 layer shares the first's shape
    assert sorted(calls) == sorted((k, n, r) for k, n in ((16, 48), (16, 16), (16, 64)) for r in range(1, 13))
    # off the CPU engine no layer has cpu_linear: nothing is run
    calls.clear()
    bare = type("W", (), {"model_runner": type("R", (), {"model": torch.nn.Linear(4, 4)})()})()
    assert _warm_gemm_shapes(bare, 32, 4)["shapes"] == 0 and not calls


@pytest.mark.parametrize("flags, isa", [
    ("fpu avx2 avx512f avx512bw amx_tile amx_bf16", "AMX + AVX-512"),
    ("fpu avx2 avx512f avx512vl", "AVX-512"),
    ("fpu sse4_2 avx2 fma", "AVX2"),
    ("fpu sse4_2", "no AVX2"),
])
def test_the_cpu_isa_is_read_from_the_flags(flags, isa):
    from vllm_graft.tools.bench.stats import cpu_isa

    text = f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert cpu_isa(text) == isa
    assert cpu_isa("") == "unknown"


def test_two_pairs_of_arm_processes_pool_their_runs():
    from vllm_graft.tools.bench.command import pool_runs

    def raw(walls, tokens):
        return {"engine": {"num_blocks": 8}, "workloads": {"chat": {
            "requests": [{"output_token_ids": tokens}], "repeats_identical": True,
            "repeats": [{"wall_s": w, "output_tokens": 4} for w in walls]}}}

    pooled = pool_runs({"graft": raw([1, 2], [5, 6])}, {"graft": raw([3], [5, 6])})
    w = pooled["graft"]["workloads"]["chat"]
    assert [r["wall_s"] for r in w["repeats"]] == [1, 2, 3] and w["repeats_identical"]
    assert pooled["graft"]["engine"] == {"num_blocks": 8}
    differs = pool_runs({"graft": raw([1], [5, 6])}, {"graft": raw([1], [5, 7])})
    assert differs["graft"]["workloads"]["chat"]["repeats_identical"] is False


@pytest.mark.parametrize(
    "bind, env",
    [(None, {}), ("nobind", {}), ("0", {"OMP_NUM_THREADS": "1"}), ("0,1", {"OMP_NUM_THREADS": "2"})],
)
def test_the_arms_threads_are_torchs_unless_vllms_binding_is_asked_for(monkeypatch, tmp_path, fake_arms, bind, env):
    """Unset, the arms keep torch's threads; VLLM_CPU_OMP_THREADS_BIND gives them as many as
    vLLM's own CPU worker would get (its OMPProcessManager asked), never its placement, through
    each arm job's environment (applied before vLLM loads); the line the result records says
    which, and the parent's own environment is left as it was."""
    from vllm_graft.integration.env import cpu_worker_threads

    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    got, line = cpu_worker_threads()
    assert got == env
    assert ("torch's default threads" in line) == (not env)
    assert "OMP_PLACES" not in got and "OMP_PROC_BIND" not in got
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    _, jobs, _ = fake_arms
    path = tmp_path / "r.json"
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "1", "--max-tokens", "2",
                 "--no-ppl", "--json", str(path)]) == 0
    assert jobs and all(job["env"].get("OMP_NUM_THREADS") == env.get("OMP_NUM_THREADS") for job in jobs)
    assert json.loads(path.read_text())["environment"]["threads"] == line
    assert os.environ["OMP_NUM_THREADS"] == "7"  # the parent's own value stays


def test_interleave_step_gives_each_pair_of_arms_one_baton(monkeypatch, tmp_path, fake_arms, capsys):
    """--interleave step: each pair of generating arms gets its sides of one baton (side 0 the
    arm loaded first, which is the first round's first), the scorer none; GNU's and Intel's
    OpenMP idle threads told not to spin through the other arm's turn unless the user set it; the
    result says step. It takes exactly two arms."""
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    log, jobs, _ = fake_arms
    path = tmp_path / "r.json"
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "1", "--max-tokens", "2",
                 "--repeat", "2", "--interleave", "step", "--json", str(path)]) == 0, capsys.readouterr()
    generating = [(j["arm"], j["turn_side"]) for j in jobs if j["workloads"]]
    assert generating == [("graft", 0), ("plain", 1), ("plain", 0), ("graft", 1)]  # two pairs, loaded both ways
    assert all(j["env"]["KMP_BLOCKTIME"] == "0" and j["env"]["GOMP_SPINCOUNT"] == "10000" for j in jobs)
    data = json.loads(path.read_text())
    assert data["settings"]["interleave"] == "step"
    assert {k: data["environment"]["threads_env"][k] for k in STEP_SPIN} == STEP_SPIN
    runs = [e for e in log if e[0] == "run"]
    assert len(runs) == 8  # 2 rounds x 2 arms x 2 pairs, every round begun by both arms

    jobs.clear()
    monkeypatch.setenv("KMP_BLOCKTIME", "5")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "1", "--max-tokens", "2",
                 "--no-ppl", "--interleave", "step", "--pairs", "1"]) == 0
    assert [(j["env"]["KMP_BLOCKTIME"], j["env"]["GOMP_SPINCOUNT"]) for j in jobs] == [("5", "7"), ("5", "7")]

    jobs.clear()
    capsys.readouterr()
    assert main(["bench", str(PLAIN), "--workload", "chat", "--arms", "graft", "--interleave", "step"]) == 2
    assert "--interleave step runs two arms" in capsys.readouterr().err and not jobs
    # the default: step with two arms, run with one (the scorer is no arm of the rounds)
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "1", "--no-ppl", "--pairs", "1",
                 "--json", str(path)]) == 0
    assert [j["turn_side"] for j in jobs] == [0, 1] and json.loads(path.read_text())["settings"]["interleave"] == "step"
    jobs.clear()
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "1", "--arms", "graft",
                 "--json", str(path)]) == 0
    assert [j["turn_side"] for j in jobs] == [None, None] and json.loads(path.read_text())["settings"]["interleave"] == "run"
    jobs.clear()
    assert main(["bench", str(PLAIN), "--workload", "chat", "--num-prompts", "1", "--no-ppl", "--pairs", "1",
                 "--interleave", "run"]) == 0
    assert [j["turn_side"] for j in jobs] == [None, None]
