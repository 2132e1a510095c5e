"""The kv4 Triton attention kernel (4-bit K/V dequantised inside the attention) against the
plain-PyTorch reference, under TRITON_INTERPRET=1: fp32 and fp16, ragged lengths (decode and
prefill rows, partial last blocks), GQA, head sizes 64 and 128, block sizes 16 and 32. Compiled on
``GRAFT_REAL_DEVICE`` where it is set (see tests/kernels/__init__.py)."""
from tests.kernels import device

DEVICE = device()  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.hooks import AttentionLayer, PagedBatch  # noqa: E402

pytestmark = pytest.mark.kernel


def kv4_case(dtype, seq_lens, q_lens, H, Hkv, D, B, G=32, seed=0, device=DEVICE, nhd=False):
    """A kv4 cache written through the reference's write() (the cache the kernel reads in
    vLLM), scattered block ids, and queries. ``nhd``: the page is a ``[N, H_kv, B, C]`` view of
    a ``[N, B, H_kv, C]`` tensor (vLLM's CUDA order)."""
    from vllm_graft.plugins.kvcompress.kv4.reference import bytes_per_token, write

    g = torch.Generator().manual_seed(seed)
    width = max(-(-L // B) for L in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 3
    C = bytes_per_token(D, B, G)
    cache = torch.zeros(num_blocks, B, Hkv, C, dtype=torch.uint8).permute(0, 2, 1, 3) if nhd else \
        torch.zeros(num_blocks, Hkv, B, C, dtype=torch.uint8)
    perm = torch.randperm(num_blocks - 1, generator=g)[: len(seq_lens) * width] + 1
    table = perm.view(len(seq_lens), width).to(torch.int32)
    for i, L in enumerate(seq_lens):
        k = torch.randn(L, Hkv, D, generator=g).to(dtype)
        v = torch.randn(L, Hkv, D, generator=g).to(dtype)
        slots = table[i, torch.arange(L) // B].long() * B + torch.arange(L) % B
        write(k, v, cache, slots, G)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), H, D, generator=g).to(dtype)
    batch = PagedBatch(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)
    layer = AttentionLayer(num_heads=H, num_kv_heads=Hkv, head_size=D, scale=D ** -0.5, block_size=B)
    if device != "cpu":
        batch = PagedBatch(*(t.to(device) for t in (qsl, batch.seq_lens, table)))
        query, cache = query.to(device), cache.to(device)
    return query, cache, batch, layer


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 5e-3)])
@pytest.mark.parametrize("D, B, H, Hkv", [(64, 16, 4, 2), (64, 32, 4, 1), (128, 16, 2, 2), (128, 32, 4, 2)])
def test_kv4_kernel_matches_the_reference(dtype, tol, D, B, H, Hkv):
    from vllm_graft.plugins.kvcompress.kv4.kernel import paged_attention_kv4_triton
    from vllm_graft.plugins.kvcompress.kv4.reference import paged_attention_kv4

    # ragged: decode rows of several lengths (partial last blocks) and a prefill row
    seq_lens, q_lens = [1, B + 5, 2 * B + 3, 9], [1, 1, 1, 4]
    query, cache, batch, layer = kv4_case(dtype, seq_lens, q_lens, H, Hkv, D, B)
    out_k = paged_attention_kv4_triton(query, cache, batch, layer, 32)
    out_r, _ = paged_attention_kv4(query, cache, batch, layer, 32)
    err = (out_k.float() - out_r.float()).abs().max().item()
    print(f"kv4 triton vs reference {dtype} D={D} B={B} H={H}/{Hkv}: max|diff| {err:.2e}")
    assert out_k.dtype == query.dtype and out_k.shape == query.shape
    assert err < tol


def test_kv4_kernel_refuses_non_power_of_two_shapes():
    from vllm_graft.plugins.kvcompress.kv4.kernel import paged_attention_kv4_triton

    query, cache, batch, layer = kv4_case(torch.float32, [5], [1], 2, 2, 96, 16)
    with pytest.raises(ValueError, match="powers of two"):
        paged_attention_kv4_triton(query, cache, batch, layer, 32)
