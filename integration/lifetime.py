"""Processes that die with their parent: what vllm-graft's launchers (serve, soak, servebench,
bench, demo) ask of the vLLM processes they start (vLLM-free).

vLLM's own processes outlive a parent that is killed outright: after ``kill -9`` of vLLM's API
server its ``EngineCore`` child keeps running, holding its memory and cores, until it is killed by
hand (issue 64). vLLM stops its children only on a shutdown it runs itself. Linux's
``PR_SET_PDEATHSIG`` has the kernel send a signal to a process when its parent ends, however it
ends; a launcher sets :data:`ENV_DIE_WITH_PARENT`, and the bridge (:func:`die_with_parent`, called
where vLLM loads its plugins, in every one of its processes) asks for SIGTERM in each vLLM child
process. SIGTERM, not SIGKILL: vLLM's handlers then stop the process's own children (an engine
core its workers), and each process writes its last report on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger("vllm_graft")

#: Set to 1 (the launchers do; a user of plain vLLM may too) to have each vLLM child process get
#: SIGTERM when its parent ends, however it ends. Not ``VLLM_GRAFT_...``: vLLM warns about every
#: ``VLLM_*`` variable it does not know, and refuses to start with one under
#: ``--fail-on-environ-validation`` (``Platform.validate_environ``); a default every launcher sets
#: must not do either.
ENV_DIE_WITH_PARENT = "GRAFT_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends (Linux only; False
    elsewhere or where libc refuses). Safe in a ``preexec_fn``: no allocation beyond ctypes'."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """In a vLLM child process (a ``multiprocessing`` child: the engine core, a worker) while
    :data:`ENV_DIE_WITH_PARENT` is 1: end with the parent. A parent already gone (it ended before
    the signal was asked for) ends this process at once, as the signal would have."""
    if os.environ.get(ENV_DIE_WITH_PARENT) != "1":
        return
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return  # the launcher's own child (the server): the launcher asked for it at its start
    if not set_parent_death_signal():
        log.warning(
            "vllm-graft: %s=1, but this platform has no parent-death signal (Linux's "
            "PR_SET_PDEATHSIG): %s may outlive its parent",
            ENV_DIE_WITH_PARENT,
            multiprocessing.current_process().name,
        )
        return
    if os.getppid() != parent.pid:  # the parent ended before the call above
        os.kill(os.getpid(), signal.SIGTERM)
