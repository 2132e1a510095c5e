"""benchmarks/phase_time.py's report: per method, the median over runs of its time per engine step."""

from __future__ import annotations

from tests.scripts import load_script


def _phase_time():
    return load_script("phase_time.py")


def test_report_gives_each_methods_median_milliseconds_per_step():
    mod = _phase_time()
    runs = [
        {"wall_s": w, "spent": {"execute_model": e, "_sample": s}, "calls": {"execute_model": 10, "_sample": 10}}
        for w, e, s in ((1.0, 0.05, 0.002), (3.0, 0.07, 0.004), (2.0, 0.06, 0.030))
    ]
    lines = mod.report({"plugin": runs})
    assert lines[0].startswith("plugin: run wall median 2.000 s (3 runs), 10 engine steps per run")
    assert "execute_model" in lines[1] and "6.000 ms/step" in lines[1]  # median of 5, 7, 6 ms a step
    assert "_sample" in lines[2] and "0.400 ms/step" in lines[2] and "(1.00 calls/step)" in lines[2]
    assert {t[1] for t in mod.TARGETS} == {
        "Scheduler",
        "GPUModelRunner",
        "OutputProcessor",
        "GraftProposer",
        "Drafting",
        "Adaptive",
    }


def test_report_gives_the_forward_at_the_commonest_step_shape_when_timed():
    mod = _phase_time()
    runs = [
        {"wall_s": 1.0, "spent": {}, "calls": {"execute_model": 10}, "forward_at": (32, 9, f)}
        for f in (0.004, 0.006, 0.005)
    ]
    lines = mod.report({"plain": runs})
    assert lines[1] == "  forward at 32 tokens (the commonest step, 9 in run 1): median over runs 5.000 ms"


def test_report_gives_each_processs_medians_when_there_are_several():
    mod = _phase_time()
    runs = [
        {"wall_s": w, "spent": {}, "calls": {"execute_model": 10}, "forward_at": (32, 9, f), "process": p}
        for w, f, p in ((1.0, 0.004, 0), (1.2, 0.006, 0), (2.0, 0.005, 1))
    ]
    lines = mod.report({"plain": runs})
    assert (
        lines[2] == "  per process (run wall / forward at the commonest step): 1.100 s / 5.000 ms, 2.000 s / 5.000 ms"
    )
    assert all("per process" not in line for line in mod.report({"plain": runs[:2]}))


def test_by_shape_groups_each_step_by_the_tokens_its_forward_computed():
    mod = _phase_time()
    steps = mod.StepRecords()
    steps.add("_sample", 9.0)  # before any step: not recorded
    for t0, tokens, sample in ((0.0, 5, 0.001), (0.010, 17, 0.003), (0.030, 5, 0.002)):
        steps.next_step(t0)
        steps.add("_sample", sample)
        steps.add("_sample", sample)  # a method called twice in a step is summed
        steps.tokens = tokens
    steps.next_step(0.034)
    assert [(n, round(r["step"], 6)) for n, r in steps.done] == [(5, 0.01), (17, 0.02), (5, 0.004)]
    lines = mod.by_shape({"plugin": [{"steps": steps.done}]})
    assert lines[0].startswith("plugin: steps by the tokens their forward computed")
    assert lines[1] == "  5 tokens: 2 steps; step 7.000, _sample 3.000"  # medians of (10, 4) and (2, 4) ms
    assert lines[2] == "  17 tokens: 1 steps; step 20.000, _sample 6.000"
    assert mod.by_shape({"plain": [{"wall_s": 1.0}]}) == []
