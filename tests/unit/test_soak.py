"""`vllm-graft soak` without a server: the request mix and ramp, each outcome of the load
generator against a fake server (httpx MockTransport), every check failing on the flaw it
watches for, and the runtime's per-request table sizes that the soak reads."""
from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from vllm_graft.hooks import Kind  # noqa: E402
from vllm_graft.integration.runtime import Runtime  # noqa: E402
from vllm_graft.tools.soak.driver import drive, loopback_only  # noqa: E402
from vllm_graft.tools.soak.run import checks, row  # noqa: E402
from vllm_graft.tools.soak.workload import (  # noqa: E402
    LEVELS,
    SHORT_LEVELS,
    Ramp,
    RequestMix,
    RequestSpec,
    iter_specs,
)

CORPUS = list(range(5000))


def test_counted_and_timed_ramp():
    ramp = Ramp(SHORT_LEVELS, requests_per_slot=2)
    levels = [ramp.level(i, 0.0) for i in range(ramp.total() + 1)]
    assert levels[:2] == [1, 1] and levels[2:6] == [2] * 4 and levels[-2] == 16 and levels[-1] is None
    assert ramp.total() == 2 * sum(SHORT_LEVELS)
    timed = Ramp(LEVELS, seconds_per_level=10)
    assert [timed.level(0, t) for t in (0, 9.9, 10, 65)] == [1, 1, 2, 64]
    assert timed.level(0, 70) is None and timed.total() is None


def test_request_mix_lengths_and_shares():
    a = [RequestMix(CORPUS, 512, seed=3).draw() for _ in range(2)]
    b = [RequestMix(CORPUS, 512, seed=3).draw() for _ in range(2)]
    assert [s.describe() for s in a] == [s.describe() for s in b] and a[0].prompt == b[0].prompt
    mix = RequestMix(CORPUS, 512, seed=1)
    specs = [mix.draw() for _ in range(1000)]
    for s in specs:
        if s.over_long:
            assert 512 < len(s.prompt) <= 512 + 32 and s.cut_after is None
        else:
            assert 3 <= len(s.prompt) and len(s.prompt) + s.max_tokens <= 512
        if s.cut_after is not None:
            assert s.stream and s.ignore_eos
        assert s.n == 1 or not s.greedy
    share = lambda pred: sum(map(pred, specs)) / len(specs)  # noqa: E731
    assert 0.02 < share(lambda s: s.over_long) < 0.09
    assert 0.10 < share(lambda s: s.cut_after is not None) < 0.20
    assert 0.5 < share(lambda s: s.greedy) < 0.7 and share(lambda s: s.n > 1) > 0.05
    assert share(lambda s: len(s.prompt) > 400 and not s.over_long) > 0.2
    with pytest.raises(ValueError, match="corpus"):
        RequestMix(CORPUS[:100], 512)


def test_the_top_level_opens_with_requests_that_outgrow_the_pool():
    """Preemption must not hang on how fast the server is: the top level's first `level`
    requests are greedy ignore_eos ones of which a quarter running together fit their prompts
    in the pool but not their last tokens, in blocks of 16 tokens and of 128 (vLLM's CPU
    engine)."""
    for block in (16, 128):
        blocks = lambda tokens: -(-tokens // block)  # noqa: E731
        for level, kv_tokens in ((16, 2560), (64, 2560), (32, 2560), (16, 3000)):
            s = RequestMix(CORPUS, 2048, seed=0).pressure(level, kv_tokens)
            k = level // 4
            assert s.greedy and s.ignore_eos and s.level == level and not s.over_long and s.cut_after is None
            pool = kv_tokens // block
            assert k * blocks(len(s.prompt)) <= pool < k * blocks(len(s.prompt) + s.max_tokens), (block, level)
            assert len(s.prompt) + s.max_tokens <= 2048
    ramp = Ramp(SHORT_LEVELS, requests_per_slot=3)
    specs = list(iter_specs(RequestMix(CORPUS, 2048, seed=0), ramp, lambda: 0.0, kv_tokens=2560))
    assert len(specs) == ramp.total() == 93 and [s.index for s in specs] == list(range(93))
    top = [s for s in specs if s.level == 16]
    pressure = [s for s in specs if s.ignore_eos and s.greedy and len(s.prompt) == 480 and s.max_tokens == 192]
    assert pressure == top[:16] and len(top) == 48
    assert [s for s in specs if s.pressure] == pressure  # marked, for a plain server's replay
    # without a pool size, the mix alone (as before)
    plain = list(iter_specs(RequestMix(CORPUS, 2048, seed=0), ramp, lambda: 0.0))
    assert sum(len(s.prompt) == 480 and s.ignore_eos and s.max_tokens == 192 for s in plain) < 3


def test_only_loopback():
    loopback_only("http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="loopback"):
        loopback_only("http://10.0.0.5:8000")


# ------------------------------------------------------------------ the driver against a fake server
def _sse(events, done=True):
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if done else "")
    return text.encode()


def _chunks(n_choices, tokens, finish=True):
    out = [{"choices": [{"index": i, "text": f"t{k}", "finish_reason": None} for i in range(n_choices)]}
           for k in range(tokens)]
    if finish:
        out.append({"choices": [{"index": i, "text": "", "finish_reason": "length"} for i in range(n_choices)]})
    return out


async def _server(request: httpx.Request) -> httpx.Response:
    """Behaviour by the prompt's first token id."""
    body = json.loads(request.content)
    case, n = body["prompt"][0], body["n"]
    if case == 0:  # a correct answer
        if body["stream"]:
            return httpx.Response(200, content=_sse(_chunks(n, 10)))
        return httpx.Response(200, json={"choices": [{"index": i, "text": "ok", "finish_reason": "length"}
                                                     for i in range(n)]})
    if case == 1:
        return httpx.Response(400, json={"error": "maximum context length"})
    if case == 2:
        return httpx.Response(500, text="internal error")
    if case == 3:  # never answers in time
        await asyncio.sleep(5)
        return httpx.Response(200, json={})
    if case == 4:  # a stream that stops without its finish reasons and [DONE]
        return httpx.Response(200, content=_sse(_chunks(n, 3, finish=False), done=False))
    if case == 5:  # fewer choices than n
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]})
    raise AssertionError(case)


def _spec(index, case, **kw):
    return RequestSpec(index=index, prompt=[case, 7, 7], max_tokens=16, level=4, **kw)


def test_every_outcome_of_the_driver():
    specs = [
        _spec(0, 0), _spec(1, 0, stream=True, n=2, temperature=0.8),
        _spec(2, 0, stream=True, cut_after=3),  # the client cuts it: aborted
        _spec(3, 1, over_long=True),  # 400 for over-long: rejected
        _spec(4, 1),  # 400 for a valid request: error
        _spec(5, 0, over_long=True),  # 200 for over-long: error
        _spec(6, 2), _spec(7, 3), _spec(8, 4, stream=True), _spec(9, 5, n=2, temperature=0.8),
        # a whole answer in fewer chunks than the cut (speculative decoding: several tokens a
        # chunk): ok; an incomplete one before its cut: error
        _spec(10, 0, stream=True, cut_after=50), _spec(11, 4, stream=True, cut_after=50),
    ]
    got = asyncio.run(drive("http://127.0.0.1:1", "m", specs, timeout=0.5,
                            transport=httpx.MockTransport(_server)))
    kinds = {s.index: o.kind for s, o in got}
    assert kinds == {0: "ok", 1: "ok", 2: "aborted", 3: "rejected", 4: "error", 5: "error", 6: "error",
                     7: "hung", 8: "error", 9: "error", 10: "ok", 11: "error"}
    outcomes = {s.index: o for s, o in got}
    assert outcomes[1].texts == ["t0t1t2t3t4t5t6t7t8t9"] * 2 and outcomes[0].texts == ["ok"]
    assert "HTTP 500" in outcomes[6].reason and "[DONE] missing" in outcomes[8].reason
    assert "1 choices for n=2" in outcomes[9].reason and "[DONE] missing" in outcomes[11].reason


def test_concurrency_never_exceeds_the_level():
    inflight, peak = 0, 0

    async def handler(request):
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.01)
        inflight -= 1
        return await _server(request)

    specs = [RequestSpec(index=i, prompt=[0], max_tokens=4, level=3) for i in range(12)]
    got = asyncio.run(drive("http://127.0.0.1:1", "m", specs, timeout=5, transport=httpx.MockTransport(handler)))
    assert [o.kind for _, o in got] == ["ok"] * 12 and peak == 3


# ------------------------------------------------------------------ the checks
GOOD = {
    "deployment": "deployments/x.yaml", "requests": 10, "kv_tokens": 2560,
    "outcomes": {"ok": 7, "rejected": 1, "aborted": 2, "hung": 0, "error": 0}, "over_long_sent": 1,
    "preemptions": 3.0, "drained": {"kv_usage": 0.0, "running": 0.0, "waiting": 0.0, "seconds_to_settle": 0.5},
    "last_request": {"kind": "ok", "reason": "", "alive": True},
    "state": {"start": {"W:spec.a": 1}, "peak": {"W:spec.a": 9, "W:spec.b": 4}, "after_drain": {"W:spec.a": 1}},
    "rss_mb": {"start": {"s": 500.0}, "mid": {"s": 600.0}, "end": {"s": 620.0}},
    "greedy": {"verdict": "yes", "compared": 5, "differ": 0, "differ_alone": 0, "plain_failed": []},
}

FLAWS = {
    "every request answered": [("outcomes", {"ok": 6, "rejected": 1, "aborted": 2, "hung": 1, "error": 0})],
    "over-long prompts refused": [("over_long_sent", 2)],
    "KV pool tight enough to preempt": [("preemptions", 0.0)],
    "KV and queues back to 0": [("drained", {"kv_usage": 0.01, "running": 0.0, "waiting": 0.0,
                                             "seconds_to_settle": 30})],
    "still serving": [("last_request", {"kind": "error", "reason": "HTTP 500", "alive": True})],
    "per-request state back to its start": [("state", {"start": {}, "peak": {"W:spec.b": 4},
                                                       "after_drain": {"W:spec.b": 2}})],
    "RSS stable over the second half": [("rss_mb", {"start": {"s": 500.0}, "mid": {"s": 600.0},
                                                    "end": {"s": 800.0}})],
    "greedy identical to plain vLLM": [("greedy", {"verdict": "no", "compared": 5, "differ": 2,
                                                   "differ_alone": 0, "plain_failed": []})],
}


def test_checks_pass_on_a_clean_run_and_the_row():
    r = copy.deepcopy(GOOD)
    got = checks(r)
    assert [c.name for c in got] == list(FLAWS) and all(c.passed for c in got)
    r["checks"], r["passed"] = [c.to_json() for c in got], True
    cells = row(r)
    assert cells["identical greedy"] == "yes (5/5)" and cells["RSS start/end MB"] == "500/620"
    assert cells["checks"] == "pass" and cells["state after drain"] == "1"


@pytest.mark.parametrize("name", list(FLAWS))
def test_each_check_fails_on_its_flaw(name):
    r = copy.deepcopy(GOOD)
    for key, value in FLAWS[name]:
        r[key] = value
    failed = [c.name for c in checks(r) if not c.passed]
    assert failed == [name]


def test_greedy_not_compared_for_lossy_or_plain():
    r = copy.deepcopy(GOOD)
    r["greedy"] = {"verdict": "n.a.", "why": "lossy plugins: w4a8"}
    assert "greedy identical to plain vLLM" not in [c.name for c in checks(r)]
    # the table says why (issue 64: only the JSON did)
    r["checks"], r["passed"] = [c.to_json() for c in checks(r)], True
    assert row(r)["identical greedy"] == "n.a. (lossy plugins: w4a8)"


def test_a_compressor_that_kept_the_pool_is_judged_by_plain_vllm_on_the_same_requests():
    # issue 64: `soak deployments/demo.yaml --short` failed at its defaults, "0 preemptions":
    # streaming holds each request to its budget, so the graft server need not run out of blocks
    r = copy.deepcopy(GOOD)
    r.update(preemptions=0.0, plugins=["kvcompress:streaming", "speculative:lookahead"],
             plain_pressure={"requests": 16, "ok": 16, "preemptions": 7.0})
    (pool,) = [c for c in checks(r) if c.name == "KV pool tight enough to preempt"]
    assert pool.passed and "kvcompress:streaming kept every request" in pool.detail
    assert "plain vLLM preempted 7 times on the same 16 pressure requests" in pool.detail
    r["checks"], r["passed"] = [c.to_json() for c in checks(r)], True
    assert row(r)["preemptions"] == "0 (plain 7)"
    r["plain_pressure"]["preemptions"] = 0.0  # plain did not preempt either: the pool was loose
    (pool,) = [c for c in checks(r) if c.name == "KV pool tight enough to preempt"]
    assert not pool.passed and "lower --kv-tokens" in pool.detail


# ------------------------------------------------------------------ per-request tables of a process
class _Progress:
    def __init__(self):
        self.inserted = {}


class _Plugin:
    def __init__(self):
        self.per_request = {}
        self.by_layer = {0: "x", 1: "y"}  # int keys: not per request
        self.progress = _Progress()  # only objects of vllm_graft modules are looked into
        self.progress.__class__.__module__ = "vllm_graft.plugins.fake"


def test_runtime_state_sizes_counts_request_keyed_tables():
    rt = Runtime()
    plugin = _Plugin()
    rt.instances[(Kind.SPECULATIVE, "fake")] = plugin
    holder = _Progress()
    rt.track_state("speculative/fake/adapter", holder)
    assert rt.state_sizes() == {}  # empty tables are left out
    plugin.per_request.update({"cmpl-1": 1, "cmpl-2": 2})
    plugin.progress.inserted["cmpl-1"] = 5
    holder.inserted["cmpl-9"] = 0
    assert rt.state_sizes() == {"speculative/fake.per_request": 2, "speculative/fake.progress.inserted": 1,
                                "speculative/fake/adapter.inserted": 1}
    plugin.per_request.clear()
    assert "speculative/fake.per_request" not in rt.state_sizes()
    rt.reset()
    assert rt.state_sizes() == {}


def test_unseeded_mix_and_stop_if():
    specs = [RequestMix(CORPUS, 512, seed=1, seeded=False).draw() for _ in range(300)]
    assert not [s for s in specs if s.seed is not None] and [s for s in specs if not s.greedy]
    assert [s for s in (RequestMix(CORPUS, 512, seed=1).draw() for _ in range(300)) if s.seed is not None]
    sent = []

    async def handler(request):
        sent.append(1)
        return await _server(request)

    specs = [RequestSpec(index=i, prompt=[0], max_tokens=4, level=1) for i in range(10)]
    got = asyncio.run(drive("http://127.0.0.1:1", "m", specs, timeout=5, transport=httpx.MockTransport(handler),
                            stop_if=lambda: "the server exited" if len(sent) >= 4 else None))
    assert len(got) == len(sent) == 4


def test_a_server_named_by_a_deployment_path_keeps_its_files_in_its_folder(tmp_path):
    # servebench names a second plain-named arm by its path ("deployments/plain.yaml"), which made
    # the log path a missing subfolder (FileNotFoundError at the server's start)
    from vllm_graft.tools.soak.server import Server

    s = Server({"model": "m"}, tmp_path, "deployments/plain.yaml")
    assert s.log_path.parent == tmp_path and Path(s.report_dir).parent == tmp_path
    assert s.log_path.name == "deployments_plain.yaml-server.log"
