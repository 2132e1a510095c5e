"""`vllm-graft serve` killed outright takes vLLM's engine core with it (issue 64: after `kill -9`
of vLLM's API server mid-load its EngineCore child kept running until killed by hand).

The launcher sets GRAFT_DIE_WITH_PARENT=1, and the bridge, loaded by vLLM in each of its
processes, asks the kernel for a SIGTERM to each child process when its parent ends
(integration/lifetime.py). Plain vLLM without the variable leaves the child running, as
tests/unit/test_lifetime.py shows on a stand-in."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
pytest.importorskip("vllm")

from .servers import REPO, free_port, server_env, wait_healthy  # noqa: E402

pytestmark = pytest.mark.e2e


def test_serve_killed_outright_takes_its_engine_core_with_it(tmp_path):
    port = free_port()
    env = {k: v for k, v in server_env().items() if k != "GRAFT_DIE_WITH_PARENT"}  # the launcher's to set
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_graft.cli.main", "serve",
                                 str(REPO / "deployments" / "spec-lookahead.yaml"), "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    children: list = []
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)
        children = psutil.Process(proc.pid).children(recursive=True)  # serve exec'd vLLM's server
        cores = [c for c in children if "EngineCore" in " ".join(c.cmdline()) + c.name()]
        assert cores, [(c.pid, c.name()) for c in children]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], (
            [(c.pid, c.name()) for c in alive], log_path.read_text()[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
