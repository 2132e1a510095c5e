"""What the tests that start vLLM's OpenAI server (or a `vllm-graft` command that does) share: a
free loopback port; the environment (no VLLM_GRAFT_* variable an earlier in-process engine of
the same pytest run exported; for a server, a 1 GiB CPU KV cache and vLLM's multiprocess
engine); waiting for the server's /health and stopping it; running `vllm-graft` in a child."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_graft.tools.soak.server import free_port

__all__ = ["REPO", "clean_env", "free_port", "graft_cli", "server_env", "stop", "wait_healthy"]

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without its VLLM_GRAFT_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    env.update(extra)
    return env


def server_env(**extra: str) -> dict[str, str]:
    return clean_env(**{"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **extra})


def graft_cli(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`vllm-graft ARGS` in a child process of this interpreter, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "vllm_graft.cli.main", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, seconds: float = 300) -> None:
    """Until the server at ``base`` answers /health with 200; the test fails, with the end of
    its log, if it exits first or has not answered in ``seconds`` (the caller stops it)."""
    import httpx

    deadline = time.time() + seconds
    while True:
        if proc.poll() is not None:
            pytest.fail("the server exited while starting:\n" + log_path.read_text()[-4000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            pytest.fail(f"the server did not come up in {seconds:.0f} s:\n" + log_path.read_text()[-4000:])
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited 30 s later."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
