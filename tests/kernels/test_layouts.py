"""Every Triton kernel that reads the paged KV cache, against its PyTorch reference, in each
cache a plugin may be handed (tests/kernels/layouts.py: blocked, packed NHD, packed HND; the same
tokens written into each by ``KVCacheLayout.write``): hydragen, squeezed (chunk scores and sparse
decode), the scored compressors' attention with mass (per block and per KV head), kv4 (its own
page, contiguous and NHD-ordered) and tree attention. The oracle is the reference over the blocked
cache, so a kernel that reads another layout's memory as blocked is caught. Small shapes: under
TRITON_INTERPRET=1 each program runs in NumPy. Compiled on ``GRAFT_REAL_DEVICE`` where it is set."""
from __future__ import annotations

from tests.kernels import device

DEVICE = device()  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.hooks import PagedBatch  # noqa: E402
from tests.kernels.layouts import CACHES, in_cache  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.kernel


def _to(batch: PagedBatch, *ts):
    return (PagedBatch(*(t.to(DEVICE) for t in (batch.query_start_loc, batch.seq_lens, batch.block_table))),
            *(t.to(DEVICE) for t in ts))


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_the_caches_differ_in_memory():
    """The three caches hold the same K/V at different addresses (else the tests below prove
    nothing about layouts)."""
    kv = torch.randn(3, 2, 4, 8)
    blocked, _ = in_cache(kv, _layer(), "blocked")
    hnd, _ = in_cache(kv, _layer(), "packed-HND")
    nhd, _ = in_cache(kv, _layer(), "packed-NHD")
    assert torch.equal(blocked, kv)
    assert not torch.equal(hnd, kv) and not nhd.is_contiguous()
    assert torch.equal(nhd.contiguous(), hnd)


def _layer():
    from vllm_graft.hooks import AttentionLayer

    return AttentionLayer(num_heads=4, num_kv_heads=2, head_size=4, scale=0.5, block_size=4)


@pytest.mark.parametrize("cache", CACHES)
def test_hydragen(cache):
    from tests.unit.test_hydragen import paged_case
    from vllm_graft.plugins.attention.hydragen import HydragenParams
    from vllm_graft.plugins.attention.hydragen.reference import Hydragen

    q, kv, batch, layer = paged_case(6, torch.float32, 4, 2, 64, 16)  # a two-level prefix tree
    batch, q, kv = _to(batch, q, kv)
    ref_m = Hydragen(HydragenParams())
    want = ref_m.forward(q, kv, batch, layer, ref_m.plan(batch))
    c, lay = in_cache(kv, layer, cache)
    tri_m = Hydragen(HydragenParams(kernel="triton"))
    plan = tri_m.plan(batch)
    assert plan.prefixes(16).groups, "the case must have a shared prefix group"
    got = tri_m.forward(q, c, batch, lay, plan)
    ref = ref_m.forward(q, c, batch, lay, ref_m.plan(batch))
    print(f"{cache}: triton {_err(got, want):.2e}, reference {_err(ref, want):.2e}")
    assert _err(got, want) <= 1e-5 and _err(ref, want) <= 1e-5


@pytest.mark.parametrize("cache", CACHES)
def test_squeezed(cache):
    from tests.unit.test_squeezed import paged
    from vllm_graft.plugins.attention._shared import gather_kv
    from vllm_graft.plugins.attention.squeezed import SqueezedParams
    from vllm_graft.plugins.attention.squeezed.kernel import chunk_scores_triton
    from vllm_graft.plugins.attention.squeezed.reference import Squeezed, chunk_scores

    seqs = [(70, 1), (19, 3), (45, 1)]
    q, kv, batch, layer = paged(seqs, 4, 2, 32, 16, torch.float32, seed=3)
    batch, q, kv = _to(batch, q, kv)
    c, lay = in_cache(kv, layer, cache)
    kw = dict(mode="centroid", budget=0.4, chunk=8, sink_tokens=8, recent_tokens=8)
    want = Squeezed(SqueezedParams(**kw)).forward(q, kv, batch, layer)
    got = Squeezed(SqueezedParams(kernel="triton", **kw)).forward(q, c, batch, lay)
    ref = Squeezed(SqueezedParams(**kw)).forward(q, c, batch, lay)
    rows, ids, lens = [0, 4], [0, 2], [70, 45]
    scores = chunk_scores_triton(q, c, batch, lay, 8, rows, ids, lens)
    s_err = 0.0
    for r, (tok, i, n) in enumerate(zip(rows, ids, lens)):
        k, _ = gather_kv(kv, batch.block_table[i, : -(-n // 16)], n, 32)
        s = chunk_scores(q[tok], k, 8, layer.scale)
        s_err = max(s_err, _err(scores[r, :, : s.shape[1]], s))
    print(f"{cache}: triton {_err(got, want):.2e}, reference {_err(ref, want):.2e}, scores {s_err:.2e}")
    assert _err(got, want) <= 1e-5 and _err(ref, want) <= 1e-5 and s_err <= 1e-4


@pytest.mark.parametrize("per_head", [False, True], ids=["per-block", "per-kv-head"])
@pytest.mark.parametrize("cache", CACHES)
def test_attention_with_mass(cache, per_head):
    from tests.kernels.test_h2o_kernel import paged_case
    from vllm_graft.plugins.attention._shared import paged_attention_with_mass
    from vllm_graft.plugins.kvcompress._shared.kernel import attention_with_mass

    query, kv, batch, layer, observe = paged_case(torch.float32, [16, 37, 20], [1, 1, 5], device=DEVICE)
    head_mask = None
    if per_head:
        g = torch.Generator().manual_seed(1)
        head_mask = torch.rand(3, 2, batch.block_table.shape[1], generator=g) < 0.6
        for i, n in enumerate(batch.seq_lens.tolist()):
            head_mask[i, :, (n - 1) // 16] = True
        head_mask = head_mask.to(DEVICE)
    want_out, want_mass = paged_attention_with_mass(query, kv, batch, layer, observe, head_mask=head_mask)
    c, lay = in_cache(kv, layer, cache)
    out, mass = attention_with_mass(query, c, batch, lay, observe, head_mask=head_mask)
    ref_out, ref_mass = paged_attention_with_mass(query, c, batch, lay, observe, head_mask=head_mask)
    errs = [_err(out, want_out), _err(mass, want_mass), _err(ref_out, want_out), _err(ref_mass, want_mass)]
    print(f"{cache} per_head={per_head}: kernel out/mass {errs[0]:.2e}/{errs[1]:.2e}, "
          f"reference {errs[2]:.2e}/{errs[3]:.2e}")
    assert max(errs) <= 1e-5


def test_kv4_page_in_any_physical_order():
    """kv4 stores its own byte page: written and read through the ``[N, H_kv, B, C]`` view's
    strides, so an NHD-ordered page holds the same tokens and gives the same attention."""
    from tests.kernels.test_kv4_kernel import kv4_case
    from vllm_graft.plugins.kvcompress.kv4.kernel import paged_attention_kv4_triton
    from vllm_graft.plugins.kvcompress.kv4.reference import paged_attention_kv4

    case = ([1, 21, 35, 9], [1, 1, 1, 4], 4, 2, 64, 16)
    query, page, batch, layer = kv4_case(torch.float32, *case)
    want, _ = paged_attention_kv4(query, page, batch, layer, 32)
    _, nhd, _, _ = kv4_case(torch.float32, *case, nhd=True)
    assert not nhd.is_contiguous() and torch.equal(nhd, page)
    got = paged_attention_kv4_triton(query, nhd, batch, layer, 32)
    ref, _ = paged_attention_kv4(query, nhd, batch, layer, 32)
    print(f"NHD page: triton {_err(got, want):.2e}, reference {_err(ref, want):.2e}")
    assert _err(got, want) <= 1e-4 and _err(ref, want) == 0.0


@pytest.mark.parametrize("cache", CACHES)
def test_tree_attention(cache):
    from vllm_graft.hooks import BLOCKED
    from vllm_graft.plugins.speculative._tree import DraftTree, tree_attention
    from vllm_graft.plugins.speculative._tree.kernel import tree_attention_triton

    tree = DraftTree.from_chains([[1, 2, 3], [1, 4], [5, 6]])
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d, bs, ctx = len(tree), 4, 2, 32, 16, 37
    kv = torch.randn(5, hkv, bs, 2 * d, generator=g).to(DEVICE)
    table = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    q = torch.randn(n, hq, d, generator=g).to(DEVICE)
    k_tree, v_tree = (torch.randn(n, hkv, d, generator=g).to(DEVICE) for _ in range(2))
    parents = tree.parents.to(DEVICE)

    def token_major(layout, c):  # the kernel's [num_blocks, block_size, Hkv, D] views
        return tuple(x.permute(0, 2, 1, 3) for x in layout.split(c))

    want = tree_attention(q, *token_major(BLOCKED, kv), table, ctx, k_tree, v_tree, parents, d ** -0.5)
    c, lay = in_cache(kv, _layer(), cache)
    got = tree_attention_triton(q, *token_major(lay.kv_layout, c), table, ctx, k_tree, v_tree, parents, d ** -0.5)
    ref = tree_attention(q, *token_major(lay.kv_layout, c), table, ctx, k_tree, v_tree, parents, d ** -0.5)
    print(f"{cache}: triton {_err(got, want):.2e}, reference {_err(ref, want):.2e}")
    assert _err(got, want) <= 1e-5 and _err(ref, want) <= 1e-6


def test_a_cache_without_unit_stride_along_d_is_refused():
    from vllm_graft.plugins.attention._shared import cache_strides

    k = torch.zeros(2, 2, 4, 8)[..., ::2]
    with pytest.raises(ValueError, match="unit stride along the head dim"):
        cache_strides(k, k, "test kernel")
