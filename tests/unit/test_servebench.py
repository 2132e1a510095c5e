"""`vllm-graft servebench` without a server: the seeded schedule, the requests, the SLO
classification, the goodput and ratio arithmetic, the greedy comparison, the table, the
client against a fake streaming server (httpx MockTransport), the KV cap and the command line."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from vllm_graft.cli.main import build_parser  # noqa: E402
from vllm_graft.tools.serve import options  # noqa: E402
from vllm_graft.tools.serve.client import closed_loop, open_loop  # noqa: E402
from vllm_graft.tools.serve.load import (  # noqa: E402
    Phase,
    ServeRequest,
    deal,
    parse_list,
    phases,
    poisson_arrivals,
    prompts_needed,
)
from vllm_graft.tools.serve.run import Options, arms_for, cap_env, finish, kv_blocks_of  # noqa: E402
from vllm_graft.tools.serve.stats import (  # noqa: E402
    SLO,
    Record,
    cells,
    compare_greedy,
    derived_slo,
    markdown,
    rows,
    summarize,
    summary_lines,
    vs_plain,
)

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the schedule
def test_same_seed_same_arrivals_other_seed_or_rate_other_arrivals():
    a = poisson_arrivals(0.5, 50, seed=0)
    assert a == poisson_arrivals(0.5, 50, seed=0)  # every arm gets these times
    assert a != poisson_arrivals(0.5, 50, seed=1)
    assert a != poisson_arrivals(1.0, 50, seed=0)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    assert poisson_arrivals(0.5, 20, seed=0) == a[:20]  # a prefix: n does not reseed


@pytest.mark.parametrize("rate", [0.25, 1.0, 8.0])
def test_poisson_gaps_have_mean_one_over_rate(rate):
    a = poisson_arrivals(rate, 4001, seed=3)
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean * rate - 1) < 0.06  # 4000 exponential gaps: the mean's sd is 1.6%
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert abs(var**0.5 * rate - 1) < 0.1  # exponential: sd = mean (a fixed gap would fail)


def test_rates_and_levels_parse_and_refuse():
    assert parse_list("0.25, 0.5,1") == [0.25, 0.5, 1.0]
    assert parse_list("16,64", integer=True) == [16.0, 64.0]
    for bad in ("0", "-1", "0.5,0.5", "", "x", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_list(bad)
    with pytest.raises(ValueError):
        parse_list("1.5", integer=True)
    ph = phases([0.5, 1], [16])
    assert [p.label for p in ph] == ["0.5 req/s", "1 req/s", "concurrency 16"]
    salts = [p.cache_salt(0) for p in ph]
    assert len(set(salts)) == 3 and salts == [p.cache_salt(0) for p in phases([0.5, 1], [16])]
    # vLLM refuses a salt over 128 characters or with '@', '/', '\\'
    assert all(len(s) <= 128 and not set(s) & set("@/\\") for s in salts)
    # rounds: every load again, after all of the round before, each with a salt and a key of its own
    r = phases([0.5], [16], rounds=3)
    assert [(p.load, p.round) for p in r] == [("0.5 req/s", 1), ("concurrency 16", 1), ("0.5 req/s", 2),
                                             ("concurrency 16", 2), ("0.5 req/s", 3), ("concurrency 16", 3)]
    assert r[:2] == phases([0.5], [16]) and r[3].label == "concurrency 16, round 2"
    r_salts = [p.cache_salt(0) for p in r]
    assert len(set(r_salts)) == len({p.key for p in r}) == 6
    assert all(len(s) <= 128 and not set(s) & set("@/\\") for s in r_salts)
    with pytest.raises(ValueError, match="--rounds"):
        phases([0.5], rounds=0)


def test_prompts_are_dealt_out_once_each():
    ph = phases([0.5, 1], [4])
    need = prompts_needed(3, len(ph), warm_up=2, calibration=1)
    assert need == 12
    reqs = [ServeRequest(i, (100 + i,), 10 + i) for i in range(need)]
    d = deal(reqs, ph, 3, warm_up=2, calibration=1, warm_up_tokens=4)
    assert [r.prompt for r in d.warm_up] == [(100,), (101,)] and [r.max_tokens for r in d.warm_up] == [4, 4]
    assert [(r.index, r.prompt, r.max_tokens) for r in d.calibration] == [(0, (102,), 12)]
    assert [[r.prompt[0] for r in d.phases[p.key]] for p in ph] == [[103, 104, 105], [106, 107, 108],
                                                                    [109, 110, 111]]
    assert all([r.index for r in d.phases[p.key]] == [0, 1, 2] for p in ph)
    # the same seed's prompts deal the same way: every arm gets the same requests
    assert deal(reqs, ph, 3, warm_up=2, calibration=1, warm_up_tokens=4) == d
    with pytest.raises(ValueError):
        deal(reqs[:-1], ph, 3, warm_up=2, calibration=1, warm_up_tokens=4)
    # a larger warm-up takes its extra requests after the phases': the others stay as they were
    more = [ServeRequest(i, (100 + i,), 10 + i) for i in range(need + 3)]
    d3 = deal(more, ph, 3, warm_up=2, calibration=1, warm_up_tokens=4, warm_up_extra=3)
    assert d3.calibration == d.calibration and d3.phases == d.phases
    assert [r.prompt[0] for r in d3.warm_up] == [100, 101, 112, 113, 114] and [r.index for r in d3.warm_up] == [
        0, 1, 2, 3, 4]


def test_request_body_is_a_streamed_greedy_completion_with_usage():
    b = ServeRequest(3, (5, 6, 7), 9).body("m", ignore_eos=True, cache_salt="s")
    assert b == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_salt": "s"}
    assert "cache_salt" not in ServeRequest(0, (1,), 1).body("m", ignore_eos=False, cache_salt=None)


# ----------------------------------------------------------------------------- SLO and goodput
def rec(i, ttft, latency, tokens, ok=True, sent=0.0, text="t"):
    return Record(i, ok, "" if ok else "boom", sent, sent, ttft if ok else None, latency if ok else None,
                  tokens if ok else 0, text)


def test_tpot_arithmetic():
    assert rec(0, 1.0, 3.0, 5).tpot == pytest.approx(0.5)  # (3 - 1) / (5 - 1)
    assert rec(0, 1.0, 1.0, 1).tpot is None  # one token: no TPOT
    assert rec(0, 1.0, 3.0, 5, ok=False).tpot is None


def test_slo_classification():
    slo = SLO(ttft=1.0, tpot=0.5)
    assert slo.met(rec(0, 1.0, 3.0, 5))  # at the limits: met
    assert not slo.met(rec(0, 1.01, 3.0, 5))  # TTFT over
    assert not slo.met(rec(0, 1.0, 3.1, 5))  # TPOT 0.525 over
    assert slo.met(rec(0, 0.5, 0.5, 1))  # no TPOT for one token: the TPOT limit holds
    assert not slo.met(rec(0, 0.1, 0.2, 5, ok=False))  # a failed request never meets it
    assert SLO(latency=2.0).met(rec(0, 1.9, 2.0, 50)) and not SLO(latency=2.0).met(rec(0, 0.1, 2.01, 2))
    for bad in ({}, {"ttft": 0}, {"tpot": -1.0}):
        with pytest.raises(ValueError):
            SLO(**bad)
    assert SLO(ttft=0.5, tpot=0.02, latency=3).describe() == "TTFT <= 0.5 s, TPOT <= 20 ms, latency <= 3 s"


def test_summary_goodput_and_throughput():
    records = [rec(0, 0.2, 1.0, 10, sent=0.0), rec(1, 0.4, 2.0, 10, sent=1.0), rec(2, 3.0, 4.0, 10, sent=2.0),
               rec(3, 0, 0, 0, ok=False, sent=3.0)]
    s = summarize(records, SLO(ttft=1.0), duration=8.0)
    assert (s["requests"], s["ok"], s["failed"], s["slo_met"]) == (4, 3, 1, 2)
    assert s["goodput_rps"] == pytest.approx(2 / 8) and s["throughput_tok_s"] == pytest.approx(30 / 8)
    assert s["request_rate"] == pytest.approx(3 / 8)
    assert s["ttft_s"]["p50"] == pytest.approx(0.4) and s["latency_s"]["p90"] == pytest.approx(3.6)
    assert s["errors"] == ["boom"]
    # without a duration: the latest end (request 2: sent at 2, 4 s)
    assert summarize(records, SLO(ttft=1.0))["duration_s"] == pytest.approx(6.0)


def test_derived_slo_and_ratios():
    slo = derived_slo([rec(0, 0.1, 1.1, 11), rec(1, 0.3, 2.3, 11)], factor=5)
    assert slo.ttft == pytest.approx(5 * 0.2) and slo.tpot == pytest.approx(5 * 0.15)  # medians x 5
    assert "5 x plain" in slo.source
    with pytest.raises(ValueError):
        derived_slo([rec(0, 0, 0, 0, ok=False)])
    v = vs_plain({"throughput_tok_s": 30.0, "goodput_rps": 0.5}, {"throughput_tok_s": 20.0, "goodput_rps": 0.0})
    assert v == {"throughput": pytest.approx(1.5), "goodput": None}


def test_greedy_comparison():
    plain = [rec(0, 1, 2, 3, text="a"), rec(1, 1, 2, 3, text="b"), rec(2, 0, 0, 0, ok=False)]
    arm = [rec(0, 1, 2, 3, text="a"), rec(1, 1, 2, 3, text="B"), rec(2, 1, 2, 3, text="c")]
    assert compare_greedy(arm, plain) == {"compared": 2, "identical": 1, "differ": [1]}


# ----------------------------------------------------------------------------- the table
def _result(arm_records: dict[str, list[Record]], durations: float = 10.0, lossless=True):
    ph = Phase("rate", 0.5)
    arms = []
    for name, recs in arm_records.items():
        arms.append({"name": name, "lossless": None if name == "plain" else lossless,
                     "calibration": [r.to_json() for r in recs[:2]] if name == "plain" else [],
                     "phases": [{"phase": {**ph.to_json(), "key": ph.key}, "duration_s": durations,
                                 "preemptions": 3.0, "records": [r.to_json() for r in recs]}]})
    result = {"settings": {"workload": "w", "num_requests": 2, "max_tokens": 5, "seed": 0}, "arms": arms}
    finish(result, {n: {ph.key: r} for n, r in arm_records.items()}, Options(phases=[ph], slo=SLO(ttft=1.0)))
    return result


def test_finish_and_table_rows():
    plain = [rec(0, 0.5, 2.0, 4, text="x"), rec(1, 2.0, 4.0, 4, text="y")]
    graft = [rec(0, 0.5, 1.0, 4, text="x"), rec(1, 0.5, 1.5, 4, text="z")]
    result = _result({"plain": plain, "streaming-kvcap": graft})
    p, g = (a["phases"][0] for a in result["arms"])
    assert p["figures"]["goodput_rps"] == pytest.approx(0.1) and g["figures"]["goodput_rps"] == pytest.approx(0.2)
    assert g["vs_plain"]["goodput"] == pytest.approx(2.0) and g["vs_plain"]["throughput"] == pytest.approx(1.0)
    assert g["greedy"] == {"compared": 2, "identical": 1, "differ": [1]}
    assert result["slo"]["ttft_s"] == 1.0
    table = rows(result)
    assert [c[:2] for c in map(cells, table)] == [["plain", "0.5 req/s"], ["streaming-kvcap", "0.5 req/s"]]
    got = dict(zip(("arm", "load", "ok", "tok", "x", "lat", "ttft", "tpot", "good", "xgood", "pre", "greedy"),
                   cells(table[1])))
    assert got["ok"] == "2/2" and got["tok"] == "0.8" and got["x"] == "1.00x" and got["xgood"] == "2.00x"
    assert got["good"] == "0.200 (2/2)" and got["greedy"] == "**1/2**" and got["pre"] == "3"
    assert got["ttft"] == "0.50 / 0.50" and got["tpot"] == "250 / 317"  # 1/6 and 1/3 s: p50 1/4, p90 0.317
    assert cells(table[0])[-1] == "-" and cells(table[0])[4] == "-"
    md = markdown(table).splitlines()
    assert md[0].startswith("| arm | load |") and len(md) == 4 and md[3].count("|") == md[0].count("|")
    lossy = _result({"plain": plain, "snapkv": graft}, lossless=False)
    assert cells(rows(lossy)[1])[-1] == "1/2 (lossy)"
    # one round: the summary quotes it, and prints nothing
    assert [(s["arm"], s["load"], s["median"], s["quoted_from_round"]) for s in result["by_load"]] == [
        ("streaming-kvcap", "0.5 req/s", pytest.approx(1.0), 1)]
    assert summary_lines(result) == []


def test_rounds_are_summarized_from_the_second():
    """Each round's ratio to plain's same round; the median and range of rounds 2..R quoted."""
    ph = phases([], [4], rounds=3)
    tokens = {"plain": (4, 4, 4), "lookahead": (8, 4, 5)}  # output tokens per request, by round
    arms, raw = [], {}
    for name, per_round in tokens.items():
        arms.append({"name": name, "lossless": None if name == "plain" else True, "calibration": [],
                     "phases": [{"phase": {**p.to_json(), "key": p.key}, "duration_s": 2.0} for p in ph]})
        raw[name] = {p.key: [rec(0, 0.1, 1.0, n, text="x")] for p, n in zip(ph, per_round)}
    result = {"settings": {"phases": [p.to_json() for p in ph]}, "arms": arms}
    finish(result, raw, Options(phases=ph, slo=SLO(ttft=1.0)))
    (s,) = result["by_load"]
    assert s["arm"] == "lookahead" and s["load"] == "concurrency 4" and s["quoted_from_round"] == 2
    assert s["rounds"] == {"1": pytest.approx(2.0), "2": pytest.approx(1.0), "3": pytest.approx(1.25)}
    assert (s["median"], s["min"], s["max"]) == (pytest.approx(1.125), pytest.approx(1.0), pytest.approx(1.25))
    (line,) = summary_lines(result)
    assert line == ("lookahead at concurrency 4: throughput x plain 1.12x (1.00-1.25) over rounds 2..3; "
                    "by round 2.00, 1.00, 1.25")


def test_finish_derives_the_slo_from_plains_calibration():
    plain = [rec(0, 0.2, 1.2, 11), rec(1, 0.4, 1.4, 11)]
    ph = Phase("concurrency", 4)
    result = {"arms": [{"name": "plain", "lossless": None, "calibration": [r.to_json() for r in plain],
                        "phases": [{"phase": {**ph.to_json(), "key": ph.key}, "duration_s": 2.0}]}]}
    finish(result, {"plain": {ph.key: plain}}, Options(phases=[ph], slo_factor=2))
    assert result["slo"]["ttft_s"] == pytest.approx(0.6) and result["slo"]["tpot_s"] == pytest.approx(0.2)
    assert result["arms"][0]["phases"][0]["figures"]["slo_met"] == 2


# ----------------------------------------------------------------------------- the client
def _sse(tokens: int, *, done=True, finish=True, usage=True) -> bytes:
    events = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(tokens)]
    if finish:
        events[-1]["choices"][0]["finish_reason"] = "length"
    if usage:
        events.append({"choices": [], "usage": {"completion_tokens": tokens}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def _server(request):
    body = json.loads(request.content)
    assert body["stream"] and body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}
    n = body["max_tokens"]
    if n == 3:
        return httpx.Response(500, text="nope")
    if n == 4:
        return httpx.Response(200, content=_sse(4, done=False))
    if n == 6:
        return httpx.Response(200, content=_sse(6, usage=False))
    return httpx.Response(200, content=_sse(n))


def test_client_records_each_outcome():
    reqs = [ServeRequest(i, (1, 2), n) for i, n in enumerate((5, 3, 4, 6, 8))]
    recs, duration = asyncio.run(open_loop("http://127.0.0.1:1", "m", reqs, [0, 0.01, 0.02, 0.03, 0.04],
                                           ignore_eos=True, cache_salt="s", timeout=5,
                                           transport=httpx.MockTransport(_server)))
    assert [r.index for r in recs] == [0, 1, 2, 3, 4]
    assert [r.ok for r in recs] == [True, False, False, False, True]
    assert recs[0].output_tokens == 5 and recs[0].text == "t0t1t2t3t4" and recs[0].ttft is not None
    assert recs[4].sent >= 0.04 and recs[4].scheduled == 0.04 and duration >= 0.04
    assert recs[1].error.startswith("HTTP 500") and "[DONE] missing" in recs[2].error
    assert "completion_tokens" in recs[3].error
    closed, _ = asyncio.run(closed_loop("http://127.0.0.1:1", "m", reqs, 2, ignore_eos=False, cache_salt=None,
                                        timeout=5, transport=httpx.MockTransport(_server)))
    assert [r.index for r in closed] == [0, 1, 2, 3, 4] and [r.ok for r in closed] == [r.ok for r in recs]
    with pytest.raises(ValueError):
        asyncio.run(open_loop("http://10.0.0.1:1", "m", reqs, [0] * 5, ignore_eos=True, cache_salt=None, timeout=5))


# ----------------------------------------------------------------------------- KV cap, arms, command line
def test_the_kv_pool_is_capped_as_the_bench_caps_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cap_env({"model": "m"}) == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # CPU_ENV_DEFAULTS
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cap_env({"model": "m"}) == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    assert cap_env({"model": "m", "kv_cache_memory_bytes": 10}) == {}
    dep = ROOT / "deployments" / "shapes"
    plain, streaming, snapkv = arms_for([str(dep / "streaming-kvcap.yaml"), str(dep / "snapkv-kvcap.yaml")])
    assert [a.name for a in (plain, streaming, snapkv)] == ["plain", "streaming-kvcap", "snapkv-kvcap"]
    for a in (plain, streaming, snapkv):  # the shapes' own cap, in every arm
        assert a.kwargs["num_gpu_blocks_override"] == 40
    assert "additional_config" not in plain.kwargs and "additional_config" in streaming.kwargs
    assert streaming.lossless is False and plain.lossless is None
    assert all(a.kwargs["num_gpu_blocks_override"] == 12 for a in arms_for([str(dep / "streaming-kvcap.yaml")], 12))
    with pytest.raises(ValueError, match="different plain twins"):
        arms_for([str(dep / "streaming-kvcap.yaml"), str(ROOT / "deployments" / "spec-lookahead.yaml")])


def test_kv_blocks_read_from_metrics():
    text = 'vllm:cache_config_info{block_size="128",num_gpu_blocks="40",prefix="x"} 1.0\n'
    assert kv_blocks_of(text) == 40 and kv_blocks_of("vllm:other 1") is None


def test_command_line():
    parse = build_parser().parse_args
    o = options(parse(["servebench", "d.yaml"]), Path("."))
    assert [p.key for p in o.phases] == ["rate=0.25", "rate=0.5", "rate=1"] and o.slo is None
    assert o.ignore_eos is None and o.workload == "long-context"  # None: decided by the weights (sweep)
    o = options(parse(["servebench", "d.yaml", "--concurrency", "16,64", "--slo-latency", "9"]), Path("."))
    assert [p.key for p in o.phases] == ["concurrency=16", "concurrency=64"] and o.slo == SLO(latency=9.0,
                                                                                               source=o.slo.source)
    o = options(parse(["servebench", "d.yaml", "--concurrency", "16", "--rounds", "2"]), Path("."))
    assert [p.key for p in o.phases] == ["concurrency=16", "concurrency=16.round2"]
    o = options(parse(["servebench", "d.yaml", "--rates", "1", "--concurrency", "2", "--no-ignore-eos"]), Path("."))
    assert [p.key for p in o.phases] == ["rate=1", "concurrency=2"] and not o.ignore_eos
    for bad in (["--rates", "0"], ["--concurrency", "1.5"], ["--num-requests", "0"], ["--slo-ttft", "-1"],
                ["--slo-factor", "0"], ["--kv-blocks", "0"], ["--rounds", "0"]):
        with pytest.raises(ValueError):
            options(parse(["servebench", "d.yaml", *bad]), Path("."))


def test_the_warm_up_runs_a_batch_as_large_as_the_highest_concurrency():
    from types import SimpleNamespace

    from vllm_graft.tools.serve.load import phases
    from vllm_graft.tools.serve.run import WARMUP_REQUESTS, warm_up_requests

    def opts(rates=(), concurrency=(), n=64):
        return SimpleNamespace(phases=phases(rates, concurrency), num_requests=n)

    assert warm_up_requests(opts(rates=(0.5, 1))) == WARMUP_REQUESTS
    assert warm_up_requests(opts(concurrency=(16, 64))) == 64
    assert warm_up_requests(opts(concurrency=(16, 64), n=32)) == 32  # no more than a phase sends
    assert warm_up_requests(opts(concurrency=(2,))) == WARMUP_REQUESTS


def test_too_few_prompts_for_the_sweep_names_the_options(monkeypatch):
    """A workload with fewer prompts than loads x rounds x --num-requests asks: the error says
    how many the sweep sends and which options lower it."""
    import vllm_graft.tools.workloads as workloads
    from vllm_graft.tools.serve.run import build_requests
    from vllm_graft.tools.workloads import WorkloadError

    def build(names, tokenizer, *, num_prompts, **kw):
        raise WorkloadError(f"code-completion: only 544 functions found (asked {num_prompts})")

    monkeypatch.setattr(workloads, "build", build)
    monkeypatch.setattr(workloads.Tokenizer, "from_model", staticmethod(lambda model: None))
    opts = Options(phases=phases([], [16, 64], rounds=3), num_requests=100, workload="code-completion")
    with pytest.raises(WorkloadError, match=r"only 544 .*sends 6\d\d distinct prompts \(6 phases .* "
                                            r"--num-requests 100, .*lower --num-requests or --rounds"):
        build_requests("m", 2048, opts)
