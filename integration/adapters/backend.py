"""vllm-graft's attention backend: vLLM's CPU attention with seams for plugins.

On CPU the platform always selects ``CPU_ATTN``; the only way in is to override that
enum member's class (``register_backend(AttentionBackendEnum.CPU_ATTN, path)``). Two kinds
need the backend, so it is shared and installed while either is active:

* attention plugins (:mod:`.attention`): the impl's ``forward`` calls the enabled
  :class:`~vllm_graft.hooks.AttentionMethod` with the paged batch; ``plan`` runs once per
  step in the metadata builder. A method that ``uses_host_kernel`` (plain attention, e.g. the
  ``noop``) is never called: vLLM's own cache write and C++ kernel compute every layer.
* KV compressors (:mod:`.kvcompress`): ``customize_spec`` returns their KV-cache spec (its
  manager frees blocks in the scheduler), and a metadata *rewriter* drops the freed blocks
  from each block-table row before the stock builder runs (the worker's table is
  append-only and keeps stale ids). A KV *storage format* (``kv_format``, e.g. ``kv4``)
  also gives the spec its own page (``uint8``, its bytes per token), and the impl's
  ``do_kv_cache_update`` and ``forward`` call the format's ``write`` and attention on
  layers whose cache is in that page (``uint8``): vLLM's kernel cannot read it.

While an attention method runs (a plugin's, or a scored compressor's attention with mass), the
cache is in one of two layouts. vLLM's CPU kernels keep it in an ISA-specific layout; for the
``vec`` and ``vec16`` ISAs that is :data:`~vllm_graft.hooks.CPU_VEC` (keys transposed per block),
checked once per process and configuration by writing a small cache with vLLM's own op and
reading it back (:func:`stock_layout_checked`). Where the method reads ``cpu_vec`` (its
``kv_layouts``) and the layer's ISA is checked, vLLM writes the cache as it always does and the
method is handed ``cpu_vec``. Two optional seams of the method then hand work back to vLLM's C++
kernel, step by step (``plan`` is the step's, from the method's ``plan``):

* ``plain(plan) -> bool``: the whole step is vLLM's (counted ``stock_layers``): a scored
  compressor's step that scores nothing (e.g. SnapKV's decodes), over the kept blocks (the
  rewriter has compacted the block table); tree verification's steps without a tree.
* ``amends(plan) -> bool`` with ``amend(query, kv_cache, batch, layer, plan, output)``: vLLM's
  kernel computes the whole step's output, then the method amends it in place (``output``
  ``[T, H, D]``, the step's; counted under the method's ``amend_event``): a scored compressor
  adds the observed queries' mass and leaves the output alone (``stock_layers_with_mass``); tree
  verification overwrites the tree rows, which vLLM attended causally, with their masked pass
  (``stock_layers_with_tree``).

Otherwise (another ISA, e.g. ``amx``, said once in the log; a method that reads only
``blocked``) the backend writes the cache in the ``blocked`` layout and the method computes every
step (``forward``). On CUDA (:mod:`.cuda_backends`) only ``plain`` is asked.

With neither hook set the backend behaves exactly as ``CPUAttentionBackend``.

On CUDA the same seams ride vLLM's own backends: :mod:`.cuda_backends` subclasses
``FLASH_ATTN`` and ``TRITON_ATTN`` (``FLASHINFER`` in :mod:`.cuda_flashinfer`), and vLLM
chooses among them as it would. :mod:`.custom_backend` (vLLM's ``CUSTOM``, PyTorch attention)
is the fallback for a backend the bridge does not know (asked for in the deployment's engine
section); every other member gets a guard that refuses it while the deployment needs the
seams. ``VLLM_GRAFT_ATTENTION_BACKEND=generic`` puts the generic backend in place of
``CPU_ATTN`` on CPU, which is how its code is tested here.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from ...hooks import BLOCKED, CPU_VEC, PACKED, AttentionLayer, KVCacheLayout, PagedBatch
from .plugin_calls import raised
from .kvcompress.scoring_pass import PassMetadata, run_in_backend
from ..runtime import RUNTIME

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

log = logging.getLogger("vllm_graft")

BACKEND_PATH = f"{__name__}.GraftCPUAttentionBackend"
#: The generic backend classes live in :mod:`.custom_backend` (which imports this module);
#: named here by path so that the route never imports it.
GENERIC_PATH = f"{__package__}.custom_backend.GraftAttentionBackend"
GENERIC_CPU_PATH = f"{__package__}.custom_backend.GraftGenericCPUBackend"
#: CUDA: the enum members overridden with a subclass of vLLM's own backend (the ones vLLM 0.33
#: picks among for decoder models, platforms/cuda.py:155-182), by member name
#: the class-name prefix of :mod:`.cuda_backends`' guard subclasses (see its ``guard_class``),
#: named by path so that routing never imports that module (vLLM imports it when it selects)
GUARD_PREFIX = "GraftGuarded_"
CUDA_PATHS = {
    "FLASH_ATTN": f"{__package__}.cuda_backends.GraftFlashAttentionBackend",
    "TRITON_ATTN": f"{__package__}.cuda_backends.GraftTritonAttentionBackend",
    "FLASHINFER": f"{__package__}.cuda_flashinfer.GraftFlashInferBackend",
}
#: members left alone on CUDA: ours (CUSTOM) and the CPU platform's
_UNGUARDED = ("CUSTOM", "CPU_ATTN")


#: What the active adapters plug into the backend: the runtime's (:class:`~vllm_graft.integration.
#: runtime.Seams`), which ``RUNTIME.reset`` clears.
SEAMS = RUNTIME.seams


#: ``VLLM_GRAFT_ATTENTION_BACKEND``: ``generic`` puts :mod:`.custom_backend` in place of
#: ``CPU_ATTN`` on CPU (the GPU backend's code, tested on the CPU engine).
BACKEND_ENV = "VLLM_GRAFT_ATTENTION_BACKEND"


def routes() -> dict[AttentionBackendEnum, str]:
    """The enum members this process overrides, each with its class path: on CPU ``CPU_ATTN``;
    on CUDA ``FLASH_ATTN``/``TRITON_ATTN``/``FLASHINFER`` (subclasses of vLLM's), ``CUSTOM``
    (the generic fallback) and a guard for every other member."""
    import os

    from vllm.platforms import current_platform

    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice not in ("", "cpu", "generic"):
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected 'generic' or nothing")
    if current_platform.is_cpu():
        return {AttentionBackendEnum.CPU_ATTN: GENERIC_CPU_PATH if choice == "generic" else BACKEND_PATH}
    if current_platform.is_cuda():
        if choice == "generic":
            log.warning(
                "vllm-graft: %s=generic is a CPU test switch; on CUDA vLLM's own backends "
                "carry the seams (attention_backend=CUSTOM selects the generic one)",
                BACKEND_ENV,
            )
        out = {AttentionBackendEnum[name]: path for name, path in CUDA_PATHS.items()}
        out[AttentionBackendEnum.CUSTOM] = GENERIC_PATH
        for member in AttentionBackendEnum:
            if member not in out and member.name not in _UNGUARDED:
                out[member] = f"{__package__}.cuda_backends.{GUARD_PREFIX}{member.name}"
        return out
    raise NotImplementedError(
        f"vllm-graft's attention backend runs on the vLLM CPU engine and on CUDA; this platform "
        f"is {current_platform.device_name!r}. Leave the attention/kvcompress sections out of "
        "the deployment here."
    )


def install(owner: str) -> None:
    """Route vLLM's backends to ours (idempotent); ``owner`` is the adapter asking."""
    table = routes()
    key = ";".join(sorted(table.values()))
    if not SEAMS.owners or SEAMS.route != key:  # the route changes only between engines (tests)
        if SEAMS.installed:
            _clear_overrides()
        SEAMS.route = key
        SEAMS.installed = list(table)
        for member, path in table.items():
            register_backend(member, path)
        if AttentionBackendEnum.CPU_ATTN not in table:
            log.info(
                "vllm-graft: vLLM's attention backends %s carry the plugins' seams (CUSTOM: "
                "the generic fallback; other backends are refused while the seams are needed)",
                ", ".join(CUDA_PATHS),
            )
        _clear_selector_cache()
    SEAMS.owners.add(owner)


def uninstall(owner: str) -> None:
    SEAMS.owners.discard(owner)
    if not SEAMS.owners:
        _clear_overrides()
        SEAMS.route = ""
        _clear_selector_cache()
        SEAMS.method, SEAMS.method_name, SEAMS.count = None, "", None
        SEAMS.host_kernel = False
        SEAMS.customize_spec = None
        SEAMS.rewriters.clear()
        SEAMS.kv_format = None


def _clear_overrides() -> None:
    for member in SEAMS.installed:
        member.clear_override()
    SEAMS.installed = []


def host_kernel_available(plan: Any = None) -> bool:
    """This process's route hands plain attention (``uses_host_kernel``) to the host's own
    kernel: vLLM's CPU backend, or on CUDA vLLM's FLASH_ATTN/TRITON_ATTN/FLASHINFER. The generic
    backend (the CPU test switch; on CUDA the CUSTOM fallback) calls the method instead."""
    import os

    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return os.environ.get(BACKEND_ENV, "").strip().lower() != "generic"
    return bool(current_platform.is_cuda()) and not generic_requested(plan)


def kv_layout(plan: Any = None) -> KVCacheLayout:
    """The layout of the cache a plugin is handed on this process's route: ``packed`` on
    CUDA (vLLM's backends), ``blocked`` on CPU and in the generic backend (which ``plan``'s
    engine section selects by naming a backend the bridge does not know, or CUSTOM). On CPU a
    plugin that also reads ``cpu_vec`` may be handed that instead, layer by layer, where the
    layer's ISA is checked (see the module doc): ``blocked`` is what every plugin must read."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda() and not generic_requested(plan):
        return PACKED
    return BLOCKED


def generic_requested(plan: Any) -> bool:
    """``plan``'s engine section names an attention backend that vLLM's CUDA overrides do not
    cover (CUSTOM, or one the bridge does not know): the generic backend computes it."""
    engine = getattr(getattr(plan, "deployment", None), "engine", None) or {}
    asked = engine.get("attention_backend")
    return asked is not None and str(asked).upper() not in CUDA_PATHS


def require_layout(plugin: str, kv_layouts: Any, plan: Any = None, what: str = "plugin") -> None:
    """Refuse ``plugin`` (at activation) if it does not read the cache layout of this route
    (:func:`kv_layout`); ``kv_layouts`` is its ``AttentionMethod.kv_layouts`` /
    ``KVCompressor.kv_layouts`` claim."""
    layout = kv_layout(plan)
    claimed = tuple(kv_layouts or ())
    if layout.name not in claimed:
        raise NotImplementedError(
            f"vllm-graft {what} {plugin!r} reads the KV cache in layout(s) {list(claimed)}, but "
            f"this route hands it the {layout.name!r} layout (hooks KVCacheLayout: "
            f"{'vLLM CUDA backends, K|V packed per token' if layout is PACKED else 'blocked per block and head'}); "
            f"add {layout.name!r} to the plugin's kv_layouts once it reads the cache through "
            "layer.kv_layout.split, or leave it out of the deployment on this platform"
        )


#: vLLM's CPU attention ISAs whose cache :data:`~vllm_graft.hooks.CPU_VEC` describes (vLLM 0.32's
#: csrc/cpu/cpu_attn_vec.hpp ``reshape_and_cache``: keys ``[D, block_size]``, values
#: ``[block_size, D]`` per block and KV head; ``vec16`` inherits it). Each is still checked
#: by :func:`stock_layout_checked` before it is used. ``amx`` (and ``neon``...) keep another layout.
CPU_VEC_ISAS = ("vec", "vec16")


@functools.cache
def stock_layout_checked(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> bool:
    """vLLM's CPU cache write for ``isa`` (``ops.cpu_attn_reshape_and_cache``) reads back exactly
    through :data:`CPU_VEC`'s ``split``: checked on a two-block, two-head cache of ``dtype`` once
    per process and configuration. False (said once in the log) for an ISA outside
    :data:`CPU_VEC_ISAS` or one whose write does not read back: the backend then writes the
    ``blocked`` layout and the method computes every step, as before."""
    ok, why = False, f"its layout is not the one vllm-graft reads ({', '.join(CPU_VEC_ISAS)} are)"
    if isa in CPU_VEC_ISAS:
        try:
            from vllm import _custom_ops as ops

            g = torch.Generator().manual_seed(0)
            n, h, tokens = 2, 2, 2 * block_size
            kv = torch.zeros(n, h, block_size, 2 * head_size, dtype=dtype)  # host: a CPU op's probe
            key_cache, value_cache = kv.view(n, h, 2 * block_size, head_size).chunk(2, dim=2)
            slots = torch.randperm(tokens, generator=g)
            key = torch.randn(tokens, h, head_size, generator=g).to(dtype)
            value = torch.randn(tokens, h, head_size, generator=g).to(dtype)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
            k, v = CPU_VEC.split(kv)
            blocks, offsets = slots // block_size, slots % block_size
            ok = torch.equal(k[blocks, :, offsets], key) and torch.equal(v[blocks, :, offsets], value)
            why = "" if ok else "vLLM's write did not read back through hooks.CPU_VEC.split"
        except Exception as e:  # an op that refuses the configuration: the blocked path works
            why = f"checking it failed: {type(e).__name__}: {e}"
    if ok:
        log.info(
            "vllm-graft: vLLM's CPU attention ISA %r (%s, head size %d, block size %d) keeps the KV cache "
            "in the cpu_vec layout (checked): an attention method that reads it shares vLLM's cache, and "
            "steps it calls plain run vLLM's C++ kernel",
            isa,
            dtype,
            head_size,
            block_size,
        )
    else:
        log.warning(
            "vllm-graft: vLLM's CPU attention ISA %r (%s, head size %d, block size %d): %s; the attention "
            "method writes the KV cache in the blocked layout and computes every step itself (no step "
            "runs vLLM's C++ kernel, which is slower)",
            isa,
            dtype,
            head_size,
            block_size,
            why,
        )
    return ok


def customize_spec(spec):
    """A layer's KV-cache spec after the KV-compression seam (both backends call it)."""
    return SEAMS.customize_spec(spec) if SEAMS.customize_spec is not None else spec


def _clear_selector_cache() -> None:
    # vLLM caches the backend class per configuration; a later engine in this process
    # must see the current registration.
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


class GraftCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # must be the enum member it overrides

    @staticmethod
    def get_impl_cls() -> type["GraftCPUAttentionImpl"]:
        return GraftCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["GraftCPUAttentionMetadataBuilder"]:
        return GraftCPUAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        return customize_spec(super().customize_spec(spec))


class GraftCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        for rewrite in SEAMS.rewriters:
            common_attn_metadata = rewrite(self, common_attn_metadata)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if ((SEAMS.method is not None and not SEAMS.host_kernel) or SEAMS.kv_format is not None) and not (
            self.is_cross_attention or self.is_encoder_only_attention
        ):
            batch = PagedBatch(
                query_start_loc=metadata.query_start_loc,
                seq_lens=metadata.seq_lens,
                block_table=metadata.block_table,
                max_query_len=int(common_attn_metadata.max_query_len),
            )
            metadata.graft_batch = batch
            if SEAMS.method is not None:
                metadata.graft_plan = call_plan(SEAMS.method, batch)
                if SEAMS.count:
                    SEAMS.count("plan", 1)
        return metadata


class GraftCPUAttentionImpl(CPUAttentionBackendImpl):
    def graft_layout(self, layer, kv_cache) -> KVCacheLayout:
        """The layout of this layer's cache while an attention method runs: :data:`CPU_VEC`
        (vLLM's own write, which its kernel reads) where the method reads it and the layer's ISA
        is checked (:func:`stock_layout_checked`), else :data:`BLOCKED` (this backend's write).
        The cache write and the forward of a step ask it alike, so they always agree.

        Asked twice per layer and step, so it is kept on the impl (one per layer, its cache's
        block size fixed) for the method and the cache's dtype; a layer whose ISA vLLM's builder
        has not set yet is asked again."""
        method = SEAMS.method
        known = self.__dict__.get("_graft_layout")
        if known is not None and known[0] is method and known[1] is kv_cache.dtype:
            return known[2]
        if (
            method is None
            or CPU_VEC.name not in getattr(method, "kv_layouts", ())
            or self.is_fp8_kv_cache
            or kv_cache.dtype == torch.uint8
        ):
            layout = BLOCKED
        else:
            isa = getattr(layer, "isa", None)  # set on the layer by vLLM's CPU metadata builder
            if isa is None:
                return BLOCKED
            checked = stock_layout_checked(isa, kv_cache.dtype, self.head_size, kv_cache.shape[2])
            layout = CPU_VEC if checked else BLOCKED
        self.__dict__["_graft_layout"] = (method, kv_cache.dtype, layout)
        return layout

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if SEAMS.kv_format is not None and kv_cache.dtype == torch.uint8 and self.attn_type == "decoder":
            spec = layer_spec((self.num_heads, self.num_kv_heads, self.head_size, self.scale), layer, kv_cache)
            return SEAMS.kv_format.write(key, value, kv_cache, slot_mapping, spec)  # the format's page
        # vLLM's CPU kernels keep the cache in an ISA-specific layout (keys transposed per block
        # for "vec"/"vec16": hooks.CPU_VEC). An attention method reads the cache itself: one that
        # reads that layout gets vLLM's write (and its kernel on plain steps); for any other this
        # backend writes the documented blocked layout instead (the stock kernel then never reads it).
        if SEAMS.method is None or SEAMS.host_kernel or self.attn_type != "decoder":
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.graft_layout(layer, kv_cache) is CPU_VEC:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        write_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if isinstance(attn_metadata, PassMetadata):  # a compressor's scoring pass: nothing to write
            return scoring_pass_forward(
                (self.num_heads, self.num_kv_heads, self.head_size, self.scale),
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                self.graft_layout(layer, kv_cache),
            )
        method = SEAMS.method
        if SEAMS.host_kernel:  # the method is plain attention: vLLM's own kernel computes it
            if SEAMS.count and attn_metadata is not None:
                SEAMS.count("host", 1)
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        batch = getattr(attn_metadata, "graft_batch", None)
        if (
            SEAMS.kv_format is not None
            and kv_cache.dtype == torch.uint8
            and batch is not None
            and self.attn_type == "decoder"
            and method is None
        ):
            return self._format_forward(layer, query, kv_cache, attn_metadata, batch, output)
        if (
            method is None
            or batch is None
            or self.attn_type != "decoder"
            or output_scale is not None
            or output_block_scale is not None
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if (
            self.sliding_window != -1
            or self.alibi_slopes is not None
            or self.sinks is not None
            or self.logits_soft_cap
            or self.is_fp8_kv_cache
        ):
            raise NotImplementedError(
                f"vllm-graft attention plugin {SEAMS.method_name!r}: layers with sliding window, "
                "ALiBi, attention sinks, soft-capping or an fp8 KV cache are not supported"
            )
        layout = self.graft_layout(layer, kv_cache)
        plan = getattr(attn_metadata, "graft_plan", None)
        plain = getattr(method, "plain", None)  # a scored compressor's step that scores nothing
        if layout is CPU_VEC and plain is not None and plain(plan):  # vLLM's cache: its kernel reads it
            if SEAMS.count:
                SEAMS.count("stock_layers", 1)
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        n = attn_metadata.num_actual_tokens
        heads = (self.num_heads, self.num_kv_heads, self.head_size, self.scale)
        amends = getattr(method, "amends", None)
        if layout is CPU_VEC and amends is not None and amends(plan):
            # vLLM's kernel computes the whole step's output first; the method then amends it (a
            # scored compressor adds the observed queries' mass; the tree attention overwrites the
            # tree rows with their masked pass)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            spec = layer_spec(heads, layer, kv_cache, layout)
            try:
                method.amend(query[:n], kv_cache, batch, spec, plan, output[:n].view(n, self.num_heads, self.head_size))
            except Exception as e:
                raise raised("attention", SEAMS.method_name, "amend()", e) from e
            if SEAMS.count:
                SEAMS.count(getattr(method, "amend_event", "stock_layers_amended"), 1)
            return output
        return seam_forward(
            heads,
            layer,
            query,
            kv_cache,
            batch,
            plan,
            output,
            n,
            method=method,
            who=SEAMS.method_name,
            layout=layout,
        )

    def _format_forward(self, layer, query, kv_cache, attn_metadata, batch, output):
        """Attention over a cache in a storage format's page (which the C++ kernel cannot read)."""
        if self.sliding_window != -1 or self.alibi_slopes is not None or self.sinks is not None or self.logits_soft_cap:
            raise NotImplementedError(
                "vllm-graft kvcompress storage format: layers with sliding window, ALiBi, attention "
                "sinks or soft-capping are not supported"
            )
        n = attn_metadata.num_actual_tokens
        return seam_forward(
            (self.num_heads, self.num_kv_heads, self.head_size, self.scale),
            layer,
            query,
            kv_cache,
            batch,
            None,
            output,
            n,
            method=None,
            who="kvcompress storage format",
        )


def scoring_pass_forward(
    heads: "Heads", layer: Any, query, key, value, kv_cache, meta: PassMetadata, output, layout: KVCacheLayout
):
    """Every graft backend's ``forward`` when the metadata is a scoring pass's
    (:class:`~.kvcompress.scoring_pass.PassMetadata`, see :mod:`.kvcompress.scoring_forward`): the
    pass's attention over the request's cached context and its own K/V, its pair scores folded
    into the metadata; the cache is read in ``layout`` (the one this route writes) and never
    written (the pass's forward context has no slot mapping)."""
    spec = layer_spec(heads, layer, kv_cache, layout)
    try:
        out = run_in_backend(spec, query, key, value, kv_cache, meta, output)
    except Exception as e:
        raise raised("kvcompress", SEAMS.method_name or "scoring pass", "scoring pass", e) from e
    if SEAMS.count:
        SEAMS.count("pass_layers", 1)
    return out


def batch_of(cm: CommonAttentionMetadata) -> PagedBatch:
    """The :class:`PagedBatch` of vLLM's ``CommonAttentionMetadata`` ``cm``: its first
    ``num_reqs`` requests (the tensors may be padded past them)."""
    n = cm.num_reqs
    return PagedBatch(
        query_start_loc=cm.query_start_loc[: n + 1],
        seq_lens=cm.seq_lens[:n],
        block_table=cm.block_table_tensor[:n],
        max_query_len=int(cm.max_query_len),
    )


def call_plan(method: Any, batch: PagedBatch) -> Any:
    """``method.plan(batch)`` (the builder's once-per-step call); an exception names the plugin."""
    try:
        return method.plan(batch)
    except Exception as e:
        raise raised("attention", SEAMS.method_name or type(method).__name__, "plan()", e) from e


#: A layer's heads as vLLM's attention impl has them: ``(num_heads, num_kv_heads, head_size, scale)``.
#: Each backend reads them off its own impl (``self.num_heads``...), where ``vllm-graft doctor``
#: sees the attributes read on vLLM's class.
Heads = tuple[int, int, int, float]


def layer_spec(heads: Heads, layer: Any, kv_cache: torch.Tensor, layout: KVCacheLayout | None = None) -> AttentionLayer:
    """The layer's facts for a plugin (:class:`AttentionLayer`)."""
    num_heads, num_kv_heads, head_size, scale = heads
    return AttentionLayer(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=scale,
        block_size=kv_cache.shape[2],
        index=_layer_index(layer),
        kv_layout=BLOCKED if layout is None else layout,
        **_rank_heads(),
    )


def _rank_heads() -> dict[str, int]:
    """This rank and the ranks in all, under tensor parallelism (:class:`AttentionLayer`);
    ``{}`` at one rank."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized() or (tp := get_tensor_model_parallel_world_size()) == 1:
        return {}
    return {"tp_rank": get_tensor_model_parallel_rank(), "tp_size": tp}


def seam_forward(
    heads: Heads,
    layer: Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    plan: Any,
    output: torch.Tensor,
    n: int,
    *,
    method: Any,
    who: str,
    layout: KVCacheLayout | None = None,
    count: bool = True,
) -> torch.Tensor:
    """The seam every graft attention backend (CPU, CUDA's FLASH_ATTN/TRITON_ATTN/FLASHINFER,
    CUSTOM) runs for a layer: ``method.forward`` (an attention plugin's, a scored compressor's) or,
    with ``method`` None, the storage format's, on the step's first ``n`` rows; what it returns
    checked (:func:`check_output`), written into vLLM's ``output`` buffer and counted. A plugin's
    exception is re-raised naming it. No host sync."""
    H, D = heads[0], heads[2]
    spec = layer_spec(heads, layer, kv_cache, layout)
    q = query[:n].view(n, H, D)
    try:
        if method is None:
            out = SEAMS.kv_format.forward(q, kv_cache, batch, spec)
        else:
            out = method.forward(q, kv_cache, batch, spec, plan)
    except Exception as e:
        raise raised("attention" if method is not None else "kvcompress", who, "forward()", e) from e
    check_output(who, out, (n, H, D))
    output[:n].view(n, H, D).copy_(out.to(output.dtype))
    if count and SEAMS.count and method is not None:
        SEAMS.count("forward", 1)
    return output


def check_output(who: str, out: Any, shape: tuple[int, int, int]) -> None:
    """Refuse what an attention plugin's ``forward`` returned unless it is a floating-point
    tensor of ``shape`` ``[T, H, D]`` (another floating dtype is converted to the layer's, as
    the contract allows). Reads shape and dtype only: no host sync."""
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(
            f"attention plugin {who!r}: forward() returned {type(out).__name__}; "
            f"AttentionMethod.forward must return a tensor [T, H, D] = {list(shape)}"
        )
    if tuple(out.shape) != shape:
        raise RuntimeError(
            f"attention plugin {who!r} returned shape {tuple(out.shape)}, expected "
            f"{shape}: AttentionMethod.forward must return [T, H, D], one row per query token"
        )
    if not out.is_floating_point():
        raise RuntimeError(
            f"attention plugin {who!r}: forward() returned a {out.dtype} tensor; "
            "AttentionMethod.forward must return floating-point values (the query's dtype)"
        )


def _layer_index(layer) -> int:
    """The decoder layer index in a vLLM attention layer's name ("model.layers.3.self_attn.attn")."""
    parts = str(getattr(layer, "layer_name", "")).split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return -1


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping`` (negative slots are padding)
    in the ``blocked`` layout the plugins read on this route (``hooks.BLOCKED.write``)."""
    BLOCKED.write(key, value, kv_cache, slot_mapping)


__all__ = [
    "SEAMS",
    "CUDA_PATHS",
    "install",
    "uninstall",
    "routes",
    "require_layout",
    "kv_layout",
    "host_kernel_available",
    "generic_requested",
    "write_kv",
    "stock_layout_checked",
    "CPU_VEC_ISAS",
    "GraftCPUAttentionBackend",
    "scoring_pass_forward",
]
