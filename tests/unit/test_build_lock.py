"""A C++ extension build killed midway must not hang the next process (issue 35).

torch's loader guards a build with a ``lock`` file and waits on it without a timeout; a process
killed during the build leaves it behind. ``plugins.quant._shared.build_lock`` (an flock held
around every vllm-graft build) detects such a lock as ownerless, reports and removes it, and
bounds the wait for a live build.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from vllm_graft.plugins.quant._shared import BuildLockTimeout, build_lock


def test_a_stale_torch_lock_is_reported_and_removed(tmp_path, caplog):
    stale = tmp_path / "lock"
    stale.write_text("")
    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        with build_lock(str(tmp_path), timeout=5):
            assert not stale.exists()
    assert any("left by a process that stopped" in r.getMessage() for r in caplog.records)


def test_a_live_build_is_waited_for_with_a_timeout_naming_the_file(tmp_path):
    # another process holds the flock (a build in progress): the wait ends in a named error
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(tmp_path / 'graft.lock')!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # the live build's own torch lock: not touched
        with pytest.raises(BuildLockTimeout, match="graft.lock"):
            with build_lock(str(tmp_path), timeout=0.5):
                pass
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    # its owner gone, the flock is free and the torch lock it left is stale
    with build_lock(str(tmp_path), timeout=5):
        assert not (tmp_path / "lock").exists()


_BUILD = textwrap.dedent("""
    import sys
    from vllm_graft.plugins.quant._shared import cpu_extension
    mod, why = cpu_extension("vllm_graft_locktest", "int twice(int x) { return 2 * x; }", ["twice"])
    print("RESULT", why if mod is None else mod.twice(21), flush=True)
""")


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    lock = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and lock is None:
        found = list(tmp_path.glob("**/vllm_graft_locktest/lock"))
        lock = found[0] if found else None
        time.sleep(0.05)
    if lock is None:
        first.kill()
        pytest.fail("the first build never took torch's build lock")
    os.killpg(first.pid, signal.SIGKILL)  # the compiler too
    first.wait()
    assert lock.exists(), "the killed build should have left torch's lock behind"
    second = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True,
                            text=True, timeout=240)
    assert "RESULT 42" in second.stdout, second.stdout + second.stderr
    assert "left by a process that stopped" in second.stderr
