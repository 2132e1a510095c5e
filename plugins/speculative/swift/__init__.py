"""`swift` proposer: SWIFT self-speculation. The target model with a searched set of its
attention/MLP sub-layers skipped drafts the tokens (no weights of its own, no training);
the target verifies them, so greedy output is the target's.

Runs where the speculative adapter can describe the target to it (Llama architecture, no
quantization, one tensor-parallel rank); the capabilities and :meth:`SwiftParams.check_deployment`
refuse the rest before the engine starts. No Triton kernel (see ``reference``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, model_validator

from ....hooks import Capabilities, Params, Registration, hookimpl

#: What the speculative adapter can describe to the proposer (vLLM's Llama implementation).
ARCHITECTURES = ("LlamaForCausalLM",)


class SwiftParams(Params):
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="most draft tokens per step")
    skip_ratio: float = Field(
        0.4,
        gt=0.0,
        lt=1.0,
        description="share of the target's sub-layers (attention and MLP of each layer) the draft model skips",
    )
    keep_ends: bool = Field(True, description="never skip the first and the last layer")
    confidence: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="stop drafting when the draft's "
        "top-1 probability falls below this (0: always draft "
        "num_speculative_tokens)",
    )
    search_budget: int = Field(24, ge=1, le=10_000, description="skip sets scored by the search")
    search_tokens: int = Field(
        256,
        ge=8,
        le=65_536,
        description="context tokens the search scores on (the first ones of the first long-enough request)",
    )
    search_min_tokens: int = Field(
        16,
        ge=2,
        le=65_536,
        description="a request shorter than this does not start the search (and drafts nothing until one has)",
    )
    skip_layers: list[int] | None = Field(
        None, description="fixed sub-layers to skip (2*i: attention of layer i, 2*i+1: its MLP); no search"
    )
    seed: int = Field(0, ge=0, description="seed of the search's random candidates")

    @model_validator(mode="after")
    def _consistent(self):
        if self.search_min_tokens > self.search_tokens:
            raise ValueError(
                f"search_min_tokens ({self.search_min_tokens}) must not exceed search_tokens ({self.search_tokens})"
            )
        if self.skip_layers is not None:
            if not self.skip_layers:
                raise ValueError("skip_layers is empty: name at least one sub-layer, or leave it out to search")
            if any(s < 0 for s in self.skip_layers) or len(set(self.skip_layers)) != len(self.skip_layers):
                raise ValueError(f"skip_layers {self.skip_layers} must be distinct non-negative sub-layer numbers")
        return self

    def check_deployment(self, ctx) -> list[str]:
        problems = []
        quant = (ctx.engine or {}).get("quantization")
        if quant:
            problems.append(
                f"swift drafts with the target's unquantized weights, but the engine "
                f"sets quantization={quant!r}: drop it, or choose another proposer"
            )
        model = ctx.model
        if model is not None:
            try:
                cfg = json.loads((Path(model.path) / "config.json").read_text())
            except (OSError, ValueError):
                cfg = {}
            q = cfg.get("quantization_config")
            if q:
                method = q.get("quant_method", "?") if isinstance(q, dict) else q
                problems.append(
                    f"swift drafts with the target's unquantized weights, but "
                    f"{model.path} is a quantized checkpoint ({method}): use the "
                    "unquantized model, or choose another proposer"
                )
            for key in ("attention_bias", "mlp_bias"):
                if cfg.get(key):
                    problems.append(
                        f"swift's draft forward has no biases, but {model.path} sets "
                        f"{key}: choose another proposer for this model"
                    )
            layers = model.num_layers
            if self.skip_layers is not None and layers is not None:
                bad = [s for s in self.skip_layers if s >= 2 * layers]
                if bad:
                    problems.append(
                        f"skip_layers {bad} are past the model's {2 * layers} sub-layers "
                        f"({layers} layers; 2*i: attention of layer i, 2*i+1: its MLP)"
                    )
            elif layers is not None:
                from .policy import skippable_sublayers

                skippable = len(skippable_sublayers(layers, self.keep_ends))
                n_skip = max(1, round(self.skip_ratio * 2 * layers))
                if n_skip > skippable:
                    problems.append(
                        f"skip_ratio {self.skip_ratio} skips {n_skip} of the model's {2 * layers} "
                        f"sub-layers but only {skippable} may be skipped"
                        + (" (keep_ends keeps the first and last layer)" if self.keep_ends else "")
                        + f": lower skip_ratio to at most {skippable / (2 * layers):.2f}"
                    )
        return problems


@hookimpl
def graft_register_spec_proposers(register):
    register(
        Registration(
            name="swift",
            summary="Self-speculation: the target with a searched set of its attention/MLP "
            "sub-layers skipped drafts the tokens (no extra weights)",
            paper="Xia et al., SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration (ICLR 2025)",
            params=SwiftParams,
            impl="vllm_graft.plugins.speculative.swift.reference:Swift",
            # One rank only (the adapter refuses tensor_parallel_size > 1: each rank holds a shard);
            # quantized projections are refused by check_deployment and the quant kind here.
            capabilities=Capabilities(
                lossless=True, architectures=ARCHITECTURES, parallelism=("dp",), incompatible_with=("quant:*",)
            ),
        )
    )
