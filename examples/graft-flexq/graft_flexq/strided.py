"""`strided`: a third-party KV-cache eviction compressor (a TOVA-like stand-in without scores).

Keeps, per request, the first ``sink_blocks`` blocks, the ``recent_blocks`` most recent ones
(the block being written among them), and in between every ``stride``-th block, the newest of
those first, up to ``budget_blocks`` blocks in all; every other block is freed. TOVA (Oren et
al. 2024, *Transformers are Multi-State RNNs*, arXiv:2401.06104) keeps the blocks the current
query attends to most; this policy keeps a fixed thinning of the past instead, so it needs no
attention scores (``needs_scores = False``): both halves of vLLM's adapter (the scheduler that
frees blocks and the worker that masks attention) reach the same answer from the block count
alone. It is here to show that a compressor from an installed package is a first-class
citizen of the measurement tools: ``vllm-graft kvbench --compressors streaming,strided``.

The contract's rules (``vllm_graft.hooks.contracts.kvcompress``) hold by construction: the
last block is in the recent window; a block that leaves the window off the stride is dropped
for good, and one on the stride is only ever displaced by newer ones, so no block comes back.
"""
from __future__ import annotations

from typing import Optional

from pydantic import ConfigDict, Field, model_validator

from vllm_graft.hooks import BlockView, Capabilities, KVCompressor, Params, Registration, hookimpl


class StridedParams(Params):
    """`budget_blocks`: blocks a request keeps in all; `sink_blocks`: leading blocks always kept;
    `recent_blocks`: the recent window (default: half of what the sinks leave); `stride`: keep
    every stride-th block between the sinks and the window."""

    model_config = ConfigDict(extra="forbid")

    budget_blocks: int = Field(16, ge=2, description="KV blocks a request keeps in all")
    sink_blocks: int = Field(1, ge=0, description="leading blocks always kept (attention sinks)")
    recent_blocks: Optional[int] = Field(None, ge=1, description="most recent blocks kept "
                                         "(default: half of budget_blocks - sink_blocks, at least 1)")
    stride: int = Field(2, ge=1, description="between sinks and window, keep every stride-th block")

    @model_validator(mode="after")
    def _fits(self):
        if self.sink_blocks >= self.budget_blocks:
            raise ValueError(f"sink_blocks ({self.sink_blocks}) must be smaller than budget_blocks "
                             f"({self.budget_blocks}): the recent window holds the block being written")
        if self.sink_blocks + self.recent > self.budget_blocks:
            raise ValueError(f"sink_blocks ({self.sink_blocks}) + recent_blocks ({self.recent}) must be "
                             f"at most budget_blocks ({self.budget_blocks})")
        return self

    @property
    def recent(self) -> int:
        if self.recent_blocks is not None:
            return self.recent_blocks
        return max(1, (self.budget_blocks - self.sink_blocks) // 2)


class Strided(KVCompressor[StridedParams]):
    needs_scores = False

    def keep(self, view: BlockView) -> list[int]:
        p = self.params
        nb = view.num_blocks
        sink = min(p.sink_blocks, nb)
        first_recent = max(sink, nb - p.recent)
        slots = max(0, p.budget_blocks - sink - (nb - first_recent))
        middle = [i for i in range(sink, first_recent) if (i - sink) % p.stride == 0]
        kept = set(range(sink)) | set(range(first_recent, nb)) | set(middle[max(0, len(middle) - slots):] if slots else ())
        return sorted(kept | set(view.pinned))

    def describe(self):
        p = self.params
        return {"budget_blocks": p.budget_blocks, "sink_blocks": p.sink_blocks, "recent_blocks": p.recent,
                "stride": p.stride}


@hookimpl
def graft_register_kv_compressors(register):
    register(Registration(
        name="strided",
        summary="keeps sink blocks, a recent window and every stride-th block in between, up to a budget",
        paper="- (a scoreless stand-in for TOVA: Oren et al. 2024, Transformers are Multi-State RNNs, "
              "arXiv:2401.06104)",
        params=StridedParams,
        impl="graft_flexq.strided:Strided",
        capabilities=Capabilities(lossless=False),
    ))
