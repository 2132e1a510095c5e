"""benchmarks/adaptive_overhead.py: the wrapper's calls are timed over a stub proposer, and the
controller settles on chains when every draft but the last holds."""

from __future__ import annotations

from tests.scripts import load_script


def test_a_run_times_the_three_calls_and_settles_on_chains():
    mod = load_script("adaptive_overhead.py")
    got = mod.run(batch=4, steps=200, step_ms=0.05)
    assert set(got["us_per_step"]) == {"begin_step", "propose", "accepted"}
    assert got["us_per_step"]["begin_step"] > 0 and got["us_per_step"]["accepted"] > 0
    chosen = got["chosen"]
    assert sum(chosen.values()) == 200
    assert chosen["chain"] > chosen["off"] + chosen["shadow"]  # 3 tokens of 4 accepted: chains pay


def test_the_stub_drafts_the_pattern_but_its_last_token():
    mod = load_script("adaptive_overhead.py")
    # the pattern's next tokens after two, the last one wrong
    assert mod.InstantDrafts().propose("r", [1, 2], 3) == [mod.pattern(2), mod.pattern(3), 0]
