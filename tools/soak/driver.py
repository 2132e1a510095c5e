"""The soak's load generator: asyncio + httpx against a loopback server, bounded by the ramp.

Every request ends in exactly one outcome:

* ``ok``: HTTP 200 with ``n`` choices, each with a finish reason (a stream: each choice's
  finish reason and the final ``[DONE]``);
* ``rejected``: HTTP 400 for a prompt over ``max_model_len`` (expected);
* ``aborted``: the client closed the stream after ``cut_after`` chunks (expected; a stream that
  ends complete before its cut is ``ok``);
* ``hung``: no complete answer within the per-request timeout;
* ``error``: anything else (another status, a 400 for a valid request, a 200 for an over-long
  one, a broken or incomplete body, a refused connection), with the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

from .workload import RequestSpec

EXPECTED = ("ok", "rejected", "aborted")


@dataclass
class Outcome:
    index: int
    kind: str  # ok, rejected, aborted, hung, error
    texts: list[str] = field(default_factory=list)  # per choice index (ok only)
    reason: str = ""
    seconds: float = 0.0


#: what :func:`sse_events` yields at the stream's ``[DONE]`` (a stream cut short never yields it)
DONE: dict[str, Any] = {}


async def sse_events(response: Any) -> Any:
    """The JSON events of an OpenAI-style server-sent stream (``data: {...}`` lines), then
    :data:`DONE` at its ``[DONE]`` line."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            yield DONE
            return
        yield json.loads(data)


def loopback_only(base: str) -> None:
    """Refuse any server address but loopback: the soak is a load generator."""
    host = urlsplit(base).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the soak drives only a server on loopback (127.0.0.1), not {base!r}")


async def run_request(client: Any, base: str, spec: RequestSpec, model: str, timeout: float) -> Outcome:
    start = time.monotonic()
    try:
        out = await asyncio.wait_for(_send(client, base, spec, model), timeout)
    except asyncio.TimeoutError:
        out = Outcome(spec.index, "hung", reason=f"no complete answer in {timeout:.0f} s")
    except Exception as e:  # noqa: BLE001 - any transport failure is an error outcome, with its reason
        out = Outcome(spec.index, "error", reason=f"{type(e).__name__}: {e}"[:300])
    out.seconds = time.monotonic() - start
    return out


async def _send(client: Any, base: str, spec: RequestSpec, model: str) -> Outcome:
    url = base + "/v1/completions"
    if not spec.stream:
        r = await client.post(url, json=spec.body(model))
        return _classify_status(spec, r.status_code, r.text) or _complete(spec, r.json())
    async with client.stream("POST", url, json=spec.body(model)) as r:
        if r.status_code != 200:
            failed = _classify_status(spec, r.status_code, (await r.aread()).decode(errors="replace"))
            assert failed is not None  # None only for HTTP 200
            return failed
        if spec.over_long:
            return Outcome(spec.index, "error", reason="HTTP 200 for a prompt over max_model_len")
        texts: dict[int, list[str]] = {}
        finished: dict[int, str] = {}
        chunks, done = 0, False
        async for event in sse_events(r):
            if event is DONE:
                done = True
                break
            if "error" in event:
                return Outcome(spec.index, "error", reason=f"error event in the stream: {json.dumps(event)[:200]}")
            for choice in event.get("choices", ()):
                texts.setdefault(choice["index"], []).append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    finished[choice["index"]] = choice["finish_reason"]
            chunks += 1
            if spec.cut_after is not None and chunks >= spec.cut_after:
                return Outcome(spec.index, "aborted")  # leaving the block closes the connection
    # A stream that ended before its cut is a whole answer sent in fewer chunks than the cut:
    # speculative decoding emits several tokens per chunk (24 tokens in 7 chunks, in the 30-minute
    # soak of demo.yaml); it must then be complete like any other.
    if not done or sorted(finished) != list(range(spec.n)):
        return Outcome(
            spec.index,
            "error",
            reason=f"incomplete stream: [DONE] {'seen' if done else 'missing'}, "
            f"finish reasons for choices {sorted(finished)} of {spec.n}",
        )
    return Outcome(spec.index, "ok", texts=["".join(texts.get(i, ())) for i in range(spec.n)])


def _classify_status(spec: RequestSpec, status: int, text: str) -> Outcome | None:
    if status == 200:
        if spec.over_long:
            return Outcome(spec.index, "error", reason="HTTP 200 for a prompt over max_model_len")
        return None
    if status == 400 and spec.over_long:
        return Outcome(spec.index, "rejected")
    return Outcome(spec.index, "error", reason=f"HTTP {status}: {text[:200]}")


def _complete(spec: RequestSpec, body: dict[str, Any]) -> Outcome:
    choices = sorted(body.get("choices", ()), key=lambda c: c.get("index", 0))
    if len(choices) != spec.n or any(not c.get("finish_reason") for c in choices):
        return Outcome(
            spec.index,
            "error",
            reason=f"{len(choices)} choices for n={spec.n}, finish reasons {[c.get('finish_reason') for c in choices]}",
        )
    return Outcome(spec.index, "ok", texts=[c.get("text") or "" for c in choices])


async def drive(
    base: str,
    model: str,
    specs: Iterable[RequestSpec],
    *,
    timeout: float,
    on_done: Callable[[RequestSpec, Outcome], None] | None = None,
    max_connections: int = 128,
    transport: Any = None,
    stop_if: Callable[[], str | None] | None = None,
) -> list[tuple[RequestSpec, Outcome]]:
    """Send ``specs`` keeping at most ``spec.level`` requests in flight (the level of the next
    spec), wait for every one of them, and return each with its outcome, in start order.
    ``transport``: an httpx transport in place of the network (tests). ``stop_if``: asked before
    each request; a reason (e.g. the server exited) stops sending, the ones in flight finish."""
    import httpx

    loopback_only(base)
    results: list[tuple[RequestSpec, Outcome]] = []
    inflight: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # the per-request timeout is ours (wait_for); httpx's own only bounds a silent connection
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout + 30), transport=transport) as client:

        async def one(spec: RequestSpec) -> None:
            outcome = await run_request(client, base, spec, model, timeout)
            results.append((spec, outcome))
            if on_done is not None:
                on_done(spec, outcome)

        for spec in specs:
            while len(inflight) >= spec.level:
                _, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            if stop_if is not None and stop_if():
                break
            inflight.add(asyncio.create_task(one(spec)))
        if inflight:
            await asyncio.wait(inflight)
    results.sort(key=lambda r: r[0].index)
    return results
