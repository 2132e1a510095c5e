"""Per-KV-head scored attention (the ``adakv`` compressor's ``attend``): each KV head reads only
the blocks its head mask allows and the mass comes back per KV head. The reference (the shared
exact attention, batched and per-sequence paths) against an explicit per-head loop, and the
Triton decode kernel against the reference under TRITON_INTERPRET=1 (fp32 and fp16), or compiled
on ``GRAFT_REAL_DEVICE`` (see tests/kernels/__init__.py)."""
from tests.kernels import device

DEVICE = device()  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.kernels.test_h2o_kernel import paged_case  # noqa: E402

pytestmark = pytest.mark.kernel


def random_head_mask(batch, layer, seed=3):
    """[S, H_kv, width]: each head drops some blocks, never one holding the step's queries
    (as the adapter: a head drops only blocks full before the step, never the last one)."""
    g = torch.Generator().manual_seed(seed)
    S, width = batch.block_table.shape
    mask = torch.rand(S, layer.num_kv_heads, width, generator=g) > 0.4
    qlen = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    for i, L in enumerate(batch.seq_lens.tolist()):
        mask[i, :, max(0, (L - qlen[i]) // layer.block_size):] = True
    return mask


def explicit(query, kv, batch, layer, observe, mask):
    """Per sequence, query head and query: softmax over the causal keys of the blocks its KV
    head reads; mass per KV head and block."""
    from vllm_graft.hooks import split_kv_cache

    k_cache, v_cache = split_kv_cache(kv)
    B, H, hkv = layer.block_size, layer.num_heads, layer.num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    mass = torch.zeros(batch.block_table.shape[0], hkv, batch.block_table.shape[1])
    qsl = batch.query_start_loc.tolist()
    for i, L in enumerate(batch.seq_lens.tolist()):
        nb = -(-L // B)
        ids = batch.block_table[i, :nb].long()
        for h in range(H):
            kvh = h // (H // hkv)
            k = torch.cat([k_cache[b, kvh] for b in ids])[:L].float()
            v = torch.cat([v_cache[b, kvh] for b in ids])[:L].float()
            reads = mask[i, kvh, :nb].repeat_interleave(B)[:L]
            for t in range(qsl[i], qsl[i + 1]):
                pos = L - (qsl[i + 1] - t)
                ok = reads & (torch.arange(L) <= pos)
                s = (k @ query[t, h].float()) * layer.scale
                p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
                out[t, h] = p @ v
                if observe[t]:
                    mass[i, kvh, :nb] += torch.nn.functional.pad(p, (0, nb * B - L)).view(nb, B).sum(-1)
    return out, mass


@pytest.mark.parametrize("batched", [True, False])
def test_reference_masks_each_kv_head_and_reports_its_mass(batched, monkeypatch):
    from vllm_graft.plugins.attention import _shared
    from vllm_graft.plugins.attention._shared import paged_attention_with_mass

    if not batched:  # the per-sequence path (long prefill chunks)
        monkeypatch.setattr(_shared, "BATCHED_SCORES_MAX", 0)
    query, kv, batch, layer, observe = paged_case(torch.float32, [1, 16, 37, 70, 20], [1, 1, 3, 1, 5])
    mask = random_head_mask(batch, layer)
    assert not bool(mask.all())
    out, mass = paged_attention_with_mass(query, kv, batch, layer, observe, head_mask=mask)
    want_out, want_mass = explicit(query, kv, batch, layer, observe, mask)
    assert mass.shape == (5, layer.num_kv_heads, batch.block_table.shape[1])
    assert (out.float() - want_out).abs().max() < 1e-5
    assert (mass - want_mass).abs().max() < 1e-5
    assert bool((mass[~mask] == 0).all())  # a head puts no mass on a block it does not read
    # an all-True mask is plain attention: the same output, and the per-head mass sums to the
    # mass summed over heads
    full = torch.ones_like(mask)
    out_f, mass_f = paged_attention_with_mass(query, kv, batch, layer, observe, head_mask=full)
    plain_out, plain_mass = paged_attention_with_mass(query, kv, batch, layer, observe)
    assert (out_f - plain_out).abs().max() < 1e-5 and (mass_f.sum(1) - plain_mass).abs().max() < 1e-4
    assert (out - plain_out).abs().max() > 1e-2  # the mask changed the attention


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("splits", [None, 3], ids=["sms", "3-splits"])
def test_masked_decode_kernel_matches_the_reference(dtype, tol, splits, monkeypatch):
    from vllm_graft.plugins.attention._shared import paged_attention_with_mass
    from vllm_graft.plugins.kvcompress._shared import kernel
    from vllm_graft.plugins.kvcompress._shared.kernel import attention_with_mass

    if splits:  # the context split in parts (a split whose pages a head masks wholly included)
        monkeypatch.setattr(kernel, "_split_count", lambda *a: splits)

    query, kv, batch, layer, observe = paged_case(dtype, [1, 16, 37, 70, 20, 90], [1, 1, 1, 1, 5, 1],
                                                  device=DEVICE)
    mask = random_head_mask(batch, layer, seed=5).to(DEVICE)
    mask[3, 0, 0] = False  # a head whose first block is masked (the online softmax starts masked)
    out_k, mass_k = attention_with_mass(query, kv, batch, layer, observe, head_mask=mask)
    out_r, mass_r = paged_attention_with_mass(query, kv, batch, layer, observe, head_mask=mask)
    err_out = (out_k.float() - out_r.float()).abs().max().item()
    err_mass = (mass_k - mass_r).abs().max().item()
    print(f"{dtype}: max |out diff| {err_out:.2e}, max |mass diff| {err_mass:.2e}")
    assert mass_k.shape == mass_r.shape == (6, layer.num_kv_heads, batch.block_table.shape[1])
    assert err_out < tol and err_mass < tol
    assert not torch.isnan(out_k.float()).any()
    # each observed decode query of a KV head's group spreads group-size units over its blocks
    group = layer.num_heads // layer.num_kv_heads
    qlen = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    for i, q0 in enumerate(batch.query_start_loc[:-1].tolist()):
        if qlen[i] == 1:
            assert torch.allclose(mass_k[i].sum(-1), torch.full((layer.num_kv_heads,), group * float(observe[q0]), device=DEVICE),
                                  atol=1e-3)
            assert bool((mass_k[i][~mask[i]] == 0).all())
