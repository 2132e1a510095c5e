"""What a quantised linear layer does with its QuantMethod plugin, free of vLLM:
:class:`PluginLinear`, the logic half of :class:`~.vllm_method.GraftLinearMethod` (which adds
vLLM's ``create_weights``).

Online quantisation: ``process_weights_after_loading`` (called by vLLM's
``model_loader/utils.py: process_weights_after_loading``) calls
``QuantMethod.quantize(weight)`` and keeps the result on the layer (:mod:`.tensors`);
``apply(layer, x, bias)`` calls ``QuantMethod.apply(tensors, x, bias)`` through the opaque op.

Pre-quantised checkpoints (:mod:`.checkpoint`): each layer (and, if ``embeddings`` and the
plugin ``covers_embeddings``, ``embed_tokens`` and ``lm_head``) registers the plugin's
``stored_tensors(out, in)`` instead of ``weight``: fixed-shape ones are loaded by the layer's
own ``weight_loader`` (vLLM fuses ``...q_proj.<name>`` into ``qkv_proj`` as it does
``weight``) through :meth:`PluginLinear._load_rows`, ragged ones by
:meth:`PluginLinear._collect`, which keeps each shard; both check dtype and shape first and
record which shards arrived. A trap ``weight`` refuses an unquantised tensor
(:meth:`PluginLinear._refuse_weight`). ``process_weights_after_loading`` checks that every
shard of every stored tensor arrived, calls ``verify`` per shard and ``load`` once, and keeps
the result as buffers; errors name the checkpoint tensor (``...k_proj.exponents``). vLLM
itself skips its "weights not initialized" check for quantised models, so these checks are
the only guard against a silently unloaded tensor.

Devices (:func:`~.tensors.follow_device`): the layer's device is that of its loaded
parameters (``weight``, or for a pre-quantised checkpoint its fixed-shape stored tensors),
which vLLM creates on the accelerator. Ragged tensors, kept from the checkpoint reader (on the
host), are moved there before ``verify``/``load``, so a shard's tensors share one device; and
whatever ``quantize``/``load`` return is moved there before it becomes a buffer or the host's
dense weight. Syncs and host work in ``verify``/``load``/``quantize`` are fine (load time);
``apply`` runs inside vLLM's CUDA graphs and must not sync (see :mod:`.tensors`).

A method whose ``dense_weight(tensors)`` gives a dense weight (its ``apply`` is exactly
``F.linear`` with it) is handed to the host's own dense GEMM instead (:meth:`PluginLinear._host_gemm`;
in vLLM, its unquantised linear method, which prepacks the weight for oneDNN on CPU): no
opaque op, no per-call Python, and ``apply`` is not called.

Events counted: ``quantize`` (layers quantised), ``load`` (layers loaded), ``dense`` (layers
handed to the host's dense GEMM), ``apply`` (linear calls through the plugin), ``embed``
(embedding calls), ``captured`` (linear or embedding calls captured into a CUDA graph: their
replays run no Python and are not counted; see :mod:`.tensors`).
"""

from __future__ import annotations

from typing import Any

import torch

from ....hooks import Kind, QuantMethod

from ...runtime import RUNTIME
from ..plugin_calls import raised
from .checkpoint import checkpoint_tensor_name, quantization_name
from .tensors import (
    BUFFER_PREFIX,
    capturing,
    check_quantized,
    follow_device,
    install_tensors,
    layer_tensors,
    quant_embed_op,
    quant_linear_op,
    register_linear,
)


class PluginLinear:
    """A linear layer (or, for a pre-quantised checkpoint of a plugin that
    ``covers_embeddings``, an embedding table or LM head) computed by a QuantMethod plugin
    from its quantised tensors. ``create_weights`` (vLLM's side) sets ``out_features``,
    ``in_features``, ``shard_rows`` and ``params_dtype``, and for a pre-quantised checkpoint
    ``specs``, ``seen`` and ``parts``."""

    # set by create_weights (vllm_method.GraftLinearMethod), not here
    in_features: int
    shard_rows: list[int]
    params_dtype: Any
    specs: dict[str, Any]  # pre-quantised: stored tensor name -> its spec
    seen: dict[str, set[int | None]]  # pre-quantised: shards loaded per stored tensor
    parts: dict[str, Any]  # pre-quantised: ragged shards kept until all arrived

    def __init__(self, plugin: QuantMethod, name: str, prefix: str = "", prequantized: bool = False) -> None:
        self.plugin, self.name, self.prefix = plugin, name, prefix
        self.prequantized = prequantized
        self.out_features = 0
        self.names: tuple[str, ...] = ()
        self.key = register_linear(self)
        #: the host's dense linear method computing this layer, when the plugin gave a dense weight
        self.dense: Any = None
        # Both ops are made here, not on first call: that call may be traced by torch.compile.
        self._op = quant_linear_op()
        self._embed_op = quant_embed_op()

    def _count(self, event: str) -> None:
        RUNTIME.count(Kind.QUANT, self.name, event)

    # -------------------------------------------------------------- pre-quantised loading
    def _refuse_weight(self, param, loaded, shard_id=None) -> None:
        idx = None if shard_id is None else self._shard("weight", shard_id)
        raise ValueError(
            f"{self.tensor_name('weight', idx)}: an unquantised weight in a "
            f"{self.plugin_label()} checkpoint, which stores {', '.join(self.specs)} for this "
            "layer; the checkpoint is corrupt or mixed (rewrite it with `vllm-graft quantize`)"
        )

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
            raise ValueError(
                f"{label}: stored as {loaded.dtype}, but {self.name!r} stores "
                f"{spec.dtype}; the checkpoint is corrupt or from another method"
            )
        if want_shape is not None and tuple(loaded.shape) != tuple(want_shape):
            raise ValueError(
                f"{label}: shape {tuple(loaded.shape)}, expected {tuple(want_shape)} "
                f"for a [{self._rows(idx)}, {self.in_features}] weight"
            )

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
            raise ValueError(f"{self.tensor_name(tname, idx)}: shape {tuple(loaded.shape)}, expected a 1-D tensor")
        self.parts[tname][idx] = loaded.detach().clone()
        self.seen[tname].add(idx)

    def _device(self, layer):
        """Where the layer's tensors belong: the device of its loaded parameters (for a
        pre-quantised checkpoint, its fixed-shape stored tensors; the ragged ones and the trap
        ``weight`` are placeholders), else the host."""
        names = [t for t, spec in self.specs.items() if not spec.ragged] if self.prequantized else ["weight"]
        for tname in names:
            t = getattr(layer, tname, None)
            if isinstance(t, torch.Tensor):
                return t.device
        return torch.device("cpu")

    def _stored_parts(self, layer) -> dict[str, list]:
        n = len(self.shard_rows)
        device = self._device(layer)
        out: dict[str, list] = {}
        for tname, spec in self.specs.items():
            seen = self.seen[tname]
            whole = None in seen
            missing = [] if whole else [i for i in range(n) if i not in seen]
            if missing or not seen:
                names = [self.tensor_name(tname, i) for i in missing] if missing else [self.tensor_name(tname, None)]
                raise ValueError(
                    f"{', '.join(names)}: missing from the checkpoint (a "
                    f"{self.plugin_label()} checkpoint stores "
                    f"{', '.join(self.specs)} for every quantised layer)"
                )
            if spec.ragged:  # read from the checkpoint on the host: to the layer's device
                out[tname] = [
                    p.to(device)
                    for p in ([self.parts[tname][None]] if whole else [self.parts[tname][i] for i in range(n)])
                ]
            else:
                data = getattr(layer, tname).data
                k = spec.shape[0] // self.out_features
                out[tname] = [data] if whole else list(torch.split(data, [r * k for r in self.shard_rows], 0))
        counts = {len(v) for v in out.values()}
        if len(counts) != 1:  # some tensors stored fused, others per shard
            raise ValueError(
                f"layer {self.prefix}: its stored tensors mix fused and per-shard "
                "checkpoint entries; rewrite the checkpoint with `vllm-graft quantize`"
            )
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

    # ------------------------------------------------------------------ after loading
    def _host_gemm(self, layer, weight) -> Any:
        """The host's dense linear method, set up on ``layer`` to compute with ``weight``, or
        None where the host has none for this layer (here: none; the vLLM side overrides)."""
        return None

    def _use_dense(self, layer, tensors) -> bool:
        """Hand the layer to the host's dense GEMM if the plugin gives a dense weight."""
        weight = self.plugin.dense_weight(tensors)
        if weight is None:
            return False
        want = (self.out_features, self.in_features)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != want or weight.dtype != self.params_dtype:
            got = (
                f"a {tuple(weight.shape)} {weight.dtype} tensor"
                if isinstance(weight, torch.Tensor)
                else f"a {type(weight).__name__}"
            )
            raise ValueError(
                f"quant plugin {self.name!r}: dense_weight() returned {got}; "
                f"expected a tensor of shape {want} in {self.params_dtype} (or None "
                "to compute through apply())"
            )
        self.dense = self._host_gemm(layer, weight)
        if self.dense is None:
            return False
        self._count("dense")
        return True

    def process_weights_after_loading(self, layer) -> None:
        if self.prequantized:
            stored = self._stored_parts(layer)
            rows = self.shard_rows if len(stored[next(iter(stored))]) > 1 else [self.out_features]
            try:
                tensors = self.plugin.load(stored, rows)
            except ValueError as e:
                raise ValueError(f"{self.plugin_label()} checkpoint, layer {self.prefix}: {e}") from e
            tensors = follow_device(check_quantized(tensors, self.name), self._device(layer))
            for tname in (*self.specs, "weight"):
                delattr(layer, tname)
            self.parts = {}
            if self._use_dense(layer, tensors):
                self._count("load")
                return
            for tname, t in tensors.items():
                layer.register_buffer(BUFFER_PREFIX + tname, t, persistent=False)
            layer.graft_tensor_names = tuple(tensors)
            self.names = tuple(tensors)
            self._count("load")
            return
        tensors = self.plugin.quantize(layer.weight.data)
        if self.plugin.stored_tensors(self.out_features, self.in_features) is not None:
            tensors = self.plugin.load({k: [v] for k, v in tensors.items()}, [self.out_features])
        tensors = follow_device(check_quantized(tensors, self.name), layer.weight.device)
        self._count("quantize")
        if self._use_dense(layer, tensors):
            return
        install_tensors(layer, tensors)
        self.names = tuple(tensors)

    # -------------------------------------------------------------------------- calls
    def apply(self, layer, x, bias=None):
        if self.dense is not None:
            return self.dense.apply(layer, x, bias)
        tensors = layer_tensors(layer)
        return self._op(x, [tensors[n] for n in self.names], bias, self.key)

    def embedding(self, layer, ids):
        tensors = layer_tensors(layer)
        return self._embed_op(ids, [tensors[n] for n in self.names], self.key)

    def compute_embedding(self, ids, tensors):
        """The embedding op's body; graph-safe like :meth:`compute`."""
        self._count("captured" if capturing(ids) else "embed")
        try:
            out = self.plugin.embed(dict(zip(self.names, tensors)), ids)
        except Exception as e:
            raise raised("quant", self.name, "embed()", e) from e
        want = (*ids.shape, self.in_features)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            raise ValueError(
                f"quant plugin {self.name!r}: embed() returned {getattr(out, 'shape', type(out))}; expected {want}"
            )
        return out

    def compute(self, x, tensors, bias):
        """The custom op's body: runs eagerly on every call, compiled graph or not, but inside
        a CUDA graph only once, at capture. So it must not sync with the host (it reads shapes
        and dtypes only), and while capturing it counts ``captured``, not ``apply``."""
        self._count("captured" if capturing(x) else "apply")
        try:
            out = self.plugin.apply(dict(zip(self.names, tensors)), x, bias)
        except Exception as e:
            raise raised("quant", self.name, "apply()", e) from e
        want = (*x.shape[:-1], self.out_features)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != x.dtype:
            got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out)
            raise ValueError(
                f"quant plugin {self.name!r}: apply() returned {got} for input "
                f"{tuple(x.shape)} {x.dtype}; expected shape {want} in {x.dtype}"
            )
        return out


__all__ = ["PluginLinear"]
