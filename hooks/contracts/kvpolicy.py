"""Scorer x policy: an eviction compressor as a block **scorer** and a **keep policy**, as
kvpress separates them (pure Python, no tensors, no vLLM).

A compressor built on :class:`PolicyCompressor` says only how much each block is worth
(:meth:`PolicyCompressor.score`, and for a scorer that reads the cache
:meth:`~.kvcompress.KVCompressor.block_scores`); :class:`KeepPolicy` says which blocks stay:

* **budget**: ``budget_blocks``, or ``keep_ratio`` of the prompt's blocks (kvpress's
  compression ratio is the fraction *removed*: ratio 0.75 there is ``keep_ratio: 0.25`` here);
* **what is fixed**: ``sink_blocks`` leading blocks, the ``recent_blocks`` last blocks of the
  scope (the block being written always), and what the scorer protects (SnapKV's observation
  window: :meth:`PolicyCompressor.protected_start`);
* **scope**: ``all`` blocks compete, or only the ``prompt``'s (the generated ones are all kept,
  as SnapKV and Ada-KV do); the budget then counts prompt blocks;
* **when**: at every step, prefill chunks included (``chunk``), or only once the prompt is in
  (``prefill``); ``slack_blocks`` lets a request hold up to ``budget + slack`` blocks before it
  is cut back to ``budget`` (decode-time compression with a buffer, as R-KV compresses
  reasoning traces: one eviction per ``slack`` blocks instead of one per block);
* **allocation**: one budget for the request (``uniform``), or one per KV head (``heads``) or
  per decoder layer (``layers``), shared out by the compressor's
  :meth:`PolicyCompressor.allocate` (each unit its own best by default). Per head and per layer
  only *mask*: vLLM frees a block for every layer and head at once (one KV-cache group), so a
  block is freed only when no head (layer) keeps it; a smaller budget in some heads or layers
  stops them reading blocks, it frees nothing others keep.

Nothing here is a paper's technique: each one lives in its plugin's folder
(``plugins/kvcompress/<name>/reference.py``: StreamingLLM's recency, H2O's accumulated mass,
SnapKV's observation window, TOVA's current query, Ada-KV's allocation over heads, PyramidKV's
budgets over layers). A scorer is a :class:`PolicyCompressor`
subclass with a ``score`` (and where it needs one a ``score_positions``, a ``protected_start`` or
a ``block_scores``) and a parameter model with the policy's fields (:class:`PolicyParams`);
every policy field then works for it. :class:`CacheScores` is the one shared base: its score is
the step's :meth:`~.kvcompress.KVCompressor.block_scores`, for scorers that read the keys in the
cache (K-norm, KeyDiff). ``docs/tutorial.md`` shows one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Literal, Sequence

from pydantic import Field, model_validator

from ..registry import KernelParams
from .kvcompress import BlockView, KVCompressor, union_of_heads

NEG_INF = float("-inf")
_LIVE: Any = object()  # KeepPolicy._frame: keep the blocks not dropped yet

Scope = Literal["all", "prompt"]
When = Literal["chunk", "prefill"]
Allocation = Literal["uniform", "heads", "layers"]


# ------------------------------------------------------------------ block planners
def sink_window(num_blocks: int, sink: int, window: int) -> set[int]:
    """The first ``sink`` and the last ``window`` of ``num_blocks`` blocks."""
    return set(range(min(sink, num_blocks))) | set(range(max(0, num_blocks - window), num_blocks))


def with_pinned(mine: Iterable[int], pinned: Iterable[int]) -> list[int]:
    return sorted(set(mine) | set(pinned))


def top_blocks(scores: Sequence[float], candidates: Iterable[int], k: int) -> set[int]:
    """The ``k`` candidates with the highest score (ties: the older block first, so the
    answer is a deterministic function of the scores)."""
    if k <= 0:
        return set()
    ranked = sorted(candidates, key=lambda i: (-float(scores[i]), i))
    return set(ranked[:k])


def top_live_blocks(scores: Sequence[float], candidates: Iterable[int], k: int) -> set[int]:
    """:func:`top_blocks` among the candidates not dropped yet (score ``-inf``: never chosen)."""
    return top_blocks(scores, [i for i in candidates if scores[i] != NEG_INF], k)


# ------------------------------------------------------------------ the keep policy
@dataclass(frozen=True)
class KeepPolicy:
    """Which blocks stay, given one score per block (see the module docstring)."""

    budget_blocks: int = 16
    keep_ratio: float | None = None
    sink_blocks: int = 0
    recent_blocks: int = 1
    scope: Scope = "all"
    when: When = "chunk"
    slack_blocks: int = 0

    @classmethod
    def from_params(cls, params: Any, **fixed: Any) -> "KeepPolicy":
        """The policy a plugin's parameters set (its fields named as this class's), over the
        ``fixed`` choices of the compressor itself (``scope``, ``when``)."""
        values = {
            f.name: getattr(params, f.name) for f in fields(cls) if f.name not in fixed and hasattr(params, f.name)
        }
        return cls(**values, **fixed)

    def budget(self, view: BlockView) -> int:
        """Blocks kept of the scope: ``budget_blocks``, or ``keep_ratio`` of the prompt's blocks
        (rounded up; never fewer than the fixed blocks, nor 2)."""
        if self.keep_ratio is None:
            return self.budget_blocks
        prompt_blocks = -(-view.num_prompt_tokens // view.block_size)
        return max(2, self.sink_blocks + self.recent_blocks, math.ceil(round(self.keep_ratio * prompt_blocks, 6)))

    def _frame(self, view: BlockView, scores: Sequence[float], protected_start: int | None):
        """``(fixed, candidates, budget, fixed_in_scope)``: the blocks always kept, the scope's
        others, the budget and how much of it the fixed blocks take; None when every block
        stays (mid-prefill with ``when: prefill``, or within the budget: nothing was dropped
        yet), ``_LIVE`` when the blocks not dropped yet stay (within the slack)."""
        n = view.num_blocks
        if self.when == "prefill" and view.num_tokens < view.num_prompt_tokens:
            return None  # mid-prefill: the prompt's queries have not all been seen
        end = n if self.scope == "all" else min(n, -(-view.num_prompt_tokens // view.block_size))
        budget = self.budget(view)
        if end <= budget:
            return None
        start = max(0, end - self.recent_blocks)
        if protected_start is not None:
            start = min(start, max(0, protected_start))
        fixed = set(range(min(self.sink_blocks, n))) | set(range(start, n)) | {n - 1}
        if self.slack_blocks and sum(1 for i in range(end) if scores[i] != NEG_INF) <= budget + self.slack_blocks:
            return _LIVE  # within the buffer: cut back to the budget only once it is full
        candidates = [i for i in range(end) if i not in fixed]
        return fixed, candidates, budget, sum(1 for i in fixed if i < end)

    def keep(self, view: BlockView, scores: Sequence[float] | None, protected_start: int | None = None) -> list[int]:
        """The blocks kept (:meth:`KVCompressor.keep`'s answer) given one score per block
        (``-inf``: dropped earlier; ``None``: asked without scores, so every block stays)."""
        n = view.num_blocks
        if scores is None:
            return list(range(n))
        frame = self._frame(view, scores, protected_start)
        if frame is None:
            return list(range(n))
        if frame is _LIVE:
            return with_pinned((i for i in range(n) if scores[i] != NEG_INF or i == n - 1), view.pinned)
        fixed, candidates, budget, taken = frame
        return with_pinned(fixed | top_live_blocks(scores, candidates, budget - taken), view.pinned)

    def _per_unit(self, view: BlockView, units: Sequence[Sequence[float]] | None, protected_start: int | None):
        """For :meth:`keep_heads` / :meth:`keep_layers`: ``(answer, None)`` when every unit's
        answer is already known (no scores, nothing due, within the slack), else
        ``(None, frame)``. A block every unit dropped is ``-inf`` for the request."""
        n = view.num_blocks
        if units is None:
            return [with_pinned(range(n), view.pinned)], None
        summed = [NEG_INF if all(u[i] == NEG_INF for u in units) else 0.0 for i in range(n)]
        frame = self._frame(view, summed, protected_start)
        if frame is None:
            return [with_pinned(range(n), view.pinned) for _ in units], None
        if frame is _LIVE:
            return [
                with_pinned((i for i in range(n) if u[i] != NEG_INF or i == n - 1), view.pinned) for u in units
            ], None
        return None, frame

    def keep_units(
        self,
        view: BlockView,
        unit_scores: Sequence[Sequence[float]] | None,
        protected_start: int | None,
        allocate: Callable[[Sequence[Sequence[float]], list[int], int, int], list[set[int]]],
    ) -> list[list[int]]:
        """Per unit (KV head, decoder layer: ``allocation: heads`` / ``layers``), the blocks it
        keeps: the fixed blocks, and what ``allocate(unit_scores, candidates, budget, taken)``
        gives each unit of the scope's other blocks (``budget``: a unit's average, of which the
        fixed blocks take ``taken``). How a budget is shared out over heads or layers is the
        plugin's technique (Ada-KV, PyramidKV: :meth:`PolicyCompressor.allocate`)."""
        known, frame = self._per_unit(view, unit_scores, protected_start)
        if known is not None:
            return known
        assert unit_scores is not None
        fixed, candidates, budget, taken = frame
        chosen = allocate(unit_scores, candidates, budget, taken)
        return [with_pinned(fixed | mine, view.pinned) for mine in chosen]


class PolicyParams(KernelParams):
    """The policy's parameters a scored compressor exposes (add them to its parameter model):
    ``keep_ratio`` (instead of ``budget_blocks``) and ``slack_blocks``."""

    budget_blocks: int = Field(16, ge=2, description="KV blocks a request keeps in all")
    keep_ratio: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="keep this fraction of the prompt's blocks instead of budget_blocks (kvpress's "
        "compression_ratio is the fraction removed: 0.75 there is keep_ratio 0.25 here)",
    )
    slack_blocks: int = Field(
        0,
        ge=0,
        description="let a request hold budget + slack_blocks blocks before cutting it back to the "
        "budget (decode-time compression with a buffer, as R-KV: one eviction per slack blocks); 0: every step",
    )

    @model_validator(mode="after")
    def _one_budget(self):
        if self.keep_ratio is not None and "budget_blocks" in self.model_fields_set:
            raise ValueError(
                f"set budget_blocks ({self.budget_blocks}) or keep_ratio ({self.keep_ratio}), not both: "
                "keep_ratio sets the budget from the prompt's length"
            )
        return self


# ------------------------------------------------------------------ the compressor
class PolicyCompressor(KVCompressor):
    """An eviction compressor as a scorer (:meth:`score`) and a :class:`KeepPolicy` (from its
    parameters, :meth:`policy`). Combine it with one of the scorer mixins below, or implement
    :meth:`score` (and ``needs_scores``, ``score_positions``, ``block_scores`` as it needs)."""

    #: the policy choices the compressor fixes (its parameters set the numbers)
    scope: Scope = "all"
    when: When = "chunk"
    allocation: Allocation = "uniform"

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.policy = KeepPolicy.from_params(params, scope=self.scope, when=self.when)
        if self.policy.slack_blocks and not self.needs_scores:
            raise ValueError(
                f"{type(self).__name__}: slack_blocks needs a scored compressor (the scheduler and the worker "
                "decide an unscored one's blocks each on their own, from the block count alone); set slack_blocks: 0"
            )
        for unit, flag in (("heads", "per_head"), ("layers", "per_layer")):
            if (self.allocation == unit) != bool(getattr(self, flag)):
                raise TypeError(
                    f"{type(self).__name__}: allocation {unit!r} and {flag} = True go together "
                    f"(allocation {self.allocation!r}, {flag} {getattr(self, flag)})"
                )

    def score(self, view: BlockView) -> Sequence[float] | None:
        """One score per block of ``view`` (higher: kept first; ``-inf``: dropped earlier), or
        None when there is nothing to score by (then every block stays)."""
        raise NotImplementedError(f"{type(self).__name__} implements no score()")

    def head_score(self, view: BlockView) -> Sequence[Sequence[float]] | None:
        """Per KV head, one score per block (``allocation: heads``). Default: ``view.head_scores``
        (or the summed scores as one head when asked per block only)."""
        if view.head_scores is not None:
            return view.head_scores
        scores = self.score(view)
        return None if scores is None else [scores]

    def protected_start(self, view: BlockView) -> int | None:
        """The first block of what the scorer itself needs kept (e.g. the observation window's),
        kept with the recent blocks; None: nothing."""
        return None

    def layer_score(self, view: BlockView) -> Sequence[Sequence[float]] | None:
        """Per decoder layer, one score per block (``allocation: layers``). Default:
        ``view.layer_scores`` (or the summed scores as one layer when asked per block only)."""
        if view.layer_scores is not None:
            return view.layer_scores
        scores = self.score(view)
        return None if scores is None else [scores]

    def keep(self, view: BlockView) -> list[int]:
        if self.allocation == "heads":
            return union_of_heads(self.keep_heads(view))
        if self.allocation == "layers":
            return union_of_heads(self.keep_layers(view))
        return self.policy.keep(view, self.score(view), self.protected_start(view))

    def keep_heads(self, view: BlockView) -> list[list[int]]:
        return self.policy.keep_units(view, self.head_score(view), self.protected_start(view), self.allocate)

    def keep_layers(self, view: BlockView) -> list[list[int]]:
        return self.policy.keep_units(view, self.layer_score(view), self.protected_start(view), self.allocate)

    def allocate(
        self, unit_scores: Sequence[Sequence[float]], candidates: list[int], budget: int, taken: int
    ) -> list[set[int]]:
        """``allocation: heads`` / ``layers``: each unit's blocks among ``candidates`` (the scope's
        blocks besides the fixed ones, which take ``taken`` of the average ``budget``). Default:
        each unit its own best ``budget - taken``; Ada-KV and PyramidKV share the budget out
        unevenly (their plugins' ``allocate``)."""
        return [top_live_blocks(s, candidates, budget - taken) for s in unit_scores]

    def describe(self) -> dict[str, Any]:
        return self.params.model_dump() if hasattr(self.params, "model_dump") else {}


# ------------------------------------------------------------------ the one shared scorer base
class CacheScores(PolicyCompressor):
    """This step's :meth:`block_scores` (implement it): what the keys in the cache say now,
    summed over layers (K-norm, KeyDiff); only once the prompt is in."""

    needs_scores = True
    when: When = "prefill"
    kv_layouts = ("blocked", "packed", "cpu_vec")  # block_scores reads through layer.kv_layout.split

    def score(self, view: BlockView) -> Sequence[float] | None:
        return view.step_scores
