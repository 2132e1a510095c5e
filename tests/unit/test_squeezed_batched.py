"""squeezed's batched CPU path (cpu_path: batched: mode centroid, no head map, refresh 1) against
the per-sequence oracle: the same outputs, the same KV-read statistics; its centroid cache
computes each full chunk once and again when the chunk's block is written by another request."""
from __future__ import annotations

import pytest
import torch

from vllm_graft.hooks import AttentionLayer, PagedBatch
from vllm_graft.plugins.attention.squeezed import SqueezedParams
from vllm_graft.plugins.attention.squeezed.reference import Squeezed


def step(seqs, h=4, hkv=2, d=32, bs=32, dtype=torch.float32, seed=0, kv=None, table=None):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n, _ in seqs]
    if table is None:
        nb = sum(need) + 3
        perm = torch.randperm(nb, generator=g).tolist()
        table = torch.full((len(seqs), max(need) + 1), perm[-1], dtype=torch.int32)
        at = 0
        for i, k in enumerate(need):
            table[i, :k] = torch.tensor(perm[at:at + k])
            at += k
    if kv is None:
        kv = torch.randn(int(table.max()) + 2, hkv, bs, 2 * d, generator=g).to(dtype)
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    batch = PagedBatch(torch.tensor(qsl, dtype=torch.int32), torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                       table)
    q = torch.randn(qsl[-1], h, d, generator=g).to(dtype)
    return q, kv, batch, AttentionLayer(h, hkv, d, d ** -0.5, bs, index=0)


def both(params, *args):
    fast = Squeezed(SqueezedParams(**params))
    slow = Squeezed(SqueezedParams(**params, cpu_path="per-sequence"))
    return fast, fast.forward(*args), slow, slow.forward(*args)


# decode rows of many lengths (budget full and not; partial last chunks), a chunked prefill, an
# empty row
SEQS = [(300, 1), (37, 1), (19, 3), (130, 1), (500, 1), (0, 0), (64, 1), (1000, 1), (45, 45)]


@pytest.mark.parametrize("budget_", [0.125, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_batched_equals_the_per_sequence_path(budget_, hkv):
    args = step(SEQS, hkv=hkv, seed=hkv)
    params = {"budget": budget_, "chunk": 8, "sink_tokens": 8, "recent_tokens": 24}
    fast, a, slow, b = both(params, *args)
    assert (a - b).abs().max() <= 1e-5
    assert fast.describe() == slow.describe()  # the same tokens attended, the same centroids read


def test_fp16_cache():
    args = step(SEQS, dtype=torch.float16, seed=3)
    _, a, _, b = both({"budget": 0.25, "chunk": 16}, *args)
    assert a.dtype == torch.float16 and (a.float() - b.float()).abs().max() <= 2e-3


def test_centroids_are_kept_between_steps_and_made_again_for_a_rewritten_block():
    m = Squeezed(SqueezedParams(budget=0.25, chunk=8, sink_tokens=8, recent_tokens=16))
    q, kv, batch, layer = step([(400, 1), (300, 1)], seed=7)
    m.forward(q, kv, batch, layer)
    cache = m._centroids[0]
    first = cache.computed
    assert first > 0
    m.forward(q, kv, batch, layer)  # the next layer call over the same cache: nothing new
    assert cache.computed == first
    # another request's keys written into the first block of sequence 0: its chunks are stale
    block = int(batch.block_table[0, 0])
    kv[block] = torch.randn_like(kv[block])
    slow = Squeezed(SqueezedParams(budget=0.25, chunk=8, sink_tokens=8, recent_tokens=16, cpu_path="per-sequence"))
    out = m.forward(q, kv, batch, layer)
    assert cache.computed == first + 3  # that block's chunks 1-3 (block 32 / chunk 8; chunk 0 is the sink, forced, never scored)
    assert (out - slow.forward(q, kv, batch, layer)).abs().max() <= 1e-5


def test_other_modes_and_head_maps_stay_per_sequence(monkeypatch):
    import vllm_graft.plugins.attention.squeezed.reference as R

    called = []
    monkeypatch.setattr(R, "squeezed_attention_batched", lambda *a: called.append(1))
    q, kv, batch, layer = step([(200, 1)])
    for params in ({"mode": "window"}, {"mode": "recycled"}, {"refresh": 4}, {"prefill": "sparse"},
                   {"cpu_path": "per-sequence"}):
        Squeezed(SqueezedParams(**params)).forward(q, kv, batch, layer)
    assert not called
    Squeezed(SqueezedParams()).forward(q, kv, batch, layer)
    assert called == [1]
