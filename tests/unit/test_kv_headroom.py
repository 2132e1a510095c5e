"""`vllm-graft kv-headroom`: the step replay that builds each policy's attention mask, the
paired bootstrap, and the command line (the study itself runs in tests/e2e/test_kv_headroom.py)."""
from __future__ import annotations

import math

import pytest

from vllm_graft.hooks import BlockView
from vllm_graft.tools.kvcompress import kv_headroom as kh


def test_steps_are_prefill_chunks_then_one_token_each():
    assert kh.step_bounds(300, 303, 128) == [0, 128, 256, 300, 301, 302, 303]


def test_streaming_replay_drops_blocks_only_for_later_steps_and_never_returns_them():
    B, n, prompt = 4, 40, 24
    comp = kh.planner("streaming", {"budget_blocks": 3, "sink_blocks": 1})
    allowed = kh.replay_allowed(n, prompt, B, 8, lambda s: comp.keep(BlockView(s, B, prompt)))
    # causal everywhere
    assert not allowed.triu(1).any()
    # the first chunk (rows 0..7) sees everything before it: nothing was dropped yet
    assert allowed[7, :8].all()
    # rows of the second chunk (8..15) do not see block 1 (dropped after the first step:
    # 2 blocks, budget 3, so nothing; after 16 tokens: blocks 0 (sink) and 2, 3 kept)
    assert allowed[15, 4:8].all()  # after step 1 (8 tokens, 2 blocks) nothing was dropped
    assert not allowed[16, 4:8].any() and allowed[16, 0:4].all()  # after 16 tokens block 1 went
    # the last query sees the sink and the last two blocks only, as the planner says
    seen = [b for b in range(n // B) if allowed[n - 1, b * B:(b + 1) * B].any()]
    assert seen == comp.keep(BlockView(n - 1, B, prompt))
    # a dropped block never comes back for any later row
    for b in range(n // B):
        rows = allowed[:, b * B].nonzero().flatten().tolist()
        assert rows == list(range(rows[0], rows[-1] + 1))


def test_snapkv_replay_keeps_the_prompt_until_it_is_in_then_the_best_scored_blocks():
    B, n, prompt = 4, 36, 28
    comp = kh.planner("snapkv", {"budget_blocks": 3, "sink_blocks": 1, "window_tokens": 1})  # oracle's planner
    scores = [0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0]  # block 4 is the one to keep

    def keep(s):
        nb = -(-s // B)
        return comp.keep(BlockView(s, B, prompt, tuple((scores + [0.0] * nb)[:nb])))

    allowed = kh.replay_allowed(n, prompt, B, 8, keep)
    assert allowed[prompt - 1, :prompt].all()  # prompt rows: full attention
    seen = [b for b in range(n // B) if allowed[prompt, b * B:(b + 1) * B].any()]
    assert seen == [0, 4, 6, 7]  # sink, the scored block, the window's block, the generated one


def test_bootstrap_interval_brackets_the_estimate_and_collapses_for_equal_arms():
    diffs, toks = [1.0, -0.5, 2.0, 0.2], [100] * 4
    lo, hi = kh.bootstrap(diffs, toks)
    point = math.exp(sum(diffs) / sum(toks)) - 1
    assert lo <= point <= hi and lo < hi
    assert kh.bootstrap([0.0] * 4, toks) == (0.0, 0.0)


def test_unknown_arm_is_refused_with_the_choices(capsys):
    from vllm_graft.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["kv-headroom", "--arms", "streaming,h3o"])
    assert "unknown arm(s) h3o" in str(e.value) and "oracle" in str(e.value) and "h2o" in str(e.value)
    with pytest.raises(SystemExit, match="per KV head"):  # refused before the model loads
        main(["kv-headroom", "--arms", "adakv"])
    with pytest.raises(SystemExit, match="invalid parameters"):
        main(["kv-headroom", "--arms", "h2o", "--params", '{"sink_blocks": -1}'])


def test_plugin_arms_are_kvbenchs_and_the_study_arms_are_snapkvs_planner_or_more_streaming():
    from vllm_graft.tools.kvcompress.kvbench import _arms

    bench = dict(_arms(2048, 32, ["streaming", "snapkv", "snapkv-recent", "snapkv-wide"], (4,)))
    for name in ("streaming", "snapkv", "snapkv-recent", "snapkv-wide"):
        assert kh.arm_choice(name, 2048, 32, 4, extra=4) == bench[f"{name} 1/4"]
    for name in ("prompt-mean", "oracle"):
        assert kh.arm_choice(name, 2048, 32, 4, extra=4) == {
            "plugin": "snapkv", "params": {"budget_blocks": 16, "sink_blocks": 1, "window_tokens": 1}}
    assert kh.arm_choice("streaming+", 2048, 32, 4, extra=4) == {
        "plugin": "streaming", "params": {"budget_blocks": 20, "sink_blocks": 1}}


def test_a_fraction_that_leaves_fewer_than_two_blocks_is_refused():
    from vllm_graft.cli.main import main

    with pytest.raises(SystemExit, match="--fractions 64 leave fewer than 2 of the context's 64 blocks"):
        main(["kv-headroom", "--fractions", "4,64"])


def test_registered_plugins_are_arms_too():
    # a registered plugin outside kv-headroom's own arms: kvbench's budget, --params under its own JSON
    assert kh.arm_choice("streaming:{\"sink_blocks\": 2}", 512, 32, 2, 0) == {
        "plugin": "streaming", "params": {"budget_blocks": 8, "sink_blocks": 2}}
    with pytest.raises(SystemExit, match="storage format"):
        kh.arm_choice("kv4", 512, 32, 2, 0)
