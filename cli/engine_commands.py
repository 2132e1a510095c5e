"""`vllm-graft demo`, `generate` and `serve`: vLLM with a deployment applied.

``demo`` and ``generate`` run vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless set) and stream tokens as the engine produces them; ``serve`` replaces this process with
``vllm serve`` (OpenAI-compatible server, multiprocess engine), the deployment passed as
``--additional-config '{"graft": ...}'`` so every vLLM process applies it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..hooks import DeploymentError, Plan
from ..launch.engine import quiet_vllm, serve_command, start_engine
from ..launch.exits import EXIT_INVALID, EXIT_OK
from ..launch.reports import (
    REPORT_QUIET_PERIODS,
    REPORT_WAIT_S,
    parse_metrics,
    read_reports,
    read_settled_reports,
)

DEMO_DEPLOYMENT = "demo.yaml"
#: The demo on the real model (SmolLM2-135M-Instruct, `vllm-graft models fetch smollm2-135m`), its
#: default once the model is fetched.
REAL_DEMO_MODEL = "smollm2-135m"
REAL_DEMO_DEPLOYMENT = "smollm2/demo.yaml"
#: What the demo runs through both arms, one request at a time: code completion (what the
#: speculative plugin speeds up, lossless) and ~1.8K-token code windows (where eviction holds fewer
#: KV blocks per request).
DEMO_WORKLOADS = ("code-completion", "long-context")
#: Timed runs per arm in the demo, after each arm's warm-up; the arms alternate (graft plain,
#: plain graft, ...) so that neither always runs first.
DEMO_REPEATS = 3
#: Above this many CPUs used by other processes during any timed run (the bench's busy-CPU
#: measurement, /proc/stat), the demo says its speed figures are disturbed. The figure also holds
#: the demo's own parent process and the idle arm (seen up to ~0.09 on a shared machine).
DEMO_BUSY_CPUS = 0.25


def add_command(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="plain vLLM vs a deployment of real plugins on the bundled model: speed, KV, quality",
        description="Runs the same prompts (code completion, and ~1.8K-token code windows, one "
        "request at a time) through plain vLLM and through a deployment (default: "
        "deployments/demo.yaml: lookahead speculation + streaming KV eviction), each "
        "engine in its own process, and prints a sample of each arm's text and a table: "
        "tokens/s, KV blocks held while decoding, accepted draft tokens per step, "
        "identical outputs, and the perplexity change of the outputs under the "
        "unmodified model. Each arm is warmed up, then the arms take turns over "
        f"{DEMO_REPEATS} timed runs; tokens/s is the median run with the min-max, and "
        "the demo says when other processes used the CPU meanwhile (the figure is then "
        "not the plugins'). vLLM's own log goes to a file (--log-dir keeps it).",
    )
    d.add_argument(
        "--deployment",
        help=f"deployment file (default: deployments/{REAL_DEMO_DEPLOYMENT} on the real model once "
        f"`vllm-graft models fetch {REAL_DEMO_MODEL}` has run, else deployments/{DEMO_DEPLOYMENT})",
    )
    d.add_argument("--quick", action="store_true", help="2 prompts x 48 tokens per workload (default 4 x 64)")
    d.add_argument("--num-prompts", type=int, metavar="N", help="prompts per workload")
    d.add_argument("--max-tokens", type=int, metavar="N", help="output tokens per request")
    d.add_argument(
        "--repeat", type=int, metavar="N", help=f"timed runs per arm, the arms alternating (default {DEMO_REPEATS})"
    )
    d.add_argument("--log-dir", metavar="DIR", help="keep vLLM's full engine logs (one per arm) in DIR")
    d.set_defaults(func=cmd_demo)

    g = sub.add_parser("generate", help="generate from a prompt with a deployment applied, streaming")
    g.add_argument("deployment", help="deployment YAML file")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print the outputs and plugin report as JSON")
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser(
        "report",
        help="what the plugins did in a running (or stopped) server: the per-process reports summed",
        description="Reads the reports that every vLLM process (front end, engine core, workers) "
        "writes while VLLM_GRAFT_REPORT_DIR=DIR is set (one JSON file per process, "
        "rewritten at most once a second while plugins count events, and at each process's "
        "exit) and prints each plugin's events summed over the processes.",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("dir", help="the folder VLLM_GRAFT_REPORT_DIR named")
    r.add_argument("--json", action="store_true", help="print the summed report as JSON")
    r.add_argument(
        "--metrics",
        metavar="URL|FILE",
        help="also read vLLM's /metrics at URL (e.g. http://127.0.0.1:8000/metrics), or a "
        "copy saved before the server stopped (curl URL > FILE), and put its "
        "speculative-decoding counters beside the report's",
    )
    r.add_argument(
        "--no-wait",
        action="store_true",
        help=f"read the reports at once (default: wait up to {REPORT_WAIT_S:.0f} s until no "
        "process has rewritten its report for a while, nor since the call, so a run "
        "that just ended is counted in full)",
    )
    r.set_defaults(func=cmd_report)

    s = sub.add_parser(
        "serve",
        help="start vLLM's OpenAI-compatible server with a deployment applied",
        description="Starts `vllm serve MODEL` with the deployment's engine arguments and the "
        "deployment in --additional-config. Arguments after the deployment (or after --) "
        "go to vllm serve unchanged, e.g. `vllm-graft serve d.yaml --port 8001`.",
    )
    s.add_argument("deployment", help="deployment YAML file")
    s.add_argument("--dry-run", action="store_true", help="print the vllm serve command and exit")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="passed to vllm serve")
    s.set_defaults(func=cmd_serve)


# ------------------------------------------------------------------------------ shared
def _load(path: str, console: Console) -> Plan | None:
    from .main import _print_plan
    from ..integration.plan import plan_for

    try:
        plan = plan_for(path)
    except DeploymentError as e:
        n = len(e.problems)
        console.print(f"[bold red]✗ {escape(e.source)}: {n} problem{'s' if n != 1 else ''}[/] (nothing was started)")
        for p in e.problems:
            console.print(f"  [red]•[/] {escape(str(p))}")
        return None
    _print_plan(plan, path, console)
    return plan


def stream(
    llm,
    prompt: str,
    max_tokens: int,
    console: Console,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    request_id: str = "0",
    show: bool = True,
) -> dict[str, Any]:
    """Generate for one prompt through the engine's step loop, printing text as it arrives."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=seed, output_kind=RequestOutputKind.DELTA
    )
    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first = None
    text, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id or not out.outputs:
                continue
            delta = out.outputs[0]
            if delta.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += list(delta.token_ids)
            text.append(delta.text)
            if show and delta.text:
                console.out(delta.text, end="", highlight=False)
    wall = time.perf_counter() - t0
    if show:
        console.out("")
    return {
        "prompt": prompt,
        "text": "".join(text),
        "token_ids": tokens,
        "wall_s": wall,
        "ttft_s": first,
        "tokens_per_s": len(tokens) / wall if wall > 0 else None,
    }


def print_report(console: Console) -> list[dict[str, Any]]:
    from ..integration.runtime import RUNTIME

    report = RUNTIME.report()
    if not report:
        console.print("no plugins enabled: vLLM ran unchanged")
        return report
    table = Table(title="what each plugin did (this process)", box=None, padding=(0, 2))
    for col in ("kind", "plugin", "calls through vLLM", "reported by the plugin"):
        table.add_column(col, overflow="fold")
    for r in report:
        events = ", ".join(f"{k}={v}" for k, v in sorted(r["events"].items())) or "never called"
        described = ", ".join(f"{k}={v}" for k, v in r["described"].items()) or "-"
        table.add_row(r["kind"], r["name"], escape(events), escape(described))
    console.print(table)
    return report


# ---------------------------------------------------------------------------- commands
def demo_deployment(console: Console) -> str:
    """The demo's default deployment: :data:`REAL_DEMO_DEPLOYMENT` on the real model when it is
    fetched, else :data:`DEMO_DEPLOYMENT` on the bundled tiny model, saying why."""
    from ..launch.engine import deployments_dir
    from .real_model import RealModelError, fetched_path

    try:
        fetched_path(REAL_DEMO_MODEL)
        return str(deployments_dir() / REAL_DEMO_DEPLOYMENT)
    except RealModelError as e:
        console.print(
            f"[yellow]note:[/] {escape(str(e))}. The demo runs on the bundled tiny model instead "
            f"(deployments/{DEMO_DEPLOYMENT}: test material, its text is not meant to read well)",
            soft_wrap=True,
        )
        return str(deployments_dir() / DEMO_DEPLOYMENT)


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from ..tools.bench.command import EXIT_OK as BENCH_OK, run_bench

    from ..integration.env import installed_vllm, package_version
    from ..launch.engine import models_dir

    models_dir()  # a clear error if the bundled models are missing
    path = args.deployment or demo_deployment(console)
    found = installed_vllm()
    console.rule(f"vllm-graft {package_version()} demo · {found[0]} {found[1]}" if found else "vllm-graft demo")
    plan = _load(path, console)
    if plan is None:
        return EXIT_INVALID
    bench_args = argparse.Namespace(
        deployment=path,
        workload=[",".join(DEMO_WORKLOADS)],
        num_prompts=args.num_prompts or (2 if args.quick else 4),
        max_tokens=args.max_tokens or (48 if args.quick else 64),
        batch=1,
        repeat=DEMO_REPEATS if getattr(args, "repeat", None) is None else args.repeat,
        seed=0,
        arms="plain,graft",
        baseline=None,
        ignore_eos=False,
        no_ppl=False,
        log_dir=args.log_dir,
        timeout=0,
    )
    console.print(
        f"[dim]the same {bench_args.num_prompts} prompts per workload "
        f"({', '.join(DEMO_WORKLOADS)}), one request at a time, through plain vLLM and "
        f"through the deployment, {bench_args.repeat} timed runs per arm after a warm-up, "
        "the arms taking turns engine step by engine step: each engine in its own process, vLLM's log in "
        + (escape(args.log_dir) if args.log_dir else "a temporary file (--log-dir keeps it)")
        + "[/]"
    )
    err = Console(stderr=True, highlight=False, width=console.width)
    rc, result = run_bench(bench_args, console, err)
    if result is None:
        return rc
    print_demo(result, console)
    return BENCH_OK


def _decode_mean(blocks_per_step: Sequence[int]) -> float | None:
    """Mean KV blocks held over the steps after a request's first one (its prefill)."""
    if not blocks_per_step:
        return None
    rest = blocks_per_step[1:] or blocks_per_step
    return sum(rest) / len(rest)


def disturbance(other_cpus: Sequence[float | None], limit: float = DEMO_BUSY_CPUS) -> dict[str, Any]:
    """The demo's verdict on its timings from the CPUs other processes used during each timed
    run (the bench's ``other_cpus``): ``busy`` when the worst run is above ``limit``, None when no
    run could be measured (no /proc/stat), with the sentence the demo prints."""
    known = [float(x) for x in other_cpus if x is not None]
    if not known:
        return {
            "busy": None,
            "max_cpus": None,
            "limit": limit,
            "text": "what other processes used of the CPU was not measured (no /proc/stat): "
            "the speed figures may be disturbed",
        }
    worst = max(known)
    if worst > limit:
        text = (
            f"the machine was busy: other processes used up to {worst:.2f} CPUs during the timed "
            f"runs (more than {limit:g}): these speed figures are not the plugins'; run the demo "
            "again when the machine is quiet"
        )
    else:
        text = (
            f"the machine was quiet: other processes used at most {worst:.2f} CPUs during the "
            f"timed runs (limit {limit:g})"
        )
    return {"busy": worst > limit, "max_cpus": worst, "limit": limit, "text": text}


def _rate(summary: dict[str, Any]) -> str:
    """Median tokens/s with the runs' min-max when there were several runs."""
    text = f"{summary['output_tok_s']:.0f}"
    lo, hi = summary.get("output_tok_s_min"), summary.get("output_tok_s_max")
    if (summary.get("runs") or 1) > 1 and lo is not None and hi is not None:
        text += f" ({lo:.0f}-{hi:.0f})"
    return text


def _speed(ratio: dict[str, Any] | None) -> str:
    if not ratio:
        return "-"
    text = f"{ratio['ratio']:.2f}x"
    if ratio.get("min") is not None and ratio.get("max") is not None and len(ratio.get("runs") or ()) > 1:
        text += f" ({ratio['min']:.2f}-{ratio['max']:.2f})"
    return text


def _print_samples(result: dict[str, Any], console: Console) -> None:
    """The first prompt of each workload and both arms' text for it."""
    arms = result["arms"]
    cmp = result["comparison"]["workloads"]
    for w in result["workloads"]:
        name = w["name"]
        prompt = w["prompts"][0]
        plain_req = arms["plain"]["workloads"][name]["requests"][0]
        graft_req = arms["graft"]["workloads"][name]["requests"][0]
        same = cmp[name]["prompts"][0]
        console.rule(f"{name}: prompt 1 of {w['num_prompts']} ({escape(str(prompt.get('source')))})")
        tail = "\n".join(prompt["text"].rstrip("\n").split("\n")[-3:])
        console.print(f"[dim]... {escape(tail)}[/]")
        for arm, req in (("plain", plain_req), ("graft", graft_req)):
            text = req.get("output_text") or ""
            console.print(f"[bold]{arm}:[/] {escape(text[:240])}{'…' if len(text) > 240 else ''}")
        console.print(
            "[green]identical tokens[/]"
            if same["identical"]
            else f"[yellow]outputs part at output token {same['first_diff']}[/]"
        )


def _summary_table(result: dict[str, Any]) -> Table:
    """The demo's table: per workload, both arms' tok/s, the speed, the KV blocks held, the
    identical outputs and the perplexity change."""
    from ..tools.bench.stats import relative_change

    arms = result["arms"]
    cmp = result["comparison"]["workloads"]
    table = Table(
        title="plain vLLM vs the deployment (same prompts, greedy, one request at a time)", box=None, padding=(0, 2)
    )
    for col in (
        "workload",
        "plain tok/s",
        "graft tok/s",
        "speed",
        "KV blocks held (decode)",
        "identical",
        "ppl change",
    ):
        table.add_column(col, justify="left" if col in ("workload", "identical") else "right")
    for w in result["workloads"]:
        name = w["name"]
        p, g = (arms[a]["workloads"][name] for a in ("plain", "graft"))
        ps, gs = p["summary"], g["summary"]
        a, b = (_decode_mean(x["kv_blocks_per_step"]) for x in (p, g))
        held_text = (
            "-"
            if a is None or b is None
            else f"{a:.1f} -> {b:.1f} ({100 * (b - a) / a:+.0f}%)"
            if a
            else f"{a:.1f} -> {b:.1f}"
        )
        ppl = relative_change(ps.get("perplexity"), gs.get("perplexity"))
        table.add_row(
            name,
            _rate(ps),
            _rate(gs),
            _speed(cmp[name].get("ratio")),
            held_text,
            f"{cmp[name]['n_identical']}/{cmp[name]['n']}",
            f"{100 * ppl:+.1f}%" if ppl is not None else "-",
        )
    return table


def print_demo(result: dict[str, Any], console: Console) -> None:
    """A sample of each workload's text from both arms, then the demo's summary table."""
    arms = result["arms"]
    _print_samples(result, console)
    table = _summary_table(result)
    console.rule("summary")
    console.print(table)
    runs = max(
        (
            arms[a]["workloads"][w["name"]]["summary"].get("runs") or 1
            for a in ("plain", "graft")
            for w in result["workloads"]
        ),
        default=1,
    )
    verdict = disturbance(
        [
            arms[a]["workloads"][w["name"]]["summary"].get("other_cpus")
            for a in ("plain", "graft")
            for w in result["workloads"]
        ]
    )
    result["disturbance"] = verdict
    if runs > 1:
        console.print(
            f"tok/s: the median of {runs} timed runs per arm (min-max in brackets), the arms "
            "taking turns after a warm-up; speed: the median of the runs' paired ratios "
            "graft / plain, with their min-max"
        )
    style = "bold yellow" if verdict["busy"] is not False else "green"
    console.print(f"[{style}]{escape(verdict['text'])}[/]")
    for r in result.get("runtime_report") or []:
        ev = r.get("events", {})
        if r["kind"] == "speculative" and ev.get("propose"):
            console.print(
                f"{r['name']}: {ev.get('accepted', 0)} of {ev.get('drafted', 0)} drafted tokens "
                f"accepted, {ev.get('accepted', 0) / ev['propose']:.2f} per step that drafted "
                f"({ev['propose']} steps): each such step emits that many tokens plus its own"
            )
        elif r["kind"] == "kvcompress" and "blocks_freed" in ev:
            console.print(f"{r['name']}: {ev['blocks_freed']} KV blocks freed while requests ran")
    console.print(
        "[dim]tok/s: output tokens / wall time of the workload; KV blocks held: mean blocks in "
        "use per engine step after a request's first (prefill) step; ppl change: perplexity "
        "of the deployment's outputs against plain vLLM's, both scored by the unmodified "
        "model (lower is better). The full A/B bench: vllm-graft bench DEPLOYMENT.[/]"
    )
    console.print(f"[dim]demo wall time {result['wall_s']:.1f} s (both engines loaded, prompts run, outputs scored)[/]")


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    from ..launch.exits import EXIT_INVALID

    quiet_vllm()
    if args.json:  # stdout carries only the JSON: everything else (vLLM's logs too) goes to stderr
        real_stdout = os.dup(1)
        sys.stdout.flush()
        os.dup2(2, 1)
        console = Console(stderr=True, highlight=False)
    try:
        plan = _load(args.deployment, console)
        if plan is None:
            return EXIT_INVALID
        llm = start_engine(plan)
        results = []
        for i, prompt in enumerate(args.prompt):
            if not args.json:
                console.rule(f"prompt {i + 1}")
                console.print(f"[bold]{escape(prompt)}[/]", end="")
            results.append(
                stream(
                    llm,
                    prompt,
                    args.max_tokens,
                    console,
                    temperature=args.temperature,
                    seed=args.seed,
                    request_id=f"gen-{i}",
                    show=not args.json,
                )
            )
    finally:
        if args.json:
            sys.stdout.flush()
            os.dup2(real_stdout, 1)
            os.close(real_stdout)
    if args.json:
        from ..integration.runtime import RUNTIME

        print(json.dumps({"outputs": results, "plugins": RUNTIME.report()}, indent=2))
    else:
        print_report(console)
    return EXIT_OK


REPORT_EPILOG = """\
what the counters are (per plugin, summed over the processes):
  every plugin   the events its code counts, by its own names (--json lists them)
  speculative    propose    calls of the plugin's proposer (one per request and step)
                 drafted    draft tokens proposed
                 verified   drafts vLLM checked: vLLM's spec_decode_num_draft_tokens
                 accepted   drafts vLLM kept: vLLM's spec_decode_num_accepted_tokens
                 verified_without_propose
                            placeholder drafts vLLM verified in steps it did not call the
                            drafter (a request within k tokens of max_model_len)
                 seeded_undrafted
                            drafts discarded for seeded sampled requests (never sent)
                 finish     requests that ended
                 undrafted_steps / plain_steps
                            steps the plugin chose not to draft for / steps with no
                            drafts to verify, run on vLLM's plain path
                 over_max_batch
                            steps over the deployment's speculative.max_batch (no drafts)
                 drafts_with_output
                            steps whose drafts rode with the output (engine core)
                 tree_verify / tree_accepted
                            draft trees verified / tree nodes accepted
  the report is complete once the server has stopped: each process writes its last
  events at exit (vLLM's processes get up to 5 s to exit while VLLM_GRAFT_REPORT_DIR is set)
"""


#: vLLM's counters that a speculative plugin's report counts the same way (see
#: :mod:`.adapters.speculative.drafting`): /metrics sample name -> the report's figure.
SPEC_METRICS = {
    "vllm:spec_decode_num_draft_tokens_total": "verified",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}


def spec_counter_notes(events: dict[str, int], metrics: dict[str, float] | None = None) -> list[str]:
    """One line per figure of a speculative plugin's events that vLLM also counts: which of
    vLLM's counters it equals, the value ``metrics`` (parsed ``/metrics``) has, and why the two
    may differ."""
    verified, accepted = events.get("verified", 0), events.get("accepted", 0)
    drafted, seeded = events.get("drafted", 0), events.get("seeded_undrafted", 0)
    unseen = events.get("verified_without_propose", 0)
    got = {key: metrics.get(name) for name, key in SPEC_METRICS.items()} if metrics is not None else {}

    def vs(expected: int, key: str) -> str:
        value = got.get(key)
        if metrics is None:
            return ""
        if value is None:
            return "; /metrics has no such counter (speculative decoding off, or log stats disabled)"
        return "; /metrics: " + (f"{value:.0f}, equal" if value == expected else f"{value:.0f}, DIFFERENT")

    lines = [
        f"verified={verified}"
        + (f" + verified_without_propose={unseen}" if unseen else "")
        + " is vLLM's spec_decode_num_draft_tokens"
        + vs(verified + unseen, "verified")
    ]
    line = f"accepted={accepted} is vLLM's spec_decode_num_accepted_tokens" + vs(accepted, "accepted")
    if unseen:
        line += (
            f" (vLLM's also holds whichever of the {unseen} placeholder drafts, token id 0, the "
            "target sampled: vLLM verified them in steps it did not call the drafter, a request "
            "being within num_speculative_tokens of max_model_len)"
        )
    lines.append(line)
    if drafted > verified:
        lines.append(
            f"drafted={drafted}: {drafted - verified} of these were never verified (vLLM "
            "counts only what it scheduled: the request ended first, or the scheduler cut "
            "them at the token budget, max_model_len or a preemption)"
        )
    if seeded:
        lines.append(f"seeded_undrafted={seeded}: drafts discarded for seeded sampled requests, never sent to vLLM")
    return lines


def _fetch_metrics(where: str) -> dict[str, float]:
    """/metrics from a server (a URL) or as saved (a file: /metrics is gone once the server
    stops, and a stopped server's reports are complete, see ``Runtime._flush_at_exit``)."""
    if os.path.isfile(where):
        with open(where) as f:
            return parse_metrics(f.read())
    import httpx

    return parse_metrics(httpx.get(where, timeout=10).text)


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from ..launch.exits import EXIT_INVALID
    from ..integration.runtime import ENV_REPORT_DIR, REPORT_EVERY_S

    if not os.path.isdir(args.dir):
        console.print(
            f"[bold red]error:[/] {escape(args.dir)} is not a folder: start vLLM with "
            f"{ENV_REPORT_DIR}={escape(args.dir)} set, then read it here"
        )
        return EXIT_INVALID
    metrics = None
    if args.metrics:
        try:
            metrics = _fetch_metrics(args.metrics)
        except Exception as e:  # noqa: BLE001 - any failure to reach the server is the user's to fix
            console.print(
                f"[bold red]error:[/] cannot read vLLM's metrics at {escape(args.metrics)} ({e}): "
                "pass the server's /metrics URL, e.g. http://127.0.0.1:8000/metrics, or a "
                "file holding a saved copy"
            )
            return EXIT_INVALID
    if args.no_wait:
        summed, settled = read_reports(args.dir), None
    else:
        summed, settled = read_settled_reports(
            args.dir, quiet_s=REPORT_QUIET_PERIODS * REPORT_EVERY_S, timeout_s=REPORT_WAIT_S
        )
    restarts = _earlier_runs(summed["processes"])
    for p in summed["plugins"]:
        if p["kind"] == "speculative":
            p["vllm_counters"] = {
                "spec_decode_num_draft_tokens": p["events"].get("verified", 0)
                + p["events"].get("verified_without_propose", 0),
                "spec_decode_num_accepted_tokens": p["events"].get("accepted", 0),
            }
            p["vllm_counter_notes"] = spec_counter_notes(p["events"], metrics)
    summed["settled"] = settled
    if metrics is not None:
        summed["metrics"] = {name: metrics.get(name) for name in SPEC_METRICS}
    if args.json:
        print(json.dumps(summed, indent=1))
        return EXIT_OK
    if not summed["processes"]:
        console.print(
            f"no reports in {escape(args.dir)}: no vLLM process has activated a deployment "
            f"with {ENV_REPORT_DIR} set to it"
        )
        return EXIT_OK
    later = sum(1 for p in summed["processes"] if p.get("tensor_parallel_rank"))
    title = f"what each plugin did, summed over {len(summed['processes']) - later} processes"
    if later:
        title += f" (not counted: {later} later tensor-parallel ranks, which repeat the first rank's)"
    table = Table(title=title, box=None, padding=(0, 2))
    for col in ("kind", "plugin", "events", "processes"):
        table.add_column(col, overflow="fold")
    for p in summed["plugins"]:
        events = ", ".join(f"{k}={v}" for k, v in sorted(p["events"].items())) or "none yet"
        table.add_row(p["kind"], p["name"], escape(events), escape(", ".join(map(str, p["processes"]))))
    console.print(table)
    for p in summed["plugins"]:
        for line in p.get("vllm_counter_notes", ()):
            console.print(f"{escape(p['name'])}: {escape(line)}")
    if settled is False:
        console.print(
            f"[yellow]the reports were still being rewritten after {REPORT_WAIT_S:.0f} s (a "
            "process is counting: the server is serving): the last second's events may be "
            "missing; read again once it is idle[/]"
        )
    if restarts:
        console.print(
            f"[yellow]this folder holds reports of {restarts} earlier vLLM process(es) of the "
            "same role (a restarted server?): their events are summed too, while vLLM's "
            "/metrics counts since its start; give each server run an empty folder[/]"
        )
    return EXIT_OK


def _earlier_runs(processes: Sequence[dict[str, Any]]) -> int:
    """Reports beyond the first of each process name (MainProcess, EngineCore, VllmWorker-0, ...):
    processes of earlier server runs that wrote to the same folder."""
    from collections import Counter

    names = Counter(p.get("process") for p in processes)
    return sum(n - 1 for n in names.values() if n > 1)


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from ..integration.bridge import check_vllm_version
    from ..launch.exits import EXIT_INVALID
    from ..launch.engine import apply_env_defaults

    plan = _load(args.deployment, console)
    if plan is None:
        return EXIT_INVALID
    argv = serve_command(plan, args.vllm_args)
    console.print(f"[dim]$ {escape(shlex.join(argv))}[/]")
    if args.dry_run:
        return EXIT_OK
    check_vllm_version()
    engine = dict(plan.deployment.engine)
    if any(a.split("=")[0] == "--kv-cache-memory-bytes" for a in args.vllm_args or ()):
        engine["kv_cache_memory_bytes"] = "from the command line"
    apply_env_defaults(engine=engine)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return EXIT_OK  # pragma: no cover


__all__ = ["add_command", "stream"]
