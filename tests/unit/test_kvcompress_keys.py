"""The key-scored compressors (``knorm``, ``keydiff``): their per-block scores from the cache
against a plain loop over each sequence's tokens, in both cache layouts; what they keep; and
that the worker uses their scores in place of the attention mass."""

import math

import pytest
import torch

from vllm_graft.hooks import BlockView, check_keep, get_registry
from vllm_graft.kit.conformance.exercises.attention import attention_case
from vllm_graft.plugins.kvcompress.keydiff.reference import key_diff_scores
from vllm_graft.plugins.kvcompress.knorm.reference import key_norm_scores

from .test_kvcompress_policies import build

SHAPE = (4, 2, 64, 16)  # H, H_kv, D, block


def _loop(kv, batch, layer, stat):
    """Per sequence and column, from the sequence's own tokens one by one."""
    keys, _ = layer.kv_layout.split(kv)
    B = keys.shape[2]
    S, W = batch.block_table.shape
    out = torch.zeros(S, W, dtype=torch.float64)
    for i in range(S):
        n = int(batch.seq_lens[i])
        toks = [keys[int(batch.block_table[i, t // B]), :, t % B].double() for t in range(n)]  # [H, D] each
        if stat == "diff":
            anchor = torch.stack([k / k.norm(dim=-1, keepdim=True) for k in toks]).sum(0)
            anchor = anchor / anchor.norm(dim=-1, keepdim=True)
        for j in range(math.ceil(n / B)):
            vals = []
            for t in range(j * B, min(n, (j + 1) * B)):
                k = toks[t]
                if stat == "norm":
                    vals.append(-k.norm(dim=-1).mean())
                else:
                    vals.append(-((k / k.norm(dim=-1, keepdim=True)) * anchor).sum(-1).mean())
            out[i, j] = torch.stack(vals).mean()
    return out


@pytest.mark.parametrize("cache", ["blocked", "packed-NHD", "packed-HND"])
@pytest.mark.parametrize("stat, fn", [("norm", key_norm_scores), ("diff", key_diff_scores)])
def test_block_scores_equal_a_loop_over_each_sequences_tokens(stat, fn, cache):
    q, kv, batch, layer = attention_case(SHAPE, "float32", seed=11, cache=cache)
    before = kv.clone()
    got = fn(kv, batch, layer).double()
    want = _loop(kv, batch, layer, stat)
    used = want != 0
    assert got.shape == want.shape and torch.allclose(got[used], want[used], atol=1e-5)
    assert torch.equal(kv, before)


def test_knorm_keeps_the_lowest_norm_blocks_and_keydiff_the_most_distinct():
    step = (-3.0, -1.0, -2.0, -0.5, -4.0, -9.0)  # higher = lower norm / more distinct
    view = BlockView(6 * 32, 32, 10, scores=step, step_scores=step)
    for name in ("knorm", "keydiff"):
        c = build(name, budget_blocks=3)
        assert check_keep(view, c.keep(view), name) == [1, 3, 5]  # the two best and the written block
        assert build(name, budget_blocks=3, sink_blocks=1).keep(view) == [0, 3, 5]
        assert c.keep(BlockView(6 * 32, 32, 7 * 32, scores=step, step_scores=step)) == list(range(6))  # mid-prefill


def test_the_worker_scores_them_from_the_cache_not_the_mass():
    from vllm_graft.integration.adapters.kvcompress.shared_attention import layouts_read, scores_the_cache

    for name in ("knorm", "keydiff"):
        c = build(name)
        assert scores_the_cache(c) and layouts_read(c) == ("blocked", "packed", "cpu_vec")
    assert not scores_the_cache(build("tova")) and not scores_the_cache(build("h2o"))


def test_registered_with_their_papers():
    reg = get_registry()
    assert "2406.11430" in reg.get("kvcompress", "knorm").registration.paper
    assert "2504.15364" in reg.get("kvcompress", "keydiff").registration.paper
