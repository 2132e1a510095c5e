"""Where a step's time goes, per engine phase, plugin arm against plain vLLM: the wall time of
vLLM's scheduler, model runner and output processor methods per engine step, so that what a
deployment adds to a step is located (e.g. an idle speculative proposer: does the extra time sit
in the forward pass, the sampler or the drafter call?).

    .venv/bin/python benchmarks/phase_time.py DEPLOYMENT [--workload code-completion]
        [--num-prompts 64] [--max-tokens 64] [--batch 32] [--repeat 3] [--rounds 2] [--by-shape]

Each round starts a fresh child process per arm (the deployment, then its plain twin), each an
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``max_num_seqs = --batch``, which
generates the workload once to warm up and then ``--repeat`` timed times (greedy, ``ignore_eos``:
every arm runs the same steps when nothing drafts), the proposers' state renewed before each as
the bench does. The methods below are wrapped with a ``perf_counter`` pair; nested ones are
counted inside their callers too (``_model_forward`` inside ``execute_model``). Printed per arm:
the median wall time of a run, the forward pass's median time at the commonest number of tokens
a step computed (steps of one shape compare across arms that ran different steps) and, per
method, the median over runs of its milliseconds per engine step; the garbage collector's time
(``gc``) wherever it fell; with two or more ``--rounds``, each process's own medians (one engine
process differs from the next by a few percent). The wrapping itself costs about a microsecond per call, alike in both arms.
``--by-shape``: also, per arm, each of its commonest step shapes (the tokens the forward
computed: e.g. a chain step against a tree step of the same deployment, in one process) with the
median of each method's time in such a step and of the whole step, from one ``execute_model``
call to the next.
"""

from __future__ import annotations

import collections
import gc
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import child_engine_setup, fresh_run, run_in_child, workload_parser, workload_settings  # noqa: E402

#: (module, class, methods) timed per step
TARGETS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", ("schedule", "update_from_output", "update_draft_token_ids")),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        (
            "execute_model",  # and _model_forward, timed per step shape in _child
            "_prepare_inputs",
            "_build_attention_metadata",
            "_update_states",
            "sample_tokens",
            "_sample",
            "_bookkeeping_sync",
            "propose_draft_token_ids",
            "take_draft_token_ids",
        ),
    ),
    ("vllm.v1.engine.output_processor", "OutputProcessor", ("process_outputs",)),
    # the speculative adapter's share of ``propose_draft_token_ids`` (absent from a plain arm)
    ("vllm_graft.integration.adapters.speculative.engine", "GraftProposer", ("propose",)),
    ("vllm_graft.integration.adapters.speculative.drafting", "Drafting", ("propose",)),
    # `adaptive`'s own per-step decision (its share of ``Drafting.propose``)
    ("vllm_graft.plugins.speculative.adaptive.reference", "Adaptive", ("begin_step", "accepted")),
)


def _child(path: str, graft: bool, settings: dict, out) -> None:
    launch, plan, ps = child_engine_setup(path, settings["workload"], settings["num_prompts"], settings["max_tokens"])
    from vllm import SamplingParams

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    # --by-shape: each engine step's methods, from one execute_model call to the next
    steps = StepRecords() if settings.get("by_shape") else None

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            if steps is not None and name == "execute_model":
                steps.next_step(t)
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t
                spent[name] += took
                calls[name] += 1
                if steps is not None:
                    steps.add(name, took)

        return wrapper

    gc_started = [0.0]

    def gc_timer(phase, info):  # the collector's own time, wherever it falls (inside the methods too)
        if phase == "start":
            gc_started[0] = time.perf_counter()
            return
        took = time.perf_counter() - gc_started[0]
        for name in (
            ("gc (any generation)", "gc generation 2") if info.get("generation") == 2 else ("gc (any generation)",)
        ):
            spent[name] += took
            calls[name] += 1

    gc.callbacks.append(gc_timer)
    for module, cls_name, methods in TARGETS:
        cls = getattr(importlib.import_module(module), cls_name)
        for name in methods:
            if getattr(cls, name, None) is not None:
                label = name if module.startswith("vllm.") else f"{cls_name}.{name}"
                setattr(cls, name, timed(label, getattr(cls, name)))
    # the forward pass, also per number of tokens computed: steps of one shape compare across arms
    # even where the arms ran different steps (a drafting step, a prompt split over more steps)
    by_tokens: dict[int, list[float]] = collections.defaultdict(list)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    forward = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, *args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(self, input_ids, *args, **kwargs)
        finally:
            took = time.perf_counter() - t
            spent["_model_forward"] += took
            calls["_model_forward"] += 1
            tokens = int(input_ids.shape[0]) if input_ids is not None else -1
            by_tokens[tokens].append(took)
            if steps is not None:
                steps.add("_model_forward", took)
                steps.tokens = tokens

    GPUModelRunner._model_forward = _model_forward
    prompts = [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], ignore_eos=True)
    runs = []
    stats = {"disable_log_stats": False} if settings.get("log_stats") else {}
    with launch.in_process_engine(plan, graft=graft, max_num_seqs=settings["batch"], **stats) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        for _ in range(settings["repeat"]):
            fresh_run(llm)
            spent.clear()
            calls.clear()
            by_tokens.clear()
            if steps is not None:
                steps.clear()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            shape = max(by_tokens, key=lambda n: len(by_tokens[n]))  # the most common step shape
            runs.append(
                {
                    "wall_s": time.perf_counter() - t,
                    "spent": dict(spent),
                    "calls": dict(calls),
                    "forward_at": (shape, len(by_tokens[shape]), statistics.median(by_tokens[shape])),
                }
            )
            if steps is not None:
                steps.next_step(time.perf_counter())  # closes the run's last step
                runs[-1]["steps"] = list(steps.done)
    out.send(runs)


class StepRecords:
    """``--by-shape``: each engine step as ``(tokens the forward computed, {method: seconds,
    "step": seconds})``, a step running from one ``execute_model`` call to the next, so that it
    holds that step's runner methods, its output processing and the next step's scheduling."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.done: list[tuple[int, dict[str, float]]] = []
        self.open: dict[str, float] | None = None
        self.started = 0.0
        self.tokens = -1

    def next_step(self, now: float) -> None:
        if self.open is not None:
            self.open["step"] = now - self.started
            self.done.append((self.tokens, self.open))
        self.open, self.started, self.tokens = {}, now, -1

    def add(self, name: str, took: float) -> None:
        if self.open is not None:
            self.open[name] = self.open.get(name, 0.0) + took


def by_shape(arms: dict[str, list[dict]], shapes: int = 4) -> list[str]:
    """Per arm, its commonest step shapes (tokens the forward computed, over all its runs): the
    steps of that shape, then the median of each method's milliseconds in such a step
    (``step``: the whole interval; the slowest first)."""
    lines = []
    for arm, runs in arms.items():
        grouped: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
        for r in runs:
            for tokens, rec in r.get("steps", ()):
                grouped[tokens].append(rec)
        if not grouped:
            continue
        lines.append(f"{arm}: steps by the tokens their forward computed (medians over {len(runs)} runs' steps, ms)")
        for tokens in sorted(grouped, key=lambda n: -len(grouped[n]))[:shapes]:
            recs = grouped[tokens]
            medians = {k: statistics.median(x.get(k, 0.0) for x in recs) for k in {k for rec in recs for k in rec}}
            parts = ", ".join(f"{k} {ms * 1e3:.3f}" for k, ms in sorted(medians.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {tokens} tokens: {len(recs)} steps; {parts}")
    return lines


def report(arms: dict[str, list[dict]]) -> list[str]:
    lines = []
    for arm, runs in arms.items():
        steps = max(1, runs[0]["calls"].get("execute_model", 1))
        lines.append(
            f"{arm}: run wall median {statistics.median(r['wall_s'] for r in runs):.3f} s "
            f"({len(runs)} runs), {steps} engine steps per run"
        )
        if all("forward_at" in r for r in runs):
            shape, count, _ = runs[0]["forward_at"]
            lines.append(
                f"  forward at {shape} tokens (the commonest step, {count} in run 1): median over runs "
                f"{statistics.median(r['forward_at'][2] for r in runs) * 1e3:.3f} ms"
            )
        processes = sorted({r["process"] for r in runs if "process" in r})
        if len(processes) > 1:  # each process's own medians: how far one engine differs from the next
            per = []
            for p in processes:
                mine = [r for r in runs if r.get("process") == p]
                forward = [r["forward_at"][2] for r in mine if "forward_at" in r]
                per.append(
                    f"{statistics.median(r['wall_s'] for r in mine):.3f} s"
                    + (f" / {statistics.median(forward) * 1e3:.3f} ms" if forward else "")
                )
            lines.append(f"  per process (run wall / forward at the commonest step): {', '.join(per)}")
        names = sorted(runs[0]["spent"], key=lambda k: -runs[0]["spent"][k])
        for name in names:
            per_step = statistics.median(
                r["spent"].get(name, 0.0) / max(1, r["calls"].get("execute_model", 1)) for r in runs
            )
            lines.append(
                f"  {name:32s} {per_step * 1e3:7.3f} ms/step ({runs[0]['calls'].get(name, 0) / steps:.2f} calls/step)"
            )
    return lines


def main() -> None:
    ap = workload_parser(__doc__.split("\n\n")[0], workload="code-completion", num_prompts=64, batch=32)
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per arm, alternating (default 2)")
    ap.add_argument(
        "--log-stats", action="store_true", help="vLLM's stats on (disable_log_stats=False), as `vllm-graft bench` runs"
    )
    ap.add_argument(
        "--by-shape",
        action="store_true",
        help="also each method's median time in a step of each of the commonest step shapes (tokens computed)",
    )
    a = ap.parse_args()
    settings = {"by_shape": a.by_shape, "log_stats": a.log_stats, **workload_settings(a)}
    arms: dict[str, list[dict]] = {"plugin": [], "plain": []}
    for process in range(a.rounds):
        for arm, graft in (("plugin", True), ("plain", False)):
            runs = run_in_child(_child, a.deployment, graft, settings, what=f"{a.deployment}: the {arm} engine")
            arms[arm] += [{**r, "process": process} for r in runs]
    print("\n".join(report(arms) + (by_shape(arms) if a.by_shape else [])))


if __name__ == "__main__":
    main()
