"""`vllm-graft bench --suite [FILE]`: every case of a suite file through the A/B bench, one row
per case (plain vs plugin tokens/s, the ratio against the case's target, memory, quality,
identical outputs), written into a marked section of BENCHMARKS.md with a plot of the ratios.

A suite file (YAML; the default is ``benchmarks/suite.yaml``)::

    output:                      # paths relative to the suite file
      results: suite-results.json  # every case's last row (rows survive --only runs)
      markdown: ../BENCHMARKS.md   # its <!-- bench-suite:start --> ... end --> section is rewritten
      plot: suite.png
    defaults: {workload: chat, num_prompts: 8, max_tokens: 32, repeat: 3}
    quick: {num_prompts: 4, max_tokens: 16, repeat: 2}   # --quick: these replace the defaults
    cases:
      - name: noop-attention
        deployment: ../deployments/shapes/noop-attention.yaml
        target: 0.95             # plugin tok/s / plain tok/s must be at least this
      - name: lookahead-b1
        deployment: ../deployments/spec-lookahead.yaml
        workload: code-completion
        batch: 1
        target: 2.0
        quick: {num_prompts: 4}  # this case's own --quick settings

Adding a case is one entry under ``cases``. Everything here but :func:`cmd_suite` is pure
(no engine): parsing, the row of a case from a bench result, the Markdown and the plot.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .report import PLOT_INSTALL
from .stats import NO_PACKAGE, cpu_isa

MARK_START, MARK_END = "<!-- bench-suite:start -->", "<!-- bench-suite:end -->"
SUITE_SCHEMA = "vllm-graft-bench-suite/1"


def default_suite_path() -> Path:
    from ...launch.engine import repo_root

    return repo_root() / "benchmarks" / "suite.yaml"


class SuiteError(ValueError):
    """A suite file that cannot be used; the message names the file and the field."""


# ============================================================================ the file
class RunSettings(BaseModel):
    """Bench settings of a case (each one a `vllm-graft bench` option)."""

    model_config = ConfigDict(extra="forbid")

    workload: Optional[str] = None
    num_prompts: Optional[int] = Field(default=None, ge=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    batch: Optional[int] = Field(default=None, ge=0)
    repeat: Optional[int] = Field(default=None, ge=1)
    ignore_eos: Optional[bool] = None
    ppl: Optional[bool] = None  # None: on unless the deployment loads dummy weights
    seed: Optional[int] = None
    interleave: Optional[Literal["run", "step"]] = None  # bench --interleave
    pairs: Optional[int] = Field(default=None, ge=1)  # bench --pairs: fresh pairs of engine processes

    @field_validator("workload")
    @classmethod
    def _known_workloads(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            from ..workloads import parse_names

            parse_names([v])  # ValueError naming the accepted workloads
        return v


#: What a case gets when neither it nor the suite's defaults say.
BUILTIN_DEFAULTS = {
    "workload": "chat",
    "num_prompts": 8,
    "max_tokens": 32,
    "batch": 0,
    "repeat": 3,
    "ignore_eos": True,
    "ppl": None,
    "seed": 0,
    "interleave": "step",
    "pairs": 2,
}


class Case(RunSettings):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    deployment: str
    target: Optional[float] = Field(None, gt=0)
    note: Optional[str] = None
    # what the plain arm runs (bench --baseline): a deployment file (relative to the suite file)
    # or "no-package"; none: the deployment's plain twin
    baseline: Optional[str] = None
    # what the ratio compares: output tokens/s of the whole run (default) or decode speed alone
    # (1 / inter-token latency: prefill left out), for a target stated in decode speed
    metric: Literal["output", "decode"] = "output"
    quick: RunSettings = Field(default_factory=RunSettings)
    # an optional package the case needs, as "module: how to install it" (e.g. vLLM's `suffix`
    # method needs arctic_inference): without it the case is skipped, said in one line
    requires: Optional[str] = Field(None, pattern=r"^[A-Za-z_][\w.]*: .+$")

    def missing(self) -> str | None:
        """What this case needs that is not installed (None: nothing)."""
        if self.requires is None:
            return None
        import importlib.util

        module, _, install = self.requires.partition(": ")
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"needs the Python package {module!r} ({install})"


class Output(BaseModel):
    model_config = ConfigDict(extra="forbid")

    results: str = "suite-results.json"
    markdown: Optional[str] = "../BENCHMARKS.md"
    plot: Optional[str] = "suite.png"


class Suite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output: Output = Field(default_factory=Output)
    defaults: RunSettings = Field(default_factory=RunSettings)
    quick: RunSettings = Field(default_factory=RunSettings)
    cases: list[Case] = Field(min_length=1)
    path: Optional[Path] = Field(None, exclude=True)

    @model_validator(mode="after")
    def _unique_names(self) -> "Suite":
        seen: set[str] = set()
        for i, c in enumerate(self.cases):
            if c.name in seen:
                raise ValueError(f"cases[{i}].name: {c.name!r} is used twice; case names must be unique")
            seen.add(c.name)
        return self

    @property
    def folder(self) -> Path:
        return self.path.parent if self.path is not None else Path.cwd()

    def resolve(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else (self.folder / p).resolve()

    def settings(self, case: Case, quick: bool) -> dict[str, Any]:
        """A case's bench settings: built-in defaults < the suite's defaults < the case's own;
        with ``quick``, then the suite's quick settings < the case's quick settings."""
        out = dict(BUILTIN_DEFAULTS)
        layers = [self.defaults, case] + ([self.quick, case.quick] if quick else [])
        for layer in layers:
            for key in RunSettings.model_fields:
                value = getattr(layer, key)
                if value is not None:
                    out[key] = value
        return out

    def select(self, only: Sequence[str] | None) -> list[Case]:
        if not only:
            return list(self.cases)
        names = [n.strip() for part in only for n in part.split(",") if n.strip()]
        known = {c.name: c for c in self.cases}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SuiteError(f"unknown case(s) {', '.join(map(repr, unknown))}; cases: {', '.join(known)}")
        return [c for c in self.cases if c.name in names]


def _where(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse_suite(data: Any, source: str = "<suite>") -> Suite:
    """Validate a suite's parsed YAML; a :class:`SuiteError` names the file, the field
    (e.g. ``cases[2].target``) and what is wrong."""
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: a suite is a mapping with a 'cases' list, got {type(data).__name__}")
    try:
        return Suite.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            loc = _where(err["loc"])
            problems.append(msg if msg.startswith("cases[") else f"{loc}: {msg}")
        raise SuiteError(f"{source}: " + "; ".join(problems)) from None


def load_suite(path: str | os.PathLike[str], *, check_files: bool = True) -> Suite:
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SuiteError(f"{path}: cannot read the suite file ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SuiteError(f"{path}: not valid YAML: {e}") from None
    suite = parse_suite(data, str(path))
    suite.path = path.resolve()
    if check_files:
        for i, c in enumerate(suite.cases):
            if not suite.resolve(c.deployment).is_file():
                raise SuiteError(
                    f"{path}: cases[{i}].deployment: no file {c.deployment!r} "
                    f"(paths are relative to the suite file's folder, {suite.folder})"
                )
            if c.baseline and c.baseline != NO_PACKAGE and not suite.resolve(c.baseline).is_file():
                raise SuiteError(
                    f"{path}: cases[{i}].baseline: no file {c.baseline!r} (a deployment "
                    f"relative to the suite file's folder, {suite.folder}, or {NO_PACKAGE})"
                )
    return suite


def uses_dummy_weights(deployment: Path) -> bool:
    """Whether a deployment's engine loads random weights (``load_format: dummy``): its
    outputs' perplexity means nothing."""
    import yaml

    try:
        data = yaml.safe_load(deployment.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    engine = data.get("engine") or {} if isinstance(data, dict) else {}
    return isinstance(engine, dict) and engine.get("load_format") == "dummy"


def bench_argv(suite: Suite, case: Case, quick: bool) -> list[str]:
    """The `vllm-graft bench` command line of a case (what the row records and what runs)."""
    s = suite.settings(case, quick)
    deployment = suite.resolve(case.deployment)
    argv = [
        str(deployment),
        "--workload",
        s["workload"],
        "--num-prompts",
        str(s["num_prompts"]),
        "--max-tokens",
        str(s["max_tokens"]),
        "--repeat",
        str(s["repeat"]),
        "--pairs",
        str(s["pairs"]),
        "--seed",
        str(s["seed"]),
    ]
    if s["batch"]:
        argv += ["--batch", str(s["batch"])]
    if case.baseline:
        argv += ["--baseline", case.baseline if case.baseline == NO_PACKAGE else str(suite.resolve(case.baseline))]
    if s["ignore_eos"]:
        argv.append("--ignore-eos")
    argv += ["--interleave", s["interleave"]]
    ppl = s["ppl"] if s["ppl"] is not None else not uses_dummy_weights(deployment)
    if not ppl:
        argv.append("--no-ppl")
    return argv


# ============================================================================ the rows
def target_met(ratio: float | None, target: float | None) -> bool | None:
    """Whether the median ratio reaches the target (None: no target or no ratio)."""
    if ratio is None or target is None:
        return None
    return ratio >= target


def case_row(
    case: Case, argv: Sequence[str], result: dict[str, Any], *, quick: bool, display_argv: Sequence[str] | None = None
) -> dict[str, Any]:
    """The suite's row of one case from its bench result (:func:`..stats.assemble`)."""
    arms = result["arms"]
    plain, graft = arms["plain"]["overall"], arms["graft"]["overall"]
    cmp = result["comparison"] or {}
    ratio = (cmp.get("decode_ratio") if case.metric == "decode" else cmp.get("ratio")) or {}
    pp, gp = plain.get("perplexity"), graft.get("perplexity")
    busy = [
        w["summary"].get("other_cpus")
        for a in arms.values()
        for w in a["workloads"].values()
        if w["summary"].get("other_cpus") is not None
    ]
    model = result.get("model") or ""
    return {
        "name": case.name,
        "deployment": case.deployment,
        "baseline": case.baseline,
        "note": case.note,
        "metric": case.metric,
        "plugins": result.get("plugins") or [],
        "model": Path(str(model)).name,
        "workload": ",".join(result["settings"]["workloads"]),
        "num_prompts": result["settings"]["num_prompts"],
        "max_tokens": result["settings"]["max_tokens"],
        "batch": result["settings"]["batch"],
        "repeat": result["settings"]["repeat"],
        "order": result["settings"].get("order"),
        "interleave": result["settings"].get("interleave", "run"),
        "pairs": result["settings"].get("pairs"),
        "ratio_by_pair": ratio.get("by_pair"),
        "quick": quick,
        "command": "vllm-graft bench " + " ".join(display_argv or argv),
        "plain_tok_s": plain["output_tok_s"],
        "plain_tok_s_min": plain.get("output_tok_s_min"),
        "plain_tok_s_max": plain.get("output_tok_s_max"),
        "plain_tok_s_runs": plain.get("output_tok_s_runs"),
        "graft_tok_s": graft["output_tok_s"],
        "graft_tok_s_min": graft.get("output_tok_s_min"),
        "graft_tok_s_max": graft.get("output_tok_s_max"),
        "graft_tok_s_runs": graft.get("output_tok_s_runs"),
        "ratio": ratio.get("ratio"),
        "ratio_min": ratio.get("min"),
        "ratio_max": ratio.get("max"),
        "target": case.target,
        "met": target_met(ratio.get("ratio"), case.target),
        "kv_blocks_plain": plain.get("kv_blocks_peak"),
        "kv_blocks_graft": graft.get("kv_blocks_peak"),
        "rss_mib_plain": plain.get("peak_rss_mib"),
        "rss_mib_graft": graft.get("peak_rss_mib"),
        "load_s_plain": arms["plain"]["engine"].get("load_s"),
        "load_s_graft": arms["graft"]["engine"].get("load_s"),
        "ppl_plain": pp,
        "ppl_graft": gp,
        "ppl_change": (gp - pp) / pp if pp and gp is not None else None,
        "identical": cmp.get("n_identical"),
        "compared": cmp.get("n"),
        "busy_cpus_max": max(busy) if busy else None,
        "wall_s": result.get("wall_s"),
        "run_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def failed_row(
    case: Case, argv: Sequence[str], reason: str, *, quick: bool, display_argv: Sequence[str] | None = None
) -> dict[str, Any]:
    return {
        "name": case.name,
        "deployment": case.deployment,
        "baseline": case.baseline,
        "note": case.note,
        "target": case.target,
        "quick": quick,
        "command": "vllm-graft bench " + " ".join(display_argv or argv),
        "failed": reason,
        "run_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def merge_rows(suite: Suite, old: dict[str, Any], new: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows to show: each case of the suite, in its order, from this run or else from the
    previous results; cases that were never run are left out (rows of removed cases too)."""
    rows = []
    for c in suite.cases:
        row = new.get(c.name) or old.get(c.name)
        if row is not None:
            rows.append(
                row
                | {
                    "target": c.target,
                    "met": row.get("met") if c.name in new else target_met(row.get("ratio"), c.target),
                }
            )
    return rows


# ============================================================================ Markdown
def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _tok(row: dict[str, Any], arm: str) -> str:
    med, lo, hi = row.get(f"{arm}_tok_s"), row.get(f"{arm}_tok_s_min"), row.get(f"{arm}_tok_s_max")
    if med is None:
        return "-"
    if lo is None or hi is None or row.get("repeat", 1) <= 1:
        return f"{med:.1f}"
    return f"{med:.1f} ({lo:.0f}-{hi:.0f})"


def _ratio(row: dict[str, Any]) -> str:
    r = row.get("ratio")
    if r is None:
        return "-"
    lo, hi = row.get("ratio_min"), row.get("ratio_max")
    digits = 4 if row.get("met") is False and round(r, 3) >= (row.get("target") or 0) else 3  # 0.9498 < 0.95
    return (
        f"**{r:.{digits}f}**"
        + (
            f" ({lo:.2f}-{hi:.2f})"
            if lo is not None and hi is not None and (row.get("repeat") or 1) * (row.get("pairs") or 1) > 1
            else ""
        )
        + (" decode" if row.get("metric") == "decode" else "")
        + (f"; pairs {'/'.join(f'{m:.2f}' for m in row['ratio_by_pair'])}" if row.get("ratio_by_pair") else "")
    )


def _target(row: dict[str, Any]) -> str:
    t = row.get("target")
    if t is None:
        return "-"
    met = row.get("met")
    return f">= {t:g}: " + ("yes" if met else "**no**" if met is False else "-")


def _pair(a: Any, b: Any, fmt: str = "{}") -> str:
    if a is None and b is None:
        return "-"
    return f"{_f(a, fmt)} / {_f(b, fmt)}"


def _busy(x: float | None, limit: float) -> str:
    if x is None:
        return "-"
    return f"**{x:.1f}** (disturbed)" if x > limit else f"{x:.1f}"


def short_command(command: str, keep: int = 2) -> str:
    """``command`` with a long run of ``--only NAME`` cut to its first ``keep`` and a count (the
    rows name every case; the full command line is in the results file)."""
    words = command.split()
    only = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--only"]
    if len(only) <= keep + 1:
        return command
    rest = [w for i, w in enumerate(words) if w != "--only" and (i == 0 or words[i - 1] != "--only")]
    shown = " ".join(f"--only {n}" for n in only[:keep])
    return " ".join(rest) + f" {shown} ... ({len(only)} cases)"


def _under_deployments(path: str) -> str:
    """A case's deployment as the table shows it: relative to ``deployments/`` when it lies there."""
    return Path(path).as_posix().removeprefix("../").removeprefix("deployments/")


def render_markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any], plot: str | None) -> str:
    """The generated section: how it was run, one row per case, the plot."""
    lines = [
        f"Generated by `{short_command(meta['command'])}` ({meta['date']}; {meta['machine']}; the whole run took "
        f"{meta['duration_min']:.1f} min). Each case is one `vllm-graft bench` run (commands in "
        f"`{meta['results']}`; 'PxR step' in the runs column: P pairs of engine processes, R rounds each, the arms "
        "taking turns step by step; 'pairs': each pair's ratio). tok/s: median (min-max) of "
        "the runs; ratio: of the per-run ratios plugin / plain ('decode': of 1 / median inter-token latency). "
        "Memory: KV blocks at peak, peak RSS, plain / plugin. Quality: perplexity change ('-': random weights). "
        f"Busy CPUs: the most other processes used in a run (above {meta['busy_limit']}: disturbed). UTC.",
        "",
    ]
    if meta.get("shared_note"):
        lines += [meta["shared_note"], ""]
    lines += [
        "| case | deployment (in deployments/) | model | workload | plain tok/s | plugin tok/s | ratio | target | "
        "KV blocks peak | peak RSS MiB | quality | identical | busy CPUs | run |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        dep = f"`{_under_deployments(r['deployment'])}`"
        if r.get("baseline"):
            dep += f" vs `{_under_deployments(r['baseline'])}`"
        if r.get("failed"):
            lines.append(
                f"| {r['name']} | {dep} | - | - | - | - | failed: {r['failed'][:80]} | {_target(r)} "
                f"| - | - | - | - | - | {r['run_at']} |"
            )
            continue
        wl = f"{r['workload']} {r['num_prompts']} x {r['max_tokens']}" + (f", batch {r['batch']}" if r["batch"] else "")
        quality = "-" if r.get("ppl_change") is None else f"{r['ppl_change'] * 100:+.2f}% ppl"
        ident = "-" if r.get("compared") is None else f"{r['identical']}/{r['compared']}"
        runs = (
            (f"{r['pairs']}x{r['repeat']}" if r.get("pairs") else f"{r['repeat']}x")
            + (" quick" if r.get("quick") else "")
            + (" step" if r.get("interleave") == "step" else "")
            + f", {r['run_at'].removesuffix(' UTC')}"
        )
        lines.append(
            f"| {r['name']} | {dep} | {r['model']} | {wl} | {_tok(r, 'plain')} | {_tok(r, 'graft')} | "
            f"{_ratio(r)} | {_target(r)} | {_pair(r.get('kv_blocks_plain'), r.get('kv_blocks_graft'))} | "
            f"{_pair(r.get('rss_mib_plain'), r.get('rss_mib_graft'), '{:.0f}')} | {quality} | {ident} | "
            f"{_busy(r.get('busy_cpus_max'), meta['busy_limit'])} | {runs} |"
        )
    notes = [r for r in rows if r.get("note")]
    if notes:
        lines.append("")
        lines += [f"- {r['name']}: {r['note']}" for r in notes]
    if plot:
        lines += ["", f"![plugin / plain tokens/s per case, with the targets]({plot})"]
    return "\n".join(lines) + "\n"


def replace_section(text: str, body: str, start: str = MARK_START, end: str = MARK_END) -> str:
    """``text`` with what lies between the marker comments replaced by ``body``; everything
    outside the markers is kept byte for byte. Raises ValueError without both markers."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"expected one {start} ... {end} section (in that order)")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    return f"{before}{start}\n{body}{end}{after}"


# ============================================================================ the plot
def write_suite_plot(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> bool:
    """A small PNG of each case's ratio (median, min-max whiskers) against its target; False
    (nothing written) when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = [r for r in rows if r.get("ratio") is not None]
    fig = Figure(figsize=(8, 0.9 + 0.32 * max(len(rows), 1)), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ys = list(range(len(rows)))[::-1]
    values = [1.0]
    for y, r in zip(ys, rows):
        met = r.get("met")
        color = "#2ca02c" if met else "#d62728" if met is False else "#555555"
        lo, hi = r.get("ratio_min"), r.get("ratio_max")
        if lo is not None and hi is not None:
            ax.plot([lo, hi], [y, y], color=color, linewidth=1.2, alpha=0.6)
            values += [lo, hi]
        ax.plot([r["ratio"]], [y], "o", color=color, markersize=6)
        if r.get("target") is not None:
            ax.plot([r["target"]], [y], marker="|", color="black", markersize=14, markeredgewidth=2)
            values.append(r["target"])
        ax.annotate(
            f"{r['ratio']:.2f}", (r["ratio"], y), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=7
        )
        values.append(r["ratio"])
    ax.axvline(1.0, color="#999999", linewidth=0.8)
    ax.set_xscale("log")  # ratios: 0.5x and 2x equally far from 1
    ax.set_xlim(min(values) / 1.3, max(values) * 1.3)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks(ys, [r["name"] for r in rows], fontsize=7)
    ax.set_xlabel(
        "plugin / plain output tokens/s, log scale (dot: median; line: min-max of the runs; "
        "|: target; green met, red not)",
        fontsize=7,
    )
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(str(path))
    return True


# ============================================================================ the command
def _machine() -> str:
    from ...integration.env import installed_vllm

    found = installed_vllm()
    return (
        f"{os.cpu_count()} CPUs ({cpu_isa()}), {platform.machine()}, {platform.system()}, "
        f"{'%s %s' % found if found else 'no vLLM'}"
    )


def _shown(argv: list[str], root: Path) -> list[str]:
    """A case's bench command line with its paths as the reader would type them."""
    out = list(argv)
    for i, a in enumerate(out):
        if i == 0 or (out[i - 1] == "--baseline" and os.path.isabs(a)):
            try:
                out[i] = os.path.relpath(a, root)
            except ValueError:
                pass
    return out


def _print_table(rows: list[dict[str, Any]], new: dict[str, Any], title: str, out: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("case", "plain tok/s", "plugin tok/s", "ratio", "target", "identical", "busy CPUs"):
        table.add_column(col, justify="left" if col in ("case", "target") else "right")
    for r in rows:
        if r.get("failed"):
            table.add_row(r["name"], "-", "-", f"[red]failed: {escape(r['failed'])}[/]", _target(r), "-", "-")
            continue
        t = _target(r).replace("**", "")
        table.add_row(
            r["name"] + ("" if r["name"] in new else " [dim](earlier run)[/]"),
            _tok(r, "plain"),
            _tok(r, "graft"),
            _ratio(r).replace("**", ""),
            f"[green]{t}[/]" if r.get("met") else f"[red]{t}[/]" if r.get("met") is False else t,
            f"{r.get('identical')}/{r.get('compared')}",
            _f(r.get("busy_cpus_max")),
        )
    out.print(table)


def _write_pages(suite: "Suite", rows: list[dict[str, Any]], meta: dict[str, Any], out: Any, err: Any) -> bool:
    """The suite's plot and its section of the markdown page; False if the page cannot be
    updated (said on ``err``)."""
    from rich.markup import escape

    plot_rel = None
    if suite.output.plot:
        plot_path = suite.resolve(suite.output.plot)
        if write_suite_plot(rows, plot_path):
            out.print(f"plot written to {escape(str(plot_path))}")
            if suite.output.markdown:
                plot_rel = os.path.relpath(plot_path, suite.resolve(suite.output.markdown).parent)
        else:
            out.print(f"[yellow]no plot:[/] matplotlib is not installed ({escape(PLOT_INSTALL)})")
    if suite.output.markdown:
        md = suite.resolve(suite.output.markdown)
        if len({r.get("run") for r in rows}) > 1:
            meta["shared_note"] = (
                "Rows come from more than one run (`--only`): each row says when it ran; "
                "the header describes the latest run."
            )
        try:
            md.write_text(replace_section(md.read_text(), render_markdown(rows, meta, plot_rel)))
        except (OSError, ValueError) as e:
            err.print(f"[bold red]error:[/] cannot update {escape(str(md))}: {escape(str(e))}")
            return False
        out.print(f"section written to {escape(str(md))}")
    return True


def _meta(args: argparse.Namespace, path: Path, suite: "Suite", results_path: Path, root: Path) -> dict[str, Any]:
    """The run's header: the command that makes it (paths from ``root``), when, on what machine."""
    from .stats import BUSY_OTHER_CPUS

    cmdline = (
        "vllm-graft bench --suite"
        + ("" if args.suite == "DEFAULT" else f" {os.path.relpath(path, root)}")
        + (" --quick" if args.quick else "")
        + ("".join(f" --only {o}" for o in args.only or []))
    )
    return {
        "command": cmdline,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "duration_min": 0.0,
        "busy_limit": BUSY_OTHER_CPUS,
        "results": os.path.relpath(results_path, suite.resolve(suite.output.markdown).parent)
        if suite.output.markdown
        else str(results_path),
    }


def _list_cases(suite: Any, quick: bool, root: Path, out: Any) -> None:
    from rich.markup import escape

    for c in suite.cases:
        out.print(
            f"[bold]{escape(c.name)}[/]"
            + (f" (target >= {c.target:g})" if c.target else "")
            + ": vllm-graft bench "
            + escape(" ".join(_shown(bench_argv(suite, c, quick), root))),
            soft_wrap=True,
        )


def _earlier_rows(results_path: Path) -> dict[str, Any]:
    """The rows an earlier run wrote, by case name (none where the file is missing or unreadable)."""
    if not results_path.is_file():
        return {}
    try:
        return {r["name"]: r for r in json.loads(results_path.read_text()).get("rows", [])}
    except (ValueError, KeyError, TypeError):
        return {}


def _save_rows(path: Path, results_path: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The results file, replaced whole (a write cut short leaves the previous one)."""
    runs = {
        "schema": SUITE_SCHEMA,
        "suite": str(os.path.relpath(path, results_path.parent)),
        "last_run": meta,
        "rows": rows,
    }
    results_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = results_path.with_name(results_path.name + ".tmp")
    tmp.write_text(json.dumps(runs, indent=1, default=str) + "\n")
    os.replace(tmp, results_path)


def cmd_suite(args: argparse.Namespace, out: Any, err: Any, *, run_bench: Any, add_command: Any) -> int:
    """The suite command; ``run_bench`` and ``add_command`` are :mod:`.command`'s (passed in: this
    module does not import it back)."""
    from rich.markup import escape

    from ...launch.exits import EXIT_FAILED as EXIT_RUN_FAILED
    from ...launch.exits import EXIT_OK, EXIT_USAGE

    from .report import new_progress

    path = default_suite_path() if args.suite == "DEFAULT" else Path(args.suite)
    try:
        suite = load_suite(path)
        cases = suite.select(args.only)
    except SuiteError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    root = Path.cwd()

    if args.list_cases:
        _list_cases(suite, args.quick, root, out)
        return EXIT_OK

    parser = argparse.ArgumentParser(prog="vllm-graft")
    add_command(parser.add_subparsers())

    results_path = suite.resolve(suite.output.results)
    old = _earlier_rows(results_path)
    meta = _meta(args, path, suite, results_path, root)

    def save(rows: list[dict[str, Any]]) -> None:  # after every case: a stopped run keeps its rows
        _save_rows(path, results_path, meta, rows)

    t0 = time.perf_counter()
    run_id = f"{meta['date']} {uuid.uuid4().hex[:6]}"  # which rows one run wrote
    new: dict[str, dict[str, Any]] = {}
    failures = 0
    if args.render:
        cases = []
        meta = (json.loads(results_path.read_text()).get("last_run") or meta) if results_path.is_file() else meta
    with new_progress(out) as progress:
        overall = progress.add_task("suite", total=len(cases), unit="cases")
        for c in cases:
            argv = bench_argv(suite, c, args.quick)
            progress.update(overall, description=f"suite: {c.name}")
            missing = c.missing()
            if missing:
                out.print(f"{escape(c.name)}: skipped, {escape(missing)}")
                progress.advance(overall)
                continue
            ns = parser.parse_args(["bench", *argv])
            if args.log_dir:
                ns.log_dir = str(Path(args.log_dir) / c.name)
            ns.timeout = args.timeout
            rc, result = run_bench(ns, out, err, progress=progress)
            if result is None or result.get("comparison") is None:
                failures += 1
                new[c.name] = failed_row(c, argv, f"exit code {rc}", quick=args.quick, display_argv=_shown(argv, root))
            else:
                new[c.name] = case_row(c, argv, result, quick=args.quick, display_argv=_shown(argv, root))
                r = new[c.name]
                out.print(
                    f"{escape(c.name)}: plain {_tok(r, 'plain')} tok/s, plugin {_tok(r, 'graft')} tok/s, "
                    f"ratio {_ratio(r).replace('**', '')}, target {_target(r).replace('**', '')}, "
                    f"identical {r['identical']}/{r['compared']}, busy CPUs {_f(r.get('busy_cpus_max'))}"
                )
            new[c.name]["run"] = run_id
            progress.advance(overall)
            meta["duration_min"] = (time.perf_counter() - t0) / 60
            if not args.no_write:
                save(merge_rows(suite, old, new))
    duration = time.perf_counter() - t0
    if cases:
        meta["duration_min"] = duration / 60
    rows = merge_rows(suite, old, new)
    _print_table(rows, new, f"vllm-graft bench suite: {escape(str(path))}" + (" (quick)" if args.quick else ""), out)
    if cases:
        out.print(f"[dim]suite wall time {duration / 60:.1f} min ({len(cases)} case(s))[/]")
    if args.no_write:
        return EXIT_RUN_FAILED if failures else EXIT_OK
    if cases:
        save(rows)
        out.print(f"results written to {escape(str(results_path))}")
    if not _write_pages(suite, rows, meta, out, err):
        return EXIT_USAGE
    return EXIT_RUN_FAILED if failures else EXIT_OK
