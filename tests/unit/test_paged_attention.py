"""The shared exact paged attention (plugins/attention/_shared.py): its batched path (one masked
attention over the whole batch, no loop over sequences) against the per-sequence loop, for
decode, chunked-prefill and empty rows, GQA, fp32 and fp16, with and without the block mass,
through the cache and through a storage format's gather."""
from __future__ import annotations

import random

import pytest
import torch

import vllm_graft.plugins.attention._shared as shared
from vllm_graft.hooks import AttentionLayer, PagedBatch, split_kv_cache


def case(seed, dtype, S=6, H=8, Hkv=2, D=64, B=16):
    g, r = torch.Generator().manual_seed(seed), random.Random(seed)
    lens = [r.choice([0, 1, 15, 16, 17, 130, 300]) for _ in range(S)]
    q_lens = [min(L, r.choice([0, 1, 1, 1, 5, 37])) for L in lens]
    width = max(-(-L // B) for L in lens) + 2
    N = S * width + 3
    table = torch.randperm(N, generator=g)[: S * width].view(S, width).int()
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    batch = PagedBatch(torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), table)
    kv = torch.randn(N, Hkv, B, 2 * D, generator=g).to(dtype)
    q = torch.randn(qsl[-1], H, D, generator=g).to(dtype)
    observe = torch.rand(qsl[-1], generator=g) > 0.3
    return q, kv, batch, AttentionLayer(H, Hkv, D, D ** -0.5, B), observe


def _both(monkeypatch, fn):
    monkeypatch.setattr(shared, "BATCHED_SCORES_MAX", 0)  # every step goes sequence by sequence
    loop = fn()
    monkeypatch.setattr(shared, "BATCHED_SCORES_MAX", 1 << 24)
    return loop, fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("seed", range(8))
def test_batched_equals_the_per_sequence_loop(monkeypatch, seed, dtype):
    q, kv, batch, layer, observe = case(seed, dtype, Hkv=[1, 2, 4, 8][seed % 4])
    assert shared._paged_batched(q, kv, batch, layer, None, None) is not None  # the batched path runs
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    (lo, lm), (bo, bm) = _both(monkeypatch, lambda: shared.paged_attention_with_mass(q, kv, batch, layer, observe))
    lp, bp = _both(monkeypatch, lambda: shared.paged_attention(q, kv, batch, layer))
    assert bo.dtype == q.dtype and bo.shape == q.shape
    if q.numel():
        assert (bo.float() - lo.float()).abs().max() <= tol and (bp.float() - lp.float()).abs().max() <= tol
    assert (bm - lm).abs().max() <= 1e-4 * max(1.0, float(lm.abs().max()))


def test_batched_through_a_storage_formats_gather(monkeypatch):
    q, kv, batch, layer, _ = case(3, torch.float32)
    k_cache, v_cache = split_kv_cache(kv)
    calls = []

    def gather(ids):  # what a storage format passes: its blocks, dequantised
        calls.append(ids.numel())
        return k_cache[ids] * 0.5, v_cache[ids]

    loop, batched = _both(monkeypatch, lambda: shared.paged_attention(q, kv, batch, layer, gather))
    assert (batched - loop).abs().max() <= 1e-5 and len(calls) > 1


def test_a_step_too_large_for_one_batch_goes_sequence_by_sequence(monkeypatch):
    q, kv, batch, layer, _ = case(5, torch.float32)
    monkeypatch.setattr(shared, "BATCHED_SCORES_MAX", 10)
    assert shared._paged_batched(q, kv, batch, layer, None, None) is None
    out = shared.paged_attention(q, kv, batch, layer)
    monkeypatch.setattr(shared, "BATCHED_SCORES_MAX", 1 << 24)
    assert (out - shared.paged_attention(q, kv, batch, layer)).abs().max() <= 1e-5


def test_the_step_index_is_built_once_per_step_and_again_when_the_batch_changes():
    q, kv, batch, layer, _ = case(2, torch.float32)
    first = shared._step_index(batch, 16, q.shape[0])
    assert shared._step_index(batch, 16, q.shape[0]) is first  # the next layer of the step
    before = shared.paged_attention(q, kv, batch, layer)
    batch.block_table = batch.block_table.clone()  # a new tensor object, same version and values
    second = shared._step_index(batch, 16, q.shape[0])
    assert second is not first
    batch.seq_lens[batch.seq_lens > 0] -= 1  # changed in place: indexed again, attends less
    assert shared._step_index(batch, 16, q.shape[0]) is not second
    after = shared.paged_attention(q, kv, batch, layer)
    other = case(2, torch.float32)[2]  # an equal batch that is another object
    assert shared._step_index(other, 16, q.shape[0]) is not shared._step_index(batch, 16, q.shape[0])
    assert not torch.equal(before, after)


def test_under_inference_mode_as_in_vllms_forward():
    with torch.inference_mode():
        q, kv, batch, layer, observe = case(4, torch.float32)
        index = shared._step_index(batch, 16, q.shape[0])
        assert shared._step_index(batch, 16, q.shape[0]) is index
        out, mass = shared.paged_attention_with_mass(q, kv, batch, layer, observe)
    assert out.shape == q.shape and mass.shape[0] == batch.seq_lens.numel()


def _explicit(q, kv, batch, layer, observe):
    """Every sequence with explicit probabilities over all its queries (the definition)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    mass = torch.zeros(batch.seq_lens.numel(), batch.block_table.shape[1])
    qsl = batch.query_start_loc.tolist()
    for i, L in enumerate(batch.seq_lens.tolist()):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 <= q0 or L <= 0:
            continue
        k, v = shared.gather_kv(kv, batch.block_table[i], L, layer.head_size)
        p = shared.causal_probs(q[q0:q1], k, layer.scale)
        out[q0:q1] = shared.attend_probs(p, v)
        per_key = torch.einsum("hqk,q->k", p, observe[q0:q1].float())
        nb = -(-L // layer.block_size)
        mass[i, :nb] = torch.nn.functional.pad(per_key, (0, nb * layer.block_size - L)).view(nb, -1).sum(-1)
    return out, mass


@pytest.mark.parametrize("seed", range(6))
def test_the_loop_attends_fused_and_scores_only_the_observed_queries(monkeypatch, seed):
    """The per-sequence path (long chunks) takes its output from fused attention and the mass
    from explicit probabilities of the observed queries alone; both equal the definition.
    A step with nothing observed gets zero mass on the batched path too."""
    q, kv, batch, layer, observe = case(seed, torch.float32, Hkv=[1, 2, 4][seed % 3])
    want_out, want_mass = _explicit(q, kv, batch, layer, observe)
    monkeypatch.setattr(shared, "BATCHED_SCORES_MAX", 0)
    out, mass = shared.paged_attention_with_mass(q, kv, batch, layer, observe)
    assert (out - want_out).abs().max() <= 1e-5
    assert (mass - want_mass).abs().max() <= 1e-4 * max(1.0, float(want_mass.abs().max()))
    monkeypatch.setattr(shared, "BATCHED_SCORES_MAX", 1 << 24)
    none = torch.zeros_like(observe)
    out, mass = shared.paged_attention_with_mass(q, kv, batch, layer, none)
    assert (out - want_out).abs().max() <= 1e-5 and not mass.any()
