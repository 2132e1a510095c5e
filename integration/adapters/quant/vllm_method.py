"""The quant adapter's vLLM classes: :class:`GraftQuantConfig` (a ``QuantizationConfig``, one
subclass per plugin, registered by :func:`config_class`) and :class:`GraftLinearMethod` (a
``LinearMethodBase``). Imports vLLM: :mod:`.engine` imports this module only when it
activates a deployment (and vLLM imports it when it unpickles a config).

``get_quant_method(layer, prefix)`` returns a ``GraftLinearMethod`` for every ``LinearBase``
layer built with the quant config and, for a pre-quantised checkpoint with ``embeddings``,
for ``VocabParallelEmbedding``/``ParallelLMHead``; ``None`` for everything else, which vLLM
then runs unquantised.

Per linear layer, ``create_weights`` registers a full-precision ``weight`` ``[out, in]``
(``input_dim=1, output_dim=0``) with the layer's own ``weight_loader``, so vLLM loads fused
q/k/v and gate/up shards into it as usual; for a pre-quantised checkpoint it registers the
plugin's stored tensors and a trap ``weight`` instead. Everything after that (quantising or
loading, the calls) is :class:`~.linear.PluginLinear`, free of vLLM.

The config classes are made at run time (one per plugin), so a config instance pickles by
name (``__reduce__``): vLLM sends its config, quant config included, to the engine process,
where unpickling rebuilds and registers the class before the bridge activates there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers import quantization as vllm_quantization
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.utils import set_weight_attrs

from ....hooks import Kind, QuantMethod

from ...runtime import RUNTIME
from .checkpoint import (
    PREFIX,
    check_checkpoint_params,
    checkpoint_config,
    quantization_name,
    stored_specs,
)
from .linear import PluginLinear


def _plugin_for(quant_name: str, checkpoint: dict[str, Any] | None = None) -> tuple[QuantMethod, str]:
    for e in RUNTIME.enabled(Kind.QUANT):
        if quantization_name(e.name) == quant_name:
            plugin = RUNTIME.instance(e)
            if checkpoint is not None:
                check_checkpoint_params(plugin, e.name, checkpoint)
            return plugin, e.name
    raise RuntimeError(
        f"quantization {quant_name!r} is vllm-graft's and needs a deployment that enables the "
        f"quant plugin {quant_name[len(PREFIX) :]!r} (additional_config={{'graft': {{...}}}} or "
        "VLLM_GRAFT_DEPLOYMENT); it cannot be used with --quantization alone"
    )


class GraftQuantConfig(QuantizationConfig):
    """One subclass per plugin (see :func:`config_class`) sets ``quant_name``."""

    quant_name: str = ""
    #: The checkpoint's quantization_config (checked), for a pre-quantised checkpoint.
    checkpoint: dict[str, Any] | None = None

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
        """A pre-quantised checkpoint's ``quantization_config`` (vLLM checked that its
        ``quant_method`` is this config's name)."""
        cfg = cls()
        cfg.checkpoint = checkpoint_config(config, cls.quant_name)
        return cfg

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        ckpt = getattr(self, "checkpoint", None)
        if isinstance(layer, LinearBase):
            plugin, name = _plugin_for(self.quant_name, ckpt)
            return GraftLinearMethod(plugin, name, prefix, ckpt is not None)
        if ckpt is not None and ckpt["embeddings"] and isinstance(layer, VocabParallelEmbedding):
            plugin, name = _plugin_for(self.quant_name, ckpt)
            if not prefix:  # Llama builds embed_tokens without a prefix
                prefix = "lm_head" if isinstance(layer, ParallelLMHead) else "model.embed_tokens"
            return GraftLinearMethod(plugin, name, prefix, True)
        return None  # vLLM runs the layer unquantised

    def __reduce__(self):
        return _restore_config, (self.quant_name, dict(self.__dict__))


class GraftLinearMethod(PluginLinear, LinearMethodBase):
    """A linear layer (or, for a pre-quantised checkpoint of a plugin that
    ``covers_embeddings``, an embedding table or LM head) computed by a QuantMethod plugin
    from its quantised tensors; vLLM's side is ``create_weights``, the rest is
    :class:`~.linear.PluginLinear`."""

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        self.out_features = sum(output_partition_sizes)
        self.in_features = input_size_per_partition
        self.shard_rows = list(output_partition_sizes)
        self.params_dtype = params_dtype
        if self.prequantized:
            self._create_stored(layer, weight_loader, extra_weight_attrs)
            return
        weight = Parameter(
            torch.empty(self.out_features, input_size_per_partition, dtype=params_dtype), requires_grad=False
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        set_weight_attrs(weight, extra_weight_attrs)

    def _host_gemm(self, layer, weight):
        """vLLM's own unquantised linear method on ``layer`` with ``weight`` (on CPU it
        prepacks the weight for oneDNN and drops ``layer.weight``); None for an embedding
        table or LM head, which vLLM computes otherwise."""
        if not isinstance(layer, LinearBase):
            return None
        if "weight" in layer._parameters:
            del layer.weight
        layer.register_parameter("weight", Parameter(weight.detach(), requires_grad=False))
        method = UnquantizedLinearMethod()
        method.process_weights_after_loading(layer)
        return method

    def _create_stored(self, layer, weight_loader, extra_weight_attrs) -> None:
        specs = stored_specs(self.plugin, self.name, self.out_features, self.in_features)
        self.specs = specs
        self.seen: dict[str, set] = {n: set() for n in specs}
        self.parts: dict[str, dict] = {n: {} for n in specs}
        for tname, spec in specs.items():
            dtype = getattr(torch, spec.dtype)
            if spec.ragged:
                param = Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
                loader = functools.partial(self._collect, tname)
            else:
                param = Parameter(torch.empty(spec.shape, dtype=dtype), requires_grad=False)
                loader = functools.partial(self._load_rows, tname, weight_loader)
                set_weight_attrs(param, {"output_dim": 0})
            layer.register_parameter(tname, param)
            set_weight_attrs(param, {"weight_loader": loader})
            set_weight_attrs(param, extra_weight_attrs)
        # A full-precision `weight` in a pre-quantised checkpoint is an error, not loaded.
        trap = Parameter(torch.empty(0), requires_grad=False)
        layer.register_parameter("weight", trap)
        set_weight_attrs(trap, {"weight_loader": self._refuse_weight})


# ----------------------------------------------------------------- registration with vLLM
_classes: dict[str, type] = {}


def config_class(quant_name: str) -> type:
    """The config class for ``quant_name``, made once per process and registered into vLLM
    (idempotent: registering again is a no-op)."""
    cls = _classes.get(quant_name)
    if cls is None:
        ident = "".join(c if c.isalnum() else "_" for c in quant_name[len(PREFIX) :])
        cls = type(f"GraftQuantConfig_{ident}", (GraftQuantConfig,), {"quant_name": quant_name, "__module__": __name__})
        _classes[quant_name] = cls
    if vllm_quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(quant_name) is not cls:
        vllm_quantization.register_quantization_config(quant_name)(cls)
    return cls


def _restore_config(quant_name: str, state: dict[str, Any]) -> Any:
    """Unpickling a config (vLLM sends its config to the engine process): the class is
    rebuilt and registered here, as it is made at run time and cannot be found by name."""
    cfg = config_class(quant_name)()
    cfg.__dict__.update(state)
    return cfg


def unregister(quant_name: str) -> None:
    """Take ``quant_name`` out of vLLM's registries (where :func:`config_class` put it)."""
    from vllm.platforms import current_platform  # resolved when called, as vLLM does

    vllm_quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.pop(quant_name, None)
    for names in (vllm_quantization.QUANTIZATION_METHODS, current_platform.supported_quantization):
        while quant_name in (names or []):
            names.remove(quant_name)


__all__ = ["GraftQuantConfig", "GraftLinearMethod", "config_class", "unregister"]
