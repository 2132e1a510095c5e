"""The kit's MoE exercise: a scheduler bound to a generated model, its ``expert_placement``
checked as vLLM's EPLB map, its ``adjust_logits`` / ``route`` / ``observe`` on generated router
logits; a router's weights checked against the softmax the kit computes itself for the experts
it chose (:func:`reference_weights`), a lossless one against plain top-k routing
(:func:`model_topk`).
"""

from __future__ import annotations

from typing import Any

from ....hooks import MoEModel
from ..base import Target, torch_dtype, torch_module

MOE_EXPERTS, MOE_TOPK, MOE_TOKENS, MOE_LAYERS = 8, 2, 9, 4


def model_topk(logits, top_k: int, renormalize: bool):
    """The plain top-k routing a lossless scheduler must reproduce."""
    torch = torch_module()
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def exercise_moe(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    torch = torch_module()
    cls = type(impl)
    lossless = t.entry.registration.capabilities.lossless
    try:  # as the MoE adapter does at activation
        impl.bind(MoEModel(num_layers=MOE_LAYERS, num_experts=MOE_EXPERTS, top_k=MOE_TOPK, model="graft-conformance"))
    except ValueError as e:
        raise t.fail(
            f"bind() refused the kit's model ({MOE_LAYERS} layers, {MOE_EXPERTS} experts, "
            f"top-{MOE_TOPK}) with the example parameters: {e}; give example parameters "
            "that fit it (marker params=)"
        ) from None
    _check_placement(t, impl)
    results = []
    for layer in range(MOE_LAYERS):
        for renorm in (True, False):
            g = torch.Generator().manual_seed(500 + layer * 2 + renorm)
            logits = torch.randn(MOE_TOKENS, MOE_EXPERTS, generator=g).to(torch_dtype(dtype))
            before = logits.clone()
            label = f"layer {layer} renormalize={renorm} {dtype}"
            out: dict[str, Any] = {}
            adjusted = impl.adjust_logits(layer, logits) if cls.implements("adjust_logits") else logits
            if rules and (adjusted.shape != logits.shape or adjusted.dtype != logits.dtype):
                raise t.fail(
                    f"adjust_logits returned {tuple(adjusted.shape)} {adjusted.dtype} for "
                    f"{tuple(logits.shape)} {logits.dtype} ({label})"
                )
            if rules and not torch.equal(logits, before):
                raise t.fail(f"adjust_logits modified the router logits in place ({label})")
            if rules and lossless and not torch.equal(adjusted, logits):
                raise t.fail(f"declared lossless but adjust_logits changed the logits ({label})")
            out["logits"] = adjusted
            if cls.implements("route"):
                w, ids = impl.route(layer, adjusted, MOE_TOPK, renorm)
                if rules:
                    if tuple(w.shape) != (MOE_TOKENS, MOE_TOPK) or tuple(ids.shape) != (MOE_TOKENS, MOE_TOPK):
                        raise t.fail(
                            f"route returned weights {tuple(w.shape)} and ids {tuple(ids.shape)}; "
                            f"both must be [T, top_k] = [{MOE_TOKENS}, {MOE_TOPK}] ({label})"
                        )
                    if ids.is_floating_point() or ids.min() < 0 or ids.max() >= MOE_EXPERTS:
                        raise t.fail(f"route returned expert ids outside [0, {MOE_EXPERTS}) ({label})")
                    wf = w.float()
                    if not torch.isfinite(wf).all() or (wf < 0).any():
                        raise t.fail(f"route returned negative or non-finite weights ({label})")
                    if ((wf > 0).sum(-1) < 1).any():
                        raise t.fail(f"route left a token with no expert (all weights 0) ({label})")
                    if renorm and ((wf.sum(-1) - 1).abs() > 1e-3).any():
                        raise t.fail(f"with renormalize each token's weights must sum to 1 ({label})")
                    _check_route_weights(t, adjusted, w, ids, renorm, label)
                    if lossless:
                        rw, rids = model_topk(logits, MOE_TOPK, renorm)
                        if not (
                            torch.equal(ids.long().sort(-1).values, rids.sort(-1).values)
                            and torch.allclose(wf.sort(-1).values, rw.sort(-1).values, atol=1e-3)
                        ):
                            raise t.fail(f"declared lossless but routes differently from the model's top-k ({label})")
                out["route"] = (w, ids)
            else:
                w, ids = model_topk(adjusted, MOE_TOPK, renorm)
            if cls.implements("observe"):
                wc, ic = w.clone(), ids.clone()
                impl.observe(layer, ids, w)
                if rules and not (torch.equal(w, wc) and torch.equal(ids, ic)):
                    raise t.fail(f"observe modified the routing in place ({label})")
            results.append((label, out))
    return results


def reference_weights(logits, ids, weights, renormalize: bool):
    """The weights the MoE contract gives the experts a router chose (``ids [T, k]``; slots of
    weight 0 are pruned and left out), in float64: without ``renormalize`` each chosen expert's
    softmax probability over all ``E`` experts, with it a softmax over the chosen experts'
    logits only (they sum to 1). Pruned slots get 0."""
    torch = torch_module()
    probs = torch.softmax(logits.double(), dim=-1).gather(-1, ids.long())
    used = weights.float() > 0
    probs = torch.where(used, probs, torch.zeros_like(probs))
    if renormalize:
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-300)
    return probs


def _check_route_weights(t: Target, logits, w, ids, renorm: bool, label: str) -> None:
    used = w.float() > 0
    for tok in range(ids.shape[0]):
        chosen = ids[tok][used[tok]].tolist()
        if len(set(chosen)) != len(chosen):
            raise t.fail(
                f"route() sent token {tok} to expert(s) {sorted(x for x in set(chosen) if chosen.count(x) > 1)} "
                f"in more than one weighted slot (ids {ids[tok].tolist()}, weights "
                f"{[round(x, 4) for x in w[tok].float().tolist()]}) ({label}); a pruned slot carries weight 0"
            )
    ref = reference_weights(logits, ids, w, renorm)
    err = (w.double() - ref).abs()
    if err.max() > 2e-3:
        tok = int(err.max(-1).values.argmax())
        how = (
            "a softmax over the logits of the experts it chose (renormalize=True)"
            if renorm
            else "each chosen expert's softmax probability over all experts (renormalize=False)"
        )
        raise t.fail(
            f"route() gave token {tok} weights {[round(x, 4) for x in w[tok].float().tolist()]} for "
            f"experts {ids[tok].tolist()}, where the MoE contract gives "
            f"{[round(x, 4) for x in ref[tok].tolist()]}: {how}, 0 for a pruned slot ({label})"
        )


def _check_placement(t: Target, impl: Any) -> None:
    """``expert_placement()`` (after ``bind``): None, or vLLM's EPLB ``physical_to_logical_map``
    for the kit's model: one row per MoE layer, each a permutation of the experts."""
    got = impl.expert_placement()
    if got is None:
        return
    layers = MOE_LAYERS
    try:
        rows = [[int(x) for x in row] for row in got]
    except (TypeError, ValueError):
        raise t.fail(
            f"expert_placement() returned {got!r:.200}; it must be None or one list of expert ids per MoE layer"
        ) from None
    if len(rows) != layers:
        raise t.fail(
            f"expert_placement() returned {len(rows)} row(s) for the kit's model with {layers} MoE "
            "layers; one row per MoE layer (MoEModel.moe_layers order)"
        )
    for i, row in enumerate(rows):
        if sorted(row) != list(range(MOE_EXPERTS)):
            raise t.fail(
                f"expert_placement() row {i} is {row}: each row lists the {MOE_EXPERTS} logical "
                f"experts by physical slot, each exactly once (a permutation of range({MOE_EXPERTS}))"
            )
