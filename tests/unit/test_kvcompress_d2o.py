"""``d2o`` (D2O, merge-on-evict): H2O's blocks dropped, each evicted token merged into its most
similar kept token (checked against a per-token loop), the running threshold, the worker's
merge into the paged cache (the right physical slots, nothing else touched), the adapter's
refusals and the per-request prefix-cache salt."""

import math

import pytest
import torch

from vllm_graft.hooks import BLOCKED, CPU_VEC, PACKED, BlockView, KVCompressor, get_registry
from vllm_graft.plugins.kvcompress.d2o.reference import merge_nearest

from .test_kvcompress_policies import build as _build


def build(**params):
    return _build("d2o", **params)


def loop_merge(dk, dv, kk, kv, threshold):
    """Per KV head and per dropped token, the merge as the package doc states it."""
    H, M, D = kk.shape
    out_k, out_v = kk.clone().double(), kv.clone().double()
    for h in range(H):
        num_k = [kk[h, j].double() * math.e for j in range(M)]
        num_v = [kv[h, j].double() * math.e for j in range(M)]
        den = [math.e] * M
        for e in range(dk.shape[1]):
            sims = [float(torch.nn.functional.cosine_similarity(dk[h, e], kk[h, j], dim=0)) for j in range(M)]
            j = max(range(M), key=lambda x: sims[x])
            if sims[j] >= float(threshold[h]):
                w = math.exp(sims[j])
                num_k[j] = num_k[j] + w * dk[h, e].double()
                num_v[j] = num_v[j] + w * dv[h, e].double()
                den[j] += w
        for j in range(M):
            out_k[h, j], out_v[h, j] = num_k[j] / den[j], num_v[j] / den[j]
    return out_k, out_v


@pytest.mark.parametrize("seed", range(4))
def test_merge_matches_a_per_token_loop(seed):
    g = torch.Generator().manual_seed(seed)
    H, E, M, D = 2, 16, 24, 8
    kk = torch.randn(H, M, D, generator=g)
    dk = kk[:, torch.randint(0, M, (E,), generator=g)] + 0.6 * torch.randn(H, E, D, generator=g)  # some close
    dv, kv = torch.randn(H, E, D, generator=g), torch.randn(H, M, D, generator=g)
    thr = torch.tensor([0.5, 0.8])
    new_k, new_v, best = merge_nearest(dk, dv, kk, kv, thr)
    ref_k, ref_v = loop_merge(dk, dv, kk, kv, thr)
    torch.testing.assert_close(new_k.double(), ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_v.double(), ref_v, atol=1e-5, rtol=1e-5)
    merged = (best >= thr[:, None]).sum()
    assert 0 < merged < H * E  # the case exercises both branches
    assert not torch.equal(new_k, kk)


def test_threshold_one_merges_nothing_and_minus_one_everything():
    g = torch.Generator().manual_seed(1)
    dk, dv, kk, kv = (torch.randn(2, n, 8, generator=g) for n in (16, 16, 24, 24))
    k1, v1, _ = build(threshold=1.0).merge(dk, dv, kk, kv)
    assert torch.equal(k1, kk) and torch.equal(v1, kv)
    k2, v2, _ = build(threshold=-1.0).merge(dk, dv, kk, kv)
    ref_k, ref_v = loop_merge(dk, dv, kk, kv, torch.tensor([-1.0, -1.0]))
    torch.testing.assert_close(k2.double(), ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2.double(), ref_v, atol=1e-5, rtol=1e-5)


def test_running_threshold_starts_at_the_mean_best_similarity_and_moves_by_ema():
    g = torch.Generator().manual_seed(2)
    c = build(ema=0.25)
    dk, dv, kk, kv = (torch.randn(2, n, 8, generator=g).to(torch.bfloat16) for n in (16, 16, 24, 24))
    sim = torch.nn.functional.normalize(dk.float(), dim=-1) @ torch.nn.functional.normalize(kk.float(), dim=-1).mT
    mean_best = sim.max(-1).values.mean(-1)
    k1, v1, state = c.merge(dk, dv, kk, kv)
    assert k1.dtype == torch.bfloat16 and k1.shape == kk.shape
    torch.testing.assert_close(state, mean_best)
    # the first merge used the mean itself as the threshold
    ref_k, _ = loop_merge(dk.float(), dv.float(), kk.float(), kv.float(), mean_best)
    torch.testing.assert_close(k1.double(), ref_k, atol=2e-2, rtol=2e-2)
    dk2 = torch.randn(2, 16, 8, generator=g).to(torch.bfloat16)
    sim2 = torch.nn.functional.normalize(dk2.float(), dim=-1) @ torch.nn.functional.normalize(k1.float(), dim=-1).mT
    _, _, state2 = c.merge(dk2, dv, k1, v1, state)
    torch.testing.assert_close(state2, 0.25 * state + 0.75 * sim2.max(-1).values.mean(-1))


def test_drops_the_same_blocks_as_h2o():
    view = BlockView(16 * 20, 16, 16 * 20, scores=[float((i * 7) % 11) for i in range(20)])
    assert build(budget_blocks=6).keep(view) == _build("h2o", budget_blocks=6).keep(view)
    assert build().merges and build().needs_scores


def _cache(layout, N, H, B, D, seed):
    g = torch.Generator().manual_seed(seed)
    if layout is not PACKED:  # blocked, cpu_vec: [N, H, B, 2D] contiguous, read through split
        return torch.randn(N, H, 2 * B, D, generator=g).view(N, H, B, 2 * D)
    return torch.randn(N, B, H, 2 * D, generator=g).permute(0, 2, 1, 3)  # NHD, as FLASH_ATTN's


@pytest.mark.parametrize("layout", [BLOCKED, PACKED, CPU_VEC], ids=lambda x: x.name)
def test_worker_merges_into_the_kept_slots_before_the_drops_go_out(layout):
    from vllm_graft.integration.adapters.kvcompress.merge import MergingScores
    from vllm_graft.integration.adapters.kvcompress.scores import _StepPlan

    B, H, D, N = 4, 2, 8, 20
    comp = build(budget_blocks=3, sink_blocks=1, recent_blocks=1, threshold=-1.0)  # merges every dropped token
    events = []
    sc = MergingScores(comp, "d2o", lambda ev, n: events.append((ev, n)))
    caches = [_cache(layout, N, H, B, D, s) for s in (0, 1)]
    before = [c.clone() for c in caches]
    # request "a": 5 logical blocks, 18 tokens (last block 2 of 4 slots), physical [7, 3, 11, 5, 9];
    # request "b" next to it drops nothing
    table = torch.tensor([[7, 3, 11, 5, 9], [1, 2, 0, 0, 0]], dtype=torch.int32)
    batch = type("Batch", (), {"block_table": table})()
    sc.caches, sc.block_table = {}, table  # as plan() sets them
    plan = _StepPlan(
        [("a", 17, 1, 16, []), ("b", 5, 1, 6, [])],
        [list(range(5)), [0, 1]],
        torch.ones(2, dtype=torch.bool),
        torch.zeros(2, 5),
        B,
    )
    plan.mass[0] = torch.tensor([1.0, 0.5, 3.0, 0.2, 1.0])  # keep 0 (sink), 2 (heavy), 4 (recent)
    sc.pending = plan
    for c in caches:
        sc.note(c, layout)
    assert batch.block_table is table
    drops = sc.finalize()
    assert drops == {"a": [1, 3]}
    assert ("blocks_merged", 2) in events
    for c, b in zip(caches, before):
        k, v = layout.split(c)
        k0, v0 = layout.split(b)
        # dropped (3, 5), b's (1, 2) and untouched blocks (0, ...) are as they were
        for phys in [3, 5, 1, 2, 0, 4, 6, 8, 10]:
            assert torch.equal(k[phys], k0[phys]) and torch.equal(v[phys], v0[phys])
        # the kept tokens: logical 0, 2 full, logical 4's first 2 slots; its last 2 slots untouched
        tok = lambda x, blocks: x[blocks].permute(1, 0, 2, 3).reshape(H, -1, D)  # noqa: E731
        kept_k, kept_v = tok(k0, [7, 11, 9])[:, :10], tok(v0, [7, 11, 9])[:, :10]
        ref_k, ref_v = loop_merge(tok(k0, [3, 5]), tok(v0, [3, 5]), kept_k, kept_v, torch.tensor([-1.0, -1.0]))
        torch.testing.assert_close(tok(k, [7, 11, 9])[:, :10].double(), ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tok(v, [7, 11, 9])[:, :10].double(), ref_v, atol=1e-5, rtol=1e-5)
        assert torch.equal(k[9][:, 2:], k0[9][:, 2:]) and torch.equal(v[9][:, 2:], v0[9][:, 2:])
    assert set(sc.merge_state["a"]) == {c.data_ptr() for c in caches}
    # every step runs the merging attention (none goes to vLLM's kernel un-noted)
    from vllm_graft.integration.adapters.kvcompress.merge import MergingAttention

    assert MergingAttention(sc).plain(None) is False
    sc.forget(["a"])
    assert "a" not in sc.merge_state


def test_the_shape_check_refuses_a_merging_compressor_it_cannot_serve():
    """hooks.contracts.kvcompress.shape_problems, which validation and the kit run (not activate)."""
    from vllm_graft.hooks.contracts import shape_problems

    class NoMerge(KVCompressor):
        needs_scores = merges = True

        def keep(self, view):
            return list(range(view.num_blocks))

    class Unscored(NoMerge):
        needs_scores = False

        def merge(self, *a):
            return a[2], a[3], None

    for impl, why in ((NoMerge, "implements no merge"), (Unscored, "does not set needs_scores")):
        (found,) = shape_problems("kvcompress", impl)
        assert why in found.message and found.other is None


def test_each_request_of_a_merging_compressor_is_salted_on_its_own():
    from vllm_graft.integration.adapters.kvcompress import state as _state
    from vllm_graft.integration.adapters.kvcompress.salt import request_init_wrapper
    from vllm_graft.integration.adapters.kvcompress.state import Active

    class Req:
        def __init__(self, request_id, prompt, cache_salt=None):
            self.request_id, self.cache_salt = request_id, cache_salt

    init = request_init_wrapper(Req.__init__)
    _state.set_active(Active(build(), "d2o", lambda *a: None, salt="S", salt_per_request=True))
    try:
        a, b, c = Req.__new__(Req), Req.__new__(Req), Req.__new__(Req)
        init(a, "r1", [1, 2])
        init(b, "r2", [1, 2])
        init(c, "r3", [1, 2], cache_salt="user")
        assert a.cache_salt == "S/request=r1" and b.cache_salt == "S/request=r2"
        assert c.cache_salt == "S/request=r3|user"
    finally:
        _state.set_active(None)


def test_registered_with_its_paper_and_refused_with_kv4():
    from vllm_graft.hooks.contracts import shape_problems

    reg = get_registry().get("kvcompress", "d2o").registration
    kv4 = get_registry().get("kvcompress", "kv4").registration.load()
    assert "2406.13035" in reg.paper
    # refused with kv4 by its shape (validation runs it; tests/unit/test_kvcompress_shape.py)
    assert [p.other for p in shape_problems("kvcompress", reg.load(), [("kvcompress", "kv4", kv4)])] == ["kvcompress:kv4"]
