"""Quantization adapter: the enabled :class:`~vllm_graft.hooks.QuantMethod` quantises and
computes every linear layer of the model.

vLLM route
----------
For each enabled quant plugin the adapter registers, in every process that activates the
deployment, a vLLM quantization config named :func:`quantization_name` (``graft-<plugin>``;
vLLM keys its registry by the plain string, and plugin names are ``[a-z0-9_-]``, so the name
is valid wherever ``--quantization`` is), through vLLM's own
``model_executor/layers/quantization/__init__.py: register_quantization_config``
(:func:`.vllm_method.config_class`). ``engine_overrides`` sets ``quantization`` to that name.
No patch is needed.

This is online quantisation of an unquantised checkpoint: ``get_config_filenames()`` is
``[]``, so ``model_loader/weight_utils.py: get_quant_config`` builds the config with no
arguments. ``get_quant_method(layer, prefix)`` returns a ``GraftLinearMethod`` for
every ``LinearBase`` layer built with the quant config (``model_executor/layers/linear.py``:
in Llama the fused q/k/v, o, fused gate/up and down projections, 16 layers in the bundled
tiny Llama) and ``None`` for everything else, which vLLM then runs unquantised: embeddings
and the ``lm_head`` (``VocabParallelEmbedding``/``ParallelLMHead`` fall back to
``UnquantizedEmbeddingMethod``), MoE experts (``RoutedExperts`` falls back to
``UnquantizedFusedMoEMethod``) and attention (no KV-cache scales). A layer the model builds
without the quant config stays unquantised too: Mixtral's router ``GateLinear`` (so in the
bundled tiny Mixtral only q/k/v and o are the plugin's, 8 layers). Pre-quantised checkpoints
written by ``vllm-graft quantize`` load the same way, without a flag.

The package:

* :mod:`.checkpoint` (vLLM-free): plugin names, the pre-quantised checkpoint format, its
  ``quantization_config`` checks, checkpoint tensor names and the deployment it implies;
* :mod:`.tensors` (vLLM-free): the quantised tensors kept on a layer, and the opaque torch
  ops ``vllm_graft::quant_linear``/``quant_embed`` that keep plugin code out of vLLM's
  ``torch.compile`` graphs;
* :mod:`.linear` (vLLM-free): quantising or loading a layer and calling the plugin;
* :mod:`.vllm_method`: vLLM's config and linear-method classes and their registration;
  imported only by :meth:`QuantAdapter.activate` and :meth:`QuantAdapter.deactivate`, so
  this module imports without vLLM.

Events counted: ``quantize`` (layers quantised), ``apply`` (linear calls), ``load`` (layers
loaded from a pre-quantised checkpoint), ``embed`` (embedding calls), ``captured`` (calls
captured into a CUDA graph, whose replays are not counted: see :mod:`.tensors`).

On CUDA (vLLM 0.33): the tensors a plugin builds at load follow the layer weight's device
(:func:`.tensors.follow_device`), and ``vllm_graft::quant_linear`` is captured in vLLM's
CUDA graphs (not a splitting op), its body free of host syncs (:mod:`.tensors` says why).

Deactivation removes the names from vLLM's registries again (``QUANTIZATION_METHODS``, the
platform's ``supported_quantization`` and the custom-config dict), so a later plain engine
in the same process sees vLLM as it was. An engine built while the deployment was active
keeps its linear methods, which hold their plugin instance directly. The custom op stays
registered with torch (it cannot be removed; it is reachable only through those methods).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ....hooks import Kind, Plan
from ....hooks.deployment import Enabled

from ... import targets
from ...runtime import Runtime
from .. import Adapter

# The adapter's vLLM-free API, also reachable here (the unit tests use it through this module).
from .checkpoint import (  # noqa: F401
    CHECKPOINT_FORMAT,
    checkpoint_config,
    checkpoint_deployment,
    checkpoint_tensor_name,
    quantization_name,
    stored_specs,
)
from .tensors import (  # noqa: F401
    check_quantized,
    install_tensors,
    keeps_storage,
    layer_tensors,
    quant_linear_op,
)

OWNER = targets.QUANT


@dataclass
class QuantState:
    """The quant adapter's per-deployment state (on the runtime: ``ADAPTER.state``)."""

    registered: list[str] = field(default_factory=list)  # vLLM quantization names registered


class QuantAdapter(Adapter[QuantState]):
    kind = Kind.QUANT
    owner = OWNER

    State = QuantState

    def engine_overrides(self, enabled: list[Enabled], plan: Plan) -> dict[str, Any]:
        (e,) = enabled  # the deployment allows one quant plugin
        return {"quantization": quantization_name(e.name)}

    def activate(self, enabled: list[Enabled], plan: Plan, runtime: Runtime) -> None:
        from .vllm_method import config_class

        for e in enabled:
            name = quantization_name(e.name)
            config_class(name)
            if name not in self.state.registered:
                self.state.registered.append(name)

    def deactivate(self) -> None:
        if self.state.registered:
            from .vllm_method import unregister

            for name in self.state.registered:
                unregister(name)
        self.state.registered.clear()


ADAPTER = QuantAdapter()

__all__ = [
    "ADAPTER",
    "QuantAdapter",
    "OWNER",
    "quantization_name",
    "check_quantized",
    "install_tensors",
    "layer_tensors",
    "keeps_storage",
    "checkpoint_config",
    "checkpoint_deployment",
    "checkpoint_tensor_name",
    "stored_specs",
    "CHECKPOINT_FORMAT",
    "quant_linear_op",
]
