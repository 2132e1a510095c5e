"""Quantization adapter: the enabled :class:`~vllm_graft.hooks.QuantMethod` quantises and
computes every linear layer of the model.

vLLM route
----------
For each enabled quant plugin the adapter registers, in every process that activates the
deployment, a vLLM quantization config named :func:`quantization_name` (``graft-<plugin>``;
vLLM keys its registry by the plain string, and plugin names are ``[a-z0-9_-]``, so the name
is valid wherever ``--quantization`` is), through vLLM's own
``model_executor/layers/quantization/__init__.py: register_quantization_config``.
``engine_overrides`` sets ``quantization`` to that name.

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
bundled tiny Mixtral only q/k/v and o are the plugin's, 8 layers).

Per linear layer: ``create_weights`` registers a full-precision ``weight`` ``[out, in]``
(``input_dim=1, output_dim=0``) with the layer's own ``weight_loader``, so vLLM loads fused
q/k/v and gate/up shards into it as usual; ``process_weights_after_loading`` (called by
``model_loader/utils.py: process_weights_after_loading``) calls ``QuantMethod.quantize(weight)``
and keeps the returned tensors on the layer as buffers ``graft_<name>``; if none of them is
the original weight (shares its storage), the weight is deleted so its memory is freed.
``apply(layer, x, bias)`` calls ``QuantMethod.apply(tensors, x, bias)``. No patch is needed.

The call goes through one opaque torch custom op, ``torch.ops.vllm_graft.quant_linear``,
so that vLLM's ``torch.compile`` (the default without ``enforce_eager``) never traces plugin
code: a plugin may use numpy, data-dependent Python or the Triton interpreter, its Python
runs on every call, and its events are counted on every call. (Traced, a Python counter
update would be baked into the graph at trace time and replayed wrongly, corrupting every
plugin's counts.) The op's shape function says the output is ``[*x.shape[:-1], out]`` in
``x``'s dtype; the eager body checks the plugin keeps to that. The cost: the compiler
cannot fuse across a plugin's linear layers.

Events counted: ``quantize`` (layers quantised) and ``apply`` (linear calls).

Pre-quantised checkpoints (a later issue) plug in at the same config: a checkpoint whose
``config.json`` has ``"quantization_config": {"quant_method": "graft-<plugin>", ...}`` is
detected by vLLM without a flag and handed to ``from_config(that dict)``; the linear method
would then register the plugin's stored tensors (e.g. ``qweight``, ``scales``) instead of
``weight``, loaded by the same ``weight_loader`` (vLLM fuses/slices ``...q_proj.qweight``
like ``weight``), and ``process_weights_after_loading`` would skip ``quantize``. For that the
contract needs to say which tensors a layer stores (names, shapes, dtypes for a given
``[out, in]``), e.g. an optional ``QuantMethod.stored_tensors``. Until then ``from_config``
refuses such a checkpoint with a clear message.

The config classes are made at run time (one per plugin), so a config instance pickles by
name (``__reduce__``): vLLM sends its config, quant config included, to the engine process,
where unpickling rebuilds and registers the class before the bridge activates there.

Deactivation removes the names from vLLM's registries again (``QUANTIZATION_METHODS``, the
platform's ``supported_quantization`` and the custom-config dict), so a later plain engine
in the same process sees vLLM as it was. An engine built while the deployment was active
keeps its linear methods, which hold their plugin instance directly. The custom op stays
registered with torch (it cannot be removed; it is reachable only through those methods).
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

from vllm_graft.hooks import Kind, Plan, QuantMethod
from vllm_graft.hooks.deployment import Enabled

from ..runtime import RUNTIME, Runtime
from . import Adapter

OWNER = "adapters.quant"
PREFIX = "graft-"
BUFFER_PREFIX = "graft_"


def quantization_name(plugin_name: str) -> str:
    """The ``--quantization`` name of a quant plugin."""
    return PREFIX + plugin_name


# ------------------------------------------------------------------- pure tensor bookkeeping
def check_quantized(tensors: Any, plugin: str) -> dict[str, Any]:
    """Validate what ``QuantMethod.quantize`` returned: a non-empty dict of tensors with
    identifier names (they become buffer names ``graft_<name>``)."""
    import torch

    if not isinstance(tensors, dict) or not tensors:
        raise TypeError(f"quant plugin {plugin!r}: quantize() must return a non-empty dict of "
                        f"tensors, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise TypeError(f"quant plugin {plugin!r}: quantize() returned the key {name!r}; "
                            "keys must be Python identifiers")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"quant plugin {plugin!r}: quantize() returned {type(t).__name__} "
                            f"for {name!r}; values must be tensors")
    return tensors


def keeps_storage(tensors: dict[str, Any], weight: Any) -> bool:
    """Whether any returned tensor is (a view of) ``weight``'s memory."""
    ptr = weight.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in tensors.values())


def install_tensors(layer: Any, tensors: dict[str, Any]) -> None:
    """Keep ``tensors`` on ``layer`` as non-persistent buffers ``graft_<name>`` and drop the
    full-precision ``weight`` unless one of them still uses its memory."""
    weight = layer.weight
    keep = keeps_storage(tensors, weight)
    for name, t in tensors.items():
        layer.register_buffer(BUFFER_PREFIX + name, t, persistent=False)
    layer.graft_tensor_names = tuple(tensors)
    if not keep:
        del layer.weight


def layer_tensors(layer: Any) -> dict[str, Any]:
    """The tensors ``install_tensors`` kept, read from the buffers (so a later ``.to()`` of
    the model is followed)."""
    buffers = layer._buffers
    return {name: buffers[BUFFER_PREFIX + name] for name in layer.graft_tensor_names}


# ---------------------------------------------------------------------- vLLM-facing classes
def _plugin_for(quant_name: str) -> tuple[QuantMethod, str]:
    for e in RUNTIME.enabled(Kind.QUANT):
        if quantization_name(e.name) == quant_name:
            return RUNTIME.instance(e), e.name  # type: ignore[return-value]
    raise RuntimeError(
        f"quantization {quant_name!r} is vllm-graft's and needs a deployment that enables the "
        f"quant plugin {quant_name[len(PREFIX):]!r} (additional_config={{'graft': {{...}}}} or "
        "VLLM_GRAFT_DEPLOYMENT); it cannot be used with --quantization alone")


def _restore_config(quant_name: str, state: dict[str, Any]) -> Any:
    """Unpickling a config (vLLM sends its config to the engine process): the class is
    rebuilt and registered here, as it is made at run time and cannot be found by name."""
    cfg = config_class(quant_name)()
    cfg.__dict__.update(state)
    return cfg


#: Linear methods by key, for the custom op (weak: an engine's methods go with its model).
_LINEAR: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_keys = itertools.count()


@functools.lru_cache(maxsize=1)
def quant_linear_op() -> Any:
    """``torch.ops.vllm_graft.quant_linear(x, tensors, bias, key)``: the linear method with
    key ``key`` computes ``x`` with its plugin, from ``tensors`` (in its names' order).
    Registered once per process."""
    import torch

    @torch.library.custom_op("vllm_graft::quant_linear", mutates_args=(),
                             schema="(Tensor x, Tensor[] tensors, Tensor? bias, int key) -> Tensor")
    def quant_linear(x, tensors, bias, key):
        return _LINEAR[key].compute(x, tensors, bias)

    @quant_linear.register_fake
    def _(x, tensors, bias, key):
        return x.new_empty((*x.shape[:-1], _LINEAR[key].out_features))

    return quant_linear


@functools.lru_cache(maxsize=1)
def _vllm_classes() -> tuple[type, type]:
    """The QuantizationConfig base and the LinearMethod class (built on first use: importing
    vLLM's layers is slow, and this module must import without vLLM for its unit tests)."""
    import torch
    from torch.nn import Parameter
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.utils import set_weight_attrs

    class GraftQuantConfig(QuantizationConfig):
        """One subclass per plugin (see :func:`config_class`) sets ``quant_name``."""

        quant_name: str = ""

        def get_name(self) -> str:
            return self.quant_name

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.float32, torch.float16, torch.bfloat16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0  # plugin requirements are checked by deployment validation

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []  # online quantisation: vLLM builds the config with no arguments

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "GraftQuantConfig":
            raise NotImplementedError(
                f"this checkpoint is stored quantised by {cls.quant_name!r}; vllm-graft does not "
                "load pre-quantised checkpoints yet: use the unquantised checkpoint (the plugin "
                "quantises it while loading)")

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
            if isinstance(layer, LinearBase):
                plugin, name = _plugin_for(self.quant_name)
                return GraftLinearMethod(plugin, name)
            return None  # vLLM runs the layer unquantised

        def __reduce__(self):
            return _restore_config, (self.quant_name, dict(self.__dict__))

    class GraftLinearMethod(LinearMethodBase):
        """A linear layer computed by a QuantMethod plugin from its quantised tensors."""

        def __init__(self, plugin: QuantMethod, name: str) -> None:
            self.plugin, self.name = plugin, name
            self.key = next(_keys)
            self.out_features = 0
            self.names: tuple[str, ...] = ()
            _LINEAR[self.key] = self
            self._op = quant_linear_op()

        def _count(self, event: str) -> None:
            RUNTIME.count(Kind.QUANT, self.name, event)

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                           input_size, output_size, params_dtype, **extra_weight_attrs):
            weight_loader = extra_weight_attrs.pop("weight_loader")
            self.out_features = sum(output_partition_sizes)
            weight = Parameter(torch.empty(self.out_features, input_size_per_partition,
                                           dtype=params_dtype), requires_grad=False)
            layer.register_parameter("weight", weight)
            set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0,
                                      "weight_loader": weight_loader})
            set_weight_attrs(weight, extra_weight_attrs)

        def process_weights_after_loading(self, layer) -> None:
            tensors = check_quantized(self.plugin.quantize(layer.weight.data), self.name)
            install_tensors(layer, tensors)
            self.names = tuple(tensors)
            self._count("quantize")

        def apply(self, layer, x, bias=None):
            tensors = layer_tensors(layer)
            return self._op(x, [tensors[n] for n in self.names], bias, self.key)

        def compute(self, x, tensors, bias):
            """The custom op's body: runs eagerly on every call, compiled graph or not."""
            self._count("apply")
            out = self.plugin.apply(dict(zip(self.names, tensors)), x, bias)
            want = (*x.shape[:-1], self.out_features)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != x.dtype:
                got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out)
                raise ValueError(f"quant plugin {self.name!r}: apply() returned {got} for input "
                                 f"{tuple(x.shape)} {x.dtype}; expected shape {want} in {x.dtype}")
            return out

    return GraftQuantConfig, GraftLinearMethod


_classes: dict[str, type] = {}


def config_class(quant_name: str) -> type:
    """The config class for ``quant_name``, made once per process and registered into vLLM
    (idempotent: registering again is a no-op)."""
    from vllm.model_executor.layers.quantization import (
        _CUSTOMIZED_METHOD_TO_QUANT_CONFIG,
        register_quantization_config,
    )

    cls = _classes.get(quant_name)
    if cls is None:
        base = _vllm_classes()[0]
        ident = "".join(c if c.isalnum() else "_" for c in quant_name[len(PREFIX):])
        cls = type(f"GraftQuantConfig_{ident}", (base,), {"quant_name": quant_name,
                                                          "__module__": __name__})
        _classes[quant_name] = cls
    if _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(quant_name) is not cls:
        register_quantization_config(quant_name)(cls)
    return cls


def unregister(quant_name: str) -> None:
    """Take ``quant_name`` out of vLLM's registries (where :func:`config_class` put it)."""
    from vllm.model_executor.layers import quantization as q
    from vllm.platforms import current_platform

    q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.pop(quant_name, None)
    for names in (q.QUANTIZATION_METHODS, current_platform.supported_quantization):
        while quant_name in (names or []):
            names.remove(quant_name)


# ------------------------------------------------------------------------------ adapter
class QuantAdapter(Adapter):
    kind = Kind.QUANT
    owner = OWNER

    def __init__(self) -> None:
        self._registered: list[str] = []

    def engine_overrides(self, enabled: list[Enabled], plan: Plan) -> dict[str, Any]:
        (e,) = enabled  # the deployment allows one quant plugin
        return {"quantization": quantization_name(e.name)}

    def activate(self, enabled: list[Enabled], plan: Plan, runtime: Runtime) -> None:
        for e in enabled:
            name = quantization_name(e.name)
            config_class(name)
            if name not in self._registered:
                self._registered.append(name)

    def deactivate(self) -> None:
        for name in self._registered:
            unregister(name)
        self._registered.clear()


ADAPTER = QuantAdapter()

__all__ = ["ADAPTER", "quantization_name", "config_class", "check_quantized", "install_tensors",
           "layer_tensors", "keeps_storage"]
