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

Pre-quantised checkpoints (written by ``vllm-graft quantize``, ``tools/quant/quantize.py``):
``config.json`` has ``"quantization_config": {"quant_method": "graft-<plugin>", "graft_format":
1, "params": {...}, "embeddings": bool}``; vLLM detects it without a flag and calls
``from_config(that dict)`` (checked by :func:`checkpoint_config`). The bridge enables the
plugin with the checkpoint's params when no deployment (or one without ``quant``) is given
(:func:`checkpoint_deployment`); a deployment's different params are refused. Each linear
layer (and, if ``embeddings`` and the plugin ``covers_embeddings``, ``embed_tokens`` and
``lm_head``: ``embedding()`` goes through a second opaque op, ``vllm_graft::quant_embed``)
registers the plugin's ``stored_tensors(out, in)`` instead of ``weight``: fixed-shape ones with
``output_dim=0`` and the layer's own ``weight_loader`` (vLLM fuses ``...q_proj.<name>`` into
``qkv_proj`` as it does ``weight``), ragged ones with a loader that keeps each shard; both
loaders check dtype and shape first and record which shards arrived. A trap ``weight``
parameter refuses an unquantised tensor. ``process_weights_after_loading`` checks that every
shard of every stored tensor arrived, calls ``verify`` per shard and ``load`` once, and keeps
the result as buffers; errors name the checkpoint tensor (``...k_proj.exponents``). vLLM
itself skips its "weights not initialized" check for quantised models, so these checks are
the only guard against a silently unloaded tensor. Events: ``load`` (layers loaded),
``embed`` (embedding calls).

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

from vllm_graft.integration.runtime import RUNTIME, Runtime
from vllm_graft.integration.adapters import Adapter

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
def _plugin_for(quant_name: str, checkpoint: dict[str, Any] | None = None) -> tuple[QuantMethod, str]:
    for e in RUNTIME.enabled(Kind.QUANT):
        if quantization_name(e.name) == quant_name:
            plugin = RUNTIME.instance(e)
            if checkpoint is not None:
                check_checkpoint_params(plugin, e.name, checkpoint)  # type: ignore[arg-type]
            return plugin, e.name  # type: ignore[return-value]
    raise RuntimeError(
        f"quantization {quant_name!r} is vllm-graft's and needs a deployment that enables the "
        f"quant plugin {quant_name[len(PREFIX):]!r} (additional_config={{'graft': {{...}}}} or "
        "VLLM_GRAFT_DEPLOYMENT); it cannot be used with --quantization alone")


# ------------------------------------------------------------ pre-quantised checkpoints
#: Version of the checkpoint layout written by ``vllm-graft quantize``.
CHECKPOINT_FORMAT = 1
#: vLLM's fused linear layers and the checkpoint layers whose shards they hold, in order.
FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_config(config: Any, quant_name: str) -> dict[str, Any]:
    """A checkpoint's ``quantization_config`` for ``quant_name``, checked: ``{"quant_method",
    "graft_format", "params", "embeddings"}`` (what ``vllm-graft quantize`` writes)."""
    where = f"config.json quantization_config (quant_method {quant_name!r})"
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must be a mapping, got {type(config).__name__}")
    method = config.get("quant_method")
    if method != quant_name:
        raise ValueError(f"{where}: quant_method is {method!r}; this checkpoint is not "
                         f"{quant_name!r}'s")
    fmt = config.get("graft_format")
    if fmt != CHECKPOINT_FORMAT:
        raise ValueError(f"{where}: graft_format is {fmt!r}, this vllm-graft reads format "
                         f"{CHECKPOINT_FORMAT}; rewrite the checkpoint with `vllm-graft quantize`")
    params = config.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{where}: params must be a mapping, got {params!r}")
    embeddings = config.get("embeddings", False)
    if not isinstance(embeddings, bool):
        raise ValueError(f"{where}: embeddings must be true or false, got {embeddings!r}")
    unknown = sorted(set(config) - {"quant_method", "graft_format", "params", "embeddings"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; the fields are quant_method, "
                         "graft_format, params, embeddings")
    return {"quant_method": method, "graft_format": fmt, "params": params, "embeddings": embeddings}


def check_checkpoint_params(plugin: QuantMethod, name: str, checkpoint: dict[str, Any]) -> None:
    """The deployment's plugin must be the one the checkpoint was written with."""
    have, want = plugin.checkpoint_params(), checkpoint["params"]
    if have != want:
        raise ValueError(
            f"the checkpoint was quantised by {name!r} with params {want}, but the deployment "
            f"enables it with {have}; drop quant.params from the deployment (they are read from "
            "the checkpoint) or give the same values")


def stored_specs(plugin: QuantMethod, name: str, out_features: int, in_features: int) -> dict[str, Any]:
    """``plugin.stored_tensors(out, in)``, checked, or an error if the plugin cannot load
    pre-quantised checkpoints."""
    from vllm_graft.hooks import StoredTensor

    specs = plugin.stored_tensors(out_features, in_features)
    if specs is None:
        raise ValueError(f"quant plugin {name!r} quantises online only (no stored_tensors): it "
                         "cannot load a pre-quantised checkpoint; use the unquantised model")
    if not isinstance(specs, dict) or not specs:
        raise TypeError(f"quant plugin {name!r}: stored_tensors() must return a non-empty dict")
    for tname, spec in specs.items():
        if not (isinstance(tname, str) and tname.isidentifier()) or tname == "weight":
            raise TypeError(f"quant plugin {name!r}: stored tensor name {tname!r} must be an "
                            "identifier other than 'weight'")
        if not isinstance(spec, StoredTensor):
            raise TypeError(f"quant plugin {name!r}: stored_tensors()[{tname!r}] must be a "
                            f"StoredTensor, got {type(spec).__name__}")
        if spec.ragged and tuple(spec.shape) != (-1,):
            raise TypeError(f"quant plugin {name!r}: ragged tensor {tname!r} must have shape (-1,)")
        if not spec.ragged and (not spec.shape or spec.shape[0] % out_features):
            raise TypeError(f"quant plugin {name!r}: stored tensor {tname!r} {spec.shape}: dim 0 "
                            f"must be a multiple of the {out_features} output rows")
    return specs


def checkpoint_tensor_name(prefix: str, tname: str, idx: int | None, n_shards: int) -> str:
    """The checkpoint name of stored tensor ``tname`` of layer ``prefix`` (vLLM's name), for
    shard ``idx`` of a fused layer: ``model.layers.0.self_attn.qkv_proj`` shard 1 ->
    ``model.layers.0.self_attn.k_proj.<tname>``."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_LAYERS.get(last)
    if idx is not None and parts is not None and len(parts) == n_shards:
        return f"{head + '.' if head else ''}{parts[idx]}.{tname}"
    if idx is not None and n_shards > 1:
        return f"{prefix}.{tname} (shard {idx})"
    return f"{prefix}.{tname}" if prefix else tname


def model_checkpoint_quant(model: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a local model folder's ``config.json`` if it names a
    vllm-graft method (``graft-<plugin>``), else None."""
    import json
    from pathlib import Path

    if not model:
        return None
    path = Path(str(model)) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if isinstance(q, dict) and str(q.get("quant_method", "")).startswith(PREFIX):
        return q
    return None


def checkpoint_deployment(model: Any) -> dict[str, Any] | None:
    """The deployment that a pre-quantised vllm-graft checkpoint implies when none is given:
    its quant plugin, with the params it was written with."""
    q = model_checkpoint_quant(model)
    if q is None:
        return None
    params = q.get("params") if isinstance(q.get("params"), dict) else {}
    return {"quant": {"plugin": str(q["quant_method"])[len(PREFIX):], "params": params}}


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
def quant_embed_op() -> Any:
    """``torch.ops.vllm_graft.quant_embed(ids, tensors, key)``: rows ``ids`` of the embedding
    table that the method with key ``key`` stores as ``tensors`` (opaque, like quant_linear)."""
    import torch

    @torch.library.custom_op("vllm_graft::quant_embed", mutates_args=(),
                             schema="(Tensor ids, Tensor[] tensors, int key) -> Tensor")
    def quant_embed(ids, tensors, key):
        return _LINEAR[key].compute_embedding(ids, tensors)

    @quant_embed.register_fake
    def _(ids, tensors, key):
        m = _LINEAR[key]
        return ids.new_empty((*ids.shape, m.in_features), dtype=m.params_dtype)

    return quant_embed


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
            from vllm.model_executor.layers.vocab_parallel_embedding import (
                ParallelLMHead,
                VocabParallelEmbedding,
            )

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

    class GraftLinearMethod(LinearMethodBase):
        """A linear layer (or, for a pre-quantised checkpoint of a plugin that
        ``covers_embeddings``, an embedding table or LM head) computed by a QuantMethod
        plugin from its quantised tensors."""

        def __init__(self, plugin: QuantMethod, name: str, prefix: str = "",
                     prequantized: bool = False) -> None:
            self.plugin, self.name, self.prefix = plugin, name, prefix
            self.prequantized = prequantized
            self.key = next(_keys)
            self.out_features = 0
            self.names: tuple[str, ...] = ()
            _LINEAR[self.key] = self
            # Both ops are made here, not on first call: that call may be traced by torch.compile.
            self._op = quant_linear_op()
            self._embed_op = quant_embed_op()

        def _count(self, event: str) -> None:
            RUNTIME.count(Kind.QUANT, self.name, event)

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                           input_size, output_size, params_dtype, **extra_weight_attrs):
            weight_loader = extra_weight_attrs.pop("weight_loader")
            self.out_features = sum(output_partition_sizes)
            self.in_features = input_size_per_partition
            self.shard_rows = list(output_partition_sizes)
            self.params_dtype = params_dtype
            if self.prequantized:
                self._create_stored(layer, weight_loader, extra_weight_attrs)
                return
            weight = Parameter(torch.empty(self.out_features, input_size_per_partition,
                                           dtype=params_dtype), requires_grad=False)
            layer.register_parameter("weight", weight)
            set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0,
                                      "weight_loader": weight_loader})
            set_weight_attrs(weight, extra_weight_attrs)

        # ---------------------------------------------------------- pre-quantised
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

        def _refuse_weight(self, param, loaded, shard_id=None) -> None:
            idx = None if shard_id is None else self._shard("weight", shard_id)
            raise ValueError(
                f"{self.tensor_name('weight', idx)}: an unquantised weight in a "
                f"{self.plugin_label()} checkpoint, which stores {', '.join(self.specs)} for this "
                "layer; the checkpoint is corrupt or mixed (rewrite it with `vllm-graft quantize`)")

        def _shard(self, tname: str, shard_id: Any) -> int | None:
            n = len(self.shard_rows)
            if shard_id is None:
                return None
            idx = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
            if not isinstance(idx, int) or not 0 <= idx < n:
                raise ValueError(f"{self.tensor_name(tname, None)}: unexpected shard {shard_id!r}")
            return idx

        def tensor_name(self, tname: str, idx: int | None) -> str:
            return checkpoint_tensor_name(self.prefix, tname, idx, len(self.shard_rows))

        def _check(self, tname: str, idx: int | None, loaded, want_shape) -> None:
            spec = self.specs[tname]
            label = self.tensor_name(tname, idx)
            if str(loaded.dtype).removeprefix("torch.") != spec.dtype:
                raise ValueError(f"{label}: stored as {loaded.dtype}, but {self.name!r} stores "
                                 f"{spec.dtype}; the checkpoint is corrupt or from another method")
            if want_shape is not None and tuple(loaded.shape) != tuple(want_shape):
                raise ValueError(f"{label}: shape {tuple(loaded.shape)}, expected {tuple(want_shape)} "
                                 f"for a [{self._rows(idx)}, {self.in_features}] weight")

        def _rows(self, idx: int | None) -> int:
            return self.out_features if idx is None else self.shard_rows[idx]

        def _load_rows(self, tname, weight_loader, param, loaded, shard_id=None) -> None:
            idx = self._shard(tname, shard_id)
            spec = self.specs[tname]
            rows = self._rows(idx) * spec.shape[0] // self.out_features
            self._check(tname, idx, loaded, (rows, *spec.shape[1:]))
            if shard_id is None:
                weight_loader(param, loaded)
            else:
                weight_loader(param, loaded, shard_id)
            self.seen[tname].add(idx)

        def _collect(self, tname, param, loaded, shard_id=None) -> None:
            idx = self._shard(tname, shard_id)
            self._check(tname, idx, loaded, None)
            if loaded.dim() != 1:
                raise ValueError(f"{self.tensor_name(tname, idx)}: shape {tuple(loaded.shape)}, "
                                 "expected a 1-D tensor")
            self.parts[tname][idx] = loaded.detach().clone()
            self.seen[tname].add(idx)

        def _stored_parts(self, layer) -> dict[str, list]:
            n = len(self.shard_rows)
            out: dict[str, list] = {}
            for tname, spec in self.specs.items():
                seen = self.seen[tname]
                whole = None in seen
                missing = [] if whole else [i for i in range(n) if i not in seen]
                if missing or not seen:
                    names = [self.tensor_name(tname, i) for i in (missing or [None])]
                    raise ValueError(f"{', '.join(names)}: missing from the checkpoint (a "
                                     f"{self.plugin_label()} checkpoint stores "
                                     f"{', '.join(self.specs)} for every quantised layer)")
                if spec.ragged:
                    out[tname] = [self.parts[tname][None]] if whole else \
                        [self.parts[tname][i] for i in range(n)]
                else:
                    data = getattr(layer, tname).data
                    k = spec.shape[0] // self.out_features
                    out[tname] = [data] if whole else \
                        list(torch.split(data, [r * k for r in self.shard_rows], 0))
            counts = {len(v) for v in out.values()}
            if len(counts) != 1:  # some tensors stored fused, others per shard
                raise ValueError(f"layer {self.prefix}: its stored tensors mix fused and per-shard "
                                 "checkpoint entries; rewrite the checkpoint with `vllm-graft quantize`")
            for i in range(counts.pop()):
                idx = None if len(out[next(iter(out))]) == 1 else i
                try:
                    self.plugin.verify({k: v[i] for k, v in out.items()})
                except ValueError as e:
                    key, sep, rest = str(e).partition(": ")
                    names = [self.tensor_name(k.strip(), idx) for k in key.split("/")]
                    if sep and all(k.strip() in self.specs for k in key.split("/")):
                        raise ValueError(f"{', '.join(names)}: {rest}") from e
                    raise ValueError(f"layer {self.prefix} (shard {idx}): {e}") from e
            return out

        def plugin_label(self) -> str:
            return quantization_name(self.name)

        def process_weights_after_loading(self, layer) -> None:
            if self.prequantized:
                stored = self._stored_parts(layer)
                rows = self.shard_rows if len(stored[next(iter(stored))]) > 1 else [self.out_features]
                try:
                    tensors = self.plugin.load(stored, rows)
                except ValueError as e:
                    raise ValueError(f"{self.plugin_label()} checkpoint, layer {self.prefix}: {e}") from e
                tensors = check_quantized(tensors, self.name)
                for tname in (*self.specs, "weight"):
                    delattr(layer, tname)
                self.parts = {}
                for tname, t in tensors.items():
                    layer.register_buffer(BUFFER_PREFIX + tname, t, persistent=False)
                layer.graft_tensor_names = tuple(tensors)
                self.names = tuple(tensors)
                self._count("load")
                return
            tensors = self.plugin.quantize(layer.weight.data)
            if self.plugin.stored_tensors(self.out_features, self.in_features) is not None:
                tensors = self.plugin.load({k: [v] for k, v in tensors.items()}, [self.out_features])
            tensors = check_quantized(tensors, self.name)
            install_tensors(layer, tensors)
            self.names = tuple(tensors)
            self._count("quantize")

        def apply(self, layer, x, bias=None):
            tensors = layer_tensors(layer)
            return self._op(x, [tensors[n] for n in self.names], bias, self.key)

        def embedding(self, layer, ids):
            tensors = layer_tensors(layer)
            return self._embed_op(ids, [tensors[n] for n in self.names], self.key)

        def compute_embedding(self, ids, tensors):
            self._count("embed")
            out = self.plugin.embed(dict(zip(self.names, tensors)), ids)
            want = (*ids.shape, self.in_features)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
                raise ValueError(f"quant plugin {self.name!r}: embed() returned "
                                 f"{getattr(out, 'shape', type(out))}; expected {want}")
            return out

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
           "layer_tensors", "keeps_storage", "checkpoint_config", "checkpoint_deployment",
           "checkpoint_tensor_name", "stored_specs", "CHECKPOINT_FORMAT"]
