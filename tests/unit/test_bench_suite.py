"""`vllm-graft bench --suite` without an engine: the suite file's parsing and validation, the
settings each case gets, the ratio/target logic, the BENCHMARKS.md section writer, the plot,
and the command driven with a stand-in for the bench run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vllm_graft.cli.main import main
from vllm_graft.tools.bench import suite as S

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "benchmarks" / "suite.yaml"


def write_suite(tmp_path, data, name="suite.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def dep(tmp_path, name="d.yaml", dummy=True):
    path = tmp_path / name
    engine = "{dtype: float32, load_format: dummy}" if dummy else "{dtype: float32}"
    path.write_text(f"model: {ROOT / 'models' / 'graft-tiny-llama'}\nengine: {engine}\n")
    return path


# --------------------------------------------------------------------------- the file
def _committed_shape_deployments():
    """deployments/shapes/*.yaml that git tracks (a file still being written is not held to it)."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "deployments/shapes"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    names = [Path(p).name for p in out if p.endswith(".yaml")]
    return sorted(names or (p.name for p in (ROOT / "deployments" / "shapes").glob("*.yaml")))


def test_default_suite_is_valid_and_covers_the_issue():
    suite = S.load_suite(DEFAULT)
    cases = {c.name: c for c in suite.cases}
    shapes = _committed_shape_deployments()
    in_suite = sorted(Path(c.deployment).name for c in suite.cases if "/shapes/" in c.deployment)
    missing = sorted(set(shapes) - set(in_suite))
    assert not missing, f"deployments/shapes/{missing[0]} has no case: add one to benchmarks/suite.yaml"
    for c in suite.cases:
        if Path(c.deployment).name.startswith("noop-"):
            assert c.target == 0.95, c.name
    assert cases["w4a8"].target == 0.8
    assert cases["squeezellm"].target == 0.8 and cases["dfloat11"].target == 0.3
    assert (cases["package-no-deployment"].baseline, cases["package-no-deployment"].target) == ("no-package", 0.98)
    assert cases["snapkv-kvcap"].target == 2.0 and cases["squeezed-4k"].target == 1.2
    assert cases["squeezed-4k"].workload == "long-context-4k"
    for name in ("vllm-ngram-b1", "vllm-ngram-b8"):  # vLLM's own ngram beside the plugins
        argv = S.bench_argv(suite, cases[name], quick=True)
        assert Path(argv[argv.index("--baseline") + 1]) == ROOT / "deployments" / "plain.yaml"
    assert (cases["lookahead-b1"].target, cases["lookahead-b1"].batch) == (2.0, 1)
    assert (cases["lookahead-b8"].target, cases["lookahead-b8"].batch) == (1.2, 8)
    assert (cases["adaptive-b32"].target, cases["adaptive-b32"].batch) == (1.0, 32)
    assert suite.settings(cases["adaptive-b32"], quick=False)["num_prompts"] >= 32  # 32 in flight
    assert suite.resolve(suite.output.markdown) == ROOT / "BENCHMARKS.md"


def test_settings_layers(tmp_path):
    d = dep(tmp_path)
    path = write_suite(tmp_path, {
        "defaults": {"num_prompts": 6, "repeat": 5},
        "quick": {"num_prompts": 2, "repeat": 2},
        "cases": [{"name": "a", "deployment": d.name, "max_tokens": 48, "quick": {"max_tokens": 8}},
                  {"name": "b", "deployment": d.name, "workload": "code-completion", "batch": 1}]})
    suite = S.load_suite(path)
    a, b = suite.cases
    assert suite.settings(a, quick=False) == S.BUILTIN_DEFAULTS | {"num_prompts": 6, "repeat": 5, "max_tokens": 48}
    assert suite.settings(a, quick=True) == S.BUILTIN_DEFAULTS | {"num_prompts": 2, "repeat": 2, "max_tokens": 8}
    assert suite.settings(b, quick=True)["batch"] == 1 and suite.settings(b, quick=True)["max_tokens"] == 32
    argv = S.bench_argv(suite, b, quick=False)
    assert argv[0] == str(d.resolve())  # relative to the suite file
    assert argv[1:] == ["--workload", "code-completion", "--num-prompts", "6", "--max-tokens", "32",
                        "--repeat", "5", "--pairs", "2", "--seed", "0", "--batch", "1", "--ignore-eos", "--interleave", "step",
                        "--no-ppl"]  # dummy weights
    real = dep(tmp_path, "real.yaml", dummy=False)
    suite.cases[1].deployment = real.name
    assert "--no-ppl" not in S.bench_argv(suite, b, quick=False)
    suite.cases[1].ppl = False
    assert "--no-ppl" in S.bench_argv(suite, b, quick=False)
    suite.cases[1].quick.interleave = "run"  # a case's own quick settings win
    assert S.bench_argv(suite, b, quick=True)[-3:-1] == ["--interleave", "run"]
    assert S.bench_argv(suite, b, quick=False)[-3:-1] == ["--interleave", "step"]
    suite.cases[1].quick.pairs = 4  # more pairs of fresh engine processes
    argv = S.bench_argv(suite, b, quick=True)
    assert argv[argv.index("--pairs") + 1] == "4" and S.bench_argv(suite, b, quick=False)[9:11] == ["--pairs", "2"]


@pytest.mark.parametrize("case, field, words", [
    ({"name": "a", "deployment": "d.yaml", "target": "fast"}, "cases[0].target", "valid number"),
    ({"name": "a", "deployment": "d.yaml", "target": -1}, "cases[0].target", "greater than 0"),
    ({"name": "a", "deployment": "d.yaml", "batch": -2}, "cases[0].batch", "greater than or equal to 0"),
    ({"name": "a", "deployment": "d.yaml", "reapeat": 3}, "cases[0].reapeat", "Extra inputs"),
    ({"name": "a", "deployment": "d.yaml", "workload": "chatt"}, "cases[0].workload", "did you mean 'chat'"),
    ({"name": "a b", "deployment": "d.yaml"}, "cases[0].name", "pattern"),
    ({"name": "a"}, "cases[0].deployment", "Field required"),
    ({"name": "a", "deployment": "d.yaml", "quick": {"repeat": 0}}, "cases[0].quick.repeat", "greater than or equal to 1"),
])
def test_a_bad_case_names_the_field(tmp_path, case, field, words):
    dep(tmp_path)
    path = write_suite(tmp_path, {"cases": [case]})
    with pytest.raises(S.SuiteError) as e:
        S.load_suite(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and f"{field}:" in msg and words in msg, msg


def test_suite_level_problems(tmp_path):
    d = dep(tmp_path)
    for data, words in [
        ({"cases": []}, "cases: List should have at least 1 item"),
        ({"cases": [{"name": "a", "deployment": d.name}] * 2}, "cases[1].name: 'a' is used twice"),
        ({"defaults": {"num_prompts": 0}, "cases": [{"name": "a", "deployment": d.name}]},
         "defaults.num_prompts: Input should be greater than or equal to 1"),
        ({"output": {"plots": "x.png"}, "cases": [{"name": "a", "deployment": d.name}]}, "output.plots: Extra inputs"),
        ({"cases": [{"name": "a", "deployment": "missing.yaml"}]}, "cases[0].deployment: no file 'missing.yaml'"),
        (["not", "a", "mapping"], "a suite is a mapping"),
    ]:
        with pytest.raises(S.SuiteError) as e:
            S.load_suite(write_suite(tmp_path, data))
        assert words in str(e.value), (data, str(e.value))
    (tmp_path / "broken.yaml").write_text("cases: [\n")
    with pytest.raises(S.SuiteError, match="not valid YAML"):
        S.load_suite(tmp_path / "broken.yaml")
    with pytest.raises(S.SuiteError, match="cannot read"):
        S.load_suite(tmp_path / "nowhere.yaml")


def test_select_cases():
    suite = S.load_suite(DEFAULT)
    assert [c.name for c in suite.select(None)] == [c.name for c in suite.cases]
    assert [c.name for c in suite.select(["w4a8,noop-moe"])] == ["noop-moe", "w4a8"]  # suite order
    with pytest.raises(S.SuiteError, match="unknown case\\(s\\) 'w4a9'; cases: package-no-deployment, a-a-control, noop-attention"):
        suite.select(["w4a9"])


# ---------------------------------------------------------------- ratio, target, rows
def test_target_met():
    assert S.target_met(0.96, 0.95) is True
    assert S.target_met(0.95, 0.95) is True  # "at least"
    assert S.target_met(0.94, 0.95) is False
    assert S.target_met(None, 0.95) is None and S.target_met(1.2, None) is None


def _summary(runs, kv, rss, ppl):
    return {"output_tok_s": sorted(runs)[len(runs) // 2], "output_tok_s_runs": runs, "output_tok_s_min": min(runs),
            "output_tok_s_max": max(runs), "kv_blocks_peak": kv, "peak_rss_mib": rss, "perplexity": ppl}


def fake_result(plain_runs, graft_runs, *, ppl=(2.0, 2.1), identical=(8, 8), busy=0.2):
    from vllm_graft.tools.bench import ratio_of

    arms = {}
    for arm, runs, kv, rss, p in (("plain", plain_runs, 10, 1000.0, ppl[0]), ("graft", graft_runs, 5, 900.0, ppl[1])):
        arms[arm] = {"engine": {"load_s": 30.0}, "overall": _summary(runs, kv, rss, p),
                     "workloads": {"chat": {"summary": {"other_cpus": busy}}}}
    return {"model": "/x/models/shapes/llama-108m", "plugins": ["attention:noop"], "arms": arms,
            "settings": {"workloads": ["chat"], "num_prompts": 8, "max_tokens": 32, "batch": 0,
                         "repeat": len(plain_runs), "order": [["graft", "plain"], ["plain", "graft"], ["graft", "plain"]]},
            "comparison": {"ratio": ratio_of(plain_runs, graft_runs), "n_identical": identical[0], "n": identical[1]},
            "wall_s": 100.0}


def test_case_row_and_markdown():
    suite = S.load_suite(DEFAULT)
    case = {c.name: c for c in suite.cases}["noop-attention"]
    row = S.case_row(case, ["deployments/shapes/noop-attention.yaml", "--workload", "chat"],
                     fake_result([100.0, 110.0, 90.0], [95.0, 99.0, 95.0], busy=0.7), quick=False)
    assert row["ratio"] == pytest.approx(0.95) and row["met"] is True and row["target"] == 0.95
    assert (row["ratio_min"], row["ratio_max"]) == (pytest.approx(0.9), pytest.approx(95 / 90))
    assert row["ppl_change"] == pytest.approx(0.05) and row["model"] == "llama-108m"
    assert row["busy_cpus_max"] == 0.7
    assert row["command"] == "vllm-graft bench deployments/shapes/noop-attention.yaml --workload chat"
    slow = S.case_row(case, ["x"], fake_result([100.0, 100.0, 100.0], [94.0, 94.0, 94.0], ppl=(None, None),
                                               identical=(7, 8)), quick=True)
    assert slow["met"] is False and slow["ppl_change"] is None
    meta = {"command": "vllm-graft bench --suite", "date": "2026-11-25 12:00 UTC", "machine": "2 CPUs",
            "duration_min": 12.34, "busy_limit": 0.5, "results": "benchmarks/suite-results.json"}
    md = S.render_markdown([row, slow, S.failed_row(case, ["x"], "exit code 4", quick=False)], meta, "benchmarks/suite.png")
    lines = md.splitlines()
    assert lines[0].startswith("Generated by `vllm-graft bench --suite` (2026-11-25 12:00 UTC; 2 CPUs; the whole "
                               "run took 12.3 min)")
    table = [ln for ln in lines if ln.startswith("| noop-attention")]
    assert len(table) == 3
    cells = [c.strip() for c in table[0].split("|")[1:-1]]
    assert "| deployment (in deployments/) |" in md
    assert cells[:8] == ["noop-attention", "`shapes/noop-attention.yaml`", "llama-108m", "chat 8 x 32",
                         "100.0 (90-110)", "95.0 (95-99)", "**0.950** (0.90-1.06)", ">= 0.95: yes"]
    assert cells[8:12] == ["10 / 5", "1000 / 900", "+5.00% ppl", "8/8"]
    slow_cells = [c.strip() for c in table[1].split("|")[1:-1]]
    assert slow_cells[6:8] == ["**0.940** (0.94-0.94)", ">= 0.95: **no**"] and slow_cells[10:12] == ["-", "7/8"]
    assert "quick" in slow_cells[-1]
    assert cells[12] == "**0.7** (disturbed)" and slow_cells[12] == "0.2"  # above busy_limit 0.5: flagged
    assert "failed: exit code 4" in table[2]
    # --pairs: the runs column says pairs x rounds, the ratio cell each pair's own ratio
    two = fake_result([100.0, 100.0, 100.0, 100.0], [99.0, 101.0, 108.0, 110.0])
    two["settings"] |= {"repeat": 2, "pairs": 2}
    two["comparison"]["ratio"]["by_pair"] = [1.0, 1.09]
    cells = [c.strip() for c in S.render_markdown([S.case_row(case, ["x"], two, quick=True)], meta, None)
             .splitlines()[4].split("|")[1:-1]]
    assert cells[6] == "**1.045** (0.99-1.10); pairs 1.00/1.09" and cells[-1].startswith("2x2 quick,")
    assert md.rstrip().endswith("![plugin / plain tokens/s per case, with the targets](benchmarks/suite.png)")


def test_merge_rows_keeps_earlier_runs_in_suite_order():
    suite = S.load_suite(DEFAULT)
    old = {"w4a8": {"name": "w4a8", "ratio": 0.7, "met": True, "target": 0.5},
           "gone": {"name": "gone", "ratio": 1.0}}
    new = {"noop-moe": {"name": "noop-moe", "ratio": 1.0, "met": True}}
    rows = S.merge_rows(suite, old, new)
    assert [r["name"] for r in rows] == ["noop-moe", "w4a8"]  # removed cases dropped, unrun left out
    assert rows[1]["target"] == 0.8 and rows[1]["met"] is False  # judged against today's target


# ----------------------------------------------------------------- the marked section
DOC = "# Title\n\nintro  \n\n<!-- bench-suite:start -->\nold table\n<!-- bench-suite:end -->\n\n## After\ntext\n"


def test_replace_section_keeps_the_rest_and_is_idempotent():
    once = S.replace_section(DOC, "new table\n")
    assert once == DOC.replace("old table\n", "new table\n")
    assert S.replace_section(once, "new table\n") == once
    before, after = DOC.split("<!-- bench-suite:start -->")[0], DOC.split("<!-- bench-suite:end -->")[1]
    assert once.startswith(before) and once.endswith(after)
    for bad in ("no markers", DOC.replace("<!-- bench-suite:end -->", ""),
                DOC + "<!-- bench-suite:start -->\n",
                "<!-- bench-suite:end -->\n<!-- bench-suite:start -->\n"):
        with pytest.raises(ValueError, match="bench-suite:start"):
            S.replace_section(bad, "x\n")


def test_benchmarks_md_has_the_markers():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert S.replace_section(text, "x\n").count(S.MARK_START) == 1


# ----------------------------------------------------------------------- the plot
def test_plot(tmp_path):
    rows = [{"name": "a", "ratio": 0.9, "ratio_min": 0.8, "ratio_max": 1.0, "target": 0.95, "met": False},
            {"name": "b", "ratio": 2.3, "ratio_min": 2.1, "ratio_max": 2.4, "target": 2.0, "met": True},
            {"name": "c", "failed": "exit code 4"}]
    path = tmp_path / "s.png"
    assert S.write_suite_plot(rows, path) is True
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 100_000


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert S.write_suite_plot([{"name": "a", "ratio": 1.0}], tmp_path / "s.png") is False
    assert not (tmp_path / "s.png").exists()


# ---------------------------------------------------------------------- the command
def test_suite_command_writes_results_section_and_plot(tmp_path, monkeypatch, capsys):
    d = dep(tmp_path)
    (tmp_path / "B.md").write_text(DOC)
    path = write_suite(tmp_path, {
        "output": {"results": "r.json", "markdown": "B.md", "plot": "s.png"},
        "quick": {"repeat": 2},
        "cases": [{"name": "fast", "deployment": d.name, "target": 0.95},
                  {"name": "slow", "deployment": d.name, "target": 2.0},
                  {"name": "broken", "deployment": d.name}]})
    calls = []

    def fake_run_bench(ns, out, err, progress=None):
        calls.append(ns)
        assert progress is not None  # the suite's own progress display
        if len(calls) == 3:
            return 4, None
        return 0, fake_result([100.0, 100.0], [96.0, 100.0] if len(calls) == 1 else [150.0, 160.0])

    from vllm_graft.tools.bench import command

    monkeypatch.setattr(command, "run_bench", fake_run_bench)
    rc = main(["bench", "--suite", str(path), "--quick"])
    out = capsys.readouterr().out
    assert rc == 4  # a case failed; the others were still run and written
    assert [(c.deployment, c.repeat, c.no_ppl) for c in calls] == [(str(d.resolve()), 2, True)] * 3
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["name"] for r in data["rows"]] == ["fast", "slow", "broken"]
    assert data["rows"][0]["met"] is True and data["rows"][1]["met"] is False
    assert data["rows"][2]["failed"] == "exit code 4"
    md = (tmp_path / "B.md").read_text()
    assert md.startswith("# Title\n\nintro  \n\n<!-- bench-suite:start -->\nGenerated by `vllm-graft bench --suite")
    assert md.endswith("<!-- bench-suite:end -->\n\n## After\ntext\n")
    assert "| fast |" in md and ">= 2: **no**" in md and "![plugin / plain" in md and "(s.png)" in md
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "suite wall time" in out

    # --only: one case again; the other rows keep their earlier figures
    calls.clear()
    assert main(["bench", "--suite", str(path), "--only", "slow", "--no-write"]) == 0
    assert len(calls) == 1
    assert json.loads((tmp_path / "r.json").read_text()) == data  # --no-write wrote nothing


def test_suite_command_refusals(tmp_path, capsys):
    path = write_suite(tmp_path, {"cases": [{"name": "a", "deployment": "missing.yaml"}]})
    assert main(["bench", "--suite", str(path)]) == 2
    assert "cases[0].deployment: no file 'missing.yaml'" in capsys.readouterr().err
    assert main(["bench", "--suite", str(DEFAULT), "--only", "nope"]) == 2
    assert "unknown case(s) 'nope'" in capsys.readouterr().err
    assert main(["bench", "--suite", "--list-cases", "--quick"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "lookahead-b1 (target >= 2): vllm-graft bench" in out and "--batch 1" in out


def test_render_rewrites_the_section_from_saved_results(tmp_path, monkeypatch):
    d = dep(tmp_path)
    (tmp_path / "B.md").write_text(DOC)
    path = write_suite(tmp_path, {"output": {"results": "r.json", "markdown": "B.md", "plot": None},
                                  "cases": [{"name": "a", "deployment": d.name, "target": 1.5},
                                            {"name": "b", "deployment": d.name}]})
    from vllm_graft.tools.bench import command

    monkeypatch.setattr(command, "run_bench", lambda *a, **k: (0, fake_result([100.0] * 3, [120.0] * 3)))
    assert main(["bench", "--suite", str(path), "--only", "a"]) == 0
    first = (tmp_path / "B.md").read_text()
    assert "| a |" in first and "| b |" not in first and ">= 1.5: **no**" in first
    assert "more than one run" not in first
    assert main(["bench", "--suite", str(path), "--only", "b"]) == 0
    both = (tmp_path / "B.md").read_text()
    assert "| a |" in both and "| b |" in both and "more than one run" in both

    def never(*a, **k):
        raise AssertionError("--render runs nothing")

    monkeypatch.setattr(command, "run_bench", never)
    (tmp_path / "B.md").write_text(DOC)
    assert main(["bench", "--suite", str(path), "--render"]) == 0
    assert (tmp_path / "B.md").read_text() == both  # the same section from the saved rows


def test_a_ratio_just_below_its_target_is_not_rounded_up():
    row = {"ratio": 0.9496, "ratio_min": 0.92, "ratio_max": 0.96, "repeat": 3, "target": 0.95, "met": False}
    assert S._ratio(row) == "**0.9496** (0.92-0.96)" and S._target(row) == ">= 0.95: **no**"
    assert S._ratio(row | {"ratio": 0.9512, "met": True}) == "**0.951** (0.92-0.96)"


def test_a_decode_metric_case_takes_the_decode_ratio():
    """A case with ``metric: decode`` (squeezed-4k: the target is decode speed) is judged by the
    bench's decode ratio (1 / median inter-token latency), not by output tokens/s with prefill in it."""
    from vllm_graft.tools.bench.stats import _decode_runs, ratio_of

    raw = {"workloads": {"a": {"repeats": [{"itl_p50_s": 0.02}, {"itl_p50_s": 0.04}]},
                         "b": {"repeats": [{"itl_p50_s": 0.04}, {"itl_p50_s": 0.04}]}}}
    sets = [type("PS", (), {"name": n})() for n in ("a", "b")]
    assert _decode_runs(raw, sets) == [pytest.approx(1 / 0.03), pytest.approx(25.0)]
    raw["workloads"]["b"]["repeats"][1]["itl_p50_s"] = None  # a run without decode tokens
    assert _decode_runs(raw, sets) == []
    suite = S.load_suite(DEFAULT)
    case = {c.name: c for c in suite.cases}["squeezed-4k"]
    assert case.metric == "decode"
    result = fake_result([10.0, 10.0, 10.0], [8.0, 8.0, 8.0])  # output tok/s: 0.8 with prefill
    result["comparison"]["decode_ratio"] = ratio_of([50.0, 50.0, 50.0], [65.0, 60.0, 70.0])
    row = S.case_row(case, ["x"], result, quick=True)
    assert row["ratio"] == pytest.approx(1.3) and row["met"] is True and row["metric"] == "decode"
    assert S._ratio(row).endswith(" decode")
    with pytest.raises(S.SuiteError, match="metric"):
        S.parse_suite({"cases": [{"name": "x", "deployment": "d.yaml", "metric": "latency"}]}, "s.yaml")


def test_a_baseline_file_that_is_not_there_is_refused(tmp_path):
    (tmp_path / "d.yaml").write_text("model: m\n")
    (tmp_path / "s.yaml").write_text("cases: [{name: x, deployment: d.yaml, baseline: nowhere.yaml}]\n")
    with pytest.raises(S.SuiteError, match="cases\\[0\\].baseline: no file 'nowhere.yaml'"):
        S.load_suite(tmp_path / "s.yaml")
    (tmp_path / "s.yaml").write_text("cases: [{name: x, deployment: d.yaml, baseline: no-package}]\n")
    assert S.load_suite(tmp_path / "s.yaml").cases[0].baseline == "no-package"


def test_a_case_that_needs_a_missing_package_is_skipped_and_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    d = dep(tmp_path)
    path = write_suite(tmp_path, {
        "output": {"results": "r.json", "markdown": None, "plot": None},
        "cases": [{"name": "peer", "deployment": d.name, "requires": "no_such_module_xyz: make peer"},
                  {"name": "here", "deployment": d.name, "requires": "yaml: pip install pyyaml"}]})
    calls = []
    from vllm_graft.tools.bench import command

    monkeypatch.setattr(command, "run_bench",
                        lambda ns, *a, **k: (calls.append(ns), (0, fake_result([100.0] * 3, [120.0] * 3)))[1])
    assert main(["bench", "--suite", str(path)]) == 0  # a skip is not a failure
    out = " ".join(capsys.readouterr().out.split())
    assert "peer: skipped, needs the Python package 'no_such_module_xyz' (make peer)" in out
    assert len(calls) == 1 and [r["name"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]] == ["here"]
    with pytest.raises(S.SuiteError, match="requires"):
        S.load_suite(write_suite(tmp_path, {"cases": [{"name": "x", "deployment": d.name, "requires": "no colon"}]},
                                 name="bad.yaml"))


def test_suffix_tree_of_vllms_peer_is_emptied_before_each_timed_run():
    """vLLM's `suffix` drafter caches earlier responses; the bench evicts them in the worker
    (a stand-in for arctic_inference's SuffixDecodingCache: cached_requests, evict_cached_response)."""
    from types import SimpleNamespace

    from vllm_graft.tools.bench.arm import _empty_suffix_tree

    class Cache:
        def __init__(self):
            self.responses = {"r1": [1, 2], "r2": [3]}

        @property
        def cached_requests(self):
            return self.responses.keys()

        def evict_cached_response(self, req_id):
            del self.responses[req_id]

    cache = Cache()
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=SimpleNamespace(suffix_cache=cache)))
    assert _empty_suffix_tree(worker) == 2 and cache.responses == {}
    assert _empty_suffix_tree(SimpleNamespace(model_runner=SimpleNamespace(drafter=None))) == 0


def test_a_long_only_list_is_cut_in_the_generated_line():
    cmd = "vllm-graft bench --suite --quick " + " ".join(f"--only c{i}" for i in range(30))
    assert S.short_command(cmd) == "vllm-graft bench --suite --quick --only c0 --only c1 ... (30 cases)"
    assert S.short_command("vllm-graft bench --suite --only a --only b") == "vllm-graft bench --suite --only a --only b"
