"""PyramidKV at block granularity, per decoder layer (see ``__init__``): SnapKV's window scores per
layer, and the technique, :meth:`PyramidKV.layer_budgets`: budgets falling from the first layer to
the last, under the keep policy's ``allocation: layers`` (``hooks.contracts.kvpolicy``: the blocks
each layer keeps, ``keep_layers``, and their union, ``keep``). The per-layer masked attention with
per-layer mass is the worker's shared one (``kvcompress/_shared``)."""

from __future__ import annotations

from typing import Sequence

from ....hooks import BlockView
from ....hooks.contracts.kvpolicy import top_live_blocks

from ..snapkv.reference import SnapKV


class PyramidKV(SnapKV):
    per_layer = True
    allocation = "layers"

    def layer_budgets(self, view: BlockView, layers: int) -> list[int]:
        """Each decoder layer's budget, falling linearly from the first layer to the last,
        ``min_fraction`` of the average at the top and as much more at the bottom, so that they
        average to the budget."""
        return self._budgets(self.policy.budget(view), layers)

    def _budgets(self, avg: int, layers: int) -> list[int]:
        if layers <= 1:
            return [avg] * layers
        top = self.params.min_fraction * avg
        bottom = 2 * avg - top
        return [max(1, round(bottom + (top - bottom) * layer / (layers - 1))) for layer in range(layers)]

    def allocate(
        self, unit_scores: Sequence[Sequence[float]], candidates: list[int], budget: int, taken: int
    ) -> list[set[int]]:
        """Each layer its own best blocks by its own scores, up to its budget; ``held_blocks`` caps
        their union (the memory held: vLLM frees a block only when no layer keeps it): the chosen
        blocks with the best scores (a block's best over the layers that chose it) are held, and
        each layer then takes its own best among them."""
        budgets = self._budgets(budget, len(unit_scores))
        chosen = [top_live_blocks(s, candidates, b - taken) for s, b in zip(unit_scores, budgets)]
        union = set().union(*chosen)
        held_blocks = self.params.held_blocks
        if held_blocks is not None and len(union) > max(0, held_blocks - taken):
            best = {i: max(float(s[i]) for s, c in zip(unit_scores, chosen) if i in c) for i in union}
            held = sorted(union, key=lambda i: (-best[i], i))[: max(0, held_blocks - taken)]
            # the memory is held anyway: each layer reads its own best among the held blocks
            chosen = [top_live_blocks(s, held, b - taken) for s, b in zip(unit_scores, budgets)]
        return chosen
