"""benchmarks/adaptive_modes.py's summary: each step's choice as one character, the steps recorded per shape."""

from __future__ import annotations

from tests.scripts import load_script


def _script():
    return load_script("adaptive_modes.py")


def test_summary_gives_the_choices_and_the_recorded_steps_per_shape():
    mod = _script()
    choices = ["run", "tree", "tree", "chain", "off", "shadow", "run", "chain"]
    records = [
        ("tree", 2, 0.006, 8, False),
        ("chain", 2, 0.003, 5, True),
        ("chain", 2, 0.005, 3, True),
        ("off", 2, 0.002, 2, False),
    ]
    assert mod.summarize(choices, records) == [
        "chosen: tree 2, chain 2, off 1, shadow 1",
        "|TT.os|.",
        "recorded tree: 1 steps, median 6.000 ms, 4.00 tokens per request, 0 timed",
        "recorded chain: 2 steps, median 4.000 ms, 2.00 tokens per request, 2 timed",
        "recorded off: 1 steps, median 2.000 ms, 1.00 tokens per request, 0 timed",
    ]
