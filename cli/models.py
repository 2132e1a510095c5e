"""``vllm-graft models``: where the bundled models and example deployments are, and what they are.

They ship inside the package (``vllm_graft/models``, ``vllm_graft/deployments`` in an install
from a wheel; ``models/`` and ``deployments/`` in a checkout), so a user who never cloned the
repository can still point vLLM or a deployment at them::

    vllm-graft models                        # the table: name, architecture, parameters, folder
    vllm-graft models path                   # the folder holding them (one line, for scripts)
    vllm-graft models path graft-tiny-llama  # one model's folder: vllm serve "$(...)"
    vllm-graft models path --deployments     # the example deployments' folder

No vLLM, torch or safetensors import: parameters are counted from each checkpoint's header.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_MISSING, EXIT_UNKNOWN = 0, 1, 2


def add_command(sub: Any) -> None:
    m = sub.add_parser("models", help="the bundled models (and example deployments): list them, print where they are")
    m.set_defaults(func=cmd_list, json=False)
    msub = m.add_subparsers(dest="models_command", metavar="ACTION")
    ls = msub.add_parser("list", help="one row per bundled model (the default action)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)
    p = msub.add_parser("path", help="print the models' folder, one model's folder, or the deployments' folder")
    p.add_argument("name", nargs="?", help="a bundled model (e.g. graft-tiny-mixtral, shapes/llama-108m)")
    p.add_argument("--deployments", action="store_true", help="the example deployments' folder instead")
    p.set_defaults(func=cmd_path)


# ------------------------------------------------------------------------------ facts
def checkpoint_parameters(folder: Path) -> int | None:
    """Parameters stored in the folder's ``*.safetensors`` files (from their JSON headers only);
    None when it has none (the shapes, run with ``load_format: dummy``)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, t in header.items():
            if name != "__metadata__":
                n = 1
                for d in t["shape"]:
                    n *= d
                total += n
    return total


def bundled_models(root: Path) -> list[dict[str, Any]]:
    """Every folder under ``root`` with a ``config.json``, sorted by name (relative, POSIX)."""
    out = []
    for config in sorted(root.rglob("config.json")):
        folder = config.parent
        try:
            cfg = json.loads(config.read_text())
        except (OSError, ValueError):
            cfg = {}
        params = checkpoint_parameters(folder)
        out.append(
            {
                "name": folder.relative_to(root).as_posix(),
                "architecture": (cfg.get("architectures") or ["?"])[0],
                "parameters": params,
                "weights": params is not None,
                "path": str(folder),
            }
        )
    return out


def _millions(n: int | None) -> str:
    return "none (load_format: dummy)" if n is None else f"{n / 1e6:.1f}M"


# ------------------------------------------------------------------------------ commands
def cmd_list(args: argparse.Namespace, console: Any) -> int:
    from rich.markup import escape
    from rich.table import Table

    from vllm_graft.cli.launch import deployments_dir, models_dir

    try:
        root = models_dir()
    except FileNotFoundError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_MISSING
    rows = bundled_models(root)
    if args.json:
        print(
            json.dumps({"models_dir": str(root), "deployments_dir": str(deployments_dir()), "models": rows}, indent=2)
        )
        return EXIT_OK
    table = Table(title=f"bundled models ({escape(str(root))})")
    for col in ("name", "architecture", "parameters"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["architecture"], _millions(r["parameters"]))
    console.print(table)
    console.print(f"example deployments: {escape(str(deployments_dir()))}")
    return EXIT_OK


def cmd_path(args: argparse.Namespace, console: Any) -> int:
    from rich.markup import escape

    from vllm_graft.cli.launch import deployments_dir, models_dir

    if args.deployments:
        if args.name:
            console.print("[bold red]error:[/] give a model name or --deployments, not both")
            return EXIT_UNKNOWN
        print(deployments_dir())
        return EXIT_OK
    try:
        root = models_dir()
    except FileNotFoundError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_MISSING
    if not args.name:
        print(root)
        return EXIT_OK
    names = [r["name"] for r in bundled_models(root)]
    if args.name not in names:
        console.print(
            f"[bold red]error:[/] no bundled model {escape(repr(args.name))}; the bundled models: "
            f"{escape(', '.join(names))}"
        )
        return EXIT_UNKNOWN
    print(root / args.name)
    return EXIT_OK
