"""Processes that die with their parent (issue 64: after `kill -9` of vLLM's API server its
EngineCore child kept running). No vLLM here: a parent killed outright, and what becomes of the
child it started the way vLLM starts its engine core (a multiprocessing child that calls
`die_with_parent`, as the bridge does where vLLM loads it) or the way the soak starts a server
(`preexec_fn=set_parent_death_signal`). tests/e2e/test_lifetime.py does it to vLLM's server."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys, time
    from vllm_graft.integration.lifetime import die_with_parent, set_parent_death_signal

    def child():
        die_with_parent()
        time.sleep(120)

    if __name__ == "__main__":
        if sys.argv[1] == "multiprocessing":
            p = multiprocessing.get_context("fork").Process(target=child, name="EngineCore")
            p.start()
            pid = p.pid
        else:
            pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                   preexec_fn=set_parent_death_signal, start_new_session=True).pid
        print(pid, flush=True)
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _orphan_after_kill9(how: str, env: dict[str, str]) -> bool:
    """Start the parent, kill -9 it once its child runs; True if the child outlived it by 10 s."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the child has asked for its signal
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphan = _alive(child)
        if orphan:
            os.kill(child, signal.SIGKILL)
        return orphan
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_vllm_child_process_ends_with_its_parent_when_the_launcher_asks():
    env = {**os.environ, "GRAFT_DIE_WITH_PARENT": "1"}
    assert not _orphan_after_kill9("multiprocessing", env)


def test_without_the_variable_a_child_outlives_a_parent_killed_outright():
    # what vLLM does on its own (the failure the variable is for): the test can tell
    env = {k: v for k, v in os.environ.items() if k != "GRAFT_DIE_WITH_PARENT"}
    assert _orphan_after_kill9("multiprocessing", env)


def test_a_launched_server_ends_with_its_launcher():
    assert not _orphan_after_kill9("popen", dict(os.environ))


def test_launchers_ask_for_it_unless_the_user_said_otherwise(monkeypatch):
    from vllm_graft.launch import engine as launch

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the other defaults it sets stay in this test
    monkeypatch.delenv("GRAFT_DIE_WITH_PARENT", raising=False)
    launch.apply_env_defaults()
    assert os.environ["GRAFT_DIE_WITH_PARENT"] == "1"
    monkeypatch.setenv("GRAFT_DIE_WITH_PARENT", "0")
    launch.apply_env_defaults()
    assert os.environ["GRAFT_DIE_WITH_PARENT"] == "0"
    from vllm_graft.tools.soak.server import server_env

    assert server_env(None)["GRAFT_DIE_WITH_PARENT"] == "1"
