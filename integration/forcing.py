"""Teacher-forced decoding in vLLM: a request generates given tokens, one decode step each,
and reports the log-probability the model gave each of them.

The perplexity of a continuation *decoded* after a prompt is what a KV compressor changes
while a request generates (prompt log-probabilities only show what it changes during
prefill, and nothing for a compressor that acts once the prompt is in, such as SnapKV).
vLLM has no forced decoding, so :class:`ForceTokens`, a V1 logits processor, masks every
other token at each step of a request whose ``SamplingParams.extra_args`` carries
:data:`FORCE_KEY`. The log-probabilities come from vLLM's ``raw_logprobs`` mode (its
default): computed before logits processors run, so they are the model's own.

Build the engine with ``LLM(..., logits_processors=[ForceTokens])`` (in-process engines:
the class is passed as an object) and the requests with :func:`forced_params`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

#: ``SamplingParams.extra_args`` key: the token ids to force, in order
FORCE_KEY = "vllm_graft_force_tokens"


class ForceTokens(AdapterLogitsProcessor):
    """Output token ``i`` of a request with ``extra_args[FORCE_KEY]`` is that list's ``i``-th."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: greedy requests must run it too

    def new_req_logits_processor(self, params: SamplingParams):
        forced = (params.extra_args or {}).get(FORCE_KEY)
        if not forced:
            return None
        forced = [int(t) for t in forced]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            i = len(output_ids)
            if i >= len(forced):
                return logits
            out = torch.full_like(logits, float("-inf"))
            out[forced[i]] = 0.0
            return out

        return force


def forced_params(tokens: Sequence[int], **kwargs: Any) -> SamplingParams:
    """Greedy params that generate exactly ``tokens`` and report each one's log-probability."""
    return SamplingParams(
        max_tokens=len(tokens),
        temperature=0.0,
        ignore_eos=True,
        logprobs=0,
        extra_args={FORCE_KEY: list(tokens)},
        **kwargs,
    )


def forced_logprobs(output: Any, tokens: Sequence[int]) -> list[float]:
    """The model's log-probability of each forced token, from a finished request's output;
    raises if the request did not generate exactly ``tokens`` (the processor was not installed)."""
    comp = output.outputs[0]
    got = list(comp.token_ids)
    if got != list(tokens):
        raise RuntimeError(
            f"forced decoding generated {got[:8]}... instead of {list(tokens)[:8]}...: build the "
            "engine with logits_processors=[ForceTokens]"
        )
    return [step[t].logprob for step, t in zip(comp.logprobs, tokens)]
