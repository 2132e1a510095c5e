"""One sweep: plain vLLM's OpenAI server, then each deployment's, one at a time, each through
every phase of the load; then the figures.

Per arm: start the server (:class:`~vllm_graft.tools.soak.server.Server`, loopback) with the
KV pool capped as `vllm-graft bench --suite` caps it (below), warm it up (4 prompts at once, 4
tokens each), send the calibration requests one at a time (TTFT and TPOT alone), then each
phase in turn, with prompts of its own (:func:`~.load.deal`) and its own prefix-cache salt,
reading vLLM's preemption counter before and after each; stop the server. The default SLO is derived from plain's calibration
(:func:`~.stats.derived_slo`), so it is fixed before any arm is classified, and every arm is
held to the same one.

The KV pool: the bench runs each arm with the deployment's engine arguments (a kvcap shape's
``num_gpu_blocks_override``, in both arms) and, on the CPU engine, ``VLLM_CPU_KVCACHE_SPACE``
as the user set it or 1 GiB (:data:`~vllm_graft.launch.engine.CPU_ENV_DEFAULTS`; left out where
the deployment gives ``kv_cache_memory_bytes``, which it would override). The servers here get
exactly that, so a sweep's rows compare with the suite's. ``--kv-blocks N`` sets
``num_gpu_blocks_override`` in every arm instead. The number of blocks each server allocated is
read back from its ``/metrics`` (``vllm:cache_config_info``) and recorded.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .client import closed_loop, one_at_a_time, open_loop
from .load import Dealt, Phase, deal, poisson_arrivals, prompts_needed, requests_from_prompts
from .stats import MEASUREMENT, SLO, Record, by_load, compare_greedy, derived_slo, summarize, vs_plain

SCHEMA = "vllm-graft-servebench/1"
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 4
CALIBRATION_REQUESTS = 2


@dataclass
class Options:
    phases: list[Phase]
    workload: str = "long-context"
    num_requests: int = 16
    max_tokens: int = 128
    seed: int = 0
    slo: SLO | None = None  # None: derived from plain's calibration, slo_factor x
    slo_factor: float = 5.0
    kv_blocks: int | None = None
    ignore_eos: bool | None = None  # None: on iff the deployments load dummy weights (see sweep)
    timeout: float = 600.0
    folder: Path = field(default_factory=lambda: Path("."))


@dataclass
class Arm:
    name: str
    deployment: str | None  # None: plain vLLM
    kwargs: dict[str, Any]
    plugins: list[str]
    lossless: bool | None  # None: plain


def cap_env(kwargs: dict[str, Any]) -> dict[str, str]:
    """The server environment that caps the KV pool as the bench does (see the module doc)."""
    from ...launch.engine import CPU_ENV_DEFAULTS

    if kwargs.get("kv_cache_memory_bytes") is not None:
        return {}
    key = "VLLM_CPU_KVCACHE_SPACE"
    return {key: os.environ.get(key) or CPU_ENV_DEFAULTS[key]}


def arms_for(paths: Sequence[str], kv_blocks: int | None = None) -> list[Arm]:
    """Plain vLLM (the deployments' plain twin) and each deployment. Every deployment must
    have the same plain twin (model and engine arguments): one plain arm, one KV cap."""
    from ...launch.engine import llm_kwargs
    from ...integration.plan import plan_for

    arms: list[Arm] = []
    plain: dict[str, Any] | None = None
    first = ""
    for path in paths:
        plan = plan_for(path)
        kwargs = llm_kwargs(plan, graft=True)
        twin = llm_kwargs(plan, graft=False)
        if kv_blocks is not None:
            kwargs["num_gpu_blocks_override"] = twin["num_gpu_blocks_override"] = kv_blocks
        if plain is None:
            plain, first = twin, str(path)
        elif twin != plain:
            diff = sorted(k for k in set(twin) | set(plain) if twin.get(k) != plain.get(k))
            raise ValueError(
                f"{path} and {first} have different plain twins ({', '.join(diff)} differ): one sweep "
                "compares deployments of one model and engine (one plain arm, one KV cap); run them apart"
            )
        lossless = bool(plan.enabled) and all(e.entry.registration.capabilities.lossless for e in plan.enabled)
        arms.append(Arm(Path(path).stem, str(path), kwargs, [f"{e.kind}:{e.name}" for e in plan.enabled], lossless))
    if plain is None:
        raise ValueError("no deployment given")
    names = [a.name for a in arms]
    for a in arms:
        if names.count(a.name) > 1 or a.name == "plain":
            a.name = a.deployment or a.name
    return [Arm("plain", None, plain, [], None), *arms]


def build_requests(model: str, max_model_len: int, opts: Options) -> tuple[Dealt, dict[str, Any]]:
    """The workload's prompts for the warm-up, the calibration and every phase, dealt out."""
    from ..workloads import Tokenizer, WorkloadError, build

    extra = warm_up_requests(opts) - WARMUP_REQUESTS
    need = prompts_needed(opts.num_requests, len(opts.phases), WARMUP_REQUESTS, CALIBRATION_REQUESTS, extra)
    try:
        (ps,) = build(
            [opts.workload],
            Tokenizer.from_model(model),
            num_prompts=need,
            max_tokens=opts.max_tokens,
            max_model_len=max_model_len,
            seed=opts.seed,
        )
    except WorkloadError as e:
        raise WorkloadError(
            f"{e}; this sweep sends {need} distinct prompts ({len(opts.phases)} phases (loads x --rounds) x "
            f"--num-requests {opts.num_requests}, plus {need - len(opts.phases) * opts.num_requests} for the "
            "warm-up and calibration): lower --num-requests or --rounds"
        ) from e
    dealt = deal(
        requests_from_prompts(ps.prompts),
        opts.phases,
        opts.num_requests,
        warm_up=WARMUP_REQUESTS,
        calibration=CALIBRATION_REQUESTS,
        warm_up_tokens=WARMUP_TOKENS,
        warm_up_extra=extra,
    )
    return dealt, ps.to_json()


def warm_up_requests(opts: Any) -> int:
    """Requests of the warm-up, sent at once: at least :data:`WARMUP_REQUESTS`, and as many as
    the highest concurrency level (up to ``num_requests``), so that no timed phase is the first
    to run a batch of its size (on vLLM's CPU engine a batch size met first cost one arm ~1 s
    of TTFT at concurrency 16). The ones beyond :data:`WARMUP_REQUESTS` are dealt after the
    phases' (:func:`.load.deal`), so the calibration and the phases get the same requests as
    with a small warm-up."""
    levels = [int(ph.value) for ph in opts.phases if ph.mode == "concurrency"]
    return max([WARMUP_REQUESTS] + [min(level, opts.num_requests) for level in levels])


def _max_model_len(kwargs: dict[str, Any]) -> int:
    import json

    if kwargs.get("max_model_len"):
        return int(kwargs["max_model_len"])
    cfg = json.loads((Path(kwargs["model"]) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("max_position_embeddings", 2048))


_BLOCKS = re.compile(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"')


def kv_blocks_of(metrics_text: str) -> int | None:
    """The KV blocks a server allocated, from its /metrics text (None if it does not say)."""
    m = _BLOCKS.search(metrics_text)
    return int(m.group(1)) if m else None


def sweep(paths: Sequence[str], opts: Options, say: Callable[[str], None] = print) -> dict[str, Any]:
    arms = arms_for(paths, opts.kv_blocks)
    plain = arms[0]
    model = str(plain.kwargs["model"])
    if opts.ignore_eos is None:
        # as the bench suite runs them: random weights end at random points (the kvcap shapes
        # run with ignore_eos), a trained model where it ends (the speculative cases do not)
        opts.ignore_eos = any(a.kwargs.get("load_format") == "dummy" for a in arms)
    requests, workload = build_requests(model, _max_model_len(plain.kwargs), opts)
    arrivals = {
        ph.key: poisson_arrivals(ph.value, opts.num_requests, opts.seed) for ph in opts.phases if ph.mode == "rate"
    }
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "measurement": MEASUREMENT,
        "settings": {
            "deployments": [str(p) for p in paths],
            "phases": [ph.to_json() for ph in opts.phases],
            "workload": opts.workload,
            "num_requests": opts.num_requests,
            "rounds": max((ph.round for ph in opts.phases), default=1),
            "max_tokens": opts.max_tokens,
            "ignore_eos": opts.ignore_eos,
            "seed": opts.seed,
            "kv_blocks_override": opts.kv_blocks,
            "timeout_s": opts.timeout,
        },
        "workload": workload,
        "arrivals": arrivals,
        "folder": str(opts.folder),
        "arms": [],
    }
    raw: dict[str, dict[str, list[Record]]] = {}
    for arm in arms:
        say(f"{arm.name}: starting the server ({', '.join(arm.plugins) or 'plain vLLM'})")
        out = run_arm(arm, requests, arrivals, opts, say)
        raw[arm.name] = out.pop("_records")
        result["arms"].append(out)
        if "error" in out:
            say(f"{arm.name}: {out['error'][:2000]}")
    finish(result, raw, opts)
    return result


def finish(result: dict[str, Any], raw: dict[str, dict[str, list[Record]]], opts: Options) -> None:
    """The SLO (given, or derived from plain's calibration), then each arm's phase figures, its
    ratios to plain and its greedy comparison with plain."""
    plain = result["arms"][0]
    slo = opts.slo
    if slo is None:
        alone = [Record.from_json(r) for r in plain.get("calibration", [])]
        try:
            slo = derived_slo(alone, opts.slo_factor)
        except ValueError as e:
            result["slo"] = {"error": str(e)}
            slo = None
    if slo is not None:
        result["slo"] = slo.to_json()
    plain_figures: dict[str, dict[str, Any]] = {}
    for arm in result["arms"]:
        for ph in arm.get("phases", []):
            recs = raw[arm["name"]][ph["phase"]["key"]]
            ph["figures"] = summarize(recs, slo or SLO(latency=float("inf"), source="none"), duration=ph["duration_s"])
            if slo is None:
                ph["figures"]["slo_met"], ph["figures"]["goodput_rps"] = 0, None
            if arm["name"] == "plain":
                plain_figures[ph["phase"]["key"]] = ph["figures"]
            else:
                base = plain_figures.get(ph["phase"]["key"])
                ph["vs_plain"] = vs_plain(ph["figures"], base) if base else None
                theirs = raw["plain"].get(ph["phase"]["key"])
                ph["greedy"] = compare_greedy(recs, theirs) if theirs is not None else None
    result["by_load"] = by_load(result)


def run_arm(
    arm: Arm,
    requests: Dealt,
    arrivals: dict[str, list[float]],
    opts: Options,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from ..soak.server import PREEMPTIONS, SERVED_NAME, Server, ServerError

    out: dict[str, Any] = {
        "name": arm.name,
        "deployment": arm.deployment,
        "plugins": arm.plugins,
        "lossless": arm.lossless,
        "engine": {k: v for k, v in arm.kwargs.items() if k != "additional_config"},
        "env": cap_env(arm.kwargs),
        "phases": [],
    }
    records: dict[str, list[Record]] = {}
    out["_records"] = records
    t_start = time.monotonic()
    try:
        with Server(arm.kwargs, opts.folder, arm.name, report=False, env=out["env"]) as server:
            out["start_s"] = round(time.monotonic() - t_start, 1)
            out["log"] = str(server.log_path)
            import httpx

            out["kv_blocks"] = kv_blocks_of(httpx.get(server.base + "/metrics", timeout=10).text)
            kw: dict[str, Any] = {"ignore_eos": opts.ignore_eos, "timeout": opts.timeout}
            warm = requests.warm_up
            got, _ = asyncio.run(
                closed_loop(server.base, SERVED_NAME, warm, len(warm), cache_salt="vllm-graft.servebench.warm-up", **kw)
            )
            failed = [r.error for r in got if not r.ok]
            if failed:
                raise RuntimeError(
                    f"the warm-up failed: {failed[0]}; the end of {server.log_path}:\n{server.log_tail()}"
                )
            calib = asyncio.run(
                one_at_a_time(
                    server.base,
                    SERVED_NAME,
                    requests.calibration,
                    cache_salt=f"vllm-graft.servebench.{opts.seed}.alone",
                    **kw,
                )
            )
            out["calibration"] = [r.to_json(text=False) for r in calib]
            for ph in opts.phases:
                batch = requests.phases[ph.key]
                say(f"  {arm.name}: {ph.label}, {len(batch)} requests")
                before = server.metrics().get(PREEMPTIONS, 0.0)
                salt = ph.cache_salt(opts.seed)
                if ph.mode == "rate":
                    recs, duration = asyncio.run(
                        open_loop(server.base, SERVED_NAME, batch, arrivals[ph.key], cache_salt=salt, **kw)
                    )
                else:
                    recs, duration = asyncio.run(
                        closed_loop(server.base, SERVED_NAME, batch, int(ph.value), cache_salt=salt, **kw)
                    )
                if not server.alive():
                    raise RuntimeError(
                        f"the server exited during {ph.label}; the end of {server.log_path}:\n{server.log_tail(3000)}"
                    )
                records[ph.key] = recs
                out["phases"].append(
                    {
                        "phase": {**ph.to_json(), "key": ph.key},
                        "duration_s": duration,
                        "preemptions": server.metrics().get(PREEMPTIONS, 0.0) - before,
                        "records": [r.to_json() for r in recs],
                    }
                )
                bad = [r for r in recs if not r.ok]
                if bad:
                    say(f"  {arm.name}: {len(bad)} of {len(recs)} requests failed at {ph.label}: {bad[0].error}")
    except (ServerError, RuntimeError) as e:
        out["error"] = str(e)
    return out
