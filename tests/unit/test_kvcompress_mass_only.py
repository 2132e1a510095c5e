"""The scoring attention's mass-only path (``_ScoringAttention.mass_only``/``add_mass``): where a
route computes the step's output with its own kernel, the observed queries alone, as a batch of
their own cut at their last position, give the same block mass as the whole step's attention;
and the path is taken only where they are a small part of the step."""

import types

import pytest
import torch

from vllm_graft.hooks import KVCompressor, PagedBatch

from .test_kvcompress_public_api import _case


class Window(KVCompressor):
    """Scores from the prompt's last ``w`` queries (SnapKV's window); keeps everything."""

    needs_scores = True

    def __init__(self, w):
        super().__init__(None)
        self.w = w

    def score_positions(self, num_prompt_tokens):
        return (num_prompt_tokens - self.w, num_prompt_tokens)

    def keep(self, view):
        return list(range(view.num_blocks))


def _compacted(q, kv, batch, i, column):
    """Sequence ``i`` with block-table ``column`` dropped, as the rewriter leaves it."""
    table = batch.block_table.clone()
    row = [int(b) for j, b in enumerate(table[i]) if j != column] + [0]
    table[i] = torch.tensor(row, dtype=table.dtype)
    lens = batch.seq_lens.clone()
    lens[i] -= kv.shape[2]
    return PagedBatch(query_start_loc=batch.query_start_loc, seq_lens=lens, block_table=table)


def _plans(w, rows, batch):
    from vllm_graft.integration.adapters.kvcompress.rows import step_rows
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _ScoringAttention

    sc = _Scores(Window(w), "window", lambda *a: None)
    att = _ScoringAttention(sc)
    step_rows.step = types.SimpleNamespace(rows=rows, block_size=4,
                                           query_start_loc=batch.query_start_loc.tolist())
    try:
        return att, att.plan(batch), att.plan(batch)
    finally:
        step_rows.step = None


@pytest.mark.parametrize("w", [1, 2])
def test_the_observed_queries_alone_give_the_steps_mass(w):
    q, kv, batch, layer = _case()  # seqs (7 tokens, 7 queries), (40, 1), (19, 3), (33, 1)
    batch = _compacted(q, kv, batch, 2, 1)  # the third sequence dropped its logical block 1 earlier
    rows = [("a", 0, 7, 7, []), ("b", 39, 1, 20, []), ("c", 16, 3, 19, [1]), ("d", 32, 1, 20, [])]
    att, whole, alone = _plans(w, rows, batch)
    assert att.mass_only(alone) and alone.observed_batch[0].tolist() == (
        list(range(7 - w, 7)) + list(range(11 - w, 11))
    )
    att.forward(q, kv, batch, layer, whole)
    att.add_mass(q, kv, batch, layer, alone)
    assert whole.mass.abs().sum() > 0
    torch.testing.assert_close(alone.mass, whole.mass, atol=1e-5, rtol=1e-5)


def test_not_taken_where_most_of_the_step_is_observed():
    q, kv, batch, layer = _case()
    rows = [("a", 0, 7, 7, []), ("b", 39, 1, 20, []), ("c", 16, 3, 19, []), ("d", 32, 1, 20, [])]
    att, _, plan = _plans(4, rows, batch)  # 4 + 3 of 12 queries observed
    assert plan.observed and not att.mass_only(plan)
    att, _, plan = _plans(0, rows, batch)  # nothing observed
    assert not plan.observed and not att.mass_only(plan)


def test_not_for_per_head_nor_cache_scorers_nor_a_merging_compressor():
    from vllm_graft.integration.adapters.kvcompress.merge import MergingAttention, MergingScores
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores

    from .test_kvcompress_policies import build

    for name in ("adakv", "knorm", "pyramidkv"):
        assert not _Scores(build(name), name, lambda *a: None).mass_alone, name
    assert _Scores(build("snapkv"), "snapkv", lambda *a: None).mass_alone
    att = MergingAttention(MergingScores(build("d2o"), "d2o", lambda *a: None))
    assert not att.mass_only(types.SimpleNamespace(observed_batch=object()))
