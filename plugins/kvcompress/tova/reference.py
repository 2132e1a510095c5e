"""TOVA at block granularity (Oren et al. 2024, arXiv:2401.06104): over budget, keep the
``budget_blocks`` blocks with the most attention from the current query (``sink_blocks``
leading ones and the block being written always among them). The current query is the one
:meth:`TOVA.score_positions` observes: the prompt's last token at prefill, then each generated
token; mid-prefill (chunked) nothing is dropped, as no query of the step is the current one."""

from __future__ import annotations

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.policy import keep_top


class TOVA(KVCompressor):
    needs_scores = True

    def keep(self, view: BlockView) -> list[int]:
        # this step's queries only (view.step_scores): TOVA ranks by the current query
        return keep_top(view, view.step_scores, self.params.budget_blocks, self.params.sink_blocks)

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        """The current query: the prompt's last token at prefill, then each generated one."""
        return (max(0, num_prompt_tokens - 1), 1 << 62)

    def describe(self):
        return self.params.model_dump()
