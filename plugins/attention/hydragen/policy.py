"""Hydragen's planner: shared prefixes found in the block tables, at any depth (pure Python).

With prefix caching, requests that share a prefix hold the same physical block ids in the
leading columns of their block-table rows. The planner builds a radix tree over those rows:
each edge is a run of blocks held by the same set of (at least ``min_group``) sequences, so
a shared system prompt, then few-shot examples shared by a sub-group, then n>1 samples of
one prompt become three nested groups. Each group's attention is computed once with the
queries of all its sequences stacked; what is left of each sequence (its *suffix*, the
blocks after its deepest group, the new tokens included) is attended per sequence.

Only blocks whose every token precedes the sequence's first new token are *eligible* for a
group: their keys are visible to every query of the sequence (no causal mask inside a
group), and the unused tail of a block-table row (stale or other sequences' ids) is never
looked at.

Invariant (checked by :func:`check_plan`): for every sequence, its groups cover its logical
blocks ``[0, suffix_start)`` contiguously, one level after another, and the suffix covers
``[suffix_start * block_size, seq_len)``; so the partial attentions add up to attention over
exactly the sequence's context.

:class:`StepPlan` is what ``Hydragen.plan(batch)`` returns once per step: the batch as Python
lists (read from its tensors once) and the tree, built on first use for a block size; the
reference and the Triton launcher both read it (:func:`group_rows`), and the launcher keeps its
per-step index tensors in ``StepPlan.cache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ....hooks import PagedBatch


@dataclass(frozen=True)
class PrefixGroup:
    """A run of blocks read once for every sequence in ``seqs``."""

    seqs: tuple[int, ...]  # sequence (row) indices, ascending, at least min_group of them
    start_block: int  # logical index of its first block (the same in every member's row)
    blocks: tuple[int, ...]  # physical block ids
    level: int  # 0 for a root group, 1 for a group nested in one group, ...


@dataclass(frozen=True)
class PrefixPlan:
    groups: tuple[PrefixGroup, ...]
    suffix_start: tuple[int, ...]  # per sequence: first logical block of its own suffix
    block_size: int

    @property
    def depth(self) -> int:
        return 1 + max((g.level for g in self.groups), default=-1)


def eligible_blocks(seq_len: int, q_len: int, block_size: int) -> int:
    """Full blocks of a sequence whose tokens all come before its first new token."""
    return max(0, seq_len - q_len) // block_size


def plan_prefixes(
    rows: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    block_size: int,
    *,
    min_group: int = 2,
    min_blocks: int = 1,
) -> PrefixPlan:
    """The shared-prefix tree of one step's batch.

    ``rows[i]`` is sequence i's block-table row (any length, only the eligible leading blocks
    are read); ``seq_lens[i]`` its tokens including the ``q_lens[i]`` new ones. A run shared by
    fewer than ``min_group`` sequences, or shorter than ``min_blocks`` blocks, is not a group
    (its sequences attend to it in their suffix).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive (got {block_size})")
    if min_group < 2:
        raise ValueError(f"min_group must be at least 2 (got {min_group})")
    n = len(seq_lens)
    if len(rows) != n or len(q_lens) != n:
        raise ValueError(f"{len(rows)} rows, {n} seq_lens and {len(q_lens)} q_lens: one each per sequence")
    own = [list(rows[i][: eligible_blocks(int(seq_lens[i]), int(q_lens[i]), block_size)]) for i in range(n)]
    suffix = [0] * n
    groups: list[PrefixGroup] = []
    # (members sharing own[m][:depth], depth, level); sequences without new tokens take no part
    stack = [([i for i in range(n) if int(q_lens[i]) > 0], 0, 0)]
    while stack:
        members, depth, level = stack.pop()
        buckets: dict[int, list[int]] = {}
        for s in members:
            if len(own[s]) > depth:
                buckets.setdefault(int(own[s][depth]), []).append(s)
            else:
                suffix[s] = depth
        for sub in buckets.values():
            if len(sub) < min_group:
                for s in sub:
                    suffix[s] = depth
                continue
            end = depth + 1
            first = own[sub[0]]
            while all(len(own[s]) > end for s in sub) and all(own[s][end] == first[end] for s in sub):
                end += 1
            if end - depth < min_blocks:
                for s in sub:
                    suffix[s] = depth
                continue
            groups.append(PrefixGroup(tuple(sub), depth, tuple(int(b) for b in first[depth:end]), level))
            stack.append((sub, end, level + 1))
    groups.sort(key=lambda g: (g.level, g.seqs[0], g.start_block))
    return PrefixPlan(tuple(groups), tuple(suffix), block_size)


def check_plan(plan: PrefixPlan, rows: Sequence[Sequence[int]], seq_lens: Sequence[int], q_lens: Sequence[int]) -> None:
    """Raise AssertionError unless ``plan`` keeps the invariant of the module docstring."""
    bs = plan.block_size
    covered: dict[int, list[PrefixGroup]] = {}
    for g in plan.groups:
        assert len(g.seqs) >= 2 and len(set(g.seqs)) == len(g.seqs), g
        for s in g.seqs:
            assert list(rows[s][g.start_block : g.start_block + len(g.blocks)]) == list(g.blocks), (s, g)
            covered.setdefault(s, []).append(g)
    for s in range(len(seq_lens)):
        mine = sorted(covered.get(s, []), key=lambda g: g.start_block)
        at = 0
        for level, g in enumerate(mine):
            assert g.start_block == at and g.level == level, (s, mine)
            at += len(g.blocks)
        if int(q_lens[s]) == 0:
            assert not mine
            continue
        assert plan.suffix_start[s] == at, (s, plan.suffix_start[s], at)
        # every group block precedes the first new token
        assert at * bs <= int(seq_lens[s]) - int(q_lens[s]), (s, at, seq_lens[s], q_lens[s])


def kv_bytes_read(plan: PrefixPlan, seq_lens: Sequence[int], bytes_per_token: int) -> tuple[int, int]:
    """KV bytes one layer reads in one step: ``(plain, hydragen)``.

    Plain paged attention reads every sequence's whole context; Hydragen reads each group's
    blocks once and each sequence's suffix (``seq_len - suffix_start * block_size`` tokens).
    ``bytes_per_token``: keys and values of one token in one layer (2 * H_kv * D * dtype size).
    """
    plain = sum(int(n) for n in seq_lens) * bytes_per_token
    shared = sum(len(g.blocks) for g in plan.groups) * plan.block_size
    own = sum(int(n) - plan.suffix_start[i] * plan.block_size for i, n in enumerate(seq_lens))
    return plain, (shared + own) * bytes_per_token


class StepPlan:
    """What ``plan(batch)`` returns: the batch in Python lists, the prefix tree built on first
    use for the layer's block size (one per step; every layer shares it)."""

    def __init__(self, batch: PagedBatch, min_group: int = 2, min_blocks: int = 1) -> None:
        qsl = batch.query_start_loc.tolist()
        self.seq_lens: list[int] = [int(n) for n in batch.seq_lens.tolist()]
        self.q_lens: list[int] = [qsl[i + 1] - qsl[i] for i in range(len(self.seq_lens))]
        self.query_start: list[int] = qsl
        self._table = batch.block_table
        self._rows: list[list[int]] | None = None
        self._min_group, self._min_blocks = min_group, min_blocks
        self._plans: dict[int, PrefixPlan] = {}
        self.cache: dict[Any, Any] = {}  # per-step data of the Triton launcher

    def prefixes(self, block_size: int) -> PrefixPlan:
        plan = self._plans.get(block_size)
        if plan is None:
            if self._rows is None:
                width = max((-(-n // block_size) for n in self.seq_lens), default=0)
                self._rows = self._table[:, :width].tolist()
            plan = plan_prefixes(
                self._rows,
                self.seq_lens,
                self.q_lens,
                block_size,
                min_group=self._min_group,
                min_blocks=self._min_blocks,
            )
            self._plans[block_size] = plan
        return plan


def group_rows(plan: StepPlan, seqs: tuple[int, ...]) -> list[int]:
    """Token rows of the new tokens of ``seqs``, in order."""
    out: list[int] = []
    for s in seqs:
        out += range(plan.query_start[s], plan.query_start[s + 1])
    return out
