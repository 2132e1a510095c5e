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
class KVCacheLayout:
    """How one layer's paged cache ``[num_blocks, H_kv, block_size, C]`` holds keys and values.

    The backend a plugin rides on decides it and hands it to the plugin as
    :attr:`AttentionLayer.kv_layout`; a plugin reads the cache only through :meth:`split`
    (and, where it writes, :meth:`write`), and says which layouts it reads in
    ``kv_layouts`` (a class attribute of :class:`AttentionMethod` and of
    ``KVCompressor``; default ``("blocked",)``). Three layouts exist:

    * ``blocked`` (:data:`BLOCKED`): for each block and KV head the memory holds the block's
      keys ``[block_size, D]`` followed by its values, so ``C = 2*D`` but the last two dims
      are not "K and V side by side per token" (vLLM's CPU layout, read by its kernel as
      ``view(N, H_kv, 2*block_size, D).chunk(2, dim=2)``; also vllm-graft's generic
      backend). The view must be contiguous per (block, head).
    * ``packed`` (:data:`PACKED`): each token's key and value side by side along ``C``
      (``C = 2*D``: ``kv_cache[..., :D]`` are keys, ``kv_cache[..., D:]`` values), in any
      physical order of the other dims, which the 4-D view's strides carry (vLLM's CUDA
      backends FLASH_ATTN, TRITON_ATTN and FLASHINFER: physically ``[N, B, H, C]`` (NHD)
      by default, ``[N, H, B, C]`` (HND) where the backend asks for it).
    * ``cpu_vec`` (:data:`CPU_VEC`): the cache as vLLM's CPU kernels write it for their ``vec``
      and ``vec16`` ISAs (``ops.cpu_attn_reshape_and_cache``, csrc/cpu/cpu_attn_vec.hpp): per
      block and KV head the block's keys *transposed*, ``[D, block_size]`` row-major, followed by
      its values ``[block_size, D]``. The key view's stride along ``D`` is ``block_size``, not 1:
      only a reader that takes every stride from the view (PyTorch indexing does) may claim it.
      The CPU route hands it to a method that claims it when the layer's ISA is one whose layout
      the worker has checked (written with vLLM's op and read back exactly), so that vLLM's own
      cache write and C++ kernel can run beside the method; otherwise it hands ``blocked``.

    :meth:`split` returns two ``[num_blocks, H_kv, block_size, D]`` views, with a unit stride
    along ``D`` in ``blocked`` and ``packed`` (not for the keys of ``cpu_vec``); kernels take
    their strides, never assume them.
    """

    name: str

    def split(self, kv_cache: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(key_cache, value_cache)``, each ``[num_blocks, H_kv, block_size, D]``, as views."""
        n, h, b, c = kv_cache.shape
        d = c // 2
        if self.name == "blocked":
            kv = kv_cache.view(n, h, 2, b, d)
            return kv[:, :, 0], kv[:, :, 1]
        if self.name == "packed":
            return kv_cache[..., :d], kv_cache[..., d:]
        if self.name == "cpu_vec":  # keys [D, B] per (block, head), then values [B, D]
            keys = kv_cache.view(n, h, 2, d, b)[:, :, 0].transpose(-1, -2)
            return keys, kv_cache.view(n, h, 2, b, d)[:, :, 1]
        raise ValueError(f"unknown KV-cache layout {self.name!r}; expected one of {sorted(KV_LAYOUTS)}")

    def write(
        self, key: "torch.Tensor", value: "torch.Tensor", kv_cache: "torch.Tensor", slot_mapping: "torch.Tensor"
    ) -> None:
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping`` (slot = block *
        block_size + offset; negative slots are padding and are not written) in this layout.
        A reference write for routes without a kernel of their own (it reads the padding mask
        on the host once per call): on CUDA vLLM's backends write the cache themselves."""
        k_cache, v_cache = self.split(kv_cache)
        block_size = kv_cache.shape[2]
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[:n][valid], value[:n][valid]
        else:
            key, value = key[:n], value[:n]
        blocks, offsets = slots // block_size, slots % block_size
        k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = value.to(v_cache.dtype)


#: vLLM's CPU layout and vllm-graft's generic backend (see :class:`KVCacheLayout`).
BLOCKED = KVCacheLayout("blocked")
#: vLLM's CUDA backends: K and V side by side per token (see :class:`KVCacheLayout`).
PACKED = KVCacheLayout("packed")
#: vLLM's CPU kernels' own cache for the ``vec``/``vec16`` ISAs: keys transposed per block
#: (see :class:`KVCacheLayout`).
CPU_VEC = KVCacheLayout("cpu_vec")
KV_LAYOUTS = {BLOCKED.name: BLOCKED, PACKED.name: PACKED, CPU_VEC.name: CPU_VEC}


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
    #: how the cache handed to the plugin holds K and V (the backend's layout)
    kv_layout: KVCacheLayout = BLOCKED
    #: vLLM's tensor parallelism: this rank and the ranks in all (0 and 1 without it); the layer's
    #: ``num_kv_heads`` are this rank's, see :meth:`first_kv_head`
    tp_rank: int = 0
    tp_size: int = 1

    def first_kv_head(self, total_kv_heads: int) -> int:
        """The model's index of this rank's first KV head, for a model of ``total_kv_heads``
        (per-head state calibrated on the whole model, such as ``million``'s codebooks): as vLLM's
        ``QKVParallelLinear`` splits them, rank ``r`` from ``r * total // tp`` (where ranks
        outnumber KV heads, the one head it holds of those vLLM replicates)."""
        return self.tp_rank * total_kv_heads // self.tp_size


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
    #: the most query rows of any sequence, as a host int where the route knows it without
    #: reading the device (vLLM's ``CommonAttentionMetadata.max_query_len``); 1 means a step of
    #: decodes only, which a plugin may take without a host sync. None: not known.
    max_query_len: int | None = None


def split_kv_cache(
    kv_cache: "torch.Tensor", layout: KVCacheLayout | None = None
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(key_cache, value_cache)``, each ``[num_blocks, H_kv, block_size, D]``, as views of
    one layer's paged cache ``[num_blocks, H_kv, block_size, 2*D]`` in ``layout`` (default
    :data:`BLOCKED`; a plugin passes ``layer.kv_layout``). See :class:`KVCacheLayout`."""
    return (layout or BLOCKED).split(kv_cache)


class AttentionMethod(PluginImpl[P]):
    """Attention over a paged KV cache."""

    kind = Kind.ATTENTION
    #: the :class:`KVCacheLayout` names this method reads (and writes) the cache in; a route
    #: whose backend keeps another layout refuses the plugin at start-up, naming the layout
    kv_layouts: tuple[str, ...] = ("blocked",)

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


# ---------------------------------------------------------------- the engine's own kernels
#: Kernels of the serving engine that plugins may call where the route provides them (the
#: integration fills this when an attention plugin activates on vLLM; empty elsewhere, e.g. in
#: the kit and the kernel tests). Known names:
#:
#: * ``"merge_attn_states"``: vLLM's ``merge_attn_states(output, prefix_output, prefix_lse,
#:   suffix_output, suffix_lse, output_lse=None)`` (v1/attention/ops/merge_attn_states.py): two
#:   partial attentions ``[tokens, heads, D]`` merged by their natural-log log-sum-exp
#:   ``[heads, tokens]`` into ``output`` (and ``output_lse``); on CUDA its CUDA kernel (fp32,
#:   fp16, bf16; D a multiple of 4 or 8) else its Triton one, on the CPU engine PyTorch.
HOST_KERNELS: dict[str, Any] = {}


def host_kernel(name: str) -> Any:
    """The engine's kernel ``name`` (see :data:`HOST_KERNELS`), or None where the route has none."""
    return HOST_KERNELS.get(name)
