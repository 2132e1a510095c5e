"""One soak run of a deployment: the server under the ramp, the drain, the checks.

Order: start the deployment's server (KV pool capped at ``kv_tokens``), one warm-up request,
then the start figures (RSS, per-request state, preemption counter); the ramp
(:mod:`.workload`) while a sampler reads RSS and per-request state every
:data:`SAMPLE_EVERY_S`; the drain (every request answered); vLLM's gauges until they read 0 or
:data:`DRAIN_WAIT_S` passed; the per-request state once the reports have settled; the end RSS;
a last request. For a lossless deployment a plain server (the deployment's plain twin,
same KV cap) then answers every greedy request that completed, at the same concurrency as
the drain's top level at most 8, and each greedy text is compared; a differing one is sent
again alone to both servers, and the result says whether it still differs then.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...launch.reports import REPORT_QUIET_PERIODS
from ...integration.runtime import REPORT_EVERY_S

from .driver import EXPECTED, Outcome, drive, run_request
from .server import KV_USAGE, PREEMPTIONS, RUNNING, SERVED_NAME, WAITING, Server, kv_bytes_per_token
from .workload import CPU_SEED_BUG, LEVELS, SHORT_LEVELS, Ramp, RequestMix, RequestSpec, corpus_ids, iter_specs

SAMPLE_EVERY_S = 2.0
DRAIN_WAIT_S = 30.0
STATE_SETTLE_S = 10.0
#: how long no report may have been rewritten before its state counts as current: the period
#: `vllm-graft report` waits (each process rewrites within REPORT_EVERY_S of a change)
REPORT_QUIET_S = REPORT_QUIET_PERIODS * REPORT_EVERY_S
#: RSS may grow this much over the second half of the run (allocator pools, caches filling)
RSS_SLACK_MB, RSS_SLACK_FRACTION = 64.0, 0.10
COMPARE_CONCURRENCY = 8


@dataclass
class Options:
    minutes: float | None = None  # a timed ramp; None: the counted ramp
    short: bool = False
    seed: int = 0
    kv_tokens: int | None = None  # None: 1.25 x max_model_len
    timeout: float = 300.0  # per request; past it a request counts as hung
    compare: bool = True
    seeds: bool | None = None  # None: on, except on vLLM's CPU engine (workload.CPU_SEED_BUG)
    folder: Path = field(default_factory=lambda: Path("."))


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def soak(path: str, opts: Options, say: Callable[[str], None] = print) -> dict[str, Any]:
    from ...launch.engine import llm_kwargs
    from ...integration.plan import plan_for

    plan = plan_for(path)
    kwargs = llm_kwargs(plan, graft=True)
    plain_kwargs = llm_kwargs(plan, graft=False)
    model = str(kwargs["model"])
    max_model_len = int(kwargs.get("max_model_len") or _config(model).get("max_position_embeddings", 2048))
    kv_tokens = opts.kv_tokens or max_model_len * 5 // 4
    if kv_tokens < max_model_len:
        raise ValueError(
            f"--kv-tokens {kv_tokens} is below max_model_len={max_model_len}: vLLM refuses a "
            "KV pool that cannot hold one request of max_model_len; give at least that"
        )
    kv_bytes = kv_tokens * kv_bytes_per_token(model, kwargs.get("dtype"))
    for kw in (kwargs, plain_kwargs):
        kw["kv_cache_memory_bytes"] = kv_bytes
    lossless = bool(plan.enabled) and all(e.entry.registration.capabilities.lossless for e in plan.enabled)
    levels = SHORT_LEVELS if opts.short else LEVELS
    ramp = Ramp(levels, seconds_per_level=None if opts.minutes is None else opts.minutes * 60 / len(levels))

    from ..workloads import Tokenizer

    tokenizer = Tokenizer.from_model(model)
    seeded = opts.seeds if opts.seeds is not None else plan.platform != "cpu"
    if not seeded and opts.seeds is None:
        say(f"note: sampled requests are sent without a seed (--seeds sends them): {CPU_SEED_BUG}")
    mix = RequestMix(corpus_ids(tokenizer, seed=opts.seed), max_model_len, seed=opts.seed, seeded=seeded)
    name = Path(path).stem
    folder = opts.folder / name
    folder.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "deployment": str(path),
        "plugins": [f"{e.kind}:{e.name}" for e in plan.enabled],
        "lossless": lossless,
        "max_model_len": max_model_len,
        "kv_tokens": kv_tokens,
        "kv_cache_memory_bytes": kv_bytes,
        "ramp": ramp.describe(),
        "seed": opts.seed,
        "seeded_requests": seeded,
        "folder": str(folder),
    }
    say(
        f"{name}: starting the server ({', '.join(result['plugins']) or 'no plugins'}; KV pool "
        f"{kv_tokens} tokens = {kv_bytes} bytes); logs in {folder}"
    )
    with Server(kwargs, folder, "graft") as server:
        asyncio.run(_graft_run(server, mix, ramp, opts, result, say))
        sent = result.pop("_results")
        greedy = [(s, o) for s, o in sent if s.greedy and o.kind == "ok"]
        pressure = [s for s, _ in sent if s.pressure]
        if not plan.enabled:
            result["greedy"] = {"verdict": "n.a.", "why": "no plugins: the deployment is plain vLLM"}
        elif not lossless:
            result["greedy"] = {
                "verdict": "n.a.",
                "why": "lossy plugins: "
                + ", ".join(e.name for e in plan.enabled if not e.entry.registration.capabilities.lossless),
            }
        elif not opts.compare:
            result["greedy"] = {"verdict": "n.a.", "why": "--no-compare"}
        # a KV compressor holds each request to its budget, so the graft server may never run out
        # of blocks (its point); whether the pool was tight is then plain vLLM's to show
        pool_on_plain = result["preemptions"] == 0 and bool(plan.by_kind("kvcompress"))
        compare = "greedy" not in result
        if pool_on_plain or compare:
            why = " and ".join(
                ([f"replay the {len(pressure)} pressure requests"] if pool_on_plain else [])
                + ([f"compare {len(greedy)} greedy completions"] if compare else [])
            )
            say(f"{name}: starting a plain server (same KV pool) to {why}")
            with Server(plain_kwargs, folder, "plain", report=False) as plain:
                if pool_on_plain:
                    result["plain_pressure"] = asyncio.run(_preemptions(plain, pressure, opts.timeout))
                if compare:
                    result["greedy"] = asyncio.run(_compare(server, plain, greedy, opts.timeout))
    result["checks"] = [c.to_json() for c in checks(result)]
    result["passed"] = all(c["passed"] for c in result["checks"])
    return result


def _config(model: str) -> dict[str, Any]:
    import json

    return json.loads((Path(model) / "config.json").read_text())


def _rss_total(rss: dict[str, float]) -> float:
    return round(sum(rss.values()), 1)


async def _graft_run(
    server: Server, mix: RequestMix, ramp: Ramp, opts: Options, result: dict[str, Any], say: Callable[[str], None]
) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=opts.timeout) as client:
        warm = await run_request(client, server.base, _plain_greedy(mix, 10_000_000), SERVED_NAME, opts.timeout)
    if warm.kind != "ok":
        raise RuntimeError(
            f"the warm-up request failed: {warm.reason}; the end of {server.log_path}:\n{server.log_tail()}"
        )
    await asyncio.sleep(REPORT_QUIET_S + 0.5)  # the reporter rewrites within 1 s of a change
    start: dict[str, Any] = {"rss_mb": server.rss_mb(), "state": server.state_sizes(), "metrics": server.metrics()}
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 1),
                    "rss_mb": await asyncio.to_thread(server.rss_mb),
                    "state": await asyncio.to_thread(server.state_sizes),
                }
            )
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
            except asyncio.TimeoutError:
                pass

    done = {"n": 0}

    def progress(spec: RequestSpec, outcome: Outcome) -> None:
        done["n"] += 1
        if outcome.kind not in EXPECTED:
            say(f"  request {spec.index} ({spec.describe()}): {outcome.kind}: {outcome.reason}")
        if done["n"] % 50 == 0:
            say(f"  {done['n']} requests answered ({time.monotonic() - t0:.0f} s)")

    say(f"  ramp: {ramp.describe()}")
    task = asyncio.create_task(sampler())

    def dead() -> str | None:
        if server.alive():
            return None
        return f"the server exited ({server.proc.returncode if server.proc is not None else 'never started'})"

    results = await drive(
        server.base,
        SERVED_NAME,
        iter_specs(mix, ramp, lambda: time.monotonic() - t0, result["kv_tokens"]),
        timeout=opts.timeout,
        on_done=progress,
        stop_if=dead,
    )
    if dead():
        raise RuntimeError(
            f"{dead()} during the load, after {len(results)} requests; the end of "
            f"{server.log_path}:\n{server.log_tail(3000)}"
        )
    load_s = time.monotonic() - t0
    drained = await _drain(server)
    state = await _settle_state(server, start["state"])
    stop.set()
    await task
    end_rss = server.rss_mb()
    async with httpx.AsyncClient(timeout=opts.timeout) as client:
        last = await run_request(client, server.base, _plain_greedy(mix, 10_000_001), SERVED_NAME, opts.timeout)
    metrics = server.metrics()
    kinds = {k: 0 for k in ("ok", "rejected", "aborted", "hung", "error")}
    for _, o in results:
        kinds[o.kind] += 1
    result["load_seconds"] = round(load_s, 1)
    result.update(_requests_summary(results, kinds))
    result.update(
        {
            "preemptions": metrics.get(PREEMPTIONS, 0) - start["metrics"].get(PREEMPTIONS, 0),
            "drained": drained,
            "rss_mb": _rss_summary(samples, start["rss_mb"], end_rss, load_s),
            "state": {"start": start["state"], "peak": _peak_state(samples), "after_drain": state},
            "last_request": {"kind": last.kind, "reason": last.reason, "alive": server.alive()},
            "_results": results,
        }
    )
    if kinds["hung"] or kinds["error"]:
        say(f"  the end of {server.log_path}:\n{server.log_tail(2000)}")


async def _drain(server: Server) -> dict[str, Any]:
    """Every request has its outcome; wait (up to DRAIN_WAIT_S) for vLLM's own gauges to settle."""
    deadline = time.monotonic() + DRAIN_WAIT_S
    while True:
        m = await asyncio.to_thread(server.metrics)
        if (
            m.get(KV_USAGE, 1) == 0 and m.get(RUNNING, 1) == 0 and m.get(WAITING, 1) == 0
        ) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return {
        "kv_usage": m.get(KV_USAGE),
        "running": m.get(RUNNING),
        "waiting": m.get(WAITING),
        "seconds_to_settle": round(DRAIN_WAIT_S - (deadline - time.monotonic()), 1),
    }


async def _settle_state(server: Server, start: dict[str, int]) -> dict[str, int]:
    """The per-request state after the drain. Each process rewrites its report within 1 s of a
    change, so a change just before this point may be in no file yet: quiet both since the last
    write and since here (up to STATE_SETTLE_S)."""
    settle_from = time.monotonic()
    settle = settle_from + STATE_SETTLE_S
    while True:
        state = await asyncio.to_thread(server.state_sizes)
        grown = {k: v for k, v in state.items() if v > start.get(k, 0)}
        quiet = min(time.time() - server.reports_written_at(), time.monotonic() - settle_from) > REPORT_QUIET_S
        if (not grown and quiet) or time.monotonic() > settle:
            return state
        await asyncio.sleep(0.5)


def _requests_summary(results: list[tuple[RequestSpec, Outcome]], kinds: dict[str, int]) -> dict[str, Any]:
    return {
        "requests": len(results),
        "outcomes": kinds,
        "over_long_sent": sum(1 for s, _ in results if s.over_long),
        "cut_sent": sum(1 for s, _ in results if s.cut_after is not None),
        "greedy_sent": sum(1 for s, _ in results if s.greedy),
        "n_gt_1_sent": sum(1 for s, _ in results if s.n > 1),
        "failures": [
            {"request": s.describe(), "outcome": o.kind, "reason": o.reason}
            for s, o in results
            if o.kind not in EXPECTED
        ][:50],
    }


def _rss_summary(samples: list[dict[str, Any]], start: Any, end: Any, load_s: float) -> dict[str, Any]:
    mid = [s for s in samples if s["t"] >= load_s / 2]
    return {
        "start": start,
        "mid": mid[0]["rss_mb"] if mid else start,
        "end": end,
        "max_total": max((_rss_total(s["rss_mb"]) for s in samples), default=None),
    }


def _peak_state(samples: list[dict[str, Any]]) -> dict[str, int]:
    peak: dict[str, int] = {}
    for s in samples:
        for k, v in s["state"].items():
            peak[k] = max(peak.get(k, 0), v)
    return peak


def _plain_greedy(mix: RequestMix, index: int) -> RequestSpec:
    return RequestSpec(index=index, prompt=list(mix.corpus[:40]), max_tokens=8)


async def _preemptions(server: Server, specs: list[RequestSpec], timeout: float) -> dict[str, Any]:
    """vLLM's preemptions while ``server`` answers ``specs`` (at their own concurrency)."""
    before = (await asyncio.to_thread(server.metrics)).get(PREEMPTIONS, 0)
    done = await drive(server.base, SERVED_NAME, specs, timeout=timeout)
    after = (await asyncio.to_thread(server.metrics)).get(PREEMPTIONS, 0)
    return {"requests": len(specs), "ok": sum(1 for _, o in done if o.kind == "ok"), "preemptions": after - before}


async def _compare(
    graft: Server, plain: Server, greedy: list[tuple[RequestSpec, Outcome]], timeout: float
) -> dict[str, Any]:
    """Every greedy completion of the graft server against the plain server's on the same request."""
    replay = []
    for spec, _ in greedy:
        again = RequestSpec(**{**spec.__dict__, "level": COMPARE_CONCURRENCY, "stream": False, "cut_after": None})
        replay.append(again)
    plain_out = dict((s.index, o) for s, o in await drive(plain.base, SERVED_NAME, replay, timeout=timeout))
    differ, failed = [], []
    for spec, got in greedy:
        want = plain_out[spec.index]
        if want.kind != "ok":
            failed.append({"request": spec.index, "reason": want.reason})
        elif want.texts != got.texts:
            differ.append(spec)
    alone = []
    if differ:  # again, one at a time on each server: batch composition out of the picture
        import httpx

        async with httpx.AsyncClient(timeout=timeout) as client:
            for spec in differ:
                a = await run_request(client, graft.base, spec, SERVED_NAME, timeout)
                b = await run_request(client, plain.base, spec, SERVED_NAME, timeout)
                alone.append(
                    {
                        "request": spec.describe(),
                        "differs_alone": a.texts != b.texts,
                        "graft": a.texts,
                        "plain": b.texts,
                    }
                )
    verdict = "yes" if not differ and not failed else "no"
    return {
        "verdict": verdict,
        "compared": len(greedy),
        "differ": len(differ),
        "differ_alone": sum(1 for d in alone if d["differs_alone"]),
        "plain_failed": failed[:20],
        "details": alone[:20],
    }


def checks(r: dict[str, Any]) -> list[Check]:
    o = r["outcomes"]
    out = [
        Check(
            "every request answered",
            o["hung"] == 0 and o["error"] == 0 and sum(o.values()) == r["requests"],
            f"{o['ok']} ok, {o['rejected']} over-long 400, {o['aborted']} client aborts, {o['hung']} hung, "
            f"{o['error']} errors of {r['requests']}",
        ),
        Check(
            "over-long prompts refused",
            o["rejected"] == r["over_long_sent"],
            f"{o['rejected']} HTTP 400 of {r['over_long_sent']} over max_model_len",
        ),
        _pool_check(r),
        Check(
            "KV and queues back to 0",
            r["drained"]["kv_usage"] == 0 and r["drained"]["running"] == 0 and r["drained"]["waiting"] == 0,
            f"kv_cache_usage_perc={r['drained']['kv_usage']}, running={r['drained']['running']}, "
            f"waiting={r['drained']['waiting']} ({r['drained']['seconds_to_settle']} s after the drain)",
        ),
        Check(
            "still serving",
            r["last_request"]["kind"] == "ok" and r["last_request"]["alive"],
            "a last request after the drain: "
            + (r["last_request"]["kind"] + " " + r["last_request"]["reason"]).strip(),
        ),
    ]
    grown = {
        k: (r["state"]["start"].get(k, 0), v)
        for k, v in r["state"]["after_drain"].items()
        if v > r["state"]["start"].get(k, 0)
    }
    peak = sum(r["state"]["peak"].values())
    out.append(
        Check(
            "per-request state back to its start",
            not grown,
            (
                f"grown: {grown}"
                if grown
                else f"every request-keyed table back to its start (peak {peak} entries summed over "
                f"{len(r['state']['peak'])} tables)"
            ),
        )
    )
    mid, end = _rss_total(r["rss_mb"]["mid"]), _rss_total(r["rss_mb"]["end"])
    allowed = RSS_SLACK_MB + RSS_SLACK_FRACTION * mid
    out.append(
        Check(
            "RSS stable over the second half",
            end - mid <= allowed,
            f"{_rss_total(r['rss_mb']['start'])} MB at start, {mid} MB mid-run, {end} MB at the end "
            f"(allowed growth over the second half {allowed:.0f} MB)",
        )
    )
    g = r["greedy"]
    if g["verdict"] != "n.a.":
        out.append(
            Check(
                "greedy identical to plain vLLM",
                g["verdict"] == "yes",
                f"{g['compared'] - g['differ']}/{g['compared']} identical"
                + (f"; {g['differ_alone']} still differ sent alone" if g["differ"] else "")
                + (f"; {len(g['plain_failed'])} failed on the plain server" if g["plain_failed"] else ""),
            )
        )
    return out


def _pool_check(r: dict[str, Any]) -> Check:
    """The KV pool was too small for the load: the deployment's server preempted, or (a KV
    compressor that kept every request within its budget) plain vLLM did on the same pressure
    requests with the same pool."""
    name, pool = "KV pool tight enough to preempt", f"a {r['kv_tokens']}-token KV pool"
    if r["preemptions"] > 0:
        return Check(name, True, f"{r['preemptions']:.0f} preemptions with {pool}")
    plain = r.get("plain_pressure")
    if plain is None:
        return Check(name, False, f"0 preemptions with {pool}: the pool was not tight enough, lower --kv-tokens")
    kept = ", ".join(p for p in r.get("plugins", ()) if p.startswith("kvcompress:")) or "the deployment"
    if plain["preemptions"] > 0:
        return Check(
            name,
            True,
            f"0 preemptions with {pool}: {kept} kept every request within it; plain vLLM preempted "
            f"{plain['preemptions']:.0f} times on the same {plain['requests']} pressure requests",
        )
    return Check(
        name,
        False,
        f"0 preemptions with {pool}, and plain vLLM did not preempt on the {plain['requests']} pressure "
        "requests either: the pool was not tight enough, lower --kv-tokens",
    )


def row(r: dict[str, Any]) -> dict[str, str]:
    """The BENCHMARKS.md table row of one run."""
    o = r["outcomes"]
    d = r["drained"]
    g = r["greedy"]
    greedy = (
        f"n.a. ({g['why']})"
        if g["verdict"] == "n.a."
        else (f"{g['verdict']} ({g['compared'] - g['differ']}/{g['compared']})")
    )
    return {
        "deployment": Path(r["deployment"]).name,
        "requests": str(r["requests"]),
        "aborts": str(o["aborted"]),
        "over-long 400": str(o["rejected"]),
        "preemptions": f"{r['preemptions']:.0f}"
        + (f" (plain {r['plain_pressure']['preemptions']:.0f})" if r.get("plain_pressure") else ""),
        "errors": str(o["error"] + o["hung"]),
        "KV after drain": f"{d['kv_usage']:g} (run {d['running']:g}, wait {d['waiting']:g})",
        "state after drain": str(sum(r["state"]["after_drain"].values())),
        "RSS start/end MB": f"{_rss_total(r['rss_mb']['start']):.0f}/{_rss_total(r['rss_mb']['end']):.0f}",
        "identical greedy": greedy,
        "checks": "pass" if r["passed"] else "FAIL: " + ", ".join(c["name"] for c in r["checks"] if not c["passed"]),
    }
