"""`tova` (TOVA at block granularity): over budget it keeps the blocks the current query
attends to most (``step_scores``), not those with the most accumulated attention (H2O)."""

import pytest
from pydantic import ValidationError

from vllm_graft.hooks import BlockView, check_keep, get_registry

from .test_kvcompress_policies import build, histories

INF = float("-inf")


def view(n_blocks, step, prompt=10, bs=32, pinned=frozenset(), extra=0):
    return BlockView(n_blocks * bs - extra, bs, prompt, scores=tuple(0.0 for _ in step), pinned=pinned,
                     step_scores=tuple(step))


def test_keeps_what_the_current_query_reads_not_what_was_read_most():
    t = build("tova", budget_blocks=3)
    step = (0.1, 5.0, 0.2, 4.0, 0.0, 1.0)
    assert t.keep(view(6, step)) == [1, 3, 5]  # the two blocks the query reads most, and the one being written
    # h2o on the same accumulated scores would keep the old heavy hitters; tova ignores them
    accumulated = BlockView(6 * 32, 32, 10, scores=(99.0, 0.0, 99.0, 0.0, 99.0, 0.0), step_scores=step)
    assert t.keep(accumulated) == [1, 3, 5]
    assert build("h2o", budget_blocks=3, sink_blocks=0, recent_blocks=1).keep(accumulated) == [0, 2, 5]


def test_sinks_the_written_block_pinned_and_dropped_blocks():
    step = (0.0, 1.0, INF, 3.0, 0.5, 0.0, 0.1)  # block 2 dropped earlier
    assert build("tova", budget_blocks=3, sink_blocks=1).keep(view(7, step)) == [0, 3, 6]
    assert build("tova", budget_blocks=4).keep(view(7, step)) == [1, 3, 4, 6]  # never block 2 again
    assert build("tova", budget_blocks=3).keep(view(7, step, pinned=frozenset({5}))) == [1, 3, 5, 6]


def test_drops_nothing_within_budget_mid_prefill_or_without_scores():
    t = build("tova", budget_blocks=3)
    assert t.keep(view(3, (0.0, 0.0, 0.0))) == [0, 1, 2]
    assert t.keep(view(6, (1.0,) * 6, prompt=6 * 32 + 40)) == list(range(6))  # the prompt is still being read
    assert t.keep(BlockView(6 * 32, 32, 10)) == list(range(6))


def test_the_current_query_is_the_prompts_last_token_then_each_generated_one():
    t = build("tova", budget_blocks=3)
    assert t.score_positions(100) == (99, 1 << 62)
    assert t.score_positions(0)[0] == 0


def test_properties_over_random_histories():
    """Over seeded random histories (each step a fresh current-query mass): sorted, in range,
    the last block and pinned blocks kept, the budget held, a dropped block never back."""
    for budget, sink in ((2, 0), (4, 1), (8, 2)):
        t = build("tova", budget_blocks=budget, sink_blocks=sink)
        for bs, prompt, shared, unshare_at, steps, rnd in histories(budget * 31 + sink):
            dropped: set[int] = set()
            for n_tok in steps:
                nb = -(-n_tok // bs)
                pinned = frozenset(i for i in range(shared) if n_tok < unshare_at and i < nb - 1 and i not in dropped)
                step = tuple(INF if i in dropped else rnd.random() for i in range(nb))
                v = BlockView(n_tok, bs, prompt, scores=step, pinned=pinned, step_scores=step)
                kept = check_keep(v, t.keep(v), "tova")
                assert len(set(kept) - pinned) <= max(budget, 0) or n_tok < prompt, (v, kept)
                assert not dropped & set(kept) and pinned <= set(kept)
                if n_tok >= prompt and nb > budget:
                    assert set(range(min(sink, nb))) <= set(kept)
                dropped |= set(range(nb)) - set(kept)


@pytest.mark.parametrize("params, msg", [
    ({"budget_blocks": 1}, "greater than or equal to 2"),
    ({"budget_blocks": 4, "sink_blocks": 4}, r"sink_blocks \(4\) must be smaller than budget_blocks \(4\)"),
])
def test_rejects_bad_parameters(params, msg):
    with pytest.raises(ValidationError, match=msg):
        get_registry().get("kvcompress", "tova").registration.params(**params)


def test_registered_with_its_paper_and_refusing_attention_plugins():
    reg = get_registry().get("kvcompress", "tova").registration
    from vllm_graft.hooks.contracts import shape_problems

    assert "2401.06104" in reg.paper
    # refused with an attention plugin by its shape (needs_scores; validation runs it)
    assert [p.other for p in shape_problems("kvcompress", reg.load(), [("attention", "noop", None)])] == ["attention:noop"]
    assert not reg.capabilities.lossless  # lossy: kvbench reports its quality change
