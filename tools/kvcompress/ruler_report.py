"""The RULER-style suite's report for ``vllm-graft kvbench --suite ruler``: the score-vs-ratio
summary of kvbench's rows, its two tables (the average per compressor and ratio kept; the
per-task detail) and an SVG plot written as plain text (no plotting library).

The summary is a plain dict (what ``--ruler-out`` writes)::

    {"tasks": ["single", ...], "cases_per_task": 16, "context": 2048,
     "arms": [{"arm": "streaming 1/4", "compressor": "streaming", "ratio": "1/4",
               "kept": 0.25, "scores": {"single": 0.5, ...}, "average": 0.41}, ...]}

``ratio`` is the budget as a fraction of the context's KV blocks ("1/2", "1/4", ...), ``None``
for an arm without a budget (plain vLLM, kv4 alone, a plugin without ``budget_blocks``): those
keep every block (``kept`` 1.0). Never imports vLLM.
"""

from __future__ import annotations

import math
import re
from html import escape
from fractions import Fraction
from typing import Any, Sequence

_RATIO = re.compile(r"^(?P<name>.+) (?P<num>\d+)/(?P<den>\d+)$")
#: Tokens of the context kvbench leaves for a RULER case's output (:func:`ruler_max_tokens`):
#: the prompts are ``--context`` - this long (kvpress_compare builds the same).
RULER_ROOM = 64
#: Line colours of the plot, one per compressor in order (plain is black, dashed).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def ruler_max_tokens(cases: Sequence[Any]) -> int:
    """Tokens each RULER request generates (kvbench and kvpress_compare alike): room for every
    answer of the longest case, with a few tokens around each (multivalue's values are found
    anywhere in the output)."""
    return max(sum(len(a) + 4 for a in c.answers) for c in cases) + 4


def kept(value: int | str | Fraction) -> Fraction:
    """A budget as the share of the context's KV blocks kept: an integer N is 1/N (``--fractions
    2,4``), ``"a/b"`` is a/b (``3/4``: kvpress's ``compression_ratio`` 0.25); 0 < kept <= 1."""
    try:
        if isinstance(value, Fraction):
            share = value
        elif isinstance(value, str) and "/" in value:
            share = Fraction(value)
        else:
            share = Fraction(1, int(value))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"a budget is N (1/N of the context kept) or a/b (a/b kept), not {value!r}") from None
    if not 0 < share <= 1:
        raise ValueError(f"a budget keeps more than none and at most all of the context, not {value!r}")
    return share


def parse_budgets(text: str) -> tuple[Fraction, ...]:
    """``--fractions`` (kvbench, kvpress_compare): a comma list of :func:`kept` budgets."""
    return tuple(kept(f.strip()) for f in text.split(","))


def kept_label(share: Fraction) -> str:
    """The budget's part of an arm's label: ``"1/4"``, ``"3/4"``."""
    return f"{share.numerator}/{share.denominator}"


def kept_arg(share: Fraction) -> str:
    """The budget as ``--fractions`` takes it: ``"4"`` for 1/4, ``"3/4"``."""
    return str(share.denominator) if share.numerator == 1 else kept_label(share)


def kept_blocks(blocks: int, share: Fraction) -> int:
    """Whole blocks of ``blocks`` that the budget ``share`` keeps (rounded down)."""
    return blocks * share.numerator // share.denominator


def split_label(label: str) -> tuple[str, str | None, float]:
    """An arm's label as ``(compressor, ratio, kept)``: ``"h2o 1/4"`` -> ``("h2o", "1/4", 0.25)``,
    ``"h2o 3/4"`` -> ``("h2o", "3/4", 0.75)``; a label without a budget -> ``(label, None, 1.0)``."""
    m = _RATIO.match(label)
    if not m or int(m["den"]) == 0:
        return label, None, 1.0
    share = Fraction(int(m["num"]), int(m["den"]))
    return m["name"], kept_label(share), float(share)


def task_means(row: dict[str, Any]) -> dict[str, float]:
    """A kvbench row's mean score per RULER task (``ruler_tasks`` and ``ruler_scores``, one per
    case), in the order the tasks first appear."""
    per: dict[str, list[float]] = {}
    for task, score in zip(row.get("ruler_tasks", []), row.get("ruler_scores", [])):
        per.setdefault(task, []).append(float(score))
    return {t: sum(v) / len(v) for t, v in per.items()}


def summarize(
    rows: Sequence[dict[str, Any]], tasks: Sequence[str], *, cases_per_task: int, context: int
) -> dict[str, Any]:
    """The summary of kvbench's rows (each with ``arm``, ``ruler_tasks`` and ``ruler_scores``,
    one score per case): per arm the mean score per task and their average (every task
    weighs the same); with a ``plain`` row, each arm's ``vs_plain``: its average minus plain's
    and the standard error of that difference over the paired cases (:func:`paired_difference`)."""
    plain = next((r for r in rows if r["arm"] == "plain"), None)
    arms = []
    for r in rows:
        means = task_means(r)
        scores = {t: means[t] for t in tasks if t in means}  # a task not asked for is left out
        missing = [t for t in tasks if t not in scores]
        if missing:
            raise ValueError(f"arm {r['arm']!r} has no score for {', '.join(missing)}")
        name, ratio, kept = split_label(r["arm"])
        arms.append(
            {
                "arm": r["arm"],
                "compressor": name,
                "ratio": ratio,
                "kept": kept,
                "scores": scores,
                "average": sum(scores.values()) / len(scores),
                **({"vs_plain": paired_difference(r, plain, tasks)} if plain is not None else {}),
            }
        )
    return {"tasks": list(tasks), "cases_per_task": cases_per_task, "context": context, "arms": arms}


def paired_difference(row: dict[str, Any], base: dict[str, Any], tasks: Sequence[str]) -> dict[str, float]:
    """``row``'s RULER average minus ``base``'s over the same cases (both kvbench rows), and the
    standard error of that difference: per task the mean and the variance of the per-case
    differences over its cases, the average over the tasks as the average is, so the error is
    sqrt(sum of the tasks' squared errors) / tasks. Pairing removes what the two arms share (the
    cases plain gets wrong, most cases a compressor leaves alone): on 24 cases an arm's average
    carries ~0.07 of sampling error, its difference from plain often a third of that."""
    if list(row.get("ruler_tasks", [])) != list(base.get("ruler_tasks", [])):
        raise ValueError(f"arm {row['arm']!r} scored other cases than {base['arm']!r}")
    per: dict[str, list[float]] = {}
    for task, a, b in zip(row["ruler_tasks"], row["ruler_scores"], base["ruler_scores"]):
        per.setdefault(task, []).append(float(a) - float(b))
    means, variances = [], []
    for t in tasks:
        d = per[t]
        m = sum(d) / len(d)
        var = sum((x - m) ** 2 for x in d) / (len(d) - 1) if len(d) > 1 else 0.0
        means.append(m)
        variances.append(var / len(d))
    return {"difference": sum(means) / len(tasks), "paired_se": math.sqrt(sum(variances)) / len(tasks)}


def _ratios(summary: dict[str, Any]) -> list[str]:
    """The ratios of the summary's arms, largest kept first."""
    seen = {a["ratio"]: a["kept"] for a in summary["arms"] if a["ratio"] is not None}
    return sorted(seen, key=lambda r: -seen[r])


def _compressors(summary: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for a in summary["arms"]:
        if a["compressor"] not in out:
            out.append(a["compressor"])
    return out


def tables(summary: dict[str, Any]) -> str:
    """The two tables, as markdown: the RULER average per compressor (rows) and ratio kept
    (columns; "1" is every block: plain vLLM and arms without a budget), then the per-task
    detail per arm."""
    ratios = _ratios(summary)
    by = {(a["compressor"], a["ratio"]): a for a in summary["arms"]}
    cols = ["1", *ratios]
    lines = [
        "| compressor | " + " | ".join(f"kept {c}" for c in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name in _compressors(summary):
        cells = []
        for ratio in [None, *ratios]:
            a = by.get((name, ratio))
            cells.append(f"{a['average']:.3f}" if a else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    tasks = summary["tasks"]
    paired = all("vs_plain" in a for a in summary["arms"])
    head = " | ".join([*tasks, "average", *(["vs plain (paired error)"] if paired else [])])
    lines += ["", f"| arm | {head} |", "|---|" + "---:|" * (len(tasks) + 1 + paired)]
    for a in summary["arms"]:
        cells = [f"{a['scores'][t]:.3f}" for t in tasks] + [f"**{a['average']:.3f}**"]
        if paired:
            v = a["vs_plain"]
            cells.append("" if a["arm"] == "plain" else f"{v['difference']:+.3f} ({v['paired_se']:.3f})")
        lines.append(f"| {a['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def svg(summary: dict[str, Any], *, width: int = 640, height: int = 400, beside: dict[str, Any] | None = None) -> str:
    """Score (RULER average, 0..1) against ratio kept (log scale, 1 at the right): one line
    per compressor with a budget, plain vLLM as a dashed horizontal reference; an arm
    without a budget other than plain is a point at ratio 1. With ``beside`` (kvpress_compare's
    ``ruler_beside``), each press kvpress ran is a dashed line in its compressor's colour."""
    left, right, top, bottom = 60, 150, 40, 50
    pw, ph = width - left - right, height - top - bottom
    ratios = _ratios(summary)
    xs = ["1", *ratios][::-1]  # smallest kept on the left
    step = pw / max(1, len(xs) - 1)
    xpos = {r: left + i * step for i, r in enumerate(xs)}

    def y(v: float) -> float:
        return top + ph * (1.0 - v)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left + pw / 2:.1f}" y="20" text-anchor="middle" font-size="14">RULER-style suite '
        f"({escape(', '.join(summary['tasks']))}; {summary['cases_per_task']} cases each, "
        f"context {summary['context']})</text>",
    ]
    for i in range(6):  # grid and y ticks
        v = i / 5
        out.append(
            f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + pw}" y2="{y(v):.1f}" stroke="#ddd"/>'
            f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>'
        )
    for r, x in xpos.items():
        out.append(
            f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 5}" stroke="black"/>'
            f'<text x="{x:.1f}" y="{top + ph + 20}" text-anchor="middle">{r}</text>'
        )
    out.append(
        f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>'
        f'<text x="{left + pw / 2:.1f}" y="{height - 10}" text-anchor="middle">'
        "ratio kept (budget / context blocks)</text>"
        f'<text x="16" y="{top + ph / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {top + ph / 2:.1f})">score (exact match, average)</text>'
    )
    legend = iter(range(top + 10, height, 18))  # the legend's rows, one per series

    def key(stroke: str, label: str) -> str:
        ly = next(legend)
        return (
            f'<line x1="{left + pw + 10}" y1="{ly}" x2="{left + pw + 30}" y2="{ly}" {stroke}/>'
            f'<text x="{left + pw + 35}" y="{ly + 4}">{label}</text>'
        )

    plain = next((a for a in summary["arms"] if a["arm"] == "plain"), None)
    if plain is not None:
        py = y(plain["average"])
        dashed = 'stroke="black" stroke-dasharray="6 4"'
        out.append(
            f'<line class="plain" x1="{left}" y1="{py:.1f}" x2="{left + pw}" y2="{py:.1f}" {dashed}/>'
            + key(dashed, f"plain {plain['average']:.3f}")
        )
    names = [n for n in _compressors(summary) if n != "plain"]
    for i, name in enumerate(names):
        colour = COLOURS[i % len(COLOURS)]
        pts = sorted(
            (
                (xpos["1" if a["ratio"] is None else a["ratio"]], y(a["average"]))
                for a in summary["arms"]
                if a["compressor"] == name
            ),
        )
        if len(pts) > 1:
            coords = " ".join(f"{x:.1f},{yy:.1f}" for x, yy in pts)
            out.append(
                f'<polyline data-compressor="{escape(name)}" points="{coords}" fill="none" '
                f'stroke="{colour}" stroke-width="2"/>'
            )
        for x, yy in pts:
            out.append(f'<circle data-compressor="{escape(name)}" cx="{x:.1f}" cy="{yy:.1f}" r="3.5" fill="{colour}"/>')
        out.append(key(f'stroke="{colour}" stroke-width="2"', escape(name)))
        theirs = sorted(
            (xpos[r["kept"]], y(r["theirs"]))
            for r in (beside or {}).get("rows", [])
            if r["compressor"] == name and r["kept"] in xpos
        )
        if theirs:
            stroke = f'stroke="{colour}" stroke-width="2" stroke-dasharray="4 3"'
            coords = " ".join(f"{x:.1f},{yy:.1f}" for x, yy in theirs)
            out.append(
                f'<polyline data-kvpress="{escape(name)}" points="{coords}" fill="none" {stroke}/>'
                + "".join(
                    f'<rect data-kvpress="{escape(name)}" x="{x - 3:.1f}" y="{yy - 3:.1f}" width="6" height="6" '
                    f'fill="{colour}"/>'
                    for x, yy in theirs
                )
                + key(stroke, f"{escape(name)} (kvpress)")
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"
