"""The RULER-style suite (tools/workloads/ruler.py) without an engine: each task's prompts are
seeded, fit the context, hold their answer where the question points (the key asked for, all
the values, a variable chain that resolves to the value), end exactly where the answer starts;
score_case; the report (tables and SVG plot) of a hand-made result; kvbench's --suite flags."""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from fractions import Fraction
from pathlib import Path

import pytest

from vllm_graft.tools import workloads as W
from vllm_graft.tools.kvcompress import kvbench, ruler_report
from vllm_graft.tools.workloads import ruler as R

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama-recall"
CONTEXT = 1024
N = 4


@pytest.fixture(scope="module")
def tok():
    return W.Tokenizer.from_model(MODEL)


@pytest.fixture(scope="module")
def suite(tok):
    return R.ruler_suite(tok, tasks=R.CODE_TASKS, num_per_task=N, context_tokens=CONTEXT)


def by_task(cases, task):
    return [c for c in cases if c.task == task]


SECRET = re.compile(r'^SECRET_([A-Z]{4}) = "([a-z]{8})"$', re.M)


def test_deterministic_and_seeded(tok, suite):
    again = R.ruler_suite(tok, tasks=R.CODE_TASKS, num_per_task=N, context_tokens=CONTEXT)
    other = R.ruler_suite(tok, tasks=R.CODE_TASKS, num_per_task=N, context_tokens=CONTEXT, seed=1)
    assert again == suite
    assert [c.task for c in suite] == [t for t in R.CODE_TASKS for _ in range(N)]
    for task in R.CODE_TASKS:
        a, b = by_task(suite, task), by_task(other, task)
        assert all(x.token_ids != y.token_ids for x, y in zip(a, b)), task
        assert all(x.answers != y.answers for x, y in zip(a, b)), task


def test_lengths_within_the_context(suite):
    for c in suite:
        assert CONTEXT - 200 <= len(c.token_ids) <= CONTEXT, (c.task, len(c.token_ids))
        assert 0.0 <= c.depth <= 1.0 and "@" in c.source


@pytest.mark.parametrize("task", ["single", "multikey", "vartrack"])
def test_the_prompt_ends_where_the_answer_starts(tok, suite, task):
    for c in by_task(suite, task):
        (answer,) = c.answers
        assert tok.decode(answer).endswith('"') and len(answer) >= 2
        # the answer continues the prompt token for token: greedy output can match it exactly
        assert tok.encode(tok.decode(c.token_ids) + tok.decode(answer)) == list(c.token_ids) + list(answer)


def test_single_and_multikey_hold_the_key_asked_for(tok, suite):
    for c in by_task(suite, "single") + by_task(suite, "multikey"):
        text = tok.decode(c.token_ids)
        tag = re.search(r'SECRET_([A-Z]{4}) = "$', text)[1]
        value = tok.decode(c.answers[0])[:-1]
        needles = dict(SECRET.findall(text))
        assert needles[tag] == value  # the key asked for binds the answer
        assert len(needles) == (1 if c.task == "single" else R.MULTIKEY_KEYS)
        assert len(set(needles.values())) == len(needles)  # distractors differ in key and value
        # the needle sits where its depth says
        at = text.index(f'SECRET_{tag} = "{value}"') / len(text)
        assert abs(at - c.depth) < 0.1, (at, c.depth)


def test_multikey_asks_for_every_position(tok, suite):
    cases = R.ruler_suite(tok, tasks=["multikey"], num_per_task=R.MULTIKEY_KEYS, context_tokens=CONTEXT)
    asked = []
    for c in cases:
        text = tok.decode(c.token_ids)
        tag = re.search(r'SECRET_([A-Z]{4}) = "$', text)[1]
        asked.append([t for t, _ in SECRET.findall(text)].index(tag))
    assert sorted(asked) == list(range(R.MULTIKEY_KEYS))


def test_multivalue_holds_every_value_under_one_key(tok, suite):
    for c in by_task(suite, "multivalue"):
        text = tok.decode(c.token_ids)
        tag = re.search(r'SECRET_([A-Z]{4}) = "$', text)[1]
        found = SECRET.findall(text)
        assert [t for t, _ in found] == [tag] * R.MULTIVALUE_VALUES
        assert [v for _, v in found] == [tok.decode(a) for a in c.answers]
        assert len(set(c.answers)) == R.MULTIVALUE_VALUES


def test_vartrack_chain_resolves_to_the_value(tok, suite):
    for c in by_task(suite, "vartrack"):
        text = tok.decode(c.token_ids)
        last = re.search(r'assert ([A-Z]{5}) == "$', text)[1]
        values = dict(re.findall(r'^([A-Z]{5}) = "([a-z]{8})"$', text, re.M))
        refs = re.findall(r"^([A-Z]{5}) = ([A-Z]{5})$", text, re.M)
        assert len(values) == 1 and len(refs) == R.VARTRACK_HOPS - 1
        # executed in order, the chain gives the last variable the value
        env = dict(values)
        order = sorted(refs, key=lambda r: text.index(f"\n{r[0]} = {r[1]}\n"))
        for name, src in order:
            env[name] = env[src]
        assert env[last] == tok.decode(c.answers[0])[:-1]
        assert last not in values  # it takes at least one hop
        (root,) = values
        assert text.index(f'{root} = "') < min(text.index(f"\n{n} = {s}\n") for n, s in refs)


def test_unknown_task_refused(tok):
    with pytest.raises(W.WorkloadError, match="unknown RULER task.*vartrack"):
        R.ruler_suite(tok, tasks=["single", "niah"], num_per_task=1, context_tokens=CONTEXT)


# ------------------------------------------------------------------------------ scoring
def test_score_case():
    one = R.RulerCase("single", (1, 2), ((5, 6, 7),), 0.5, "x@0")
    assert R.score_case(one, [5, 6, 7, 9]) == 1.0
    assert R.score_case(one, [5, 6]) == 0.0  # cut short
    assert R.score_case(one, [9, 5, 6, 7]) == 0.0  # must start with it
    many = R.RulerCase("multivalue", (1,), ((5, 6), (7, 8), (9,)), 0.1, "x@0")
    assert R.score_case(many, [0, 7, 8, 3]) == pytest.approx(1 / 3)
    assert R.score_case(many, [9, 5, 6, 1, 7, 8]) == 1.0
    assert R.score_case(many, [5, 7, 6, 8]) == 0.0  # tokens interleaved: not contiguous


# ------------------------------------------------------------------------ the prose form
@pytest.fixture(scope="module", params=["noise", "essay"])
def prose(tok, request):
    return request.param, R.ruler_suite(
        tok, tasks=R.RULER_TASKS, num_per_task=N, context_tokens=CONTEXT, form=request.param
    )


NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: ([0-9]{7})\.")


def test_prose_cases_fit_hold_their_answers_and_are_seeded(tok, prose):
    from vllm_graft.tools.workloads import ruler_prose as P

    form, prose = prose
    assert [c.task for c in prose] == [t for t in R.RULER_TASKS for _ in range(N)]
    again = R.ruler_suite(tok, tasks=R.RULER_TASKS, num_per_task=N, context_tokens=CONTEXT, form=form)
    assert again == prose
    other = R.ruler_suite(tok, tasks=["single"], num_per_task=N, context_tokens=CONTEXT, form=form, seed=1)
    assert [c.token_ids for c in other] != [c.token_ids for c in by_task(prose, "single")]
    for c in prose:
        assert CONTEXT - 200 < len(c.token_ids) <= CONTEXT and c.match == "contains"
        text = tok.decode(list(c.token_ids))
        if c.task == "qa":  # its own test below
            continue
        noise = c.source == "noise"
        assert noise == (form == "noise" or c.task == "vartrack") and (noise or "pydoc_data" in c.source)
        found = dict(NEEDLE.findall(text))
        if c.task == "vartrack":
            value = re.search(r"assigned the value ([0-9]{7}), they are:$", text)[1]
            chain = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|[0-9]{7})\.", text)
            assert len(chain) == P.VARTRACK_HOPS + 1 and chain[0][1] == value  # in order, the value first
            assert all(b == f"VAR {a}" for (a, _), (_, b) in zip(chain, chain[1:]))
            assert [tok.decode(list(a)) for a in c.answers] == [" " + a for a, _ in chain]
            continue
        key = re.search(
            r"The special magic numbers? for ([a-z]+-[a-z]+) mentioned in the provided text (is|are)$", text
        )
        assert key, text[-200:]
        if c.task == "multivalue":
            values = re.findall(rf"for {key[1]} is: ([0-9]{{7}})\.", text)
            assert len(values) == P.MULTIVALUE_VALUES == len(c.answers)
        else:
            values = [found[key[1]]]
            assert len(found) == (P.MULTIKEY_KEYS if c.task == "multikey" else 1)
        assert [tok.decode(list(a)) for a in c.answers] == [" " + v for v in values]
        for a in c.answers:  # the answer's ids occur in the prompt as the output would write them
            assert R._contains(c.token_ids, a)


QA_DOC = re.compile(r"Document: ([A-Z][a-z]+ [A-Z][a-z]+) works as a ([a-z]+) in ([A-Z][a-z]+)\.")


def test_qa_asks_one_person_among_documents_about_others(tok, prose):
    from vllm_graft.tools.workloads import ruler_prose as P

    form, prose = prose
    qa = by_task(prose, "qa")
    assert len(qa) == N
    for i, c in enumerate(qa):
        text = tok.decode(list(c.token_ids))
        assert text.startswith("Answer the question based on the given documents.")
        assert (c.source == "noise") == (form == "noise") and (form == "noise" or "pydoc_data" in c.source)
        asked = re.search(r"Question: (In which city does|What is the profession of) ([A-Z][a-z]+ [A-Z][a-z]+)", text)
        assert asked[1] == ("In which city does" if i % 2 == 0 else "What is the profession of")
        assert text.endswith(f"Answer: {asked[2]} works in" if i % 2 == 0 else f"Answer: {asked[2]} works as a")
        docs = QA_DOC.findall(text)
        assert len(docs) == P.QA_DOCUMENTS
        for field in range(3):  # each person in a city and trade of their own
            assert len({d[field] for d in docs}) == P.QA_DOCUMENTS
        _, job, city = next(d for d in docs if d[0] == asked[2])
        assert [tok.decode(list(a)) for a in c.answers] == [" " + (city if i % 2 == 0 else job)]
        assert R._contains(c.token_ids, c.answers[0])
    with pytest.raises(W.WorkloadError, match="qa have no code form: give --ruler-form noise"):
        R.ruler_suite(tok, tasks=["single", "qa"], num_per_task=1, context_tokens=CONTEXT)


def test_prose_scoring_is_the_fraction_of_answers_anywhere_in_the_output():
    case = R.RulerCase("single", (1,), ((5, 6),), 0.5, "x@0", match="contains")
    assert R.score_case(case, [9, 9, 5, 6, 1]) == 1.0  # anywhere, not only at the start
    assert R.score_case(case, [5, 9, 6]) == 0.0
    vt = R.RulerCase("vartrack", (1,), ((5,), (6,), (7,), (8,)), 0.5, "x@0", match="contains")
    assert R.score_case(vt, [8, 0, 6]) == 0.5


def test_unknown_form_refused(tok):
    with pytest.raises(W.WorkloadError, match="unknown RULER form 'prose': the forms are code, noise, essay"):
        R.ruler_suite(tok, tasks=["single"], num_per_task=1, context_tokens=CONTEXT, form="prose")
    with pytest.raises(W.WorkloadError, match="leaves no room for a haystack"):
        R.ruler_suite(tok, tasks=["single"], num_per_task=1, context_tokens=80, form="noise")


# ------------------------------------------------------------------------------ the report
def rows():
    """Hand-made kvbench rows: 2 tasks, 2 cases each."""

    def row(arm, single, multikey):
        return {"arm": arm, "ruler_tasks": ["single"] * 2 + ["multikey"] * 2, "ruler_scores": single + multikey}

    return [
        row("plain", [1.0, 0.0], [1.0, 1.0]),  # 0.5, 1.0 -> 0.75
        row("streaming 1/2", [1.0, 0.0], [1.0, 0.0]),  # 0.5
        row("snapkv 1/2", [1.0, 1.0], [1.0, 0.0]),  # 0.75
        row("streaming 1/4", [0.0, 0.0], [1.0, 0.0]),  # 0.25
        row("snapkv 1/4", [1.0, 0.0], [1.0, 0.0]),  # 0.5
    ]


def test_summary_and_tables():
    s = ruler_report.summarize(rows(), ["single", "multikey"], cases_per_task=2, context=2048)
    arms = {a["arm"]: a for a in s["arms"]}
    assert arms["plain"]["average"] == 0.75 and arms["plain"]["ratio"] is None
    assert arms["snapkv 1/4"] == {
        "arm": "snapkv 1/4",
        "compressor": "snapkv",
        "ratio": "1/4",
        "kept": 0.25,
        "scores": {"single": 0.5, "multikey": 0.5},
        "average": 0.5,
        # single's differences 0, 0; multikey's 0, -1 (mean -0.5, variance 0.5 over 2 cases)
        "vs_plain": {"difference": -0.25, "paired_se": 0.25},
    }
    assert arms["plain"]["vs_plain"] == {"difference": 0.0, "paired_se": 0.0}
    assert arms["streaming 1/4"]["vs_plain"]["paired_se"] == pytest.approx(0.5**0.5 / 2)
    text = ruler_report.tables(s)
    assert "| arm | single | multikey | average | vs plain (paired error) |" in text
    assert "| snapkv 1/4 | 0.500 | 0.500 | **0.500** | -0.250 (0.250) |" in text
    assert "| compressor | kept 1 | kept 1/2 | kept 1/4 |" in text
    assert "| plain | 0.750 |  |  |" in text
    assert "| streaming |  | 0.500 | 0.250 |" in text
    assert "| snapkv |  | 0.750 | 0.500 |" in text
    assert "| streaming 1/4 | 0.000 | 0.500 | **0.250** | -0.500 (0.354) |" in text
    no_plain = ruler_report.tables(ruler_report.summarize(rows()[1:], ["single"], cases_per_task=2, context=2048))
    assert "| streaming 1/4 | 0.000 | **0.000** |" in no_plain and "paired" not in no_plain
    with pytest.raises(ValueError, match="no score for multivalue"):
        ruler_report.summarize(rows(), ["single", "multivalue"], cases_per_task=2, context=2048)


def test_split_label():
    assert ruler_report.split_label("kv4+h2o 1/8") == ("kv4+h2o", "1/8", 0.125)
    assert ruler_report.split_label("plain") == ("plain", None, 1.0)
    assert ruler_report.split_label("snapkv 3/4") == ("snapkv", "3/4", 0.75)


def test_budgets_are_shares_kept():
    kept = ruler_report.kept
    assert [kept(x) for x in (2, "4", "3/4", "2/4")] == [Fraction(1, 2), Fraction(1, 4), Fraction(3, 4), Fraction(1, 2)]
    assert ruler_report.kept_label(kept("3/4")) == "3/4"
    assert ruler_report.kept_blocks(62, kept("3/4")) == 46  # rounded down, as 62 // 2 == 31
    assert ruler_report.kept_blocks(62, kept(2)) == 31
    for bad in (0, "0/3", "4/3", "half"):
        with pytest.raises(ValueError, match="budget"):
            kept(bad)


def test_svg_plot():
    s = ruler_report.summarize(rows(), ["single", "multikey"], cases_per_task=2, context=2048)
    root = ET.fromstring(ruler_report.svg(s, width=640, height=400))
    ns = {"s": "http://www.w3.org/2000/svg"}
    lines = {p.get("data-compressor"): p.get("points") for p in root.iterfind("s:polyline", ns)}
    assert set(lines) == {"streaming", "snapkv"}  # one line per compressor, plain is the reference
    # plot area: x from 60 to 490 (1/4, 1/2, 1 evenly), y from 40 (score 1) to 350 (score 0)
    assert lines["streaming"] == "60.0,272.5 275.0,195.0"  # 0.25 at 1/4, 0.5 at 1/2
    assert lines["snapkv"] == "60.0,195.0 275.0,117.5"
    (plain,) = [e for e in root.iterfind("s:line", ns) if e.get("class") == "plain"]
    assert plain.get("y1") == plain.get("y2") == "117.5"  # 0.75
    labels = [t.text for t in root.iterfind("s:text", ns)]
    assert {"1/4", "1/2", "1", "plain 0.750", "streaming", "snapkv"} <= set(labels)


def test_svg_plot_draws_kvpress_beside_each_press_it_ran():
    s = ruler_report.summarize(rows(), ["single", "multikey"], cases_per_task=2, context=2048)
    beside = {
        "rows": [
            {"compressor": "snapkv", "kept": "1/2", "theirs": 0.25},
            {"compressor": "snapkv", "kept": "1/4", "theirs": 0.0},
            {"compressor": "snapkv", "kept": "1/8", "theirs": 0.0},  # a ratio kvbench did not run: not drawn
        ]
    }
    root = ET.fromstring(ruler_report.svg(s, width=640, height=400, beside=beside))
    ns = {"s": "http://www.w3.org/2000/svg"}
    theirs = {p.get("data-kvpress"): p.get("points") for p in root.iterfind("s:polyline", ns) if p.get("data-kvpress")}
    assert theirs == {"snapkv": "60.0,350.0 275.0,272.5"}  # 0 at 1/4, 0.25 at 1/2; no streaming press
    assert len([r for r in root.iterfind("s:rect", ns) if r.get("data-kvpress")]) == 2
    assert "snapkv (kvpress)" in [t.text for t in root.iterfind("s:text", ns)]
    plain = ruler_report.svg(s, width=640, height=400)
    assert "data-kvpress" not in plain and "(kvpress)" not in plain


# ------------------------------------------------------------------------------ the CLI
def parse(*argv):
    from vllm_graft.cli.main import build_parser

    return build_parser().parse_args(["kvbench", *argv])


def test_suite_flags_parse():
    args = parse()
    assert args.suite is None and args.ruler_out is None
    assert args.ruler_tasks == ",".join(R.DEFAULT_TASKS) and args.ruler_cases == 16
    kvbench.check_suite_args(args)  # the default run: nothing to refuse
    args = parse("--suite", "ruler", "--ruler-tasks", "all", "--ruler-cases", "3", "--ruler-out", "r.json")
    assert (args.suite, args.ruler_cases, args.ruler_out) == ("ruler", 3, "r.json")
    kvbench.check_suite_args(args)
    assert kvbench.parse_ruler_tasks(args.ruler_tasks) == list(R.CODE_TASKS)  # the code form's: no qa
    assert kvbench.parse_ruler_tasks("all", "noise") == list(R.RULER_TASKS) and "qa" in R.RULER_TASKS
    with pytest.raises(SystemExit, match="qa have no code form: give --ruler-form noise"):
        kvbench.check_suite_args(parse("--suite", "ruler", "--ruler-tasks", "single,qa"))
    kvbench.check_suite_args(parse("--suite", "ruler", "--ruler-tasks", "single,qa", "--ruler-form", "noise"))
    assert kvbench.parse_ruler_tasks("multikey, single") == ["multikey", "single"]
    with pytest.raises(SystemExit):
        parse("--suite", "rulers")
    with pytest.raises(SystemExit, match="unknown RULER task.*niah"):
        kvbench.check_suite_args(parse("--suite", "ruler", "--ruler-tasks", "single,niah"))
    with pytest.raises(SystemExit, match="--ruler-out needs --suite ruler"):
        kvbench.check_suite_args(parse("--ruler-out", "r.json"))
    with pytest.raises(SystemExit, match="--ruler-cases"):
        kvbench.check_suite_args(parse("--suite", "ruler", "--ruler-cases", "0"))
    assert isinstance(args, argparse.Namespace)
