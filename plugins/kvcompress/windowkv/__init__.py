"""`windowkv` KV compressor (WindowKV, Zuo et al. 2025, "WindowKV: Task-Adaptive Group-Wise KV Cache
Window Selection for Efficient LLM Inference", arXiv:2503.17922) at block granularity: once the
prompt is prefilled, keep whole **windows** of consecutive prompt blocks, those the observation
window (the prompt's last ``window_tokens`` queries, as SnapKV's) attends to most.

A window is a run of ``window_blocks`` consecutive prompt blocks (``window_blocks`` x the block
size tokens), counted from the first block after the ``sink_blocks``; its score is the observation
mass on its blocks (summed over its blocks, heads and layers). The best whole windows are kept
within ``budget_blocks`` prompt blocks, besides what is always kept: the ``sink_blocks`` leading
blocks, the observation window's blocks, the ``recent_blocks`` last prompt blocks (0 by default, as
SnapKV's) and every generated block. A window is kept in part only where the budget forces it: when the
blocks the budget leaves after those are not a multiple of ``window_blocks``, the last window
taken keeps its leading blocks, as many as fit (the remainder is spent, not left unused). The
last window before the observation window may be shorter than the others (what is left of the
prompt); it competes with the mass of the blocks it has. Mid-prefill (chunked prefill) nothing is
dropped. ``window_blocks: 1`` is SnapKV at block granularity (each block a window of its own).

Changes from the paper:

* **The layer group is all layers.** The paper shares the selected indices within groups of
  layers (intra-group index sharing) and gives the groups their own budgets. vLLM frees a KV block
  for every layer at once (one KV-cache group), so here the one group is every layer: a window's
  score is summed over all layers and heads, and all layers keep the same windows.
* **No task classifier.** The paper adapts the window selection to the task, with a trained
  classifier of the task's type; that classifier is not reproduced. ``window_blocks`` is one int
  per deployment: set it for the workload (smaller to localise a detail, larger to keep longer
  stretches of context).
* **Windows of blocks, not tokens.** vLLM's unit of KV memory is the block (16-128 tokens), so a
  window is a whole number of blocks.
"""

from pydantic import Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl
from ..snapkv import SnapKVParams


class WindowKVParams(SnapKVParams):
    window_blocks: int = Field(
        2,
        ge=1,
        description="KV blocks per window: the prompt is kept in whole runs of this many consecutive blocks "
        "(1: each block on its own, as snapkv); the paper's per-task choice of the window is not reproduced",
    )

    @model_validator(mode="after")
    def _a_window_fits(self):
        if self.keep_ratio is not None:
            return self  # the budget comes from each prompt's length: a window may then be cut
        # the observation window takes at least one block (the prompt's last), or the recent blocks
        room = self.budget_blocks - self.sink_blocks - max(self.recent_blocks, 1)
        if self.window_blocks > room:
            raise ValueError(
                f"window_blocks ({self.window_blocks}) does not fit in the budget: budget_blocks "
                f"({self.budget_blocks}) less sink_blocks ({self.sink_blocks}) and the observation window's "
                f"or recent blocks (at least {max(self.recent_blocks, 1)}) leaves {max(room, 0)} blocks for "
                f"windows, so no whole window could be kept; "
                + (f"set window_blocks to at most {room} or " if room >= 1 else "")
                + f"set budget_blocks to at least {self.sink_blocks + max(self.recent_blocks, 1) + self.window_blocks}"
            )
        return self

    def check_deployment(self, ctx) -> list[str]:
        """SnapKV's check (the observation window's blocks fit in the budget), then that a whole
        window fits beside them at the deployment's block size."""
        problems = super().check_deployment(ctx)
        if problems or ctx.block_size is None or self.keep_ratio is not None:
            return problems
        spans = -(-(self.window_tokens - 1) // ctx.block_size) + 1  # as SnapKV counts them
        fixed = self.sink_blocks + max(self.recent_blocks, spans)
        if fixed + self.window_blocks <= self.budget_blocks:
            return []
        return [
            f"window_blocks {self.window_blocks}: with blocks of {ctx.block_size} tokens the observation window "
            f"(window_tokens {self.window_tokens}) spans up to {spans} blocks, so sink_blocks {self.sink_blocks} "
            f"and those leave {max(0, self.budget_blocks - fixed)} of budget_blocks {self.budget_blocks} for "
            "windows; "
            + (f"set window_blocks to at most {self.budget_blocks - fixed} or " if self.budget_blocks > fixed else "")
            + f"set budget_blocks to at least {fixed + self.window_blocks}"
        ]


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="windowkv",
            summary="WindowKV: after prefill, keeps whole windows of consecutive prompt blocks, "
            "those the observation window attends to most",
            paper="Zuo et al. 2025, WindowKV: Task-Adaptive Group-Wise KV Cache Window Selection for Efficient "
            "LLM Inference (arXiv:2503.17922)",
            params=WindowKVParams,
            impl="vllm_graft.plugins.kvcompress.windowkv.reference:WindowKV",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
