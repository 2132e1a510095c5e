"""The attention contract: attention over a paged KV cache."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kinds import Kind
from .base import P, PluginImpl

if TYPE_CHECKING:  # torch is only needed by implementations
    import torch


@dataclass(frozen=True)
class AttentionLayer:
    """Static facts about one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    block_size: int
    #: the decoder layer's index in the model (0-based; -1 where unknown), for per-layer
    #: choices such as a head map
    index: int = -1


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

    def uses_host_kernel(self) -> bool:
        """True when :meth:`forward` is exactly plain causal attention over the whole cache on
        every step (the ``noop``): the host engine then computes every layer with its own
        kernel and cache layout (on vLLM's CPU engine, its C++ attention), and neither
        :meth:`plan` nor :meth:`forward` is called. Asked once, when the plugin is enabled; a
        route that has no host kernel (vllm-graft's generic backend) says so in the log and
        calls :meth:`forward`. Default: False."""
        return False

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
