"""What the MoE adapter checks, free of vLLM: the decoder layer of an MoE layer
(:func:`layer_index`), whether a layer's routing is one a routing plugin can stand in for
(:func:`plain_softmax_routing`), and the deployment against the model: eager mode
(:func:`require_eager`), a model with MoE layers (:func:`require_moe_model`) and plugins whose
parameters fit it (:func:`bind`). :mod:`.engine` calls them from vLLM's side.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable

from vllm_graft.hooks import DeploymentError, Plan, Problem
from vllm_graft.hooks.contracts import MoEModel
from vllm_graft.hooks.deployment import Enabled

from vllm_graft.integration.runtime import Runtime

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
    raise MoEAdapterError(f"cannot tell which decoder layer MoE layer {prefix!r} belongs to "
                          "(expected a name like 'model.layers.3.mlp.experts')")


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
        raise DeploymentError([Problem(
            "engine.enforce_eager", "MoE plugins run Python in every MoE layer at every step, "
            "which needs vLLM's eager mode", value=False, accepted="true (or leave it out)",
            hint="Drop engine.enforce_eager: the MoE adapter sets it")], "deployment")


def bind(enabled: list[Enabled], facts: MoEModel, runtime: Runtime) -> None:
    """Give every scheduler the model's MoE facts; a ValueError it raises (a parameter
    that does not fit this model) refuses the deployment, naming the plugin's params."""
    problems = []
    for e in enabled:
        try:
            runtime.instance(e).bind(facts)
        except ValueError as err:
            problems.append(Problem(
                f"{e.path}.params", f"MoE plugin {e.name!r} does not fit model {facts.model} "
                f"({facts.num_layers} layers, {facts.num_experts} experts, top-{facts.top_k}): {err}"))
    if problems:
        raise DeploymentError(problems, "deployment vs model")


def require_moe_model(enabled: list[Enabled], plan: Plan,
                      read_facts: Callable[[str, bool], MoEModel]) -> MoEModel | None:
    """The model's MoE facts (``read_facts(model, trust_remote_code)``), or None when they
    cannot be known; a model without MoE layers refuses the deployment, naming the fix."""
    model = plan.deployment.model or (plan.model.path if plan.model is not None else None)
    if model is None:
        log.warning("vllm-graft: no model known at activation, so whether it has MoE layers "
                    "is not checked (a model without them runs the MoE plugins nowhere)")
        return None
    try:
        facts = read_facts(model, bool(plan.deployment.engine.get("trust_remote_code", False)))
    except Exception as e:  # vLLM will report an unreadable model itself
        log.warning("vllm-graft: could not read the config of %s (%s); MoE check skipped", model, e)
        return None
    if facts.num_experts > 0:
        return facts
    archs = ", ".join(plan.model.architectures) if plan.model is not None else "unknown architecture"
    raise DeploymentError([Problem(
        f"{e.path}.plugin", f"MoE plugin {e.name!r} needs a model with MoE layers, but model "
        f"{model} ({archs}) has none", value=e.name,
        hint="Remove the `moe:` section to run this model, or run an MoE model "
             "(e.g. models/graft-tiny-mixtral)") for e in enabled], "deployment vs model")


__all__ = ["MoEAdapterError", "layer_index", "plain_softmax_routing", "require_eager", "bind",
           "require_moe_model"]
