"""``expected-attention``: its block scores against a plain loop over each sequence's observed
queries and tokens (the Gaussian of the observed queries, in closed form), against sampled
queries, in every cache layout; what it keeps; and its registration."""

import math

import pytest
import torch

from vllm_graft.hooks import BlockView, check_keep, get_registry
from vllm_graft.plugins.kvcompress.snapkv.reference import SnapKV
from vllm_graft.kit.conformance.exercises.attention import ATTENTION_SEQS, attention_case
from vllm_graft.plugins.kvcompress.expected_attention.reference import expected_attention_scores

from .test_kvcompress_policies import build

SHAPE = (4, 2, 16, 16)  # H, H_kv, D, block


def _observe(batch, last):
    """The last ``last`` query rows of every sequence."""
    qsl = batch.query_start_loc.tolist()
    obs = torch.zeros(qsl[-1], dtype=torch.bool)
    for i in range(len(qsl) - 1):
        obs[max(qsl[i], qsl[i + 1] - last) : qsl[i + 1]] = True
    return obs


def _loop(q, kv, batch, layer, observe, vnorm):
    keys, values = layer.kv_layout.split(kv)
    B, H, Hkv = keys.shape[2], q.shape[1], keys.shape[1]
    G, s = H // Hkv, layer.scale
    S, W = batch.block_table.shape
    qsl = batch.query_start_loc.tolist()
    out = torch.zeros(S, W, dtype=torch.float64)
    for i in range(S):
        rows = [t for t in range(qsl[i], qsl[i + 1]) if observe[t]]
        if not rows:
            continue
        n = int(batch.seq_lens[i])
        obs = q[rows].double()  # [R, H, D]
        mu, var = obs.mean(0), obs.var(0, unbiased=False)
        for h in range(H):
            kh = h // G
            ks = [keys[int(batch.block_table[i, t // B]), kh, t % B].double() for t in range(n)]
            vs = [values[int(batch.block_table[i, t // B]), kh, t % B].double() for t in range(n)]
            logits = torch.stack([s * (mu[h] @ k) + 0.5 * s * s * (var[h] @ (k * k)) for k in ks])
            p = torch.softmax(logits, 0)
            for t in range(n):
                out[i, t // B] += p[t] * (vs[t].norm() if vnorm else 1.0)
    return out


@pytest.mark.parametrize("cache", ["blocked", "packed-NHD", "packed-HND"])
@pytest.mark.parametrize("vnorm", [True, False])
def test_block_scores_equal_a_loop_over_each_sequences_queries_and_tokens(cache, vnorm):
    q, kv, batch, layer = attention_case(SHAPE, "float32", seed=5, cache=cache)
    observe = _observe(batch, 3)
    before = kv.clone()
    got = expected_attention_scores(kv, batch, layer, q, observe, vnorm).double()
    want = _loop(q, kv, batch, layer, observe, vnorm)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(kv, before)
    # each sequence with an observed query spreads H units of probability over its blocks (without vnorm)
    if not vnorm:
        assert torch.allclose(got.sum(1), torch.full((got.shape[0],), 4.0, dtype=got.dtype), atol=1e-5)


def test_the_closed_form_matches_sampled_queries():
    """E[exp(s q.k)] for q ~ N(mu, diag(var)), in closed form vs 200k sampled queries (one head,
    one sequence): the expected attention normalised over the keys."""
    g = torch.Generator().manual_seed(0)
    D, n = 8, 20
    keys = torch.randn(n, D, generator=g, dtype=torch.float64)
    mu, sd, s = torch.randn(D, generator=g, dtype=torch.float64), 0.7, D**-0.5
    closed = torch.softmax(s * keys @ mu + 0.5 * s * s * (keys * keys).sum(-1) * sd * sd, 0)
    qs = mu + sd * torch.randn(200_000, D, generator=g, dtype=torch.float64)
    sampled = torch.exp(s * qs @ keys.T).mean(0)
    assert torch.allclose(closed, sampled / sampled.sum(), rtol=2e-2)


def test_no_observed_query_scores_nothing():
    q, kv, batch, layer = attention_case(SHAPE, "float32", seed=5)
    none = torch.zeros(q.shape[0], dtype=torch.bool)
    assert not expected_attention_scores(kv, batch, layer, q, none).any()
    assert not expected_attention_scores(kv, batch, layer, None, None).any()
    # one sequence observing: the others stay zero
    one = torch.zeros_like(none)
    one[int(batch.query_start_loc[1]) - 1] = True
    got = expected_attention_scores(kv, batch, layer, q, one)
    assert got[0].sum() > 0 and not got[1:].any()
    assert len(ATTENTION_SEQS) == got.shape[0]


def test_it_keeps_the_best_prompt_blocks_after_prefill_with_the_window():
    c = build("expected-attention", budget_blocks=4, window_tokens=16, sink_blocks=1)
    assert isinstance(c, SnapKV) and c.kv_layouts == ("blocked", "packed", "cpu_vec")
    scores = (0.0, 5.0, 1.0, 9.0, 2.0, 0.5, 3.0, 0.0, 0.0)  # 8 prompt blocks of 16 + 1 generated
    view = BlockView(8 * 16 + 3, 16, 8 * 16, scores=scores, step_scores=scores)
    # the sink, the two best (3, 1), the window's block (7) and the generated one
    assert check_keep(view, c.keep(view), "expected-attention") == [0, 1, 3, 7, 8]
    assert c.keep(BlockView(5 * 16, 16, 8 * 16, scores=scores[:5])) == list(range(5))  # mid-prefill
    assert c.score_positions(128) == (112, 128)


def test_registered_with_its_paper():
    reg = get_registry().get("kvcompress", "expected-attention").registration
    assert "2510.00636" in reg.paper and reg.capabilities.parallelism == ("tp", "dp")
    assert math.isclose(reg.params(keep_ratio=0.25).keep_ratio, 0.25)
