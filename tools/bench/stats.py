"""Pure helpers of `vllm-graft bench`: the timing metrics of a request and of a run, the
comparison of two arms' greedy outputs, the choice among repeated runs and the assembly of the
result (what --json writes and the table and plot show). No engine, no vLLM."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

#: ``bench --baseline no-package``: the plain arm's vLLM loads every general plugin but this one.
NO_PACKAGE = "no-package"

ARMS = ("plain", "graft")
SCHEMA = "vllm-graft-bench/1"

MEASUREMENT = {
    "output_tok_s": "output tokens of all requests / wall time from the first request submitted "
    "to the last token received (warm-up excluded); with --repeat N, the median of "
    "the N runs (every run's figure under output_tok_s_runs, in run order; the other "
    "figures come from the run with the median wall time)",
    "repeats": "with --repeat N both engines stay loaded and the arms take turns: run r of every "
    "workload goes through the arms in the order settings.order[r], which alternates "
    "(graft then plain, plain then graft, ...), so neither arm always runs first",
    "decode_ratio": "as ratio, of decode rates (1 / median inter-token latency of each run): "
    "decode steps alone, prefill left out",
    "ratio": "the median of the paired ratios graft / plain output tokens/s of the two arms' runs "
    "with the same index (adjacent in time); its range their min-max; of_medians: graft / plain "
    "of each arm's median tokens/s",
    "ttft": "per request: perf_counter when the engine step returning its first output token "
    "ends - when the request was submitted (LLMEngine.add_request, in-process engine "
    "driven step by step)",
    "itl": "per output token after the first: gap to the previous token of the same request "
    "(a step delivering k tokens counts as k gaps of 1/k); tpot = (last - first) / (n - 1)",
    "vllm_metrics": "vLLM's RequestOutput.metrics (RequestStateStats): first_token_latency and "
    "(last_token_ts - first_token_ts) / (n - 1), kept per request as a cross-check",
    "kv_blocks": "blocks allocated from the scheduler's KV block pool (total - free - null block), "
    "sampled after every Scheduler.schedule(); peak per workload, and the median over the "
    "decode steps (steps where every scheduled request is past its prompt: the prefill "
    "makes the peak, a KV compressor acts on the decode steps)",
    "peak_rss": "ru_maxrss of the arm's child process after its last timed workload",
    "other_cpus": "CPUs used on average by other processes during a run (/proc/stat busy time minus "
    "the arm's own CPU time, / wall time); well above 0 means the timings are disturbed",
    "identical": "greedy output token ids, graft vs plain, per prompt; first differing output position",
    "perplexity": "exp(mean NLL of the output tokens) under the unmodified model (plain engine, "
    "prompt_logprobs=0 on prompt + output)",
}


#: Above this many CPUs used by other processes during a run, its timings are flagged. (The
#: engine's own CPU time cannot tell: its OpenMP threads spin while they wait for a core.)
BUSY_OTHER_CPUS = 0.5


# ======================================================================== pure helpers
def cpu_isa(cpuinfo: str | None = None) -> str:
    """The vector ISA vLLM's CPU kernels choose by, from ``/proc/cpuinfo``'s flags (or the text
    given): "AMX + AVX-512", "AVX-512", "AVX2", or "unknown" (no flags to read: not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return "unknown"
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if "avx512f" in flags:
        return "AMX + AVX-512" if "amx_tile" in flags else "AVX-512"
    return "AVX2" if "avx2" in flags else ("unknown" if not flags else "no AVX2")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (as numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def token_gaps(times: Sequence[float]) -> list[float]:
    """Inter-token gaps of one request from per-token arrival times (non-decreasing). Tokens
    that arrive together (k in one step) share the gap before them: k gaps of gap/k."""
    gaps: list[float] = []
    i = 1
    while i < len(times):
        j = i
        while j + 1 < len(times) and times[j + 1] == times[i]:
            j += 1
        k = j - i + 1
        gaps += [(times[i] - times[i - 1]) / k] * k
        i = j + 1
    return gaps


def request_timing(submit: float, token_times: Sequence[float]) -> dict[str, Any]:
    """TTFT, TPOT and ITL gaps of one request (seconds) from its submission time and
    per-token arrival times."""
    if not token_times:
        return {"ttft_s": None, "tpot_s": None, "itl_s": []}
    n = len(token_times)
    return {
        "ttft_s": token_times[0] - submit,
        "tpot_s": (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
        "itl_s": token_gaps(token_times),
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (the shorter length when one is a
    prefix of the other); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(plain: Sequence[Sequence[int]], graft: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per-prompt comparison of two arms' output token ids (same prompts, same order)."""
    if len(plain) != len(graft):
        raise ValueError(f"{len(plain)} plain outputs vs {len(graft)} graft outputs")
    prompts: list[dict[str, Any]] = []
    for i, (a, b) in enumerate(zip(plain, graft)):
        pos = first_difference(a, b)
        prompts.append(
            {"index": i, "identical": pos is None, "first_diff": pos, "plain_tokens": len(a), "graft_tokens": len(b)}
        )
    n_same = sum(p["identical"] for p in prompts)
    return {"identical": n_same == len(prompts), "n_identical": n_same, "n": len(prompts), "prompts": prompts}


def nll_of(prompt_logprobs: Sequence[Any], token_ids: Sequence[int], start: int) -> list[float]:
    """Negative log-likelihoods of ``token_ids[start:]`` from vLLM's ``prompt_logprobs``
    (position i: {token id: Logprob} for token i given tokens < i; position 0 is None)."""
    out = []
    for j in range(start, len(token_ids)):
        entry = prompt_logprobs[j]
        if entry is None or token_ids[j] not in entry:
            raise ValueError(f"no log-probability for token {token_ids[j]} at position {j}")
        lp = entry[token_ids[j]]
        out.append(-float(getattr(lp, "logprob", lp)))
    return out


def summarize(requests: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Aggregate metrics of one arm on one workload (or several: pass the sum of walls)."""
    out_tokens = sum(len(r["output_token_ids"]) for r in requests)
    ttft = [r["ttft_s"] for r in requests if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in requests if r.get("tpot_s") is not None]
    gaps = [g for r in requests for g in r.get("itl_s", [])]
    nll = [x for r in requests for x in (r.get("nll") or [])]
    scored = all(r.get("nll") is not None for r in requests) and bool(requests)
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_max_s": max(ttft) if ttft else None,
        "itl_mean_s": mean(gaps),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p90_s": percentile(gaps, 90),
        "itl_p99_s": percentile(gaps, 99),
        "tpot_mean_s": mean(tpot),
        "perplexity": math.exp(sum(nll) / len(nll)) if scored and nll else None,
        "scored_tokens": len(nll) if scored else 0,
    }


def median(values: Sequence[float]) -> float | None:
    """The median (the mean of the two middle values for an even count); None for no values."""
    return percentile(values, 50)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and count of repeated measurements (None figures for none)."""
    xs = [float(v) for v in values if v is not None]
    return {"median": median(xs), "min": min(xs, default=None), "max": max(xs, default=None), "n": len(xs)}


def arm_order(arms: Sequence[str], repeat: int) -> list[list[str]]:
    """The order the arms take in each of ``repeat`` runs: the given order in run 0, reversed
    in run 1, and so on alternately (A B, B A, A B, ...), so that neither arm always goes first
    (a warm cache, a neighbour's job ending) in a run."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    return [list(arms) if r % 2 == 0 else list(arms)[::-1] for r in range(repeat)]


def paired_ratios(plain: Sequence[float], graft: Sequence[float]) -> list[float]:
    """graft / plain of the runs with the same index (the same round, adjacent in time)."""
    if len(plain) != len(graft):
        raise ValueError(f"{len(plain)} plain runs vs {len(graft)} graft runs")
    return [g / p for p, g in zip(plain, graft) if p]


def ratio_of(plain_runs: Sequence[float], graft_runs: Sequence[float]) -> dict[str, Any] | None:
    """The speed ratio of two arms from their runs' tokens/s (in run order): the median of the
    paired per-run ratios (run r of one arm against run r of the other, adjacent in time), with
    their min-max as its spread; without pairs (unequal counts), the ratio of the medians.

    Why the paired median: on the 2-core VM one engine's speed drifts by +-10% over tens of
    seconds whatever it runs (30 identical 128-token runs in one process read 71-98 tok/s, in
    phases of ~10 runs, its CPU time per run tracking the wall time), so the two arms' medians
    each carry the phases their runs fell in. A paired ratio compares runs seconds apart, and its
    median drops the pairs that straddle a phase change. Nine A/A invocations (both arms plain)
    read 0.979-1.023 this way and 0.958-1.093 as the ratio of the medians, from the same runs
    (tools/bench/__init__.py). ``of_medians`` keeps the ratio of the medians beside it."""
    p, g = median(plain_runs), median(graft_runs)
    if p is None or g is None or p == 0:
        return None
    pairs = paired_ratios(plain_runs, graft_runs) if len(plain_runs) == len(graft_runs) else []
    return {
        "ratio": median(pairs) if pairs else g / p,
        "of_medians": g / p,
        "min": min(pairs, default=None),
        "max": max(pairs, default=None),
        "runs": pairs,
    }


def by_pair(runs: Sequence[float], pairs: int) -> list[float]:
    """The median of each pair of engine processes' paired ratios (``runs`` in run order: the
    first pair's rounds, then the next pair's, as --pairs runs them)."""
    n = len(runs) // pairs
    chunks = [runs[i * n : (i + 1) * n] for i in range(pairs)] if n else []
    return [m for m in map(median, chunks) if m is not None]


def relative_change(plain: float | None, graft: float | None) -> float | None:
    if plain is None or graft is None or plain == 0:
        return None
    return (graft - plain) / plain


def decode_series(w: dict[str, Any]) -> list[int]:
    """KV blocks in use at a workload run's decode steps (``kv_blocks_per_step`` where
    ``kv_decode_steps`` is true: every scheduled request past its prompt). Results without the
    flags (older files) have none."""
    flags = w.get("kv_decode_steps") or []
    return [n for n, d in zip(w.get("kv_blocks_per_step") or [], flags) if d]


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of repeated runs of one workload, the one with the median wall time (the upper median
    for an even count), with every run's headline figures under ``repeats``."""
    order = sorted(range(len(runs)), key=lambda k: runs[k]["wall_s"])
    chosen = dict(runs[order[len(runs) // 2]])
    first = [r["output_token_ids"] for r in runs[0]["requests"]]
    chosen["repeat_index"] = order[len(runs) // 2]
    chosen["repeats"] = []
    for r in runs:
        ttft = [q["ttft_s"] for q in r["requests"] if q.get("ttft_s") is not None]
        gaps = [g for q in r["requests"] for g in q.get("itl_s", [])]
        chosen["repeats"].append(
            {
                "wall_s": r["wall_s"],
                "kv_blocks_peak": r["kv_blocks_peak"],
                "output_tokens": sum(len(q["output_token_ids"]) for q in r["requests"]),
                "ttft_mean_s": mean(ttft),
                "itl_mean_s": mean(gaps),
                "itl_p50_s": percentile(gaps, 50),
                "other_cpus": r.get("other_cpus"),
                "turn_wait_s": r.get("turn_wait_s"),
            }
        )
    chosen["repeats_identical"] = all([q["output_token_ids"] for q in r["requests"]] == first for r in runs)
    return chosen


# ====================================================================== result assembly
def _runs_of(summary: dict[str, Any]) -> list[float]:
    runs = summary.get("output_tok_s_runs") or []
    return list(runs) if runs else ([summary["output_tok_s"]] if summary.get("output_tok_s") else [])


def _repeats(raw: dict[str, Any], prompt_sets: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """Each workload's per-run figures, or [] unless every workload has the same number of runs."""
    reps = [raw["workloads"][ps.name].get("repeats") for ps in prompt_sets]
    if not reps or any(not r for r in reps) or len({len(r) for r in reps}) != 1:
        return []
    return reps


def _decode_runs(raw: dict[str, Any], prompt_sets: Sequence[Any]) -> list[float]:
    """Decode rate of each run: 1 / its median inter-token latency (of each workload's output
    tokens after each request's first; averaged over workloads): the speed of a decode step.
    The median, not the mean: a gap that spans another request's prefill chunk (requests
    arriving together) is an outlier of the prefill, not of decoding."""
    reps = _repeats(raw, prompt_sets)
    out = []
    for k in range(len(reps[0]) if reps else 0):
        itl = [r[k].get("itl_p50_s") for r in reps]
        valid = [x for x in itl if x is not None and x > 0]
        if len(valid) < len(itl):
            return []
        out.append(1.0 / (sum(valid) / len(valid)))
    return out


def _overall_runs(raw: dict[str, Any], prompt_sets: Sequence[Any]) -> list[float]:
    """Tokens/s of each run over all workloads (run r: its tokens / its walls, summed)."""
    reps = _repeats(raw, prompt_sets)
    out = []
    for k in range(len(reps[0]) if reps else 0):
        wall = sum(r[k]["wall_s"] for r in reps)
        out.append(sum(r[k]["output_tokens"] for r in reps) / wall if wall > 0 else 0.0)
    return out


def _workload_result(
    arm: str,
    ps: Any,
    raw: dict[str, Any],
    scores: dict[str, list[float]] | None,
    decode: Callable[[Sequence[int]], str],
) -> dict[str, Any]:
    """One arm's result on one workload: its requests (text, NLLs, perplexity) and their summary,
    the median over runs where it ran more than once."""
    w = raw["workloads"][ps.name]
    requests = []
    for prompt, r in zip(ps.prompts, w["requests"]):
        nll = scores.get(f"{arm}/{ps.name}/{prompt.index}") if scores is not None else None
        requests.append(
            {
                "index": prompt.index,
                "source": prompt.source,
                "group": prompt.group,
                "prompt_tokens": len(prompt.token_ids),
                "max_tokens": prompt.max_tokens,
                **r,
                "output_text": decode(r["output_token_ids"]),
                "nll": nll,
                "perplexity": math.exp(sum(nll) / len(nll)) if nll else None,
            }
        )
    summary = summarize(requests, w["wall_s"])
    decode_blocks = decode_series(w)
    summary.update(
        kv_blocks_peak=w.get("kv_blocks_peak"),
        kv_blocks_decode_median=median(decode_blocks),
        kv_decode_steps=len(decode_blocks),
        kv_blocks_total=raw["engine"].get("num_blocks"),
        peak_rss_mib=raw.get("peak_rss_mib"),
        other_cpus=w.get("other_cpus"),
        turn_wait_s=w.get("turn_wait_s"),  # --interleave step: the other arm's turns, out of the clock
    )
    repeats = w.get("repeats") or [{"wall_s": w["wall_s"], "output_tokens": summary["output_tokens"]}]
    rates = [r["output_tokens"] / r["wall_s"] for r in repeats if r["wall_s"] > 0]
    summary.update(
        runs=len(repeats),
        output_tok_s_runs=rates,
        output_tok_s_min=min(rates, default=None),
        output_tok_s_max=max(rates, default=None),
        runs_identical=w.get("repeats_identical", True),
        turn_wait_s_runs=[r.get("turn_wait_s") for r in repeats],
    )
    if len(rates) > 1:
        summary["output_tok_s"] = median(rates)
        for key in ("ttft_mean_s", "itl_mean_s", "other_cpus"):
            sp = spread([r.get(key) for r in repeats if r.get(key) is not None])
            summary[f"{key}_min"], summary[f"{key}_max"] = sp["min"], sp["max"]
        busy = [r.get("other_cpus") for r in repeats if r.get("other_cpus") is not None]
        if busy:
            summary["other_cpus"] = max(busy)  # the worst run flags the figure
    return {
        "summary": summary,
        "kv_blocks_per_step": w.get("kv_blocks_per_step", []),
        "kv_decode_steps": w.get("kv_decode_steps", []),
        "requests": requests,
    }


def _arm_result(
    arm: str,
    raw: dict[str, Any],
    prompt_sets: Sequence[Any],
    scores: dict[str, list[float]] | None,
    decode: Callable[[Sequence[int]], str],
) -> dict[str, Any]:
    """One arm's result: per workload (:func:`_workload_result`) and over all of them."""
    workloads = {ps.name: _workload_result(arm, ps, raw, scores, decode) for ps in prompt_sets}
    all_requests = [r for w in workloads.values() for r in w["requests"]]
    overall = summarize(all_requests, sum(raw["workloads"][ps.name]["wall_s"] for ps in prompt_sets))
    per_run = _overall_runs(raw, prompt_sets)
    overall.update(
        output_tok_s_runs=per_run,
        output_tok_s_min=min(per_run, default=None),
        output_tok_s_max=max(per_run, default=None),
        runs=len(per_run) or 1,
    )
    if len(per_run) > 1:
        overall["output_tok_s"] = median(per_run)
    peaks = [w["summary"]["kv_blocks_peak"] for w in workloads.values() if w["summary"]["kv_blocks_peak"] is not None]
    overall.update(
        runs_identical=all(w["summary"]["runs_identical"] for w in workloads.values()),
        kv_blocks_peak=max(peaks) if peaks else None,
        kv_blocks_decode_median=median([n for w in workloads.values() for n in decode_series(w)]),
        kv_blocks_total=raw["engine"].get("num_blocks"),
        peak_rss_mib=raw.get("peak_rss_mib"),
    )
    return {
        "engine": raw["engine"],
        "deployment_active": raw.get("deployment_active"),
        "peak_rss_mib": raw.get("peak_rss_mib"),
        "rss_after_load_mib": raw.get("rss_after_load_mib"),
        "overall": overall,
        "workloads": workloads,
    }


def _comparison(
    arms: dict[str, Any], arm_results: dict[str, dict[str, Any]], prompt_sets: Sequence[Any]
) -> dict[str, Any]:
    """Plain against the plugin arm: greedy outputs compared per prompt, the speed ratios."""
    per = {}
    for ps in prompt_sets:
        cmp = compare_outputs(
            [r["output_token_ids"] for r in arms["plain"]["workloads"][ps.name]["requests"]],
            [r["output_token_ids"] for r in arms["graft"]["workloads"][ps.name]["requests"]],
        )
        for p, prompt in zip(cmp["prompts"], ps.prompts):
            p["source"] = prompt.source
        per[ps.name] = cmp
    for ps in prompt_sets:
        per[ps.name]["ratio"] = ratio_of(
            _runs_of(arms["plain"]["workloads"][ps.name]["summary"]),
            _runs_of(arms["graft"]["workloads"][ps.name]["summary"]),
        )
    return {
        "ratio": ratio_of(_runs_of(arms["plain"]["overall"]), _runs_of(arms["graft"]["overall"])),
        "decode_ratio": ratio_of(
            _decode_runs(arm_results["plain"], prompt_sets), _decode_runs(arm_results["graft"], prompt_sets)
        ),
        "identical": all(c["identical"] for c in per.values()),
        "n_identical": sum(c["n_identical"] for c in per.values()),
        "n": sum(c["n"] for c in per.values()),
        "workloads": per,
    }


def assemble(
    *,
    deployment: str,
    plan_info: dict[str, Any],
    settings: dict[str, Any],
    prompt_sets: Sequence[Any],
    arm_results: dict[str, dict[str, Any]],
    scores: dict[str, list[float]] | None,
    decode: Callable[[Sequence[int]], str],
    wall_s: float,
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The bench result (what --json writes and the table and plot show) from the raw results
    of the arm processes. ``scores`` maps "arm/workload/index" to output-token NLLs."""
    arms = {
        arm: _arm_result(arm, arm_results[arm], prompt_sets, scores, decode)
        for arm in ARMS
        if arm_results.get(arm) is not None
    }
    comparison = _comparison(arms, arm_results, prompt_sets) if "plain" in arms and "graft" in arms else None
    if comparison and comparison["ratio"] and settings.get("pairs", 1) > 1:
        comparison["ratio"]["by_pair"] = by_pair(comparison["ratio"]["runs"], settings["pairs"])
    graft_raw = arm_results.get("graft") or {}
    return {
        "schema": SCHEMA,
        "deployment": deployment,
        **plan_info,
        "settings": settings,
        "environment": environment or {},
        "measurement": MEASUREMENT,
        "workloads": [ps.to_json() | {"prompts": [p.to_json() for p in ps.prompts]} for ps in prompt_sets],
        "arms": arms,
        "comparison": comparison,
        "runtime_report": graft_raw.get("runtime_report"),
        # bench --baseline-as-is: what the baseline deployment's plugins did in the plain arm
        "baseline_runtime_report": (arm_results.get("plain") or {}).get("runtime_report"),
        "wall_s": wall_s,
    }
