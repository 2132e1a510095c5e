"""The built-in noop plugins do what they claim, with plain tensors (no vLLM)."""
import torch
import torch.nn.functional as F

from vllm_graft.hooks import AttentionLayer, BlockView, PagedBatch, get_registry


def build(kind):
    entry = get_registry().get(kind, "noop")
    return entry.registration.load()(entry.registration.params())


def test_paged_attention_matches_dense_causal_attention():
    torch.manual_seed(0)
    H, Hkv, D, B = 4, 2, 16, 8
    layer = AttentionLayer(num_heads=H, num_kv_heads=Hkv, head_size=D, scale=D ** -0.5, block_size=B)
    seq_lens, q_lens = [13, 5, 20], [13, 1, 3]  # a prefill, a decode, a chunk
    num_blocks = 16
    # vLLM's CPU layout, built the way its kernel reads it: per block and head, B keys then B values.
    k_blocks, v_blocks = torch.randn(num_blocks, Hkv, B, D), torch.randn(num_blocks, Hkv, B, D)
    kv_cache = torch.cat([k_blocks, v_blocks], dim=2).view(num_blocks, Hkv, B, 2 * D)
    perm = torch.randperm(num_blocks)  # scattered physical blocks
    table = torch.zeros(3, 3, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // B)
        table[i, :nb] = perm[used:used + nb]
        used += nb
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), H, D)
    batch = PagedBatch(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)
    out = build("attention").forward(query, kv_cache, batch, layer)
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        ids = table[i, :-(-n // B)].long()
        k = k_blocks[ids].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].repeat_interleave(H // Hkv, 1).transpose(0, 1)
        v = v_blocks[ids].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].repeat_interleave(H // Hkv, 1).transpose(0, 1)
        qi = query[qsl[i]:qsl[i + 1]].transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
        ref = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_keep_all_keeps_every_block():
    assert build("kvcompress").keep(BlockView(num_tokens=129, block_size=32, num_prompt_tokens=100)) == [0, 1, 2, 3, 4]


def test_no_draft_proposes_nothing():
    assert build("speculative").propose("r1", [1, 2, 3], 4) == []


def test_full_precision_linear_is_exact():
    w, x, b = torch.randn(8, 4), torch.randn(3, 4), torch.randn(8)
    method = build("quant")
    torch.testing.assert_close(method.apply(method.quantize(w), x, b), x @ w.T + b)


def test_softmax_topk_routing():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, ids = build("moe").route(0, logits, top_k=2, renormalize=True)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    torch.testing.assert_close(weights[0, 0] / weights[0, 1], torch.tensor(torch.e))
