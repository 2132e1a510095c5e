"""`vllm-graft bench DEPLOYMENT`: the A/B benchmark, plain vLLM vs the deployment.

One command run sends the same deterministic workloads (:mod:`.workloads`) through two
engines, each in its own spawned child process with an in-process vLLM engine:

* ``graft``: ``vllm.LLM(**llm_kwargs(plan, graft=True))``: the deployment's plugins active;
* ``plain``: ``vllm.LLM(**llm_kwargs(plan, graft=False))``: the same model and engine
  arguments, no plugins. It runs second and also scores both arms' outputs under the
  unmodified model (perplexity).

How each figure is measured (also written into the JSON output, ``measurement``):

* output tokens/s: output tokens of all requests of a workload / wall time from the first
  request submitted to the last token received (the engine loop below; warm-up excluded).
* TTFT and inter-token latency: the child drives the engine itself (``LLMEngine.add_request``
  with cumulative outputs, then ``LLMEngine.step()`` until done) and stamps every output
  token with ``time.perf_counter()`` when the step that produced it returns. TTFT = first
  token - submission of that request; ITL = the gaps between a request's tokens (a step that
  delivers k tokens at once, as speculative decoding does, counts as k gaps of 1/k of it);
  TPOT (per request) = (last - first token) / (tokens - 1). vLLM's own per-request
  ``RequestOutput.metrics`` (``RequestStateStats``, ``disable_log_stats=False``) are kept
  beside them in the JSON as a cross-check (``vllm_ttft_s``, ``vllm_tpot_s``).
* KV blocks in use: blocks allocated from the scheduler's KV block pool
  (``scheduler.kv_cache_manager.block_pool``: total - free - the null block), sampled after
  every ``Scheduler.schedule()`` call (the allocation point) via a patch through
  :data:`~vllm_graft.integration.patches.PATCHES` (owner ``bench``, undone afterwards);
  the peak per workload is reported. Prefix-cached blocks no request holds count as free.
* peak memory: ``ru_maxrss`` of the arm's child process after its last timed workload
  (model, KV cache and generation; the plain arm's scoring pass comes after and is not in it).
* identical outputs: greedy (temperature 0) output token ids, per prompt, graft vs plain;
  the first differing output-token position when they differ.
* perplexity: exp(mean negative log-likelihood of the output tokens) under the unmodified
  model: prompt + output scored by the plain engine with ``prompt_logprobs=0``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_RUN_FAILED, EXIT_DIFFERENT = 0, 1, 2, 4, 5
ARMS = ("plain", "graft")
SCHEMA = "vllm-graft-bench/1"

MEASUREMENT = {
    "output_tok_s": "output tokens of all requests / wall time from the first request submitted "
                    "to the last token received (warm-up excluded); with --repeat N, the run with "
                    "the median wall time (every run's figure under output_tok_s_runs)",
    "ttft": "per request: perf_counter when the engine step returning its first output token "
            "ends - when the request was submitted (LLMEngine.add_request, in-process engine "
            "driven step by step)",
    "itl": "per output token after the first: gap to the previous token of the same request "
           "(a step delivering k tokens counts as k gaps of 1/k); tpot = (last - first) / (n - 1)",
    "vllm_metrics": "vLLM's RequestOutput.metrics (RequestStateStats): first_token_latency and "
                    "(last_token_ts - first_token_ts) / (n - 1), kept per request as a cross-check",
    "kv_blocks": "blocks allocated from the scheduler's KV block pool (total - free - null block), "
                 "sampled after every Scheduler.schedule(); peak per workload",
    "peak_rss": "ru_maxrss of the arm's child process after its last timed workload",
    "other_cpus": "CPUs used on average by other processes during a run (/proc/stat busy time minus "
                  "the arm's own CPU time, / wall time); well above 0 means the timings are disturbed",
    "identical": "greedy output token ids, graft vs plain, per prompt; first differing output position",
    "perplexity": "exp(mean NLL of the output tokens) under the unmodified model (plain engine, "
                  "prompt_logprobs=0 on prompt + output)",
}


# ======================================================================== pure helpers
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (as numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def token_gaps(times: Sequence[float]) -> list[float]:
    """Inter-token gaps of one request from per-token arrival times (non-decreasing). Tokens
    that arrive together (k in one step) share the gap before them: k gaps of gap/k."""
    gaps: list[float] = []
    i = 1
    while i < len(times):
        j = i
        while j + 1 < len(times) and times[j + 1] == times[i]:
            j += 1
        k = j - i + 1
        gaps += [(times[i] - times[i - 1]) / k] * k
        i = j + 1
    return gaps


def request_timing(submit: float, token_times: Sequence[float]) -> dict[str, Any]:
    """TTFT, TPOT and ITL gaps of one request (seconds) from its submission time and
    per-token arrival times."""
    if not token_times:
        return {"ttft_s": None, "tpot_s": None, "itl_s": []}
    n = len(token_times)
    return {"ttft_s": token_times[0] - submit,
            "tpot_s": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
            "itl_s": token_gaps(token_times)}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (the shorter length when one is a
    prefix of the other); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(plain: Sequence[Sequence[int]], graft: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per-prompt comparison of two arms' output token ids (same prompts, same order)."""
    if len(plain) != len(graft):
        raise ValueError(f"{len(plain)} plain outputs vs {len(graft)} graft outputs")
    prompts = []
    for i, (a, b) in enumerate(zip(plain, graft)):
        pos = first_difference(a, b)
        prompts.append({"index": i, "identical": pos is None, "first_diff": pos,
                        "plain_tokens": len(a), "graft_tokens": len(b)})
    n_same = sum(p["identical"] for p in prompts)
    return {"identical": n_same == len(prompts), "n_identical": n_same, "n": len(prompts),
            "prompts": prompts}


def nll_of(prompt_logprobs: Sequence[Any], token_ids: Sequence[int], start: int) -> list[float]:
    """Negative log-likelihoods of ``token_ids[start:]`` from vLLM's ``prompt_logprobs``
    (position i: {token id: Logprob} for token i given tokens < i; position 0 is None)."""
    out = []
    for j in range(start, len(token_ids)):
        entry = prompt_logprobs[j]
        if entry is None or token_ids[j] not in entry:
            raise ValueError(f"no log-probability for token {token_ids[j]} at position {j}")
        lp = entry[token_ids[j]]
        out.append(-float(getattr(lp, "logprob", lp)))
    return out


def summarize(requests: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Aggregate metrics of one arm on one workload (or several: pass the sum of walls)."""
    out_tokens = sum(len(r["output_token_ids"]) for r in requests)
    ttft = [r["ttft_s"] for r in requests if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in requests if r.get("tpot_s") is not None]
    gaps = [g for r in requests for g in r.get("itl_s", [])]
    nll = [x for r in requests for x in (r.get("nll") or [])]
    scored = all(r.get("nll") is not None for r in requests) and bool(requests)
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "ttft_mean_s": mean(ttft), "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90), "ttft_max_s": max(ttft) if ttft else None,
        "itl_mean_s": mean(gaps), "itl_p50_s": percentile(gaps, 50),
        "itl_p90_s": percentile(gaps, 90), "itl_p99_s": percentile(gaps, 99),
        "tpot_mean_s": mean(tpot),
        "perplexity": math.exp(sum(nll) / len(nll)) if scored and nll else None,
        "scored_tokens": len(nll) if scored else 0,
    }


def relative_change(plain: float | None, graft: float | None) -> float | None:
    if plain is None or graft is None or plain == 0:
        return None
    return (graft - plain) / plain


# ====================================================================== result assembly
def assemble(*, deployment: str, plan_info: dict[str, Any], settings: dict[str, Any],
             prompt_sets: Sequence[Any], arm_results: dict[str, dict[str, Any]],
             scores: dict[str, list[float]] | None, decode: Callable[[Sequence[int]], str],
             wall_s: float, environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bench result (what --json writes and the table and plot show) from the raw results
    of the arm processes. ``scores`` maps "arm/workload/index" to output-token NLLs."""
    arms: dict[str, Any] = {}
    for arm in ARMS:
        raw = arm_results.get(arm)
        if raw is None:
            continue
        workloads: dict[str, Any] = {}
        all_requests: list[dict[str, Any]] = []
        total_wall = 0.0
        for ps in prompt_sets:
            w = raw["workloads"][ps.name]
            requests = []
            for prompt, r in zip(ps.prompts, w["requests"]):
                key = f"{arm}/{ps.name}/{prompt.index}"
                nll = scores.get(key) if scores is not None else None
                req = {"index": prompt.index, "source": prompt.source, "group": prompt.group,
                       "prompt_tokens": len(prompt.token_ids), "max_tokens": prompt.max_tokens,
                       **r, "output_text": decode(r["output_token_ids"]), "nll": nll,
                       "perplexity": math.exp(sum(nll) / len(nll)) if nll else None}
                requests.append(req)
            summary = summarize(requests, w["wall_s"])
            summary.update(kv_blocks_peak=w.get("kv_blocks_peak"), kv_blocks_total=raw["engine"].get("num_blocks"),
                           peak_rss_mib=raw.get("peak_rss_mib"),
                           other_cpus=w.get("other_cpus"))
            repeats = w.get("repeats") or [{"wall_s": w["wall_s"], "output_tokens": summary["output_tokens"]}]
            rates = [r["output_tokens"] / r["wall_s"] for r in repeats if r["wall_s"] > 0]
            summary.update(runs=len(repeats), output_tok_s_runs=rates,
                           output_tok_s_min=min(rates, default=None), output_tok_s_max=max(rates, default=None),
                           runs_identical=w.get("repeats_identical", True))
            workloads[ps.name] = {"summary": summary, "kv_blocks_per_step": w.get("kv_blocks_per_step", []),
                                  "requests": requests}
            all_requests += requests
            total_wall += w["wall_s"]
        overall = summarize(all_requests, total_wall)
        peaks = [w["summary"]["kv_blocks_peak"] for w in workloads.values() if w["summary"]["kv_blocks_peak"] is not None]
        overall.update(runs_identical=all(w["summary"]["runs_identical"] for w in workloads.values()),
                       kv_blocks_peak=max(peaks) if peaks else None,
                       kv_blocks_total=raw["engine"].get("num_blocks"), peak_rss_mib=raw.get("peak_rss_mib"))
        arms[arm] = {"engine": raw["engine"], "deployment_active": raw.get("deployment_active"),
                     "peak_rss_mib": raw.get("peak_rss_mib"), "rss_after_load_mib": raw.get("rss_after_load_mib"),
                     "overall": overall, "workloads": workloads}
    comparison: dict[str, Any] | None = None
    if "plain" in arms and "graft" in arms:
        per = {}
        for ps in prompt_sets:
            cmp = compare_outputs([r["output_token_ids"] for r in arms["plain"]["workloads"][ps.name]["requests"]],
                                  [r["output_token_ids"] for r in arms["graft"]["workloads"][ps.name]["requests"]])
            for p, prompt in zip(cmp["prompts"], ps.prompts):
                p["source"] = prompt.source
            per[ps.name] = cmp
        comparison = {"identical": all(c["identical"] for c in per.values()),
                      "n_identical": sum(c["n_identical"] for c in per.values()),
                      "n": sum(c["n"] for c in per.values()), "workloads": per}
    graft_raw = arm_results.get("graft") or {}
    return {
        "schema": SCHEMA,
        "deployment": deployment,
        **plan_info,
        "settings": settings,
        "environment": environment or {},
        "measurement": MEASUREMENT,
        "workloads": [ps.to_json() | {"prompts": [p.to_json() for p in ps.prompts]} for ps in prompt_sets],
        "arms": arms,
        "comparison": comparison,
        "runtime_report": graft_raw.get("runtime_report"),
        "wall_s": wall_s,
    }


# ============================================================================ rendering
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


def render_table(result: dict[str, Any]) -> Table:
    s = result["settings"]
    runs = s.get("repeat") or 1
    plugins = ", ".join(result.get("plugins") or []) or "no plugins"
    table = Table(title=f"vllm-graft bench: {escape(result['deployment'])} ({escape(plugins)}); "
                        f"{s['num_prompts']} prompts x <= {s['max_tokens']} tokens per workload, greedy"
                        + (f"; median of {runs} runs" if runs > 1 else ""),
                  title_justify="left")
    columns = [c for c in COLUMNS if c[1] != "output_tok_s_range" or runs > 1]
    table.add_column("workload", no_wrap=True)
    table.add_column("arm", no_wrap=True)
    for header, *_ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("identical", no_wrap=True)
    arms = [a for a in ARMS if a in result["arms"]]
    names = [w["name"] for w in result["workloads"]]
    groups = [(n, n) for n in names] + ([("all", None)] if len(names) > 1 else [])
    cmp_all = result.get("comparison")
    for label, name in groups:
        summaries = {a: dict(result["arms"][a]["workloads"][name]["summary"] if name else result["arms"][a]["overall"])
                     for a in arms}
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
            table.add_row(label if i == 0 else "", arm, *cells, ident,
                          end_section=len(arms) == 1 and label != groups[-1][0])
        if len(arms) == 2:
            p, g = summaries["plain"], summaries["graft"]
            table.add_row("", "[dim]change[/]",
                          *[_change(p.get(key), g.get(key), better) if better else ""
                            for _, key, _, better in columns], "",
                          end_section=True)
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
                    reqs = {a: result["arms"][a]["workloads"][name]["requests"][p["index"]]["output_token_ids"]
                            for a in ("plain", "graft")}
                    tok = {a: (reqs[a][pos] if pos < len(reqs[a]) else "end") for a in reqs}
                    console.print(f"  {escape(name)} #{p['index']} ({escape(p.get('source', ''))}): first "
                                  f"difference at output token {pos} (plain {tok['plain']}, graft {tok['graft']}; "
                                  f"{p['plain_tokens']} vs {p['graft_tokens']} tokens)")
    busy = [(arm, name, w["summary"]["other_cpus"]) for arm, a in result["arms"].items()
            for name, w in a["workloads"].items()
            if (w["summary"].get("other_cpus") or 0) > BUSY_OTHER_CPUS]
    if busy:
        where = ", ".join(f"{arm} {name} {n:.1f}" for arm, name, n in busy)
        console.print(f"[yellow]warning:[/] other processes used CPUs during the timed runs ({where} CPUs "
                      f"on average, of {os.cpu_count()}); those timings are unreliable: run on a quiet "
                      "machine, or use --repeat")
    for arm in ("graft", "plain"):
        a = result["arms"].get(arm)
        if a and not a["overall"].get("runs_identical", True):
            console.print(f"[yellow]warning:[/] the {arm} arm's repeated runs gave different greedy outputs "
                          "(batch-dependent numerics?); the table shows the median run")
    for arm in ("graft", "plain"):
        a = result["arms"].get(arm)
        if a:
            e = a["engine"]
            console.print(f"[dim]{arm}: engine load {e.get('load_s', 0):.1f} s, warm-up {e.get('warmup_s', 0):.2f} s, "
                          f"KV pool {e.get('num_blocks')} blocks of {e.get('block_size')} tokens, "
                          f"peak RSS {_num(a.get('peak_rss_mib'), '{:.0f}')} MiB "
                          f"(after load {_num(a.get('rss_after_load_mib'), '{:.0f}')} MiB)[/]")
    console.print("[dim]How measured: TTFT/ITL from per-token perf_counter stamps taken as each engine step "
                  "returns (in-process engine driven step by step; vLLM's RequestStateStats kept in the JSON); "
                  "tokens/s = output tokens / wall time of the run; KV blocks = peak blocks allocated in the "
                  "scheduler's block pool (sampled after each schedule()); peak RSS = ru_maxrss of the arm's "
                  "process; ppl = output tokens under the unmodified model (prompt_logprobs).[/]")
    report = result.get("runtime_report")
    if report is not None:
        if not report:
            console.print("Plugins (graft arm): none enabled by the deployment; both arms ran plain vLLM.")
        else:
            t = Table(title="What each plugin did (graft arm)", title_justify="left", box=None, padding=(0, 2))
            for col in ("kind", "plugin", "instantiated", "events", "described"):
                t.add_column(col, overflow="fold")
            for r in report:
                t.add_row(r["kind"], r["name"], "yes" if r.get("instantiated") else "no",
                          escape(", ".join(f"{k}={v}" for k, v in r.get("events", {}).items()) or "-"),
                          escape(json.dumps(r.get("described") or {}, default=str)))
            console.print(t)


def _bar_label(v: float) -> str:
    if v != v:  # NaN: not measured
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """A PNG of the side-by-side figures (matplotlib, Agg canvas: no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = [a for a in ARMS if a in result["arms"]]
    names = [w["name"] for w in result["workloads"]]
    labels = names + (["all"] if len(names) > 1 else [])
    panels = [("output tokens/s", "output_tok_s", 1.0), ("TTFT mean (ms)", "ttft_mean_s", 1000.0),
              ("ITL mean (ms)", "itl_mean_s", 1000.0), ("peak KV blocks in use", "kv_blocks_peak", 1.0),
              ("perplexity of outputs (unmodified model)", "perplexity", 1.0),
              ("peak RSS of the arm (MiB)", "peak_rss_mib", 1.0)]
    colors = {"plain": "#7f7f7f", "graft": "#1f77b4"}
    fig = Figure(figsize=(15, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    width = 0.8 / max(len(arms), 1)
    for ax, (title, key, scale) in zip(axes.flat, panels):
        for j, arm in enumerate(arms):
            values = []
            for label in labels:
                s = (result["arms"][arm]["overall"] if label == "all"
                     else result["arms"][arm]["workloads"][label]["summary"])
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
    ident = ("-" if cmp is None else
             f"identical greedy outputs: {cmp['n_identical']}/{cmp['n']}")
    s = result["settings"]
    if any((w["summary"].get("other_cpus") or 0) > BUSY_OTHER_CPUS
           for a in result["arms"].values() for w in a["workloads"].values()):
        ident += "; WARNING: other processes were busy, timings disturbed"
    fig.suptitle(f"vllm-graft bench {result['deployment']} ({', '.join(result.get('plugins') or []) or 'no plugins'}): "
                 f"{s['num_prompts']} prompts x <= {s['max_tokens']} tokens, greedy; {ident}", fontsize=11)
    fig.tight_layout()
    fig.savefig(str(path))


# ====================================================================== the arm process
def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _system_busy_s() -> float | None:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


#: Above this many CPUs used by other processes during a run, its timings are flagged. (The
#: engine's own CPU time cannot tell: its OpenMP threads spin while they wait for a core.)
BUSY_OTHER_CPUS = 0.5


class _KVSampler:
    """Blocks in use in the scheduler's KV pool, sampled after every schedule()."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.reset()

    def in_use(self) -> int:
        return self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks()  # minus the null block

    def reset(self) -> None:
        self.peak = 0
        self.steps: list[int] = []

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            n = self.in_use()
            self.steps.append(n)
            self.peak = max(self.peak, n)
            return out

        return schedule


def _render(llm: Any, ids_list: Sequence[Sequence[int]]) -> list[Any]:
    prompts = [{"prompt_token_ids": list(ids)} for ids in ids_list]
    try:  # what LLM.generate does before add_request (vLLM 0.32); raw prompts still work
        return list(llm._preprocess_cmpl(prompts))
    except AttributeError:
        return prompts


def _generate(llm: Any, prompts: Sequence[dict[str, Any]], *, batch: int, ignore_eos: bool,
              sampler: _KVSampler | None, on_tokens: Callable[[int], None], tag: str) -> dict[str, Any]:
    """Run one workload through the engine, stamping every output token."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests before the timed run")
    inputs = _render(llm, [p["token_ids"] for p in prompts])
    params = [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=ignore_eos,
                             output_kind=RequestOutputKind.CUMULATIVE) for p in prompts]
    n = len(prompts)
    limit = batch if batch > 0 else n
    submit = [0.0] * n
    times: list[list[float]] = [[] for _ in range(n)]
    final: list[Any] = [None] * n
    ids = {f"{tag}-{i}": i for i in range(n)}
    pending = list(range(n))[::-1]
    inflight: set[int] = set()
    if sampler is not None:
        sampler.reset()

    def fill() -> None:
        while pending and len(inflight) < limit:
            i = pending.pop()
            submit[i] = time.perf_counter()
            # arrival_time: vLLM's own TTFT (kept as a cross-check) then counts from here too
            engine.add_request(f"{tag}-{i}", inputs[i], params[i], arrival_time=time.time())
            inflight.add(i)

    import resource

    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    system0 = _system_busy_s()
    t0 = time.perf_counter()
    fill()
    while inflight:
        outputs = engine.step()
        now = time.perf_counter()
        new = 0
        for out in outputs:
            i = ids[out.request_id]
            got = len(out.outputs[0].token_ids)
            if got > len(times[i]):
                new += got - len(times[i])
                times[i] += [now] * (got - len(times[i]))
            if out.finished:
                final[i] = out
                inflight.discard(i)
        on_tokens(new)
        fill()
        if not outputs and not engine.has_unfinished_requests() and inflight:
            raise RuntimeError(f"the engine finished without returning requests {sorted(inflight)}")
    wall = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    system1 = _system_busy_s()
    cpu = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    others = None if system0 is None or system1 is None else max(0.0, (system1 - system0 - cpu) / wall)

    requests = []
    for i, out in enumerate(final):
        c = out.outputs[0]
        token_ids = list(c.token_ids)
        if len(token_ids) != len(times[i]):
            raise RuntimeError(f"request {i}: {len(token_ids)} tokens but {len(times[i])} stamps")
        m = out.metrics
        vllm_metrics = None
        if m is not None:
            ng = getattr(m, "num_generation_tokens", 0)
            vllm_metrics = {
                "ttft_s": getattr(m, "first_token_latency", None),
                "tpot_s": ((m.last_token_ts - m.first_token_ts) / (ng - 1)) if ng > 1 else None,
                "queued_s": m.scheduled_ts - m.queued_ts,
                "prefill_s": m.first_token_ts - m.scheduled_ts,
                "num_preemptions": getattr(m, "num_preemptions", 0),
            }
        requests.append({
            "output_token_ids": token_ids,
            "finish_reason": c.finish_reason,
            "num_cached_tokens": getattr(out, "num_cached_tokens", None),
            "submit_s": submit[i] - t0,
            "token_times_s": [t - submit[i] for t in times[i]],
            **request_timing(submit[i], times[i]),
            "vllm_ttft_s": vllm_metrics["ttft_s"] if vllm_metrics else None,
            "vllm_tpot_s": vllm_metrics["tpot_s"] if vllm_metrics else None,
            "vllm_metrics": vllm_metrics,
        })
    return {"wall_s": wall, "cpu_s": cpu, "other_cpus": others, "requests": requests,
            "kv_blocks_peak": sampler.peak if sampler else None,
            "kv_blocks_per_step": list(sampler.steps) if sampler else []}


def _score(llm: Any, sequences: dict[str, tuple[list[int], list[int]]],
           on_done: Callable[[int], None], chunk: int = 8) -> dict[str, list[float]]:
    """NLL of each output token given prompt + preceding output, under this engine's model."""
    from vllm import SamplingParams

    unique: dict[tuple[int, ...], list[str]] = {}  # each distinct sequence is scored once
    for key, (prompt, output) in sequences.items():
        unique.setdefault(tuple(prompt) + tuple(output), []).append(key)
    out: dict[str, list[float]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    seqs = list(unique)
    for k in range(0, len(seqs), chunk):
        part = seqs[k:k + chunk]
        results = llm.generate([{"prompt_token_ids": list(s)} for s in part], params, use_tqdm=False)
        for s, res in zip(part, results):
            all_nll = nll_of(res.prompt_logprobs, s, 1)  # position 0 has no log-probability
            for key in unique[s]:
                start = len(sequences[key][0])
                out[key] = all_nll[start - 1:]
        on_done(len(part))
    return out


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of repeated runs of one workload, the one with the median wall time (the upper median
    for an even count), with every run's headline figures under ``repeats``."""
    order = sorted(range(len(runs)), key=lambda k: runs[k]["wall_s"])
    chosen = dict(runs[order[len(runs) // 2]])
    first = [r["output_token_ids"] for r in runs[0]["requests"]]
    chosen["repeat_index"] = order[len(runs) // 2]
    chosen["repeats"] = [{"wall_s": r["wall_s"], "output_tokens": sum(len(q["output_token_ids"]) for q in r["requests"]),
                          "kv_blocks_peak": r["kv_blocks_peak"]} for r in runs]
    chosen["repeats_identical"] = all([q["output_token_ids"] for q in r["requests"]] == first for r in runs)
    return chosen


def _arm_main(job: dict[str, Any], result_path: str, events: Any) -> None:  # events: a Connection
    """Entry of an arm's child process (spawned): start the engine, warm it up, run every
    workload, score what it is asked to score, write the result as JSON."""
    log = os.open(job["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    arm = job["arm"]

    def send(kind: str, payload: Any = None) -> None:
        events.send((arm, kind, payload))

    try:
        result = _arm_run(job, send)
        status = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}", "error_type": type(e).__name__,
                  "traceback": traceback.format_exc()}
        status = 1
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    events.close()
    if status:
        sys.exit(status)
    # Returning lets multiprocessing run its finalizers (semaphores vLLM registered with the
    # parent's resource tracker are released) and the engine shut down with the LLM object.


def _arm_run(job: dict[str, Any], send: Callable[[str, Any], None]) -> dict[str, Any]:
    from vllm_graft.integration.bridge import ENV_CONFIG, ENV_FILE
    from vllm_graft.integration.env import installed_vllm
    from vllm_graft.integration.launch import apply_env_defaults

    # The deployment reaches the graft arm through additional_config only; a deployment in the
    # environment would leak into the plain arm (and conflict in the graft arm).
    os.environ.pop(ENV_FILE, None)
    os.environ.pop(ENV_CONFIG, None)
    apply_env_defaults(in_process=True)

    send("phase", "loading model")
    t = time.perf_counter()
    from vllm import LLM, SamplingParams

    from vllm_graft.integration.patches import PATCHES
    from vllm_graft.integration.runtime import RUNTIME

    llm = LLM(**job["llm_kwargs"])
    load_s = time.perf_counter() - t
    rss_after_load = _rss_mib()
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    engine = {"load_s": load_s, "num_blocks": pool.num_gpu_blocks - 1,
              "block_size": scheduler.cache_config.block_size,
              "threads": _torch_threads(),
              "prefix_caching": bool(scheduler.cache_config.enable_prefix_caching),
              "vllm": ("%s %s" % installed_vllm()) if installed_vllm() else None}
    result: dict[str, Any] = {"arm": job["arm"], "engine": engine, "deployment_active": RUNTIME.active,
                              "rss_after_load_mib": rss_after_load, "workloads": {}}

    workloads = job["workloads"]
    if workloads:
        send("phase", "warming up")
        t = time.perf_counter()
        first = workloads[0]["prompts"][0]["token_ids"][:16]
        llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        engine["warmup_s"] = time.perf_counter() - t

        sampler = _KVSampler(pool)
        vllm_version = installed_vllm()[1] if installed_vllm() else None
        from vllm_graft.integration.bridge import SUPPORTED_VLLM

        PATCHES.apply("bench", scheduler, "schedule", sampler.wrap, wrap=True, versions=SUPPORTED_VLLM,
                      vllm_version=vllm_version,
                      reason="vLLM exposes no per-step KV block count; the bench samples the block "
                             "pool right after each allocation")
        try:
            repeat = max(1, int(job.get("repeat", 1)))
            send("total", repeat * sum(p["max_tokens"] for w in workloads for p in w["prompts"]))
            for w in workloads:
                runs = []
                for r in range(repeat):
                    send("phase", f"generating {w['name']}" + (f" ({r + 1}/{repeat})" if repeat > 1 else ""))
                    llm.reset_prefix_cache()  # every run starts with a cold prefix cache
                    runs.append(_generate(
                        llm, w["prompts"], batch=job["batch"], ignore_eos=job["ignore_eos"], sampler=sampler,
                        on_tokens=lambda k: send("advance", k), tag=f"{w['name']}-{r}"))
                result["workloads"][w["name"]] = median_run(runs)
        finally:
            PATCHES.undo("bench")
        result["peak_rss_mib"] = _rss_mib()
        if job["arm"] == "graft":
            result["runtime_report"] = RUNTIME.report()
    else:
        engine["warmup_s"] = 0.0
        result["peak_rss_mib"] = _rss_mib()

    score = dict(job.get("score") or {})
    for name, w in result["workloads"].items():  # this arm's own outputs, when it scores
        if job.get("score_own"):
            for i, (p, r) in enumerate(zip(job["workloads_by_name"][name], w["requests"])):
                score[f"{job['arm']}/{name}/{i}"] = (p, r["output_token_ids"])
    if score:
        send("phase", "scoring outputs (perplexity)")
        send("total_score", len(score))
        result["scores"] = _score(llm, {k: (list(v[0]), list(v[1])) for k, v in score.items()},
                                  lambda k: send("advance_score", k))
    send("phase", "done")
    return result


# ===================================================================== the parent side
class ArmFailed(RuntimeError):
    def __init__(self, arm: str, message: str, log_path: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.arm, self.log_path, self.error_type = arm, log_path, error_type


def _run_child(job: dict[str, Any], workdir: Path, on_event: Callable[[str, str, Any], None],
               timeout: float | None = None) -> dict[str, Any]:
    """Run one arm in a spawned child process; events are passed to ``on_event``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    result_path = str(workdir / f"{job['arm']}.json")
    proc = ctx.Process(target=_arm_main, args=(job, result_path, sender), name=f"vllm-graft-bench-{job['arm']}")
    proc.start()
    sender.close()  # the child holds the only write end: EOF when it exits
    start = time.monotonic()
    try:
        while True:
            if receiver.poll(0.2):
                try:
                    on_event(*receiver.recv())
                except EOFError:
                    break
            elif not proc.is_alive() and not receiver.poll(0):
                break
            if timeout and time.monotonic() - start > timeout:
                raise ArmFailed(job["arm"], f"timed out after {timeout:.0f} s", job["log_path"])
        proc.join(60)  # the result is on disk once the pipe is closed; a stuck teardown is ended below
    finally:
        receiver.close()
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    if not os.path.exists(result_path):
        raise ArmFailed(job["arm"], f"the process exited with code {proc.exitcode} and wrote no result",
                        job["log_path"])
    with open(result_path) as f:
        result = json.load(f)
    if "error" in result:
        raise ArmFailed(job["arm"], result["error"], job["log_path"], result.get("error_type"))
    return result


def _parse_arms(text: str) -> list[str]:
    arms = []
    for part in text.split(","):
        part = part.strip()
        if part not in ARMS:
            raise ValueError(f"unknown arm {part!r}; accepted: {', '.join(ARMS)} (comma list)")
        if part not in arms:
            arms.append(part)
    if not arms:
        raise ValueError(f"no arm named; accepted: {', '.join(ARMS)}")
    return arms


def _max_model_len(plan: Any) -> int:
    value = plan.deployment.engine.get("max_model_len")
    if value:
        return int(value)
    if plan.model is not None:
        cfg = json.loads((Path(plan.model.path) / "config.json").read_text())
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            if cfg.get(key):
                return int(cfg[key])
    return 2048


def _tail(path: str, n: int = 25) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from vllm_graft.tools import workloads as W

    out = Console(stderr=True, highlight=False, width=console.width) if args.json == "-" else console
    err = Console(stderr=True, highlight=False, width=console.width)

    if args.list_workloads:
        for w in W.WORKLOADS.values():
            out.print(f"[bold]{w.name}[/]: {escape(w.summary)}\n  {escape(w.describe)}")
        return EXIT_OK
    if not args.deployment:
        err.print("[bold red]error:[/] give a deployment file: vllm-graft bench DEPLOYMENT.yaml")
        return EXIT_USAGE
    try:
        arms = _parse_arms(args.arms)
        names = W.parse_names(args.workload)
    except ValueError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    if args.num_prompts < 1 or args.max_tokens < 1 or args.batch < 0 or args.repeat < 1:
        err.print("[bold red]error:[/] --num-prompts, --max-tokens and --repeat must be at least 1, "
                  "--batch at least 0")
        return EXIT_USAGE

    from vllm_graft.hooks import DeploymentError

    from vllm_graft.integration.launch import llm_kwargs, load_plan

    try:
        plan = load_plan(args.deployment)
    except DeploymentError as e:
        n = len(e.problems)
        err.print(f"[bold red]✗ {escape(e.source)}: {n} problem{'s' if n != 1 else ''}[/] (no engine started)")
        for p in e.problems:
            err.print(f"  [red]•[/] {escape(str(p))}")
        return EXIT_INVALID

    max_model_len = _max_model_len(plan)
    try:
        model = plan.model.path if plan.model is not None else plan.deployment.model
        if model is None:
            raise W.WorkloadError("the deployment names no model (model: FOLDER)")
        try:
            tokenizer = W.Tokenizer.from_model(model)
        except (OSError, ValueError, ImportError) as e:
            err.print(f"[bold red]error:[/] cannot load the tokenizer of {escape(str(model))}: {escape(str(e))}")
            return EXIT_INVALID
        prompt_sets = W.build(names, tokenizer, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                              max_model_len=max_model_len, seed=args.seed)
    except W.WorkloadError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE

    plugins = [f"{e.kind}:{e.name}" for e in plan.enabled]
    settings = {"arms": arms, "workloads": names, "num_prompts": args.num_prompts,
                "max_tokens": args.max_tokens, "batch": args.batch, "repeat": args.repeat, "seed": args.seed,
                "ignore_eos": args.ignore_eos, "max_model_len": max_model_len,
                "perplexity": not args.no_ppl, "temperature": 0.0}
    wl_jobs = [{"name": ps.name, "prompts": [{"token_ids": list(p.token_ids), "max_tokens": p.max_tokens}
                                             for p in ps.prompts]} for ps in prompt_sets]
    by_name = {ps.name: [list(p.token_ids) for p in ps.prompts] for ps in prompt_sets}
    # Per-request stats on (the cross-check of TTFT/ITL); the seed unless the deployment sets one.
    overrides: dict[str, Any] = {"disable_log_stats": False}
    if "seed" not in plan.deployment.engine:
        overrides["seed"] = args.seed
    keep_logs = args.log_dir is not None
    workdir = Path(args.log_dir) if keep_logs else Path(tempfile.mkdtemp(prefix="vllm-graft-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)

    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    scores: dict[str, list[float]] | None = None
    plan_runs: list[tuple[str, bool, bool]] = []  # (arm, generate, score)
    if "graft" in arms:
        plan_runs.append(("graft", True, False))
    if "plain" in arms:
        plan_runs.append(("plain", True, not args.no_ppl))
    elif not args.no_ppl:
        plan_runs.append(("plain", False, True))  # scorer only: the unmodified model

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[unit]}"), TimeElapsedColumn(),
                        console=out, transient=False)
    totals: dict[Any, int] = {}
    try:
        with progress:
            for arm, generate, score in plan_runs:
                label = arm if generate else "plain (scoring only)"
                task = progress.add_task(f"{label}: starting", total=None, unit="tokens")
                score_task: list[Any] = []

                def on_event(who: str, kind: str, payload: Any, task=task, label=label,
                             score_task=score_task) -> None:
                    if kind == "phase":
                        progress.update(task, description=f"{label}: {payload}")
                        if payload == "done" and task in totals:  # EOS can end requests early
                            progress.update(task, completed=totals[task])
                    elif kind == "total":
                        totals[task] = payload
                        progress.update(task, total=payload)
                    elif kind == "advance":
                        progress.advance(task, payload)
                    elif kind == "total_score":
                        if task in totals:  # generation done (fewer tokens than budgeted at EOS)
                            progress.update(task, completed=totals[task])
                        score_task.append(progress.add_task(f"{label}: perplexity", total=payload, unit="sequences"))
                    elif kind == "advance_score" and score_task:
                        progress.advance(score_task[0], payload)

                job = {"arm": arm, "llm_kwargs": llm_kwargs(plan, graft=(arm == "graft"), **overrides),
                       "workloads": wl_jobs if generate else [], "batch": args.batch, "repeat": args.repeat,
                       "ignore_eos": args.ignore_eos, "log_path": str(workdir / f"{arm}.log"),
                       "score_own": score and generate, "workloads_by_name": by_name, "score": {}}
                if score and "graft" in results:
                    for ps in prompt_sets:
                        for p, r in zip(ps.prompts, results["graft"]["workloads"][ps.name]["requests"]):
                            job["score"][f"graft/{ps.name}/{p.index}"] = (list(p.token_ids), r["output_token_ids"])
                raw = _run_child(job, workdir, on_event, timeout=args.timeout or None)
                progress.update(task, description=f"{label}: done")
                if generate:
                    results[arm] = raw
                if "scores" in raw:
                    scores = raw["scores"]
    except ArmFailed as e:
        err.print(f"[bold red]✗ the {e.arm} arm failed:[/] {escape(str(e))}")
        tail = _tail(e.log_path)
        if tail:
            err.print(f"[dim]last lines of {escape(e.log_path)}:[/]\n{escape(tail)}")
        err.print(f"full log: {escape(e.log_path)}")
        return EXIT_INVALID if e.error_type == "DeploymentError" else EXIT_RUN_FAILED
    wall = time.perf_counter() - t_start

    from vllm_graft.integration.env import installed_vllm

    found = installed_vllm()
    environment = {"python": sys.version.split()[0], "platform": platform.platform(),
                   "machine": platform.machine(), "cpu_count": os.cpu_count(),
                   "vllm": f"{found[0]} {found[1]}" if found else None,
                   "stdlib": str(W.stdlib_dir()), "vllm_platform": plan.platform}
    result = assemble(deployment=str(args.deployment),
                      plan_info={"model": plan.deployment.model, "plugins": plugins,
                                 "engine_args": plan.deployment.engine},
                      settings=settings, prompt_sets=prompt_sets, arm_results=results, scores=scores,
                      decode=tokenizer.decode, wall_s=wall, environment=environment)
    render_report(result, out)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            out.print(f"JSON written to {escape(args.json)}")
    if args.plot:
        write_plot(result, args.plot)
        out.print(f"plot written to {escape(args.plot)}")
    out.print(f"[dim]bench wall time {wall:.1f} s; engine logs in {escape(str(workdir))}[/]" if keep_logs
              else f"[dim]bench wall time {wall:.1f} s[/]")
    if not keep_logs:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    cmp = result["comparison"]
    if args.require_identical and cmp is not None and not cmp["identical"]:
        return EXIT_DIFFERENT
    return EXIT_OK


# ============================================================================== parser
def add_command(sub: Any) -> None:
    from vllm_graft.tools.workloads import WORKLOADS

    p = sub.add_parser(
        "bench", help="A/B benchmark: plain vLLM vs the deployment on the same workloads",
        description="Run the same deterministic workloads through plain vLLM and through the "
                    "deployment (each in its own process, in-process engine, greedy decoding) and "
                    "report output tokens/s, time to first token, inter-token latency, peak KV "
                    "blocks in use, peak memory, whether greedy outputs are identical, and the "
                    "perplexity of the outputs under the unmodified model.",
        epilog=f"Workloads: {', '.join(WORKLOADS)} (--list-workloads describes them). Exit codes: "
               "0 ok, 1 invalid deployment (no engine started), 2 bad command line, 3 a plugin "
               "failed to load, 4 an engine run failed, 5 outputs differ (with --require-identical).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deployment", nargs="?", help="deployment YAML file")
    p.add_argument("--workload", action="append", metavar="NAME[,NAME]",
                   help="workload(s) to run; repeatable or a comma list (default: all)")
    p.add_argument("--list-workloads", action="store_true", help="describe the built-in workloads and exit")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts per workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="output tokens per request (default 64; less where the context is full)")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="requests in flight at once; the next is submitted when one finishes "
                        "(default 0: all of a workload's requests at once)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each workload N times per engine and report the run with the median wall "
                        "time, with the tokens/s range (default 1)")
    p.add_argument("--seed", type=int, default=0, help="workload selection and engine seed (default 0)")
    p.add_argument("--arms", default="plain,graft", metavar="ARMS",
                   help="which arms to run: plain, graft or plain,graft (default both)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate max-tokens tokens even past <|endoftext|> (fixed output lengths)")
    p.add_argument("--no-ppl", action="store_true", help="skip scoring outputs under the unmodified model")
    p.add_argument("--json", metavar="FILE", help="write the full result as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of the figures")
    p.add_argument("--log-dir", metavar="DIR", help="keep the engines' logs and raw results here")
    p.add_argument("--timeout", type=float, default=0, metavar="S", help="give up on an arm after S seconds")
    p.add_argument("--require-identical", action="store_true",
                   help="exit 5 when the arms' greedy outputs differ")
    p.set_defaults(func=cmd_bench)
