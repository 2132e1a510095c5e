"""vllm-graft on CUDA: vLLM's own attention backends, subclassed to carry the bridge's seams.

On CUDA :func:`.backend.install` overrides the enum members vLLM 0.33 picks among for decoder
models (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``; platforms/cuda.py:155-182) with the
subclasses below (FlashInfer's in :mod:`.cuda_flashinfer`, since vLLM's module imports the
``flashinfer`` package). vLLM keeps choosing among them as it would; each subclass keeps its
stock name (``get_name``), kernel, cache write and, where nothing changes the math, CUDA graphs.

One set of mixins carries the seams of :data:`.backend.SEAMS` for all three:

* builder: ``build`` runs the KV-compression rewriters on the ``CommonAttentionMetadata``, then
  the stock ``build``; while a math-changing method (an attention plugin that is not plain
  attention, a scored compressor's mass) or a KV storage format is active it attaches
  ``graft_batch`` (a :class:`~vllm_graft.hooks.PagedBatch` of the rewritten metadata) and
  ``graft_plan``. Graph support is the stock one unless Python runs per step inside
  attention, then ``NEVER`` (vLLM then compiles attention piecewise, eager).
* impl: ``forward`` is the stock one unless a method or a storage format computes the layer;
  the method reads vLLM's cache in its layout, :data:`~vllm_graft.hooks.PACKED` (K|V side by
  side per token). ``do_kv_cache_update`` is the stock write except in a format's uint8 page.
* backend: ``customize_spec`` applies the KV-compression spec.

Other members (``FLEX_ATTENTION``, ``TRITON_FLASH_ATTN``, MLA backends, ...) get a *guard*
subclass while seams are needed: its ``validate_configuration`` gives a reason naming the fix,
so vLLM never runs a deployment on a backend that would silently ignore it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from ...hooks import PACKED

from .backend import (
    GUARD_PREFIX,
    SEAMS,
    batch_of,
    call_plan,
    customize_spec,
    layer_spec,
    scoring_pass_forward,
    seam_forward,
)
from .kvcompress.scoring_pass import PassMetadata

log = logging.getLogger("vllm_graft")


def method_runs() -> bool:
    """An attention method computes layers itself (not plain attention handed to vLLM's kernel)."""
    return SEAMS.method is not None and not SEAMS.host_kernel


def attends_in_python() -> bool:
    """Python runs inside attention each step: a method's forward/plan or a storage format."""
    return method_runs() or SEAMS.kv_format is not None


def needs_seams() -> bool:
    """The active deployment needs the graft seams in whichever backend vLLM selects."""
    return attends_in_python() or bool(SEAMS.rewriters) or SEAMS.customize_spec is not None


class GraftBuilderMixin:
    """Seams of the metadata builder (put before the stock builder in the bases)."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # the runner takes the minimum over builders and resolves the mode from it
        # (0.33: gpu_model_runner.py:6760-6787, config/compilation.py:1376-1494): NEVER
        # turns FULL_AND_PIECEWISE into PIECEWISE, attention then runs eagerly
        if attends_in_python():
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)  # type: ignore[misc]  # mixin: vLLM's builder follows in the MRO

    @property
    def supports_update_block_table(self) -> bool:
        # V1 reuses one group's metadata for later groups through update_block_table, which
        # bypasses build() (0.33: gpu_model_runner.py:2449-2458): off while build() has work
        stock = self.__dict__.get("_graft_stock_update_block_table", super().supports_update_block_table)  # type: ignore[misc]  # mixin, as above
        return bool(stock) and not (SEAMS.rewriters or attends_in_python())

    @supports_update_block_table.setter
    def supports_update_block_table(self, value: bool) -> None:
        # a stock __init__ may assign it; keep the stock value as the instance's own
        self.__dict__["_graft_stock_update_block_table"] = value

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        for rewrite in SEAMS.rewriters:
            cm = rewrite(self, cm)
        metadata = super().build(common_prefix_len, cm, fast_build)  # type: ignore[misc]  # mixin, as above
        if attends_in_python() and cm.causal is True:
            batch = batch_of(cm)
            metadata.graft_batch = batch
            metadata.graft_num_tokens = cm.num_actual_tokens
            if method_runs():
                metadata.graft_plan = call_plan(SEAMS.method, batch)
                if SEAMS.count:
                    SEAMS.count("plan", 1)
        return metadata


def _attn_type_argument(init: Any, args: tuple, kwargs: dict) -> Any:
    """The ``attn_type`` the stock impl's ``__init__`` was given (its own default if none):
    vLLM's layer passes it positionally (0.33: layers/attention/attention.py:420-432)."""
    try:
        bound = inspect.signature(init).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs.get("attn_type", AttentionType.DECODER)
    bound.apply_defaults()
    return bound.arguments.get("attn_type", AttentionType.DECODER)


class GraftImplMixin:
    """Seams of the attention impl (put before the stock impl in the bases).

    It reads from the stock impl only what every 0.33 impl it wraps sets in ``__init__``
    (``num_heads``, ``num_kv_heads``, ``head_size``, ``scale``); the attention type is its own,
    taken from the ``__init__`` arguments: 0.33's ``FlashInferImpl`` checks ``attn_type`` once and
    never stores it (v1/attention/backends/flashinfer.py:2023-2058)."""

    graft_attn_type: Any = AttentionType.DECODER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stock_init = super().__init__
        super().__init__(*args, **kwargs)
        self.graft_attn_type = _attn_type_argument(stock_init, args, kwargs)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if (
            SEAMS.kv_format is not None
            and kv_cache.dtype == torch.uint8
            and self.graft_attn_type == AttentionType.DECODER
        ):
            spec = layer_spec((self.num_heads, self.num_kv_heads, self.head_size, self.scale), layer, kv_cache, PACKED)
            return SEAMS.kv_format.write(key, value, kv_cache, slot_mapping, spec)  # the format's page
        return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if isinstance(attn_metadata, PassMetadata):  # a compressor's scoring pass: nothing written
            heads = (self.num_heads, self.num_kv_heads, self.head_size, self.scale)
            return scoring_pass_forward(heads, layer, query, key, value, kv_cache, attn_metadata, output, PACKED)
        method = SEAMS.method
        stock = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if method is not None and SEAMS.host_kernel:  # plain attention: vLLM's kernel
            if SEAMS.count and attn_metadata is not None:
                SEAMS.count("host", 1)
            return super().forward(*stock)
        batch = getattr(attn_metadata, "graft_batch", None)
        if batch is None or self.graft_attn_type != AttentionType.DECODER:
            return super().forward(*stock)  # profiling run, other layers, nothing to change
        fmt = SEAMS.kv_format is not None and kv_cache.dtype == torch.uint8
        if method is None and not fmt:
            return super().forward(*stock)
        plan = getattr(attn_metadata, "graft_plan", None)
        plain = getattr(method, "plain", None)  # a scored compressor's step that scores nothing
        if not fmt and plain is not None and plain(plan):
            if SEAMS.count:
                SEAMS.count("stock_layers", 1)
            return super().forward(*stock)
        who = SEAMS.method_name if method is not None else "kvcompress storage format"
        self._graft_refuse_unsupported(who, output_scale, output_block_scale, fmt)
        n = attn_metadata.graft_num_tokens
        return seam_forward(
            (self.num_heads, self.num_kv_heads, self.head_size, self.scale),
            layer,
            query,
            kv_cache,
            batch,
            plan,
            output,
            n,
            method=method,
            who=who,
            layout=PACKED,
        )

    def _graft_refuse_unsupported(self, who, output_scale, output_block_scale, fmt: bool) -> None:
        window = getattr(self, "sliding_window", None)
        quant = str(getattr(self, "kv_cache_dtype", "auto"))
        bad = [
            what
            for what, on in (
                ("sliding window", window not in (None, -1, (-1, -1))),
                ("ALiBi", getattr(self, "alibi_slopes", None) is not None),
                ("attention sinks", getattr(self, "sinks", None) is not None),
                ("soft-capping", bool(getattr(self, "logits_soft_cap", 0) or 0)),
                (f"KV-cache dtype {quant!r}", not fmt and quant not in ("auto", "bfloat16", "float16", "float32")),
                ("fused output quantisation", output_scale is not None or output_block_scale is not None),
            )
            if on
        ]
        if bad:
            raise NotImplementedError(
                f"vllm-graft {who!r} on {type(self).__name__}: layers with {', '.join(bad)} are "
                "not supported; leave the plugin out of the deployment for this model"
            )


class GraftBackendMixin:
    """Seams of the backend class: its builder and impl, and the KV-compression spec."""

    graft_builder: type
    graft_impl: type

    @classmethod
    def get_builder_cls(cls):
        return cls.graft_builder

    @classmethod
    def get_impl_cls(cls):
        return cls.graft_impl

    @classmethod
    def customize_spec(cls, spec):
        return customize_spec(super().customize_spec(spec))


# ------------------------------------------------------------------ FLASH_ATTN, TRITON_ATTN
class GraftFlashAttentionMetadataBuilder(GraftBuilderMixin, FlashAttentionMetadataBuilder):
    pass


class GraftFlashAttentionImpl(GraftImplMixin, FlashAttentionImpl):
    pass


class GraftFlashAttentionBackend(GraftBackendMixin, FlashAttentionBackend):
    graft_builder = GraftFlashAttentionMetadataBuilder
    graft_impl = GraftFlashAttentionImpl


class GraftTritonAttentionMetadataBuilder(GraftBuilderMixin, TritonAttentionMetadataBuilder):
    pass


class GraftTritonAttentionImpl(GraftImplMixin, TritonAttentionImpl):
    pass


class GraftTritonAttentionBackend(GraftBackendMixin, TritonAttentionBackend):
    graft_builder = GraftTritonAttentionMetadataBuilder
    graft_impl = GraftTritonAttentionImpl


# ------------------------------------------------------------------ guards for other members
_guards: dict[str, type] = {}


def guard_reason(member_name: str) -> str:
    return (
        f"vllm-graft: the deployment's attention/kvcompress plugins need vllm-graft's seams, "
        f"which {member_name} does not carry; let vLLM choose its backend (drop "
        "--attention-backend / attention_config.backend) or name FLASH_ATTN, FLASHINFER or "
        "TRITON_ATTN; attention_backend=CUSTOM in the deployment's engine section runs "
        "vllm-graft's generic backend (PyTorch attention, slow)"
    )


def guard_class(member_name: str) -> type:
    """A subclass of ``member_name``'s stock backend that vLLM finds invalid while
    :func:`needs_seams` (its reason names the fix), and that behaves as the stock one otherwise."""
    if member_name not in _guards:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        stock = resolve_obj_by_qualname(AttentionBackendEnum[member_name].value)

        def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
            if needs_seams():
                return [guard_reason(member_name)]
            return stock.validate_configuration.__func__(cls, *args, **kwargs)

        name = GUARD_PREFIX + member_name
        _guards[member_name] = type(
            name,
            (stock,),
            {
                "__module__": __name__,
                "__qualname__": name,
                "validate_configuration": classmethod(validate_configuration),
            },
        )
    return _guards[member_name]


def __getattr__(name: str) -> Any:  # the registry imports guard classes by path
    if name.startswith(GUARD_PREFIX):
        return guard_class(name[len(GUARD_PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def guard_path(member_name: str) -> str:
    return f"{__name__}.{GUARD_PREFIX}{member_name}"


__all__ = [
    "GraftFlashAttentionBackend",
    "GraftTritonAttentionBackend",
    "GraftBuilderMixin",
    "GraftImplMixin",
    "GraftBackendMixin",
    "attends_in_python",
    "guard_class",
    "guard_path",
    "method_runs",
    "needs_seams",
]
