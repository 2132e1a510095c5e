"""The soak suite's short form through vLLM's own OpenAI server: `vllm-graft soak
deployments/noop.yaml --short` (a noop plugin of every kind on the MoE model, lossless), about
a minute and a half on 2 cores with vLLM's compile cache warm. The full form is `make soak`.

Asserted from the command's JSON: every request ended in a response, a 400 for an over-long
prompt or a client abort, in the shares the request mix sent them; vLLM preempted; KV usage
and the running/waiting queues read 0 after the drain; the server answered a last request;
no plugin's per-request table is larger than at the start; every greedy completion equals a
plain server's; exit status 0. What each check does on a bad run is in tests/unit/test_soak.py.
"""
from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from .servers import REPO, clean_env, graft_cli  # noqa: E402

pytestmark = pytest.mark.e2e


def test_short_soak_of_a_lossless_deployment(tmp_path):
    out = graft_cli("soak", str(REPO / "deployments" / "noop.yaml"), "--short", "--json", "--timeout", "240",
                    "--dir", str(tmp_path), env=clean_env(), timeout=900)
    assert out.stdout.strip(), f"no output (exit {out.returncode}):\n{out.stderr[-4000:]}"
    (r,) = json.loads(out.stdout)["runs"]
    assert "error" not in r, r["error"]
    failed = [c for c in r["checks"] if not c["passed"]]
    assert not failed and out.returncode == 0, f"{failed}\n{out.stderr[-3000:]}"
    o = r["outcomes"]
    assert sum(o.values()) == r["requests"] == 93  # 3 x (1 + 2 + 4 + 8 + 16)
    assert o["hung"] == o["error"] == 0
    assert o["rejected"] == r["over_long_sent"] > 0 and o["aborted"] == r["cut_sent"] > 0
    assert r["n_gt_1_sent"] > 0 and 0 < r["greedy_sent"] < r["requests"]
    assert r["preemptions"] > 0
    assert r["drained"] == {**r["drained"], "kv_usage": 0.0, "running": 0.0, "waiting": 0.0}
    assert r["last_request"]["kind"] == "ok" and r["last_request"]["alive"]
    assert all(v <= r["state"]["start"].get(k, 0) for k, v in r["state"]["after_drain"].items())
    assert any(k.startswith("VLLM::EngineCore") for k in r["rss_mb"]["end"])  # the engine core is measured
    g = r["greedy"]
    assert g["verdict"] == "yes" and g["compared"] > 10 and g["differ"] == 0
    # the server and its engine core are gone
    pids = [int(k.rsplit("(", 1)[1].rstrip(")")) for k in r["rss_mb"]["end"]]
    deadline = time.monotonic() + 15  # SIGKILLed children take a moment to go
    while [pid for pid in pids if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its new parent has not reaped
    yet: the soak's server children are reparented when the soak command exits)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
