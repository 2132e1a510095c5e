"""TOVA at block granularity (Oren et al. 2024, arXiv:2401.06104): over budget, keep the
``budget_blocks`` blocks with the most attention from the current query (``sink_blocks``
leading ones and the block being written always among them). The technique is its score, the
current query's mass; the keep policy (``hooks.contracts.kvpolicy``) does the rest. The current
query is the prompt's last token at prefill, then each generated token; mid-prefill (chunked)
nothing is dropped, as no query of the step is the current one (``when = "prefill"``)."""

from __future__ import annotations

from typing import Sequence

from ....hooks import BlockView, PolicyCompressor


class TOVA(PolicyCompressor):
    needs_scores = True
    when = "prefill"

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        """The queries whose mass counts: the prompt's last token, then every generated one."""
        return (max(0, num_prompt_tokens - 1), 1 << 62)

    def score(self, view: BlockView) -> Sequence[float] | None:
        return view.step_scores
