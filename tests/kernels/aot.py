"""Ahead-of-time compilation of the plugins' Triton kernels for CUDA targets, without a GPU.

Two halves, in two processes (a process has Triton either interpreted or compiling):

* capture (a pytest plugin, ``-p tests.kernels.aot``, active when ``VLLM_GRAFT_AOT_CAPTURE``
  names a file): while the kernel tests run under ``TRITON_INTERPRET=1``, every launch of a
  ``@triton.jit`` kernel is recorded with the types of its arguments, its constexpr values and
  its launch options, i.e. exactly the specialisations the plugins' launchers produce;
* compile (``python -m tests.kernels.aot SPECS OUT ARCH...``, Triton not interpreted): each
  recorded specialisation is compiled with ``triton.compile(ASTSource(...),
  target=GPUTarget("cuda", arch, 32))`` down to a cubin (``ptxas`` ships with Triton's NVIDIA
  backend), and the result (``ok`` or the error) is written per kernel and arch.

:func:`jit_functions` lists every ``@triton.jit`` function under plugins/ with ``ast``, and
which of them other kernels call, so the test knows what must have been compiled.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import sys
from pathlib import Path

ENV = "VLLM_GRAFT_AOT_CAPTURE"
PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


# ------------------------------------------------------------------------------ inventory
def jit_functions(root: Path = PLUGINS) -> dict[str, set[str]]:
    """``module:function`` of every ``@triton.jit`` function -> the jit functions it calls, its
    own module's or one it imports by name (``from .._kernel import helper``)."""
    trees, jitted = {}, {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = "vllm_graft.plugins." + ".".join(path.relative_to(root).with_suffix("").parts)
        if path.name == "__init__.py":
            module = module.rsplit(".", 1)[0]
        trees[module] = (tree, path.name == "__init__.py")
        jitted[module] = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and any(
            "jit" in ast.unparse(d) for d in n.decorator_list)}
    out: dict[str, set[str]] = {}
    for module, (tree, is_package) in trees.items():
        names = {name: f"{module}:{name}" for name in jitted[module]}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                source = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    if a.name in jitted.get(source, {}):
                        names[a.asname or a.name] = f"{source}:{a.name}"
        for name, fn in jitted[module].items():
            out[f"{module}:{name}"] = {names[c.func.id] for c in ast.walk(fn) if isinstance(c, ast.Call)
                                       and isinstance(c.func, ast.Name) and c.func.id in names}
    return out


# ------------------------------------------------------------------------------ capture
def _type_of(value) -> str:
    from triton.runtime.jit import mangle_type

    return mangle_type(value)


def _json_value(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "value"):  # tl.constexpr
        return _json_value(value.value)
    raise TypeError(f"constexpr value {value!r} cannot be recorded")


def pytest_configure(config) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args), **kwargs)
        signature, constexprs = {}, {}
        for name, p in params.items():
            value = bound.get(name, p.default)
            if "constexpr" in str(p.annotation):
                signature[name] = "constexpr"
                constexprs[name] = _json_value(value)
            else:
                signature[name] = _type_of(value)
        spec = {"kernel": f"{self.fn.__module__}:{self.fn.__name__}", "signature": signature,
                "constexprs": constexprs, "options": options}
        seen.setdefault(json.dumps(spec, sort_keys=True), spec)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)

    InterpretedFunction.run = run
    config._graft_aot = (path, seen)


def pytest_unconfigure(config) -> None:
    state = getattr(config, "_graft_aot", None)
    if state:
        path, seen = state
        Path(path).write_text(json.dumps(list(seen.values()), indent=1))


# ------------------------------------------------------------------------------ compile
def compile_spec(spec: dict, arch: int) -> str:
    """"ok", or the compiler's error (its first lines)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = spec["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    constexprs = {(fn.arg_names.index(k),): v for k, v in spec["constexprs"].items()}
    try:
        src = ASTSource(fn=fn, signature=spec["signature"], constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec["options"])
    except Exception as e:  # the test reports it, naming the kernel
        return f"{type(e).__name__}: " + "\n".join(str(e).strip().splitlines()[-6:])
    return "ok" if compiled.asm.get("cubin") else "no cubin produced"


def main(argv: list[str]) -> int:
    specs_path, out_path, *archs = argv
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile with TRITON_INTERPRET unset")
    specs = json.loads(Path(specs_path).read_text())
    results = [{**s, "results": {str(a): compile_spec(s, int(a)) for a in archs}} for s in specs]
    Path(out_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
