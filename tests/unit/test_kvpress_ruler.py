"""kvpress's RULER figures beside kvbench's (kvpress_compare.ruler_beside / format_ruler_beside and
`vllm-graft kvbench --suite ruler --ruler-from ... --kvpress ...`), without kvpress or an engine:
the merge of the two result sets on hand-made rows, the difference where vllm-graft loses, and the
refusals (other prompts by digest, an arm of a shared press missing, printed rows without a digest,
stored kvbench rows of other cases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_graft.tools import workloads as W
from vllm_graft.tools.kvcompress import kvbench
from vllm_graft.tools.kvcompress import kvpress_compare as kc
from vllm_graft.tools.workloads import ruler as R

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama-recall"
TASKS = ["single", "multivalue"]
CASE_TASKS = ["single", "single", "multivalue", "multivalue"]
DIGEST = "0123456789abcdef"


def ours_rows():
    def row(arm, scores):
        return {"arm": arm, "ruler_tasks": CASE_TASKS, "ruler_scores": scores}

    return [
        row("plain", [1.0, 0.0, 1 / 3, 1 / 3]),
        row("snapkv 1/4", [1.0, 0.0, 1 / 3, 0.0]),
        row("streaming 1/4", [0.0, 0.0, 1 / 3, 0.0]),
        row("snapkv 1/2", [1.0, 0.0, 1 / 3, 0.0]),  # listed after 1/4: shown before it
        row("rkv 1/4", [1.0, 1.0, 0.0, 0.0]),  # no kvpress press: stands alone
    ]


def theirs(digest=DIGEST, rows=None):
    def row(arm, scores, **kw):
        return {"arm": arm, "mode": "prompt", "ruler_tasks": CASE_TASKS, "ruler_scores": scores, **kw}

    meta = {
        "ruler_cases": 4,
        "ruler_digest": digest,
        "ruler_tasks": TASKS,
        "ruler_per_task": 2,
        "ruler_context": 1984,
        "seed": 0,
        "budget": "context",
        "versions": {"kvpress": "0.5.5", "transformers": "5.2.0"},
    }
    if rows is None:
        rows = [
            row("plain", [1.0, 0.0, 1 / 3, 0.0]),
            row("snapkv 1/4", [0.0, 0.0, 0.0, 0.0], press_name="SnapKVPress", ruler_kept_tokens_median=512),
            row("snapkv 1/2", [1.0, 0.0, 0.0, 0.0], press_name="SnapKVPress"),
            row("streaming 1/4", [1.0, 0.0, 1 / 3, 0.0], press_name="StreamingLLMPress"),
            row("streaming 1/4", [1.0, 0.0, 0.0, 0.0], mode="context"),  # another mode: not this table's
            row("tova 1/8", [0.0, 0.0, 0.0, 0.0], press_name="TOVAPress"),  # kvbench did not run it
        ]
    return {"meta": [meta], "rows": rows}


def test_beside_pairs_arms_averages_and_differences():
    res = kc.ruler_beside(ours_rows(), theirs(), tasks=TASKS, digest=DIGEST)
    assert [r["arm"] for r in res["rows"]] == ["plain", "snapkv 1/2", "snapkv 1/4", "streaming 1/4"]
    plain, _, snap, stream = res["rows"]
    # every task weighs the same: (mean single + mean multivalue) / 2
    assert plain["ours"] == pytest.approx((0.5 + 1 / 3) / 2) and plain["theirs"] == pytest.approx((0.5 + 1 / 6) / 2)
    assert plain["same_cases"] == 3 and plain["press"] == "none" and plain["kept"] == "all"
    assert snap["difference"] == pytest.approx((0.5 + 1 / 6) / 2) and snap["behind"] == {}
    assert snap["press"] == "SnapKVPress" and snap["kept"] == "1/4" and snap["kvpress_kept_tokens"] == 512
    assert stream["difference"] == pytest.approx(-0.25)  # vllm-graft loses one single case
    assert stream["behind"] == {"single": pytest.approx(-0.5)}
    assert stream["tasks"]["single"] == (0.0, 0.5)
    assert res["alone"] == ["rkv 1/4"] and res["kvpress_only"] == ["tova 1/8"]
    assert (res["cases"], res["budget"], res["digest"]) == (4, "context", DIGEST)


def test_beside_table_says_where_vllm_graft_loses():
    text = kc.format_ruler_beside(kc.ruler_beside(ours_rows(), theirs(), tasks=TASKS, digest=DIGEST))
    lines = text.splitlines()
    assert lines[0] == "| vllm-graft | kvpress | kept | vllm-graft | kvpress | difference | single | multivalue |"
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| plain | none | all | 0.417 | 0.333 | +0.083 | 0.50 / 0.50 | 0.33 / 0.17 |"
    assert lines[3] == "| snapkv | SnapKVPress | 1/2 | 0.333 | 0.250 | +0.083 | 0.50 / 0.50 | 0.17 / 0.00 |"
    assert lines[4] == "| snapkv | SnapKVPress | 1/4 | 0.333 | 0.000 | +0.333 | 0.50 / 0.00 | 0.17 / 0.00 |"
    assert lines[5] == (
        "| streaming | StreamingLLMPress | 1/4 | 0.083 | 0.333 | -0.250 (loses: single -0.50) | 0.00 / 0.50 | 0.17 / 0.17 |"
    )
    assert "same score on 3 of 4 cases" in text
    assert "no kvpress press for: rkv 1/4" in text and "kvpress only (kvbench did not run them): tova 1/8" in text


def test_equal_average_is_no_loss_but_the_task_behind_is_named():
    ours = ours_rows()[:1] + [{**ours_rows()[2], "ruler_scores": [1.0, 0.0, 0.0, 0.0]}]  # single up, multivalue down
    rows = theirs()["rows"][:1] + [{**theirs()["rows"][3], "ruler_scores": [0.0, 0.0, 1.0, 0.0]}]
    res = kc.ruler_beside(ours, theirs(rows=rows), tasks=TASKS, digest=DIGEST)
    stream = res["rows"][1]
    assert stream["difference"] == 0.0
    line = kc.format_ruler_beside(res).splitlines()[3]  # plain, then streaming 1/4
    assert "| +0.000 (behind on multivalue -0.50) |" in line and "loses" not in line


def test_other_prompts_refused_by_digest():
    with pytest.raises(kc.RulerMismatch, match="other RULER prompts.*digest ffff.*than kvbench's.*0123456789abcdef"):
        kc.ruler_beside(ours_rows(), theirs(digest="ffff"), tasks=TASKS, digest=DIGEST)
    merged = theirs()
    merged["meta"].append({**merged["meta"][0], "ruler_digest": "ffff"})  # one of two files is of other prompts
    with pytest.raises(
        kc.RulerMismatch, match="rerun kvpress_compare with --ruler single,multivalue --ruler-per-task 2"
    ):
        kc.check_ruler_results(merged, digest=DIGEST, labels=["plain"], tasks=TASKS, case_tasks=CASE_TASKS)


def test_missing_press_refused_with_the_command_to_run():
    ours = [*ours_rows(), {**ours_rows()[1], "arm": "tova 1/2"}, {**ours_rows()[1], "arm": "tova 1/4"}]
    with pytest.raises(kc.RulerMismatch) as e:
        kc.ruler_beside(ours, theirs(), tasks=TASKS, digest=DIGEST)
    msg = str(e.value)
    assert "lack tova 1/2, tova 1/4" in msg
    assert "--presses tova --fractions 2,4" in msg and "--ruler single,multivalue --ruler-per-task 2" in msg
    no_plain = theirs(rows=theirs()["rows"][1:])
    with pytest.raises(kc.RulerMismatch, match="no plain RULER row"):
        kc.ruler_beside(ours_rows(), no_plain, tasks=TASKS, digest=DIGEST)
    # a context-mode row does not stand in for the whole-prompt one
    ctx_only = theirs(rows=[theirs()["rows"][0], theirs()["rows"][4]])
    with pytest.raises(kc.RulerMismatch, match="lack snapkv 1/4, snapkv 1/2, streaming 1/4"):
        kc.ruler_beside(ours_rows(), ctx_only, tasks=TASKS, digest=DIGEST)


def test_printed_rows_or_other_cases_refused():
    printed = {"meta": [], "rows": theirs()["rows"]}  # read_kvpress of a log: no meta
    with pytest.raises(kc.RulerMismatch, match="no RULER digest"):
        kc.ruler_beside(ours_rows(), printed, tasks=TASKS, digest=DIGEST)
    other = theirs()
    other["rows"][1] = {**other["rows"][1], "ruler_tasks": ["single"] * 4}
    with pytest.raises(kc.RulerMismatch, match="'snapkv 1/4' scored other cases"):
        kc.ruler_beside(ours_rows(), other, tasks=TASKS, digest=DIGEST)


# ------------------------------------------------------------------- through kvbench
def case(task, answer):
    return R.RulerCase(task, (1, 2, 3), tuple(answer), 0.5, "x.py@0")


CASES = [case("single", [(7, 8)]), case("multivalue", [(4,), (5,)])]


def stored(tmp_path, name, rows, **meta):
    path = tmp_path / name
    path.write_text(json.dumps({"context": 2048, **meta, "rows": rows}))
    return str(path)


def row(arm, scores, outputs=None):
    r = {"arm": arm, "ruler_tasks": ["single", "multivalue"], "ruler_scores": scores}
    return r if outputs is None else {**r, "ruler_outputs": outputs}


def test_ruler_from_merges_files_later_arm_wins(tmp_path):
    a = stored(
        tmp_path,
        "a.json",
        [row("plain", [1.0, 0.5], [[7, 8, 0], [4, 9]]), row("h2o 1/2", [0.0, 0.0])],
        ruler_digest="d",
    )
    b = stored(tmp_path, "b.json", [row("h2o 1/2", [1.0, 0.0], [[7, 8], [9]])])
    rows = kvbench.load_ruler_results([a, b], CASES, "d", context=2048)
    assert [(r["arm"], r["ruler_scores"]) for r in rows] == [("plain", [1.0, 0.5]), ("h2o 1/2", [1.0, 0.0])]


def test_ruler_from_refuses_rows_of_other_prompts(tmp_path):
    good = [row("plain", [1.0, 0.5], [[7, 8], [5]])]
    with pytest.raises(SystemExit, match="other RULER prompts \\(digest e, these: d\\)"):
        kvbench.load_ruler_results([stored(tmp_path, "x.json", good, ruler_digest="e")], CASES, "d", context=2048)
    with pytest.raises(SystemExit, match="--context 1024, not 2048"):
        kvbench.load_ruler_results([stored(tmp_path, "x.json", good, context=1024)], CASES, "d", context=2048)
    # no digest: the outputs must score as recorded on these cases
    wrong = [row("plain", [1.0, 0.5], [[7, 9], [5]])]
    with pytest.raises(SystemExit, match="'plain''s outputs do not score as recorded"):
        kvbench.load_ruler_results([stored(tmp_path, "x.json", wrong)], CASES, "d", context=2048)
    assert kvbench.load_ruler_results([stored(tmp_path, "x.json", good)], CASES, "d", context=2048)[0]["arm"] == "plain"
    with pytest.raises(SystemExit, match="nothing shows it ran these prompts"):
        kvbench.load_ruler_results([stored(tmp_path, "x.json", [row("plain", [1.0, 0.5])])], CASES, "d", context=2048)
    other_cases = [{**good[0], "ruler_tasks": ["single", "single"]}]
    with pytest.raises(SystemExit, match="scored other cases than --ruler-tasks single,multivalue --ruler-cases 1"):
        kvbench.load_ruler_results([stored(tmp_path, "x.json", other_cases)], CASES, "d", context=2048)
    with pytest.raises(SystemExit, match="no rows"):
        kvbench.load_ruler_results([stored(tmp_path, "x.json", [])], CASES, "d", context=2048)


def parse(*argv):
    from vllm_graft.cli.main import build_parser

    return build_parser().parse_args(["kvbench", *argv])


def test_kvpress_and_ruler_from_need_the_ruler_suite():
    with pytest.raises(SystemExit, match="--kvpress needs --suite ruler"):
        kvbench.check_suite_args(parse("--kvpress", "k.json"))
    with pytest.raises(SystemExit, match="--ruler-from needs --suite ruler"):
        kvbench.check_suite_args(parse("--ruler-from", "o.json"))
    args = parse("--suite", "ruler", "--ruler-from", "a.json", "--ruler-from", "b.json", "--kvpress", "k.json")
    assert args.ruler_from == ["a.json", "b.json"] and args.kvpress == ["k.json"]
    kvbench.check_suite_args(args)


@pytest.fixture(scope="module")
def real():
    """kvbench's own cases (the recall model's tokenizer, 1 case of each default task at 1024)."""
    tok = W.Tokenizer.from_model(MODEL)
    cases = R.ruler_suite(tok, tasks=["single", "multikey"], num_per_task=1, context_tokens=1024 - kvbench.RULER_ROOM)
    return tok, cases, kc.digest([c.token_ids for c in cases])


def test_kvbench_prints_kvpress_beside_ours_without_an_engine(tmp_path, capsys, real):
    tok, cases, dig = real
    tasks = ["single", "multikey"]
    ours = [
        {"arm": arm, "ruler_tasks": tasks, "ruler_scores": s}
        for arm, s in [("plain", [1.0, 0.0]), ("snapkv 1/2", [1.0, 0.0]), ("tova 1/2", [0.0, 0.0])]
    ]
    ours_path = stored(tmp_path, "ours.json", ours, context=1024, ruler_digest=dig)
    meta = {"ruler_cases": 2, "ruler_digest": dig, "budget": "context", "versions": {"kvpress": "0.5.5"}}
    kvp = [
        {"arm": arm, "mode": "prompt", "ruler_tasks": tasks, "ruler_scores": s, "press_name": p}
        for arm, s, p in [
            ("plain", [1.0, 0.0], None),
            ("snapkv 1/2", [0.0, 0.0], "SnapKVPress"),
            ("tova 1/2", [1.0, 0.0], "TOVAPress"),
        ]
    ]
    kvp_path = tmp_path / "kvpress.json"
    kvp_path.write_text(json.dumps({"meta": meta, "rows": kvp}))
    out_path = tmp_path / "merged.json"
    argv = [
        "--suite",
        "ruler",
        "--context",
        "1024",
        "--ruler-tasks",
        "single,multikey",
        "--ruler-cases",
        "1",
        "--ruler-from",
        ours_path,
        "--kvpress",
        str(kvp_path),
        "--ruler-out",
        str(out_path),
    ]
    assert kvbench._main_ruler(parse(*argv), str(MODEL), tok, []) == 0
    out = capsys.readouterr().out
    assert f"Beside kvpress 0.5.5 (transformers ?), the same 2 prompts (digest {dig})" in out
    assert "| snapkv | SnapKVPress | 1/2 | 0.500 | 0.000 | +0.500 | 1.00 / 0.00 | 0.00 / 0.00 |" in out
    assert "| tova | TOVAPress | 1/2 | 0.000 | 0.500 | -0.500 (loses: single -1.00) |" in out
    written = json.loads(out_path.read_text())
    assert written["ruler_digest"] == dig and written["seed"] == 0 and written["ruler_context"] == 1024 - 64
    assert [a["arm"] for a in written["arms"]] == ["plain", "snapkv 1/2", "tova 1/2"]
    # kvpress on other prompts: refused before anything is run or printed
    kvp_path.write_text(json.dumps({"meta": {**meta, "ruler_digest": "ffff"}, "rows": kvp}))
    with pytest.raises(SystemExit, match="kvbench: --kvpress: kvpress ran other RULER prompts"):
        kvbench._main_ruler(parse(*argv), str(MODEL), tok, [])
    # a shared press's arm kvpress lacks
    kvp_path.write_text(json.dumps({"meta": meta, "rows": kvp[:2]}))
    with pytest.raises(SystemExit, match="kvbench: --kvpress: the kvpress results lack tova 1/2"):
        kvbench._main_ruler(parse(*argv), str(MODEL), tok, [])
    # kvbench's rows of another seed's prompts
    ours_other = stored(tmp_path, "other.json", ours, context=1024, ruler_digest="abcd")
    with pytest.raises(SystemExit, match="measured on other RULER prompts"):
        kvbench._main_ruler(parse(*[a if a != ours_path else ours_other for a in argv]), str(MODEL), tok, [])


def test_kvpress_ruler_prompts_are_kvbench_s(real):
    """kvpress_compare builds the RULER prompts at kvbench's length by default (--context - 64)."""
    tok, cases, dig = real
    args = kc.parser().parse_args(["--ruler", "single", "--context", "1024"])
    assert args.ruler_context is None and args.ruler_per_task == 16  # kvbench's --ruler-cases default
    n = kc.ruler_prompt_tokens(args.context, args.ruler_context)
    assert n == 1024 - kvbench.RULER_ROOM and kc.ruler_prompt_tokens(1024, 900) == 900
    again = R.ruler_suite(tok, tasks=["single", "multikey"], num_per_task=1, context_tokens=n)
    assert kc.digest([c.token_ids for c in again]) == dig
    assert kc.digest([c.token_ids for c in again][::-1]) != dig  # the order is part of it


def test_a_run_cut_short_keeps_the_arms_it_ran(tmp_path, monkeypatch, real):
    """--ruler-out is written after each arm: a run killed in its second arm leaves the first,
    and that file is a --ruler-from file of the same prompts."""
    tok, cases, dig = real

    def fake_run_arm(model, kv, texts, needles, **kw):
        if kv is not None:
            raise KeyboardInterrupt  # the second arm: the run is cut here
        return {"ruler_tasks": [c.task for c in kw["ruler"]], "ruler_scores": [1.0, 0.0], "ruler_outputs": None}

    monkeypatch.setattr(kvbench, "run_arm", fake_run_arm)
    out_path = tmp_path / "cut.json"
    args = parse(
        "--suite", "ruler", "--context", "1024", "--ruler-tasks", "single,multikey", "--ruler-cases", "1",
        "--ruler-out", str(out_path),
    )  # fmt: skip
    arms = [("plain", None), ("snapkv 1/2", {"plugin": "snapkv", "params": {"budget_blocks": 16}})]
    with pytest.raises(KeyboardInterrupt):
        kvbench._main_ruler(args, str(MODEL), tok, arms)
    written = json.loads(out_path.read_text())
    assert written["partial"] is True and written["ruler_digest"] == dig
    assert [r["arm"] for r in written["rows"]] == ["plain"]
    rows = kvbench.load_ruler_results([str(out_path)], cases, dig, context=1024)
    assert [(r["arm"], r["ruler_scores"]) for r in rows] == [("plain", [1.0, 0.0])]
