"""Code several MoE schedulers use (pure NumPy/Python):

* :class:`StepAssembler`: one forward step's per-layer ``observe`` calls joined into per-token
  routing (``expert-cache``, ``affinity-placement``); :func:`step_sets`, the same fed from an
  ``observe`` call's tensors;
* :func:`loadable_file`: a parameter naming a file the plugin reads (``expert-mask``'s mask,
  ``affinity-placement``'s placement), resolved and read once when the deployment is validated.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # annotations only: the registrations import this module, and need no numpy
    import numpy as np

from ...hooks.deployment import param_path


def loadable_file(value: str | None, info: Any, load: Callable[[Path], object]) -> str | None:
    """None stays None; else the path as :func:`~vllm_graft.hooks.deployment.param_path` resolves
    it (``info``: the validator's), read once by ``load`` (whose ValueError names the problem),
    returned absolute: vLLM's other processes may start elsewhere."""
    if value is None:
        return value
    path = param_path(value, info)
    load(path)
    return str(path)


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


def step_sets(assembler: StepAssembler | None, layer: int, topk_ids, topk_weights) -> list[list[list[int]]]:
    """:meth:`StepAssembler.add` for an ``observe`` call's ``topk_ids`` / ``topk_weights`` tensors:
    the step's per-token expert sets once this call completes it, else (and before ``bind``,
    ``assembler`` None) an empty list."""
    if assembler is None:
        return []
    return assembler.add(layer, topk_ids.cpu().numpy(), topk_weights.float().cpu().numpy()) or []
