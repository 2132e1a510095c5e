"""`kv4` KV storage format: a 4-bit KV cache (keys per channel per block, as in KIVI/QServe;
values per token in channel groups, as in KIVI), quantised on write and dequantised inside
the attention. vLLM's page size is the format's (``uint8`` pages of
:func:`layout.bytes_per_token` bytes per token and KV head), so the same KV memory holds
~3.2-3.4x more blocks than float16 (6.4-6.7x more than float32); the layout and how keys are
quantised per channel while tokens arrive one at a time are in :mod:`.reference`.

It evicts nothing and composes with one eviction compressor (``kvcompress: [{plugin:
streaming, ...}, {plugin: kv4}]``); with a compressor that needs attention scores (``h2o``,
``snapkv``) the scores come from kv4's reference attention (its Triton kernel emits none).
"""

from typing import Literal

from pydantic import Field

from ....hooks import KernelParams, Registration, hookimpl
from .._shared.params import storage_capabilities


class KV4Params(KernelParams):
    value_group_size: Literal[16, 32, 64, 128] = Field(
        32,
        description="channels per value group (one float16 scale and minimum per token and group); "
        "must divide the head size",
    )

    def check_deployment(self, ctx) -> list[str]:
        """At deployment validation (``DeploymentContext``): the page layout against the model's
        head size and the KV block size (the same check runs again when vLLM builds the spec)."""
        if ctx.model is None or ctx.model.head_size is None or ctx.block_size is None:
            return []
        from .layout import unsupported

        why = unsupported(ctx.model.head_size, ctx.block_size, self.value_group_size)
        return [f"cannot store the KV cache of model {ctx.model.path}: {why}"] if why else []


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="kv4",
            summary="4-bit KV cache: keys per channel per block, values per token group; ~3.2x more blocks than fp16",
            paper="Liu et al. 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache (arXiv:2402.02750); "
            "Lin et al. 2024, QServe (arXiv:2405.04532)",
            params=KV4Params,
            impl="vllm_graft.plugins.kvcompress.kv4.reference:KV4",
            capabilities=storage_capabilities(("tp", "dp")),
        )
    )
