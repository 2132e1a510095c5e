"""SnapKV at block granularity (see ``__init__``); attention and mass from the worker's shared
attention with per-block mass (``kvcompress/_shared``), as H2O's."""

from __future__ import annotations

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.policy import top_blocks, with_pinned


class SnapKV(KVCompressor):
    needs_scores = True

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        return (max(0, num_prompt_tokens - self.params.window_tokens), num_prompt_tokens)

    def keep(self, view: BlockView) -> list[int]:
        p = self.params
        n = view.num_blocks
        prompt = view.num_prompt_tokens
        if view.num_tokens < prompt or view.scores is None:
            return list(range(n))  # prefill not finished: the window has not been seen
        B = view.block_size
        last = -(-prompt // B)  # prompt blocks
        window_start = min(max(0, prompt - p.window_tokens) // B, max(0, last - p.recent_blocks))
        fixed = set(range(min(p.sink_blocks, n))) | set(range(window_start, n))  # window + generated
        prompt_fixed = {i for i in fixed if i * B < prompt}
        if last <= p.budget_blocks:
            return list(range(n))
        room = max(0, p.budget_blocks - len(prompt_fixed))
        candidates = [i for i in range(min(window_start, n)) if i not in fixed and view.scores[i] != float("-inf")]
        return with_pinned(fixed | top_blocks(view.scores, candidates, room), view.pinned)

    def describe(self):
        return self.params.model_dump()
