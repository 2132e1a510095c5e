"""``rkv`` (R-KV): its block scores (importance from the attention mass, redundancy from the keys),
decode-time compression with a buffer, and its registration."""

import pytest
import torch

from vllm_graft.hooks import BlockView, check_keep, dropped_blocks, get_registry
from vllm_graft.plugins.kvcompress.tova.reference import TOVA
from vllm_graft.integration.adapters.kvcompress.shared_attention import attend_with_mass, block_scores
from vllm_graft.kit.conformance.exercises.attention import attention_case
from vllm_graft.plugins.kvcompress.keydiff.reference import key_diff_scores
from vllm_graft.plugins.kvcompress.rkv.reference import rkv_scores

from .test_kvcompress_policies import build

SHAPE = (4, 2, 16, 16)  # H, H_kv, D, block


def _case(cache="blocked"):
    q, kv, batch, layer = attention_case(SHAPE, "float32", seed=9, cache=cache)
    observe = torch.zeros(q.shape[0], dtype=torch.bool)
    for end in batch.query_start_loc.tolist()[1:]:
        observe[end - 1] = True  # each sequence's current (last) query
    c = build("rkv")
    _, mass = attend_with_mass(c, q, kv, batch, layer, observe)
    return c, q, kv, batch, layer, observe, mass


@pytest.mark.parametrize("cache", ["blocked", "packed-NHD", "packed-HND"])
def test_importance_is_the_share_of_the_current_querys_mass_and_redundancy_the_key_similarity(cache):
    c, q, kv, batch, layer, observe, mass = _case(cache)
    S, W = batch.block_table.shape
    used = torch.arange(W)[None, :] * SHAPE[3] < batch.seq_lens.long()[:, None]
    importance = rkv_scores(kv, batch, layer, observe, mass, 1.0)
    assert torch.allclose(importance.sum(1), torch.ones(S), atol=1e-5)  # each sequence's shares sum to 1
    assert torch.allclose(importance, mass[:S, :W] / SHAPE[0], atol=1e-6)  # one observed query each
    redundancy = rkv_scores(kv, batch, layer, observe, mass, 0.0)
    assert torch.allclose(redundancy[used], key_diff_scores(kv, batch, layer)[used], atol=1e-6)
    mixed = rkv_scores(kv, batch, layer, observe, mass, 0.3)
    assert torch.allclose(mixed, 0.3 * importance + 0.7 * redundancy, atol=1e-6)
    # the worker hands the compressor exactly these (its signature names observe and mass)
    assert torch.allclose(
        block_scores(c, kv, batch, layer, q, observe, mass), rkv_scores(kv, batch, layer, observe, mass, 0.5)
    )


def test_without_mass_or_observed_queries_only_redundancy_counts():
    c, q, kv, batch, layer, observe, mass = _case()
    red = rkv_scores(kv, batch, layer, observe, mass, 0.0)
    assert torch.allclose(rkv_scores(kv, batch, layer, None, None, 0.5), 0.5 * red)
    none = torch.zeros_like(observe)
    assert torch.allclose(rkv_scores(kv, batch, layer, none, mass * 0, 0.5), 0.5 * red)


def test_it_compresses_while_decoding_once_per_buffer():
    c = build("rkv", budget_blocks=6, slack_blocks=3, sink_blocks=1)
    assert isinstance(c, TOVA) and c.score_positions(100) == (99, 1 << 62)
    B, prompt = 16, 16 * 5
    dropped: set[int] = set()
    held = []
    g = torch.Generator().manual_seed(0)
    for tokens in range(prompt, prompt + 16 * 30, 16):
        nb = -(-tokens // B)
        step = [float("-inf") if i in dropped else float(x) for i, x in enumerate(torch.rand(nb, generator=g))]
        view = BlockView(tokens, B, prompt, scores=step, step_scores=step)
        kept = check_keep(view, c.keep(view), "rkv")
        assert not dropped & set(kept) and 0 in kept
        dropped |= set(dropped_blocks(view, kept))
        held.append(len(kept))
    assert max(held) == 6 + 3 and min(held[2:]) == 6
    cuts = [i for i in range(1, len(held)) if held[i] < held[i - 1]]
    assert len(cuts) >= 5 and all(b - a == 4 for a, b in zip(cuts, cuts[1:]))


def test_registered_with_its_paper_and_a_buffer_by_default():
    reg = get_registry().get("kvcompress", "rkv").registration
    assert "2505.24133" in reg.paper and reg.params().slack_blocks == 4
    with pytest.raises(ValueError, match="slack_blocks"):
        reg.params(slack_blocks=0)
    with pytest.raises(ValueError, match="sink_blocks"):
        reg.params(budget_blocks=2, sink_blocks=2)
