"""`xquant` KV storage format: the quantised latent of the layer input, keys and values
rematerialised when attending (XQuant, Tomar et al. 2025, in its variant for GQA models). For
each layer the format caches ``X Vh^T`` for K and for V (``W = U diag(S) Vh`` the SVD of the
projection, from ``vllm-graft calibrate xquant``), quantised per token in channel groups, and
rebuilds ``K = lat diag(S) U^T`` (then RoPE) and V inside the attention (:mod:`.reference`).
vLLM's page size is the format's: at the defaults (``bits`` 4, ``group_size`` 32) a head of 64
channels takes 84 bytes per token (K and V latents, their scales, the position), ~1/3 of
float16; at ``bits`` 2, 44 bytes.

It evicts nothing and composes with one eviction compressor, as ``kv4`` does. Reference path
only (plain PyTorch, the CPU route): the recompute is pure extra work there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from ....hooks import Registration, hookimpl
from .._shared.params import CalibratedFileParams, storage_capabilities

from .bases import ARCHITECTURES, CALIBRATE, IDENTITY


class XQuantParams(CalibratedFileParams):
    FILE, BUILTIN, CALIBRATE = "bases", IDENTITY, CALIBRATE
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"bases": IDENTITY}]})

    bases: str = Field(
        description="the bases file `vllm-graft calibrate xquant --model MODEL --out FILE` wrote for this "
        "model (relative paths as `model`'s), or 'identity': no latent, K (post-RoPE) and V quantised as "
        "vLLM hands them (the conformance kit's random K/V; the ablation of the latent)",
    )
    bits: Literal[2, 4, 8] = Field(4, description="bits per latent channel")
    group_size: Literal[16, 32, 64, 128] = Field(
        32,
        description="channels per group (one float16 scale and minimum per token and group); must divide the head size",
    )

    def layout_why(self, head_size: int) -> str | None:
        from .layout import unsupported

        return unsupported(head_size, self.bits, self.group_size)

    def file_why(self, model) -> str | None:
        from .bases import mismatch, read_header

        meta = read_header(self.bases)
        return mismatch(
            meta, self.bases, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_size=model.head_size
        )


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="xquant",
            summary="caches the quantised latent of the layer input (SVD of Wk, Wv) and rematerialises K "
            "and V when attending; 84 bytes per token and head at 4 bits; reference path only",
            paper="Tomar et al. 2025, XQuant: Breaking the Memory Wall for LLM Inference with KV Cache "
            "Rematerialization (arXiv:2508.10395)",
            params=XQuantParams,
            impl="vllm_graft.plugins.kvcompress.xquant.reference:XQuant",
            # the positions come from vLLM's CPU attention metadata (the CUDA route is unread)
            capabilities=storage_capabilities(
                ("dp",),
                platforms=("cpu",),
                architectures=ARCHITECTURES,
                parallelism_why="one latent spans every KV head, and a tensor-parallel rank holds only its "
                "own heads' projection (a per-rank basis is not written yet)",
            ),
        )
    )
