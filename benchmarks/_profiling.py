"""What the profiling scripts of this folder share: running one engine in a fresh child
process, which functions are vllm-graft's own and how to name a profiled function
(``startup.py``, ``profile_steps.py``), and the command line of those that run a bench workload
through a deployment and its plain twin (``phase_time.py``, ``step_log.py``, ``adaptive_modes.py``)."""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
OURS = tuple(str(ROOT / d) + os.sep for d in ("hooks", "integration", "plugins"))
LAUNCHER = str(ROOT / "integration" / "launch.py")  # wraps the whole engine: not counted


def outermost_ours(stats: dict) -> dict:
    """Of cProfile's ``pstats.Stats(...).stats``, vllm-graft's functions that no function of
    ours (other than the launcher) called: their cumulative times add up without overlap."""
    ours = {k: v for k, v in stats.items() if k[0].startswith(OURS) and k[0] != LAUNCHER}
    return {k: v for k, v in ours.items() if not any(c in ours for c in v[4])}


def label(key: tuple) -> str:
    """``file:line function``, the file relative to the repository or to site-packages."""
    file, line, fn = key
    if file == "~":
        return fn
    try:
        file = str(Path(file).relative_to(ROOT))
    except ValueError:
        parts = Path(file).parts
        file = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else file
    return f"{file}:{line} {fn}"


def run_in_child(target: Callable[..., None], *args: Any, what: str) -> Any:
    """``target(*args, sender)`` in a fresh spawned process (so every engine pays the same
    imports); returns what it sent; exits naming ``what`` when the child died first."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, sender))
    proc.start()
    sender.close()
    try:
        row = receiver.recv()
    except EOFError:
        proc.join()
        sys.exit(f"{what} failed (exit code {proc.exitcode})")
    proc.join()
    return row


def child_engine_setup(path: str, workload: str, num_prompts: int, max_tokens: int) -> tuple[Any, Any, Any]:
    """In a child process about to run one in-process engine (the model in this process, for
    the profiler): ``(launch, plan, prompts)``: the launcher module (its ``in_process_engine``),
    the deployment's plan, and the workload's prompt set (``.prompts``, each with ``token_ids``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.plan import plan_for
    from vllm_graft.tools import workloads as W

    launch.apply_env_defaults(in_process=True)
    plan = plan_for(path)
    model = plan.model.path if plan.model is not None else plan.deployment.model
    max_len = int(plan.deployment.engine.get("max_model_len") or 2048)
    (ps,) = W.build([workload], W.Tokenizer.from_model(model), num_prompts=num_prompts, max_tokens=max_tokens,
                    max_model_len=max_len)
    return launch, plan, ps


def fresh_run(llm: Any) -> None:
    """Before a timed run that repeats the warm-up's prompts, as the bench does: a cold prefix
    cache, and no proposer drafting from the earlier runs' outputs (the graft plugins' shared
    state renewed, vLLM's ``suffix`` tree emptied); before the first, every decode step's token
    count warmed on the CPU engine's linear layers, as the bench does (``warm_step_shapes``)."""
    from vllm_graft.tools.bench.arm import fresh_drafting_state, warm_step_shapes

    if not getattr(llm, "_graft_shapes_warmed", False):
        llm._graft_shapes_warmed = True
        warm_step_shapes(llm)
    llm.reset_prefix_cache()
    fresh_drafting_state(llm)


WORKLOAD_SETTINGS = ("workload", "num_prompts", "max_tokens", "batch", "repeat")


def workload_parser(description: str, *, workload: str, num_prompts: int, batch: int) -> argparse.ArgumentParser:
    """The arguments every engine-profiling script here takes: the deployment, the bench workload,
    its prompts and output tokens, ``max_num_seqs`` (``--batch``) and the timed runs (``--repeat``);
    the script adds its own. :func:`workload_settings` reads them back."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("deployment")
    ap.add_argument("--workload", default=workload)
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--repeat", type=int, default=3)
    return ap


def workload_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`workload_parser` arguments a child engine needs, by name (``num_prompts``...)."""
    return {k: getattr(args, k) for k in WORKLOAD_SETTINGS}
