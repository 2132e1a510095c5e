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


def _arm_doc(arm, rates, outputs):
    return {"arms": {arm: {
        "overall": {"output_tok_s": sorted(rates)[len(rates) // 2], "output_tok_s_runs": rates},
        "workloads": {"code": {"requests": [{"index": i, "output_token_ids": ids} for i, ids in enumerate(outputs)]}},
    }}}


def test_apart_compares_two_single_arm_documents_run_by_run():
    mod = _script()
    graft = _arm_doc("graft", [90.0, 100.0, 80.0], [[1, 2], [3, 4], [5]])
    plain = _arm_doc("plain", [100.0, 100.0, 100.0], [[1, 2], [3, 9], [5]])
    comparison = mod.apart(graft, plain)["comparison"]
    assert comparison["ratio"]["ratio"] == 0.9  # median 90 over median 100
    assert comparison["ratio"]["runs"] == [0.9, 1.0, 0.8]
    assert (comparison["ratio"]["min"], comparison["ratio"]["max"]) == (0.8, 1.0)
    assert (comparison["n_identical"], comparison["n"]) == (2, 3)  # request 1 differs
    line = mod.invocation(1, mod.apart(graft, plain))[0]
    assert line == "invocation 1: 0.900 (paired 0.800-1.000); greedy outputs identical: 2/3; graft 90, plain 100 tok/s"
    # an arm without a figure: no ratio, as for a failed arm in one bench
    assert mod.apart(graft, {"arms": {}}) == {"comparison": None}


def test_apart_refuses_an_arms_choice_and_a_missing_bench():
    mod = _script()
    assert mod.main(["2", "--apart", "d.yaml", "--arms", "graft"]) == 2
    assert mod.main(["2", "--apart"]) == 2


def test_main_runs_each_arm_alone_swapping_the_order_and_stops_on_a_failed_bench(monkeypatch, capsys):
    mod = _script()
    calls = []

    def fake_bench(arguments, path):
        calls.append(arguments[-1] if "--arms" in arguments else "both")
        arm = arguments[-1]
        if arm in ("graft", "plain"):
            return _arm_doc(arm, [100.0 if arm == "plain" else 90.0], [[1]])
        return {"comparison": {"ratio": {"ratio": 1.0, "min": 1.0, "max": 1.0, "runs": [1.0]}, "n_identical": 1, "n": 1}}

    monkeypatch.setattr(mod, "_bench", fake_bench)
    assert mod.main(["2", "--apart", "d.yaml"]) == 0
    assert calls == ["graft", "plain", "plain", "graft"]
    out = capsys.readouterr().out
    assert "invocation 2: 0.900" in out and "median ratio 0.900" in out
    calls.clear()
    assert mod.main(["2", "d.yaml"]) == 0 and calls == ["both", "both"]
    monkeypatch.setattr(mod, "_bench", lambda arguments, path: 3)
    assert mod.main(["2", "--apart", "d.yaml"]) == 3
    assert "the bench's graft arm exited 3" in capsys.readouterr().err
