"""The kit's MoE exercise: a scheduler bound to a generated model, its ``adjust_logits`` /
``route`` / ``observe`` on generated router logits, checked against plain top-k routing
(:func:`model_topk`).
"""
from __future__ import annotations

from typing import Any

from vllm_graft.hooks import MoEModel
from vllm_graft.kit.conformance.base import Target, torch_dtype, torch_module

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
        impl.bind(MoEModel(num_layers=MOE_LAYERS, num_experts=MOE_EXPERTS, top_k=MOE_TOPK,
                           model="graft-conformance"))
    except ValueError as e:
        raise t.fail(f"bind() refused the kit's model ({MOE_LAYERS} layers, {MOE_EXPERTS} experts, "
                     f"top-{MOE_TOPK}) with the example parameters: {e}; give example parameters "
                     "that fit it (marker params=)") from None
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
                raise t.fail(f"adjust_logits returned {tuple(adjusted.shape)} {adjusted.dtype} for "
                             f"{tuple(logits.shape)} {logits.dtype} ({label})")
            if rules and not torch.equal(logits, before):
                raise t.fail(f"adjust_logits modified the router logits in place ({label})")
            if rules and lossless and not torch.equal(adjusted, logits):
                raise t.fail(f"declared lossless but adjust_logits changed the logits ({label})")
            out["logits"] = adjusted
            if cls.implements("route"):
                w, ids = impl.route(layer, adjusted, MOE_TOPK, renorm)
                if rules:
                    if tuple(w.shape) != (MOE_TOKENS, MOE_TOPK) or tuple(ids.shape) != (MOE_TOKENS, MOE_TOPK):
                        raise t.fail(f"route returned weights {tuple(w.shape)} and ids {tuple(ids.shape)}; "
                                     f"both must be [T, top_k] = [{MOE_TOKENS}, {MOE_TOPK}] ({label})")
                    if ids.is_floating_point() or ids.min() < 0 or ids.max() >= MOE_EXPERTS:
                        raise t.fail(f"route returned expert ids outside [0, {MOE_EXPERTS}) ({label})")
                    wf = w.float()
                    if not torch.isfinite(wf).all() or (wf < 0).any():
                        raise t.fail(f"route returned negative or non-finite weights ({label})")
                    if ((wf > 0).sum(-1) < 1).any():
                        raise t.fail(f"route left a token with no expert (all weights 0) ({label})")
                    if renorm and ((wf.sum(-1) - 1).abs() > 1e-3).any():
                        raise t.fail(f"with renormalize each token's weights must sum to 1 ({label})")
                    if lossless:
                        rw, rids = model_topk(logits, MOE_TOPK, renorm)
                        if not (torch.equal(ids.long().sort(-1).values, rids.sort(-1).values)
                                and torch.allclose(wf.sort(-1).values, rw.sort(-1).values, atol=1e-3)):
                            raise t.fail(f"declared lossless but routes differently from the "
                                         f"model's top-k ({label})")
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
