"""The `long-recall` workload (a function repeated at the end of a ~1800-token window, its first
copy far back) and `vllm-graft sparse-quality --workload` without an engine."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vllm_graft.tools.attention import sparse_quality as SQ
from vllm_graft.tools import workloads as W
from vllm_graft.plugins.attention.squeezed import policy

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama"


@pytest.fixture(scope="module")
def tok():
    return W.Tokenizer.from_model(MODEL)


def build(tok, n=4, max_tokens=16, seed=0):
    (ps,) = W.build(["long-recall"], tok, num_prompts=n, max_tokens=max_tokens, max_model_len=2048, seed=seed)
    return ps


def test_deterministic_and_seeded(tok):
    a, b, c = build(tok), build(tok), build(tok, seed=1)
    assert [p.token_ids for p in a.prompts] == [p.token_ids for p in b.prompts]
    assert a.stats == b.stats
    assert a.fingerprint() != c.fingerprint()


@pytest.mark.parametrize("max_tokens", [16, 300])
def test_lengths_and_the_repeated_span(tok, max_tokens):
    ps = build(tok, n=6, max_tokens=max_tokens)
    length = min(W.LONG_CONTEXT_TOKENS, 2048 - max_tokens - 1)
    assert len(ps.stats["scored_spans"]) == len(ps.prompts) == 6
    for p, (a, b), d in zip(ps.prompts, ps.stats["scored_spans"], ps.stats["recall_distance"]):
        ids = list(p.token_ids)
        assert length - 64 <= len(ids) <= length and len(ids) + p.max_tokens <= 2047
        assert b == len(ids)  # the repeat ends the prompt
        assert W.LONG_RECALL_SPAN[0] <= b - a <= W.LONG_RECALL_SPAN[1]
        o = a - d  # its first copy, token for token
        assert ids[o:o + b - a] == ids[a:b] and o >= W.LONG_RECALL_LEAD and d >= len(ids) // 2
        assert o + (b - a) <= a
        rep = tok.decode(ids[a:b])
        assert rep.lstrip().startswith(("def ", "async def ")), rep[:40]
        rel = p.source.split(":")[0]
        assert rep in (W.stdlib_dir() / rel).read_text(encoding="utf-8", errors="replace")


def test_the_first_copy_is_beyond_the_window_baseline(tok):
    """At K = 1/4 and 1/8, no scored token's earlier copy is among the tokens the sink + window
    baseline attends (the squeezed plugin's own window policy, default chunk/sinks/recent)."""
    ps = build(tok, n=4)
    for p, (a, b), d in zip(ps.prompts, ps.stats["scored_spans"], ps.stats["recall_distance"]):
        for frac in (0.25, 0.125):
            for j in range(a, b):  # scored token j is predicted from tokens 0..j-1
                seen = policy.window_chunks(policy.budget(j, 16, frac, 16, 64))
                assert max(seen) * 16 + 15 >= j - 1  # (the window does reach the newest token)
                assert (j - d) // 16 not in seen, (p.source, frac, j)  # its first copy does not


def _args(**kw):
    base = dict(num_prompts=2, max_model_len=2048, seed=0, score_from=256)
    return argparse.Namespace(**{**base, **kw})


def test_sparse_quality_spans_and_refusals(tok):
    prompts, spans, firsts = SQ.load_workload("long-recall", tok, _args())
    ps = build(tok, n=2)
    assert prompts == [list(p.token_ids) for p in ps.prompts]
    assert spans == [tuple(s) for s in ps.stats["scored_spans"]]
    for p, (a, b), (c, d) in zip(prompts, spans, firsts):
        assert p[a:b] == p[c:d] and d <= a
    prompts, spans, firsts = SQ.load_workload("long-context", tok, _args())
    assert spans == [(256, len(p)) for p in prompts] and firsts is None
    for short in ("chat", "code-completion", "extractive"):
        with pytest.raises(W.WorkloadError, match=f"workload '{short}' has prompts of .* at least 1024"):
            SQ.load_workload(short, tok, _args())
    with pytest.raises(W.WorkloadError, match="score-from 5000"):
        SQ.load_workload("long-context", tok, _args(score_from=5000))


def test_sparse_quality_cli_refuses_before_any_engine(capsys):
    from vllm_graft.cli.main import main

    assert main(["sparse-quality", "--workload", "chat"]) == 2
    assert "use long-context, long-recall or shared-prefix" in capsys.readouterr().err
    assert main(["sparse-quality", "--workload", "long-recal"]) == 2
    assert "did you mean 'long-recall'?" in capsys.readouterr().err


def test_sparse_quality_arms_with_a_head_map():
    """--head-map adds streaming-heads and a '+heads' arm of each selection mode (not of window)."""
    from vllm_graft.plugins.attention.squeezed import SqueezedParams

    args = argparse.Namespace(budget=[0.25], modes="recycled,centroid,window", refresh=1, chunk=16, sink=16,
                              recent=64, head_map="heads.json")
    arms = dict(SQ._arms(args))
    assert list(arms) == ["plain vLLM", "recycled K=0.25 refresh 16", "recycled+heads K=0.25 refresh 16",
                          "centroid K=0.25", "centroid+heads K=0.25", "window K=0.25", "streaming-heads"]
    assert arms["centroid+heads K=0.25"]["head_map"] == "heads.json"
    assert arms["recycled+heads K=0.25 refresh 16"]["mode"] == "recycled"
    assert "head_map" not in arms["centroid K=0.25"] and "head_map" not in arms["window K=0.25"]
    assert SqueezedParams(**{k: v for k, v in arms["recycled K=0.25 refresh 16"].items()}).refresh == 16
    assert [a for a in SQ._arms(argparse.Namespace(**{**vars(args), "head_map": None}))
            if "heads" in a[0]] == []


def test_sparse_quality_takes_any_registered_attention_plugin(capsys):
    """--plugin NAME --params JSON: plain vLLM against any registered attention plugin, its
    parameters validated by its model; for squeezed, --params go under every arm's own;
    an unknown plugin is refused (before any engine) naming the registered ones."""
    from vllm_graft.cli.main import main

    args = argparse.Namespace(budget=[0.25], modes="window", refresh=1, chunk=16, sink=16, recent=64,
                              head_map=None, plugin="hydragen", params=None)
    assert SQ._arms(args) == [("plain vLLM", None), ("hydragen", {})]
    args.plugin, args.params = "squeezed", '{"sink_tokens": 32}'
    assert [p["sink_tokens"] for _, p in SQ._arms(args)[1:]] == [32]
    assert main(["sparse-quality", "--plugin", "tova"]) == 2
    err = capsys.readouterr().err
    assert "no attention plugin named 'tova'" in err and "squeezed" in err
    assert main(["sparse-quality", "--params", '{"bogus": 1}']) == 2
    assert "invalid parameters" in capsys.readouterr().err
