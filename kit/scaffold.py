"""`vllm-graft new-plugin KIND NAME`: a ready-to-install plugin package from a template.

The package holds the registration and its parameter model (a ``Params``), a reference module
whose methods raise NotImplementedError until written, a test suite wired to the conformance
kit, a README and a pyproject whose ``vllm_graft`` entry point makes vLLM (through vllm-graft)
find it once installed (``pip install -e DIR``). A plugin without a kernel is complete;
``--kernel`` adds one: parameters from ``KernelParams`` (``kernel: reference | triton``) and a
``kernel.py`` module the reference dispatches to.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console

from ..hooks import KINDS, Kind

#: Per kind, what the template writes: the names it imports, the methods to fill in (signature,
#: docstring) and the default ``lossless``. The hook and contract come from the kind's KindSpec.
TEMPLATES: dict[Kind, dict[str, Any]] = {
    Kind.ATTENTION: {
        "lossless": True,
        "imports": "AttentionLayer, AttentionMethod, PagedBatch",
        "methods": [
            (
                "forward(self, query, kv_cache, batch: PagedBatch, layer: AttentionLayer, plan=None)",
                "Attention output [T, H, D] for query [T, H, D] over the paged cache\n"
                "(layer.kv_layout.split(kv_cache) gives keys and values [blocks, H_kv, block_size, D]\n"
                'in the layout of the backend the plugin rides on; add "packed" to kv_layouts once\n'
                "the plugin reads only through it, so it runs on CUDA).",
            )
        ],
    },
    Kind.KVCOMPRESS: {
        "lossless": False,
        "imports": "BlockView, KVCompressor",
        "methods": [
            (
                "keep(self, view: BlockView) -> list[int]",
                "Sorted logical block indices to keep: always the last block and every\n"
                "block in view.pinned; a dropped block never comes back.",
            )
        ],
    },
    Kind.SPECULATIVE: {
        "lossless": True,
        "imports": "Proposer",
        "methods": [
            (
                "propose(self, request_id: str, token_ids, max_tokens: int) -> list[int]",
                "Up to max_tokens draft tokens to follow token_ids (prompt + output so far).",
            ),
            (
                "accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None",
                "How the last drafts fared (optional: delete this method if unused).",
            ),
            ("finish(self, request_id: str) -> None", "The request ended: release everything held for it."),
        ],
    },
    Kind.QUANT: {
        "lossless": False,
        "imports": "QuantMethod",
        "methods": [
            ("quantize(self, weight) -> dict", "The tensors that replace weight [out, in]."),
            (
                "apply(self, tensors: dict, x, bias)",
                "x @ W.T + bias from the quantised tensors, [T, out] in x's dtype.",
            ),
        ],
    },
    Kind.MOE: {
        "lossless": False,
        "imports": "MoEScheduler",
        "methods": [
            (
                "adjust_logits(self, layer_idx: int, router_logits)",
                "Router logits [T, E] to route with (delete the methods you do not need:\n"
                "adjust_logits, route, observe; see vllm_graft.hooks.MoEScheduler).",
            ),
            (
                "route(self, layer_idx: int, router_logits, top_k: int, renormalize: bool)",
                "(topk_weights [T, top_k], topk_ids [T, top_k]).",
            ),
            (
                "observe(self, layer_idx: int, topk_ids, topk_weights) -> None",
                "See the routing the layer computes with.",
            ),
        ],
    },
}

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def camel(name: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[-_]", name) if p)


def _args(sig: str) -> list[str]:
    """The arguments of ``sig`` after ``self``, without annotations (defaults kept)."""
    inner = sig.split("(", 1)[1].rsplit(")", 1)[0]
    out = []
    for a in inner.split(",")[1:]:
        name, _, default = a.partition("=")
        name = name.split(":")[0].strip()
        out.append(f"{name}={default.strip()}" if default else name)
    return out


def _pyproject(dist: str, kind: Kind, name: str, package: str) -> str:
    """The plugin distribution's ``pyproject.toml``: its entry point in the ``vllm_graft`` group."""
    return f'''\
[build-system]
requires = ["setuptools>=68", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A vllm-graft {kind.value} plugin: {name}"
requires-python = ">=3.10"
dependencies = ["vllm-graft"]

[project.optional-dependencies]
test = ["pytest>=8"]

# vllm-graft finds the plugin through this entry point once the package is installed.
[project.entry-points.vllm_graft]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''


def _conformance_test(kind: Kind, name: str, kernel: bool) -> str:
    """``tests/test_conformance.py``: the kit on the plugin."""
    return f'''\
"""The vllm-graft conformance kit on this plugin: registration, parameters, the
{kind.value} contract on generated inputs,{" Triton-vs-reference parity," if kernel else ""} and (with vLLM
installed) a run in vLLM's CPU engine. `pytest --graft-no-engine` skips the engine.
Other parameters: pytest.mark.graft_conformance("{kind.value}:{name}", params={{"example": 2}})."""
import pytest

pytestmark = pytest.mark.graft_conformance("{kind.value}:{name}")


def test_conformance(graft_check):
    graft_check()
'''


def _readme(dist: str, kind: Kind, name: str, package: str, kernel: bool) -> str:
    return f"""\
# {dist}

A [vllm-graft](https://github.com/) {kind.value} plugin: **{name}**.

    pip install -e .            # registers the plugin (entry point `vllm_graft`)
    vllm-graft plugins --kind {kind.value}
    pytest                      # the conformance kit; --graft-no-engine skips vLLM

Enable it in a deployment file:

```yaml
model: path/to/model
{kind.value}:
  plugin: {name}
  params: {{example: 1}}
```

and run `vllm-graft generate deployment.yaml "def main("` or
`vllm-graft bench deployment.yaml` to compare it with plain vLLM
(`--baseline OTHER.yaml --baseline-as-is`: against another deployment, e.g. a built-in plugin).

What to write: `{package}/reference.py` (the algorithm){f", `{package}/kernel.py` (its Triton kernel)" if kernel else ""},
the parameters and capabilities in `{package}/__init__.py`.
"""


def _registration_module(kind: Kind, name: str, package: str, kernel: bool, spec: dict[str, Any]) -> str:
    """The generated ``__init__.py``: the parameters and the registration with its capabilities."""
    cls = camel(name)
    base = "KernelParams" if kernel else "Params"
    base_doc = (
        "\n    `kernel` (from KernelParams) picks 'reference' or 'triton' (kernel.py)."
        if kernel
        else "\n    (A Triton kernel is an addition: derive from KernelParams, which adds\n"
        "    `kernel: reference | triton`, or generate with --kernel.)"
    )
    role = (
        '\n            role="eviction",  # or "storage" (a KVCacheFormat): how it composes in kvcompress:'
        if kind is Kind.KVCOMPRESS
        else ""
    )
    return f'''\
"""`{name}`: a vllm-graft {kind.value} plugin (registration and parameters)."""
from pydantic import Field

from vllm_graft.hooks import Capabilities, {base}, Registration, hookimpl


class {cls}Params({base}):
    """Parameters, as written under `params:` in a deployment. Give every field a type,
    a default and bounds (Field(..., ge=...)): the conformance kit checks that bad values
    are refused.{base_doc}"""

    example: int = Field(1, ge=1, description="replace with your parameters")


@hookimpl
def {spec["hook"]}(register):
    register(Registration(
        name="{name}",
        summary="One line: what it does",
        paper="The paper's title (venue or arXiv id)",
        params={cls}Params,
        impl="{package}.reference:{cls}",  # imported only when a deployment enables it
        # Where it runs; a deployment outside it is refused before vLLM starts, naming the
        # field (every field: docs/tutorial.md in vllm-graft, "Capabilities").
        capabilities=Capabilities(
            lossless={spec["lossless"]},  # True: the kit and the engine check hold it to plain vLLM's output
            platforms=("cpu", "cuda"),
            dtypes=("float32", "float16", "bfloat16"),
            head_sizes=None,  # None: any
            parallelism=("dp",),  # add "tp", "pp", "ep" once it has run right under them{role}
        ),
    ))
'''


def render(kind: Kind, name: str, package: str, kernel: bool = False) -> dict[str, str]:
    """File path (relative to the package folder) -> text. Without ``kernel`` the plugin is a
    reference alone (parameters from :class:`~vllm_graft.hooks.Params`, no ``kernel.py``); with
    it, parameters from :class:`~vllm_graft.hooks.KernelParams` (``kernel: reference | triton``)
    and a ``kernel.py`` the reference dispatches to. No generated module relies on
    ``from __future__ import annotations``: every name an annotation uses is imported."""
    spec = {**TEMPLATES[kind], "hook": KINDS[kind].hook, "contract": KINDS[kind].contract}
    cls = camel(name)
    dist = f"graft-{name}" if not name.startswith("graft-") else name

    def method(sig: str, doc: str, body: str) -> str:
        doc_lines = doc.splitlines()
        doc_text = (
            doc_lines[0] if len(doc_lines) == 1 else "\n".join([doc_lines[0], *("        " + d for d in doc_lines[1:])])
        )
        return f'    def {sig}:\n        """{doc_text}"""\n        {body}\n'

    def body(sig: str) -> str:
        meth = sig.split("(")[0]
        todo = f'raise NotImplementedError("{name}: write the reference {meth}() in {package}/reference.py")'
        if not kernel:
            return todo
        call = ", ".join(["self", *(a.split("=")[0] for a in _args(sig))])
        return (
            f'if self.params.kernel == "triton":\n'
            f"            from . import kernel\n\n"
            f"            return kernel.{meth}({call})\n"
            f"        {todo}"
        )

    ref_methods = "\n".join(method(sig, doc, body(sig)) for sig, doc in spec["methods"])
    kernel_funcs = "\n\n".join(
        f"def {sig.split('(')[0]}(plugin, {', '.join(_args(sig))}):\n"
        f'    """The Triton path of {cls}.{sig.split("(")[0]} (same inputs and result as the reference)."""\n'
        f'    raise NotImplementedError("{name}: write the Triton kernel for {sig.split("(")[0]}() in {package}/kernel.py")\n'
        for sig, _ in spec["methods"]
    )
    files = {
        "pyproject.toml": _pyproject(dist, kind, name, package),
        f"{package}/__init__.py": _registration_module(kind, name, package, kernel, spec),
        f"{package}/reference.py": f'''\
"""The reference implementation of `{name}`: plain PyTorch, readable beside the paper.
It is the CPU path{" and the oracle the Triton kernel is tested against" if kernel else ""}."""
from vllm_graft.hooks import {spec["imports"]}


class {cls}({spec["contract"]}):
{ref_methods}''',
        "tests/test_conformance.py": _conformance_test(kind, name, kernel),
        "README.md": _readme(dist, kind, name, package, kernel),
    }
    if kernel:
        files[f"{package}/kernel.py"] = f'''\
"""Triton kernels of `{name}` and their launchers (`kernel: triton` in the parameters).

On a machine without a GPU they run under TRITON_INTERPRET=1 (the conformance kit sets
it): fp32/fp16 only, small shapes. Import triton inside the launchers, not at module level,
so the reference path never needs it.
"""


{kernel_funcs}'''
    return files


def cmd_new_plugin(args: argparse.Namespace, console: Console) -> int:
    kind = Kind(args.kind)
    name = args.name
    if not NAME_RE.match(name):
        console.print(
            f"[red]plugin name {name!r} is not valid[/red]: use lower-case letters, "
            "digits, '-' and '_', starting with a letter or digit (e.g. my-compressor)"
        )
        return 2
    package = args.package or "graft_" + name.replace("-", "_")
    if not package.isidentifier():
        console.print(f"[red]package name {package!r} is not a Python identifier[/red]; pass --package")
        return 2
    out = Path(args.dir or f"graft-{name}")
    if out.exists() and any(out.iterdir()) and not args.force:
        console.print(f"[red]{out} exists and is not empty[/red]: choose another --dir, or --force to write over it")
        return 2
    for rel, text in render(kind, name, package, kernel=args.kernel).items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if rel.endswith(".toml") else text)
    console.print(
        f"created the {kind.value} plugin [bold]{name}[/bold] in {out}/ (package {package})\n"
        f"next: pip install -e {out} && cd {out} && pytest   (the conformance checks fail "
        f"until reference.py{' and kernel.py are' if args.kernel else ' is'} written)"
    )
    return 0


def add_command(sub: Any) -> None:
    p = sub.add_parser("new-plugin", help="create a ready-to-install plugin package from the template")
    p.add_argument("kind", choices=[k.value for k in Kind], help="the plugin kind")
    p.add_argument("name", help="the plugin name (lower-case, digits, '-', '_')")
    p.add_argument("--dir", help="where to create it (default: ./graft-NAME)")
    p.add_argument("--package", help="the Python package name (default: graft_NAME)")
    p.add_argument(
        "--kernel",
        action="store_true",
        help="add a Triton kernel: parameters from KernelParams (kernel: reference | triton) "
        "and a kernel.py the reference dispatches to (default: the reference alone)",
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty folder")
    p.set_defaults(func=cmd_new_plugin)
