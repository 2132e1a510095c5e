"""What a third-party KV compressor gets from the public API (issue 38): a TOVA-like scorer
(keep the blocks the *current* step's queries attend to most) written with public names only
(``vllm_graft.hooks``: ``BlockView.step_scores``, ``BlockView.request_id``, ``check_keep``...;
``vllm_graft.plugins.paged``: the attention with mass), driven through the worker's scores
channel (``_Scores``) as vLLM's engine drives it."""
from __future__ import annotations

import types

import pytest
import torch
from pydantic import Field

from vllm_graft.hooks import (
    BlockView,
    KeepError,
    KVCompressor,
    Params,
    check_keep,
    check_keep_heads,
    dropped_blocks,
    split_kv_cache,
    union_of_heads,
)
from vllm_graft.plugins.paged import attention_with_mass, paged_attention_with_mass

NEG_INF = float("-inf")


# ------------------------------------------------------------------- the third-party plugin
class TovaParams(Params):
    budget_blocks: int = Field(3, ge=2, description="KV blocks a request keeps (the last one included)")


class Tova(KVCompressor):
    """Keeps the last block and the ``budget_blocks - 1`` blocks this step's queries attend to
    most (``view.step_scores``; the accumulated ``view.scores`` where a caller has no step)."""

    needs_scores = True

    def __init__(self, params: TovaParams) -> None:
        super().__init__(params)
        self.seen: list[BlockView] = []  # for the test: every view it was shown

    def attend(self, query, kv_cache, batch, layer, observe):
        return paged_attention_with_mass(query, kv_cache, batch, layer, observe)

    def keep(self, view: BlockView) -> list[int]:
        self.seen.append(view)
        n = view.num_blocks
        scores = view.step_scores if view.step_scores is not None else view.scores
        if scores is None:
            return list(range(n))
        live = [i for i in range(n - 1) if scores[i] != NEG_INF]
        top = sorted(live, key=lambda i: -scores[i])[: self.params.budget_blocks - 1]
        return sorted({*top, n - 1, *view.pinned})


# ----------------------------------------------------------------------- the public names
def test_the_rules_are_public_next_to_the_contract_and_the_adapter_reexports_them():
    import vllm_graft.hooks as hooks
    from vllm_graft.hooks import contracts
    from vllm_graft.integration.adapters.kvcompress import keep as adapter

    for name in ("check_keep", "check_keep_heads", "dropped_blocks", "union_of_heads", "KeepError"):
        assert name in hooks.__all__ and name in contracts.__all__
        assert getattr(hooks, name) is getattr(contracts, name) is getattr(adapter, name)


def test_check_keep_in_an_authors_test():
    view = BlockView(num_tokens=50, block_size=16, num_prompt_tokens=50, scores=(0.5, 0.1, 0.9, 0.2),
                     pinned=frozenset({1}), request_id="req-1")
    tova = Tova(TovaParams(budget_blocks=2))
    kept = check_keep(view, tova.keep(view), "tova")
    assert kept == [1, 2, 3] and dropped_blocks(view, kept) == [0]  # pinned 1 is kept too
    with pytest.raises(KeepError, match="'tova'.*the last block"):
        check_keep(view, [1, 2], "tova")
    hv = BlockView(50, 16, 50, head_scores=((1, 1, 1, 1), (1, 1, 1, 1)))
    assert union_of_heads(check_keep_heads(hv, [[0, 3], [2, 3]], "x")) == [0, 2, 3]


def test_views_built_without_the_new_fields_still_work():
    """``step_scores`` and ``request_id`` default to None: views built the old way (the kit's,
    older plugins' tests) are valid, and the TOVA-like scorer falls back to ``scores``."""
    view = BlockView(64, 16, 64, (0.1, 0.9, 0.2, 0.3))
    assert view.step_scores is None and view.request_id is None
    assert Tova(TovaParams(budget_blocks=2)).keep(view) == [1, 3]


# ---------------------------------------------------------- the helper against a dense oracle
def _case(seqs=((7, 7), (40, 1), (19, 3), (33, 1)), h=4, hkv=2, d=16, bs=4, seed=5):
    """A ragged paged GQA batch (blocks scattered over the cache)."""
    from vllm_graft.hooks import AttentionLayer, PagedBatch

    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n, _ in seqs]
    width = max(need) + 1
    perm = torch.randperm(sum(need) + 2, generator=g)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[at:at + k]
        at += k
    qsl = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    batch = PagedBatch(query_start_loc=qsl, seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                       block_table=table)
    kv = torch.randn(len(perm), hkv, bs, 2 * d, generator=g)
    q = torch.randn(int(qsl[-1]), h, d, generator=g)
    return q, kv, batch, AttentionLayer(num_heads=h, num_kv_heads=hkv, head_size=d, scale=d ** -0.5, block_size=bs)


def dense_mass(q, kv, batch, layer, observe):
    """Per sequence and block-table column, the softmax probability the observed queries put
    on its keys, summed over heads and queries: one gathered sequence at a time, float64."""
    k_cache, _ = split_kv_cache(kv)
    bs, g = layer.block_size, layer.num_heads // layer.num_kv_heads
    mass = torch.zeros(batch.block_table.shape, dtype=torch.float64)
    for i, n in enumerate(batch.seq_lens.tolist()):
        q0, q1 = batch.query_start_loc[i].item(), batch.query_start_loc[i + 1].item()
        k = torch.cat([k_cache[int(b)] for b in batch.block_table[i, :-(-n // bs)]], dim=1)[:, :n]  # [H_kv, n, D]
        for t in range(q0, q1):
            if not observe[t]:
                continue
            pos = n - (q1 - t)
            s = torch.einsum("hd,hkd->hk", q[t].double(), k.double().repeat_interleave(g, 0)) * layer.scale
            p = s[:, : pos + 1].softmax(-1).sum(0)
            for j in range(pos + 1):
                mass[i, j // bs] += p[j]
    return mass


def test_the_attention_with_mass_helper_matches_a_dense_oracle():
    q, kv, batch, layer = _case()
    observe = torch.zeros(q.shape[0], dtype=torch.bool)
    observe[[0, 3, 6, 7, 9, 11]] = True
    out, mass = paged_attention_with_mass(q, kv, batch, layer, observe)
    assert out.shape == q.shape
    torch.testing.assert_close(mass.double(), dense_mass(q, kv, batch, layer, observe), atol=1e-5, rtol=1e-5)
    out2, mass2 = attention_with_mass(q, kv, batch, layer, observe, kernel="reference")
    assert torch.equal(out, out2) and torch.equal(mass, mass2)
    with pytest.raises(ValueError, match="'reference' or 'triton'"):
        attention_with_mass(q, kv, batch, layer, observe, kernel="cuda")


# ------------------------------------------------------------- through the worker's scores
def _scored_step(sc, att, q, kv, batch, layer, rows, layers=2):
    """One engine step as the worker runs it: the step's plan, every layer's attention through
    the compressor, then ``finalize`` (which asks ``keep``)."""
    from vllm_graft.integration.adapters.kvcompress.rows import step_rows

    step_rows.step = types.SimpleNamespace(rows=rows, block_size=layer.block_size,
                                           query_start_loc=batch.query_start_loc.tolist())
    try:
        plan = att.plan(batch)
        for _ in range(layers):
            att.forward(q, kv, batch, layer, plan)
        return sc.finalize()
    finally:
        step_rows.step = None


def test_a_tova_like_scorer_reads_the_steps_own_mass_and_the_request_key():
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _ScoringAttention, _StepPlan

    q, kv, batch, layer = _case()
    seqs = [(7, 7), (40, 1), (19, 3), (33, 1)]
    tova = Tova(TovaParams(budget_blocks=3))
    sc = _Scores(tova, "tova", lambda ev, n: None)
    att = _ScoringAttention(sc)
    rows = [(f"req-{i}", n - qn, qn, n if qn > 1 else n - 1, []) for i, (n, qn) in enumerate(seqs)]
    drops = _scored_step(sc, att, q, kv, batch, layer, rows, layers=2)

    # every row was asked once, under its request's id, with this step's own mass per block
    assert [v.request_id for v in tova.seen] == [r[0] for r in rows]
    expected = dense_mass(q, kv, batch, layer, torch.ones(q.shape[0], dtype=torch.bool)) * 2  # 2 layers
    for i, view in enumerate(tova.seen):
        nb = view.num_blocks
        assert view.step_scores == pytest.approx(expected[i, :nb].tolist(), rel=1e-4, abs=1e-5)
        assert sum(view.step_scores) == pytest.approx(seqs[i][1] * layer.num_heads * 2, rel=1e-4)
        assert view.scores == pytest.approx(view.step_scores)  # the first step: nothing accumulated before
        kept = check_keep(view, Tova(TovaParams(budget_blocks=3)).keep(view), "tova")
        assert drops.get(view.request_id, []) == dropped_blocks(view, kept)
    assert drops  # the budget (3 blocks) is below every prompt but the first's (2 blocks)

    # a later step whose mass disagrees with the past: TOVA follows the step, not the sum
    tova.seen.clear()
    B = layer.block_size
    st = sc.reqs["req-1"]
    live = [j for j in range(10) if j not in st.dropped]  # 40 tokens in 10 blocks; now 41 -> 11 blocks
    heavy_before = max((j for j in live if j != 9), key=lambda j: st.scores[j])
    fresh = next(j for j in live if j not in (heavy_before, 9))
    cols = live + [10]
    step_mass = [0.1] * len(cols)
    step_mass[cols.index(fresh)] = 3.0
    step_mass[cols.index(heavy_before)] = 0.0
    before = list(st.scores)
    sc.pending = _StepPlan([("req-1", 40, 1, 39, sorted(st.dropped))], [cols], torch.ones(1, dtype=torch.bool),
                           torch.tensor([step_mass]), B)
    drops = sc.finalize()
    (view,) = tova.seen
    assert view.request_id == "req-1" and view.num_blocks == 11
    assert view.step_scores[fresh] == 3.0 and view.step_scores[heavy_before] == 0.0
    assert all(view.step_scores[j] == NEG_INF and view.scores[j] == NEG_INF for j in st.dropped - set(drops["req-1"]))
    assert view.scores[heavy_before] == pytest.approx(before[heavy_before])  # accumulated: unchanged
    assert view.scores[fresh] == pytest.approx(before[fresh] + 3.0)
    assert drops["req-1"] == [heavy_before]  # kept: fresh, block 9 (0.1) and the last


def test_the_scheduler_and_the_worker_pass_the_request_key_to_unscored_compressors():
    from vllm_graft.integration.adapters.kvcompress.plan import blocks_to_free, blocks_to_skip

    class Window(KVCompressor):
        def __init__(self):
            super().__init__(Params())
            self.ids = []

        def keep(self, view):
            self.ids.append(view.request_id)
            return sorted({view.num_blocks - 1, *view.pinned})

    w = Window()
    assert blocks_to_free(w, "w", num_tokens=40, block_size=16, num_prompt_tokens=40,
                          held=[(False, 1)] * 3, request_id="r7") == [0, 1]
    assert blocks_to_skip(w, "w", num_tokens=40, block_size=16, num_prompt_tokens=40, request_id="r7") == [0, 1]
    assert blocks_to_skip(w, "w", num_tokens=40, block_size=16, num_prompt_tokens=40) == [0, 1]
    assert w.ids == ["r7", "r7", None]
