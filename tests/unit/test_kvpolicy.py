"""Scorer x policy (``hooks.contracts.kvpolicy``): the built-in eviction compressors are scorers
under one keep policy, and the policy's budget by ratio, slack (decode-time compression with a
buffer) and allocation compose with any scorer, a new one included."""

from __future__ import annotations

import random
from typing import Sequence

import pytest
from pydantic import Field, ValidationError

from vllm_graft.hooks import (
    BlockView,
    KeepPolicy,
    PolicyCompressor,
    PolicyParams,
    check_keep,
    check_keep_heads,
    dropped_blocks,
    get_registry,
)

from vllm_graft.plugins.kvcompress.streaming.reference import Streaming
from vllm_graft.plugins.kvcompress.tova.reference import TOVA as CurrentMass  # the current-query scorer

NEG = float("-inf")
EVICTION = ("streaming", "h2o", "snapkv", "adakv", "tova", "knorm", "keydiff")


def _impl(name: str):
    reg = get_registry().get("kvcompress", name).registration
    return reg.params, reg.load()


@pytest.mark.parametrize("name", EVICTION)
def test_every_built_in_eviction_compressor_is_a_scorer_under_the_keep_policy(name):
    params, cls = _impl(name)
    assert issubclass(cls, PolicyCompressor), f"{name} is not built on PolicyCompressor"
    c = cls(params(budget_blocks=7))
    assert isinstance(c.policy, KeepPolicy)
    # what its parameters set is what its policy holds
    assert c.policy.budget_blocks == 7


@pytest.mark.parametrize("name", EVICTION)
def test_each_eviction_compressor_holds_its_technique_in_its_plugin_folder(name):
    """Between the compressor and the policy only plugin classes (its own, or a plugin it builds
    on: Ada-KV on SnapKV) and the one shared base :class:`CacheScores`: no paper's score in hooks/."""
    from vllm_graft.hooks import CacheScores

    _, cls = _impl(name)
    between = cls.__mro__[: cls.__mro__.index(PolicyCompressor)]
    outside = [k.__qualname__ for k in between if k is not CacheScores and not k.__module__.startswith("vllm_graft.plugins.")]
    assert not outside, f"{name}'s scoring is in {outside}, not in a plugin folder"
    own = [k for k in between if k.__module__.startswith(f"vllm_graft.plugins.kvcompress.{name.replace('-', '_')}.")]
    assert own and any(m in vars(k) for k in between if k is not CacheScores
                       for m in ("score", "block_scores", "score_positions")), f"{name} defines no score of its own"


def _view(n_tokens, prompt, scores=None, step=None, heads=None, B=16, pinned=frozenset()):
    return BlockView(
        num_tokens=n_tokens,
        block_size=B,
        num_prompt_tokens=prompt,
        scores=scores,
        step_scores=step,
        head_scores=heads,
        pinned=pinned,
    )


def test_keep_ratio_sets_the_budget_from_the_prompt():
    params, H2O = _impl("h2o")
    c = H2O(params(keep_ratio=0.25, sink_blocks=1, recent_blocks=1))
    # 10 prompt blocks of 16: a quarter is 2.5, rounded up to 3
    scores = [5.0, 1, 9, 2, 8, 3, 0, 7, 4, 6]
    kept = check_keep(_view(160, 160, scores), c.keep(_view(160, 160, scores)), "h2o")
    assert kept == [0, 2, 9]  # the sink, the heaviest of the rest (block 2), the block being written
    # never below the fixed blocks
    assert KeepPolicy(keep_ratio=0.01, sink_blocks=2, recent_blocks=3).budget(_view(1600, 1600)) == 5
    assert KeepPolicy(keep_ratio=0.5).budget(_view(17, 17, B=16)) == 2
    assert KeepPolicy(keep_ratio=0.5).budget(_view(160, 100, B=16)) == 4  # ceil(7 * 0.5): the prompt's blocks


def test_budget_blocks_and_keep_ratio_together_are_refused_naming_both():
    params, _ = _impl("tova")
    with pytest.raises(ValidationError, match="budget_blocks .* or keep_ratio"):
        params(budget_blocks=8, keep_ratio=0.5)
    with pytest.raises(ValidationError):
        params(keep_ratio=0.0)  # keeps nothing
    assert params(keep_ratio=0.5).keep_ratio == 0.5


def _run(compressor, scores_of, *, prompt, total, B=16, chunk=None):
    """Drive a compressor as the worker does: one block more per step after the prompt, the
    dropped blocks -inf in the next view; returns the blocks held after each step."""
    dropped: set[int] = set()
    held = []
    rng = random.Random(0)
    n_tokens = prompt if chunk is None else chunk
    while n_tokens <= total:
        nb = -(-n_tokens // B)
        base = scores_of(nb, rng)
        scores = [NEG if i in dropped else s for i, s in enumerate(base)]
        view = _view(n_tokens, prompt, scores, step=scores, B=B)
        kept = check_keep(view, compressor.keep(view), type(compressor).__name__)
        assert not dropped & set(kept), "a dropped block came back"
        dropped |= set(dropped_blocks(view, kept))
        held.append(len(kept))
        n_tokens += B if n_tokens >= prompt else min(chunk or B, prompt - n_tokens)
    return held


def test_slack_cuts_back_to_the_budget_once_per_slack_blocks():
    params, TOVA = _impl("tova")

    def rand(nb, rng):
        return [rng.random() for _ in range(nb)]

    every = _run(TOVA(params(budget_blocks=4)), rand, prompt=64, total=64 + 16 * 20)
    assert max(every) == 4 and every[-1] == 4  # cut every step
    slack = _run(TOVA(params(budget_blocks=4, slack_blocks=3)), rand, prompt=64, total=64 + 16 * 20)
    assert max(slack) == 4 + 3 and min(slack[4:]) == 4, slack
    # it grows to budget + slack, then is cut back to the budget: one cut per slack + 1 blocks
    cuts = [i for i in range(1, len(slack)) if slack[i] < slack[i - 1]]
    assert len(cuts) >= 4 and all(b - a == 4 for a, b in zip(cuts, cuts[1:])), (slack, cuts)


def test_slack_is_refused_where_no_scores_tell_what_was_dropped():
    class RecencyParams(PolicyParams):
        sink_blocks: int = Field(1, ge=0)

    class NewestFirst(Streaming):
        pass

    with pytest.raises(ValueError, match="slack_blocks needs a scored compressor"):
        NewestFirst(RecencyParams(slack_blocks=2))
    assert NewestFirst(RecencyParams()).keep(_view(16 * 20, 16 * 20)) == [0] + list(range(5, 20))


def test_heads_allocation_goes_with_per_head():
    class Params_(PolicyParams):
        window_tokens: int = 16

    class Wrong(CurrentMass):
        allocation = "heads"  # per_head left False

    with pytest.raises(TypeError, match="per_head"):
        Wrong(Params_())

    class PerHeadTOVA(CurrentMass):
        per_head = True
        allocation = "heads"

    c = PerHeadTOVA(Params_(budget_blocks=3))
    heads = [[9.0, 0, 0, 8, 0, 0, 1], [0.0, 7, 6, 0, 0, 0, 1]]
    view = _view(16 * 7, 16 * 7, scores=[a + b for a, b in zip(*heads)], heads=heads)
    kept = check_keep_heads(view, c.keep_heads(view), "per-head")
    # 2 heads x (3 - 1 fixed) slots, taken by score over both heads: 9, 8 (head 0), 7, 6 (head 1)
    assert kept == [[0, 3, 6], [1, 2, 6]]
    assert c.keep(view) == [0, 1, 2, 3, 6]


class MassPerToken(CurrentMass):
    """A scorer written as a user would (~10 lines): the current query's mass divided by the
    tokens the block holds, so a partly filled last block is not undervalued."""

    def score(self, view: BlockView) -> Sequence[float] | None:
        if view.step_scores is None:
            return None
        B, n = view.block_size, view.num_blocks
        sizes = [min(B, view.num_tokens - i * B) for i in range(n)]
        return [s / size for s, size in zip(view.step_scores, sizes)]


def test_a_new_scorer_gets_every_policy_field():
    class P(PolicyParams):
        sink_blocks: int = Field(1, ge=0)

    # 20 prompt blocks; keep a quarter (5): the sink, the last, the 3 best per token
    step = [1.0] * 20
    step[7], step[11], step[13] = 9.0, 8.0, 7.0
    view = _view(16 * 19 + 4, 16 * 19 + 4, scores=step, step=step)
    kept = check_keep(view, MassPerToken(P(keep_ratio=0.25)).keep(view), "mass-per-token")
    assert kept == [0, 7, 11, 13, 19]
    # mid-prefill nothing is dropped (the current query is the prompt's last token)
    mid = _view(16 * 10, 16 * 19 + 4, scores=step[:10], step=step[:10])
    assert MassPerToken(P(budget_blocks=3)).keep(mid) == list(range(10))
    # with slack it holds up to budget + slack before cutting
    assert MassPerToken(P(budget_blocks=5, slack_blocks=15)).keep(view) == list(range(20))


def test_pinned_blocks_are_kept_by_every_policy():
    params, H2O = _impl("h2o")
    scores = [float(i) for i in range(12)]
    view = _view(16 * 12, 16 * 12, scores, pinned=frozenset({2, 3}))
    kept = check_keep(view, H2O(params(budget_blocks=4)).keep(view), "h2o")
    assert {2, 3} <= set(kept)


def test_snapkv_checks_its_window_against_budget_blocks_not_against_a_ratio():
    from vllm_graft.hooks import DeploymentContext

    params, _ = _impl("snapkv")
    ctx = DeploymentContext(platform="cpu", dtype=None, model=None, block_size=16)
    assert params(budget_blocks=2, window_tokens=64).check_deployment(ctx)  # the window spans 5 blocks
    # the default budget_blocks (16) would not hold a 512-token window; keep_ratio sets the budget instead
    assert params(keep_ratio=0.5, window_tokens=512).check_deployment(ctx) == []
