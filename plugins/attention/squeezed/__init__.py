"""`squeezed`: sparse decode attention over the chunks whose key centroids best match the query
(after Hooper et al., "Squeezed Attention: Accelerating Long Context Length LLM Inference",
arXiv:2411.09688, with one centroid per fixed chunk of the paged cache instead of offline k-means
clusters of a fixed context). ``mode: recycled`` chooses the chunks by the attention mass of a
full attention step instead, run every ``refresh`` positions ("Recycled Attention: Efficient
inference for long-context language models"). Also the sink + window baseline at the same budget
(``mode: window``) and RazorAttention's streaming heads (``mode: streaming-heads``: full
attention for the retrieval heads of a head map, sinks + recent window for the others). With a
head map, modes centroid and recycled choose chunks only for the map's retrieval heads; the other
heads attend to the sink + window baseline at the same budget (RazorAttention's split of heads,
with a budget for the retrieval heads too).
"""

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ....hooks import Capabilities, KernelParams, Registration, hookimpl
from ....hooks.deployment import param_path
from ....hooks.registry import ATTENTION_BACKEND_LIMITS


#: Positions between two full steps of mode recycled, unless `refresh` is given.
RECYCLED_REFRESH = 16


class SqueezedParams(KernelParams):
    mode: Literal["centroid", "recycled", "window", "streaming-heads"] = Field(
        "centroid",
        description="'centroid' (chunks chosen by key centroid), 'recycled' (Recycled "
        "Attention: every `refresh` positions a full attention step, whose attention mass chooses "
        "the chunks the next steps attend to), 'window' (the sink + window baseline at the same "
        "budget) or 'streaming-heads' (RazorAttention, needs head_map)",
    )
    budget: float = Field(
        0.25,
        gt=0,
        le=1,
        description="fraction of a decode token's context it attends to, per KV head (rounded up to whole chunks)",
    )
    chunk: int = Field(
        16, ge=1, le=256, description="tokens per chunk (the unit chosen); must divide the KV block size"
    )
    sink_tokens: int = Field(16, ge=0, description="first tokens always attended")
    recent_tokens: int = Field(64, ge=1, description="last tokens always attended (the token's own included)")
    refresh: int = Field(
        1,
        ge=1,
        le=4096,
        description="modes centroid and recycled: choose chunks "
        "afresh every `refresh` positions; in between, reuse that choice plus the "
        "moving window (no centroid reads, no full step). Mode recycled defaults to "
        f"{RECYCLED_REFRESH} and needs at least 2",
    )
    prefill: Literal["full", "sparse"] = Field(
        "full",
        description="'full': prompt tokens get full causal attention (serving); 'sparse': each "
        "prompt token attends as it would when decoded (teacher forcing, to measure quality from "
        "prompt log-probabilities)",
    )
    cpu_path: Literal["batched", "per-sequence"] = Field(
        "batched",
        description="the torch path (kernel: reference), mode centroid without a head map "
        "and with refresh 1: 'batched' scores every decode row of a step at once against chunk "
        "centroids kept between steps (computed once per full chunk, checked against the cache's "
        "keys) and attends to the chosen chunks only; 'per-sequence' is the oracle, one row at a "
        "time over all its keys. The same chunks are chosen (up to exact score ties) and the "
        "outputs agree to float rounding. Other modes always run per sequence",
    )
    head_map: str | None = Field(
        None,
        description="head-map file of `vllm-graft calibrate razor`. "
        "Mode streaming-heads: its retrieval heads attend fully, the others to the "
        "sinks + recent window. Modes centroid and recycled: its retrieval heads choose "
        "chunks, the others attend to the sink + window baseline at the same budget",
    )

    @field_validator("head_map")
    @classmethod
    def _head_map_path(cls, v: str | None, info: ValidationInfo) -> str | None:
        # as `model`: from the current folder, else relative to the deployment file
        return None if v is None else str(param_path(v, info))

    @field_validator("chunk")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"chunk must be a power of two (got {v})")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.mode == "recycled":
            if "refresh" not in self.model_fields_set:
                self.refresh = RECYCLED_REFRESH
            elif self.refresh < 2:
                raise ValueError(
                    "mode recycled with refresh 1 runs a full attention step at every "
                    "position (it reads more than plain attention); set refresh >= 2"
                )
        if self.mode == "streaming-heads" and not self.head_map:
            raise ValueError(
                "mode streaming-heads needs head_map: the file written by `vllm-graft calibrate razor --out FILE`"
            )
        if self.head_map:
            if self.mode == "window":
                raise ValueError(
                    "head_map is read in modes streaming-heads, centroid and recycled, not in "
                    "mode window (every head attends to the sink + window there)"
                )
            if not Path(self.head_map).is_file():
                raise ValueError(
                    f"head_map {self.head_map!r} does not exist; write it with `vllm-graft calibrate razor --out FILE`"
                )
        return self

    def check_deployment(self, ctx) -> list[str]:
        """At deployment validation (``DeploymentContext``): the chunk against the KV block size,
        the head map against the model's layers and KV heads."""
        problems = []
        if ctx.block_size is not None and ctx.block_size % self.chunk:
            fits = [c for c in (256, 128, 64, 32, 16, 8, 4, 2, 1) if ctx.block_size % c == 0 and c <= self.chunk]
            problems.append(
                f"chunk {self.chunk} does not divide the KV block size {ctx.block_size} "
                f"(engine.block_size, else vLLM's default on {ctx.platform}): set params.chunk "
                f"to {fits[0]} or engine.block_size to a multiple of {self.chunk}"
            )
        model = ctx.model
        if self.head_map and model is not None and model.num_layers and model.num_kv_heads:
            from .policy import load_head_map

            try:
                heads = load_head_map(self.head_map)
            except ValueError as e:
                return problems + [str(e)]
            shapes = {len(row) for row in heads}
            if len(heads) != model.num_layers or shapes != {model.num_kv_heads}:
                problems.append(
                    f"head map {self.head_map!r} has {len(heads)} layers of {'/'.join(map(str, sorted(shapes)))} "
                    f"KV heads, but model {model.path} has {model.num_layers} layers of {model.num_kv_heads}: "
                    f"calibrate one for this model (vllm-graft calibrate razor --model {model.path} --out FILE)"
                )
        return problems


@hookimpl
def graft_register_attention(register):
    register(
        Registration(
            name="squeezed",
            summary="Sparse decode attention: each decode token attends to the chunks whose key "
            "centroids match it best (or, mode recycled, that a periodic full step attended "
            "most), plus sinks and a recent window (lossy)",
            paper="Squeezed Attention: Accelerating Long Context Length LLM Inference (arXiv:2411.09688); "
            "Recycled Attention: Efficient inference for long-context language models, for mode "
            "recycled; RazorAttention (arXiv:2407.15891) for mode streaming-heads",
            params=SqueezedParams,
            impl="vllm_graft.plugins.attention.squeezed.reference:Squeezed",
            capabilities=Capabilities(
                parallelism=("tp", "dp"),
                lossless=False,
                head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256),
                unsupported_features=ATTENTION_BACKEND_LIMITS,
            ),
        )
    )
