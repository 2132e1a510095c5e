"""The MoE contract: a scheduler that changes, decides or watches expert routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kinds import Kind
from .base import P, PluginImpl

if TYPE_CHECKING:  # torch is only needed by implementations
    import torch


#: The steps of an MoE scheduler, in the order a layer runs them (see :class:`MoEScheduler`).
MOE_STEPS = ("adjust_logits", "route", "observe")


@dataclass(frozen=True)
class MoEModel:
    """Static facts about the model's MoE layers, given to each scheduler once at activation
    (:meth:`MoEScheduler.bind`), before the engine builds any layer.

    ``layers`` are the decoder-layer indices that may hold an MoE block (``layer_idx`` in the
    calls below): all of ``range(num_layers)`` unless the model's config says which ones.
    """

    num_layers: int  # decoder layers
    num_experts: int  # E, routed experts per MoE layer
    top_k: int  # experts per token (the model's)
    layers: tuple[int, ...] = ()  # decoder layers with an MoE block; () = all of range(num_layers)
    model: str = ""  # the model's path or id, for messages

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.layers or tuple(range(self.num_layers))


class MoEScheduler(PluginImpl[P]):
    """Decides, changes or watches which experts each token goes to, in every MoE layer.

    A scheduler implements one or more of three steps. For every MoE layer and forward
    step the MoE adapter calls them with ``layer_idx``, the index of the decoder layer the
    MoE block belongs to (0-based, read from the layer's name: 3 for
    ``model.layers.3.block_sparse_moe``), on that step's ``T`` tokens (all sequences packed,
    prefill and decode alike) and the model's ``E`` experts:

    1. :meth:`adjust_logits`, before top-k: change the router logits ``[T, E]`` (switch an
       expert off with ``-inf``, add a bias). Default: unchanged.
    2. :meth:`route`: turn the logits into ``(topk_weights, topk_ids)``. Not overriding it
       leaves routing to the model's own top-k (vLLM's router for the layer).
    3. :meth:`observe`, after routing: see what the layer will compute with (expert
       placement, caching, traces). Default: nothing.

    Composition. A deployment's ``moe:`` list is applied in its order (:class:`MoEChain`):

    * every plugin's ``adjust_logits`` runs first, in list order, each on the previous
      one's output;
    * then the **last** plugin in the list whose class overrides ``route`` routes the
      adjusted logits; routers earlier in the list are not asked to route. If no plugin
      overrides ``route``, the model's own top-k routes the adjusted logits;
    * then every plugin's ``observe`` runs, in list order, with the final routing.

    So a mask (``adjust_logits``) composes with any router, and a tracer (``observe``) sees
    the effect of both, wherever it stands in the list. Which steps a class implements is
    read from the class (:meth:`implements`), once, not per call.
    """

    kind = Kind.MOE

    def bind(self, model: MoEModel) -> None:
        """Called once at activation with the model's MoE facts (layers, ``E``, ``top_k``),
        before any layer runs. Check the parameters against them here (an expert index out
        of range, a mask leaving fewer than ``top_k`` experts...) and raise ``ValueError``
        with a message naming the parameter: the adapter refuses the deployment with it.
        Default: nothing."""

    def adjust_logits(self, layer_idx: int, router_logits: "torch.Tensor") -> "torch.Tensor":
        """The router logits ``[T, E]`` to route with instead of ``router_logits``.

        Same shape and dtype (the model's). Return a new tensor: do not modify
        ``router_logits`` in place. Default: ``router_logits`` unchanged.

        Example (switch expert 3 off)::

            def adjust_logits(self, layer_idx, router_logits):
                out = router_logits.clone()
                out[:, 3] = float("-inf")
                return out
        """
        return router_logits

    def route(
        self, layer_idx: int, router_logits: "torch.Tensor", top_k: int, renormalize: bool
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(topk_weights [T, top_k], topk_ids [T, top_k])`` from ``router_logits [T, E]``.

        ``top_k`` and ``renormalize`` are the model's: with ``renormalize`` a token's
        weights sum to 1 (a softmax over its chosen experts' logits), without it they are
        the chosen experts' softmax probabilities over all ``E`` experts. The layer uses the
        weights as float32 and the ids as int32 (:class:`MoEChain` converts them, onto the
        logits' device). Unused slots (a token routed to fewer than ``top_k`` experts) carry weight
        0 and any valid expert id: weight 0 is how a scheduler says "slot pruned". Where the MoE
        adapter can (vLLM's CPU engine, unquantized experts), such slots are not computed at all;
        elsewhere the layer computes them and multiplies by 0. The output is the same either way
        (for finite expert outputs).

        Not overriding this leaves routing to the model's own top-k.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} does not route: the model's own top-k does "
            "(MoEChain calls route only on classes that override it)"
        )

    def observe(self, layer_idx: int, topk_ids: "torch.Tensor", topk_weights: "torch.Tensor") -> None:
        """The routing the layer computes with: ``topk_ids [T, k]`` (logical expert ids,
        integer) and ``topk_weights [T, k]`` (floating point). Read them; do not modify
        them. Default: nothing.
        """

    def expert_placement(self) -> "list[list[int]] | None":
        """Where expert parallelism should put the experts, or None (the default: vLLM's own
        placement). A placement is vLLM's EPLB ``physical_to_logical_map``: one row per MoE layer
        (in :attr:`MoEModel.moe_layers` order), row ``l`` lists the ``E`` logical experts by
        physical slot, and EP rank ``r`` holds slots ``r*E/N .. (r+1)*E/N - 1``. Called after
        :meth:`bind`. Where the engine runs with ``enable_expert_parallel`` and ``enable_eplb``
        the MoE adapter gives vLLM's load balancer a policy that answers every rearrangement with
        this placement (at most one plugin of a deployment may return one)."""
        return None

    @classmethod
    def implements(cls, step: str) -> bool:
        """Whether this class overrides ``step`` (one of :data:`MOE_STEPS`)."""
        if step not in MOE_STEPS:
            raise ValueError(f"unknown MoE step {step!r}; the steps are {', '.join(MOE_STEPS)}")
        return getattr(cls, step) is not getattr(MoEScheduler, step)
