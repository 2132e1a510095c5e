"""WindowKV at block granularity (see ``__init__``). The technique is its score: the prompt blocks
that compete (after the sinks, before the observation window's and the recent blocks, which the
keep policy keeps anyway) are cut into windows of ``window_blocks`` consecutive blocks, and every
block of a window scores the window's observation mass (the sum of SnapKV's score, the mass the
prompt's last ``window_tokens`` queries put on a block, over the window's blocks).

The keep policy (``hooks.contracts.kvpolicy``) then takes the best blocks within the budget; as
the blocks of a window share one score and ties go to the older block, it takes whole windows,
best window first. Where the budget left after the fixed blocks is not a multiple of
``window_blocks``, the last window taken is cut to the blocks that fit: its leading ones (a
shorter run of consecutive blocks). The last window of the run may be shorter than the others
(the blocks left before the observation window); it competes with the mass of the blocks it has.
"""

from __future__ import annotations

from typing import Sequence

from ....hooks import BlockView
from ....hooks.contracts.kvpolicy import NEG_INF

from ..snapkv.reference import SnapKV


def window_runs(first: int, stop: int, window_blocks: int) -> list[range]:
    """Blocks ``[first, stop)`` cut into runs of ``window_blocks`` consecutive blocks, from
    ``first`` on (the last run shorter where the span is not a multiple)."""
    return [range(a, min(a + window_blocks, stop)) for a in range(first, stop, window_blocks)]


def window_scores(scores: Sequence[float], windows: Sequence[range]) -> list[float]:
    """``scores`` with every live block of each window scored by the window's mass (the sum of
    its live blocks' scores); a block dropped earlier (``-inf``) stays dropped, and the blocks of
    no window keep their own score."""
    out = [float(s) for s in scores]
    for win in windows:
        live = [i for i in win if out[i] != NEG_INF]
        mass = sum(out[i] for i in live)
        for i in live:
            out[i] = mass
    return out


class WindowKV(SnapKV):
    """SnapKV's observation window and protected blocks, scoring whole windows of blocks."""

    def windows(self, view: BlockView) -> list[range]:
        """The windows that compete for the budget: the prompt blocks after the ``sink_blocks``
        and before the first block kept anyway (the observation window's, or the
        ``recent_blocks`` last prompt blocks', whichever starts first), in runs of
        ``window_blocks``. The same span as the keep policy's candidates."""
        n = view.num_blocks
        prompt_blocks = min(n, -(-view.num_prompt_tokens // view.block_size))
        stop = max(0, min(prompt_blocks - self.params.recent_blocks, self.protected_start(view)))
        return window_runs(min(self.params.sink_blocks, n), stop, self.params.window_blocks)

    def score(self, view: BlockView) -> Sequence[float] | None:
        if view.scores is None:
            return None
        return window_scores(view.scores, self.windows(view))
