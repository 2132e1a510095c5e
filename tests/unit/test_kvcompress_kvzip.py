"""``kvzip``: the reconstruction passes it asks for, one layer of a pass (the plugin's dense
reference against a plain causal softmax over the concatenated sequence), the worker's paged
scoring attention (``integration/adapters/kvcompress/scoring_pass.py``) against that reference in
every cache layout, with kernel blocks smaller than the manager's and tiled queries, the pair
scores' reduction to blocks, what it keeps, its shape and its registration. The scores the
engine computes against transformers' attention on the tiny model: tests/e2e/test_kvzip_engine.py."""


import pytest
import torch

from vllm_graft.hooks import BlockView, ScoringPass, check_keep, get_registry
from vllm_graft.hooks.contracts.kvcompress import shape_problems
from vllm_graft.integration.adapters.kvcompress.scoring_pass import PassMetadata, kernel_blocks, pass_forward, stacked
from vllm_graft.kit.conformance.exercises.attention import relaid_cache
from vllm_graft.hooks import BLOCKED, AttentionLayer
from vllm_graft.plugins.kvcompress.kvzip import KVzipParams
from vllm_graft.plugins.kvcompress.kvzip.reference import (
    KVzip,
    block_scores_from_pairs,
    pass_attention,
    reconstruction_passes,
)

from .test_kvcompress_policies import build


def test_passes_chunk_the_context_after_the_prompt_and_resume_from_the_previous_chunk():
    ctx = list(range(100, 110))
    (one,) = reconstruction_passes(ctx, [1, 2], chunk_tokens=16, resume_tokens=3)
    assert one == ScoringPass((1, 2, *ctx), observe_from=2)
    passes = reconstruction_passes(ctx, [1, 2], chunk_tokens=4, resume_tokens=3)
    assert [p.token_ids for p in passes] == [
        (1, 2, 100, 101, 102, 103),
        (1, 2, 101, 102, 103, 104, 105, 106, 107),
        (1, 2, 105, 106, 107, 108, 109),
    ]
    assert [p.observe_from for p in passes] == [2, 5, 5]
    # every context token is repeated, and observed, exactly once
    assert [t for p in passes for t in p.token_ids[p.observe_from :]] == ctx
    with pytest.raises(ValueError, match="chunk_tokens"):
        reconstruction_passes(ctx, [1], chunk_tokens=0)


def test_compressor_tokenizes_its_repeat_prompt():
    kv = build("kvzip", chunk_tokens=16, resume_tokens=2, repeat_prompt="again")
    seen = []

    def tokenize(text):
        seen.append(text)
        return [7, 7]

    passes = kv.scoring_passes(list(range(40)), tokenize)
    assert seen == ["again"] and len(passes) == 3
    assert passes[1].token_ids[:4] == (7, 7, 14, 15)


def _dense(q, k_all, v_all, N, scale, observe_from):
    """A plain causal attention over the concatenated sequence (context then pass), float64."""
    n, H, D = q.shape
    hkv = k_all.shape[1]
    G = H // hkv
    T = N + n
    out = torch.zeros(n, H, D, dtype=torch.float64)
    pair = torch.zeros(hkv, N, dtype=torch.float64)
    for h in range(H):
        kh = h // G
        for t in range(n):
            logits = (k_all[: N + t + 1, kh].double() @ q[t, h].double()) * scale
            p = torch.softmax(logits, 0)
            out[t, h] = p @ v_all[: N + t + 1, kh].double()
            if t >= observe_from:
                pair[kh] = torch.maximum(pair[kh], p[:N])
    assert T == k_all.shape[0]
    return out, pair


@pytest.mark.parametrize("observe_from", [0, 5])
def test_reference_pass_attention_is_causal_attention_over_context_then_pass(observe_from):
    g = torch.Generator().manual_seed(0)
    N, n, H, hkv, D = 23, 9, 4, 2, 8
    k_all, v_all = torch.randn(N + n, hkv, D, generator=g), torch.randn(N + n, hkv, D, generator=g)
    q = torch.randn(n, H, D, generator=g)
    out, pair = pass_attention(
        q, k_all[N:], v_all[N:], k_all[:N].transpose(0, 1), v_all[:N].transpose(0, 1), D**-0.5, observe_from
    )
    want_out, want_pair = _dense(q, k_all, v_all, N, D**-0.5, observe_from)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pair.double(), want_pair, atol=1e-6, rtol=1e-5)
    # a pair score is a probability that some observed query paid: at most 1, the max over queries
    assert float(pair.max()) <= 1.0 and float(pair.min()) >= 0.0


def _paged(seed, N, hkv, D, manager_block, cache):
    """A shuffled paged cache holding a context of ``N`` tokens in manager blocks of
    ``manager_block`` (kernel blocks of 16), in layout ``cache``; the context's K/V."""
    g = torch.Generator().manual_seed(seed)
    kb = 16
    per = manager_block // kb
    n_mgr = -(-N // manager_block)
    total_mgr = n_mgr + 3
    mgr_ids = torch.randperm(total_mgr, generator=g)[:n_mgr]
    kv = torch.randn(total_mgr * per, hkv, kb, 2 * D, generator=g)  # other requests' KV around it
    ck, cv = torch.randn(hkv, N, D, generator=g), torch.randn(hkv, N, D, generator=g)
    blocks = kernel_blocks(mgr_ids, manager_block, kb)
    slots = torch.tensor([int(blocks[t // kb]) * kb + t % kb for t in range(N)])
    BLOCKED.write(ck.transpose(0, 1), cv.transpose(0, 1), kv, slots)
    layout, kv = relaid_cache(kv, cache)
    return kv, layout, mgr_ids, ck, cv


@pytest.mark.parametrize("cache", ["blocked", "cpu_vec", "packed-NHD"])
@pytest.mark.parametrize("manager_block,tile", [(16, 256), (32, 3)])
def test_paged_scoring_attention_equals_the_reference(cache, manager_block, tile):
    N, n, H, hkv, D = 45, 11, 4, 2, 16
    kv, layout, mgr_ids, ck, cv = _paged(1, N, hkv, D, manager_block, cache)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(n, H, D, generator=g), torch.randn(n, hkv, D, generator=g), torch.randn(n, hkv, D, generator=g)
    layer = AttentionLayer(num_heads=H, num_kv_heads=hkv, head_size=D, scale=D**-0.5, block_size=16, index=2,
                           kv_layout=layout)
    meta = PassMetadata(mgr_ids, manager_block, N, observe_from=4)
    before = kv.clone()
    out = pass_forward(q, k, v, kv, meta, layer, tile=tile)
    want_out, want_pair = pass_attention(q, k, v, ck, cv, D**-0.5, 4)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(meta.pair[2], want_pair, atol=1e-6, rtol=1e-5)
    assert torch.equal(kv.nan_to_num(7.0), before.nan_to_num(7.0)), "a scoring pass must not write the cache"
    # a second pass folds in as a max over the passes
    q2 = torch.randn(n, H, D, generator=g)
    pass_forward(q2, k, v, kv, meta, layer, tile=tile)
    _, pair2 = pass_attention(q2, k, v, ck, cv, D**-0.5, 4)
    torch.testing.assert_close(meta.pair[2], torch.maximum(want_pair, pair2), atol=1e-6, rtol=1e-5)
    assert meta.layers == 2 and stacked(meta).shape == (1, hkv, N)


def test_paged_scoring_attention_in_float16_follows_the_float32_reference():
    N, n, H, hkv, D = 40, 6, 4, 2, 16
    kv, layout, mgr_ids, ck, cv = _paged(3, N, hkv, D, 16, "blocked")
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(n, H, D, generator=g), torch.randn(n, hkv, D, generator=g), torch.randn(n, hkv, D, generator=g)
    layer = AttentionLayer(num_heads=H, num_kv_heads=hkv, head_size=D, scale=D**-0.5, block_size=16, index=0)
    meta = PassMetadata(mgr_ids, 16, N)
    out = pass_forward(q.half(), k.half(), v.half(), kv.half(), meta, layer)
    assert out.dtype == torch.float16
    want_out, want_pair = pass_attention(q, k, v, ck, cv, D**-0.5)
    torch.testing.assert_close(out.float(), want_out, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(meta.pair[0], want_pair, atol=2e-3, rtol=2e-2)


def test_block_scores_max_or_mean_per_layer_and_head_summed():
    pair = torch.tensor([[[0.1, 0.5, 0.2, 0.0, 0.3]], [[0.0, 0.1, 0.9, 0.4, 0.2]]])  # [L=2, Hkv=1, N=5]
    got = block_scores_from_pairs(pair, 2, "max")
    torch.testing.assert_close(got, torch.tensor([0.5 + 0.1, 0.2 + 0.9, 0.3 + 0.2]))
    got = block_scores_from_pairs(pair, 2, "mean")
    torch.testing.assert_close(got, torch.tensor([0.3 + 0.05, 0.1 + 0.65, 0.3 + 0.2]))
    with pytest.raises(ValueError, match="block_reduce"):
        block_scores_from_pairs(pair, 2, "sum")


def test_keeps_the_best_prompt_blocks_once_the_prompt_is_in():
    kv = build("kvzip", budget_blocks=4, sink_blocks=1)
    assert kv.score_positions(500) == (0, 0)  # its own steps observe nothing
    scores = [0.1, 0.9, 0.2, 3.0, 0.05, 2.0, 0.3, 0.0]
    mid = BlockView(num_tokens=100, block_size=32, num_prompt_tokens=256, scores=scores[:4])
    assert check_keep(mid, kv.keep(mid), "kvzip") == [0, 1, 2, 3]  # mid-prefill: nothing dropped
    view = BlockView(num_tokens=256, block_size=32, num_prompt_tokens=256, scores=scores)
    assert check_keep(view, kv.keep(view), "kvzip") == [0, 3, 5, 7]  # sink, the two best, the last
    # generated blocks are all kept (scope: prompt)
    later = BlockView(num_tokens=300, block_size=32, num_prompt_tokens=256,
                      scores=[0.1, float("-inf"), float("-inf"), 3.0, float("-inf"), 2.0, float("-inf"), 0.0, 0.0, 0.0])
    assert kv.keep(later) == [0, 3, 5, 7, 8, 9]


def test_shape_and_registration():
    assert shape_problems(KVzip) == []
    reg = get_registry().get("kvcompress", "kvzip").registration
    assert "2505.23416" in reg.paper and not reg.capabilities.lossless
    assert reg.capabilities.parallelism == ("tp", "dp")
    p = KVzipParams(keep_ratio=0.25)
    assert p.keep_ratio == 0.25 and p.chunk_tokens == 512
    with pytest.raises(ValueError, match="sink_blocks"):
        KVzipParams(budget_blocks=2, sink_blocks=2)
    with pytest.raises(ValueError):
        KVzipParams(chunk_tokens=4)


def test_shape_rules_of_scoring_passes():
    class NoScores(KVzip):
        needs_scores = False

    class NoReduce(KVzip):
        from vllm_graft.hooks import KVCompressor as _C
        pass_block_scores = _C.pass_block_scores  # the contract's default

    class PerHead(KVzip):
        per_head = True

        def keep_heads(self, view):
            return []

    assert any("needs_scores" in p.message for p in shape_problems(NoScores))
    assert any("pass_block_scores" in p.message for p in shape_problems(NoReduce))
    assert any("per KV head" in p.message for p in shape_problems(PerHead))
    from vllm_graft.plugins.kvcompress.kv4.reference import KV4

    problems = shape_problems(KVzip, [("kvcompress", "kv4", KV4)])
    assert any("storage format" in p.message for p in problems)


def test_the_worker_runs_the_passes_when_the_prompt_completes_and_drops_by_their_scores():
    from vllm_graft.integration.adapters.kvcompress.keep import KeepError
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _StepPlan

    kv = build("kvzip", budget_blocks=3, sink_blocks=1)
    counts = {}
    scored = _Scores(kv, "kvzip", lambda e, n=1: counts.__setitem__(e, counts.get(e, 0) + n))
    asked = []
    pass_scores = torch.tensor([0.0, 0.1, 5.0, 0.2, 0.3, 0.0])  # prompt blocks 0-5: block 2 is the best

    def passes(runner, req_id, n):
        asked.append((runner, req_id, n))
        return pass_scores, torch.zeros(1, 1, n), 0.25

    scored.passes, scored.runner = passes, "runner"

    def step(rows):
        width = 12
        return _StepPlan(rows, [list(range(-(-(c + q) // 32))) for _, c, q, _, _ in rows],
                         torch.zeros(sum(r[2] for r in rows), dtype=torch.bool),
                         torch.zeros(len(rows), width), 32)

    # mid-prefill (a), a decode (b), and a request whose prompt completes (c, 190 tokens: 6 blocks)
    scored.pending = step([("a", 0, 64, 190, []), ("b", 300, 1, 250, []), ("c", 128, 62, 190, [])])
    drops = scored.finalize()
    assert asked == [("runner", "c", 190)]
    assert drops["c"] == [1, 3, 4]  # kept: the sink, the best (2) and the prompt's last block (5)
    assert "a" not in drops  # mid-prefill: nothing dropped (b, never scored here, ranks by zeros)
    assert counts["scoring_passes"] == 1 and counts["scoring_pass_us"] == 250000
    assert scored.recent_pairs["c"].shape == (1, 1, 190)
    # a request that dropped blocks before its prompt completed is refused: the pass reads them all
    scored.reqs["d"] = type(scored.reqs["c"])([0.0] * 4, {1})
    scored.pending = step([("d", 100, 28, 128, [1])])
    with pytest.raises(KeepError, match="before its prompt was complete"):
        scored.finalize()
