"""The quantization contract: quantise a linear layer's weight and compute with it."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kinds import Kind
from .base import P, PluginImpl

if TYPE_CHECKING:  # torch is only needed by implementations
    import torch


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a quantised layer keeps in a checkpoint, for an ``[out, in]`` weight.

    ``shape[0]`` is the weight's output rows (``out``): vLLM's weight loaders fuse the
    shards of q/k/v and gate/up along it, as they fuse ``weight``. A ``ragged`` tensor is
    1-D with a length only the checkpoint knows (``shape == (-1,)``, e.g. an entropy-coded
    stream); it is not fused: :meth:`QuantMethod.load` gets one per shard. ``dtype`` is a
    torch dtype name (``"uint8"``, ``"int8"``, ``"float16"``, ``"bfloat16"``, ...).
    """

    shape: tuple[int, ...]
    dtype: str
    ragged: bool = False


class QuantMethod(PluginImpl[P]):
    """Quantises a linear layer's weight and computes with the quantised form.

    Online (an unquantised checkpoint, ``quant: {plugin: NAME}`` in a deployment): vLLM
    loads the full-precision weight ``[out, in]`` (fused q/k/v and gate/up shards
    included), then ``apply`` computes with ``load({name: [t]}, [out])`` of
    ``quantize(weight)``.

    Pre-quantised checkpoints (optional: a plugin that only quantises online leaves
    :meth:`stored_tensors` returning ``None``). ``vllm-graft quantize NAME MODEL OUT`` writes,
    for every linear weight ``P.weight`` of ``MODEL``, the tensors ``P.<name>`` that
    ``quantize`` returns, and in ``config.json`` ``"quantization_config": {"quant_method":
    "graft-NAME", "graft_format": 1, "params": {...}, "embeddings": bool}`` where ``params``
    is :meth:`checkpoint_params`. vLLM picks such a checkpoint up without a flag; each layer
    then registers :meth:`stored_tensors` instead of ``weight``, vLLM's weight loaders fill
    them (fusing shards along dim 0), :meth:`verify` checks each shard, and :meth:`load` turns
    them, split per shard, into the tensors ``apply`` gets. A missing tensor, an unquantised
    ``weight`` where stored tensors belong, a wrong shape or dtype, or a ``verify`` that
    raises, stops loading with an error naming the checkpoint tensor.

    Shapes and names. ``weight`` is ``[out, in]`` in the model's dtype (q/k/v and gate/up
    arrive fused along ``out``). ``apply``'s ``x`` is ``[..., in]`` in the same dtype; in vLLM's
    engine ``[T, in]``, the step's tokens flattened (``T`` varies per step, 1 at a decode step
    of one request); it returns ``[..., out]`` in ``x``'s dtype, ``bias`` (``[out]`` or None)
    added. ``quantize`` may keep the full weight among its tensors (a method that computes
    densely, or keeps a dense remainder): the layer then keeps its memory too. The tensor name
    ``weight`` is reserved for a checkpoint's unquantised weight: :meth:`stored_tensors` may not
    use it (a pre-quantised checkpoint must not hold ``P.weight``).

    What the plugin did: the adapter counts ``apply`` and ``embed`` calls per process; a plugin
    reports anything of its own through :meth:`~PluginImpl.describe` (a JSON-able dict, e.g.
    ``{"layers": n, "outlier_channels": k}``), which ``vllm-graft report --json`` shows per
    process as ``described``.

    Error (a lossy method): :meth:`error_bound` states the largest relative error ``apply``
    makes on one layer; the conformance kit fails the plugin beyond it, on random weights and
    on a structured layer with a decaying spectrum and outlier channels (what low-rank and
    outlier methods are for, and where a broken low-rank or outlier path shows).

    Devices and CUDA graphs (vLLM on a GPU). The weight ``quantize`` gets, and a checkpoint's
    stored tensors ``verify``/``load`` get, are on the accelerator (online, ``load`` gets what
    ``quantize`` returned, where it made it); the host moves whatever they return to the weight's device (so NumPy-built tables are fine there, and host syncs such as
    ``.item()`` are fine at load). ``apply`` and ``embed`` run inside vLLM's CUDA graphs: they
    must make every tensor on the device of those given (``device=x.device``) and never read a
    tensor's value on the host (no ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, no
    data-dependent Python); their Python runs once, at capture.
    """

    kind = Kind.QUANT

    #: True if the method also stores the embedding table and the LM head (pre-quantised
    #: checkpoints; they are then computed by :meth:`embed` and :meth:`apply`).
    covers_embeddings: bool = False

    @abstractmethod
    def quantize(self, weight: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """The tensors that replace ``weight`` ``[out, in]`` in a checkpoint."""

    @abstractmethod
    def apply(
        self, tensors: dict[str, "torch.Tensor"], x: "torch.Tensor", bias: "torch.Tensor | None"
    ) -> "torch.Tensor":
        """``x @ W.T + bias`` computed from the quantised ``tensors``."""

    def error_bound(self, layer: str) -> float | None:
        """The largest relative error ``||apply(x) - (x @ W.T + b)|| / ||x @ W.T + b||`` this
        method makes on one layer at these parameters, on the conformance kit's layers of kind
        ``layer`` (``kit/conformance/exercises/quant.py``): ``"random"`` (``randn`` weights and
        activations: a flat spectrum, no outliers) or ``"structured"`` (singular values falling
        as ``1/(1+i)``, 1 input channel in 32 an outlier in weight and activations, as in a
        trained model: where a low-rank or outlier path carries the result, so a broken one
        shows). The kit fails a lossy plugin whose error exceeds the bound on any such layer;
        measure yours there (``pytest --graft-conformance quant:NAME``: the contract check's
        result gives each layer's error in the first dtype) and declare it with a margin.
        ``None`` (default): no bound; the kit then only asks for better than returning zeros
        (1.0), and its result says the bound is missing. A lossless method
        (``capabilities.lossless``) is held to the dtype's rounding instead."""
        return None

    def stored_tensors(self, out_features: int, in_features: int) -> dict[str, StoredTensor] | None:
        """What ``quantize`` returns for an ``[out, in]`` weight (names, shapes, dtypes), so
        a pre-quantised checkpoint can be loaded. ``None`` (default): online only."""
        return None

    def checkpoint_params(self) -> dict[str, Any]:
        """The parameters written into a checkpoint's ``quantization_config.params``; a
        checkpoint is loaded with a plugin built from them. Default: all parameters."""
        return self.params.model_dump(mode="json")

    def verify(self, shard: dict[str, "torch.Tensor"]) -> None:
        """Check one shard's stored tensors as read from a checkpoint (e.g. a checksum);
        raise ``ValueError("<tensor name>: what is wrong")`` so the error names the
        checkpoint tensor. Called once per shard before :meth:`load`. Default: nothing."""

    def load(self, stored: dict[str, list["torch.Tensor"]], shard_rows: list[int]) -> dict[str, "torch.Tensor"]:
        """The tensors ``apply`` computes with, from a layer's stored tensors, each given as
        one tensor per shard (``shard_rows``: the output rows of each shard, e.g. q, k, v).
        Raise ``ValueError`` naming the tensor (the key) if one is corrupt.
        Default: each name's shards concatenated along dim 0."""
        import torch

        return {k: v[0] if len(v) == 1 else torch.cat(v, 0) for k, v in stored.items()}

    def dense_weight(self, tensors: dict[str, "torch.Tensor"]) -> "torch.Tensor | None":
        """The dense weight ``[out, in]`` (in the layer's dtype) when :meth:`apply` is exactly
        ``F.linear(x, W, bias)`` with it, for instance a method that keeps full precision.
        The host then computes the layer with its own dense GEMM (vLLM's unquantised linear
        method: prepacked oneDNN on CPU, cuBLAS on CUDA) and never calls :meth:`apply`.
        ``None`` (default): :meth:`apply` computes every call."""
        return None

    def embed(self, tensors: dict[str, "torch.Tensor"], ids: "torch.Tensor") -> "torch.Tensor":
        """Rows ``ids`` of the embedding table stored as ``tensors`` (``covers_embeddings``)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not store embedding tables")
