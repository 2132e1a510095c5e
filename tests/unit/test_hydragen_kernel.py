"""hydragen's Triton kernels against the PyTorch reference under TRITON_INTERPRET=1
(fp32 and fp16; ragged lengths, GQA, head_dim 64 and 128, block sizes 16 and 32; shared
prefix trees of depth 1 to 3 with decode, chunked-prefill and prefill rows)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported


import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.attention.hydragen import HydragenParams  # noqa: E402
from vllm_graft.plugins.attention.hydragen.policy import StepPlan  # noqa: E402
from vllm_graft.plugins.attention.hydragen.reference import (  # noqa: E402
    Hydragen,
    merge,
    prefix_attention,
    suffix_attention,
)

from .test_hydragen import paged_case  # noqa: E402

pytestmark = pytest.mark.kernel

SHAPES = [  # (H, H_kv, D, block size)
    (4, 2, 64, 16),
    (4, 4, 128, 32),
    (8, 2, 64, 32),
    (6, 2, 128, 16),
]
#: Per shape, a seed of ``paged_case`` whose tree has two levels (found by search, kept fixed).
SEEDS = {0: 6, 1: 6, 2: 8, 3: 38}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-Hkv{}-D{}-B{}".format(*s))
def test_triton_matches_reference(shape, dtype):
    h, hkv, d, bs = shape
    seed = SEEDS[SHAPES.index(shape)]
    q, kv, batch, layer = paged_case(seed, dtype, h, hkv, d, bs)
    ref_m, tri_m = Hydragen(HydragenParams()), Hydragen(HydragenParams(kernel="triton"))
    ref = ref_m.forward(q, kv, batch, layer, ref_m.plan(batch))
    plan = tri_m.plan(batch)
    out = tri_m.forward(q, kv, batch, layer, plan)
    tree = plan.prefixes(bs)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"{shape} {dtype}: {q.shape[0]} tokens of {len(plan.seq_lens)} seqs, "
          f"{len(tree.groups)} groups, depth {tree.depth}: max|err| {err:.2e}")
    assert tree.depth >= 2, "the case must exercise nested prefix groups"
    assert out.dtype == q.dtype and out.shape == q.shape
    assert err <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_each_kernel_against_its_reference_part(dtype):
    """Prefix attention with stacked queries, suffix decode attention and the LSE merge, each
    checked on its own: the kernels' partial outputs and log-sum-exps equal the reference's."""
    from vllm_graft.plugins.attention.hydragen import kernel as K

    h, hkv, d, bs = 8, 2, 64, 16
    q, kv, batch, layer = paged_case(3, dtype, h, hkv, d, bs)
    plan = StepPlan(batch)
    tree = plan.prefixes(bs)
    assert tree.groups
    out = K.hydragen_attention_triton(q, kv, batch, layer, plan)  # fills plan.cache
    ix = plan.cache[("triton", bs, "cpu")]
    k_cache, v_cache = layer.kv_layout.split(kv)
    prec = "ieee" if dtype == torch.float32 else None
    # prefix kernel
    nr = ix["num_rows"]
    o_p = torch.empty((nr, h, d)), torch.empty((nr, h))
    K._prefix_kernel[(ix["num_groups"], hkv, -(-ix["max_rows"] * (h // hkv) // K.BLOCK_M))](
        q, k_cache, v_cache, o_p[0], o_p[1], ix["grp_row_start"], ix["rows"], ix["grp_blk_start"],
        ix["blks"], q.stride(0), q.stride(1), *K.cache_strides(k_cache, v_cache, "test"),
        o_p[0].stride(0), o_p[0].stride(1), o_p[1].stride(0), layer.scale,
        G=h // hkv, D=d, BLOCK_D=d, BS=bs, BLOCK_M=K.BLOCK_M, PREC=prec)
    errs = []
    at = 0
    for g in tree.groups:
        rows = torch.tensor([t for s in g.seqs for t in range(plan.query_start[s], plan.query_start[s + 1])])
        o_ref, lse_ref = prefix_attention(q, kv, rows, torch.tensor(g.blocks), layer)
        errs.append((o_p[0][at:at + len(rows)] - o_ref).abs().max().item())
        errs.append((o_p[1][at:at + len(rows)] - lse_ref).abs().max().item())
        at += len(rows)
    # suffix kernel and merge: the whole output equals the reference composition
    o_s, lse_s = torch.zeros(q.shape), torch.zeros(q.shape[:2])
    for i, n in enumerate(plan.seq_lens):
        q0, q1 = plan.query_start[i], plan.query_start[i + 1]
        if q1 > q0:
            o_s[q0:q1], lse_s[q0:q1] = suffix_attention(q[q0:q1], kv, batch.block_table[i],
                                                        tree.suffix_start[i], n, layer)
    full = o_s.clone()
    for g_i, g in enumerate(tree.groups):
        rows = torch.tensor([t for s in g.seqs for t in range(plan.query_start[s], plan.query_start[s + 1])])
        o_ref, lse_ref = prefix_attention(q, kv, rows, torch.tensor(g.blocks), layer)
        full[rows], lse_s[rows] = merge(full[rows], lse_s[rows], o_ref, lse_ref)
    errs.append((out.float() - full).abs().max().item())
    print(f"{dtype}: prefix o/lse and merged output max|err| {max(errs):.2e}")
    assert max(errs) <= TOL[dtype] * 2


def test_triton_on_random_trees_fp32():
    """More tree shapes (fp32, one head configuration): deep trees, many groups."""
    worst = 0.0
    for seed in (0, 1, 2, 4, 5, 8):
        q, kv, batch, layer = paged_case(seed, torch.float32, 4, 2, 64, 16)
        ref_m, tri_m = Hydragen(HydragenParams()), Hydragen(HydragenParams(kernel="triton"))
        ref = ref_m.forward(q, kv, batch, layer, ref_m.plan(batch))
        out = tri_m.forward(q, kv, batch, layer, tri_m.plan(batch))
        worst = max(worst, (out - ref).abs().max().item() if q.numel() else 0.0)
    print(f"6 random trees fp32: max|err| {worst:.2e}")
    assert worst <= 1e-5
