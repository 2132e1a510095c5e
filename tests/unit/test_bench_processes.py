"""benchmarks/bench_processes.py: the spread of a bench comparison over fresh-process invocations."""

from __future__ import annotations

from tests.scripts import load_script


def _script():
    return load_script("bench_processes.py")


def _result(ratio, runs, identical=8):
    return {"comparison": {"ratio": {"ratio": ratio, "min": min(runs), "max": max(runs), "runs": runs},
                           "n_identical": identical, "n": 8}}


def test_summary_gives_each_invocation_then_the_median_over_them():
    mod = _script()
    lines = mod.summarise([_result(0.78, [0.67, 0.88, 0.79]), _result(1.006, [0.92, 1.006, 1.0]),
                           {"comparison": None}, _result(0.84, [0.79, 0.85, 0.84], identical=7)])
    assert lines[0] == "invocation 1: 0.780 (paired 0.670-0.880); greedy outputs identical: 8/8"
    assert lines[2] == "invocation 3: no graft/plain ratio (an arm missing or failed)"
    assert lines[3].endswith("identical: 7/8")
    # median of 0.78, 1.006, 0.84; median of the nine paired runs
    assert lines[4] == "over 3 invocations: median ratio 0.840 (min-max 0.780-1.006); median of all 9 paired runs 0.850"


def test_refuses_what_it_cannot_run(capsys):
    mod = _script()
    assert mod.main(["0", "d.yaml"]) == 2
    assert mod.main(["3"]) == 2
    assert mod.main(["3", "d.yaml", "--json", "x.json"]) == 2
    assert "writes --json itself" in capsys.readouterr().err
