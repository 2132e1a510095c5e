"""`squeezed` sparse decode attention in PyTorch (the oracle and the CPU path).

Per decode token (a sequence with one new token) and KV head: the context is cut into chunks of
``chunk`` tokens; each chunk is scored by its key centroid (the mean of its keys) against the
token's queries (the best of the query heads sharing the KV head); the forced chunks (sinks,
recent window) and the best other chunks up to the budget are attended exactly. Mode recycled
scores the chunks instead by the attention probability they get in a full attention step (that
token's output is then the full attention), every ``refresh`` positions; the tokens in between
attend to those chunks plus the moving window. Sequences with
several new tokens (prefill, chunked prefill) get full causal attention (the attention kind's
shared exact attention). With ``kernel: triton``, :func:`squeezed_attention_triton` runs the
decode rows' chunk scoring and sparse attention in the kernels of :mod:`.kernel` (imported
there, when chosen) and everything else here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ....hooks import BLOCKED, AttentionLayer, AttentionMethod, KVCacheLayout, PagedBatch

from .._shared import fused_causal_attention, gather_kv
from .policy import Budget, budget, load_head_map, window_chunks


def chunk_scores(q: torch.Tensor, k: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
    """``q`` [H, D], ``k`` [n, Hkv, D] -> [Hkv, C]: per KV head, the best over its query heads of
    ``scale * q . centroid`` for each chunk (the last chunk's centroid over its valid tokens)."""
    n, hkv, d = k.shape
    c = -(-n // chunk)
    kp = F.pad(k.float(), (0, 0, 0, 0, 0, c * chunk - n)).view(c, chunk, hkv, d)
    counts = (n - torch.arange(c, device=k.device) * chunk).clamp(max=chunk).float()
    cent = kp.sum(1) / counts[:, None, None]  # [C, Hkv, D]
    qg = q.float().view(hkv, -1, d)
    return (torch.einsum("hgd,chd->hgc", qg, cent) * scale).amax(1)


def chunk_mass(q: torch.Tensor, k: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
    """Mode recycled's full step: ``q`` [H, D], ``k`` [n, Hkv, D] -> [Hkv, C], the attention
    probability each chunk receives from the query heads of each KV head (summed over them)."""
    n, hkv, d = k.shape
    c = -(-n // chunk)
    prob = (torch.einsum("hgd,nhd->hgn", q.float().view(hkv, -1, d), k.float()) * scale).softmax(-1).sum(1)
    return F.pad(prob, (0, c * chunk - n)).view(hkv, c, chunk).sum(-1)


def chosen_chunks(
    scores: torch.Tensor | None, b: Budget, mode: str, hkv: int, retrieval: list[bool] | None = None
) -> torch.Tensor:
    """Bool [Hkv, C]: the chunks each KV head attends to."""
    dev = scores.device if scores is not None else None
    sel = torch.zeros(hkv, b.num_chunks, dtype=torch.bool, device=dev)
    if mode == "streaming-heads":
        assert retrieval is not None
        sel[:, list(b.sink) + list(b.recent)] = True
        sel[torch.tensor(retrieval, dtype=torch.bool, device=dev)] = True
        return sel
    if b.full:
        sel[:] = True
        return sel
    if mode == "window":
        sel[:, window_chunks(b)] = True
        return sel
    forced = list(b.sink) + list(b.recent)
    if b.extra:
        assert scores is not None  # the scoring modes always pass scores
        s = scores.clone()
        s[:, forced] = float("-inf")
        sel.scatter_(1, torch.topk(s, b.extra, dim=1).indices, True)
    sel[:, forced] = True
    return window_heads(sel, b, retrieval)


def window_heads(sel: torch.Tensor, b: Budget, retrieval: list[bool] | None) -> torch.Tensor:
    """Modes centroid and recycled with a head map: the heads it does not mark as retrieval heads
    attend to the sink + window baseline's chunks at the same budget (``sel`` [Hkv, C])."""
    if retrieval is None or all(retrieval) or b.full:
        return sel
    local = ~torch.tensor(retrieval, dtype=torch.bool, device=sel.device)
    sel = sel.clone()
    sel[local] = False
    sel[local.nonzero()[:, 0][:, None], torch.tensor(window_chunks(b), device=sel.device)[None, :]] = True
    return sel


def full_step(sel: torch.Tensor, retrieval: list[bool] | None) -> torch.Tensor:
    """Mode recycled, the token that ran the full step: every chunk for the heads that choose
    chunks (all, or a head map's retrieval heads); the others keep ``sel`` (their window)."""
    out = torch.ones_like(sel)
    if retrieval is not None:
        local = ~torch.tensor(retrieval, dtype=torch.bool, device=sel.device)
        out[local] = sel[local]
    return out


def scoring_heads(hkv: int, retrieval: list[bool] | None) -> int:
    """KV heads that score chunks (read their centroids)."""
    return hkv if retrieval is None else sum(retrieval)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode token: ``q`` [H, D], ``k``/``v`` [n, Hkv, D], ``token_mask`` [Hkv, n] (True =
    attended) -> [H, D] float32."""
    hkv, d = k.shape[1], k.shape[2]
    qg = q.float().view(hkv, -1, d)
    s = torch.einsum("hgd,nhd->hgn", qg, k.float()) * scale
    s = s.masked_fill(~token_mask[:, None, :], float("-inf"))
    return torch.einsum("hgn,nhd->hgd", s.softmax(-1), v.float()).reshape(-1, d)


def sparse_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: "Squeezed", scale: float, retrieval: list[bool] | None
) -> torch.Tensor:
    """Every row of ``q`` [nq, H, D] (the last ``nq`` positions of a context ``k``/``v`` [n, Hkv,
    D]) attends as a decode token at its position would: what teacher-forced decoding computes,
    in one pass (``prefill: sparse``, for quality evaluation). Returns [nq, H, D] float32."""
    p = m.params
    nq, h, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    chunk = p.chunk
    c = -(-n // chunk)
    dev = q.device
    budgets = [m.budget(t + 1) for t in range(n - nq, n)]
    ci = torch.arange(c, device=dev)
    num = torch.tensor([b.num_chunks for b in budgets], device=dev)[:, None]
    n_sink = torch.tensor([len(b.sink) for b in budgets], device=dev)[:, None]
    r_start = torch.tensor([b.recent[0] if b.recent else b.num_chunks for b in budgets], device=dev)[:, None]
    extra = torch.tensor([b.extra for b in budgets], device=dev)[:, None]
    full = torch.tensor([b.full for b in budgets], device=dev)[:, None]
    eligible = ci < num  # [nq, C]
    forced = (ci < n_sink) | ((ci >= r_start) & eligible)
    grown = (ci >= torch.maximum(n_sink, r_start - extra)) & (ci < r_start)
    window = forced | grown | (full & eligible)  # [nq, C]: the sink + window baseline
    retr = None if retrieval is None else torch.tensor(retrieval, dtype=torch.bool, device=dev)
    if p.mode == "streaming-heads":
        sel = forced[:, None, :].expand(nq, hkv, c).clone()
        sel[:, retr] = eligible[:, None, :]
    elif p.mode == "window":
        sel = window[:, None, :].expand(nq, hkv, c)
    else:
        if p.mode == "recycled":  # the attention mass of each chunk in a full causal step
            pos = torch.arange(n - nq, n, device=dev)
            s_all = torch.einsum("qhgd,nhd->qhgn", q.float().view(nq, hkv, -1, d), k.float()) * scale
            future = torch.arange(n, device=dev)[None, :] > pos[:, None]  # [nq, n]
            prob = s_all.masked_fill(future[:, None, None, :], float("-inf")).softmax(-1).sum(2)
            sc = F.pad(prob, (0, c * chunk - n)).view(nq, hkv, c, chunk).sum(-1)
        else:
            kp = F.pad(k.float(), (0, 0, 0, 0, 0, c * chunk - n)).view(c, chunk, hkv, d)
            counts = (n - ci * chunk).clamp(max=chunk).float()
            cent = kp.sum(1) / counts[:, None, None]  # [C, Hkv, D]; partial chunks are always forced
            sc = (torch.einsum("qhgd,chd->qhgc", q.float().view(nq, hkv, -1, d), cent) * scale).amax(2)
        sc = sc.masked_fill((forced | ~eligible)[:, None, :], float("-inf"))
        rank = torch.empty_like(sc, dtype=torch.long)
        order = torch.argsort(sc, dim=2, descending=True, stable=True)
        rank.scatter_(2, order, ci.expand_as(order).contiguous())
        sel = forced[:, None, :] | ((rank < extra[:, :, None]) & eligible[:, None, :]) | (full & eligible)[:, None, :]
    scored = torch.ones(nq, dtype=torch.bool, device=dev)
    if m.refreshing():  # rows between refreshes reuse the chunks chosen at their refresh row
        pos0 = n - nq
        at = torch.arange(nq, device=dev)
        r_idx = at - (at + pos0) % p.refresh
        r_idx = torch.where(r_idx >= 0, r_idx, at)  # refresh row before this chunk: choose afresh
        scored = r_idx == at
        sel = sel[r_idx] | forced[:, None, :]
    if p.mode in ("centroid", "recycled") and retr is not None:  # window heads (head map)
        sel = torch.where(retr[None, :, None], sel, window[:, None, :])
    tokens = sel.repeat_interleave(chunk, dim=2)[:, :, :n]  # [nq, Hkv, n]
    if p.mode == "recycled":  # a row that chose afresh ran the full step: its output is full attention
        choosing = torch.ones(hkv, dtype=torch.bool, device=dev) if retr is None else retr
        tokens = tokens | (scored[:, None] & choosing[None, :])[:, :, None]
    pos = torch.arange(n - nq, n, device=dev)
    tokens = tokens & (torch.arange(n, device=dev)[None, :] <= pos[:, None])[:, None, :]
    s = torch.einsum("qhgd,nhd->qhgn", q.float().view(nq, hkv, -1, d), k.float()) * scale
    s = s.masked_fill(~tokens[:, :, None, :], float("-inf"))
    out = torch.einsum("qhgn,nhd->qhgd", s.softmax(-1), v.float()).reshape(nq, h, d)
    centroid = p.mode == "centroid"
    n_scoring = scoring_heads(hkv, retrieval)
    for t, b in enumerate(budgets):
        m.stats.add(
            n - nq + t + 1,
            hkv,
            int(tokens[t].sum()),
            b.num_chunks * n_scoring if centroid and not b.full and bool(scored[t]) else 0,
        )
    return out


def refresh_key(layer: AttentionLayer, block_row: torch.Tensor, r: int, bs: int) -> tuple[int, int, int]:
    return (layer.index, int(block_row[r // bs]), r)


def reuse_selection(
    m: "Squeezed", layer: AttentionLayer, block_row: torch.Tensor, key_at, n: int, b: Budget, bs: int
) -> torch.Tensor | None:
    """Between refreshes (``refresh`` > 1): the chunks chosen at the last refresh position, plus
    the chunks forced now (the window has moved on); None at a refresh position or when the
    selection is not known (then the caller chooses afresh)."""
    pos = n - 1
    r = pos - pos % m.params.refresh
    if r == pos:
        return None
    stored = m.recall(refresh_key(layer, block_row, r, bs), key_at(r))
    if stored is None:
        return None
    m.reused += 1
    sel = torch.zeros(stored.shape[0], b.num_chunks, dtype=torch.bool, device=stored.device)
    sel[:, : stored.shape[1]] = stored
    sel[:, list(b.sink) + list(b.recent)] = True
    return window_heads(sel, b, m.retrieval(layer))  # window heads follow the moving window


class Stats:
    """KV traffic of decode tokens, in token-heads (one key + one value of one KV head)."""

    def __init__(self) -> None:
        self.decode_tokens = 0
        self.plain = 0  # what full attention reads
        self.read = 0.0  # attended tokens + chunk centroids (a centroid: half a token-head)

    def add(self, n: int, hkv: int, attended: int, num_centroids: int) -> None:
        self.decode_tokens += 1
        self.plain += n * hkv
        self.read += attended + 0.5 * num_centroids


class Squeezed(AttentionMethod):
    kv_layouts = ("blocked", "packed")  # every path reads through layer.kv_layout.split
    #: chunk selections kept for reuse between refreshes (oldest dropped first)
    MAX_SELECTIONS = 8192

    def __init__(self, params) -> None:
        super().__init__(params)
        self.head_map = load_head_map(params.head_map) if params.head_map else None
        self.stats = Stats()
        self.selections: OrderedDict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.reused = 0
        self._centroids: dict[int, CentroidCache] = {}  # the batched path's, by layer

    def refreshing(self) -> bool:
        return self.params.mode in ("centroid", "recycled") and self.params.refresh > 1

    def remember(self, key: tuple[int, int, int], fingerprint: torch.Tensor, sel: torch.Tensor) -> None:
        self.selections[key] = (fingerprint, sel)
        self.selections.move_to_end(key)
        while len(self.selections) > self.MAX_SELECTIONS:
            self.selections.popitem(last=False)

    def recall(self, key: tuple[int, int, int], fingerprint: torch.Tensor) -> torch.Tensor | None:
        """The selection made at a refresh position, if this sequence made it: the key is (layer,
        physical block holding the refresh position, position), and the stored key vector at that
        position must match (a freed block reused by another sequence does not)."""
        hit = self.selections.get(key)
        if hit is None or not torch.equal(hit[0], fingerprint):
            return None
        return hit[1]

    def retrieval(self, layer: AttentionLayer) -> list[bool] | None:
        if self.head_map is None:
            return None
        idx = getattr(layer, "index", -1)
        total = len(self.head_map[idx]) if 0 <= idx < len(self.head_map) else -1
        if total < 0 or layer.num_kv_heads != max(1, total // layer.tp_size):  # a rank holds its share
            raise ValueError(
                f"squeezed: head map {self.params.head_map!r} has {len(self.head_map)} layers of "
                f"{len(self.head_map[0])} KV heads; this model's layer {idx} has "
                f"{layer.num_kv_heads * layer.tp_size} KV heads. Calibrate it for this model (vllm-graft calibrate razor)"
            )
        first = layer.first_kv_head(total)  # under tensor parallelism, this rank's heads of the map
        return self.head_map[idx][first : first + layer.num_kv_heads]

    def budget(self, n: int) -> Budget:
        p = self.params
        return budget(n, p.chunk, p.budget, p.sink_tokens, p.recent_tokens)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        p = self.params
        if kv_cache.shape[2] % p.chunk:
            raise ValueError(
                f"squeezed: chunk {p.chunk} must divide the KV block size "
                f"{kv_cache.shape[2]}; set params.chunk to a divisor of it"
            )
        if p.kernel == "triton":
            return squeezed_attention_triton(self, query, kv_cache, batch, layer)
        if (
            p.cpu_path == "batched"
            and p.mode == "centroid"
            and self.head_map is None
            and p.refresh == 1
            and p.prefill == "full"
        ):
            return squeezed_attention_batched(self, query, kv_cache, batch, layer)
        return squeezed_attention(self, query, kv_cache, batch, layer)

    def centroids(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> "CentroidCache":
        """This layer's chunk centroids kept between steps (made again for a new cache)."""
        cache = self._centroids.get(layer.index)
        N, hkv, B, D2 = kv_cache.shape
        if cache is None or cache.shape != (N, hkv, B // self.params.chunk, D2 // 2):
            cache = self._centroids[layer.index] = CentroidCache(N, hkv, B, D2 // 2, self.params.chunk, kv_cache.device)
        return cache

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "decode_token_layers": s.decode_tokens,
            "selections_reused": self.reused,
            "kv_token_heads_plain": s.plain,
            "kv_token_heads_read": round(s.read, 1),
            "kv_read_fraction": round(s.read / s.plain, 4) if s.plain else None,
        }


def choose(
    m: Squeezed, q: torch.Tensor, k: torch.Tensor, b: Budget, layer: AttentionLayer, retrieval: list[bool] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode token's chunk choice [Hkv, C] made afresh, and the scores it was made from
    (None when no scoring was needed): key centroids, or mode recycled's full-step mass."""
    p = m.params
    scores = None
    if not b.full and p.mode == "centroid":
        scores = chunk_scores(q, k, p.chunk, layer.scale)
    elif not b.full and p.mode == "recycled":
        scores = chunk_mass(q, k, p.chunk, layer.scale)
    return chosen_chunks(scores, b, p.mode, layer.num_kv_heads, retrieval), scores


def attended(
    mode: str, sel: torch.Tensor, scores: torch.Tensor | None, n: int, chunk: int, retrieval: list[bool] | None = None
) -> torch.Tensor:
    """Token mask [Hkv, n] a decode token attends to: its chunks, or everything when mode
    recycled ran its full step for this token (the step that chose afresh; with a head map,
    only for the retrieval heads)."""
    if mode == "recycled" and scores is not None:
        sel = full_step(sel, retrieval)
    return sel.repeat_interleave(chunk, dim=1)[:, :n]


def squeezed_attention(
    m: Squeezed, query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer
) -> torch.Tensor:
    p = m.params
    out = torch.empty_like(query)
    bs = kv_cache.shape[2]
    hkv = layer.num_kv_heads
    retrieval = m.retrieval(layer)
    qsl = batch.query_start_loc.tolist()
    for i, n in enumerate(batch.seq_lens.tolist()):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 == q0:
            continue
        k, v = gather_kv(kv_cache, batch.block_table[i, : -(-n // bs)], n, layer.head_size, layer.kv_layout)
        if q1 - q0 > 1:
            if p.prefill == "sparse":
                out[q0:q1] = sparse_rows(query[q0:q1], k, v, m, layer.scale, retrieval).to(query.dtype)
            else:
                out[q0:q1] = fused_causal_attention(query[q0:q1], k, v, layer.scale).to(query.dtype)
            continue
        b = m.budget(n)
        key_at = lambda pos, k=k: k[pos, 0].float()  # noqa: E731
        sel = reuse_selection(m, layer, batch.block_table[i], key_at, n, b, bs) if m.refreshing() else None
        scores = None
        if sel is None:
            sel, scores = choose(m, query[q0], k, b, layer, retrieval)
            if m.refreshing() and (n - 1) % p.refresh == 0:
                m.remember(refresh_key(layer, batch.block_table[i], n - 1, bs), key_at(n - 1).clone(), sel)
        mask = attended(p.mode, sel, scores, n, p.chunk, retrieval)
        out[q0] = masked_attention(query[q0], k, v, mask, layer.scale).to(query.dtype)
        m.stats.add(
            n,
            hkv,
            int(mask.sum()),
            b.num_chunks * scoring_heads(hkv, retrieval) if scores is not None and p.mode == "centroid" else 0,
        )
    return out


def squeezed_attention_triton(
    m: Squeezed, query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer
) -> torch.Tensor:
    """``kernel: triton``: the decode rows' chunk scores and sparse attention run in the Triton
    kernels (:mod:`.kernel`); the choice of chunks between the two, and the prefill rows, run
    in PyTorch, the same code as :func:`squeezed_attention`."""
    from .kernel import chunk_scores_triton, sparse_decode_triton

    p = m.params
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    bs = kv_cache.shape[2]
    hkv = layer.num_kv_heads
    retrieval = m.retrieval(layer)
    qsl = batch.query_start_loc.tolist()
    rows, seqs, lens = [], [], []
    for i, n in enumerate(batch.seq_lens.tolist()):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 - q0 == 1:
            rows.append(q0)
            seqs.append(i)
            lens.append(n)
        elif q1 > q0:  # prefill / chunked prefill: the PyTorch path
            k, v = gather_kv(kv_cache, batch.block_table[i, : -(-n // bs)], n, layer.head_size, layer.kv_layout)
            if p.prefill == "sparse":
                out[q0:q1] = sparse_rows(query[q0:q1], k, v, m, layer.scale, retrieval).to(query.dtype)
            else:
                out[q0:q1] = fused_causal_attention(query[q0:q1], k, v, layer.scale).to(query.dtype)
    if not rows:
        return out
    budgets = [m.budget(n) for n in lens]
    need_scores = p.mode == "centroid" and any(not b.full for b in budgets)
    scores = chunk_scores_triton(query, kv_cache, batch, layer, p.chunk, rows, seqs, lens) if need_scores else None
    if p.mode == "centroid" and retrieval is None and not m.refreshing():  # every row at once, on the device
        n = torch.tensor(lens, device=query.device)
        sel = batched_choice(budgets, n, hkv, p.chunk, lambda complete: scores)
        width = max(b.chosen for b in budgets)
        sparse_decode_triton(query, kv_cache, batch, layer, p.chunk, rows, seqs, lens, sel, out, width)
        add_stats(m, budgets, lens, hkv)
        return out
    masks = []
    k_cache, _ = layer.kv_layout.split(kv_cache)
    for r, (b, n) in enumerate(zip(budgets, lens)):
        row = batch.block_table[seqs[r]]
        key_at = lambda pos, row=row: k_cache[int(row[pos // bs]), 0, pos % bs].float()  # noqa: E731
        mk = reuse_selection(m, layer, row, key_at, n, b, bs) if m.refreshing() else None
        s = None
        if mk is None:
            if p.mode == "recycled" and not b.full:  # the full step's mass: PyTorch (reference)
                k, _ = gather_kv(kv_cache, row[: -(-n // bs)], n, layer.head_size, layer.kv_layout)
                mk, s = choose(m, query[rows[r]], k, b, layer, retrieval)
            else:
                s = scores[r, :, : b.num_chunks] if scores is not None and not b.full else None
                mk = chosen_chunks(s, b, p.mode, hkv, retrieval)
            if m.refreshing() and (n - 1) % p.refresh == 0:
                m.remember(refresh_key(layer, row, n - 1, bs), key_at(n - 1).clone(), mk)
        if p.mode == "recycled" and s is not None:  # the full step itself attends to everything
            mk = full_step(mk, retrieval)
        masks.append(mk)
        m.stats.add(
            n,
            hkv,
            int(mk.repeat_interleave(p.chunk, dim=1)[:, :n].sum()),
            b.num_chunks * scoring_heads(hkv, retrieval) if s is not None and p.mode == "centroid" else 0,
        )
    sparse_decode_triton(query, kv_cache, batch, layer, p.chunk, rows, seqs, lens, masks, out)
    return out


# ------------------------------------------------------------------ the batched CPU path
class CentroidCache:
    """One layer's chunk centroids ``[N, H_kv, B/chunk, D]`` (fp32), kept between steps: a chunk's
    centroid is computed once, when its ``chunk`` tokens are in the cache, with the key vector of
    its first token (KV head 0) as a fingerprint; a chunk whose fingerprint no longer matches the
    cache (its block freed and written again by another request) is computed again. Extra
    memory: one key vector per chunk, 1/chunk of the key cache."""

    def __init__(self, N: int, hkv: int, B: int, D: int, chunk: int, device) -> None:
        self.chunk, self.per_block = chunk, B // chunk
        self.cent = torch.zeros(N, hkv, self.per_block, D, dtype=torch.float32, device=device)
        self.mark = torch.full((N, self.per_block, D), float("nan"), dtype=torch.float32, device=device)
        self.computed = 0  # chunks computed (or computed again)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.cent.shape)

    def lookup(
        self,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        subs: torch.Tensor,
        complete: torch.Tensor,
        layout: KVCacheLayout = BLOCKED,
    ) -> torch.Tensor:
        """Centroids ``[..., H_kv, D]`` of the chunks ``(blocks, subs)`` (any shape); those marked
        ``complete`` are brought up to date first (the others are returned as they are: the
        caller does not score them). The keys are read in ``layout``."""
        keys_of = layout.split(kv_cache)[0].unflatten(2, (self.per_block, self.chunk))  # [N, H_kv, B/c, c, D]
        c = self.chunk
        b, j = blocks[complete], subs[complete]
        if b.numel():
            first = keys_of[b, 0, j, 0].float()  # [U, D]: the chunk's first key, KV head 0
            stale = (first != self.mark[b, j]).any(-1)  # NaN marks never match
            if bool(stale.any()):
                flat = torch.unique(b[stale] * self.per_block + j[stale])
                ub, uj = flat // self.per_block, flat % self.per_block
                keys = keys_of[ub, :, uj].float()  # [U, H_kv, c, D]
                self.cent[ub, :, uj] = keys.sum(2) / c
                self.mark[ub, uj] = keys[:, 0, 0]
                self.computed += flat.numel()
        return self.cent[blocks, :, subs]


def squeezed_attention_batched(
    m: Squeezed, query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer
) -> torch.Tensor:
    """Mode centroid, no head map, refresh 1 (``cpu_path: batched``): prefill rows by fused
    causal attention per sequence; every decode row of the step at once: chunk scores from the
    kept centroids (:class:`CentroidCache`), the forced chunks plus the best ``extra`` ones
    (ranked as a stable sort ranks them), one gather of the chosen chunks' keys and values
    straight from the cache and one fused attention over them."""
    p = m.params
    out = torch.empty_like(query)
    N, hkv, B, D2 = kv_cache.shape
    D, c, H = D2 // 2, p.chunk, query.shape[1]
    dev = query.device
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    decode = []
    for i, n in enumerate(lens):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 <= q0 or n <= 0:
            continue
        if q1 - q0 > 1:
            k, v = gather_kv(kv_cache, batch.block_table[i, : -(-n // B)], n, layer.head_size, layer.kv_layout)
            out[q0:q1] = fused_causal_attention(query[q0:q1], k, v, layer.scale).to(query.dtype)
        else:
            decode.append(i)
    if not decode:
        return out
    S = len(decode)
    budgets = [m.budget(lens[i]) for i in decode]
    rows = torch.tensor([qsl[i] for i in decode], device=dev)
    n = torch.tensor([lens[i] for i in decode], device=dev)
    C = max(b.num_chunks for b in budgets)
    ci = torch.arange(C, device=dev)
    table = batch.block_table[torch.tensor(decode, device=dev)].long()
    blocks = table.gather(1, (ci // (B // c)).clamp(max=table.shape[1] - 1).expand(S, C))
    subs = (ci % (B // c)).expand(S, C)
    q = query[rows].float().view(S, hkv, H // hkv, D)

    def score(complete: torch.Tensor) -> torch.Tensor:
        cent = m.centroids(layer, kv_cache).lookup(kv_cache, blocks, subs, complete, layer.kv_layout)  # [S, C, Hkv, D]
        return (torch.einsum("shgd,schd->shgc", q, cent) * layer.scale).amax(2)  # [S, Hkv, C]

    sel = batched_choice(budgets, n, hkv, c, score)
    # the chosen chunks of each (row, KV head), in position order, padded to the most chosen
    K = int(sel.sum(-1).max())
    chosen = torch.where(sel, ci, C).sort(dim=-1).values[..., :K]  # [S, Hkv, K]; C = padding
    valid_chunk = chosen < C
    chosen = chosen.clamp(max=C - 1)
    heads = torch.arange(hkv, device=dev)[None, :, None]
    at = (blocks.gather(1, chosen.view(S, -1)).view(S, hkv, K), heads)
    if layer.kv_layout.name == BLOCKED.name:  # one gather of each chunk's keys and values
        picked = kv_cache.view(N, hkv, 2, B // c, c, D)[at[0], at[1], :, chosen % (B // c)]  # [S, Hkv, K, 2, c, D]
        k = picked[:, :, :, 0].reshape(S, hkv, K * c, D).float()
        v = picked[:, :, :, 1].reshape(S, hkv, K * c, D).float()
    else:  # one gather per split view
        k, v = (
            part.unflatten(2, (B // c, c))[at[0], at[1], chosen % (B // c)].reshape(S, hkv, K * c, D).float()
            for part in layer.kv_layout.split(kv_cache)
        )
    pos = (chosen[..., None] * c + torch.arange(c, device=dev)).reshape(S, hkv, K * c)
    allowed = (valid_chunk[..., None].expand(S, hkv, K, c).reshape(S, hkv, K * c)) & (pos < n[:, None, None])
    mask = allowed.repeat_interleave(H // hkv, dim=1)[:, :, None, :]  # [S, H, 1, K*c]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(S, H, 1, D), k, v, attn_mask=mask, scale=layer.scale, enable_gqa=hkv != H
    )
    out[rows] = o.reshape(S, H, D).to(query.dtype)
    add_stats(m, budgets, [lens[i] for i in decode], hkv)
    return out


def batched_choice(
    budgets: list[Budget], n: torch.Tensor, hkv: int, chunk: int, score: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Bool ``[S, H_kv, C]``: the chunks each decode row (``n`` [S] context tokens, ``budgets``)
    attends to per KV head, every row at once: the forced chunks (sinks, recent window), all of a
    full budget, and the best ``extra`` of the complete unforced chunks by ``score(complete)``
    (``[S, H_kv, C]`` for the ``complete`` [S, C] chunks; ties ranked as a stable sort ranks
    them). No host read of a device value."""
    dev = n.device
    C = max(b.num_chunks for b in budgets)
    ci = torch.arange(C, device=dev)
    col = lambda vals: torch.tensor(vals, device=dev)[:, None]  # noqa: E731
    num = col([b.num_chunks for b in budgets])
    n_sink, extra = col([len(b.sink) for b in budgets]), col([b.extra for b in budgets])
    r_start = col([b.recent[0] if b.recent else b.num_chunks for b in budgets])
    full = col([b.full for b in budgets])
    eligible = ci < num  # [S, C]
    forced = (ci < n_sink) | ((ci >= r_start) & eligible)
    sel = forced | (full & eligible)
    if not any(b.extra and not b.full for b in budgets):
        return sel[:, None, :].expand(len(budgets), hkv, C)
    complete = eligible & ((ci + 1) * chunk <= n[:, None]) & ~forced  # the chunks that get scores
    sc = score(complete).masked_fill(~complete[:, None, :], float("-inf"))
    order = torch.argsort(sc, dim=2, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(2, order, ci.expand_as(order).contiguous())
    return sel[:, None, :] | ((rank < extra[:, :, None]) & complete[:, None, :])


def add_stats(m: Squeezed, budgets: list[Budget], lens: list[int], hkv: int) -> None:
    """Count the decode rows of a step as the per-sequence path counts them (each row that
    chooses scores every chunk's centroid), from the budgets alone: a row attends to its
    chosen chunks, all whole but the last (always in the window)."""
    for b, n in zip(budgets, lens):
        m.stats.add(n, hkv, b.attended(n, m.params.chunk) * hkv, 0 if b.full else b.num_chunks * hkv)
