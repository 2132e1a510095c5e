"""Scored (``needs_scores``) compressors in the worker, vLLM-free: each request's accumulated
score per logical block (:class:`_Scores`), one step's plan of rows and attention mass
(:class:`_StepPlan`), and the attention the backend runs meanwhile (:class:`_ScoringAttention`).
See "The scores channel" in the package doc."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vllm_graft.hooks import BlockView, KVCompressor
from vllm_graft.integration.adapters.kvcompress import state as _state
from vllm_graft.integration.adapters.kvcompress.channel import trace
from vllm_graft.integration.adapters.kvcompress.keep import KeepError, check_keep, dropped_blocks
from vllm_graft.integration.adapters.kvcompress.rows import step_rows

if TYPE_CHECKING:
    import torch

NEG_INF = float("-inf")


@dataclass
class _ReqScores:
    scores: list[float]
    dropped: set[int]


@dataclass
class _StepPlan:
    """One step's rows as the scoring attention sees them (built in the metadata builder)."""

    rows: list[tuple[str, int, int, int, list[int]]]  # (req id, computed, q, prompt, skipped)
    cols: list[list[int]]  # per row: the logical block of each block-table column after compaction
    observe: "torch.Tensor"  # [T] bool: queries whose attention counts towards the scores
    mass: "torch.Tensor"  # [rows, width] float32, summed over layers
    block_size: int


class _Scores:
    """Worker-side state of a ``needs_scores`` compressor: per request, each logical block's
    accumulated score and the blocks dropped so far (see "The scores channel" above)."""

    def __init__(self, compressor: KVCompressor, name: str, count: Callable[[str, int], None],
                 reduce: Callable[[Any], Any] | None = None) -> None:
        self.compressor, self.name, self.count = compressor, name, count
        self.reqs: dict[str, _ReqScores] = {}
        self.pending: _StepPlan | None = None
        #: the step's mass ``[rows, width]`` -> its sum over the ranks that share the block table
        #: (tensor parallelism: each rank holds some KV heads, so its mass is partial; summed,
        #: every rank decides on all heads' mass, the same blocks as one rank would). None: as is.
        self.reduce = reduce

    def forget(self, req_ids: Any) -> None:
        for r in req_ids or ():
            self.reqs.pop(r, None)

    def skip(self, req_id: str, computed: int, block_size: int) -> list[int]:
        st = self.reqs.get(req_id)
        if computed <= 0 and st is not None:  # computed from scratch again (e.g. preempted)
            self.reqs.pop(req_id)
            return []
        if st is None:
            return []
        return sorted(i for i in st.dropped if (i + 1) * block_size <= computed)

    def plan(self, batch: Any) -> _StepPlan | None:
        import torch

        step = getattr(step_rows, "step", None)
        if step is None or not step.rows:
            self.pending = None
            return None
        qsl = batch.query_start_loc.tolist()
        T = qsl[len(step.rows)] if len(qsl) > len(step.rows) else qsl[-1]
        observe = torch.zeros(max(T, qsl[-1]), dtype=torch.bool)
        cols = []
        B = step.block_size
        for i, (req_id, computed, q, prompt, skip) in enumerate(step.rows):
            total = computed + q
            dropped = set(skip)
            cols.append([j for j in range(-(-total // B)) if j not in dropped])
            lo, hi = self.compressor.score_positions(prompt)
            a, b = max(lo, computed), min(hi, total)
            if a < b:
                observe[qsl[i] + a - computed: qsl[i] + b - computed] = True
        plan = _StepPlan(step.rows, cols, observe,
                         torch.zeros(len(step.rows), batch.block_table.shape[1], dtype=torch.float32), B)
        self.pending = plan
        return plan

    def finalize(self) -> dict[str, list[int]]:
        """After the step's forward: add its attention mass to the scores, ask ``keep`` and
        return the blocks newly dropped, per request."""
        plan, self.pending = self.pending, None
        if plan is None:
            return {}
        B = plan.block_size
        mass = (plan.mass if self.reduce is None else self.reduce(plan.mass)).tolist()
        drops: dict[str, list[int]] = {}
        for i, (req_id, computed, q, prompt, _) in enumerate(plan.rows):
            if q <= 0:
                continue
            st = self.reqs.setdefault(req_id, _ReqScores([], set()))
            total = computed + q
            nb = -(-total // B)
            st.scores.extend([0.0] * (nb - len(st.scores)))
            for j, logical in enumerate(plan.cols[i]):
                st.scores[logical] += mass[i][j]
            scores = tuple(NEG_INF if k in st.dropped else st.scores[k] for k in range(nb))
            view = BlockView(num_tokens=total, block_size=B, num_prompt_tokens=prompt, scores=scores)
            kept = check_keep(view, self.compressor.keep(view), self.name)
            back = sorted(st.dropped & set(kept))
            if back:
                raise KeepError(
                    f"kvcompress plugin {self.name!r}: keep() returned {kept} for {total} tokens, but "
                    f"block(s) {back} were dropped at an earlier step and their KV is gone; a dropped "
                    "block must stay dropped (dropped blocks have score -inf)")
            new = dropped_blocks(view, kept)
            new = [k for k in new if k not in st.dropped]
            if new:
                st.dropped.update(new)
                drops[req_id] = new
                trace("worker_dropped", len(new), req=req_id, blocks=new)
        self.count("worker_steps", sum(1 for r in plan.rows if r[2] > 0))
        return drops


class _ScoringAttention:
    """What the backend's attention seam runs while a ``needs_scores`` compressor is active:
    the compressor's :meth:`~vllm_graft.hooks.KVCompressor.attend`, its mass added to the step."""

    def __init__(self, scores: _Scores) -> None:
        self.scores = scores

    def plan(self, batch: Any) -> Any:
        return self.scores.plan(batch)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        import torch

        n = query.shape[0]
        observe = plan.observe[:n] if plan is not None else torch.zeros(n, dtype=torch.bool)
        if observe.numel() < n:
            observe = torch.cat([observe, torch.zeros(n - observe.numel(), dtype=torch.bool)])
        state = _state.active
        if state is not None and state.kv_format is not None and kv_cache.dtype == _uint8():
            # the cache is in the storage format: its attention reads it (and scores it)
            out, mass = state.kv_format.forward(query, kv_cache, batch, layer, observe)
        else:
            out, mass = self.scores.compressor.attend(query, kv_cache, batch, layer, observe)
        if plan is not None:
            rows, width = plan.mass.shape
            plan.mass += mass[:rows, :width].to(plan.mass.dtype)
        return out


def _uint8():
    import torch

    return torch.uint8
