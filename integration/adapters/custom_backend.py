"""vllm-graft's device-agnostic attention backend: the fallback on CUDA (vLLM's ``CUSTOM``).

On CPU vLLM always selects ``CPU_ATTN`` and :mod:`.backend` overrides it with a subclass of
the stock CPU backend; on CUDA :mod:`.cuda_backends` subclasses vLLM's FLASH_ATTN, FLASHINFER
and TRITON_ATTN the same way. This module is a backend of its own, written only against
vLLM's backend interface (``v1/attention/backend.py``: ``AttentionBackend``,
``AttentionMetadataBuilder``, ``AttentionImpl``), for a CUDA backend the bridge does not know:
where the deployment's engine section names one (e.g. FLEX_ATTENTION), the adapters ask the
engine for ``attention_backend=CUSTOM`` instead, with one warning naming the slowdown
(:func:`vllm_graft.integration.adapters.attention_backend_overrides`).

* the cache is the standard 4-D per-layer view ``[num_blocks, H_kv, block_size, 2*D]`` in the
  head-major layout (``supported_kv_cache_layouts`` = ``LBHNC``), written by
  :func:`.backend.write_kv` in the ``blocked`` layout (``hooks.KVCacheLayout``);
* the metadata builder runs the same seams as the other backends (KV-compression rewriters,
  then ``AttentionMethod.plan``) and hands the plugin a :class:`~vllm_graft.hooks.PagedBatch`;
* the impl calls ``AttentionMethod.forward`` for every decoder layer. With no attention
  plugin enabled (a KV compressor alone) it computes exact attention with the PyTorch
  reference (``plugins/attention/noop``) and says so in the log: slow, but correct; with a KV
  storage format (``kv4``) it writes and attends through the format. Python runs in attention
  every step, so the builder declares no CUDA-graph support (vLLM compiles attention piecewise).

The same class is exercised on the CPU engine: with ``VLLM_GRAFT_ATTENTION_BACKEND=generic``
:func:`.backend.install` overrides ``CPU_ATTN`` with :class:`GraftGenericCPUBackend` (this
backend under the name the CPU platform selects), and ``tests/e2e/test_custom_backend.py``
checks greedy tokens against plain vLLM through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from ...hooks import BLOCKED, PagedBatch

from .backend import (
    GENERIC_CPU_PATH,
    GENERIC_PATH,
    SEAMS,
    batch_of,
    call_plan,
    customize_spec,
    layer_spec,
    scoring_pass_forward,
    seam_forward,
    write_kv,
)
from .kvcompress.scoring_pass import PassMetadata
from ..runtime import RUNTIME


log = logging.getLogger("vllm_graft")


# Metadata builds and layer forwards through this backend in this process are counted in
# RUNTIME.backend_calls ("build", "forward"; tests read it to know the route was really taken).


@dataclass
class GraftAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    graft_batch: PagedBatch
    graft_plan: Any = None
    causal: bool = True


class GraftAttentionMetadataBuilder(AttentionMetadataBuilder[GraftAttentionMetadata]):
    # Plugins plan on the host (e.g. hydragen's radix tree over the block tables): no CUDA
    # graphs for attention; vLLM runs these layers eagerly (piecewise graphs elsewhere).
    reorder_batch_threshold: int | None = None

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size  # read by the KV-compression rewriter
        method = SEAMS.method
        if method is not None and BLOCKED.name not in tuple(getattr(method, "kv_layouts", (BLOCKED.name,))):
            raise NotImplementedError(
                f"vllm-graft attention plugin {SEAMS.method_name!r} reads the KV cache in layout(s) "
                f"{list(method.kv_layouts)}; vllm-graft's generic backend (attention_backend=CUSTOM) "
                "keeps the 'blocked' layout: let vLLM choose its backend instead (drop "
                "--attention-backend CUSTOM)"
            )

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> GraftAttentionMetadata:
        RUNTIME.backend_calls["build"] += 1
        cm = common_attn_metadata
        for rewrite in SEAMS.rewriters:
            cm = rewrite(self, cm)
        if isinstance(cm.causal, torch.Tensor) or not cm.causal:
            raise NotImplementedError("vllm-graft's attention backend supports causal decoder attention only")
        batch = batch_of(cm)
        method = _method()
        plan = call_plan(method, batch)
        if SEAMS.count and SEAMS.method is not None:
            SEAMS.count("plan", 1)
        return GraftAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=cm.slot_mapping,
            graft_batch=batch,
            graft_plan=plan,
        )


class GraftAttentionImpl(AttentionImpl[GraftAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        unsupported = [
            what
            for what, bad in (
                ("ALiBi", alibi_slopes is not None),
                ("sliding window", sliding_window not in (None, -1)),
                ("soft-capping", bool(logits_soft_cap)),
                ("attention sinks", sinks is not None),
                (f"attention type {attn_type!r}", attn_type != AttentionType.DECODER),
                (f"KV-cache dtype {kv_cache_dtype!r}", kv_cache_dtype != "auto"),
                ("KV sharing across layers", kv_sharing_target_layer_name is not None),
            )
            if bad
        ]
        if unsupported:
            raise NotImplementedError(
                "vllm-graft's attention backend (attention/kvcompress plugins) does not support "
                f"layers with {', '.join(unsupported)}; leave the attention and kvcompress sections "
                "out of the deployment for this model"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if SEAMS.kv_format is not None and kv_cache.dtype == torch.uint8:
            spec = layer_spec((self.num_heads, self.num_kv_heads, self.head_size, self.scale), layer, kv_cache)
            SEAMS.kv_format.write(key, value, kv_cache, slot_mapping, spec)  # a storage format's page
        else:
            write_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if attn_metadata is None:  # profiling run: no cache yet
            return output.fill_(0)
        if isinstance(attn_metadata, PassMetadata):  # a compressor's scoring pass: nothing written
            heads = (self.num_heads, self.num_kv_heads, self.head_size, self.scale)
            return scoring_pass_forward(heads, layer, query, key, value, kv_cache, attn_metadata, output, BLOCKED)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("vllm-graft's attention backend does not fuse output quantisation")
        RUNTIME.backend_calls["forward"] += 1
        n = attn_metadata.num_actual_tokens
        fmt = SEAMS.method is None and SEAMS.kv_format is not None and kv_cache.dtype == torch.uint8
        who = "kvcompress storage format" if fmt else SEAMS.method_name or "reference"
        return seam_forward(
            (self.num_heads, self.num_kv_heads, self.head_size, self.scale),
            layer,
            query,
            kv_cache,
            attn_metadata.graft_batch,
            attn_metadata.graft_plan,
            output,
            n,
            method=None if fmt else _method(),
            who=who,
            count=SEAMS.method is not None,
        )


def _method():
    """The enabled attention method, or exact PyTorch attention when none is (a KV compressor
    alone needs this backend for its layout and rewriters but computes nothing new; built once
    per deployment, kept as ``SEAMS.reference_attention``)."""
    if SEAMS.method is not None:
        return SEAMS.method
    if SEAMS.reference_attention is None:
        from ...plugins.attention._shared import PagedAttention

        log.warning(
            "vllm-graft: no attention plugin is enabled; the graft attention backend "
            "computes attention with the PyTorch reference (exact, slow)"
        )
        SEAMS.reference_attention = PagedAttention(None)
    return SEAMS.reference_attention


class GraftAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[GraftAttentionImpl]:
        return GraftAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GraftAttentionMetadataBuilder]:
        return GraftAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # split_kv_cache reads head-major blocks

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec):
        return customize_spec(super().customize_spec(spec))


class GraftGenericCPUBackend(GraftAttentionBackend):
    """The same backend under the name the CPU platform selects (a test route for the GPU code)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"


__all__ = ["GraftAttentionBackend", "GraftGenericCPUBackend", "GENERIC_PATH", "GENERIC_CPU_PATH"]
