"""``vllm-graft doctor`` and ``vllm-graft patches``: what vllm-graft needs from vLLM.

``vllm-graft doctor [--vllm-source DIR|WHEEL ...]`` checks, without importing or running vLLM,
that each given source (default: the installed vLLM) has everything in :func:`.checks.needs`,
and prints one table (a column per source); exit 1 if anything is missing, each failure
naming the file and the name. ``behaviour`` rows (:mod:`.behaviour`) check what vLLM does, read
statically: async scheduling's default and the output type it wraps, vllm-graft's custom ops
vs vLLM's splitting ops and CUDA graphs, MoE kernel selection; a row is ``n/a`` on a build
without that behaviour (the CPU build: no async scheduling, no CUDA graphs, CPU MoE kernels),
which is not a failure. ``flashinfer`` rows (:mod:`.flashinfer`) check every FlashInfer name and
call of vllm-graft against the FlashInfer release the source pins, read from its wheel in
``~/.cache/vllm-graft/wheels`` (``make wheels``; ``VLLM_GRAFT_WHEELS`` elsewhere) or an installed
copy at that release; ``n/a`` naming the fetch command when neither is here. The CUDA wheel
needs no GPU::

    pip download vllm==0.33.0 --no-deps -d wheels/
    vllm-graft doctor --vllm-source wheels/vllm-0.33.0-*.whl --vllm-source .venv/lib/python3.11/site-packages

``vllm-graft patches [DEPLOYMENT] [--all]`` activates a deployment in-process (no engine starts)
and lists the patches it applies (the vLLM target, which plugin, why, the checked range, the
runner it needs); ``--all`` does it for one deployment per adapter and patch, the whole register.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

EXIT_OK, EXIT_MISSING = 0, 1


def add_command(sub: Any) -> None:
    d = sub.add_parser("doctor", help="check a vLLM source tree or wheel against what vllm-graft patches and imports")
    d.add_argument(
        "--vllm-source",
        action="append",
        metavar="DIR|WHEEL",
        help="a folder holding vllm/ (e.g. site-packages) or a vLLM wheel; repeatable (default: the installed vLLM)",
    )
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--failures-only", action="store_true", help="print only what is missing")
    d.set_defaults(func=cmd_doctor)

    p = sub.add_parser("patches", help="list the patches a deployment applies inside vLLM")
    p.add_argument("deployment", nargs="?", help="deployment YAML file (default: $VLLM_GRAFT_DEPLOYMENT)")
    p.add_argument(
        "--all", action="store_true", help="every patch any built-in adapter applies (one deployment per adapter)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_patches)


# ------------------------------------------------------------------------------ doctor
def doctor(locations: list[str] | None) -> tuple[list[Any], list[Any], list[list[str | None]]]:
    """(sources, needs, results): ``results[i][j]`` is need i's problem in source j (None: ok)."""
    from .checks import installed_source, needs
    from .source import VLLMSource

    if locations:
        sources = [VLLMSource(loc) for loc in locations]
    else:
        installed = installed_source()
        if installed is None:
            raise FileNotFoundError("no vLLM is installed here; give --vllm-source DIR|WHEEL")
        sources = [installed]
    reqs = needs(sources)
    return sources, reqs, [[n.check(s) for s in sources] for n in reqs]


def cmd_doctor(args: argparse.Namespace, console: Any) -> int:
    from rich.markup import escape
    from rich.table import Table

    try:
        sources, reqs, results = doctor(args.vllm_source)
    except FileNotFoundError as e:
        console.print(f"[bold red]doctor:[/] {escape(str(e))}")
        return 2
    from .checks import is_problem, status

    failed = sum(1 for row in results for r in row if is_problem(r))
    if args.json:
        print(
            json.dumps(
                {
                    "sources": [
                        {"location": str(s.location), "version": s.version, "distribution": s.distribution}
                        for s in sources
                    ],
                    "checks": [
                        {
                            "what": n.what,
                            "key": n.key,
                            "owner": n.owner,
                            "runner": n.runner,
                            "reads": list(n.reads),
                            "results": row,
                            "status": [status(r) for r in row],
                        }
                        for n, row in zip(reqs, results)
                    ],
                    "failed": failed,
                },
                indent=2,
            )
        )
        return EXIT_MISSING if failed else EXIT_OK
    table = Table(show_header=True, box=None, padding=(0, 1))
    for col in ("check", "needed", "by", "runner"):
        table.add_column(col, overflow="fold")
    for s in sources:
        table.add_column(f"{s.distribution} {s.version}", overflow="fold")
    for n, row in zip(reqs, results):
        if args.failures_only and not any(is_problem(r) for r in row):
            continue
        key = escape(n.key) + (f" [dim](reads {escape(', '.join(n.reads))})[/]" if n.reads else "")
        table.add_row(n.what, key, escape(n.owner), n.runner, *[_cell(n.what, r) for r in row])
    console.print(table)
    verdict = f"[bold red]{failed} missing or wrong[/]" if failed else "[bold green]everything present[/]"
    console.print(f"{len(reqs)} checks x {len(sources)} source(s): {verdict}")
    return EXIT_MISSING if failed else EXIT_OK


def _cell(what: str, result: str | None) -> str:
    from rich.markup import escape

    from .checks import status

    s = status(result)
    if s == "ok":
        return "[green]ok[/]"
    if s == "n/a":
        return f"[yellow]n/a: {escape(result or '')}[/]"
    return f"[red]{'PROBLEM' if what == 'behaviour' else 'MISSING'}: {escape(result or '')}[/]"


# ------------------------------------------------------------------------------ patches
#: One deployment per adapter and patch group: together they apply every patch of the register
#: that a deployment can apply (``--all``). Model: the bundled MoE model (every kind fits it).
ALL_DEPLOYMENTS: tuple[dict[str, Any], ...] = (
    {"attention": {"plugin": "noop"}},
    {"kvcompress": {"plugin": "h2o"}},  # lossy (prefix-cache salt) and scored (scores channel)
    {"kvcompress": {"plugin": "streaming"}},  # rule-based (the frees check)
    {"speculative": {"plugin": "token-recycling", "params": {"tree": True}}},  # top-k, tree verification
    {"quant": {"plugin": "noop"}},
    {"moe": [{"plugin": "noop"}]},
)


def applied_patches(data: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """Activate ``data`` in this process (no engine), list its patches, deactivate."""
    from ...integration import bridge
    from ...integration import model_runner
    from ...integration.patches import PATCHES

    from ...integration.plan import plan_for

    plan = plan_for(data, source=source)
    bridge._install_config_hook()
    bridge.activate(plan, source=source)
    try:
        from ...integration.targets import PATCH_TARGETS

        served = model_runner.plugins_by_owner(plan.enabled)
        entries = {t.where: t for t in PATCH_TARGETS}
        rows = []
        for p in PATCHES.applied():
            entry = entries.get(p.where)
            rows.append(
                {
                    "target": p.where,
                    "owner": p.owner,
                    "plugins": served.get(p.owner, []),
                    "reason": p.reason,
                    "versions": p.versions,
                    "runner": p.runner,
                    "upstream": entry.upstream if entry else "",
                    "remove_when": entry.remove_when if entry else "",
                }
            )
        return rows
    finally:
        bridge.deactivate()


def cmd_patches(args: argparse.Namespace, console: Any) -> int:
    import os

    from rich.markup import escape
    from rich.table import Table

    from ...hooks import DeploymentError
    from ...integration.bridge import ENV_FILE

    if args.all:
        model = str(_bundled_model())
        jobs = [(dict(d, model=model), "--all: " + ", ".join(d)) for d in ALL_DEPLOYMENTS]
    else:
        path = args.deployment or os.environ.get(ENV_FILE)
        if not path:
            console.print(f"[bold red]patches:[/] give a deployment file (or set {ENV_FILE}), or --all")
            return 2
        jobs = [({"__file__": path}, path)]  # paths inside resolve from the file's folder
    rows: dict[str, dict[str, Any]] = {}
    try:
        for data, source in jobs:
            for row in applied_patches(data, source):
                prev = rows.setdefault(row["target"], row)
                if prev is not row:
                    prev["plugins"] = sorted(set(prev["plugins"]) | set(row["plugins"]))
    except DeploymentError as e:
        console.print(f"[bold red]patches:[/] {escape(str(e))}")
        return 1
    if args.json:
        print(json.dumps(list(rows.values()), indent=2))
        return EXIT_OK
    table = Table(show_header=True, box=None, padding=(0, 1))
    for col in ("vLLM target", "patched for", "runner", "checked on", "why", "upstream", "remove when"):
        table.add_column(col, overflow="fold")
    from ...hooks.versions import VLLM_BUILDS

    checked = ", ".join(f"{b.checked} {b.platform} ({'run' if b.verified == 'run' else 'static'})" for b in VLLM_BUILDS)
    for r in rows.values():
        table.add_row(
            escape(r["target"]),
            escape(", ".join(r["plugins"]) or r["owner"]),
            r["runner"],
            escape(f"{r['versions']}: {checked}"),
            escape(r["reason"]),
            escape(r["upstream"]),
            escape(r["remove_when"]),
        )
    console.print(table)
    console.print(
        f"{len(rows)} patch(es). The register with every target: "
        "vllm_graft/integration/targets.py; check a vLLM build with `vllm-graft doctor`."
    )
    return EXIT_OK


def _bundled_model():
    from ...launch.engine import models_dir

    return models_dir() / "graft-tiny-mixtral"
