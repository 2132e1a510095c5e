"""Tree verification on vLLM's CPU kernel (issue 37, "trees where they pay"): with the cache in
vLLM's own layout (``cpu_vec``, the ``vec``/``vec16`` ISAs) the graft backend hands a step without
trees to vLLM's C++ kernel (``TreeAttention.plain``), and on a step with trees runs vLLM's kernel
for every row, then overwrites only the tree rows with their masked pass (``amends``/``amend``);
with an ISA whose layout is not checked (``amx``) the cache is ``blocked`` and every row runs in
PyTorch, as before. Here with vLLM's real cache write and C++ kernel (``GraftCPUAttentionImpl``,
vLLM's CPU attention metadata), against a dense oracle and against the blocked path; the accepted
nodes' KV moved in ``cpu_vec``. The engine-level check (plain vLLM's greedy tokens, the same
verify logits in both layouts): tests/e2e/test_cpu_vec_engine.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_graft.hooks import BLOCKED, CPU_VEC, PagedBatch
from vllm_graft.integration.adapters.speculative import tree as T

from tests.unit.test_spec_tree_engine import step_tree, verifier_with

ops = pytest.importorskip("vllm._custom_ops")

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 32
PARENTS = [-1, -1, 0, 1, 1, 3, 0]  # seven nodes after the root
#: the step: row 0 a prefill chunk of 5 tokens after 40 cached, row 1 the tree's root and nodes
#: after 37 cached, row 2 a decode after 50 cached
ROWS = [(40, 5), (37, len(PARENTS) + 1), (50, 1)]  # (cached, scheduled)
TREE_ROW = 1


def _case(dtype, seed=0, rows=ROWS, tree_row=TREE_ROW):
    """The step's query, every position's key/value, the slots and the block table (blocks
    shuffled), the PagedBatch; ``rows`` (cached, scheduled) per sequence, the tree's in ``tree_row``."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-(c + s) // BLOCK) for c, s in rows]
    ids = torch.randperm(sum(blocks_per_row) + 2, generator=g)[: sum(blocks_per_row)]
    width = max(blocks_per_row)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    at = 0
    for r, nb in enumerate(blocks_per_row):
        table[r, :nb] = ids[at : at + nb].to(torch.int32)
        at += nb
    slots, starts = [], [0]
    for r, (c, s) in enumerate(rows):
        pos = torch.arange(c + s)
        slots.append(table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK)
        starts.append(starts[-1] + s)
    n_tokens = starts[-1]
    key = [torch.randn(c + s, KV_HEADS, DIM, generator=g).to(dtype) for c, s in rows]
    value = [torch.randn(c + s, KV_HEADS, DIM, generator=g).to(dtype) for c, s in rows]
    query = torch.randn(n_tokens, HEADS, DIM, generator=g).to(dtype)
    batch = PagedBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + s for c, s in rows], dtype=torch.int32),
        block_table=table,
        max_query_len=max(s for _, s in rows),
    )
    return SimpleNamespace(
        query=query,
        key=key,
        value=value,
        slots=slots,
        batch=batch,
        n_blocks=int(ids.max()) + 1,
        rows=rows,
        tree=tree_row,
    )


def _oracle(case):
    """Dense attention per sequence in float64: causal, the tree's rows under the tree mask."""
    out = torch.empty(case.query.shape, dtype=torch.float64)
    qsl = case.batch.query_start_loc.tolist()
    group = HEADS // KV_HEADS
    for r, (c, s) in enumerate(case.rows):
        n = c + s
        allowed = torch.arange(n)[None, :] <= torch.arange(c, n)[:, None]  # causal
        if r == case.tree:
            allowed[:, c:] = T._tree_parts().ancestor_mask([-1, *(p + 1 for p in PARENTS)])
        q = case.query[qsl[r] : qsl[r + 1]].double()
        k = case.key[r].double().repeat_interleave(group, 1)
        v = case.value[r].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
        p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[qsl[r] : qsl[r + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


@pytest.fixture
def seams():
    from vllm_graft.integration.adapters import backend

    saved = (backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count, backend.SEAMS.host_kernel)
    backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.host_kernel = T._ATTENTION, "tree", False
    counted: list[str] = []
    backend.SEAMS.count = lambda event, n: counted.append(event)
    yield backend, counted
    backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count, backend.SEAMS.host_kernel = saved


def _impl(backend):
    """vLLM's CPU attention impl with the graft seams, with the attributes vLLM's constructor
    sets (which needs a vLLM config for its encoder path alone)."""
    impl = object.__new__(backend.GraftCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = HEADS, KV_HEADS, DIM, DIM**-0.5
    impl.num_queries_per_kv = HEADS // KV_HEADS
    impl.sliding_window, impl.alibi_slopes, impl.sinks, impl.logits_soft_cap = -1, None, None, 0
    impl.kv_cache_dtype, impl.is_fp8_kv_cache, impl.attn_type = "auto", False, "decoder"
    impl.kv_sharing_target_layer_name, impl.use_zentorch_sdpa = None, False
    return impl


def _metadata(case, dtype, isa):
    """vLLM's CPU attention metadata for the step (as its builder makes it) with the graft's."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    b = case.batch
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(case.rows),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        seq_lens=b.seq_lens,
        dtype=dtype,
        query_start_loc=b.query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa="vec" if isa == "amx" else isa,  # amx: never reaches vLLM's kernel (blocked cache)
        enable_kv_split=False,
    )
    n = int(b.query_start_loc[-1])
    md = CPUAttentionMetadata(
        num_actual_tokens=n,
        max_query_len=b.max_query_len,
        query_start_loc=b.query_start_loc,
        max_seq_len=int(b.seq_lens.max()),
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        slot_mapping=torch.cat([s[-case.rows[r][1] :] for r, s in enumerate(case.slots)]),
        scheduler_metadata=sched,
    )
    md.graft_batch = b
    md.graft_plan = T._ATTENTION.plan(b)
    return md


def _run(backend, case, dtype, isa, trees=True):
    """The cache written through the impl (the context, then the step's keys/values, as vLLM's
    runner does), one forward; returns (output, cache, layout)."""
    impl = _impl(backend)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.0.self_attn.attn")
    kv = torch.zeros(case.n_blocks, KV_HEADS, BLOCK, 2 * DIM, dtype=dtype)
    layout = impl.graft_layout(layer, kv)
    start = int(case.batch.query_start_loc[case.tree])
    step = {case.tree: step_tree(PARENTS, start=start, context=case.rows[case.tree][0])} if trees else {}
    T.set_verifier(verifier_with(step, others=len(case.rows) > 1))
    try:
        md = _metadata(case, dtype, isa)
        for r in range(len(case.rows)):
            impl.do_kv_cache_update(layer, case.key[r], case.value[r], kv, case.slots[r])
        output = torch.full(case.query.shape, float("nan"), dtype=dtype)
        impl.forward(layer, case.query, None, None, kv, md, output)
    finally:
        T.set_verifier(None)
    return output, kv, layout, md.graft_plan


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tree_step_in_cpu_vec_is_vllms_kernel_then_the_tree_rows_and_equals_the_blocked_path(seams, dtype):
    backend, counted = seams
    backend.stock_layout_checked.cache_clear()
    case = _case(dtype)
    want = _oracle(case)
    got_vec, _, layout_vec, plan_vec = _run(backend, case, dtype, "vec")
    events_vec, counted[:] = list(counted), []
    got_blocked, _, layout_blocked, plan_blocked = _run(backend, case, dtype, "amx")
    events_blocked = list(counted)
    assert (layout_vec, layout_blocked) == (CPU_VEC, BLOCKED)
    assert plan_vec.layout is CPU_VEC and plan_blocked.layout is BLOCKED  # what move_kv will read
    # cpu_vec: vLLM's kernel, then the tree rows amended; blocked: the method's forward (PyTorch)
    assert events_vec == ["stock_layers_with_tree"] and events_blocked == ["forward"]
    tol = TOL[dtype]
    for got in (got_vec, got_blocked):
        assert (got.double() - want).abs().max().item() <= tol
    assert (got_vec.float() - got_blocked.float()).abs().max().item() <= tol
    # the rows of the requests without a tree are vLLM's kernel's own output, untouched
    alone, _, _, _ = _run(backend, case, dtype, "vec", trees=False)
    qsl = case.batch.query_start_loc.tolist()
    tree_rows = slice(qsl[TREE_ROW], qsl[TREE_ROW + 1])
    others = torch.ones(qsl[-1], dtype=torch.bool)
    others[tree_rows] = False
    assert torch.equal(got_vec[others], alone[others])
    # ... and vLLM's causal result on the tree rows is wrong for a tree: the amend is what fixes it
    # (nodes with a non-ancestor before them), so leaving the rows as vLLM wrote them fails above
    assert (alone[tree_rows].double() - want[tree_rows]).abs().max().item() > 0.1 > 3 * tol


def test_steps_without_trees_go_to_vllms_kernel_in_cpu_vec_only(seams, monkeypatch):
    backend, counted = seams
    backend.stock_layout_checked.cache_clear()
    case = _case(torch.float32, seed=1)
    plain = _oracle(case)
    # the same step as all-causal: what vLLM's kernel computes for it
    qsl = case.batch.query_start_loc.tolist()
    c, s = ROWS[TREE_ROW]
    n = c + s
    allowed = torch.arange(n)[None, :] <= torch.arange(c, n)[:, None]
    q = case.query[qsl[TREE_ROW] : qsl[TREE_ROW + 1]].double()
    k = case.key[TREE_ROW].double().repeat_interleave(2, 1)
    v = case.value[TREE_ROW].double().repeat_interleave(2, 1)
    p = (torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5).masked_fill(~allowed, float("-inf")).softmax(-1)
    plain[qsl[TREE_ROW] : qsl[TREE_ROW + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    for isa, want_events in (("vec", ["stock_layers"]), ("amx", ["forward"])):
        counted[:] = []
        out, _, _, plan = _run(backend, case, torch.float32, isa, trees=False)
        assert plan is None and counted == want_events, isa
        assert (out.double() - plain).abs().max().item() <= 2e-5, isa
    # off vLLM's CPU engine (CUDA asks plain() unconditionally) nothing is handed over
    monkeypatch.setattr(T, "_cpu_engine", lambda: False)
    assert not T._ATTENTION.plain(None)
    monkeypatch.undo()
    assert T._ATTENTION.plain(None) and not T._ATTENTION.amends(None)


def test_a_step_of_trees_alone_runs_only_the_passes_over_vllms_cache(seams, monkeypatch):
    """Batch 1: every row is a tree's, so vLLM's output would be overwritten whole; the method's
    forward computes the passes alone over the cpu_vec cache vLLM wrote (vLLM's kernel not run)."""
    from vllm.v1.attention.backends import cpu_attn

    backend, counted = seams
    backend.stock_layout_checked.cache_clear()
    stock = []
    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "forward", lambda self, *a, **k: stock.append(1))
    case = _case(torch.float32, seed=2, rows=[ROWS[TREE_ROW]], tree_row=0)
    got, _, layout, plan = _run(backend, case, torch.float32, "vec")
    assert layout is CPU_VEC and plan.layout is CPU_VEC and not plan.others
    assert counted == ["forward"] and stock == []
    assert (got.double() - _oracle(case)).abs().max().item() <= 2e-5


def test_the_test_fails_if_the_tree_rows_are_not_overwritten(seams, monkeypatch):
    """The mutation: ``amend`` leaves vLLM's causal tree rows; the comparison above then fails."""
    backend, _ = seams
    backend.stock_layout_checked.cache_clear()
    case = _case(torch.float32)
    monkeypatch.setattr(T.TreeAttention, "_pass_rows", staticmethod(lambda *a: None))
    got, _, _, _ = _run(backend, case, torch.float32, "vec")
    assert (got.double() - _oracle(case)).abs().max().item() > 1e-3


def test_move_kv_moves_accepted_nodes_in_cpu_vec():
    """``move_kv`` in vLLM's own layout: the moved keys and values read back right through
    ``CPU_VEC.split`` (and vLLM's kernel layout: the keys transposed per block), the other slots
    untouched; moving as if the cache were blocked would not."""
    g = torch.Generator().manual_seed(3)
    n_blocks, total = 4, 4 * BLOCK
    slots = torch.arange(total)
    key = torch.randn(total, KV_HEADS, DIM, generator=g)
    value = torch.randn(total, KV_HEADS, DIM, generator=g)
    caches = []
    for _ in range(2):  # two layers
        kv = torch.zeros(n_blocks, KV_HEADS, BLOCK, 2 * DIM)
        k_cache, v_cache = kv.view(n_blocks, KV_HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, "vec")  # vLLM's write
        caches.append(kv)
    before = [c.clone() for c in caches]
    src, dst = [70, 45, 101], [33, 34, 35]  # across blocks, as accepted nodes are
    T.move_kv(caches, src, dst, CPU_VEC)
    for kv, old in zip(caches, before):
        k, v = CPU_VEC.split(kv)
        for s, d in zip(src, dst):
            assert torch.equal(k[d // BLOCK, :, d % BLOCK], key[s]) and torch.equal(
                v[d // BLOCK, :, d % BLOCK], value[s]
            )
        rest = [t for t in range(total) if t not in dst]
        ko, vo = CPU_VEC.split(old)
        for t in rest:
            assert torch.equal(k[t // BLOCK, :, t % BLOCK], ko[t // BLOCK, :, t % BLOCK])
            assert torch.equal(v[t // BLOCK, :, t % BLOCK], vo[t // BLOCK, :, t % BLOCK])
    wrong = [b.clone() for b in before]
    T.move_kv(wrong, src, dst, BLOCKED)
    k, _ = CPU_VEC.split(wrong[0])
    assert not torch.equal(k[dst[0] // BLOCK, :, dst[0] % BLOCK], key[src[0]])
