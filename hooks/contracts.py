"""One small contract per plugin kind.

A registration's ``impl`` names a class implementing the contract of its kind. The
class is built with its validated parameter model instance (``cls(params, **context)``).
The vLLM adapters in ``vllm_graft.integration`` call these methods; nothing here knows
about vLLM, so a plugin is testable with plain tensors.

Shapes follow vLLM's conventions: query ``[T, H, D]`` (tokens of all sequences packed),
paged KV cache ``[num_blocks, H_kv, block_size, 2*D]`` (per block and head: the keys, then the
values; see :func:`split_kv_cache`),
block tables ``[num_seqs, max_blocks]`` of physical block ids.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar

from pydantic import BaseModel

from .registry import Kind

if TYPE_CHECKING:  # torch is only needed by implementations
    import torch

P = TypeVar("P", bound=BaseModel)


class PluginImpl(ABC, Generic[P]):
    """Base of every contract: holds the validated parameters."""

    kind: Kind

    def __init__(self, params: P) -> None:
        self.params = params

    def describe(self) -> dict[str, Any]:
        """What the plugin did so far, for `vllm-graft demo` and benchmark reports."""
        return {}


# ---------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttentionLayer:
    """Static facts about one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    block_size: int


@dataclass
class PagedBatch:
    """One step's batch in paged form.

    ``query_start_loc[i]:query_start_loc[i+1]`` are sequence i's query rows;
    ``seq_lens[i]`` counts its tokens including the new ones (its queries are the last
    ``q_len`` positions, attending causally); ``block_table[i]`` lists its physical blocks.
    """

    query_start_loc: "torch.Tensor"  # [num_seqs + 1] int32
    seq_lens: "torch.Tensor"  # [num_seqs] int32
    block_table: "torch.Tensor"  # [num_seqs, max_blocks] int32


def split_kv_cache(kv_cache: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(key_cache, value_cache)``, each ``[num_blocks, H_kv, block_size, D]``, as views of
    one layer's paged cache ``[num_blocks, H_kv, block_size, 2*D]``.

    The last two dims are not "K and V side by side per token": for each block and KV head
    the memory holds the block's keys ``[block_size, D]`` followed by its values (vLLM's CPU
    layout, read by its kernel as ``view(N, H_kv, 2*block_size, D).chunk(2, dim=2)``).
    """
    n, h, b, d2 = kv_cache.shape
    kv = kv_cache.view(n, h, 2, b, d2 // 2)
    return kv[:, :, 0], kv[:, :, 1]


class AttentionMethod(PluginImpl[P]):
    """Attention over a paged KV cache."""

    kind = Kind.ATTENTION

    def plan(self, batch: PagedBatch) -> Any:
        """Once per step, before any layer runs (e.g. find shared prefixes). Default: nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        query: "torch.Tensor",
        kv_cache: "torch.Tensor",
        batch: PagedBatch,
        layer: AttentionLayer,
        plan: Any = None,
    ) -> "torch.Tensor":
        """Return the attention output ``[T, H, D]`` for ``query`` ``[T, H, D]``."""


# --------------------------------------------------------------------------- kvcompress
@dataclass(frozen=True)
class BlockView:
    """What a compressor sees of one request's KV blocks (pure Python, no tensors).

    ``scores[i]`` is block i's accumulated importance (e.g. attention mass) where the
    method collects it, else ``None``. ``pinned`` are blocks it must keep (shared by the
    prefix cache with other requests).
    """

    num_tokens: int
    block_size: int
    num_prompt_tokens: int
    scores: Sequence[float] | None = None
    pinned: frozenset[int] = frozenset()

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)


class KVCompressor(PluginImpl[P]):
    """Chooses which KV blocks of a request to keep."""

    kind = Kind.KVCOMPRESS

    @abstractmethod
    def keep(self, view: BlockView) -> list[int]:
        """Sorted logical block indices to keep; every pinned block must be among them."""


# -------------------------------------------------------------------------- speculative
class Proposer(PluginImpl[P]):
    """Proposes draft tokens; the target model verifies them (chain verification: the
    longest prefix of the drafts that the target would have produced itself is kept, so
    greedy output does not depend on the drafts).

    How many tokens: if the plugin's parameter model has a field ``num_speculative_tokens``,
    its value is the most drafts per step (vLLM reserves that many verification slots per
    request); otherwise the adapter uses ``DEFAULT_NUM_SPECULATIVE_TOKENS`` (4). Each call's
    ``max_tokens`` is that number, or less near the model's length limit.

    Calls, per request and engine step once the request has produced a token:
    ``accepted`` (how the previous drafts fared, when there were any), then ``propose``.
    ``finish`` comes once the request has ended (finished or aborted), with the engine's
    next step: that is when vLLM tells its workers.
    """

    kind = Kind.SPECULATIVE

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``token_ids``.

        ``token_ids`` is the request's whole sequence so far: prompt, then every output
        token (the one just sampled last). Return fewer, or ``[]``, when unsure; extra
        tokens beyond ``max_tokens`` are dropped. ``request_id`` is stable for the request's
        life, so per-request state can be kept under it until :meth:`finish`.
        """

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        """The target kept the first ``num_accepted`` of the ``num_verified`` drafts it
        checked for ``request_id`` in the step just run (the drafts this plugin proposed
        last; vLLM verifies fewer when it trims them, e.g. at the length limit). For
        adaptive draft lengths and acceptance statistics. Default: nothing."""

    def finish(self, request_id: str) -> None:
        """The request ended (finished or aborted): release its state. Default: nothing."""


# -------------------------------------------------------------------------------- quant
class QuantMethod(PluginImpl[P]):
    """Quantises a linear layer's weight and computes with the quantised form."""

    kind = Kind.QUANT

    @abstractmethod
    def quantize(self, weight: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """The tensors that replace ``weight`` ``[out, in]`` in a checkpoint."""

    @abstractmethod
    def apply(
        self, tensors: dict[str, "torch.Tensor"], x: "torch.Tensor", bias: "torch.Tensor | None"
    ) -> "torch.Tensor":
        """``x @ W.T + bias`` computed from the quantised ``tensors``."""


# ---------------------------------------------------------------------------------- moe
class MoEScheduler(PluginImpl[P]):
    """Maps router logits to experts (and may observe routing for placement/caching)."""

    kind = Kind.MOE

    @abstractmethod
    def route(
        self, layer_idx: int, router_logits: "torch.Tensor", top_k: int, renormalize: bool
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(topk_weights [T, k], topk_ids [T, k])`` from ``router_logits [T, E]``.

        Unused slots (a token routed to fewer than ``top_k`` experts) carry weight 0.
        """


#: Contract class per kind, for validating implementations.
CONTRACTS: dict[Kind, type[PluginImpl]] = {
    Kind.ATTENTION: AttentionMethod,
    Kind.KVCOMPRESS: KVCompressor,
    Kind.SPECULATIVE: Proposer,
    Kind.QUANT: QuantMethod,
    Kind.MOE: MoEScheduler,
}
