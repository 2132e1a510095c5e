"""NVIDIA kvpress's presses on the prompts of ``vllm-graft kvbench``, and the table of the two side by side.

kvpress (``pip install kvpress``, github.com/NVIDIA/kvpress) implements KV-cache compression
as "presses" in Hugging Face transformers. Several of them are the methods vllm-graft's
kvcompress plugins implement as block eviction inside vLLM (:data:`PAIRS`). This module runs
kvpress itself on kvbench's model and prompts, and prints both projects' figures side by side::

    make kvpress   # .venv-kvpress: kvpress and the transformers it accepts, beside .venv
    .venv-kvpress/bin/python -m vllm_graft.tools.kvcompress.kvpress_compare \\
        --model models/graft-tiny-llama-recall --decode-tokens 32 --texts 16 --json kvpress.json
    vllm-graft kvbench --model models/graft-tiny-llama-recall --compressors streaming,h2o,... \\
        --decode-tokens 32 --texts 16 --json ours.json
    python -m vllm_graft.tools.kvcompress.kvpress_compare --table ours.json kvpress.json

and the RULER-style suite (kvbench's prompts, checked by a digest of their token ids)::

    .venv-kvpress/bin/python -m vllm_graft.tools.kvcompress.kvpress_compare --ruler single,multikey,multivalue \
        --ruler-per-task 16 --budget context --modes prompt --needles 1 --texts 0 --json kvpress-ruler.json
    vllm-graft kvbench --suite ruler --model models/graft-tiny-llama-recall --compressors snapkv,tova,... \
        --ruler-out ours-ruler.json --kvpress kvpress-ruler.json   # or --ruler-from ours-ruler.json

What is the same as kvbench: the model (float32), the needle prompts
(:func:`~vllm_graft.tools.workloads.needle_haystack` with kvbench's seed and context:
``--context`` - ``--decode-tokens`` - 1 tokens), the perplexity texts
(:func:`~vllm_graft.tools.workloads.stdlib_texts`, their last ``--gen-tokens`` teacher-forced
after the rest: "gen ppl"), greedy decoding of as many tokens as kvbench generates
(``max(longest answer + 2, --decode-tokens)``), and exact match scored as kvbench scores it
(the output's first tokens are the answer's token ids). The budgets: kvbench's 3/4, 1/2, 1/4 and
1/8 of the context become kvpress's ``compression_ratio`` (the fraction *removed*) 0.25, 0.5, 0.75
and 0.875 of each prompt (``--budget prompt``, the default) or, with ``--budget context``,
the tokens kvbench's budget holds (its whole blocks, ``context // block * kept``) kept of each
prompt.

How kvpress compresses, and the two modes run here: a press compresses the KV cache once,
at the end of the prefill, per layer and per KV head, token by token (each layer and head
keeps its own tokens); the prefill itself attends to the whole prompt, so the first output
token always sees everything, and nothing is evicted while decoding. kvpress's pipeline
separates a context (compressed) from a question (prefilled after compression, not
compressed). kvbench's prompts end with their question (``SECRET_<TAG> = "``), and vllm-graft
compresses the whole prompt, so mode ``prompt`` (the default) compresses the whole prompt;
mode ``context`` (the pipeline's) compresses the prompt before the question (the tail after
its last blank line) and prefills the question afterwards. vllm-graft instead evicts whole
blocks shared by every layer and head (vLLM frees a block for all of them), during the chunked
prefill for ``streaming`` and ``h2o`` and while decoding too.

Runs inside the kvpress environment (``make kvpress``); its pure parts (the pairs, the ratio
mapping, the table) import neither kvpress nor vLLM, so the ``--table`` command runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

from .ruler_report import (
    RULER_ROOM,
    kept,
    kept_arg,
    kept_blocks,
    kept_label,
    parse_budgets,
    ruler_max_tokens,
    split_label,
    task_means,
)


class KvpressMissing(RuntimeError):
    """kvpress is not importable in this Python."""


@dataclass(frozen=True)
class PressPair:
    """One vllm-graft plugin and the kvpress press that implements the same method."""

    ours: str  # the vllm-graft kvcompress plugin (kvbench's arm name)
    press: str  # the kvpress class
    inner: str | None  # the scorer press a wrapper press takes (AdaKVPress(SnapKVPress))
    attn: str  # the attn_implementation the press needs: "eager" where it reads the attention weights
    match: str  # how close the two are


#: The methods both projects have. kvpress's defaults are kept for every press (``n_sink=4``,
#: SnapKV's ``window_size=64``, ``kernel_size=5``, AdaKV's ``alpha_safeguard=0.2``, ...).
PAIRS: tuple[PressPair, ...] = (
    PressPair(
        "streaming",
        "StreamingLLMPress",
        None,
        "sdpa",
        "same policy (sinks + the most recent tokens); kvpress keeps 4 sink tokens, vllm-graft one sink block",
    ),
    PressPair(
        "h2o",
        "ObservedAttentionPress",
        None,
        "eager",
        "approximate: kvpress ranks tokens by the mean attention the whole prefill gave them, with no "
        "recent window; vllm-graft's h2o sums the attention mass per block through prefill and decode and "
        "keeps half its budget recent",
    ),
    PressPair(
        "snapkv",
        "SnapKVPress",
        None,
        "sdpa",
        "same scorer (the last prompt tokens' attention, pooled); window 64 tokens in kvpress, 32 (one block) in kvbench",
    ),
    PressPair(
        "tova",
        "TOVAPress",
        None,
        "sdpa",
        "same scorer (the last query's attention, averaged over heads); vllm-graft re-ranks at every step",
    ),
    PressPair(
        "knorm", "KnormPress", None, "sdpa", "same score (lowest key L2 norm); vllm-graft re-ranks at every step"
    ),
    PressPair(
        "keydiff",
        "KeyDiffPress",
        None,
        "sdpa",
        "same score (keys least like the mean key); vllm-graft re-ranks at every step",
    ),
    PressPair(
        "adakv",
        "AdaKVPress",
        "SnapKVPress",
        "sdpa",
        "same method (SnapKV scores, budget shared across heads, 20% floor per head); kvpress masks per head "
        "inside the full cache, vllm-graft frees blocks no head keeps",
    ),
    PressPair(
        "expected-attention",
        "ExpectedAttentionPress",
        None,
        "sdpa",
        "same idea (a key's expected attention under a Gaussian fitted to queries, times its value norm); kvpress "
        "fits all prompt queries with full covariance and averages RoPE over 512 future positions, vllm-graft "
        "the window's queries with a diagonal variance, summed per block",
    ),
    PressPair(
        "pyramidkv",
        "PyramidKVPress",
        None,
        "sdpa",
        "same method (SnapKV scores, budgets falling with depth); vLLM frees only what no layer keeps",
    ),
    PressPair(
        "kvzip",
        "KVzipPress",
        None,
        "sdpa",
        "same method (after prefill the model repeats its context in chunks; a KV pair's score is the most "
        "attention any repeated token gives it); kvpress keeps tokens per head with budgets across layers "
        "(layerwise=False) and 4 sinks, vllm-graft whole blocks, one budget per layer; kvpress masks the "
        "pairs it prunes (its cache keeps every token, so its kept count reads the whole prompt)",
    ),
)
PAIRS_BY_NAME = {p.ours: p for p in PAIRS}
#: kvbench's budgets: 1/2, 1/4 and 1/8 of the context
FRACTIONS = (2, 4, 8)
MODES = ("prompt", "context")
MAKE_HINT = (
    "kvpress is not installed in this Python ({exe}): run `make kvpress` (it makes .venv-kvpress beside "
    ".venv), then `.venv-kvpress/bin/python -m vllm_graft.tools.kvcompress.kvpress_compare ...`"
)


# ----------------------------------------------------------------------- the mapping
def compression_ratio(fraction: int | str | Fraction) -> float:
    """kvpress's ``compression_ratio`` (the fraction *removed*) for kvbench's budget ``fraction``
    (N: 1/N kept; ``"3/4"``: 3/4 kept, ratio 0.25)."""
    return float(1 - kept(fraction))


def ratio_keeping(n_tokens: int, kept: int) -> float:
    """The ``compression_ratio`` that makes kvpress keep ``kept`` of ``n_tokens`` tokens
    (it keeps ``int(n_tokens * (1 - ratio))``; half a token of margin against rounding)."""
    if not 0 < kept <= n_tokens:
        return 0.0
    return max(0.0, 1.0 - (kept + 0.5) / n_tokens)


def context_budget_tokens(context: int, block: int, fraction: int | str | Fraction) -> int:
    """The tokens kvbench's budget ``fraction`` holds: whole blocks, as kvbench counts them."""
    return kept_blocks(context // block, kept(fraction)) * block


def arm_label(ours: str, fraction: int | str | Fraction) -> str:
    """kvbench's label of a budget arm (``"snapkv 1/4"``, ``"snapkv 3/4"``)."""
    return f"{ours} {kept_label(kept(fraction))}"


def parse_label(label: str) -> tuple[str, Fraction | None]:
    """``"snapkv 1/4"`` -> ``("snapkv", Fraction(1, 4))``; ``"plain"`` -> ``("plain", None)``
    (kvbench's labels, read as :func:`.ruler_report.split_label` reads them)."""
    name, ratio, _ = split_label(label)
    return name, None if ratio is None else kept(ratio)


def select_pairs(names: Sequence[str]) -> list[PressPair]:
    unknown = [n for n in names if n not in PAIRS_BY_NAME]
    if unknown:
        raise SystemExit(
            f"kvpress_compare: no kvpress press paired with {', '.join(unknown)}: the pairs are "
            f"{', '.join(f'{p.ours} ({p.press})' for p in PAIRS)}"
        )
    return [PAIRS_BY_NAME[n] for n in names]


def question_start(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> int | None:
    """Where the question begins in ``ids``: the first token of the shortest tail whose text holds
    everything after the prompt's last blank line (so the newline before the question, and a
    token that merges it with the blank line, belong to the question). ``None`` when the prompt
    has no blank line (no question to hold out)."""
    text = decode(ids)
    cut = text.rfind("\n\n")
    if cut < 0:
        return None
    question = text[cut + 1 :]
    for k in range(1, len(ids)):
        if question in decode(ids[-k:]):
            return len(ids) - k
    return None


# ------------------------------------------------------------------------- the table
def _em_rows(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["arm"]: r for r in rows}


def _hits(row: dict[str, Any] | None) -> str:
    if row is None or row.get("needle_em") is None:
        return "-"
    hits = row.get("needle_hits")
    return f"{row['needle_em']:.2f}" + (f" ({sum(hits)}/{len(hits)})" if hits is not None else "")


def _gen(row: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    if row is None or base is None or not row.get("gen_ppl") or not base.get("gen_ppl"):
        return "-"
    if any(math.isnan(float(x)) for x in (row["gen_ppl"], base["gen_ppl"])):
        return "-"
    return f"{100 * (row['gen_ppl'] / base['gen_ppl'] - 1):+.1f}%"


def build_table(ours: Sequence[dict[str, Any]], theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """The side-by-side rows from kvbench's ``--json`` rows (``ours``) and this module's JSON
    (``theirs``: ``{"meta": ..., "rows": [...]}``): plain first, then each budget arm both
    have, in kvpress's order. The difference is vllm-graft's needle EM minus kvpress's
    (whole-prompt mode); negative where vllm-graft's block version loses, with the needles it
    loses. Arms only one side has are left out."""
    mine = _em_rows(ours)
    rows_theirs = theirs["rows"]
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows_theirs:
        by_mode.setdefault(r.get("mode", "prompt"), {})[r["arm"]] = r
    prompt = by_mode.get("prompt", {})
    context = by_mode.get("context", {})
    out: list[dict[str, Any]] = []
    base_ours, base_theirs = mine.get("plain"), prompt.get("plain")
    order = ["plain"] + [r["arm"] for r in rows_theirs if r.get("mode", "prompt") == "prompt" and r["arm"] != "plain"]
    for arm in dict.fromkeys(order):
        a, b = mine.get(arm), prompt.get(arm)
        if a is None or b is None:
            continue
        name, frac = parse_label(arm)
        pair = PAIRS_BY_NAME.get(name)
        row: dict[str, Any] = {
            "arm": arm,
            "ours": name,
            "press": "none" if name == "plain" else (b.get("press_name") or (pair.press if pair else "?")),
            "kept": "all" if frac is None else kept_label(frac),
            "kvpress_ratio": b.get("compression_ratio", 0.0),
            "ours_em": a.get("needle_em"),
            "theirs_em": b.get("needle_em"),
            "ours_cell": _hits(a),
            "theirs_cell": _hits(b),
            "context_cell": _hits(context.get(arm)),
            "ours_gen": _gen(a, base_ours),
            "theirs_gen": _gen(b, base_theirs),
        }
        diff_cell = "-"
        if a.get("needle_em") is not None and b.get("needle_em") is not None:
            d = a["needle_em"] - b["needle_em"]
            row["difference"] = d
            diff_cell = f"{d:+.2f}"
            total = len(b.get("needle_hits") or a.get("needle_hits") or [])
            if total and d < 0:  # the needles vllm-graft loses (kvbench's printed rows carry the EM only)
                diff_cell += f" (loses {round(-d * total)} of {total})"
            ha, hb = a.get("needle_hits"), b.get("needle_hits")
            if ha is not None and hb is not None and len(ha) == len(hb):
                row["agree"] = sum(x == y for x, y in zip(ha, hb))
        row["difference_cell"] = diff_cell
        out.append(row)
    return out


def format_table(rows: Sequence[dict[str, Any]], *, context_column: bool | None = None) -> str:
    """The rows of :func:`build_table` as a markdown table. The context-only column shows when
    any row has it (or as ``context_column`` says)."""
    if context_column is None:
        context_column = any(r["context_cell"] != "-" for r in rows)
    head = [
        "vllm-graft",
        "kvpress",
        "kept",
        "vllm-graft needle EM",
        "kvpress needle EM",
        "difference",
        *(["kvpress EM, context only"] if context_column else []),
        "vllm-graft gen ppl",
        "kvpress gen ppl",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [
            r["ours"],
            r["press"],
            r["kept"],
            r["ours_cell"],
            r["theirs_cell"],
            r["difference_cell"],
            *([r["context_cell"]] if context_column else []),
            r["ours_gen"],
            r["theirs_gen"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ruler_prompt_tokens(context: int, given: int | None = None) -> int:
    """The RULER prompts' length: ``given`` (``--ruler-context``), else kvbench's (``--context`` less
    its room for the output), so both build the same prompts."""
    return given or context - RULER_ROOM


def format_ruler_table(ours: Sequence[dict[str, Any]], theirs: dict[str, Any]) -> str:
    """Each RULER task's mean score, vllm-graft / kvpress, for the arms both ran it on (whole prompt
    compressed); empty when none did."""
    mine = _em_rows(ours)
    pairs = [
        (r["arm"], mine[r["arm"]], r)
        for r in theirs["rows"]
        if r.get("mode", "prompt") == "prompt" and r.get("ruler_scores") and mine.get(r["arm"], {}).get("ruler_scores")
    ]
    if not pairs:
        return ""
    tasks = list(dict.fromkeys(t for _, a, b in pairs for t in [*a["ruler_tasks"], *b["ruler_tasks"]]))
    head = ["arm", *tasks]
    lines = ["| " + " | ".join(head) + " (vllm-graft / kvpress) |", "|---|" + "---:|" * len(tasks)]
    for arm, a, b in pairs:
        ma, mb = task_means(a), task_means(b)
        cells = [f"{ma[t]:.2f} / {mb[t]:.2f}" if t in ma and t in mb else "-" for t in tasks]
        lines.append("| " + " | ".join([arm, *cells]) + " |")
    return "\n".join(lines)


# ------------------------------------------------------- the RULER suite beside kvbench's
class RulerMismatch(ValueError):
    """kvpress's RULER results cannot stand beside kvbench's: other prompts, or arms missing."""


def _ruler_meta(theirs: dict[str, Any]) -> list[dict[str, Any]]:
    metas = theirs.get("meta")
    metas = metas if isinstance(metas, list) else [metas]
    return [m for m in metas if isinstance(m, dict) and m.get("ruler_cases")]


def _ruler_rows(theirs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """kvpress's rows with RULER scores, whole prompt compressed, by kvbench's label (a later one wins)."""
    return {r["arm"]: r for r in theirs["rows"] if r.get("mode", "prompt") == "prompt" and r.get("ruler_scores")}


def check_ruler_results(
    theirs: dict[str, Any], *, digest: str, labels: Sequence[str], tasks: Sequence[str], case_tasks: Sequence[str]
) -> list[str]:
    """Refuse (:class:`RulerMismatch`, saying what to run) kvpress results that cannot stand beside
    kvbench's RULER arms ``labels``: results without a RULER digest (printed rows, or a run
    without ``--ruler``), built on other prompts than kvbench's (``digest``, of the cases' token
    ids), without plain transformers, or without an arm of a press both projects have (every
    ``labels`` arm whose compressor is in :data:`PAIRS`). ``case_tasks`` is the task of each case,
    in order (kvpress's rows must score the same cases). The arms of ``labels`` that kvpress has
    no press for are returned (they stand alone)."""
    metas = _ruler_meta(theirs)
    if not metas:
        raise RulerMismatch(
            "the kvpress results have no RULER digest (printed rows, or a run without --ruler): pass "
            "kvpress_compare's --json from a run with --ruler"
        )
    want = (
        f"--ruler {','.join(tasks)} --ruler-per-task {len(case_tasks) // max(1, len(tasks))} "
        "(and kvbench's --context, --seed and --ruler-form)"
    )
    for m in metas:
        if m.get("ruler_digest") != digest:
            raise RulerMismatch(
                f"kvpress ran other RULER prompts (digest {m.get('ruler_digest')}: tasks "
                f"{','.join(m.get('ruler_tasks') or []) or '?'}, {m.get('ruler_per_task', '?')} per task, "
                f"form {m.get('ruler_form') or 'code'}, {m.get('ruler_context', '?')} tokens, seed {m.get('seed', '?')}) than kvbench's "
                f"(digest {digest}): rerun kvpress_compare with {want}"
            )
    rows = _ruler_rows(theirs)
    if "plain" not in rows:
        raise RulerMismatch("the kvpress results have no plain RULER row (plain transformers)")
    for arm, r in rows.items():
        if list(r.get("ruler_tasks", [])) != list(case_tasks):
            raise RulerMismatch(f"kvpress's {arm!r} scored other cases than kvbench's ({want})")
    missing: dict[str, list[Fraction]] = {}
    alone: list[str] = []
    for label in labels:
        name, frac = parse_label(label)
        if name == "plain":
            continue
        if name not in PAIRS_BY_NAME or frac is None:
            alone.append(label)
        elif label not in rows:
            missing.setdefault(name, []).append(frac)
    if missing:
        fracs = sorted({f for v in missing.values() for f in v}, reverse=True)
        raise RulerMismatch(
            f"the kvpress results lack {', '.join(arm_label(n, f) for n, v in missing.items() for f in v)} "
            f"(a press both projects have): run .venv-kvpress/bin/python -m vllm_graft.tools.kvcompress."
            f"kvpress_compare --presses {','.join(missing)} --fractions {','.join(map(kept_arg, fracs))} {want} "
            "--modes prompt --json FILE and pass that file too"
        )
    return alone


def _avg(means: dict[str, float], tasks: Sequence[str]) -> float:
    return sum(means[t] for t in tasks) / len(tasks)


def ruler_beside(
    ours: Sequence[dict[str, Any]],
    theirs: dict[str, Any],
    *,
    tasks: Sequence[str],
    digest: str,
) -> dict[str, Any]:
    """kvbench's RULER rows (``ours``: each with ``arm``, ``ruler_tasks``, ``ruler_scores``) beside
    kvpress's (this module's ``--json``), after :func:`check_ruler_results`: per arm both have
    (plain, then each compressor in kvbench's order at its ratios, most kept first), the RULER average of each side (every task weighs the same, as
    :func:`.ruler_report.summarize`), vllm-graft's minus kvpress's, each task's means and the tasks
    where vllm-graft is behind; the plain row says on how many cases the two agree. ``alone``: the
    arms kvpress has no press for; ``kvpress_only``: kvpress arms kvbench did not run."""
    case_tasks = list(ours[0].get("ruler_tasks", [])) if ours else []
    labels = [r["arm"] for r in ours]
    alone = check_ruler_results(theirs, digest=digest, labels=labels, tasks=tasks, case_tasks=case_tasks)
    rows_theirs = _ruler_rows(theirs)
    metas = _ruler_meta(theirs)
    out: list[dict[str, Any]] = []
    for a in ours:
        if a["arm"] in alone or a["arm"] not in rows_theirs:
            continue
        b = rows_theirs[a["arm"]]
        if list(a.get("ruler_tasks", [])) != case_tasks:
            raise RulerMismatch(f"kvbench's {a['arm']!r} scored other cases than its plain row")
        name, frac = parse_label(a["arm"])
        ma, mb = task_means(a), task_means(b)
        row: dict[str, Any] = {
            "arm": a["arm"],
            "compressor": name,
            "press": "none" if name == "plain" else b.get("press_name") or PAIRS_BY_NAME[name].press,
            "kept": "all" if frac is None else kept_label(frac),
            "ours": _avg(ma, tasks),
            "theirs": _avg(mb, tasks),
            "tasks": {t: (ma[t], mb[t]) for t in tasks},
            "kvpress_kept_tokens": b.get("ruler_kept_tokens_median"),
        }
        d = row["ours"] - row["theirs"]
        row["difference"] = 0.0 if abs(d) < 1e-9 else d  # equal averages summed in another order
        row["behind"] = {t: ma[t] - mb[t] for t in tasks if ma[t] < mb[t]}
        row["same_cases"] = sum(float(x) == float(y) for x, y in zip(a["ruler_scores"], b["ruler_scores"]))
        out.append(row)
    names = list(dict.fromkeys(r["compressor"] for r in out))  # each press's ratios together, most kept first
    out.sort(key=lambda r: (names.index(r["compressor"]), -(parse_label(r["arm"])[1] or 1)))
    return {
        "tasks": list(tasks),
        "cases": len(case_tasks),
        "digest": digest,
        "budget": metas[0].get("budget"),
        "versions": metas[0].get("versions"),
        "rows": out,
        "alone": alone,
        "kvpress_only": [arm for arm in rows_theirs if arm not in labels],
    }


def format_ruler_beside(result: dict[str, Any]) -> str:
    """:func:`ruler_beside` as a markdown table: per (press, ratio kept) vllm-graft's RULER average,
    kvpress's, the difference (vllm-graft minus kvpress; where vllm-graft loses, by how much on
    which task), then each task's means (vllm-graft / kvpress); then the lines on the arms left out."""
    tasks = result["tasks"]
    head = ["vllm-graft", "kvpress", "kept", "vllm-graft", "kvpress", "difference", *tasks]
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * (len(head) - 2),
    ]
    for r in result["rows"]:
        diff = f"{r['difference']:+.3f}"
        if r["difference"] < 0:
            diff += " (loses: " + ", ".join(f"{t} {d:+.2f}" for t, d in r["behind"].items()) + ")"
        elif r["behind"]:
            diff += " (behind on " + ", ".join(f"{t} {d:+.2f}" for t, d in r["behind"].items()) + ")"
        cells = [
            r["compressor"],
            r["press"],
            r["kept"],
            f"{r['ours']:.3f}",
            f"{r['theirs']:.3f}",
            diff,
            *(f"{r['tasks'][t][0]:.2f} / {r['tasks'][t][1]:.2f}" for t in tasks),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    plain = next((r for r in result["rows"] if r["compressor"] == "plain"), None)
    if plain is not None:
        lines.append(
            f"\nplain: vLLM and transformers give the same score on {plain['same_cases']} of {result['cases']} cases"
        )
    if result["alone"]:
        lines.append(f"no kvpress press for: {', '.join(result['alone'])}")
    if result["kvpress_only"]:
        lines.append(f"kvpress only (kvbench did not run them): {', '.join(result['kvpress_only'])}")
    return "\n".join(lines)


def read_kvbench(path: str) -> list[dict[str, Any]]:
    """kvbench's rows: its ``--json`` file (a list), or its printed output (one JSON object per
    arm on its own line, without the per-needle hits: what a run stopped early leaves)."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"arm"' in line]
    return data.get("rows", []) if isinstance(data, dict) else data


def read_kvpress(paths: Sequence[str]) -> dict[str, Any]:
    """This module's results: ``--json`` files, or printed output (the rows a run stopped early
    printed), concatenated in order (a later file's arm wins)."""
    rows: list[dict[str, Any]] = []
    meta: list[Any] = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            rows += [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"arm"' in line]
            continue
        rows += data["rows"]
        meta.append(data.get("meta"))
    return {"meta": meta, "rows": rows}


def table_main(ours_path: str, *theirs_paths: str) -> int:
    if not theirs_paths:
        raise SystemExit("kvpress_compare: --table needs kvbench's rows and at least one kvpress result")
    ours = read_kvbench(ours_path)
    theirs = read_kvpress(theirs_paths)
    rows = build_table(ours, theirs)
    if not rows:
        raise SystemExit(f"kvpress_compare: {ours_path} and {', '.join(theirs_paths)} have no arm in common")
    print(format_table(rows))
    ruler = format_ruler_table(ours, theirs)
    if ruler:
        print("\nRULER-style suite, mean score per task:\n")
        print(ruler)
    plain = next((r for r in rows if r["ours"] == "plain"), None)
    if plain is not None and "agree" in plain:
        print(f"\nplain: transformers and vLLM agree on {plain['agree']} of the needles")
    return 0


# ------------------------------------------------------------------------ the runner
def require_kvpress() -> Any:
    """The kvpress module, or :class:`KvpressMissing` naming ``make kvpress``."""
    try:
        import kvpress
    except ImportError as e:
        raise KvpressMissing(MAKE_HINT.format(exe=sys.executable)) from e
    return kvpress


def make_press(kvpress: Any, pair: PressPair, ratio: float) -> Any:
    cls = getattr(kvpress, pair.press)
    if pair.inner is not None:
        return cls(getattr(kvpress, pair.inner)(compression_ratio=ratio))
    return cls(compression_ratio=ratio)


class Runner:
    """One model per attention implementation; the needles and texts through one press."""

    def __init__(self, model: str, threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.path = model
        self._models: dict[str, Any] = {}

    def model(self, attn: str) -> Any:
        if attn not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32, attn_implementation=attn)
            self._models[attn] = m.eval()
        return self._models[attn]

    def _prefill(self, model: Any, press: Any, ids: Sequence[int], cache: Any, start: int = 0) -> Any:
        """``ids[start:]`` through the model after ``ids[:start]`` is in the cache; the press (if
        any) compresses what this forward leaves in the cache. Positions continue from the
        uncompressed length, as kvpress's pipeline does. The last position's logits."""
        import contextlib

        import torch

        if press is None and start:
            return self._after(model, cache, ids[start:], start)[-1]
        t = torch.tensor([list(ids[start:])])
        pos = torch.arange(start, len(ids)).unsqueeze(0)
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=t, past_key_values=cache, position_ids=pos, logits_to_keep=1)
        return out.logits[0, -1]

    @staticmethod
    def _after(model: Any, cache: Any, tokens: Sequence[int], start: int) -> Any:
        """The logits of ``tokens`` at positions ``start``... after the (compressed) cache: one
        forward, or one token at a time where the press left the layers different lengths
        (PyramidKV: transformers builds one mask from the first layer's length)."""
        import torch

        lengths = {cache.get_seq_length(i) for i in range(len(cache))}
        if len(lengths) == 1:
            pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
            return model(input_ids=torch.tensor([list(tokens)]), past_key_values=cache, position_ids=pos).logits[0]
        return torch.cat(
            [
                model(
                    input_ids=torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[start + i]])
                ).logits[0]
                for i, t in enumerate(tokens)
            ]
        )

    def generate(
        self, attn: str, press: Any, ids: Sequence[int], max_tokens: int, split: int | None
    ) -> tuple[list[int], int]:
        """Greedy output of ``max_tokens`` tokens after ``ids`` (the press compressing all of ``ids``,
        or with ``split`` only ``ids[:split]``, the rest prefilled after it), and the tokens the
        first layer's cache held after the prompt."""
        import torch
        from transformers import DynamicCache

        model = self.model(attn)
        cache = DynamicCache()
        with torch.no_grad():
            if split is None:
                logits = self._prefill(model, press, ids, cache)
            else:
                self._prefill(model, press, ids[:split], cache)
                logits = self._prefill(model, None, ids, cache, start=split)
            held = cache.get_seq_length(0)
            out = [int(logits.argmax())]
            for i in range(max_tokens - 1):
                step = model(
                    input_ids=torch.tensor([[out[-1]]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[len(ids) + i]]),
                )
                out.append(int(step.logits[0, -1].argmax()))
        return out, held

    def forced_nll(self, attn: str, press: Any, prompt: Sequence[int], rest: Sequence[int]) -> float:
        """The negative log-likelihood of ``rest`` teacher-forced after ``prompt`` (compressed by the
        press): kvbench's gen ppl numerator for one text."""
        import torch
        from transformers import DynamicCache

        model = self.model(attn)
        cache = DynamicCache()
        with torch.no_grad():
            first = self._prefill(model, press, prompt, cache)
            logps = [torch.log_softmax(first.float(), -1)[rest[0]]]
            if len(rest) > 1:
                lp = torch.log_softmax(self._after(model, cache, rest[:-1], len(prompt)).float(), -1)
                logps += [lp[i, t] for i, t in enumerate(rest[1:])]
        return -float(sum(logps))


def digest(seqs: Sequence[Sequence[int]]) -> str:
    """A short digest of token id sequences (the prompts' ids, in order): both tools write it, and the
    side-by-side tables refuse results built on other prompts."""
    import hashlib

    h = hashlib.sha256()
    for s in seqs:
        h.update(json.dumps(list(s)).encode())
    return h.hexdigest()[:16]


class _Material:
    """The prompts one comparison runs (needles, texts, RULER cases, from the model's tokenizer) and
    the rows they score under one attention and one press: kvbench's fields, so the tables compare."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ..workloads import Tokenizer, needle_haystack, stdlib_texts

        self.args = args
        tok = Tokenizer.from_model(args.model)
        room = args.decode_tokens + 1  # kvbench's: the output tokens
        self.needles = needle_haystack(
            tok, num_prompts=args.needles, context_tokens=args.context - room, seed=args.seed
        )
        self.texts = stdlib_texts(tok, num=args.texts, tokens=args.context - 1, seed=args.seed) if args.texts else []
        self.decode = max(max(len(n.answer_ids) for n in self.needles) + 2, args.decode_tokens)
        self.splits = [question_start(tok.decode, n.token_ids) for n in self.needles]
        self.runner = Runner(args.model, args.threads)
        self.cases: list[Any] = []
        self.tasks: list[str] = []
        self.ruler_context = 0
        self.ruler_decode = 0
        if args.ruler:
            from ..workloads.ruler import ruler_suite, tasks_of

            self.tasks = (
                list(tasks_of(args.ruler_form)) if args.ruler == "all" else [t for t in args.ruler.split(",") if t]
            )
            self.ruler_context = ruler_prompt_tokens(args.context, args.ruler_context)
            self.cases = ruler_suite(
                tok,
                tasks=self.tasks,
                num_per_task=args.ruler_per_task,
                context_tokens=self.ruler_context,
                seed=args.seed,
                form=args.ruler_form,
            )
            self.ruler_decode = ruler_max_tokens(self.cases)

    def needles_row(self, attn: str, press_for: Callable[[int], Any], mode: str) -> dict[str, Any]:
        hits, held = [], []
        for n, split in zip(self.needles, self.splits):
            if mode == "context" and split is None:
                raise SystemExit("kvpress_compare: a needle prompt has no blank line before its question")
            out, kept = self.runner.generate(
                attn,
                press_for(len(n.token_ids) if mode == "prompt" else split or 0),
                n.token_ids,
                self.decode,
                split if mode == "context" else None,
            )
            hits.append(out[: len(n.answer_ids)] == list(n.answer_ids))
            held.append(kept)
        return {
            "needle_em": sum(hits) / len(hits),
            "needle_hits": hits,
            "kept_tokens_median": sorted(held)[len(held) // 2],
        }

    def texts_row(self, attn: str, press_for: Callable[[int], Any]) -> dict[str, Any]:
        gen = self.args.gen_tokens
        if not self.texts or not gen:
            return {}
        nll, n = 0.0, 0
        for ids, _ in self.texts:
            prompt, rest = ids[: len(ids) - gen], ids[len(ids) - gen :]
            nll += self.runner.forced_nll(attn, press_for(len(prompt)), prompt, rest)
            n += len(rest)
        return {"gen_ppl": math.exp(nll / n), "gen_tokens": n}

    def ruler_row(self, attn: str, press_for: Callable[[int], Any]) -> dict[str, Any]:
        """kvbench's RULER fields: every case's score, whole prompt compressed."""
        if not self.cases:
            return {}
        from ..workloads.ruler import score_case

        done = [
            self.runner.generate(attn, press_for(len(c.token_ids)), c.token_ids, self.ruler_decode, None)
            for c in self.cases
        ]
        held = sorted(kept for _, kept in done)
        return {
            "ruler_scores": [score_case(c, out) for c, (out, _) in zip(self.cases, done)],
            "ruler_tasks": [c.task for c in self.cases],
            "ruler_kept_tokens_median": held[len(held) // 2],
        }

    def meta(self, pairs: Sequence[PressPair]) -> dict[str, Any]:
        """What the rows were made with, and the digests the side-by-side tables check."""
        from importlib.metadata import version

        import torch
        import transformers

        args, cases = self.args, self.cases
        return {
            "command": " ".join(["python -m vllm_graft.tools.kvcompress.kvpress_compare", *sys.argv[1:]]),
            "versions": {
                "kvpress": version("kvpress"),
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
            },
            "model": args.model,
            "context": args.context,
            "block": args.block,
            "budget": args.budget,
            "needles": args.needles,
            "needle_prompt_tokens": [len(n.token_ids) for n in self.needles],
            "needle_digest": digest([n.token_ids for n in self.needles]),
            "texts": args.texts,
            "text_digest": digest([ids for ids, _ in self.texts]),
            "ruler_cases": len(cases),
            "ruler_digest": digest([c.token_ids for c in cases]),
            "ruler_context": self.ruler_context if cases else 0,
            "ruler_tasks": self.tasks if cases else [],
            "ruler_per_task": args.ruler_per_task if cases else 0,
            "ruler_form": args.ruler_form if cases else None,
            "gen_tokens": args.gen_tokens,
            "decode_tokens": self.decode,
            "seed": args.seed,
            "pairs": {p.ours: {"press": p.press, "inner": p.inner, "attn": p.attn, "match": p.match} for p in pairs},
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    kvpress = require_kvpress()
    pairs = select_pairs([s for s in args.presses.split(",") if s])
    try:
        fractions = parse_budgets(args.fractions)
    except ValueError as e:
        raise SystemExit(f"kvpress_compare: --fractions {args.fractions}: {e}") from None
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"kvpress_compare: unknown mode(s) {', '.join(bad)}: the modes are {', '.join(MODES)}")
    m = _Material(args)
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "needle_hits"}), flush=True)
        if args.json:  # after every arm: a run cut short keeps what it ran, a valid --json file
            write_json(args.json, {"partial": True, "meta": m.meta(pairs), "rows": rows})

    for attn in dict.fromkeys(["sdpa", *(p.attn for p in pairs)]):
        row: dict[str, Any] = {"arm": "plain" if attn == "sdpa" else f"plain ({attn})", "press_name": None}
        row.update(attn=attn, mode="prompt", compression_ratio=0.0, **m.needles_row(attn, lambda n: None, "prompt"))
        row.update(m.texts_row(attn, lambda n: None))
        row.update(m.ruler_row(attn, lambda n: None))
        emit(row)
    for frac in fractions:
        for pair in pairs:
            for mode in modes:
                budget = context_budget_tokens(args.context, args.block, frac) if args.budget == "context" else None
                ratio = None if budget is not None else compression_ratio(frac)

                def press_for(
                    n: int, pair: PressPair = pair, ratio: float | None = ratio, budget: int | None = budget
                ) -> Any:
                    return make_press(kvpress, pair, ratio if ratio is not None else ratio_keeping(n, budget or 0))

                row = {
                    "arm": arm_label(pair.ours, frac),
                    "ours": pair.ours,
                    "fraction": kept_label(frac),  # the share kept ("1/2"; files before 3/4 say N for 1/N)
                    "press_name": pair.press + (f"({pair.inner})" if pair.inner else ""),
                    "press": repr(press_for(len(m.needles[0].token_ids))),
                    "attn": pair.attn,
                    "mode": mode,
                    "compression_ratio": ratio,
                }
                row.update(m.needles_row(pair.attn, press_for, mode))
                if mode == "prompt":  # a text has no question: one gen ppl per press and budget
                    row.update(m.texts_row(pair.attn, press_for))
                    row.update(m.ruler_row(pair.attn, press_for))
                emit(row)
    return {"meta": m.meta(pairs), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    """kvpress's figures alone (the side-by-side table is ``--table``)."""
    rows = result["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows if r.get("ours")))
    ruler = any(r.get("ruler_scores") for r in rows)
    head = ["press", "kept", *(f"needle EM ({m})" for m in modes), "gen ppl", "kept tokens (median)"]
    head += ["RULER mean per task"] if ruler else []
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        if not r.get("ours"):
            gen = f"{r['gen_ppl']:.3f}" if "gen_ppl" in r else "-"
            cells = [r["arm"], "all", *([_hits(r)] * len(modes)), gen, str(r["kept_tokens_median"])]
            cells += [_ruler_cell(r)] if ruler else []
            lines.append("| " + " | ".join(cells) + " |")
            continue
        if r["mode"] != modes[0]:
            continue
        same = {x["mode"]: x for x in rows if x["arm"] == r["arm"]}
        cells = [
            f"{r['press_name']} ({r['ours']})",
            kept_label(kept(r["fraction"])),
            *(_hits(same.get(m)) for m in modes),
            f"{r['gen_ppl']:.3f}" if "gen_ppl" in r else "-",
            str(r["kept_tokens_median"]),
            *([_ruler_cell(r)] if ruler else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ruler_cell(row: dict[str, Any]) -> str:
    means = task_means(row)
    return ", ".join(f"{t} {m:.2f}" for t, m in means.items()) if means else "-"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm_graft.tools.kvcompress.kvpress_compare",
        description="NVIDIA kvpress's presses on kvbench's model and prompts (in .venv-kvpress: make kvpress), "
        "or --table OURS THEIRS: kvbench's --json beside this command's --json.",
    )
    p.add_argument(
        "--table",
        nargs="+",
        metavar="FILE",
        help="print the side-by-side table: kvbench's --json (or printed rows), then one or more of this "
        "command's --json (or printed rows; a later file's arm wins)",
    )
    p.add_argument("--model", default="models/graft-tiny-llama-recall", help="model folder (HF format)")
    p.add_argument(
        "--presses",
        default=",".join(p.ours for p in PAIRS),
        help=f"vllm-graft names whose kvpress press to run (default all: {', '.join(p.ours for p in PAIRS)})",
    )
    p.add_argument(
        "--fractions",
        default="2,4,8",
        help="kvbench's budgets, the share of the context kept: N for 1/N, or a/b (3/4: compression_ratio 0.25)",
    )
    p.add_argument(
        "--modes",
        default="prompt,context",
        help="prompt: the whole prompt compressed (as vllm-graft); context: the prompt before its question "
        "compressed, the question prefilled after (kvpress's pipeline) (default both)",
    )
    p.add_argument(
        "--budget",
        choices=("prompt", "context"),
        default="prompt",
        help="prompt: compression_ratio 1 - 1/N of each prompt (default); context: keep kvbench's budget "
        "in tokens (context // block // N * block) of each prompt",
    )
    p.add_argument("--context", type=int, default=2048, help="kvbench's --context (default 2048)")
    p.add_argument("--block", type=int, default=32, help="kvbench's --block, for --budget context (default 32)")
    p.add_argument("--needles", type=int, default=16, help="kvbench's --needles (default 16)")
    p.add_argument("--decode-tokens", type=int, default=384, help="kvbench's --decode-tokens (default 384)")
    p.add_argument("--texts", type=int, default=4, help="kvbench's --texts (default 4; 0: no gen ppl)")
    p.add_argument("--gen-tokens", type=int, default=128, help="kvbench's --gen-tokens (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ruler",
        metavar="TASKS",
        help="also the RULER-style suite (tools/workloads/ruler.py): 'all' or a comma list of its tasks, "
        "whole prompt compressed",
    )
    p.add_argument(
        "--ruler-per-task", type=int, default=16, help="RULER cases per task (default 16, kvbench's --ruler-cases)"
    )
    p.add_argument(
        "--ruler-form",
        choices=("code", "noise", "essay"),
        default="code",
        help="RULER's form (kvbench's --ruler-form): code (stdlib source), or RULER's own wording in filler "
        "sentences (noise) or English prose (essay)",
    )
    p.add_argument(
        "--ruler-context",
        type=int,
        help="RULER prompt tokens (default kvbench's: --context - 64)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default torch's)")
    p.add_argument("--json", help="write the result to this file (after every arm: a cut run keeps what it ran)")
    p.add_argument("--markdown", help="write kvpress's table to this file")
    return p


def write_json(path: str, result: dict[str, Any]) -> None:
    """``--json``: written whole to a temporary file, then moved over ``path`` (a reader, or a
    run killed while writing, never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.table:
        return table_main(*args.table)
    try:
        result = run(args)
    except KvpressMissing as e:
        print(f"kvpress_compare: {e}", file=sys.stderr)
        return 2
    table = markdown(result)
    print()
    print(table)
    if args.json:
        write_json(args.json, result)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
