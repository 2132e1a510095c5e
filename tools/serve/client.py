"""The sweep's client: streamed greedy completions against a loopback server (asyncio + httpx),
timed per request, sent open-loop (at the Poisson arrival times, whatever is in flight) or
closed-loop (a fixed number in flight). Every request ends in a :class:`~.stats.Record`: answered
(``ok``) or not, with the reason (an HTTP status, a broken stream, no answer within the timeout)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Sequence

from ..soak.driver import DONE, loopback_only, sse_events

from .load import ServeRequest
from .stats import Record


async def send(
    client: Any,
    base: str,
    model: str,
    req: ServeRequest,
    *,
    t0: float,
    scheduled: float = 0.0,
    ignore_eos: bool,
    cache_salt: str | None,
    timeout: float,
) -> Record:
    """One streamed request; times relative to ``t0`` (``time.monotonic()`` of the phase start)."""
    start = time.monotonic()
    rec = Record(req.index, ok=False, scheduled=scheduled, sent=start - t0)
    try:
        await asyncio.wait_for(_stream(client, base, model, req, rec, start, ignore_eos, cache_salt), timeout)
    except asyncio.TimeoutError:
        rec.ok, rec.error = False, f"no complete answer in {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001 - a transport failure is a failed request, with its reason
        rec.ok, rec.error = False, f"{type(e).__name__}: {e}"[:300]
    if not rec.ok:
        rec.latency = None
    return rec


async def _stream(
    client: Any,
    base: str,
    model: str,
    req: ServeRequest,
    rec: Record,
    start: float,
    ignore_eos: bool,
    cache_salt: str | None,
) -> None:
    body = req.body(model, ignore_eos=ignore_eos, cache_salt=cache_salt)
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return
        parts: list[str] = []
        done = False
        async for event in sse_events(r):
            if event is DONE:
                done = True
                break
            if "error" in event:
                rec.error = f"error event in the stream: {json.dumps(event)[:200]}"
                return
            for choice in event.get("choices") or ():
                if rec.ttft is None:
                    rec.ttft = time.monotonic() - start
                parts.append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                rec.output_tokens = int(usage["completion_tokens"])
    rec.latency = time.monotonic() - start
    rec.text = "".join(parts)
    if not done or rec.finish_reason is None or rec.ttft is None:
        rec.error = (
            f"incomplete stream: [DONE] {'seen' if done else 'missing'}, "
            f"finish reason {rec.finish_reason}, {'a' if rec.ttft is not None else 'no'} first token"
        )
        return
    if not rec.output_tokens:
        rec.error = "no usage.completion_tokens in the stream (stream_options.include_usage)"
        return
    rec.ok = True


def _client(connections: int, timeout: float, transport: Any = None) -> Any:
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    # the per-request timeout is ours (wait_for); httpx's own only bounds a silent connection
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout + 30), transport=transport)


async def open_loop(
    base: str,
    model: str,
    requests: Sequence[ServeRequest],
    arrivals: Sequence[float],
    *,
    ignore_eos: bool,
    cache_salt: str | None,
    timeout: float,
    transport: Any = None,
) -> tuple[list[Record], float]:
    """Request ``i`` sent at ``arrivals[i]`` s after the start, whatever is still in flight;
    returns the records (in request order) and the duration (start to the last end).
    ``transport``: an httpx transport in place of the network (tests)."""
    loopback_only(base)
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(arrivals)} arrival times for {len(requests)} requests")
    async with _client(len(requests) + 4, timeout, transport) as client:
        t0 = time.monotonic()
        tasks = []
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(
                    send(
                        client,
                        base,
                        model,
                        req,
                        t0=t0,
                        scheduled=at,
                        ignore_eos=ignore_eos,
                        cache_salt=cache_salt,
                        timeout=timeout,
                    )
                )
            )
        records = list(await asyncio.gather(*tasks))
        duration = time.monotonic() - t0
    return records, duration


async def closed_loop(
    base: str,
    model: str,
    requests: Sequence[ServeRequest],
    concurrency: int,
    *,
    ignore_eos: bool,
    cache_salt: str | None,
    timeout: float,
    transport: Any = None,
) -> tuple[list[Record], float]:
    """``concurrency`` workers, each sending the next unsent request as soon as its previous
    one ends; returns the records (in request order) and the duration."""
    loopback_only(base)
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency}: must be at least 1")
    queue = list(requests)[::-1]
    records: list[Record] = []
    async with _client(concurrency + 4, timeout, transport) as client:
        t0 = time.monotonic()

        async def worker() -> None:
            while queue:
                req = queue.pop()
                rec = await send(
                    client,
                    base,
                    model,
                    req,
                    t0=t0,
                    scheduled=time.monotonic() - t0,
                    ignore_eos=ignore_eos,
                    cache_salt=cache_salt,
                    timeout=timeout,
                )
                records.append(rec)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        duration = time.monotonic() - t0
    records.sort(key=lambda r: r.index)
    return records, duration


async def one_at_a_time(
    base: str, model: str, requests: Sequence[ServeRequest], *, ignore_eos: bool, cache_salt: str | None, timeout: float
) -> list[Record]:
    """Each request alone (the calibration: TTFT and TPOT with nothing else in flight)."""
    records, _ = await closed_loop(
        base, model, requests, 1, ignore_eos=ignore_eos, cache_salt=cache_salt, timeout=timeout
    )
    return records
