"""SnapKV at block granularity (see ``__init__``). The technique is its score: the attention mass
the prompt's last ``window_tokens`` queries (the observation window) put on each prompt block,
the window's own blocks protected; the keep policy (``hooks.contracts.kvpolicy``) keeps the best
prompt blocks within the budget once the prompt is in. Attention and mass come from the worker's
shared attention with per-block mass (``kvcompress/_shared``), as H2O's. Ada-KV (per KV head),
PyramidKV (per layer) and Expected Attention (scores from the cache) build on this scorer."""

from __future__ import annotations

from typing import Sequence

from ....hooks import BlockView, PolicyCompressor


class SnapKV(PolicyCompressor):
    needs_scores = True
    scope = "prompt"  # the generated blocks are all kept
    when = "prefill"

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        """The observation window: the prompt's last ``window_tokens`` queries."""
        return (max(0, num_prompt_tokens - self.params.window_tokens), num_prompt_tokens)

    def score(self, view: BlockView) -> Sequence[float] | None:
        return view.scores

    def protected_start(self, view: BlockView) -> int:
        """The window's first block: the window itself is always kept."""
        return max(0, view.num_prompt_tokens - self.params.window_tokens) // view.block_size
