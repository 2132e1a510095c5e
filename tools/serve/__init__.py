"""`vllm-graft servebench DEPLOYMENT...`: plain vLLM and each deployment behind vLLM's OpenAI
server, one at a time, under the same load at each of a list of request rates (open loop,
Poisson arrivals) and/or concurrency levels (closed loop): throughput, latency, TTFT, TPOT and
goodput at a latency limit, each against plain vLLM at the same load (issues 34 and 37).

Every arm gets the same requests (``--workload``'s prompts, streamed greedy completions, no
prompt sent twice to a server) at the same seeded arrival times, and the same KV pool as `vllm-graft bench --suite` gives it (so a
kvcap shape's rows compare with the suite's); lossless arms' greedy texts are compared with
plain's, request by request. The SLO (``--slo-ttft``, ``--slo-tpot``, ``--slo-latency``, in
seconds) defaults to ``--slo-factor`` (5) x plain vLLM's own median TTFT and TPOT of requests
sent alone. A table is printed and the whole result (every request's record) written with
``--out``. Exit status :data:`EXIT_FAILED` when a server failed or a request was not answered.

Modules: :mod:`.load` (phases, Poisson arrivals, requests), :mod:`.stats` (figures, SLO,
goodput, the table), :mod:`.client` (asyncio + httpx, open and closed loop), :mod:`.run` (the
servers, one arm after another). None imports vLLM: the servers run in their own processes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from ...launch.exits import EXIT_FAILED
from ..command_line import from_args, write_json

DEFAULT_RATES = "0.25,0.5,1"


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "servebench",
        help="plain vLLM vs deployments behind vLLM's OpenAI server: a request-rate sweep, goodput at an SLO",
        description=__doc__.split("\n\n")[0].replace("`vllm-graft servebench DEPLOYMENT...`: ", "Runs ")
        + f" Exit status {EXIT_FAILED} if a server failed or a request was not answered.",
    )
    p.add_argument("deployments", nargs="+", metavar="DEPLOYMENT", help="deployment YAML file(s), served in turn")
    p.add_argument(
        "--rates",
        metavar="R[,R]",
        default=None,
        help=f"open loop: Poisson arrivals at these request rates, req/s (default {DEFAULT_RATES} "
        "unless --concurrency is given)",
    )
    p.add_argument(
        "--concurrency",
        metavar="C[,C]",
        default=None,
        help="closed loop: this many requests in flight, the next sent as one ends (after the rates)",
    )
    p.add_argument("--num-requests", type=int, default=16, metavar="N", help="requests per rate or level (default 16)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="send every load R times over in each server, each time with prompts of its own (round 1's "
        "loads, then round 2's, ...); the summary quotes the median x plain of rounds 2..R, round 1 "
        "being a cold server's (default 1)",
    )
    p.add_argument(
        "--workload",
        default="long-context",
        help="prompts from this bench workload (default long-context; code-completion for speculation)",
    )
    p.add_argument("--max-tokens", type=int, default=128, metavar="M", help="output tokens per request (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="SLO: time to first token, seconds")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="SLO: time per output token, seconds")
    p.add_argument("--slo-latency", type=float, default=None, metavar="S", help="SLO: request latency, seconds")
    p.add_argument(
        "--slo-factor",
        type=float,
        default=5.0,
        metavar="F",
        help="with no --slo-*: TTFT and TPOT limits F x plain vLLM's median for requests sent alone (default 5)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        metavar="N",
        help="KV pool of N blocks in every arm (num_gpu_blocks_override; default: the deployments' own)",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="generate max-tokens tokens even past <|endoftext|> (default: yes for deployments with "
        "random weights (load_format: dummy, the shapes), no for trained models, as the bench suite runs them)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--dir", default=None, help="folder for the server logs (default: a new temporary one)")
    p.add_argument("--out", metavar="FILE", default=None, help="write the full result as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.set_defaults(func=cmd_servebench)


def options(args: argparse.Namespace, folder: Path) -> Any:
    """The run's :class:`~.run.Options` from the command line (ValueError for a bad one)."""
    from .load import parse_list, phases
    from .run import Options
    from .stats import SLO

    rates = parse_list(args.rates, what="--rates") if args.rates else []
    conc = parse_list(args.concurrency, integer=True, what="--concurrency") if args.concurrency else []
    if not rates and not conc:
        rates = parse_list(DEFAULT_RATES)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests {args.num_requests}: give at least 1")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise ValueError(f"--kv-blocks {args.kv_blocks}: give at least 1")
    limits = (args.slo_ttft, args.slo_tpot, args.slo_latency)
    slo = None
    if any(v is not None for v in limits):
        slo = SLO(*limits, source="given (--slo-*)")
    elif not args.slo_factor > 0:
        raise ValueError(f"--slo-factor {args.slo_factor}: must be positive")
    return from_args(Options, args, phases=phases(rates, conc, args.rounds), slo=slo, folder=folder)


def render(result: dict[str, Any], console: Any, *, as_markdown: bool = False) -> None:
    from rich.markup import escape
    from rich.table import Table

    from .stats import COLUMNS, cells, markdown, rows, summary_lines

    slo = result.get("slo") or {}
    head = f"SLO: {slo.get('text')} ({slo.get('source')})" if "text" in slo else f"SLO: none ({slo.get('error', '?')})"
    s = result["settings"]
    title = (
        f"vllm-graft servebench: {s['workload']}, {s['num_requests']} requests x {s['max_tokens']} tokens "
        f"per load, seed {s['seed']}; {head}"
    )
    table_rows = rows(result)
    if as_markdown:
        print(title + "\n\n" + markdown(table_rows))
    else:
        table = Table(title=escape(title), box=None, padding=(0, 1), title_justify="left")
        for i, col in enumerate(COLUMNS):
            table.add_column(col, overflow="fold", no_wrap=i < 2)  # arm and load whole
        for r in table_rows:
            table.add_row(*map(escape, cells(r)))
        console.print(table)
    for line in summary_lines(result):
        console.print(escape(line))
    for arm in result["arms"]:
        if "error" in arm:
            console.print(f"[bold red]✗ {escape(arm['name'])}: {escape(arm['error'][:1500])}[/]")
        elif arm.get("kv_blocks") is not None:
            console.print(f"{escape(arm['name'])}: KV pool {arm['kv_blocks']} blocks")


def failed(result: dict[str, Any]) -> bool:
    return any("error" in a or any(ph["figures"]["failed"] for ph in a["phases"]) for a in result["arms"])


def cmd_servebench(args: argparse.Namespace, console: Any) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ...hooks import DeploymentError
    from ...integration.bridge import check_vllm_version
    from ..workloads import WorkloadError

    from .run import sweep

    err = Console(stderr=True, highlight=False, width=console.width)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="vllm-graft-servebench-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        opts = options(args, folder)
    except ValueError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return 2
    check_vllm_version()
    try:
        result = sweep(args.deployments, opts, say=lambda line: err.print(escape(line)))
    except DeploymentError as e:
        err.print(f"[bold red]✗ {escape(e.source)}: invalid deployment[/]")
        for p in e.problems:
            err.print(f"  [red]•[/] {escape(str(p))}")
        return 1
    except (ValueError, WorkloadError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return 2
    if args.out:
        write_json(args.out, result, default=str)
        err.print(f"results written to {escape(args.out)}")
    render(result, console, as_markdown=args.markdown)
    return EXIT_FAILED if failed(result) else 0
