"""`million` KV storage format: product-quantised keys and values (MILLION, Wang et al.
2025). Each head vector is cut into sub-vectors of ``sub_dim`` channels, each stored as the
index of its nearest centroid among ``2**bits`` in a codebook per layer, KV head and sub-space,
calibrated offline on the model (``vllm-graft calibrate million``: post-RoPE keys, as vLLM
stores them). Decode attention scores keys through query-centroid lookup tables and rebuilds
values from the value codebooks (:mod:`.reference`). vLLM's page size is the format's: with
the defaults (``sub_dim`` 2, ``bits`` 8: 4 bits per channel) a head of 64 channels takes 64
bytes per token and KV head for K and V, 1/4 of float16 and 1/8 of float32, with no scales.

It evicts nothing and composes with one eviction compressor, as ``kv4`` does. Reference path
only (plain PyTorch, the CPU route); no Triton kernel yet.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from ....hooks import Registration, hookimpl
from .._shared.params import CalibratedFileParams, storage_capabilities

from .codebooks import CALIBRATE, GAUSSIAN


class MillionParams(CalibratedFileParams):
    FILE, BUILTIN, CALIBRATE = "codebooks", GAUSSIAN, CALIBRATE
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"codebooks": GAUSSIAN}]})

    codebooks: str = Field(
        description="the codebook file `vllm-graft calibrate million --model MODEL --out FILE` wrote for "
        "this model (relative paths as `model`'s), or 'gaussian': data-free k-means centroids of a unit "
        "Gaussian, the same for every layer and head (for tests and the conformance kit's random K/V; "
        "far worse than calibrated codebooks on a model)",
    )
    sub_dim: Literal[1, 2, 4, 8] = Field(
        2, description="channels per sub-vector (M = head size / sub_dim codes per vector); must match the file"
    )
    bits: Literal[4, 8] = Field(8, description="bits per code (2**bits centroids per sub-space); must match the file")

    def layout_why(self, head_size: int) -> str | None:
        from .layout import unsupported

        return unsupported(head_size, self.sub_dim, self.bits)

    def file_why(self, model) -> str | None:
        from .codebooks import mismatch, read_header

        meta = read_header(self.codebooks)
        return mismatch(
            meta,
            self.codebooks,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            sub_dim=self.sub_dim,
            bits=self.bits,
        )


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="million",
            summary="product-quantised KV cache (codebooks per layer/head/sub-space, calibrated offline); "
            "lookup-table attention; 4 bits per channel by default; reference path only (no Triton kernel)",
            paper="Wang et al. 2025, MILLION: Mastering Long-Context LLM Inference Via Outlier-Immunized "
            "KV Product Quantization (arXiv:2504.03661)",
            params=MillionParams,
            impl="vllm_graft.plugins.kvcompress.million.reference:Million",
            # per-layer, per-KV-head codebooks: a tensor-parallel rank reads its heads' (AttentionLayer.first_kv_head)
            capabilities=storage_capabilities(("tp", "dp")),
        )
    )
