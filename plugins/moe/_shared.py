"""Code several MoE schedulers use (pure NumPy/Python):

* :class:`StepAssembler`: one forward step's per-layer ``observe`` calls joined into per-token
  routing (``expert-cache``, ``affinity-placement``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class StepAssembler:
    """Joins one forward step's per-layer ``observe`` calls into per-token routing: feed
    ``add(layer, ids, weights)``; when every MoE layer of the step has been seen it returns
    ``sets`` (``[T][L]`` lists of the experts each token used, weight-0 slots dropped), else
    None. ``layers``: the MoE layers, in order (from ``MoEModel.moe_layers``)."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = list(layers)
        self._pending: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def add(self, layer: int, ids: np.ndarray, weights: np.ndarray | None):
        if layer in self._pending:  # a step left incomplete (should not happen): start over
            self._pending.clear()
        self._pending[layer] = (ids, weights)
        if len(self._pending) < len(self.layers) or set(self._pending) != set(self.layers):
            return None
        per = [self._pending[l] for l in self.layers]
        self._pending = {}
        T = per[0][0].shape[0]
        out = []
        for t in range(T):
            row = []
            for ids, w in per:
                row.append([int(e) for j, e in enumerate(ids[t]) if w is None or w[t, j] > 0])
            out.append(row)
        return out
