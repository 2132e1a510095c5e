"""The arm process of `vllm-graft bench`: a spawned child that starts an in-process vLLM engine
(plain or with the deployment), warms it up, then, each time the parent (:mod:`.command`) says
``run``, runs every workload once stamping each output token and sampling the KV block pool
(the parent alternates the two arms' runs); at ``finish`` it scores outputs (perplexity) and
writes its result as JSON. vLLM is imported only inside its functions."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Sequence

from .stats import median_run, nll_of, request_timing


def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _system_busy_s() -> float | None:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class _KVSampler:
    """Blocks in use in the scheduler's KV pool, sampled after every schedule(), and which of
    those steps were decode steps: every scheduled request past its prompt (the scheduler has
    already counted the step's tokens as computed, so a request decodes when it has computed
    more than its prompt; a step holding any prompt token, a prefill chunk or a preempted
    request's recomputation, is not one)."""

    def __init__(self, pool: Any, scheduler: Any = None) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.reset()

    def decoding(self, out: Any) -> bool:
        requests = getattr(self.scheduler, "requests", None)
        scheduled = getattr(out, "num_scheduled_tokens", None)
        if not requests or not scheduled:
            return False
        for rid in scheduled:
            req = requests.get(rid)
            if req is None or req.num_computed_tokens <= req.num_prompt_tokens:
                return False
        return True

    def in_use(self) -> int:
        return self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks()  # minus the null block

    def reset(self) -> None:
        self.peak = 0
        self.steps: list[int] = []
        self.decode: list[bool] = []  # per step: a decode step

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            n = self.in_use()
            self.steps.append(n)
            self.decode.append(self.decoding(out))
            self.peak = max(self.peak, n)
            return out

        return schedule


class _Clock:
    """An arm's clock in a timed run: the wall clock, or with a ``turn`` (``--interleave step``)
    the wall clock less the waits for the other arm's steps. The machine's busy CPU seconds are
    then summed over this arm's own turns only, so that the other arm's steps do not read as
    another process loading the machine."""

    def __init__(self, turn: Any = None) -> None:
        self.turn, self.paused, self.busy = turn, 0.0, 0.0
        self._busy_at: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.paused

    def take(self) -> None:
        if self.turn is not None:
            self.paused += self.turn.take()
            self._busy_at = _system_busy_s()

    def _close_turn(self) -> None:
        busy = _system_busy_s()
        if busy is not None and self._busy_at is not None:
            self.busy += busy - self._busy_at
        self._busy_at = None

    def give(self) -> None:
        if self.turn is not None:
            self._close_turn()
            self.turn.give()

    def next_turn(self) -> None:
        self.give()
        self.take()

    def busy_of_run(self, start: float | None, end: float | None) -> float | None:
        """After the run's last :meth:`give`: the machine's busy CPU seconds of the run (/proc/stat
        at ``start`` and ``end``), with a turn those of its own turns only."""
        if start is None or end is None:
            return None
        return self.busy if self.turn is not None else end - start


def _render(llm: Any, ids_list: Sequence[Sequence[int]]) -> list[Any]:
    prompts = [{"prompt_token_ids": list(ids)} for ids in ids_list]
    try:  # what LLM.generate does before add_request (vLLM 0.32); raw prompts still work
        return list(llm._preprocess_cmpl(prompts))
    except AttributeError:
        return prompts


def _request_result(i: int, out: Any, submit: float, times: list[float], t0: float) -> dict[str, Any]:
    """One finished request of a timed run: its tokens, our timing from its stamps and vLLM's own
    metrics beside them (the cross-check)."""
    c = out.outputs[0]
    token_ids = list(c.token_ids)
    if len(token_ids) != len(times):
        raise RuntimeError(f"request {i}: {len(token_ids)} tokens but {len(times)} stamps")
    m = out.metrics
    vllm_metrics = None
    if m is not None:
        ng = getattr(m, "num_generation_tokens", 0)
        vllm_metrics = {
            "ttft_s": getattr(m, "first_token_latency", None),
            "tpot_s": ((m.last_token_ts - m.first_token_ts) / (ng - 1)) if ng > 1 else None,
            "queued_s": m.scheduled_ts - m.queued_ts,
            "prefill_s": m.first_token_ts - m.scheduled_ts,
            "num_preemptions": getattr(m, "num_preemptions", 0),
        }
    return {
        "output_token_ids": token_ids,
        "finish_reason": c.finish_reason,
        "num_cached_tokens": getattr(out, "num_cached_tokens", None),
        "submit_s": submit - t0,
        "token_times_s": [t - submit for t in times],
        **request_timing(submit, times),
        "vllm_ttft_s": vllm_metrics["ttft_s"] if vllm_metrics else None,
        "vllm_tpot_s": vllm_metrics["tpot_s"] if vllm_metrics else None,
        "vllm_metrics": vllm_metrics,
    }


def _generate(
    llm: Any,
    prompts: Sequence[dict[str, Any]],
    *,
    batch: int,
    ignore_eos: bool,
    sampler: _KVSampler | None,
    on_tokens: Callable[[int], None],
    tag: str,
    turn: Any = None,
) -> dict[str, Any]:
    """Run one workload through the engine, stamping every output token. ``turn`` (a side of
    :class:`.turns.Turns`, ``--interleave step``): every step in this arm's own turn, the other
    arm's steps between them left out of the clock."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests before the timed run")
    inputs = _render(llm, [p["token_ids"] for p in prompts])
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=ignore_eos, output_kind=RequestOutputKind.CUMULATIVE
        )
        for p in prompts
    ]
    n = len(prompts)
    limit = batch if batch > 0 else n
    submit = [0.0] * n
    times: list[list[float]] = [[] for _ in range(n)]
    final: list[Any] = [None] * n
    ids = {f"{tag}-{i}": i for i in range(n)}
    pending = list(range(n))[::-1]
    inflight: set[int] = set()
    if sampler is not None:
        sampler.reset()

    clock = _Clock(turn)

    def fill() -> None:
        while pending and len(inflight) < limit:
            i = pending.pop()
            submit[i] = clock.now()
            # arrival_time: vLLM's own TTFT (kept as a cross-check) then counts from here too
            engine.add_request(f"{tag}-{i}", inputs[i], params[i], arrival_time=time.time())
            inflight.add(i)

    import resource

    clock.take()  # the first turn: waited for before the clock starts
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    system0 = _system_busy_s()
    t0 = clock.now()
    delivered = 0  # told to the parent once the run is over: an event per step woke it mid-run
    fill()
    while inflight:
        outputs = engine.step()
        now = clock.now()
        new = 0
        for out in outputs:
            i = ids[out.request_id]
            got = len(out.outputs[0].token_ids)
            if got > len(times[i]):
                new += got - len(times[i])
                times[i] += [now] * (got - len(times[i]))
            if out.finished:
                final[i] = out
                inflight.discard(i)
        delivered += new
        fill()
        if not outputs and not engine.has_unfinished_requests() and inflight:
            raise RuntimeError(f"the engine finished without returning requests {sorted(inflight)}")
        if inflight:
            clock.next_turn()
    wall = clock.now() - t0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    system1 = _system_busy_s()
    clock.give()
    busy = clock.busy_of_run(system0, system1)
    on_tokens(delivered)
    cpu = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    others = None if busy is None else max(0.0, (busy - cpu) / wall)

    requests = [_request_result(i, out, submit[i], times[i], t0) for i, out in enumerate(final)]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "other_cpus": others,
        "turn_wait_s": clock.paused if turn is not None else None,  # --interleave step: the other arm's turns
        "requests": requests,
        "kv_blocks_peak": sampler.peak if sampler else None,
        "kv_blocks_per_step": list(sampler.steps) if sampler else [],
        "kv_decode_steps": list(sampler.decode) if sampler else [],
    }


def _score(
    llm: Any, sequences: dict[str, tuple[list[int], list[int]]], on_done: Callable[[int], None], chunk: int = 8
) -> dict[str, list[float]]:
    """NLL of each output token given prompt + preceding output, under this engine's model."""
    from vllm import SamplingParams

    unique: dict[tuple[int, ...], list[str]] = {}  # each distinct sequence is scored once
    for key, (prompt, output) in sequences.items():
        unique.setdefault(tuple(prompt) + tuple(output), []).append(key)
    out: dict[str, list[float]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    seqs = list(unique)
    for k in range(0, len(seqs), chunk):
        part = seqs[k : k + chunk]
        results = llm.generate([{"prompt_token_ids": list(s)} for s in part], params, use_tqdm=False)
        for s, res in zip(part, results):
            all_nll = nll_of(res.prompt_logprobs, s, 1)  # position 0 has no log-probability
            for key in unique[s]:
                start = len(sequences[key][0])
                out[key] = all_nll[start - 1 :]
        on_done(len(part))
    return out


def _arm_main(job: dict[str, Any], result_path: str, events: Any, commands: Any = None, turn: Any = None) -> None:
    """Entry of an arm's child process (spawned): start the engine, warm it up, then run what
    the parent asks through ``commands`` (a Connection: ``("run", round)`` runs every workload
    once, ``("finish", score)`` ends), score what it is asked to score, write the result as
    JSON. Without ``commands`` it runs ``job["repeat"]`` rounds by itself and finishes with
    ``job["score"]``. Events go to the parent through ``events``; ``turn``: this arm's side of
    the baton (``--interleave step``)."""
    log = os.open(job["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    arm = job["arm"]

    def send(kind: str, payload: Any = None) -> None:
        events.send((arm, kind, payload))

    if commands is None:
        script = [("run", r) for r in range(max(1, int(job.get("repeat", 1))))] + [("finish", job.get("score"))]

        def receive() -> tuple[str, Any]:
            return script.pop(0)
    else:

        def receive() -> tuple[str, Any]:
            try:
                return tuple(commands.recv())
            except EOFError:  # the parent is gone
                raise SystemExit("the parent closed the command pipe") from None

    try:
        result = _arm_run(job, send, receive, turn)
        status = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        traceback.print_exc()
        result = {
            "error": f"{type(e).__name__}: {e}",
            "error_type": type(e).__name__,
            "traceback": traceback.format_exc(),
        }
        status = 1
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    events.close()
    if status:
        sys.exit(status)
    # Returning lets multiprocessing run its finalizers (semaphores vLLM registered with the
    # parent's resource tracker are released) and the engine shut down with the LLM object.


def _empty_suffix_tree(worker: Any) -> int:
    """In a worker: evict every response vLLM's ``suffix`` drafter (``SuffixDecodingProposer``,
    ``v1/spec_decode/suffix_decoding.py``) cached in its global tree; returns how many."""
    cache = getattr(getattr(getattr(worker, "model_runner", None), "drafter", None), "suffix_cache", None)
    if cache is None:
        return 0
    cached = list(cache.cached_requests)
    for req_id in cached:
        cache.evict_cached_response(req_id)
    return len(cached)


#: oneDNN's primitive cache holds this many primitives unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``
#: says otherwise (oneDNN's documented default)
ONEDNN_CACHE_DEFAULT = 1024


def gemm_rows_to_warm(max_num_seqs: int, spec_tokens: int, shapes: int, capacity: int) -> int:
    """The row counts ``1..N`` to warm each linear shape at: every token count a decode step
    can compute (``max_num_seqs`` requests of ``1 + spec_tokens`` tokens each), as far as
    ``shapes`` primitives per row count fit in four fifths of oneDNN's primitive cache
    (``capacity``; the rest is left to the prompt steps' row counts)."""
    if shapes <= 0:
        return 0
    decode = max(1, int(max_num_seqs)) * (1 + max(0, int(spec_tokens)))
    return max(0, min(decode, int(0.8 * int(capacity)) // shapes))


def _warm_gemm_shapes(worker: Any, max_num_seqs: int, spec_tokens: int) -> dict[str, Any]:
    """In a worker: run each distinct shape of the model's linear layers that vLLM's CPU engine
    dispatched to oneDNN (``layer.cpu_linear``, ``dispatch_cpu_unquantized_gemm`` in
    ``model_executor/layers/utils.py``) once at every row count of :func:`gemm_rows_to_warm`.
    oneDNN builds a matmul primitive the first time it meets a row count (0.14-0.2 ms each on
    the tiny llama's five shapes), and a speculative step's row count (its requests plus their
    drafts) changes from step to step. No module has ``cpu_linear`` off the CPU engine: nothing
    runs there."""
    import torch

    model = getattr(getattr(worker, "model_runner", None), "model", None)
    layers: dict[tuple[int, int], Any] = {}
    for m in model.modules() if model is not None else ():
        if getattr(m, "cpu_linear", None) is None:
            continue
        k = getattr(m, "input_size_per_partition", None) or getattr(m, "embedding_dim", None)
        n = getattr(m, "output_size_per_partition", None) or getattr(m, "num_embeddings_per_partition", None)
        if k is not None:
            layers.setdefault((int(k), int(n or 0)), m)
    capacity = int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") or ONEDNN_CACHE_DEFAULT)
    rows = gemm_rows_to_warm(max_num_seqs, spec_tokens, len(layers), capacity)
    t = time.perf_counter()
    with torch.no_grad():
        for (k, n), m in layers.items():
            x = torch.zeros(rows, k, dtype=getattr(m, "params_dtype", None) or torch.get_default_dtype())
            try:
                for r in range(1, rows + 1):  # the layer's own call, as its quant method makes it
                    m.cpu_linear(x[:r], getattr(m, "weight", None), getattr(m, "bias", None))
            except Exception as e:  # a layout this warm-up does not know: the timed runs build it
                print(f"vllm-graft bench: the {k}x{n} linear shape was not warmed ({e!r})", file=sys.stderr)
    return {"shapes": len(layers), "rows": rows, "s": time.perf_counter() - t}


def warm_step_shapes(llm: Any) -> dict[str, Any] | None:
    """Before the timed runs, on vLLM's CPU engine: build the oneDNN primitives of every token
    count a decode step of this engine can compute (:func:`_warm_gemm_shapes`), so that no timed
    run builds one, as no step of a server that has run a while does. A plain engine's
    decode steps compute one count per batch size, which its warm-up already met; a
    speculative engine's vary with the drafts (with `adaptive`, from run to run). Returns the
    first worker's ``{"shapes", "rows", "s"}`` (None where nothing was warmed)."""
    config = llm.llm_engine.vllm_config
    spec = getattr(config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    seqs = int(config.scheduler_config.max_num_seqs)
    done = llm.collective_rpc(_warm_gemm_shapes, args=(seqs, k))
    if done and done[0].get("shapes"):
        return done[0]
    if config.device_config.device.type == "cpu":  # e.g. every linear layer quantized
        print(
            "vllm-graft bench: no linear layer of this model runs vLLM's oneDNN GEMM (cpu_linear); "
            "its step shapes were not warmed",
            file=sys.stderr,
        )
    return None


def fresh_drafting_state(llm: Any) -> None:
    """Before a timed run that repeats the warm-up's and the previous run's prompts: no proposer
    drafts their outputs back. The graft plugins' shared state is renewed
    (:meth:`Runtime.fresh_cross_request_state`), and vLLM's ``suffix`` method, which drafts from
    a global tree of earlier responses, has that tree emptied."""
    from ...integration.runtime import RUNTIME

    RUNTIME.fresh_cross_request_state()
    spec = getattr(llm.llm_engine.vllm_config, "speculative_config", None)
    if getattr(spec, "method", None) == "suffix":
        llm.collective_rpc(_empty_suffix_tree)


def _warm_up(llm: Any, job: dict[str, Any], engine: dict[str, Any], send: Callable[[str, Any], None]) -> None:
    """Every workload's first prompts (as many as run at once), a few tokens each, then every
    decode step's token count on the CPU engine's linear layers (warm_step_shapes): the first
    timed run then meets no shape the engine has not seen at start-up."""
    from vllm import SamplingParams

    workloads = job["workloads"]
    send("phase", "warming up")
    t = time.perf_counter()
    size = job["batch"] or max(len(w["prompts"]) for w in workloads)
    for w in workloads:
        llm.generate(
            [{"prompt_token_ids": p["token_ids"]} for p in w["prompts"][:size]],
            SamplingParams(temperature=0.0, max_tokens=4),
            use_tqdm=False,
        )
    engine["gemm_warm"] = warm_step_shapes(llm)
    engine["warmup_s"] = time.perf_counter() - t
    repeat = max(1, int(job.get("repeat", 1)))
    send("total", repeat * sum(p["max_tokens"] for w in workloads for p in w["prompts"]))


def _rounds(
    llm: Any,
    job: dict[str, Any],
    scheduler: Any,
    pool: Any,
    send: Callable[[str, Any], None],
    receive: Callable[[], tuple[str, Any]],
    turn: Any = None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every workload once per "run" the parent sends, until it sends "finish" (with the outputs
    to score): each workload's runs, and what to score. With a ``turn`` the other arm runs the
    same round at once, step by step in turns (:mod:`.turns`)."""
    from ...integration.patches import PATCHES

    workloads = job["workloads"]
    runs: dict[str, list[dict[str, Any]]] = {w["name"]: [] for w in workloads}
    sampler = _KVSampler(pool, scheduler)
    patched = False
    try:
        while True:
            command, payload = receive()
            if command == "finish":
                score = dict(payload or {})
                break
            if command != "run":
                raise ValueError(f"unknown command {command!r}")
            if workloads and not patched:
                from ...integration.targets import BENCH_SCHEDULE

                PATCHES.apply(BENCH_SCHEDULE, sampler.wrap, on=scheduler)
                patched = True
            r = int(payload)
            fresh_drafting_state(llm)  # no run drafts from the previous run's outputs
            for w in workloads:
                send("phase", f"generating {w['name']} (run {r + 1})")
                llm.reset_prefix_cache()  # every run starts with a cold prefix cache
                runs[w["name"]].append(
                    _generate(
                        llm,
                        w["prompts"],
                        batch=job["batch"],
                        ignore_eos=job["ignore_eos"],
                        sampler=sampler,
                        on_tokens=lambda k: send("advance", k),
                        tag=f"{w['name']}-{r}",
                        turn=turn,
                    )
                )
            if turn is not None:
                turn.finish_round()
            send("phase", f"run {r + 1} done, waiting")
            send("round_done", r)
    finally:
        if patched:
            from ...integration.targets import BENCH_SCHEDULE

            PATCHES.undo(BENCH_SCHEDULE.owner)  # was "bench": the owner is "tools.bench"
    return runs, score


def _arm_run(
    job: dict[str, Any],
    send: Callable[[str, Any], None],
    receive: Callable[[], tuple[str, Any]],
    turn: Any = None,
) -> dict[str, Any]:
    from ...integration.bridge import ENV_CONFIG, ENV_FILE
    from ...integration.env import installed_vllm
    from ...launch.engine import apply_env_defaults

    # The deployment reaches the graft arm through additional_config only; a deployment in the
    # environment would leak into the plain arm (and conflict in the graft arm).
    os.environ.pop(ENV_FILE, None)
    os.environ.pop(ENV_CONFIG, None)
    os.environ.update(job.get("env") or {})  # e.g. the no-package baseline's VLLM_PLUGINS
    apply_env_defaults(in_process=True, engine=job.get("llm_kwargs"))

    send("phase", "loading model")
    t = time.perf_counter()
    from vllm import LLM

    from ...integration.runtime import RUNTIME

    llm = LLM(**job["llm_kwargs"])
    load_s = time.perf_counter() - t
    rss_after_load = _rss_mib()
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    vllm = installed_vllm()
    engine = {
        "load_s": load_s,
        "num_blocks": pool.num_gpu_blocks - 1,
        "block_size": scheduler.cache_config.block_size,
        "threads": _torch_threads(),
        "prefix_caching": bool(scheduler.cache_config.enable_prefix_caching),
        "vllm": f"{vllm[0]} {vllm[1]}" if vllm else None,
    }
    result: dict[str, Any] = {
        "arm": job["arm"],
        "engine": engine,
        "deployment_active": RUNTIME.active,
        "rss_after_load_mib": rss_after_load,
        "workloads": {},
    }

    workloads = job["workloads"]
    engine["warmup_s"] = 0.0
    if workloads:
        _warm_up(llm, job, engine, send)
    send("phase", "ready")
    send("ready", None)

    runs, score = _rounds(llm, job, scheduler, pool, send, receive, turn)
    for name, done in runs.items():
        if done:
            result["workloads"][name] = median_run(done)
    result["peak_rss_mib"] = _rss_mib()
    if workloads and job.get("report_plugins", job["arm"] == "graft"):  # graft, or an as-is baseline
        result["runtime_report"] = RUNTIME.report()

    for name, w in result["workloads"].items():  # this arm's own outputs, when it scores
        if job.get("score_own"):
            for i, (p, r) in enumerate(zip(job["workloads_by_name"][name], w["requests"])):
                score[f"{job['arm']}/{name}/{i}"] = (p, r["output_token_ids"])
    if score:
        send("phase", "scoring outputs (perplexity)")
        send("total_score", len(score))
        result["scores"] = _score(
            llm, {k: (list(v[0]), list(v[1])) for k, v in score.items()}, lambda k: send("advance_score", k)
        )
    send("phase", "done")
    return result
