"""squeezed: budgets, chunk choice, the reference against exact attention, bad parameters; and
(kernel) its Triton scoring and sparse decode against the reference under TRITON_INTERPRET=1."""
from __future__ import annotations

import json
import os

if not os.environ.get("GRAFT_REAL_DEVICE"):  # tests/kernels/test_layouts.py imports this on the GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.hooks import AttentionLayer, PagedBatch, split_kv_cache  # noqa: E402
from vllm_graft.plugins.attention._shared import gather_kv, paged_attention  # noqa: E402
from vllm_graft.plugins.attention.squeezed import SqueezedParams  # noqa: E402
from vllm_graft.plugins.attention.squeezed.policy import HEAD_MAP_FORMAT, budget, window_chunks  # noqa: E402
from vllm_graft.plugins.attention.squeezed.reference import (  # noqa: E402
    Squeezed,
    chosen_chunks,
    chunk_scores,
)

from .paged_cases import paged  # noqa: E402  (tests/kernels/test_layouts.py imports it from here)


def test_budget_rounds_to_chunks_and_forces_sinks_and_window():
    b = budget(1000, 16, 0.25, 16, 64)  # 63 chunks, 250 tokens -> 16 chunks
    assert b.num_chunks == 63 and b.sink == (0,) and b.recent == tuple(range(58, 63))
    assert len(b.sink) + len(b.recent) + b.extra == 16 and not b.full
    assert window_chunks(b) == [0] + list(range(48, 63))
    assert budget(40, 16, 0.25, 16, 64).full  # the forced chunks are the whole context
    assert budget(1, 16, 0.1, 0, 1) == budget(1, 16, 0.1, 0, 1) and budget(1, 16, 0.1, 0, 1).full
    with pytest.raises(ValueError):
        budget(0, 16, 0.5, 0, 1)


def test_centroid_choice_picks_the_matching_chunk():
    d, n, chunk = 8, 160, 16
    k = torch.randn(n, 1, d) * 0.1
    k[70:80, 0] += torch.ones(d)  # chunk 4 is aligned with the query
    q = torch.ones(2, d)
    s = chunk_scores(q, k, chunk, 1.0)
    assert s.shape == (1, 10) and int(s[0].argmax()) == 4
    b = budget(n, chunk, 0.2, 16, 16)  # 2 chunks: the sink, the last; plus 0 extra
    b3 = budget(n, chunk, 0.3, 16, 16)
    sel = chosen_chunks(s, b3, "centroid", 1)
    assert sel[0].nonzero().flatten().tolist() == [0, 4, 9]
    assert chosen_chunks(s, b3, "window", 1)[0].nonzero().flatten().tolist() == [0, 8, 9]
    assert chosen_chunks(s, b, "centroid", 1)[0].nonzero().flatten().tolist() == [0, 9]
    assert chosen_chunks(None, b, "streaming-heads", 2, [True, False]).sum(1).tolist() == [10, 2]


SEQS = [(200, 1), (37, 1), (19, 3), (130, 1), (300, 1)]


def test_reference_is_exact_at_full_budget_and_masks_otherwise():
    q, kv, batch, layer = paged(SEQS, 4, 2, 64, 16, torch.float32)
    exact = paged_attention(q, kv, batch, layer)
    full = Squeezed(SqueezedParams(budget=1.0)).forward(q, kv, batch, layer)
    assert (full - exact).abs().max() < 1e-5
    m = Squeezed(SqueezedParams(budget=0.25, sink_tokens=16, recent_tokens=16))
    out = m.forward(q, kv, batch, layer)
    assert (out[2:5] - exact[2:5]).abs().max() < 1e-5  # the 3-token chunked prefill: full attention
    assert (out[0] - exact[0]).abs().max() > 1e-3  # a decode token over 200 tokens: sparse
    # the sparse output is attention over exactly the chosen chunks
    k, v = gather_kv(kv, batch.block_table[0, :13], 200, 64)
    sel = chosen_chunks(chunk_scores(q[0], k, 16, layer.scale), m.budget(200), "centroid", 2)
    mask = sel.repeat_interleave(16, dim=1)[:, :200]
    s = torch.einsum("hgd,nhd->hgn", q[0].view(2, 2, 64), k) * layer.scale
    s = s.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    assert (out[0] - torch.einsum("hgn,nhd->hgd", s, v).reshape(4, 64)).abs().max() < 1e-5
    d = m.describe()
    assert d["decode_token_layers"] == 4 and 0 < d["kv_read_fraction"] < 0.6


def test_bad_parameters_are_refused(tmp_path):
    for bad, word in [({"budget": 0}, "budget"), ({"budget": 1.5}, "budget"), ({"chunk": 24}, "power of two"),
                      ({"mode": "streaming-heads"}, "head_map"), ({"mode": "window", "head_map": "x.json"}, "not in mode window"),
                      ({"head_map": str(tmp_path / "none.json")}, "does not exist"),
                      ({"mode": "streaming-heads", "head_map": str(tmp_path / "none.json")}, "does not exist"),
                      ({"mode": "sparse"}, "mode"), ({"kernel": "cuda"}, "kernel")]:
        with pytest.raises(ValueError, match=word):
            SqueezedParams(**bad)
    q, kv, batch, layer = paged(SEQS, 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="must divide the KV block size"):
        Squeezed(SqueezedParams(chunk=32)).forward(q, kv, batch, layer)


def test_streaming_heads_mode_reads_its_head_map(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"format": HEAD_MAP_FORMAT, "retrieval": [[True, False], [False, False]]}))
    q, kv, batch, layer = paged(SEQS, 4, 2, 64, 16, torch.float32)
    m = Squeezed(SqueezedParams(mode="streaming-heads", head_map=str(path), sink_tokens=16, recent_tokens=16))
    exact = paged_attention(q, kv, batch, layer)
    out = m.forward(q, kv, batch, AttentionLayer(4, 2, 64, layer.scale, 16, index=0))
    assert (out[0, :2] - exact[0, :2]).abs().max() < 1e-5  # KV head 0 of layer 0: retrieval, full
    assert (out[0, 2:] - exact[0, 2:]).abs().max() > 1e-3  # KV head 1: sinks + window only
    with pytest.raises(ValueError, match="calibrate razor"):
        m.forward(q, kv, batch, AttentionLayer(4, 2, 64, layer.scale, 16, index=5))
    # under tensor parallelism a rank (here one of two, each with one KV head) reads its heads' entries
    ranks = [AttentionLayer(2, 1, 64, layer.scale, 16, index=0, tp_rank=r, tp_size=2) for r in (0, 1)]
    assert [m.retrieval(r) for r in ranks] == [[True], [False]]
    with pytest.raises(ValueError, match="layer 0 has 4 KV heads"):  # 2 heads a rank of 2: the map has 2
        m.retrieval(AttentionLayer(4, 2, 64, layer.scale, 16, index=0, tp_rank=0, tp_size=2))
    # a relative head map resolves as `model` does: relative to the deployment file's folder
    ctx = {"base_dir": str(tmp_path)}
    rel = SqueezedParams.model_validate({"mode": "streaming-heads", "head_map": "heads.json"}, context=ctx)
    assert rel.head_map == str(path.resolve())
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a"):
        Squeezed(SqueezedParams(mode="streaming-heads", head_map=str(path)))


@pytest.mark.parametrize("mode,refresh", [("centroid", 1), ("centroid", 4), ("recycled", 4)])
def test_head_map_in_a_selection_mode_splits_the_heads(mode, refresh, tmp_path):
    """With a head map, modes centroid and recycled choose chunks for the retrieval heads only:
    those heads get what the mode gives without a map, the others what mode window gives."""
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"format": HEAD_MAP_FORMAT, "retrieval": [[True, False]]}))
    q, kv, batch, layer = paged(SEQS, 4, 2, 64, 16, torch.float32, seed=7)
    layer = AttentionLayer(4, 2, 64, layer.scale, 16, index=0)
    kw = dict(budget=0.25, sink_tokens=16, recent_tokens=16, refresh=refresh)
    run = lambda **extra: Squeezed(SqueezedParams(**{**kw, **extra})).forward(q, kv, batch, layer)  # noqa: E731
    split = Squeezed(SqueezedParams(mode=mode, head_map=str(path), **kw))
    out = split.forward(q, kv, batch, layer)
    alone, window = run(mode=mode), run(mode="window")
    decode = [0, 1, 5, 6]  # the decode rows of SEQS (rows 2-4: a chunked prefill, full attention)
    assert (out[decode, :2] - alone[decode, :2]).abs().max() < 1e-5  # KV head 0: retrieval, chooses
    assert (out[decode, 2:] - window[decode, 2:]).abs().max() < 1e-5  # KV head 1: the window baseline
    assert (alone[decode, 2:] - window[decode, 2:]).abs().max() > 1e-3  # (the two differ there)
    if mode == "centroid":  # centroids are read for the scoring head only
        d_alone = Squeezed(SqueezedParams(mode=mode, **kw))
        d_alone.forward(q, kv, batch, layer)
        assert split.describe()["kv_token_heads_read"] < d_alone.describe()["kv_token_heads_read"]


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
# Each shape takes 6-9 s in Triton's CPU interpreter: CI runs two (GQA 2:1 at D64, MHA at D128,
# two block sizes), the long form (GRAFT_FULL=1) all five.
@pytest.mark.parametrize("shape", [(4, 2, 64, 16, 16), (4, 4, 128, 32, 16),
                                   *(pytest.param(s, marks=pytest.mark.full)
                                     for s in [(8, 2, 64, 32, 32), (6, 2, 128, 16, 16), (4, 2, 64, 32, 8)])],
                         ids=lambda s: "H{}-Hkv{}-D{}-B{}-chunk{}".format(*s))
def test_triton_matches_reference(shape, dtype, tmp_path):
    from vllm_graft.plugins.attention.squeezed.kernel import chunk_scores_triton

    h, hkv, d, bs, chunk = shape
    q, kv, batch, layer = paged(SEQS, h, hkv, d, bs, dtype, seed=sum(shape))
    layer = AttentionLayer(h, hkv, d, layer.scale, bs, index=0)
    heads = tmp_path / "heads.json"  # the first KV head retrieves, the others keep the window
    heads.write_text(json.dumps({"format": HEAD_MAP_FORMAT, "retrieval": [[True] + [False] * (hkv - 1)]}))
    worst = {}
    for mode in ("centroid", "window", "recycled", "centroid+heads", "recycled+heads"):
        kw = dict(mode=mode.removesuffix("+heads"), budget=0.25, chunk=chunk, sink_tokens=16, recent_tokens=16,
                  **({"head_map": str(heads)} if mode.endswith("+heads") else {}))
        ref_m = Squeezed(SqueezedParams(**kw))
        ref = ref_m.forward(q, kv, batch, layer)
        tri_m = Squeezed(SqueezedParams(kernel="triton", **kw))
        out = tri_m.forward(q, kv, batch, layer)
        assert out.dtype == q.dtype and out.shape == q.shape
        # the traffic counted (the batched and kernel paths from the budgets alone) is the
        # per-sequence path's, which sums the masks it attends with
        seq_m = Squeezed(SqueezedParams(cpu_path="per-sequence", **kw))
        seq_m.forward(q, kv, batch, layer)
        assert tri_m.describe() == ref_m.describe() == seq_m.describe(), mode
        worst[mode] = (out.float() - ref.float()).abs().max().item()
    # the scoring kernel on its own
    rows, seqs, lens = [0, 1, 5], [0, 1, 3], [200, 37, 130]
    s_tri = chunk_scores_triton(q, kv, batch, layer, chunk, rows, seqs, lens)
    s_err = 0.0
    for r, (tok, i, n) in enumerate(zip(rows, seqs, lens)):
        k, _ = gather_kv(kv, batch.block_table[i, : -(-n // bs)], n, d)
        s_ref = chunk_scores(q[tok], k, chunk, layer.scale)
        s_err = max(s_err, (s_tri[r, :, :s_ref.shape[1]] - s_ref).abs().max().item())
    print(f"{shape} {dtype}: max|err| " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
          + f", scores {s_err:.2e}")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert max(worst.values()) <= tol and s_err <= tol * 10


@pytest.mark.parametrize("mode,refresh", [("centroid", 1), ("window", 1), ("streaming-heads", 1),
                                          ("centroid", 8), ("recycled", 8), ("recycled", 3),
                                          ("centroid+heads", 1), ("centroid+heads", 8), ("recycled+heads", 8)])
def test_sparse_prefill_equals_decoding_token_by_token(mode, refresh, tmp_path):
    """prefill: sparse gives each prompt row what a decode step at its position computes."""
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"format": HEAD_MAP_FORMAT, "retrieval": [[False, True]]}))
    extra = {"head_map": str(path)} if mode in ("streaming-heads", "centroid+heads", "recycled+heads") else {}
    kw = dict(mode=mode.removesuffix("+heads"), budget=0.2, chunk=16, sink_tokens=16, recent_tokens=20, refresh=refresh, **extra)
    n, nq, bs = 150, 90, 16
    q, kv, batch, layer = paged([(n, nq)], 4, 2, 64, bs, torch.float32, seed=3)
    layer = AttentionLayer(4, 2, 64, layer.scale, bs, index=0)
    m = Squeezed(SqueezedParams(prefill="sparse", **kw))
    out = m.forward(q, kv, batch, layer)
    dec = Squeezed(SqueezedParams(**kw))
    worst = 0.0
    for r in range(nq):
        pos = n - nq + r
        one = PagedBatch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([pos + 1], dtype=torch.int32),
                         batch.block_table)
        worst = max(worst, (dec.forward(q[r:r + 1], kv, one, layer)[0] - out[r]).abs().max().item())
    assert worst < 1e-5
    assert m.describe()["kv_token_heads_read"] == dec.describe()["kv_token_heads_read"]
    if refresh > 1:  # decoding reused the choice made at each multiple of `refresh` in between
        first = n - nq  # positions before the first multiple decoded here have no choice stored
        assert dec.describe()["selections_reused"] == sum(
            1 for pos in range(first, n) if pos % refresh and pos - pos % refresh >= first)
    full = Squeezed(SqueezedParams(prefill="full", **kw)).forward(q, kv, batch, layer)
    assert (full - paged_attention(q, kv, batch, layer)).abs().max() < 1e-5


def test_refresh_reuses_a_selection_only_for_its_own_sequence():
    """A block freed and reused by another sequence does not hand over the old selection: the
    key vector at the refresh position must match."""
    q, kv, batch, layer = paged([(200, 1)], 4, 2, 64, 16, torch.float32, seed=5)
    layer = AttentionLayer(4, 2, 64, layer.scale, 16, index=0)
    m = Squeezed(SqueezedParams(budget=0.2, refresh=8, sink_tokens=16, recent_tokens=16))
    one = lambda n: PagedBatch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),  # noqa: E731
                               batch.block_table)
    m.forward(q, kv, one(193), layer)  # position 192: a refresh, stored
    m.forward(q, kv, one(195), layer)
    assert m.reused == 1
    kv2 = kv.clone()
    kv2[int(batch.block_table[0, 12])] += 1.0  # the block holding position 192 now holds other keys
    m.forward(q, kv2, one(196), layer)
    assert m.reused == 1  # not reused: chosen afresh
    with pytest.raises(ValueError, match="refresh"):
        SqueezedParams(refresh=0)


def test_recycled_attends_to_the_chunks_its_full_step_attended_most():
    """Mode recycled: a full attention step at each refresh position (its output is exact) picks
    the chunks with the most attention mass; the steps in between attend to those chunks plus
    the forced ones, and read far less than plain attention. A distant chunk whose keys match
    the queries is kept, where the sink + window baseline drops it."""
    from vllm_graft.plugins.attention.squeezed.reference import chunk_mass

    n, bs, chunk = 256, 16, 16
    q, kv, batch, layer = paged([(n, 1)], 4, 2, 64, bs, torch.float32, seed=11)
    layer = AttentionLayer(4, 2, 64, layer.scale, bs, index=0)
    k_cache, _ = split_kv_cache(kv)
    planted = 5  # chunk 5 = tokens 80..95: keys along the query's direction
    for t in range(planted * chunk, (planted + 1) * chunk):
        blk = int(batch.block_table[0, t // bs])
        k_cache[blk, :, t % bs] = 4.0 * q[0].view(2, 2, 64).mean(1)
    k, _ = gather_kv(kv, batch.block_table[0, : n // bs], n, 64)
    mass = chunk_mass(q[0], k, chunk, layer.scale)
    assert mass.shape == (2, n // chunk)
    assert torch.allclose(mass.sum(1), torch.full((2,), 2.0), atol=1e-5)  # 2 query heads per KV head
    assert int(mass[:, 1:-4].argmax(1)[0]) + 1 == planted
    kw = dict(budget=0.25, chunk=chunk, sink_tokens=16, recent_tokens=16)  # 1 chunk chosen
    one = lambda m: PagedBatch(torch.tensor([0, 1], dtype=torch.int32),  # noqa: E731
                               torch.tensor([m], dtype=torch.int32), batch.block_table)
    rec = Squeezed(SqueezedParams(mode="recycled", refresh=4, **kw))
    assert rec.params.refresh == 4
    full = rec.forward(q, kv, one(n - 3), layer)  # position 252: a refresh, the full step
    assert (full - paged_attention(q, kv, one(n - 3), layer)).abs().max() < 1e-5
    stored = next(iter(rec.selections.values()))[1]
    assert bool(stored[:, planted].all())
    rec.forward(q, kv, one(n - 2), layer)  # position 253: reuses the choice
    assert rec.reused == 1
    d = rec.describe()
    assert d["kv_token_heads_read"] < d["kv_token_heads_plain"] * (1 + 0.25 + 0.1) / 2
    win = Squeezed(SqueezedParams(mode="window", **kw))
    assert planted not in window_chunks(win.budget(n - 2))


def test_recycled_refresh_default_and_refusal():
    assert SqueezedParams(mode="recycled").refresh == 16
    assert SqueezedParams(mode="centroid").refresh == 1
    with pytest.raises(ValueError, match="refresh >= 2"):
        SqueezedParams(mode="recycled", refresh=1)
