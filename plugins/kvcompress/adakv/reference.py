"""Ada-KV at block granularity, per KV head (see ``__init__``): the blocks each head keeps
(:meth:`AdaKV.keep_heads`) and their union (:meth:`AdaKV.keep`); the per-head masked attention
with per-head mass is the worker's shared one (``kvcompress/_shared``)."""

from __future__ import annotations

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.policy import adaptive_head_budget, with_pinned


class AdaKV(KVCompressor):
    needs_scores = True
    per_head = True

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        return (max(0, num_prompt_tokens - self.params.window_tokens), num_prompt_tokens)

    def keep_heads(self, view: BlockView) -> list[list[int]]:
        p = self.params
        n = view.num_blocks
        heads = view.head_scores
        if heads is None:  # asked per block only: the summed scores as one head
            heads = None if view.scores is None else [view.scores]
        prompt = view.num_prompt_tokens
        everything = list(range(n))
        if heads is None or view.num_tokens < prompt:
            return [with_pinned(everything, view.pinned) for _ in (heads or [()])]
        B = view.block_size
        last = -(-prompt // B)  # prompt blocks
        if last <= p.budget_blocks:
            return [with_pinned(everything, view.pinned) for _ in heads]
        window_start = min(max(0, prompt - p.window_tokens) // B, max(0, last - p.recent_blocks))
        fixed = set(range(min(p.sink_blocks, n))) | set(range(window_start, n))  # window + generated
        prompt_fixed = {i for i in fixed if i * B < prompt}
        room = max(0, p.budget_blocks - len(prompt_fixed))  # per head, on average
        cap = None if p.held_blocks is None else max(0, p.held_blocks - len(prompt_fixed))
        candidates = [i for i in range(min(window_start, n)) if i not in fixed]
        chosen = adaptive_head_budget(heads, candidates, len(heads) * room, floor=int(p.floor_fraction * room), cap=cap)
        return [with_pinned(fixed | mine, view.pinned) for mine in chosen]

    def keep(self, view: BlockView) -> list[int]:
        """The blocks some head keeps (the others are freed)."""
        return sorted(set().union(*map(set, self.keep_heads(view))))

    def describe(self):
        return self.params.model_dump()
