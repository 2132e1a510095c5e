"""`vllm-graft report` against vLLM's own `/metrics` on the same server run (issue 35): the
speculative counters vLLM also keeps are equal, or the report says why they differ.

One short run of vLLM's OpenAI server with `lookahead`: 20 requests, 4 at a time, of mixed
lengths (greedy, a seeded sampled one, one that runs to max_model_len, where vLLM stops calling
the drafter) and one last request; then the server is stopped at once, as vLLM stops it (SIGTERM,
shutdown_timeout 0), and the report is read from the stopped server's files beside a copy of
/metrics saved before the stop: each process writes its last events at exit.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

from .servers import REPO, free_port, graft_cli, server_env, stop, wait_healthy  # noqa: E402

# It failed in a full CI run, and 1 run in 6 alone (lookahead's events empty): the 20 requests
# took less than one report period, so no file had them yet and all looked long idle; `report`
# now always waits a quiet period from its call (cli/engine_commands.py read_settled_reports;
# tests/unit/test_report_counters.py plants that race).
pytestmark = pytest.mark.e2e

LLAMA = str(REPO / "models" / "graft-tiny-llama")
MAX_MODEL_LEN = 384
CODE = "".join(f"def handler_{i}(event, context):\n    return process(event, {i})\n\n" for i in range(12))


def _report(reports: Path, *extra: str) -> subprocess.CompletedProcess:
    return graft_cli("report", str(reports), *extra, env=server_env(), timeout=60)


def test_report_equals_vllm_metrics_on_the_same_server_run(tmp_path):
    reports = tmp_path / "reports"
    log_path = tmp_path / "server.log"
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", LLAMA, "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "--port", str(port),
            "--additional-config", json.dumps({"graft": {"speculative": {"plugin": "lookahead"}}})]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=server_env(VLLM_GRAFT_REPORT_DIR=str(reports)), stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path)
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        n_prompt = c.completions.create(model="tiny", prompt=CODE, max_tokens=1, temperature=0).usage.prompt_tokens
        jobs = [dict(prompt=CODE[: 60 + 37 * i], max_tokens=8 + 4 * (i % 5), temperature=0,
                     extra_body={"ignore_eos": i % 3 == 0}) for i in range(18)]
        jobs.append(dict(prompt="def main():\n", max_tokens=24, temperature=0.8, seed=7))  # seeded: no drafts
        # runs to max_model_len: vLLM verifies placeholder drafts in its last steps
        jobs.append(dict(prompt=CODE, max_tokens=MAX_MODEL_LEN - n_prompt, temperature=0,
                         extra_body={"ignore_eos": True}))
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda kw: c.completions.create(model="tiny", **kw), jobs))
        assert len(done) == 20 and done[-1].usage.completion_tokens == MAX_MODEL_LEN - n_prompt
        # one more request, then the stop at once: its events are younger than a report period
        # (issue 64: a server stopped so lost the worker's last events, 1136 of 1196 verified)
        c.completions.create(model="tiny", prompt=CODE, max_tokens=40, temperature=0)
        text = httpx.get(base + "/metrics", timeout=10).text
    finally:
        stop(proc)
    saved = tmp_path / "metrics.txt"
    saved.write_text(text)
    metrics = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_total" in line:
            name = line.split("{")[0]
            metrics[name] = metrics.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    # read after the server stopped: the reports and the saved /metrics are all there is
    out = _report(reports, "--json", "--metrics", str(saved))
    assert out.returncode == 0, out.stderr
    summed = json.loads(out.stdout)
    table = _report(reports, "--metrics", str(saved))
    assert summed["settled"] is True  # no process was still counting
    (spec,) = [p for p in summed["plugins"] if p["name"] == "lookahead"]
    ev = spec["events"]
    assert ev.get("verified", 0) > 0 and ev.get("accepted", 0) > 0 and ev.get("seeded_undrafted", 0) > 0, ev
    assert ev["verified_without_propose"] > 0, ev  # the request that reached max_model_len
    drafts = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert spec["vllm_counters"]["spec_decode_num_draft_tokens"] == drafts, (spec, metrics)
    # vLLM's accepted count also has the placeholder drafts (token id 0) its target sampled
    assert ev["accepted"] <= accepted <= ev["accepted"] + ev["verified_without_propose"], (spec, metrics)
    assert summed["metrics"]["vllm:spec_decode_num_draft_tokens_total"] == drafts
    assert ev["drafted"] > ev["verified"]  # drafts for requests that ended were never verified
    assert table.returncode == 0, table.stderr
    assert "spec_decode_num_draft_tokens; /metrics: " in table.stdout and ", equal" in table.stdout, table.stdout
    assert "never verified" in table.stdout and "seeded sampled requests" in table.stdout, table.stdout
