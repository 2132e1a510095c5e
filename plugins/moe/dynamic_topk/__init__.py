"""`dynamic-topk` MoE scheduler (MC-MoE online pruning): tokens whose routing is confident
activate fewer experts (never fewer than ``min_k`` >= 1). See ``reference.py`` for the rule and
the scheduler, ``kernel.py`` for the fused Triton routing kernel.

What it saves in vLLM's CPU engine: the pruned expert evaluations are not computed. vLLM's
layer takes ``[T, top_k]`` routing, so a pruned slot is passed as weight 0 (on the token's top
expert), which the MoE contract defines as "slot pruned"; the MoE adapter then runs vLLM's expert
kernel on the kept (token, expert) pairs only (``integration/adapters/moe/skip.py``: in float32
the layer output is bit-identical to computing the slot with weight 0). The plugin reports the
share saved (``saved_share``); the adapter counts ``slots_skipped``. Where the adapter cannot skip
(not vLLM's CPU platform, quantized experts, expert parallelism) or with
``VLLM_GRAFT_MOE_SKIP=0``, pruned slots are computed with weight 0 and the saving is logical
only. What it saves in time: ``benchmarks/moe_skip.py`` (BENCHMARKS.md, "dynamic-topk").
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ....hooks import Capabilities, KernelParams, Registration, hookimpl


class Params(KernelParams):
    """`kernel: triton` runs the fused routing kernel (on CPU only under TRITON_INTERPRET=1:
    an exactness check, slow)."""

    criterion: Literal["mass", "entropy"] = Field(
        "mass",
        description="mass: keep the fewest top experts holding `threshold` of the top-k weight; "
        "entropy: keep min_k experts when the router's normalised entropy < threshold",
    )
    threshold: float = Field(0.8, gt=0.0, le=1.0, description="the confidence threshold (see criterion)")
    min_k: int = Field(1, ge=1, description="fewest experts a token keeps")


@hookimpl
def graft_register_moe_schedulers(register):
    register(
        Registration(
            name="dynamic-topk",
            summary="Confident tokens (top-expert share or low router entropy) activate fewer experts",
            paper="MC-MoE: mixture compressor for MoE LLMs (online dynamic pruning of activated experts)",
            params=Params,
            impl="vllm_graft.plugins.moe.dynamic_topk.reference:DynamicTopK",
            capabilities=Capabilities(
                parallelism=("tp", "dp"), lossless=False, dtypes=("float32", "float16", "bfloat16")
            ),
        )
    )
