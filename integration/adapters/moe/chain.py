"""How a deployment's MoE schedulers compose in one layer call (:class:`MoEChain`). vLLM-free:
the MoE adapter calls it from vLLM's router, the conformance kit and tests call it directly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from ....hooks.contracts.moe import MOE_STEPS, MoEScheduler
from ..plugin_calls import raised

if TYPE_CHECKING:
    import torch


class MoEChain:
    """A deployment's MoE schedulers, composed as :class:`MoEScheduler` describes.

    ``schedulers`` are ``(name, scheduler)`` pairs in the deployment's order. ``count``,
    if given, is called as ``count(name, event, n)`` to record what each plugin did, per
    layer call: the step it ran (``"adjust_logits"``, ``"route"``, ``"observe"``, n=1)
    and ``"tokens"`` (the ``T`` tokens it was given, once per layer call).

    Calling the chain runs one layer's routing: ``chain(layer_idx, router_logits, top_k,
    renormalize, model_topk)`` where ``model_topk(logits) -> (topk_weights, topk_ids)`` is
    the model's own routing, used when no plugin routes.
    """

    def __init__(
        self,
        schedulers: Sequence[tuple[str, MoEScheduler]],
        count: "Callable[[str, str, int], None] | None" = None,
    ) -> None:
        self.schedulers = list(schedulers)
        if not self.schedulers:
            raise ValueError("an MoE chain needs at least one scheduler")
        for name, s in self.schedulers:
            if not isinstance(s, MoEScheduler):
                raise TypeError(f"MoE plugin {name!r}: {type(s).__qualname__} is not a vllm_graft.hooks.MoEScheduler")
            if not any(type(s).implements(step) for step in MOE_STEPS):
                raise TypeError(
                    f"MoE plugin {name!r}: {type(s).__qualname__} overrides none of "
                    f"{', '.join(MOE_STEPS)}, so it would do nothing"
                )
        steps = {step: [(n, s) for n, s in self.schedulers if type(s).implements(step)] for step in MOE_STEPS}
        self.adjusters: list[tuple[str, MoEScheduler]] = steps["adjust_logits"]
        routers = steps["route"]
        #: The plugin that routes (the last router in the list), or None: the model routes.
        self.router: tuple[str, MoEScheduler] | None = routers[-1] if routers else None
        #: Plugins that override ``route`` but are not asked to (a later one routes).
        self.overruled: list[str] = [n for n, _ in routers[:-1]]
        self.observers: list[tuple[str, MoEScheduler]] = steps["observe"]
        called = {id(s) for _, s in self.adjusters + self.observers}
        if self.router is not None:
            called.add(id(self.router[1]))
        #: Names of the plugins called at each layer call (the ones that count tokens).
        self.participants: list[str] = [n for n, s in self.schedulers if id(s) in called]
        self._count = count

    @property
    def routes(self) -> bool:
        """Whether a plugin routes (else the model's own top-k does)."""
        return self.router is not None

    def __call__(
        self,
        layer_idx: int,
        router_logits: "torch.Tensor",
        top_k: int,
        renormalize: bool,
        model_topk: "Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]",
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(topk_weights, topk_ids)`` for one layer call (see the class docstring)."""
        count = self._count
        num_tokens = router_logits.shape[0]
        logits = router_logits
        for name, s in self.adjusters:
            try:
                out = s.adjust_logits(layer_idx, logits)
            except Exception as e:
                raise raised("MoE", name, "adjust_logits()", e) from e
            if tuple(out.shape) != tuple(logits.shape):
                raise ValueError(
                    f"MoE plugin {name!r}: adjust_logits returned shape "
                    f"{tuple(out.shape)} for logits of shape {tuple(logits.shape)}"
                )
            logits = out
            if count is not None:
                count(name, "adjust_logits", 1)
        if self.router is None:
            weights, ids = model_topk(logits)
        else:
            name, s = self.router
            try:
                weights, ids = s.route(layer_idx, logits, top_k, renormalize)
            except Exception as e:
                raise raised("MoE", name, "route()", e) from e
            want = (num_tokens, top_k)
            if tuple(weights.shape) != want or tuple(ids.shape) != want:
                raise ValueError(
                    f"MoE plugin {name!r}: route returned weights {tuple(weights.shape)} "
                    f"and ids {tuple(ids.shape)}; both must be [T, top_k] = {list(want)}"
                )
            if ids.is_floating_point() or not weights.is_floating_point():
                raise TypeError(
                    f"MoE plugin {name!r}: route must return (floating weights, integer "
                    f"ids), got ({weights.dtype}, {ids.dtype})"
                )
            weights = weights.to(logits.device).float().contiguous()
            ids = ids.to(logits.device).int().contiguous()
            check_expert_ids(name, ids, logits.shape[-1])
            if count is not None:
                count(name, "route", 1)
        for name, s in self.observers:
            try:
                s.observe(layer_idx, ids, weights)
            except Exception as e:
                raise raised("MoE", name, "observe()", e) from e
            if count is not None:
                count(name, "observe", 1)
        if count is not None:
            for name in self.participants:
                count(name, "tokens", num_tokens)
        return weights, ids


def check_expert_ids(name: str, ids: "torch.Tensor", num_experts: int) -> None:
    """Refuse routing ids outside ``[0, num_experts)`` (vLLM's expert kernels index their weights
    by them). On host tensors (vLLM's CPU engine) a ``ValueError`` naming the plugin; on a device,
    a device-side assert (``torch._assert_async``: no host sync per layer; the engine stops at
    the next sync, and CUDA reports the assert without this message)."""
    if not ids.numel():
        return
    msg = (
        f"MoE plugin {name!r}: route returned expert ids outside [0, {num_experts}) (the layer's "
        "experts); MoEScheduler.route must return ids of this layer's experts"
    )
    if ids.device.type == "cpu":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{msg}: got ids from {lo} to {hi}")
        return
    import torch

    torch._assert_async(((ids >= 0) & (ids < num_experts)).all(), msg)
