"""`vllm-graft servebench` through vLLM's own OpenAI server, short form: plain vLLM and
deployments/spec-lookahead.yaml (lossless) on the bundled tiny model, 2 request rates x 3
code-completion requests of 8 tokens (two server starts: about 1.5-2 minutes on 2 cores with
vLLM's compile cache warm). The realistic form is `make servebench`.

Asserted from the command's JSON: both arms served every request of both rates with exactly
the requested tokens, at the same scheduled times and with the same KV pool; each figure follows
from the records (goodput = requests within the SLO / duration, the ratio to plain); the
lossless arm's greedy texts equal plain's; exit status 0 and a table printed. The arithmetic
and each failure path are in tests/unit/test_servebench.py.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from .servers import REPO, clean_env, graft_cli  # noqa: E402

pytestmark = pytest.mark.e2e


# Two server starts (68 s in CI): long form only. CI's tests/e2e/test_report_metrics.py drives
# the same vLLM server with a lossless deployment and reads its metrics; the sweep's arithmetic
# and failure paths are in tests/unit/test_servebench.py.
@pytest.mark.full
def test_short_sweep_plain_vs_a_lossless_deployment(tmp_path):
    out_json = tmp_path / "sweep.json"
    out = graft_cli("servebench", str(REPO / "deployments" / "spec-lookahead.yaml"), "--workload", "code-completion",
                    "--rates", "4,16", "--num-requests", "3", "--max-tokens", "8", "--ignore-eos", "--timeout", "240",
                    "--dir", str(tmp_path), "--out", str(out_json), env=clean_env(VLLM_CPU_KVCACHE_SPACE="1"), timeout=900)
    assert out_json.exists(), f"no result (exit {out.returncode}):\n{out.stderr[-4000:]}"
    r = json.loads(out_json.read_text())
    assert out.returncode == 0, out.stderr[-4000:]
    plain, spec = r["arms"]
    assert (plain["name"], spec["name"]) == ("plain", "spec-lookahead") and spec["lossless"] is True
    assert "error" not in plain and "error" not in spec
    assert plain["kv_blocks"] == spec["kv_blocks"] and plain["kv_blocks"] > 0  # one KV pool for both
    assert len(plain["calibration"]) == 2 and "plain vLLM's median TTFT" in r["slo"]["source"]
    for arm in (plain, spec):
        assert [p["phase"]["key"] for p in arm["phases"]] == ["rate=4", "rate=16"]
    for p_ph, s_ph in zip(plain["phases"], spec["phases"]):
        assert [x["scheduled"] for x in p_ph["records"]] == [x["scheduled"] for x in s_ph["records"]] \
            == r["arrivals"][p_ph["phase"]["key"]]
        for ph in (p_ph, s_ph):
            f = ph["figures"]
            assert f["ok"] == f["requests"] == 3 and not f["failed"]
            assert all(x["output_tokens"] == 8 and x["ttft"] <= x["latency"] for x in ph["records"])
            assert f["output_tokens"] == 24 and f["throughput_tok_s"] == pytest.approx(24 / ph["duration_s"])
            assert f["goodput_rps"] == pytest.approx(f["slo_met"] / ph["duration_s"])
        assert s_ph["vs_plain"]["throughput"] == pytest.approx(
            s_ph["figures"]["throughput_tok_s"] / p_ph["figures"]["throughput_tok_s"])
        assert s_ph["greedy"] == {"compared": 3, "identical": 3, "differ": []}
    assert "spec-lookahead" in out.stdout and "x plain goodput" in out.stdout
