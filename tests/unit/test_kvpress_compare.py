"""tools/kvcompress/kvpress_compare.py without kvpress: the press pairs and kvbench's arm labels,
the budget-to-compression-ratio mapping, the question split, the side-by-side table on
hand-made results, and a clear error naming `make kvpress` when kvpress is missing."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from vllm_graft.tools.kvcompress import kvpress_compare as kc


def test_ratio_is_the_fraction_removed():
    assert [kc.compression_ratio(f) for f in kc.FRACTIONS] == [0.5, 0.75, 0.875]
    assert kc.compression_ratio(1) == 0.0
    assert [kc.compression_ratio(f) for f in ("3/4", "1/2", "1/4")] == [0.25, 0.5, 0.75]  # kvpress's leaderboard
    for bad in (0, "0/4", "5/4", "x"):
        with pytest.raises(ValueError, match="budget"):
            kc.compression_ratio(bad)


@pytest.mark.parametrize("n, kept", [(2014, 1024), (2014, 256), (1919, 512), (100, 1), (33, 32)])
def test_ratio_keeping_gives_kvpress_the_tokens_asked(n, kept):
    ratio = kc.ratio_keeping(n, kept)
    assert 0 <= ratio < 1
    assert int(n * (1 - ratio)) == kept  # kvpress's compute_n_kept (and ScorerPress's top-k size)


def test_ratio_keeping_keeps_everything_when_the_budget_covers_the_prompt():
    assert kc.ratio_keeping(500, 1024) == 0.0
    assert kc.ratio_keeping(500, 0) == 0.0


def test_context_budget_is_kvbench_blocks_in_tokens():
    assert [kc.context_budget_tokens(2048, 32, f) for f in (2, 4, 8)] == [1024, 512, 256]
    assert kc.context_budget_tokens(2000, 32, 8) == 224  # 62 blocks // 8 = 7 blocks
    assert kc.context_budget_tokens(2048, 32, "3/4") == 1536
    assert kc.context_budget_tokens(2000, 32, "3/4") == 1472  # 62 blocks * 3/4 = 46 blocks


def test_labels_are_kvbench_arms():
    from vllm_graft.hooks import get_registry
    from vllm_graft.tools.kvcompress.kvbench import _arms

    registered = [p.ours for p in kc.PAIRS if ("kvcompress", p.ours) in get_registry()]
    assert {"streaming", "h2o", "snapkv", "tova", "knorm", "keydiff", "adakv"} <= set(registered)
    labels = [label for label, _ in _arms(2048, 32, registered, kc.FRACTIONS)]
    for name in registered:
        for frac in kc.FRACTIONS:
            assert kc.arm_label(name, frac) in labels
    assert kc.parse_label("snapkv 1/4") == ("snapkv", Fraction(1, 4))
    assert kc.parse_label("expected-attention 1/8") == ("expected-attention", Fraction(1, 8))
    assert kc.parse_label("snapkv 3/4") == ("snapkv", Fraction(3, 4))
    assert kc.arm_label("snapkv", "3/4") in [label for label, _ in _arms(2048, 32, ["snapkv"], ["3/4"])]
    assert kc.parse_label("plain") == ("plain", None)


def test_pairs_are_unique_and_name_their_attention():
    assert len({p.ours for p in kc.PAIRS}) == len(kc.PAIRS)
    assert {p.attn for p in kc.PAIRS} <= {"sdpa", "eager"}
    assert kc.PAIRS_BY_NAME["h2o"].attn == "eager"  # ObservedAttentionPress reads the weights
    assert kc.PAIRS_BY_NAME["adakv"].inner == "SnapKVPress"
    assert [p.ours for p in kc.select_pairs(["tova", "snapkv"])] == ["tova", "snapkv"]
    with pytest.raises(SystemExit, match="no kvpress press paired with kv4.*streaming"):
        kc.select_pairs(["kv4"])


class _Pieces:
    """A tokenizer over a fixed vocabulary of strings (token id = index)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)


def test_question_start_holds_out_the_tail_after_the_last_blank_line():
    tok = _Pieces(["x = 1", "\n", "\n\n", "SECRET", "_AB", ' = "', "y"])
    # the blank line merged into one token: that token starts the question
    assert kc.question_start(tok.decode, [0, 1, 0, 2, 3, 4, 5]) == 3
    # separate newlines: the question starts at the second one
    assert kc.question_start(tok.decode, [0, 1, 0, 1, 1, 3, 4, 5]) == 4
    assert kc.question_start(tok.decode, [0, 1, 6, 1, 3]) is None  # no blank line


def _theirs():
    def row(arm, mode, hits, gen=None, **kw):
        r = {"arm": arm, "mode": mode, "needle_hits": hits, "needle_em": sum(hits) / len(hits), **kw}
        if gen is not None:
            r["gen_ppl"] = gen
        return r

    return {
        "meta": {},
        "rows": [
            row("plain", "prompt", [True, True, False, True], 10.0, compression_ratio=0.0),
            row("snapkv 1/2", "prompt", [True, True, False, True], 11.0, press_name="SnapKVPress"),
            row("snapkv 1/2", "context", [True, False, False, False], press_name="SnapKVPress"),
            row("streaming 1/2", "prompt", [False, True, False, False], 10.5, press_name="StreamingLLMPress"),
            row("pyramidkv 1/2", "prompt", [True, True, True, True], 10.0, press_name="PyramidKVPress"),
        ],
    }


def _ours():
    return [
        {"arm": "plain", "needle_hits": [True, True, False, False], "needle_em": 0.5, "gen_ppl": 8.0},
        {"arm": "streaming 1/2", "needle_hits": [True, True, True, False], "needle_em": 0.75, "gen_ppl": 8.8},
        {"arm": "snapkv 1/2", "needle_hits": [True, False, False, False], "needle_em": 0.25, "gen_ppl": 8.4},
        {"arm": "h2o 1/2", "needle_hits": [True, False, False, False], "needle_em": 0.25},
    ]


def test_table_pairs_arms_and_says_by_how_much_vllm_graft_loses():
    rows = kc.build_table(_ours(), _theirs())
    assert [r["arm"] for r in rows] == ["plain", "snapkv 1/2", "streaming 1/2"]  # only arms both have
    plain, snap, stream = rows
    assert plain["agree"] == 3  # the sanity check: transformers and vLLM, needle by needle
    assert snap["difference"] == pytest.approx(-0.5)
    assert snap["difference_cell"] == "-0.50 (loses 2 of 4)"
    assert snap["context_cell"] == "0.25 (1/4)"
    assert snap["ours_gen"] == "+5.0%" and snap["theirs_gen"] == "+10.0%"
    assert stream["difference_cell"] == "+0.50"  # vllm-graft wins: no "loses"
    assert stream["kept"] == "1/2" and stream["press"] == "StreamingLLMPress"


def test_table_markdown_has_the_columns_asked_for():
    text = kc.format_table(kc.build_table(_ours(), _theirs()))
    head, rule, *body = text.splitlines()
    assert head.startswith("| vllm-graft | kvpress | kept | vllm-graft needle EM | kvpress needle EM | difference |")
    assert "kvpress EM, context only" in head
    assert rule.count("|") == head.count("|")
    assert body[1] == (
        "| snapkv | SnapKVPress | 1/2 | 0.25 (1/4) | 0.75 (3/4) | -0.50 (loses 2 of 4) | 0.25 (1/4) | +5.0% | +10.0% |"
    )
    no_context = kc.format_table(kc.build_table(_ours(), _theirs()), context_column=False)
    assert "context only" not in no_context


def test_table_command_reads_both_json_files(tmp_path, capsys):
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    ours.write_text(json.dumps(_ours()))
    theirs.write_text(json.dumps(_theirs()))
    assert kc.main(["--table", str(ours), str(theirs)]) == 0
    out = capsys.readouterr().out
    assert "| streaming | StreamingLLMPress | 1/2 |" in out
    assert "agree on 3 of the needles" in out
    theirs.write_text(json.dumps({"meta": {}, "rows": []}))
    with pytest.raises(SystemExit, match="no arm in common"):
        kc.main(["--table", str(ours), str(theirs)])


def test_missing_kvpress_names_make_kvpress(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    with pytest.raises(kc.KvpressMissing, match="make kvpress"):
        kc.require_kvpress()
    assert kc.main(["--needles", "1"]) == 2
    err = capsys.readouterr().err
    assert "make kvpress" in err and ".venv-kvpress/bin/python" in err


def test_module_imports_neither_kvpress_nor_vllm_nor_torch():
    code = (
        "import sys, vllm_graft.tools.kvcompress.kvpress_compare as m; "
        "print(sorted(k for k in ('kvpress', 'vllm', 'torch', 'transformers') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ruler_table_per_task_means_for_arms_both_ran():
    tasks = ["single", "single", "multivalue", "multivalue"]
    ours = [
        {"arm": "plain", "ruler_tasks": tasks, "ruler_scores": [1.0, 0.0, 1.0, 2 / 3]},
        {"arm": "snapkv 1/4", "ruler_tasks": tasks, "ruler_scores": [0.0, 0.0, 1 / 3, 0.0]},
        {"arm": "tova 1/4", "needle_hits": [True], "needle_em": 1.0},  # no RULER: left out
    ]
    theirs = {
        "rows": [
            {"arm": "plain", "mode": "prompt", "ruler_tasks": tasks, "ruler_scores": [1.0, 1.0, 1.0, 1.0]},
            {"arm": "snapkv 1/4", "mode": "prompt", "ruler_tasks": tasks, "ruler_scores": [1.0, 0.0, 0.0, 0.0]},
            {"arm": "tova 1/4", "mode": "prompt", "ruler_tasks": tasks, "ruler_scores": [1.0, 0.0, 0.0, 0.0]},
        ]
    }
    text = kc.format_ruler_table(ours, theirs).splitlines()
    assert text[0] == "| arm | single | multivalue (vllm-graft / kvpress) |"
    assert text[2:] == ["| plain | 0.50 / 1.00 | 0.83 / 1.00 |", "| snapkv 1/4 | 0.00 / 0.50 | 0.17 / 0.00 |"]
    assert kc.format_ruler_table(ours[2:], theirs) == ""


def test_table_from_kvbench_printed_rows_without_hits(tmp_path, capsys):
    log = tmp_path / "kvbench.log"
    printed = [{k: v for k, v in r.items() if k != "needle_hits"} for r in _ours()]  # as kvbench prints
    log.write_text("INFO engine started\n" + "\n".join(json.dumps(r) for r in printed) + "\n\ncontext 2048 ...\n")
    assert [r["arm"] for r in kc.read_kvbench(str(log))] == [r["arm"] for r in _ours()]
    rows = kc.build_table(kc.read_kvbench(str(log)), _theirs())
    snap = rows[1]
    assert snap["ours_cell"] == "0.25" and snap["difference_cell"] == "-0.50 (loses 2 of 4)"
    assert "agree" not in rows[0]  # no per-needle hits: no agreement count
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps(_theirs()))
    assert kc.main(["--table", str(log), str(theirs)]) == 0
    assert "agree on" not in capsys.readouterr().out


def test_table_merges_kvpress_files_later_arm_wins(tmp_path, capsys):
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(_ours()))
    first, second = tmp_path / "half.log", tmp_path / "rest.json"
    half = _theirs()["rows"]
    first.write_text("\n".join(json.dumps(r) for r in half) + "\nTraceback (most recent call last):\n")
    second.write_text(
        json.dumps({"meta": {}, "rows": [{**half[3], "needle_hits": [True] * 4, "needle_em": 1.0}]})  # streaming
    )
    merged = kc.read_kvpress([str(first), str(second)])
    rows = kc.build_table(_ours(), merged)
    assert [r["arm"] for r in rows] == ["plain", "snapkv 1/2", "streaming 1/2"]
    assert rows[2]["theirs_cell"] == "1.00 (4/4)" and rows[2]["difference_cell"] == "-0.25 (loses 1 of 4)"
    assert kc.main(["--table", str(ours), str(first), str(second)]) == 0
    assert "| streaming | StreamingLLMPress | 1/2 | 0.75 (3/4) | 1.00 (4/4) |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="at least one kvpress result"):
        kc.main(["--table", str(ours)])


def test_json_written_after_an_arm_is_a_loadable_file(tmp_path):
    # run() writes --json after every arm, as {"partial": true, ...}: a run cut in its next arm
    # leaves a file the side-by-side tables read, and no temporary file beside it
    path = tmp_path / "kvpress.json"
    kc.write_json(str(path), {"partial": True, "meta": {"ruler_digest": "d"}, "rows": [{"arm": "plain"}]})
    kc.write_json(str(path), {"partial": True, "meta": {"ruler_digest": "d"}, "rows": [{"arm": "plain"}, {"arm": "snapkv 1/2"}]})
    assert [r["arm"] for r in kc.read_kvpress([str(path)])["rows"]] == ["plain", "snapkv 1/2"]
    assert [p.name for p in tmp_path.iterdir()] == ["kvpress.json"]
