"""Rendering of a bench result: the rich table and report, and the PNG plot."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .stats import ARMS, BUSY_OTHER_CPUS, relative_change


def new_progress(console: Console) -> Any:
    """The bench's rich progress display (a bar per arm, the suite's bar over its cases)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        # redrawn twice a second (rich's default is 10): on 2 cores a redraw during a timed run
        # takes a core from the engine's OpenMP threads, and a parallel region waits for its slowest
        refresh_per_second=2,
    )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _change(p: float | None, g: float | None, better: str) -> str:
    rel = relative_change(p, g)
    if rel is None:
        return "-"
    text = f"{rel * 100:+.1f}%"
    if abs(rel) < 0.005:
        return text
    good = rel > 0 if better == "higher" else rel < 0
    return f"[green]{text}[/]" if good else f"[red]{text}[/]"


#: Table columns: header, summary key, formatter, which direction is better.
COLUMNS: tuple[tuple[str, str, Callable[[Any], str], str], ...] = (
    ("out tok/s", "output_tok_s", lambda x: _num(x), "higher"),
    ("(min-max)", "output_tok_s_range", lambda x: x or "", ""),
    ("TTFT mean ms", "ttft_mean_s", _ms, "lower"),
    ("TTFT p90 ms", "ttft_p90_s", _ms, "lower"),
    ("ITL mean ms", "itl_mean_s", _ms, "lower"),
    ("ITL p90 ms", "itl_p90_s", _ms, "lower"),
    ("KV blocks peak", "kv_blocks_peak", lambda x: _num(x, "{:d}"), "lower"),
    ("KV blocks decode", "kv_blocks_decode_median", lambda x: _num(x, "{:g}"), "lower"),  # median
    ("peak RSS MiB", "peak_rss_mib", lambda x: _num(x, "{:.0f}"), "lower"),
    ("ppl", "perplexity", lambda x: _num(x, "{:.3f}"), "lower"),
    ("busy CPUs", "other_cpus", lambda x: _num(x, "{:.1f}"), ""),  # used by other processes
)


def _identical_cell(cmp: dict[str, Any] | None) -> str:
    if cmp is None:
        return "-"
    text = f"{cmp['n_identical']}/{cmp['n']}"
    if cmp["identical"]:
        return f"[green]{text} yes[/]"
    firsts = [p for p in cmp["prompts"] if not p["identical"]] if "prompts" in cmp else []
    where = f" (#{firsts[0]['index']}@{firsts[0]['first_diff']})" if firsts else ""
    return f"[red]{text} no{where}[/]"


def _order_text(order: list[list[str]] | None) -> str:
    """How the arms took turns, e.g. "; arms alternating: graft plain, plain graft, graft plain"."""
    if not order or len(order) < 2 or len(order[0]) < 2:
        return ""
    return "; arms alternating: " + ", ".join(" ".join(o) for o in order)


def render_table(result: dict[str, Any]) -> Table:
    s = result["settings"]
    runs = s.get("repeat") or 1
    plugins = ", ".join(result.get("plugins") or []) or "no plugins"
    table = Table(
        title=f"vllm-graft bench: {escape(result['deployment'])} ({escape(plugins)}); "
        f"{s['num_prompts']} prompts x <= {s['max_tokens']} tokens per workload, greedy"
        + (f"; plain arm: {escape(s['baseline'])}" if s.get("baseline") else "")
        + (" as is (its plugins on)" if s.get("baseline_as_is") else "")
        + (f"; median of {runs} runs" if runs > 1 else "")
        + _order_text(s.get("order")),
        title_justify="left",
    )
    columns = [c for c in COLUMNS if c[1] != "output_tok_s_range" or runs > 1]
    table.add_column("workload", no_wrap=True)
    table.add_column("arm", no_wrap=True)
    for header, *_ in columns:  # two-line headers: the numbers set the width (cells never wrap)
        table.add_column("\n".join(header.rsplit(" ", 1)) if len(header) > 9 else header, justify="right", no_wrap=True)
    table.add_column("identical", no_wrap=True)
    arms = [a for a in ARMS if a in result["arms"]]
    names = [w["name"] for w in result["workloads"]]
    groups = [(n, n) for n in names] + ([("all", None)] if len(names) > 1 else [])
    cmp_all = result.get("comparison")
    for label, name in groups:
        summaries = {
            a: dict(result["arms"][a]["workloads"][name]["summary"] if name else result["arms"][a]["overall"])
            for a in arms
        }
        for summ in summaries.values():
            lo, hi = summ.get("output_tok_s_min"), summ.get("output_tok_s_max")
            summ["output_tok_s_range"] = f"{lo:.1f}-{hi:.1f}" if lo is not None and hi is not None else ""
        for i, arm in enumerate(arms):
            cells = [fmt(summaries[arm].get(key)) for _, key, fmt, _ in columns]
            if cmp_all is None:
                ident = "-"
            elif arm == "plain":
                ident = "reference"
            else:
                ident = _identical_cell(cmp_all["workloads"][name] if name else cmp_all)
            table.add_row(
                label if i == 0 else "", arm, *cells, ident, end_section=len(arms) == 1 and label != groups[-1][0]
            )
        if len(arms) == 2:
            p, g = summaries["plain"], summaries["graft"]
            table.add_row(
                "",
                "[dim]change[/]",
                *[_change(p.get(key), g.get(key), better) if better else "" for _, key, _, better in columns],
                "",
                end_section=True,
            )
    return table


def render_report(result: dict[str, Any], console: Console) -> None:
    console.print(render_table(result))
    cmp = result.get("comparison")
    if cmp is not None:
        if cmp["identical"]:
            console.print(f"[green]Greedy outputs identical for all {cmp['n']} prompts.[/]")
        else:
            console.print(f"[red]Greedy outputs differ for {cmp['n'] - cmp['n_identical']} of {cmp['n']} prompts:[/]")
            shown = 0
            for name, c in cmp["workloads"].items():
                for p in c["prompts"]:
                    if p["identical"] or shown >= 12:
                        continue
                    shown += 1
                    pos = p["first_diff"]
                    reqs = {
                        a: result["arms"][a]["workloads"][name]["requests"][p["index"]]["output_token_ids"]
                        for a in ("plain", "graft")
                    }
                    tok = {a: (reqs[a][pos] if pos < len(reqs[a]) else "end") for a in reqs}
                    console.print(
                        f"  {escape(name)} #{p['index']} ({escape(p.get('source', ''))}): first "
                        f"difference at output token {pos} (plain {tok['plain']}, graft {tok['graft']}; "
                        f"{p['plain_tokens']} vs {p['graft_tokens']} tokens)"
                    )
    ratio = (cmp or {}).get("ratio")
    if ratio is not None and len(ratio.get("runs") or []) > 1 and ratio.get("min") is not None:
        pairs = ", ".join(f"{m:.3f}" for m in ratio.get("by_pair") or [])
        console.print(
            f"Speed: graft / plain output tokens/s {ratio['ratio']:.3f} (median of the "
            f"{len(ratio['runs'])} paired runs' ratios, range {ratio['min']:.3f}-"
            f"{ratio['max']:.3f}; ratio of the arms' medians {ratio.get('of_medians', ratio['ratio']):.3f}; "
            + (f"each pair of engine processes' median {pairs}; " if pairs else "")
            + f"CPU {result.get('environment', {}).get('cpu_isa', 'ISA not recorded')})."
        )
    if result.get("environment", {}).get("threads"):
        console.print(f"[dim]Model threads: {escape(result['environment']['threads'])}[/]")
    busy = [
        (arm, name, w["summary"]["other_cpus"])
        for arm, a in result["arms"].items()
        for name, w in a["workloads"].items()
        if (w["summary"].get("other_cpus") or 0) > BUSY_OTHER_CPUS
    ]
    if busy:
        where = ", ".join(f"{arm} {name} {n:.1f}" for arm, name, n in busy)
        console.print(
            f"[yellow]warning:[/] other processes used CPUs during the timed runs ({where} CPUs "
            f"on average, of {os.cpu_count()}); those timings are unreliable: run on a quiet "
            "machine, or use --repeat"
        )
    for arm in ("graft", "plain"):
        a = result["arms"].get(arm)
        if a and not a["overall"].get("runs_identical", True):
            console.print(
                f"[yellow]warning:[/] the {arm} arm's repeated runs gave different greedy outputs "
                "(batch-dependent numerics?); the table shows the median run"
            )
    for arm in ("graft", "plain"):
        a = result["arms"].get(arm)
        if a:
            e = a["engine"]
            console.print(
                f"[dim]{arm}: engine load {e.get('load_s', 0):.1f} s, warm-up {e.get('warmup_s', 0):.2f} s, "
                f"KV pool {e.get('num_blocks')} blocks of {e.get('block_size')} tokens, "
                f"peak RSS {_num(a.get('peak_rss_mib'), '{:.0f}')} MiB "
                f"(after load {_num(a.get('rss_after_load_mib'), '{:.0f}')} MiB)[/]"
            )
    console.print(
        "[dim]How measured: TTFT/ITL from per-token perf_counter stamps taken as each engine step "
        "returns (in-process engine driven step by step; vLLM's RequestStateStats kept in the JSON); "
        "tokens/s = output tokens / wall time of the run; KV blocks = peak blocks allocated in the "
        "scheduler's block pool (sampled after each schedule()), and their median over the decode "
        "steps (every scheduled request past its prompt; the peak is usually the prefill); peak RSS = ru_maxrss of the arm's "
        "process; ppl = output tokens under the unmodified model (prompt_logprobs).[/]"
    )
    report = result.get("runtime_report")
    if report is not None:
        if not report:
            console.print("Plugins (graft arm): none enabled by the deployment; both arms ran plain vLLM.")
        else:
            t = Table(title="What each plugin did (graft arm)", title_justify="left", box=None, padding=(0, 2))
            for col in ("kind", "plugin", "instantiated", "events", "described"):
                t.add_column(col, overflow="fold")
            for r in report:
                t.add_row(
                    r["kind"],
                    r["name"],
                    "yes" if r.get("instantiated") else "no",
                    escape(", ".join(f"{k}={v}" for k, v in r.get("events", {}).items()) or "-"),
                    escape(json.dumps(r.get("described") or {}, default=str)),
                )
            console.print(t)


def _bar_label(v: float) -> str:
    if v != v:  # NaN: not measured
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


#: matplotlib is optional (only the plots use it): the extra that brings it.
PLOT_INSTALL = "pip install 'vllm-graft[plot]'"


def plot_available() -> bool:
    """Whether matplotlib can be imported (checked before an engine starts, for --plot)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """A PNG of the side-by-side figures (matplotlib, Agg canvas: no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"the plot needs matplotlib, which is not installed: {PLOT_INSTALL}", name="matplotlib"
        ) from e

    arms = [a for a in ARMS if a in result["arms"]]
    names = [w["name"] for w in result["workloads"]]
    labels = names + (["all"] if len(names) > 1 else [])
    panels = [
        ("output tokens/s", "output_tok_s", 1.0),
        ("TTFT mean (ms)", "ttft_mean_s", 1000.0),
        ("ITL mean (ms)", "itl_mean_s", 1000.0),
        ("peak KV blocks in use", "kv_blocks_peak", 1.0),
        ("perplexity of outputs (unmodified model)", "perplexity", 1.0),
        ("peak RSS of the arm (MiB)", "peak_rss_mib", 1.0),
    ]
    colors = {"plain": "#7f7f7f", "graft": "#1f77b4"}
    fig = Figure(figsize=(15, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    width = 0.8 / max(len(arms), 1)
    for ax, (title, key, scale) in zip(axes.flat, panels):
        for j, arm in enumerate(arms):
            values = []
            for label in labels:
                s = (
                    result["arms"][arm]["overall"]
                    if label == "all"
                    else result["arms"][arm]["workloads"][label]["summary"]
                )
                v = s.get(key)
                values.append(float("nan") if v is None else v * scale)
            xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(labels))]
            bars = ax.bar(xs, values, width, label=arm, color=colors[arm])
            ax.bar_label(bars, labels=[_bar_label(v) for v in values], fontsize=7, padding=1)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(labels)), [t.replace("-", "-\n", 1) for t in labels], fontsize=8)
        ax.set_xlim(-0.75, len(labels) - 0.25)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    cmp = result.get("comparison")
    ident = "-" if cmp is None else f"identical greedy outputs: {cmp['n_identical']}/{cmp['n']}"
    s = result["settings"]
    if any(
        (w["summary"].get("other_cpus") or 0) > BUSY_OTHER_CPUS
        for a in result["arms"].values()
        for w in a["workloads"].values()
    ):
        ident += "; WARNING: other processes were busy, timings disturbed"
    fig.suptitle(
        f"vllm-graft bench {result['deployment']} ({', '.join(result.get('plugins') or []) or 'no plugins'}): "
        f"{s['num_prompts']} prompts x <= {s['max_tokens']} tokens, greedy; {ident}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(str(path))
