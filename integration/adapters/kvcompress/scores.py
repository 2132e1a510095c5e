"""Scored (``needs_scores``) compressors in the worker, vLLM-free: each request's accumulated
score per logical block (:class:`_Scores`), one step's plan of rows and attention mass
(:class:`_StepPlan`), and the attention the backend runs meanwhile (:class:`_ScoringAttention`).
See "The scores channel" in the package doc."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ....hooks import BlockView, KVCompressor
from . import state as _state
from .channel import trace
from .keep import (
    KeepError,
    ask,
    check_keep,
    check_keep_heads,
    check_keep_layers,
    dropped_blocks,
    union_of_heads,
)
from .rows import step_rows
from .shared_attention import (
    attend_with_mass,
    block_scores,
    layouts_read,
    uses_shared_attention,
    scores_the_cache,
)

if TYPE_CHECKING:
    import torch

NEG_INF = float("-inf")


@dataclass
class _ReqScores:
    scores: list[float]
    dropped: set[int]  # blocks left out of attention (and freed): every head dropped them
    #: per_head: [H_kv][block]; per_layer: [layer][block] (the two never go together)
    head_scores: list[list[float]] = field(default_factory=list)
    #: per_head: the blocks each KV head no longer reads; per_layer: each layer's
    head_dropped: list[set[int]] = field(default_factory=list)

    def view(self, step: list[float], total: int, B: int, prompt: int, req_id: str | None, **heads: Any) -> BlockView:
        """What ``keep`` is asked after a step: the scores so far and ``step``'s own mass per
        logical block (``len(step)`` of them), -inf for a block already dropped."""
        nb = len(step)
        return BlockView(
            num_tokens=total,
            block_size=B,
            num_prompt_tokens=prompt,
            scores=tuple(NEG_INF if k in self.dropped else self.scores[k] for k in range(nb)),
            step_scores=tuple(NEG_INF if k in self.dropped else step[k] for k in range(nb)),
            request_id=req_id,
            **heads,
        )


@dataclass
class _StepPlan:
    """One step's rows as the scoring attention sees them (built in the metadata builder)."""

    rows: list[tuple[str, int, int, int, list[int]]]  # (req id, computed, q, prompt, skipped)
    cols: list[list[int]]  # per row: the logical block of each block-table column after compaction
    observe: "torch.Tensor"  # [T] bool: queries whose attention counts towards the scores
    mass: "torch.Tensor | None"  # [rows, width] (per_head: [rows, H_kv, width], made at the first layer) float32, summed over layers
    block_size: int
    head_dropped: list[list[set[int]] | None] | None = (
        None  # per_head (per_layer): per row, each KV head's (layer's) dropped blocks
    )
    _head_mask: Any = None
    #: per_layer: the unit is the decoder layer; each layer's mass ``[rows, width]`` by its index
    per_layer: bool = False
    layer_mass: dict[int, Any] = field(default_factory=dict)
    _layer_masks: Any = None  # per_layer: [num_seqs, layers + 1, width], built at the first layer
    #: some query of the step counts towards the scores (known on the host when planning)
    observed: bool = True
    #: the observed queries alone as a batch of their own, for a route that computes the step's
    #: output with its own kernel and only the mass here (:meth:`_ScoringAttention.mass_only`):
    #: ``(query rows [n] long, query_start_loc [S + 1], seq_lens [S], longest query)``; None:
    #: the scoring attention computes the whole step
    observed_batch: Any = None
    _observed_paged: Any = None  # that batch as a PagedBatch, made at the first layer

    def _dropped_mask(self, num_seqs: int, units: int, width: int, device: Any) -> "torch.Tensor":
        """``[num_seqs, units, width]`` bool on ``device``: False where a row's unit (KV head, or
        layer) dropped the block of that column; rows past the plan's read everything. Built on
        the host, where the rows' dropped sets are (Python sets: no device read), and moved once."""
        import torch

        m = torch.ones(num_seqs, units, width, dtype=torch.bool)
        for i, dropped in enumerate((self.head_dropped or [])[:num_seqs]):
            if not dropped:
                continue
            for j, logical in enumerate(self.cols[i][:width]):
                for u, d in enumerate(dropped[:units]):
                    if logical in d:
                        m[i, u, j] = False
        return m.to(device)

    def head_mask(self, num_seqs: int, hkv: int, width: int, device: Any = "cpu") -> "torch.Tensor":
        """per_head: ``[num_seqs, H_kv, width]`` bool on ``device``, False where a row's KV head
        dropped the block of that column (built and moved once per step, not per layer; rows
        past the plan's read everything)."""
        import torch

        m = self._head_mask
        if m is None or tuple(m.shape) != (num_seqs, hkv, width) or m.device != torch.device(device):
            self._head_mask = m = self._dropped_mask(num_seqs, hkv, width, device)
        return m

    def layer_mask(self, layer: int, num_seqs: int, hkv: int, width: int, device: Any = "cpu") -> "torch.Tensor":
        """per_layer: ``[num_seqs, H_kv, width]`` bool on ``device`` for decoder layer ``layer``,
        False where a row's layer dropped the block of that column (every KV head alike). Every
        layer's mask is built and moved once per step; each layer gets a view of its own."""
        import torch

        m = self._layer_masks
        if m is None or (m.shape[0], m.shape[2]) != (num_seqs, width) or m.device != torch.device(device):
            units = max((len(d) for d in (self.head_dropped or []) if d), default=0)
            # one all-True unit past the layers decided so far, for the layers no row has decided yet
            self._layer_masks = m = self._dropped_mask(num_seqs, units + 1, width, device)
        unit = min(layer, m.shape[1] - 1)
        return m[:, unit : unit + 1, :].expand(num_seqs, hkv, width)


class _Scores:
    """Worker-side state of a ``needs_scores`` compressor: per request, each logical block's
    accumulated score and the blocks dropped so far (see "The scores channel" above).

    Each step, :meth:`finalize` shows the compressor a :class:`BlockView` per request with the
    accumulated ``scores``, the step's own mass per block (``step_scores``: what this step
    added) and the request's id (``request_id``)."""

    def __init__(
        self,
        compressor: KVCompressor,
        name: str,
        count: Callable[[str, int], None],
        reduce: Callable[[Any], Any] | None = None,
        gather: Callable[[Any, int | None], tuple[Any, int]] | None = None,
    ) -> None:
        self.compressor, self.name, self.count = compressor, name, count
        self.reqs: dict[str, _ReqScores] = {}
        self.pending: _StepPlan | None = None
        #: the step's mass ``[rows, width]`` -> its sum over the ranks that share the block table
        #: (tensor parallelism: each rank holds some KV heads, so its mass is partial; summed,
        #: every rank decides on all heads' mass, the same blocks as one rank would). None: as is.
        self.reduce = reduce
        #: per_head: the step's mass ``[rows, H_kv here, width]`` and the model's KV heads ->
        #: every KV head's mass and this rank's first head (tensor parallelism: a rank holds
        #: some heads; all ranks then allocate over all heads, and each masks its own). None: as is.
        self.gather = gather
        self.total_heads: int | None = None  # the model's KV heads (per_head), read at the first plan
        self.heads_read = False
        self.local_heads: tuple[int, int | None] = (0, None)  # per_head: this rank's heads among them, [first, end)
        #: the compressor scores blocks from the cache (``block_scores``) in place of the mass
        self.from_cache = scores_the_cache(compressor)
        #: the mass alone may be computed apart from the step's output (the shared attention, one
        #: score per block, from the mass): see :meth:`_ScoringAttention.mass_only`
        #: scoring passes (``compressor.scoring_pass``): ``passes(runner, req_id, context_len) ->
        #: (block scores tensor or None, pair scores, seconds)``, set by the adapter (it runs the
        #: model: :func:`.scoring_forward.pass_block_scores`); None: the compressor asks for none
        self.passes: Callable[[Any, str, int], Any] | None = None
        self.runner: Any = None  # the step's model runner (noted at plan time), for the passes
        #: the last requests' pair scores ``[layers, H_kv, prompt]`` (on the host), for tests and tools
        self.recent_pairs: dict[str, Any] = {}
        self.mass_alone = (
            uses_shared_attention(compressor)
            and not self.from_cache
            and not getattr(compressor, "per_head", False)
            and not getattr(compressor, "per_layer", False)
        )

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
        self.runner = getattr(step, "runner", None)
        # vLLM's host copy (query_start_loc_cpu, noted by the rows' pass): no device read per step
        qsl = step.query_start_loc
        T = qsl[len(step.rows)] if len(qsl) > len(step.rows) else qsl[-1]
        observe = torch.zeros(max(T, qsl[-1]), dtype=torch.bool)
        cols = []
        B = step.block_size
        # per row: its observed query rows [first, end) and its length cut at the last observed
        # position b (the compacted length: every dropped block lies before this step's tokens)
        spans: list[tuple[int, int, int]] = []
        for i, (req_id, computed, q, prompt, skip) in enumerate(step.rows):
            total = computed + q
            dropped = set(skip)
            cols.append([j for j in range(-(-total // B)) if j not in dropped])
            lo, hi = self.compressor.score_positions(prompt)
            a, b = max(lo, computed), min(hi, total)
            if a < b:
                first, end = qsl[i] + a - computed, qsl[i] + b - computed
                observe[first:end] = True
                spans.append((first, end, b - B * len(dropped)))
            else:
                spans.append((0, 0, 0))
        per_head = bool(getattr(self.compressor, "per_head", False))
        per_layer = bool(getattr(self.compressor, "per_layer", False))
        # on the attention's device (vLLM's batch tensors are there): built on the host from
        # the rows, moved once per step; the mass is summed there over the layers and read
        # back once, in finalize
        device = batch.block_table.device
        observed = bool(observe.any())  # the host tensor, before it moves
        observe = observe.to(device, non_blocking=True)
        mass = (
            None
            if per_head or per_layer
            else torch.zeros(len(step.rows), batch.block_table.shape[1], dtype=torch.float32, device=device)
        )
        plan = _StepPlan(step.rows, cols, observe, mass, B, observed=observed, per_layer=per_layer)
        # worth it where the observed queries are a small part of the step (SnapKV's window in a
        # step of prefill chunks): the kernel's pass plus theirs costs less than one PyTorch pass
        counts = [end - first for first, end, _ in spans]
        if observed and self.mass_alone and 2 * sum(counts) <= qsl[-1]:
            # the observed queries as a batch of their own (rows past the plan's observe nothing)
            pad = [0] * (batch.block_table.shape[0] - len(step.rows))
            rows_obs = [t for first, end, _ in spans for t in range(first, end)]
            sub_qsl = [0, *itertools.accumulate(counts + pad)]
            sub_lens = [cut for *_, cut in spans] + pad
            longest = max(counts)
            plan.observed_batch = (
                torch.tensor(rows_obs, dtype=torch.long).to(device, non_blocking=True),
                torch.tensor(sub_qsl, dtype=batch.query_start_loc.dtype).to(device, non_blocking=True),
                torch.tensor(sub_lens, dtype=batch.seq_lens.dtype).to(device, non_blocking=True),
                longest,
            )
        if per_head and not self.heads_read:  # once: the model's KV heads, for the ranks' gather
            config = getattr(getattr(step, "runner", None), "model_config", None)
            self.total_heads = config.get_total_num_kv_heads() if config is not None else None
            self.heads_read = True
        if per_head or per_layer:
            own, end = self.local_heads  # the mask is of this rank's KV heads (all but under per-head TP)
            plan.head_dropped = [
                (d[own:end] if d else d)
                for d in (getattr(self.reqs.get(r[0]), "head_dropped", None) for r in step.rows)
            ]
        self.pending = plan
        return plan

    def finalize(self) -> dict[str, list[int]]:
        """After the step's forward: add its attention mass to the scores, ask ``keep`` and
        return the blocks newly dropped, per request."""
        plan, self.pending = self.pending, None
        if plan is not None and plan.per_layer and plan.layer_mass:
            import torch

            plan.mass = torch.stack([plan.layer_mass[k] for k in sorted(plan.layer_mass)], dim=1)  # [rows, L, width]
        if plan is None or plan.mass is None:
            return {}
        B = plan.block_size
        extra = self._pass_scores(plan) if self.passes is not None else {}
        per_head = plan.head_dropped is not None
        if per_head and not plan.per_layer and self.gather is not None:
            every, first = self.gather(plan.mass, self.total_heads)
            self.local_heads = (first, first + plan.mass.shape[1])
            mass = every.tolist()
        else:
            mass = (plan.mass if self.reduce is None else self.reduce(plan.mass)).tolist()
        drops: dict[str, list[int]] = {}
        head_drops = 0
        for i, (req_id, computed, q, prompt, _) in enumerate(plan.rows):
            if q <= 0:
                continue
            st = self.reqs.setdefault(req_id, _ReqScores([], set()))
            total = computed + q
            nb = -(-total // B)
            if per_head:
                view, kept_heads = self._ask_heads(st, mass[i], plan.cols[i], total, B, prompt, req_id, plan.per_layer)
                kept = union_of_heads(kept_heads)
                for h, blocks in enumerate(kept_heads):
                    new_h = set(dropped_blocks(view, blocks)) - st.head_dropped[h]
                    head_drops += len(new_h)
                    st.head_dropped[h] |= new_h
            else:
                st.scores.extend([0.0] * (nb - len(st.scores)))
                step = [0.0] * nb  # this step's own mass per logical block
                for j, logical in enumerate(plan.cols[i]):
                    st.scores[logical] += mass[i][j]
                    step[logical] += mass[i][j]
                for logical, x in enumerate(extra.get(req_id, ())[:nb]):  # the scoring passes' scores
                    st.scores[logical] += x
                    step[logical] += x
                view = st.view(step, total, B, prompt, req_id)
                kept = check_keep(view, ask(self.compressor, view, self.name), self.name)
            back = sorted(st.dropped & set(kept))
            if back:
                raise KeepError(
                    f"kvcompress plugin {self.name!r}: keep() returned {kept} for {total} tokens, but "
                    f"block(s) {back} were dropped at an earlier step and their KV is gone; a dropped "
                    "block must stay dropped (dropped blocks have score -inf)"
                )
            new = dropped_blocks(view, kept)
            new = [k for k in new if k not in st.dropped]
            if new:
                st.dropped.update(new)
                drops[req_id] = new
                trace("worker_dropped", len(new), req=req_id, blocks=new)
        self.count("worker_steps", sum(1 for r in plan.rows if r[2] > 0))
        if head_drops:
            self.count("layer_blocks_dropped" if plan.per_layer else "head_blocks_dropped", head_drops)
        return drops

    def _pass_scores(self, plan: _StepPlan) -> dict[str, list[float]]:
        """The scoring passes of the rows whose prompt is complete at this step: per request,
        one score per prompt block (summed over the ranks). Run after the step's forward."""
        out: dict[str, list[float]] = {}
        for req_id, computed, q, prompt, _ in plan.rows:
            if q <= 0 or not computed < prompt <= computed + q:
                continue
            st = self.reqs.get(req_id)
            if st is not None and st.dropped:
                raise KeepError(
                    f"kvcompress plugin {self.name!r}: request {req_id!r} dropped blocks "
                    f"{sorted(st.dropped)} before its prompt was complete; a scoring pass reads the "
                    "whole context, so its compressor must not drop blocks mid-prefill (when: prefill)"
                )
            assert self.passes is not None
            scores, pair, seconds = self.passes(self.runner, req_id, prompt)
            if scores is None:
                continue
            if self.reduce is not None:
                scores = self.reduce(scores)
            out[req_id] = [float(x) for x in scores.tolist()]
            self.count("scoring_passes", 1)
            self.count("scoring_pass_us", int(seconds * 1e6))
            self.recent_pairs[req_id] = pair.detach().to("cpu")
            while len(self.recent_pairs) > 16:
                self.recent_pairs.pop(next(iter(self.recent_pairs)))
            trace("scoring_pass", 1, req=req_id, tokens=prompt, seconds=round(seconds, 4))
        return out

    def _ask_heads(
        self,
        st: _ReqScores,
        mass: list[list[float]],
        cols: list[int],
        total: int,
        B: int,
        prompt: int,
        req_id: str | None = None,
        per_layer: bool = False,
    ) -> tuple[BlockView, list[list[int]]]:
        """per_head: add a row's mass ``[H_kv][column]`` to its per-head scores, ask
        ``keep_heads`` and check the answer (each head's rules, and a block a head dropped
        stays dropped for it). per_layer: the same with ``[layer][column]`` and ``keep_layers``."""
        hkv, nb = len(mass), -(-total // B)
        if not st.head_scores:  # the row's first step
            st.head_scores = [[] for _ in range(hkv)]
            st.head_dropped = [set() for _ in range(hkv)]
        step = [0.0] * nb  # this step's own mass per logical block, summed over the KV heads
        for h in range(hkv):
            hs = st.head_scores[h]
            hs.extend([0.0] * (nb - len(hs)))
            for j, logical in enumerate(cols):
                hs[logical] += mass[h][j]
                step[logical] += mass[h][j]
        st.scores = [sum(st.head_scores[h][k] for h in range(hkv)) for k in range(nb)]
        head_view = tuple(
            tuple(NEG_INF if k in st.head_dropped[h] else st.head_scores[h][k] for k in range(nb)) for h in range(hkv)
        )
        view = st.view(
            step,
            total,
            B,
            prompt,
            req_id,
            head_scores=None if per_layer else head_view,
            layer_scores=head_view if per_layer else None,
        )
        method, unit, check = (
            ("keep_layers", "layer", check_keep_layers) if per_layer else ("keep_heads", "KV head", check_keep_heads)
        )
        kept_heads = check(view, ask(self.compressor, view, self.name, method), self.name)
        for h, blocks in enumerate(kept_heads):
            back = sorted(st.head_dropped[h] & set(blocks))
            if back:
                raise KeepError(
                    f"kvcompress plugin {self.name!r}: {method}() kept block(s) {back} for {unit} {h} "
                    f"({total} tokens), which that {unit} dropped at an earlier step; a block a {unit} dropped "
                    f"stays dropped for it (its {'layer' if per_layer else 'head'}_scores are -inf)"
                )
        return view, kept_heads


class _ScoringAttention:
    """What the backend's attention seam runs while a ``needs_scores`` compressor is active:
    the compressor's :meth:`~vllm_graft.hooks.KVCompressor.attend`, its mass added to the step.

    ``kv_layouts``: the cache layouts that attention reads (:func:`.shared_attention.layouts_read`);
    where it includes ``cpu_vec`` and the layer's ISA is checked, vLLM's CPU backend keeps its own
    cache write and runs its C++ kernel on the steps that are :meth:`plain`."""

    def __init__(self, scores: _Scores) -> None:
        self.scores = scores
        self.kv_layouts = layouts_read(scores.compressor)

    def plan(self, batch: Any) -> Any:
        return self.scores.plan(batch)

    def plain(self, plan: Any) -> bool:
        """This step is plain attention over the kept blocks: no query counts towards the
        scores and the compressor masks nothing per head, so the mass would be zero and the
        output vLLM's. A backend with a kernel of its own then runs its kernel instead of
        :meth:`forward` (e.g. SnapKV's decode steps, which score nothing): vLLM's CUDA backends
        always, vLLM's CPU backend where the cache is in vLLM's own layout (``cpu_vec`` in
        :attr:`kv_layouts`, the layer's ISA checked); :meth:`_Scores.finalize` still runs on the
        zero mass."""
        if getattr(self.scores.compressor, "per_head", False) or getattr(self.scores.compressor, "per_layer", False):
            return False
        return plan is None or not plan.observed

    def mass_only(self, plan: Any) -> bool:
        """This step's output may come from the route's own kernel, with only the mass computed
        here (:meth:`add_mass`, the observed queries alone: e.g. SnapKV's window at the end of a
        prompt, where the step's other rows are prefill chunks and decodes). A backend with a
        kernel that reads the cache then runs it and :meth:`amend` instead of :meth:`forward`."""
        if plan is None or plan.observed_batch is None:
            return False
        state = _state.get_active()
        return state is None or state.kv_format is None

    #: the backend's count for a step amended here (see :meth:`amend`)
    amend_event = "stock_layers_with_mass"

    def amends(self, plan: Any) -> bool:
        """The backend's "vLLM's kernel first, then the method amends" seam (:mod:`..backend`):
        taken on the steps that are :meth:`mass_only`."""
        return self.mass_only(plan)

    def amend(self, query, kv_cache, batch, layer, plan, output) -> None:
        """After vLLM's kernel wrote the step's ``output``: :meth:`add_mass` (the output is
        vLLM's, left as it is)."""
        self.add_mass(query, kv_cache, batch, layer, plan)

    def add_mass(self, query, kv_cache, batch, layer, plan) -> None:
        """Add the observed queries' block mass (of ``query [T, H, D]``, the step's) to the step's
        scores: the shared attention with mass over those queries alone, each sequence cut at its
        last observed position (causality unchanged); its output is discarded."""
        import torch

        from ....hooks import PagedBatch

        rows, qsl, lens, longest = plan.observed_batch
        made = plan._observed_paged  # one batch object per step: the attention's step index is cached by it
        if made is None or made.block_table is not batch.block_table:
            made = PagedBatch(query_start_loc=qsl, seq_lens=lens, block_table=batch.block_table, max_query_len=longest)
            plan._observed_paged = made
        q = query.index_select(0, rows)
        observe = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
        _, mass = attend_with_mass(self.scores.compressor, q, kv_cache, made, layer, observe)
        r, width = plan.mass.shape
        plan.mass += mass[:r, :width].to(plan.mass.dtype)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        import torch

        n = query.shape[0]
        observe = plan.observe[:n] if plan is not None else torch.zeros(n, dtype=torch.bool, device=query.device)
        if observe.shape[0] < n:
            observe = torch.cat([observe, observe.new_zeros(n - observe.shape[0])])
        state = _state.get_active()
        compressor = self.scores.compressor
        if getattr(compressor, "per_layer", False):
            # each decoder layer reads the blocks it kept; its mass is summed over its KV heads
            S, width, hkv = batch.block_table.shape[0], batch.block_table.shape[1], layer.num_kv_heads
            index = int(layer.index)
            if index < 0:
                raise NotImplementedError(
                    f"kvcompress plugin {self.scores.name!r} chooses blocks per layer, but the attention "
                    "route gave no decoder layer index (AttentionLayer.index); use a route that sets it"
                )
            mask = (
                plan.layer_mask(index, S, hkv, width, query.device)
                if plan is not None
                else torch.ones(S, hkv, width, dtype=torch.bool, device=query.device)
            )
            out, mass = attend_with_mass(compressor, query, kv_cache, batch, layer, observe, head_mask=mask)
            if plan is not None:
                rows = len(plan.rows)
                got = mass[:rows, :, :width].to(torch.float32).sum(1)
                plan.layer_mass[index] = got if index not in plan.layer_mass else plan.layer_mass[index] + got
            return out
        if getattr(compressor, "per_head", False):
            # each KV head reads the blocks it kept; the mass comes back per KV head
            S, width, hkv = batch.block_table.shape[0], batch.block_table.shape[1], layer.num_kv_heads
            mask = (
                plan.head_mask(S, hkv, width, query.device)
                if plan is not None
                else torch.ones(S, hkv, width, dtype=torch.bool, device=query.device)
            )
            out, mass = attend_with_mass(compressor, query, kv_cache, batch, layer, observe, head_mask=mask)
            if plan is not None:
                if plan.mass is None:  # made at the first layer, where the mass is
                    plan.mass = torch.zeros(len(plan.rows), hkv, width, dtype=torch.float32, device=mass.device)
                rows = plan.mass.shape[0]
                plan.mass += mass[:rows, :, :width].to(plan.mass.dtype)
            return out
        if state is not None and state.kv_format is not None and kv_cache.dtype == _uint8():
            # the cache is in the storage format: its attention reads it (and scores it)
            out, mass = state.kv_format.forward(query, kv_cache, batch, layer, observe)
        else:
            out, mass = attend_with_mass(compressor, query, kv_cache, batch, layer, observe)
            if self.scores.from_cache:  # the compressor scores blocks from the keys, not the mass
                mass = block_scores(compressor, kv_cache, batch, layer, query, observe, mass)
        if plan is not None:
            rows, width = plan.mass.shape
            plan.mass += mass[:rows, :width].to(plan.mass.dtype)
        return out


def _uint8():
    import torch

    return torch.uint8
