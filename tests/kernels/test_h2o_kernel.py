"""The Triton decode-attention kernel that emits per-block attention mass (h2o / snapkv)
against the reference, under TRITON_INTERPRET=1 (small shapes; fp32 and fp16), or compiled on
``GRAFT_REAL_DEVICE`` (see tests/kernels/__init__.py)."""
from tests.kernels import device

DEVICE = device()  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.hooks import AttentionLayer, PagedBatch  # noqa: E402

pytestmark = pytest.mark.kernel


def paged_case(dtype, seq_lens, q_lens, H=4, Hkv=2, D=32, B=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-L // B) for L in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 3
    kv_cache = torch.randn(num_blocks, Hkv, B, 2 * D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g)[: len(seq_lens) * width] + 1  # scattered ids, never 0
    table = perm.view(len(seq_lens), width).to(torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), H, D, generator=g).to(dtype)
    batch = PagedBatch(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)
    layer = AttentionLayer(num_heads=H, num_kv_heads=Hkv, head_size=D, scale=D ** -0.5, block_size=B)
    observe = torch.rand(query.shape[0], generator=g) > 0.3
    if device != "cpu":
        batch = PagedBatch(*(t.to(device) for t in (qsl, batch.seq_lens, table)))
        query, kv_cache, observe = query.to(device), kv_cache.to(device), observe.to(device)
    return query, kv_cache, batch, layer, observe


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_decode_kernel_matches_the_reference(dtype, tol):
    from vllm_graft.plugins.attention._shared import paged_attention_with_mass
    from vllm_graft.plugins.kvcompress._shared.kernel import attention_with_mass

    # decode rows (one query each) of several lengths, a partial last block included,
    # plus a prefill row (which the launcher sends to the reference)
    query, kv, batch, layer, observe = paged_case(dtype, [1, 16, 37, 70, 20], [1, 1, 1, 1, 5], device=DEVICE)
    out_k, mass_k = attention_with_mass(query, kv, batch, layer, observe)
    out_r, mass_r = paged_attention_with_mass(query, kv, batch, layer, observe)
    err_out = (out_k.float() - out_r.float()).abs().max().item()
    err_mass = (mass_k - mass_r).abs().max().item()
    print(f"{dtype}: max |out diff| {err_out:.2e}, max |mass diff| {err_mass:.2e}")
    assert err_out < tol and err_mass < tol
    # mass: each observed decode query spreads H units of probability over its blocks
    qlen = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    for i, q0 in enumerate(batch.query_start_loc[:-1].tolist()):
        if qlen[i] == 1:
            expected = layer.num_heads * float(observe[q0])
            assert abs(mass_k[i].sum().item() - expected) < 1e-3
            nb = -(-int(batch.seq_lens[i]) // layer.block_size)
            assert torch.all(mass_k[i, nb:] == 0)


def test_the_reference_is_plain_causal_attention():
    from vllm_graft.hooks import split_kv_cache
    from vllm_graft.plugins.attention._shared import paged_attention_with_mass

    query, kv, batch, layer, observe = paged_case(torch.float32, [40], [6], B=16)
    out, mass = paged_attention_with_mass(query, kv, batch, layer, torch.ones(6, dtype=torch.bool))
    k_cache, v_cache = split_kv_cache(kv)
    ids = batch.block_table[0, :3].long()
    k = torch.cat([k_cache[b] for b in ids], dim=1)[:, :40]  # [Hkv, 40, D]
    v = torch.cat([v_cache[b] for b in ids], dim=1)[:, :40]
    for h in range(4):
        kh, vh = k[h // 2], v[h // 2]
        for t in range(6):
            pos = 34 + t
            p = torch.softmax((query[t, h] @ kh[: pos + 1].T) * layer.scale, dim=-1)
            assert torch.allclose(out[t, h], p @ vh[: pos + 1], atol=1e-5)
    assert abs(mass.sum().item() - 4 * 6) < 1e-4


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_the_context_split_in_any_number_of_parts_gives_the_reference(dtype, tol, splits):
    """The kernel splits each context (flash-decoding) and merges the parts; on the host the
    SM count asks for one split, so the split path is forced here: lengths shorter than one
    split, ending inside one, spanning several, and splits left empty."""
    from vllm_graft.hooks import split_kv_cache
    from vllm_graft.plugins.attention._shared import paged_attention_with_mass
    from vllm_graft.plugins.kvcompress._shared.kernel import decode_attention_with_mass

    lens = [1, 16, 37, 150, 260, 64]
    query, kv, batch, layer, _ = paged_case(dtype, lens, [1] * len(lens), H=8, Hkv=2, device=DEVICE)
    observe = torch.ones(query.shape[0], dtype=torch.bool, device=query.device)
    out_r, mass_r = paged_attention_with_mass(query, kv, batch, layer, observe)
    k_cache, v_cache = split_kv_cache(kv)
    rows = batch.query_start_loc[:-1]
    out_k, mass_k = decode_attention_with_mass(query, k_cache, v_cache, batch.block_table, batch.seq_lens,
                                               rows, layer.scale, splits=splits)
    assert (out_k.float() - out_r.float()).abs().max().item() < tol
    assert (mass_k.sum(1) - mass_r).abs().max().item() < tol
    for i, L in enumerate(lens):
        nb = -(-L // layer.block_size)
        assert abs(mass_k[i].sum().item() - layer.num_heads) < 1e-3
        assert torch.all(mass_k[i, :, nb:] == 0)


@pytest.mark.parametrize("per_head", [False, True], ids=["per-block", "per-kv-head"])
def test_a_decode_only_step_takes_the_path_without_host_reads(per_head, monkeypatch):
    """With ``max_query_len == 1`` on the batch (the builders set it from vLLM's host int) the
    launcher runs over every sequence without reading the device: the same output and mass as
    the path that looks (rows found on the host), a padded sequence of length 0 and a
    sequence with no query this step included (they write no row and have no mass)."""
    import dataclasses

    from vllm_graft.plugins.kvcompress._shared import kernel
    from vllm_graft.plugins.kvcompress._shared.kernel import attention_with_mass

    lens, qlens = [16, 37, 0, 70, 20, 5], [1, 1, 1, 1, 0, 1]
    query, kv, batch, layer, observe = paged_case(torch.float32, lens, qlens, device=DEVICE)
    head_mask = None
    if per_head:
        from tests.kernels.test_perhead_kernel import random_head_mask

        head_mask = random_head_mask(batch, layer, seed=2).to(DEVICE)
    want_out, want_mass = attention_with_mass(query, kv, batch, layer, observe, head_mask=head_mask)
    fast = dataclasses.replace(batch, max_query_len=1)

    def no_host_reads(*a, **k):
        raise AssertionError("the decode-only path read the device on the host")

    monkeypatch.setattr(torch.Tensor, "any", no_host_reads)
    monkeypatch.setattr(torch.Tensor, "nonzero", no_host_reads)
    got_out, got_mass = attention_with_mass(query, kv, fast, layer, observe, head_mask=head_mask)
    monkeypatch.undo()
    assert (got_out.float() - want_out.float()).abs().max().item() < 1e-5
    assert (got_mass - want_mass).abs().max().item() < 1e-5
    assert torch.all(got_mass[2] == 0) and torch.all(got_mass[4] == 0)
    assert bool(got_mass[0].sum() > 0)
