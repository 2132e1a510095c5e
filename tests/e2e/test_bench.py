"""`vllm-graft bench` for real: both arms on deployments/plain.yaml (no plugins, so both arms
run plain vLLM and must agree), one small workload, through the console script."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS, MAX_TOKENS, BATCH = 3, 8, 2


@pytest.fixture(scope="module", params=[pytest.param("run", marks=pytest.mark.full), "step"])
def run(tmp_path_factory, request):
    """The bench as run (``--interleave run``, the arms alternating runs: the long form, CI runs the
    default alone; unit tests drive both modes with stand-in arms) and with both arms running each
    round at once, taking turns step by step (``--interleave step``)."""
    out = tmp_path_factory.mktemp("bench")
    script = Path(sys.executable).with_name("vllm-graft")  # CI does not activate the venv
    cmd = [str(script), "bench", str(ROOT / "deployments" / "plain.yaml"), "--workload", "code-completion",
           "--num-prompts", str(NUM_PROMPTS), "--max-tokens", str(MAX_TOKENS), "--batch", str(BATCH), "--ignore-eos",
           "--pairs", "1",  # one pair of engines: the figures' definitions (the pooling: test_bench_suite)
           "--interleave", request.param, "--json", str(out / "bench.json"), "--plot", str(out / "bench.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout, out


def test_both_arms_ran_plain_and_agree(run):
    data, _, _ = run
    assert set(data["arms"]) == {"plain", "graft"}
    assert data["plugins"] == [] and data["runtime_report"] == []
    assert [a["deployment_active"] for a in data["arms"].values()] == [False, False]
    cmp = data["comparison"]
    assert cmp["identical"] is True and (cmp["n_identical"], cmp["n"]) == (NUM_PROMPTS, NUM_PROMPTS)
    for p in cmp["workloads"]["code-completion"]["prompts"]:
        assert p["identical"] and p["first_diff"] is None
    plain = data["arms"]["plain"]["workloads"]["code-completion"]["requests"]
    graft = data["arms"]["graft"]["workloads"]["code-completion"]["requests"]
    assert [r["output_token_ids"] for r in plain] == [r["output_token_ids"] for r in graft]


def test_figures_are_measured(run):
    data, _, _ = run
    for arm in ("plain", "graft"):
        a = data["arms"][arm]
        s = a["workloads"]["code-completion"]["summary"]
        assert s["output_tokens"] == NUM_PROMPTS * MAX_TOKENS  # --ignore-eos: fixed lengths
        for key in ("output_tok_s", "ttft_mean_s", "itl_mean_s", "perplexity"):
            assert math.isfinite(s[key]) and s[key] > 0, (arm, key, s[key])
        assert s["output_tok_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        # greedy outputs are the model's likeliest tokens: far below the vocabulary's 4096
        assert 1.0 <= s["perplexity"] < 100
        # a prompt + 8 tokens needs at least one 128-token block per request in flight
        assert BATCH <= s["kv_blocks_peak"] < a["engine"]["num_blocks"]
        assert max(a["workloads"]["code-completion"]["kv_blocks_per_step"]) == s["kv_blocks_peak"]
        assert a["peak_rss_mib"] > 200
        for r in a["workloads"]["code-completion"]["requests"]:
            times = r["token_times_s"]
            assert len(times) == MAX_TOKENS and times == sorted(times) and times[0] == r["ttft_s"] > 0
            assert len(r["itl_s"]) == MAX_TOKENS - 1
            if data["settings"]["interleave"] == "run":
                # vLLM's own per-request stats agree with the bench's clock (same request, same steps);
                # in step mode vLLM's clock also counts the other arm's turns, the bench's does not
                assert r["vllm_ttft_s"] == pytest.approx(r["ttft_s"], abs=0.05)
                assert r["vllm_tpot_s"] == pytest.approx(r["tpot_s"], rel=0.1, abs=0.005)
            assert len(r["nll"]) == MAX_TOKENS
    # --batch 2: two requests start at once, the third when one of them has finished
    for arm in ("plain", "graft"):
        reqs = data["arms"][arm]["workloads"]["code-completion"]["requests"]
        assert reqs[0]["submit_s"] < 0.1 and reqs[1]["submit_s"] < 0.1
        done = min(r["submit_s"] + r["token_times_s"][-1] for r in reqs[:2])
        assert reqs[2]["submit_s"] >= done
    # step: each arm waited through the other's steps, and its clock left them out
    for arm in ("plain", "graft"):
        w = data["arms"][arm]["workloads"]["code-completion"]
        s = w["summary"]
        if data["settings"]["interleave"] == "step":
            assert s["turn_wait_s"] > 0 and s["turn_wait_s_runs"] and all(t > 0 for t in s["turn_wait_s_runs"])
            # between two steps of a request the other arm stepped: vLLM's clock counts that, the bench's not
            assert all(r["vllm_tpot_s"] > r["tpot_s"] for r in w["requests"])
        else:
            assert s["turn_wait_s"] is None and s["turn_wait_s_runs"] == [None]
    # both arms' outputs are the same, so the same perplexity under the same model
    pp = [data["arms"][a]["overall"]["perplexity"] for a in ("plain", "graft")]
    assert pp[0] == pytest.approx(pp[1], rel=1e-6)


def test_table_and_plot(run):
    _, stdout, out = run
    assert "code-completion" in stdout and "reference" in stdout and f"{NUM_PROMPTS}/{NUM_PROMPTS} yes" in stdout
    assert "none enabled by the deployment" in stdout
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
