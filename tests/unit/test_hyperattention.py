"""hyperattention: the sortLSH hash, the exact paths (decode, short prompts) against dense causal
attention, the approximation made exact by a block or a sample covering every key, its error on
random, clustered and low-rank inputs shrinking as the blocks and the sample grow, causality,
chunked prefill, seeding, and bad parameters."""
from __future__ import annotations

import pytest
import torch

from vllm_graft.plugins.attention._shared import causal_attention, gather_kv, paged_attention
from vllm_graft.plugins.attention.hyperattention import HyperAttentionParams
from vllm_graft.plugins.attention.hyperattention.reference import (
    Config,
    HyperAttention,
    exact_causal,
    gray_rank,
    hyper_causal,
    hyper_unmasked,
    hyperplanes,
    merge,
    partition,
    prefill_hyper,
    sample_generator,
)

from .paged_cases import paged


def _method(**params) -> HyperAttention:
    return HyperAttention(HyperAttentionParams(**params))


def _dense(q, kv, batch, layer):
    """Dense causal attention, sequence by sequence, from the shared explicit-softmax oracle."""
    out = torch.zeros(q.shape)
    qsl = batch.query_start_loc.tolist()
    for i, n in enumerate(batch.seq_lens.tolist()):
        k, v = gather_kv(kv, batch.block_table[i, : -(-n // layer.block_size)], n, layer.head_size)
        out[qsl[i]:qsl[i + 1]] = causal_attention(q[qsl[i]:qsl[i + 1]], k, v, layer.scale)
    return out


def test_gray_rank_orders_buckets_one_bit_apart():
    for r in (1, 2, 5, 8):
        codes = torch.arange(2 ** r)
        bits = ((codes[:, None] >> torch.arange(r)) & 1).bool()
        rank = gray_rank(bits)
        assert sorted(rank.tolist()) == list(range(2 ** r))  # a bijection onto 0..2^r-1
        ordered = codes[torch.argsort(rank)]
        assert all(bin(int(a ^ b)).count("1") == 1 for a, b in zip(ordered[:-1], ordered[1:]))


def test_partition_cuts_nearly_equal_contiguous_blocks():
    for n, nb in [(10, 3), (7, 7), (5, 8), (4096, 16), (1, 1)]:
        blk, pos, width = partition(n, nb)
        sizes = torch.bincount(blk, minlength=nb)
        assert int(sizes.sum()) == n and int(sizes.max()) == width and width - int(sizes[sizes > 0].min()) <= 1
        assert bool((blk[1:] >= blk[:-1]).all()) and int(pos.min()) == 0 and int(pos.max()) < width
        assert len({(int(b), int(p)) for b, p in zip(blk, pos)}) == n  # every row its own slot


SEQS = [(300, 300), (40, 1), (600, 200), (700, 1), (19, 3)]  # a prompt, decodes, a chunk over a prefix


def test_exact_below_min_seq_len_and_for_decode():
    q, kv, batch, layer = paged(SEQS, 4, 2, 32, 16)
    dense = _dense(q, kv, batch, layer)
    m = _method()  # min_seq_len 4096: everything here is exact
    assert (m.forward(q, kv, batch, layer) - dense).abs().max() < 1e-5
    assert m.describe()["approx_rows"] == 0 and m.describe()["exact_rows"] == q.shape[0]
    # min_seq_len 256: the 300-token prompt and the chunk at 600 are approximated, decode rows
    # (even over 700 tokens) and the short chunk stay exact
    m = _method(min_seq_len=256, block_size=16, sample_size=16)
    out = m.forward(q, kv, batch, layer)
    qsl = batch.query_start_loc.tolist()
    for i in (1, 3, 4):
        assert (out[qsl[i]:qsl[i + 1]] - dense[qsl[i]:qsl[i + 1]]).abs().max() < 1e-5
    for i in (0, 2):
        assert (out[qsl[i]:qsl[i + 1]] - dense[qsl[i]:qsl[i + 1]]).abs().max() > 1e-2
    d = m.describe()
    assert d["approx_rows"] == 500 and d["chunks_with_prefix"] == 1 and d["score_fraction"] < 1
    # a step of decodes only (max_query_len 1) takes the exact path without reading the batch
    dq, dkv, dbatch, dlayer = paged([(5000, 1), (33, 1)], 4, 2, 32, 16)
    dbatch.max_query_len = 1
    assert m.plan(dbatch) is None
    assert (m.forward(dq, dkv, dbatch, dlayer) - _dense(dq, dkv, dbatch, dlayer)).abs().max() < 1e-5


@pytest.mark.parametrize("cover", ["block", "sample"])
def test_a_block_or_a_sample_covering_every_key_is_exact(cover):
    q, kv, batch, layer = paged(SEQS, 4, 2, 32, 16, seed=3)
    params = {"block_size": 1024, "sample_size": 8} if cover == "block" else {"block_size": 16, "sample_size": 1024}
    m = _method(min_seq_len=64, **params)
    out = m.forward(q, kv, batch, layer)
    assert m.describe()["approx_rows"] == 500  # the prompt and the chunk at 600 (19 < 64: exact)
    assert m.describe()["rectangles_approximated"] > 0
    assert (out - _dense(q, kv, batch, layer)).abs().max() < 1e-4
    assert (out - paged_attention(q, kv, batch, layer)).abs().max() < 1e-4


def _clustered(n, h, hkv, d, g):
    cent = torch.randn(16, d, generator=g)
    cent = 3 * cent / cent.norm(dim=1, keepdim=True)
    lab = torch.randint(16, (n,), generator=g)
    k = cent[lab] + 0.3 * torch.randn(hkv, n, d, generator=g)
    q = cent[torch.randint(16, (n,), generator=g)] + 0.3 * torch.randn(h, n, d, generator=g)
    v = torch.randn(16, d, generator=g)[lab] + 0.1 * torch.randn(hkv, n, d, generator=g)
    return q, k, v, 1.0


def _low_rank(n, h, hkv, d, g):
    w = torch.randn(4, d, generator=g)
    k = (torch.randn(n, 4, generator=g) @ w).expand(hkv, n, d) + 0.05 * torch.randn(hkv, n, d, generator=g)
    q = (torch.randn(n, 4, generator=g) @ w).expand(h, n, d) + 0.05 * torch.randn(h, n, d, generator=g)
    return q.contiguous(), k.contiguous(), torch.randn(hkv, n, d, generator=g), 0.5 * d ** -0.5


def _random(n, h, hkv, d, g):
    return (torch.randn(h, n, d, generator=g), torch.randn(hkv, n, d, generator=g),
            torch.randn(hkv, n, d, generator=g), d ** -0.5)


@pytest.mark.parametrize("inputs,bound", [(_random, 1.0), (_low_rank, 1.0), (_clustered, 0.2)])
def test_error_is_bounded_and_shrinks_as_blocks_and_sample_grow(inputs, bound):
    """Error in units of the values' RMS (the paper's bound is eps * ||D^-1 A|| * ||V||), at
    block = sample = 16, 64, 256 over 1024 tokens, averaged over 3 seeds of the sample."""
    n, h, hkv, d = 1024, 4, 2, 32
    q, k, v, scale = inputs(n, h, hkv, d, torch.Generator().manual_seed(1))
    exact, _ = exact_causal(q, k, v, scale)
    planes = hyperplanes(d, 7, 0)
    errs = []
    for size in (16, 64, 256):
        cfg = Config(min_seq_len=128, block_size=size, sample_size=size)
        e = [(hyper_causal(q, k, v, scale, planes, cfg, torch.Generator().manual_seed(s))[0] - exact).pow(2).mean()
             for s in range(3)]
        errs.append(float(torch.stack(e).mean().sqrt() / v.pow(2).mean().sqrt()))
    print(inputs.__name__, "error / rms(V) at block = sample 16, 64, 256:", [round(e, 4) for e in errs])
    assert errs[0] > errs[1] > errs[2] and errs[0] < bound


def test_clustered_inputs_are_approximated_better_than_random_ones():
    n, h, hkv, d = 1024, 4, 2, 32
    planes, cfg = hyperplanes(d, 7, 0), Config(min_seq_len=128, block_size=64, sample_size=64)
    rel = {}
    for inputs in (_random, _clustered):
        q, k, v, scale = inputs(n, h, hkv, d, torch.Generator().manual_seed(2))
        exact, _ = exact_causal(q, k, v, scale)
        o, _ = hyper_causal(q, k, v, scale, planes, cfg, torch.Generator().manual_seed(0))
        rel[inputs.__name__] = float((o - exact).norm() / exact.norm())
    assert rel["_clustered"] < 0.1 < rel["_random"]


def test_no_query_reads_a_later_key():
    """Keys and values after position t changed (even to huge values): rows up to t unchanged,
    bit for bit, through the recursion and over a chunk's prefix."""
    n, h, hkv, d = 1000, 4, 2, 32
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(n, h, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    planes, cfg = hyperplanes(d, 7, 0), Config(min_seq_len=64, block_size=32, sample_size=32)
    for nq in (n, 500):  # the whole prompt; a chunk of 500 over a 500-token prefix
        base = prefill_hyper(q[-nq:], k, v, d ** -0.5, planes, cfg, torch.Generator().manual_seed(0))
        for t in (n - nq + 10, n - 200, n - 2):
            k2, v2 = k.clone(), v.clone()
            k2[t + 1:] = 1e3 * torch.randn(n - t - 1, hkv, d, generator=g)
            v2[t + 1:] = 1e3
            out = prefill_hyper(q[-nq:], k2, v2, d ** -0.5, planes, cfg, torch.Generator().manual_seed(0))
            r = t - (n - nq) + 1  # rows 0..r-1 of the chunk are positions up to t
            assert torch.equal(out[:r], base[:r]) and not torch.equal(out[r:], base[r:])


def test_chunked_prefill_is_the_chunk_over_its_prefix_plus_the_chunk_over_itself():
    """A chunk of 200 queries at positions 400..599: the forward equals hyper_unmasked over the
    400-token prefix merged with the causal recursion over the chunk, with the sample generator
    of (seed, layer, 600, 200); its error against exact attention is bounded."""
    q, kv, batch, layer = paged([(600, 200)], 4, 2, 32, 16, seed=5, index=3)
    m = _method(min_seq_len=128, block_size=32, sample_size=32, seed=7)
    out = m.forward(q, kv, batch, layer)
    k, v = gather_kv(kv, batch.block_table[0, :38], 600, 32)
    qh, kh, vh = (t.float().transpose(0, 1).contiguous() for t in (q, k, v))
    cfg, planes = m.config(), m.planes(layer, q.device)
    gen = sample_generator(7, 3, 600, 200)
    o, lse = hyper_causal(qh, kh[:, 400:], vh[:, 400:], layer.scale, planes, cfg, gen)
    o, lse = merge(o, lse, *hyper_unmasked(qh, kh[:, :400], vh[:, :400], layer.scale, planes, cfg, gen))
    assert (out - o.transpose(0, 1)).abs().max() < 1e-5
    exact = _dense(q, kv, batch, layer)
    assert float((out - exact).pow(2).mean().sqrt() / v.pow(2).mean().sqrt()) < 0.5
    assert m.describe()["chunks_with_prefix"] == 1


def test_seeded_runs_are_reproducible():
    q, kv, batch, layer = paged([(900, 900)], 4, 2, 32, 16, seed=6)
    a = _method(min_seq_len=128, block_size=32, sample_size=32).forward(q, kv, batch, layer)
    b = _method(min_seq_len=128, block_size=32, sample_size=32).forward(q, kv, batch, layer)
    c = _method(min_seq_len=128, block_size=32, sample_size=32, seed=1).forward(q, kv, batch, layer)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_fused_exact_pieces_match_the_explicit_softmax():
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(4, 300, 32, generator=g), torch.randn(2, 300, 32, generator=g), torch.randn(2, 300, 32, generator=g)
    of, lf = exact_causal(q, k, v, 0.2, fused=True)
    oe, le = exact_causal(q, k, v, 0.2, fused=False, rows=64)
    assert (of - oe).abs().max() < 1e-5 and (lf - le).abs().max() < 1e-4
    qq, kv, batch, layer = paged([(700, 700)], 4, 2, 32, 16)
    a = _method(min_seq_len=128, block_size=32, sample_size=32).forward(qq, kv, batch, layer)
    b = _method(min_seq_len=128, block_size=32, sample_size=32, exact_kernel=False).forward(qq, kv, batch, layer)
    assert (a - b).abs().max() < 1e-4


def test_half_precision_cache_and_queries():
    q, kv, batch, layer = paged(SEQS, 4, 2, 32, 16, dtype=torch.bfloat16)
    out = _method(min_seq_len=64, block_size=1024).forward(q, kv, batch, layer)
    assert out.dtype == torch.bfloat16
    assert (out.float() - _dense(q, kv, batch, layer)).abs().max() < 2e-2


def test_bad_parameters_are_refused():
    for bad, word in [({"min_seq_len": 1}, "min_seq_len"), ({"block_size": 0}, "block_size"),
                      ({"sample_size": -1}, "sample_size"), ({"lsh_bits": 0}, "lsh_bits"),
                      ({"lsh_bits": 31}, "lsh_bits"), ({"budget": 0.5}, "budget")]:
        with pytest.raises(ValueError, match=word):
            HyperAttentionParams(**bad)
