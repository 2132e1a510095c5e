"""What the MoE adapter checks, free of vLLM: the decoder layer of an MoE layer
(:func:`layer_index`), whether a layer's routing is one a routing plugin can stand in for
(:func:`plain_softmax_routing`), and the deployment against the model: eager mode
(:func:`require_eager`), a model with MoE layers (:func:`require_moe_model`) and plugins whose
parameters fit it (:func:`bind`), and on CUDA a modular MoE kernel (:func:`moe_backend_overrides`,
:func:`monolithic_refusal`). :mod:`.engine` calls them from vLLM's side.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from ....hooks import DeploymentError, Plan, Problem
from ....hooks.contracts import MoEModel
from ....hooks.deployment import Enabled

from ...runtime import Runtime

log = logging.getLogger("vllm_graft")


class MoEAdapterError(RuntimeError):
    """The enabled MoE plugins cannot act on this model's MoE layers."""


_LAYERS_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(prefix: str) -> int:
    """The decoder layer an MoE layer belongs to, from its name (vLLM's ``prefix``): the
    number after ``layers.`` (``model.layers.3.block_sparse_moe.experts`` -> 3), else its
    only number."""
    m = _LAYERS_RE.search(prefix)
    if m:
        return int(m.group(1))
    numbers = [int(part) for part in prefix.split(".") if part.isdecimal()]
    if len(numbers) == 1:
        return numbers[0]
    raise MoEAdapterError(
        f"cannot tell which decoder layer MoE layer {prefix!r} belongs to "
        "(expected a name like 'model.layers.3.mlp.experts')"
    )


def plain_softmax_routing(routed_experts: Any) -> str | None:
    """Why a routing plugin (softmax top-k parameters only) cannot stand in for this
    layer's routing, or None when the layer routes by plain softmax top-k."""
    reasons = []
    if getattr(routed_experts, "scoring_func", "softmax") != "softmax":
        reasons.append(f"scoring function {routed_experts.scoring_func!r}")
    if getattr(routed_experts, "use_grouped_topk", False):
        reasons.append("grouped top-k")
    if getattr(routed_experts, "custom_routing_function", None) is not None:
        reasons.append("a custom routing function")
    if getattr(routed_experts, "e_score_correction_bias", None) is not None:
        reasons.append("a score-correction bias")
    if getattr(routed_experts, "routed_scaling_factor", 1.0) != 1.0:
        reasons.append(f"routed scaling factor {routed_experts.routed_scaling_factor}")
    return ", ".join(reasons) or None


def require_eager(plan: Plan) -> None:
    """Refuse a deployment whose ``engine`` turns eager mode off (see :mod:`.engine`)."""
    if plan.deployment.engine.get("enforce_eager") is False:
        raise DeploymentError(
            [
                Problem(
                    "engine.enforce_eager",
                    "MoE plugins run Python in every MoE layer at every step, which needs vLLM's eager mode",
                    value=False,
                    accepted="true (or leave it out)",
                    hint="Drop engine.enforce_eager: the MoE adapter sets it",
                )
            ],
            "deployment",
        )


def bind(enabled: list[Enabled], facts: MoEModel, runtime: Runtime) -> None:
    """Give every scheduler the model's MoE facts; a ValueError it raises (a parameter
    that does not fit this model) refuses the deployment, naming the plugin's params."""
    problems = []
    for e in enabled:
        try:
            runtime.instance(e).bind(facts)
        except ValueError as err:
            problems.append(
                Problem(
                    f"{e.path}.params",
                    f"MoE plugin {e.name!r} does not fit model {facts.model} "
                    f"({facts.num_layers} layers, {facts.num_experts} experts, top-{facts.top_k}): {err}",
                )
            )
    if problems:
        raise DeploymentError(problems, "deployment vs model")


def require_moe_model(
    enabled: list[Enabled], plan: Plan, read_facts: Callable[[str, bool], MoEModel]
) -> MoEModel | None:
    """The model's MoE facts (``read_facts(model, trust_remote_code)``), or None when they
    cannot be known; a model without MoE layers refuses the deployment, naming the fix."""
    model = plan.deployment.model or (plan.model.path if plan.model is not None else None)
    if model is None:
        log.warning(
            "vllm-graft: no model known at activation, so whether it has MoE layers "
            "is not checked (a model without them runs the MoE plugins nowhere)"
        )
        return None
    try:
        facts = read_facts(model, bool(plan.deployment.engine.get("trust_remote_code", False)))
    except Exception as e:  # vLLM will report an unreadable model itself
        log.warning("vllm-graft: could not read the config of %s (%s); MoE check skipped", model, e)
        return None
    if facts.num_experts > 0:
        return facts
    archs = ", ".join(plan.model.architectures) if plan.model is not None else "unknown architecture"
    raise DeploymentError(
        [
            Problem(
                f"{e.path}.plugin",
                f"MoE plugin {e.name!r} needs a model with MoE layers, but model {model} ({archs}) has none",
                value=e.name,
                hint="Remove the `moe:` section to run this model, or run an MoE model "
                "(e.g. models/graft-tiny-mixtral)",
            )
            for e in enabled
        ],
        "deployment vs model",
    )


# ------------------------------------------------------------------ modular MoE kernel
#: The ``moe_backend`` vllm-graft selects for MoE deployments on CUDA. In vLLM 0.33 it maps to
#: modular expert kernels only, which take the router's ``(topk_weights, topk_ids)``:
#: ``TritonExperts`` for unquantized and FP8 experts, ``TritonWNA16Experts`` for int4/int8
#: weight-only (``fused_moe/oracle/unquantized.py``, ``fp8.py``, ``int_wna16.py``
#: ``backend_to_kernel_cls``). Exception: MXFP4 experts, whose ``triton`` entry lists
#: ``OAITritonMxfp4ExpertsMonolithic`` first (``oracle/mxfp4.py``); the first-forward check
#: (:func:`monolithic_refusal`) still catches that.
MODULAR_MOE_BACKEND = "triton"
#: ``moe_backend`` values that can select a kernel that routes inside itself (a subclass of
#: ``FusedMoEExpertsMonolithic``: the ``TrtLlm*ExpertsMonolithic`` of FlashInfer TRT-LLM, the
#: AITER ones), and ``auto``, whose CUDA priority list puts FlashInfer TRT-LLM first on SM100
#: (``oracle/unquantized.py``, ``_get_priority_backends``). A value starting with one of these
#: is refused on CUDA (``auto`` is replaced instead).
MONOLITHIC_CAPABLE_PREFIXES = ("flashinfer_trtllm", "aiter")
#: The flag, as vLLM's EngineArgs names it (``--moe-backend``), in 0.32 and 0.33.
MOE_BACKEND_ARG = "moe_backend"


def _backend_name(value: Any) -> str:
    """``moe_backend`` normalised the way vLLM does (``KernelConfig._normalize_moe_backend``)."""
    return str(value).lower().replace("-", "_")


def moe_backend_overrides(platform: str | None, engine: dict[str, Any], has_arg: bool) -> dict[str, str]:
    """The engine arguments that make vLLM build modular MoE kernels for a deployment with MoE
    plugins: ``{"moe_backend": "triton"}`` on CUDA, ``{}`` elsewhere.

    Why: vLLM picks each MoE layer's kernel while it builds the layer, from the router the layer
    is built with (``FusedMoEConfig.require_decomposed_backend`` is ``not
    router.supports_monolithic_kernels``, ``fused_moe/layer.py``); the adapter swaps the router
    only afterwards, so with ``moe_backend=auto`` an SM100 GPU gets FlashInfer's monolithic
    TRT-LLM kernel, which routes inside itself from the logits and never calls the plugins.

    ``platform``: the deployment's (``Plan.platform``; only ``"cuda"`` changes anything: the CPU
    engine has CPU kernels only and keeps ``auto``); ``engine``: the deployment's ``engine``
    section (an explicit ``moe_backend`` there is kept unless it can select a monolithic kernel,
    which refuses the deployment with the fix); ``has_arg``: whether the installed vLLM's
    EngineArgs has ``moe_backend`` (without it there is nothing to set, and the first-forward
    check is the only guard). A ``--moe-backend`` given on vLLM's command line that differs from
    the value returned here is refused by the bridge, naming the flag.
    """
    if platform != "cuda" or not has_arg:
        return {}
    chosen = engine.get(MOE_BACKEND_ARG)
    if chosen is None or _backend_name(chosen) == "auto":
        return {MOE_BACKEND_ARG: MODULAR_MOE_BACKEND}
    name = _backend_name(chosen)
    if name.startswith(MONOLITHIC_CAPABLE_PREFIXES):
        raise DeploymentError(
            [
                Problem(
                    f"engine.{MOE_BACKEND_ARG}",
                    f"MoE backend {chosen!r} can run a monolithic kernel that "
                    "routes inside itself, so the enabled MoE plugins would never be called",
                    value=chosen,
                    accepted=f"{MODULAR_MOE_BACKEND!r} (or leave it out: the MoE adapter sets it)",
                    hint=f"Set engine.{MOE_BACKEND_ARG}: {MODULAR_MOE_BACKEND} or drop it",
                )
            ],
            "deployment",
        )
    return {MOE_BACKEND_ARG: name}


def monolithic_refusal(layer_name: str, quant_method: str, moe_backend: str | None) -> str:
    """The message of the first-forward check when a layer's kernel routes by itself; it names
    the fix (``moe_backend``)."""
    where = f" (moe_backend={moe_backend!r})" if moe_backend else ""
    return (
        f"MoE layer {layer_name}: its quant method {quant_method} runs a monolithic kernel{where} "
        "that routes inside the kernel, so the enabled MoE plugins would never be called. "
        f"Select a modular MoE kernel: engine.{MOE_BACKEND_ARG}: {MODULAR_MOE_BACKEND} in the "
        f"deployment (vLLM flag --moe-backend {MODULAR_MOE_BACKEND}; the MoE adapter sets it on "
        "CUDA unless told otherwise); or run the model unquantized, or remove the `moe:` section"
    )


__all__ = [
    "MoEAdapterError",
    "layer_index",
    "plain_softmax_routing",
    "require_eager",
    "bind",
    "require_moe_model",
    "moe_backend_overrides",
    "monolithic_refusal",
    "MODULAR_MOE_BACKEND",
    "MONOLITHIC_CAPABLE_PREFIXES",
    "MOE_BACKEND_ARG",
]
