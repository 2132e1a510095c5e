"""Whether a plugin may call FlashInfer here, and the calls plugins share.

A plugin uses a FlashInfer kernel only where :func:`unavailable` returns None: ``flashinfer``
is installed at the release vLLM's CUDA build pins (:data:`~vllm_graft.hooks.versions.FLASHINFER`,
0.7.2.post1 for vLLM 0.33), its JIT modules are prebuilt (flashinfer-jit-cache) or buildable
(nvcc and ninja), and the tensors are on a CUDA
device of compute capability >= 8.0. Otherwise the plugin runs its Triton kernel (or PyTorch)
and :func:`choose` logs once, per path and reason, which ran and why.

Nothing here imports flashinfer or vllm at module level; FlashInfer is imported inside the calls
(``vllm-graft doctor`` checks each name and signature against the pinned wheel).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
from functools import lru_cache
from typing import Any

from ..hooks.versions import FLASHINFER

log = logging.getLogger("vllm_graft")

#: vLLM 0.33's FlashInfer backend accepts SM80 to SM121
#: (vllm/v1/attention/backends/flashinfer.py:696-703, SM75 excluded as broken).
MIN_CAPABILITY = (8, 0)
MAX_CAPABILITY = (12, 1)
#: FlashInfer's log-sum-exp is base 2 (include/flashinfer/attention/cascade.cuh:58-72 merges
#: with exp2/log2); natural-log lse * LOG2E is its lse.
LOG2E = 1.4426950408889634


@lru_cache(maxsize=None)
def package_status() -> str | None:
    """None if FlashInfer at the pinned release can run its kernels here, else why not."""
    if FLASHINFER is None:
        return "hooks/versions.py pins no FlashInfer release"
    fix = f"pip install {FLASHINFER.requirement} (vllm-graft[gpu] installs it)"
    if importlib.util.find_spec(FLASHINFER.module) is None:
        return f"flashinfer is not installed; {fix}"
    try:
        version = importlib.metadata.version(FLASHINFER.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != FLASHINFER.version:
        return (
            f"{FLASHINFER.distribution} {version} is installed but vllm-graft calls FlashInfer "
            f"only at vLLM's pin {FLASHINFER.version}; {fix}"
        )
    # The modules vllm-graft calls (cascade.merge_state, top_k) are JIT-built on first use
    # unless an AOT provider ships them: flashinfer-jit-cache (flashinfer/jit/env.py:190-215).
    # flashinfer-cubin holds downloaded TRT-LLM cubins only (jit/env.py:93-131), none of these.
    if importlib.util.find_spec("flashinfer_jit_cache") is None and (_nvcc() is None or shutil.which("ninja") is None):
        cubin = importlib.util.find_spec("flashinfer_cubin") is not None
        return (
            "FlashInfer's JIT-built modules (cascade.merge_state, top_k) are not prebuilt here "
            "(flashinfer-jit-cache is not installed"
            + ("; flashinfer-cubin holds TRT-LLM cubins only, not these modules" if cubin else "")
            + ") and cannot be built (nvcc under CUDA_HOME or on PATH, and ninja on PATH)"
        )
    return None


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        found = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(found)) if found else "/usr/local/cuda"
    return shutil.which(os.path.join(home, "bin", "nvcc"))


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))  # a host query, no sync


def device_status(tensor: Any) -> str | None:
    """None if ``tensor``'s device can run FlashInfer, else why not."""
    dev = tensor.device
    if dev.type != "cuda":
        return f"the tensors are on {dev.type}; FlashInfer runs on CUDA only"
    import torch

    if getattr(torch.version, "hip", None):
        return "ROCm: FlashInfer is a CUDA library"
    cap = _capability(dev.index if dev.index is not None else torch.cuda.current_device())
    if not MIN_CAPABILITY <= cap <= MAX_CAPABILITY:
        return (
            f"compute capability {cap[0]}.{cap[1]} is outside {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
            f"-{MAX_CAPABILITY[0]}.{MAX_CAPABILITY[1]} (vLLM's FlashInfer range)"
        )
    return None


def unavailable(tensor: Any) -> str | None:
    """None if FlashInfer may run on ``tensor``'s device, else the reason it may not."""
    return device_status(tensor) or package_status()


_logged: set[tuple[str, str | None]] = set()


def choose(what: str, reason: str | None, flashinfer: str, other: str) -> bool:
    """True (use ``flashinfer``) when ``reason`` is None; logs once per (what, reason)."""
    if (what, reason) not in _logged:
        _logged.add((what, reason))
        if reason is None:
            pinned = FLASHINFER.requirement if FLASHINFER is not None else "no pinned release"
            log.info("vllm-graft %s: FlashInfer %s (%s)", what, flashinfer, pinned)
        else:
            log.info("vllm-graft %s: %s, not FlashInfer %s: %s", what, other, flashinfer, reason)
    return reason is None


def topk_ids(logits: Any, k: int) -> Any:
    """Top-``k`` token ids per row of ``logits [R, V]`` as int64 ``[R, k]``: FlashInfer's
    ``top_k`` where :func:`unavailable` allows (ordered by value descending, then id ascending,
    ties at the k-th value taking the smaller ids), else ``torch.topk``'s indices."""
    import torch

    reason = unavailable(logits)
    if reason is None and logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"top_k takes float32/float16/bfloat16 logits, not {logits.dtype}"
    if not choose("top-k", reason, "top_k", "torch.topk"):
        return torch.topk(logits, k, dim=-1).indices
    from flashinfer import top_k

    # tie_break=1: prefer smaller indices at the boundary (flashinfer/topk.py:41-49, 912-920)
    values, ids = top_k(logits.contiguous(), k, sorted=False, deterministic=True, tie_break=1)
    # FlashInfer's order among the k is its own: order them (value desc, id asc) on the device
    ids, perm = torch.sort(ids, dim=-1)
    order = torch.argsort(values.gather(-1, perm).float().neg(), dim=-1, stable=True)
    return ids.gather(-1, order).to(torch.int64)
