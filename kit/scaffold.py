"""`vllm-graft new-plugin KIND NAME`: a ready-to-install plugin package from a template.

The package holds the registration and its parameter model, a reference and a kernel
module whose methods raise NotImplementedError until written, a test suite wired to the
conformance kit, a README and a pyproject whose ``vllm_graft`` entry point makes vLLM
(through vllm-graft) find it once installed (``pip install -e DIR``).
"""
from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console

from vllm_graft.hooks import KINDS, Kind

#: Per kind, what the template writes: the names it imports, the methods to fill in (signature,
#: docstring) and the default ``lossless``. The hook and contract come from the kind's KindSpec.
TEMPLATES: dict[Kind, dict[str, Any]] = {
    Kind.ATTENTION: {
        "lossless": True,
        "imports": "AttentionLayer, AttentionMethod, PagedBatch, split_kv_cache",
        "methods": [("forward(self, query, kv_cache, batch: PagedBatch, layer: AttentionLayer, plan=None)",
                     "Attention output [T, H, D] for query [T, H, D] over the paged cache\n"
                     "(split_kv_cache(kv_cache) gives keys and values [blocks, H_kv, block_size, D]).")],
    },
    Kind.KVCOMPRESS: {
        "lossless": False,
        "imports": "BlockView, KVCompressor",
        "methods": [("keep(self, view: BlockView) -> list[int]",
                     "Sorted logical block indices to keep: always the last block and every\n"
                     "block in view.pinned; a dropped block never comes back.")],
    },
    Kind.SPECULATIVE: {
        "lossless": True,
        "imports": "Proposer",
        "methods": [("propose(self, request_id: str, token_ids, max_tokens: int) -> list[int]",
                     "Up to max_tokens draft tokens to follow token_ids (prompt + output so far)."),
                    ("accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None",
                     "How the last drafts fared (optional: delete this method if unused)."),
                    ("finish(self, request_id: str) -> None",
                     "The request ended: release everything held for it.")],
    },
    Kind.QUANT: {
        "lossless": False,
        "imports": "QuantMethod",
        "methods": [("quantize(self, weight) -> dict",
                     "The tensors that replace weight [out, in]."),
                    ("apply(self, tensors: dict, x, bias)",
                     "x @ W.T + bias from the quantised tensors, [T, out] in x's dtype.")],
    },
    Kind.MOE: {
        "lossless": False,
        "imports": "MoEScheduler",
        "methods": [("adjust_logits(self, layer_idx: int, router_logits)",
                     "Router logits [T, E] to route with (delete the methods you do not need:\n"
                     "adjust_logits, route, observe; see vllm_graft.hooks.MoEScheduler)."),
                    ("route(self, layer_idx: int, router_logits, top_k: int, renormalize: bool)",
                     "(topk_weights [T, top_k], topk_ids [T, top_k])."),
                    ("observe(self, layer_idx: int, topk_ids, topk_weights) -> None",
                     "See the routing the layer computes with.")],
    },
}

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def camel(name: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[-_]", name) if p)


def render(kind: Kind, name: str, package: str) -> dict[str, str]:
    """File path (relative to the package folder) -> text."""
    spec = {**TEMPLATES[kind], "hook": KINDS[kind].hook, "contract": KINDS[kind].contract}
    cls = camel(name)
    dist = f"graft-{name}" if not name.startswith("graft-") else name

    def method(sig: str, doc: str, body: str) -> str:
        doc_lines = doc.splitlines()
        doc_text = doc_lines[0] if len(doc_lines) == 1 else \
            "\n".join([doc_lines[0], *("        " + d for d in doc_lines[1:])])
        return f'    def {sig}:\n        """{doc_text}"""\n        {body}\n'

    ref_methods = "\n".join(method(sig, doc, (
        "if self.params.kernel == \"triton\":\n"
        f"            from . import kernel\n\n"
        f"            return kernel.{sig.split('(')[0]}(self, {', '.join(a.split(':')[0].split('=')[0].strip() for a in sig.split('(', 1)[1].rsplit(')', 1)[0].split(',')[1:])})\n"
        f"        raise NotImplementedError(\"{name}: write the reference {sig.split('(')[0]}() in {package}/reference.py\")"))
        for sig, doc in spec["methods"])
    kernel_funcs = "\n\n".join(
        f"def {sig.split('(')[0]}(plugin, {', '.join(a.strip() for a in sig.split('(', 1)[1].rsplit(')', 1)[0].split(',')[1:])}):\n"
        f'    """The Triton path of {cls}.{sig.split("(")[0]} (same inputs and result as the reference)."""\n'
        f"    raise NotImplementedError(\"{name}: write the Triton kernel for {sig.split('(')[0]}() in {package}/kernel.py\")\n"
        for sig, _ in spec["methods"])
    files = {
        "pyproject.toml": f'''\
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
''',
        f"{package}/__init__.py": f'''\
"""`{name}`: a vllm-graft {kind.value} plugin (registration and parameters)."""
from pydantic import Field

from vllm_graft.hooks import Capabilities, KernelParams, Registration, hookimpl


class Params(KernelParams):
    """Parameters, as written under `params:` in a deployment. Give every field a type,
    a default and bounds (Field(..., ge=...)): the conformance kit checks that bad values
    are refused. `kernel` (from KernelParams) picks 'reference' or 'triton'."""

    example: int = Field(1, ge=1, description="replace with your parameters")


@hookimpl
def {spec["hook"]}(register):
    register(Registration(
        name="{name}",
        summary="One line: what it does",
        paper="The paper's title (venue or arXiv id)",
        params=Params,
        impl="{package}.reference:{cls}",
        capabilities=Capabilities(lossless={spec["lossless"]}, platforms=("cpu", "cuda")),
    ))
''',
        f"{package}/reference.py": f'''\
"""The reference implementation of `{name}`: plain PyTorch, readable beside the paper.
It is the CPU path and the oracle the Triton kernel is tested against."""
from __future__ import annotations

from vllm_graft.hooks import {spec["imports"]}


class {cls}({spec["contract"]}):
{ref_methods}''',
        f"{package}/kernel.py": f'''\
"""Triton kernels of `{name}` and their launchers (`kernel: triton` in the parameters).

On a machine without a GPU they run under TRITON_INTERPRET=1 (the conformance kit sets
it): fp32/fp16 only, small shapes. Import triton inside the launchers, not at module level,
so the reference path never needs it.
"""
from __future__ import annotations


{kernel_funcs}''',
        "tests/test_conformance.py": f'''\
"""The vllm-graft conformance kit on this plugin: registration, parameters, the
{kind.value} contract on generated inputs, Triton-vs-reference parity, and (with vLLM
installed) a run in vLLM's CPU engine. `pytest --graft-no-engine` skips the engine."""
import pytest

pytestmark = pytest.mark.graft_conformance("{kind.value}:{name}")


def test_conformance(graft_check):
    graft_check()
''',
        "README.md": f'''\
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
`vllm-graft bench deployment.yaml` to compare it with plain vLLM.

What to write: `{package}/reference.py` (the algorithm), `{package}/kernel.py` (its Triton
kernel), the parameters and capabilities in `{package}/__init__.py`.
''',
    }
    return files


def cmd_new_plugin(args: argparse.Namespace, console: Console) -> int:
    kind = Kind(args.kind)
    name = args.name
    if not NAME_RE.match(name):
        console.print(f"[red]plugin name {name!r} is not valid[/red]: use lower-case letters, "
                      "digits, '-' and '_', starting with a letter or digit (e.g. my-compressor)")
        return 2
    package = args.package or "graft_" + name.replace("-", "_")
    if not package.isidentifier():
        console.print(f"[red]package name {package!r} is not a Python identifier[/red]; pass --package")
        return 2
    out = Path(args.dir or f"graft-{name}")
    if out.exists() and any(out.iterdir()) and not args.force:
        console.print(f"[red]{out} exists and is not empty[/red]: choose another --dir, or --force "
                      "to write over it")
        return 2
    for rel, text in render(kind, name, package).items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if rel.endswith(".toml") else text)
    console.print(f"created the {kind.value} plugin [bold]{name}[/bold] in {out}/ (package {package})\n"
                  f"next: pip install -e {out} && cd {out} && pytest   "
                  "(the conformance checks fail until reference.py and kernel.py are written)")
    return 0


def add_command(sub: Any) -> None:
    p = sub.add_parser("new-plugin", help="create a ready-to-install plugin package from the template")
    p.add_argument("kind", choices=[k.value for k in Kind], help="the plugin kind")
    p.add_argument("name", help="the plugin name (lower-case, digits, '-', '_')")
    p.add_argument("--dir", help="where to create it (default: ./graft-NAME)")
    p.add_argument("--package", help="the Python package name (default: graft_NAME)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder")
    p.set_defaults(func=cmd_new_plugin)
