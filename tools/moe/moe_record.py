"""Recording MoE routing in vLLM: the shared helper behind `vllm-graft moe-trace` and
`vllm-graft calibrate expert-mask` (and any tool that needs routes from the engine).

:func:`record` starts vLLM's CPU engine in this process with a deployment whose ``moe:``
list gets the ``route-trace`` plugin appended (so it sees the routing after every other MoE
plugin), runs prompt sets through it greedily (each set a named segment of the trace), and
returns the trace, the perplexity of the prompts' own text under the engine's model (teacher
forcing on the prompts, not on generated text: a routing change that hurts the model shows
here), and what each plugin reported (``describe()``).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

TRACE_PLUGIN = "route-trace"


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]  # token ids
    max_tokens: list[int]  # output budget per prompt (0: prefill only)


@dataclass
class Recording:
    trace: Any  # plugins.moe.route_trace.trace.Trace
    nll: dict[str, list[float]] = field(default_factory=dict)  # set -> per-token NLL of the prompts
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    report: list[dict[str, Any]] = field(default_factory=list)  # RUNTIME.report() after generation
    wall_s: float = 0.0

    def perplexity(self, name: str | None = None) -> float | None:
        vals = self.nll[name] if name else [x for v in self.nll.values() for x in v]
        return math.exp(sum(vals) / len(vals)) if vals else None


def with_tracer(data: dict[str, Any], *, drop_moe: bool = False, max_tokens: int = 2_000_000) -> dict[str, Any]:
    """A deployment dict with ``route-trace`` appended to its ``moe:`` list (``drop_moe``: the
    deployment's own MoE plugins removed first: plain vLLM routing, recorded)."""
    out = copy.deepcopy(data)
    moe = out.get("moe") or []
    if isinstance(moe, dict):
        moe = [moe]
    moe = [] if drop_moe else [m for m in moe if (m or {}).get("plugin") != TRACE_PLUGIN]
    out["moe"] = moe + [{"plugin": TRACE_PLUGIN, "params": {"max_tokens": max_tokens}}]
    return out


def record(
    data: dict[str, Any],
    base_dir: str | os.PathLike[str] | None,
    sets: Sequence[PromptSet],
    *,
    score: bool = True,
    batch: int = 0,
    on_phase: Callable[[str], None] | None = None,
) -> Recording:
    """Run ``sets`` through an in-process engine built from deployment dict ``data`` (with the
    tracer already in its ``moe:`` list: see :func:`with_tracer`)."""
    from vllm import SamplingParams

    from ...hooks import Kind

    from ..bench import nll_of
    from ...integration.plan import plan_for
    from ...launch.engine import start_engine
    from ...integration.runtime import RUNTIME

    say = on_phase or (lambda s: None)
    plan = plan_for(data, source="moe-record", base_dir=base_dir)
    t0 = time.perf_counter()
    say("loading the model")
    llm = start_engine(plan)
    try:
        # the plugin's RouteTrace, typed Any: tools reach plugins only through the registry
        tracer: Any = RUNTIME.instances.get((Kind.MOE, TRACE_PLUGIN))
        if tracer is None:
            raise RuntimeError("the route-trace plugin was not instantiated: no MoE layer ran it")
        tracer.reset()  # nothing before the first workload (no profiling forward is recorded)
        RUNTIME.events.clear()
        for inst in RUNTIME.instances.values():
            if hasattr(inst, "reset_stats"):
                inst.reset_stats()
        rec = Recording(trace=None)
        for s in sets:
            say(f"generating {s.name} ({len(s.prompts)} prompts)")
            tracer.recorder.begin_segment(s.name)
            outs: list[list[int]] = []
            size = batch if batch > 0 else len(s.prompts)
            for k in range(0, len(s.prompts), size):
                part = list(range(k, min(k + size, len(s.prompts))))
                params = [SamplingParams(temperature=0.0, max_tokens=max(1, s.max_tokens[i])) for i in part]
                res = llm.generate([{"prompt_token_ids": s.prompts[i]} for i in part], params, use_tqdm=False)
                outs += [list(r.outputs[0].token_ids) for r in res]
            tracer.recorder.end_segment()
            rec.outputs[s.name] = outs
        rec.report = RUNTIME.report()
        rec.trace = tracer.trace(
            {"deployment_moe": [m.get("plugin") for m in data.get("moe", [])], "segments": [s.name for s in sets]}
        )
        if score:
            tracer.reset()
            for s in sets:
                say(f"scoring {s.name}")
                params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
                res = llm.generate([{"prompt_token_ids": p} for p in s.prompts], params, use_tqdm=False)
                rec.nll[s.name] = [x for p, r in zip(s.prompts, res) for x in nll_of(r.prompt_logprobs, p, 1)]
        rec.wall_s = time.perf_counter() - t0
        return rec
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
        del llm
        gc.collect()


def workload_sets(
    model: str | os.PathLike[str],
    names: Sequence[str] | None,
    *,
    num_prompts: int,
    max_tokens: int,
    max_model_len: int,
    seed: int = 0,
) -> list[PromptSet]:
    """The bench's deterministic workloads as prompt sets."""
    from .. import workloads as W

    tok = W.Tokenizer.from_model(model)
    built = W.build(
        W.parse_names(names),
        tok,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        max_model_len=max_model_len,
        seed=seed,
    )
    return [
        PromptSet(ps.name, [list(p.token_ids) for p in ps.prompts], [p.max_tokens for p in ps.prompts]) for ps in built
    ]


def text_sets(model: str | os.PathLike[str], named: dict[str, Sequence[str]]) -> list[PromptSet]:
    """Prompt sets from texts (prefill only: routes of the prompts themselves)."""
    from .. import workloads as W

    tok = W.Tokenizer.from_model(model)
    out = []
    for name, texts in named.items():
        ids = [tok.encode(t) for t in texts]
        ids = [i for i in ids if len(i) >= 2]
        out.append(PromptSet(name, ids, [0] * len(ids)))
    return out


def read_prompt_file(path: str | os.PathLike[str]) -> list[str]:
    """Prompts from a file: a JSON list of strings, or text with prompts separated by lines
    holding only ``---``."""
    import json

    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ValueError(f"{path}: expected a JSON list of strings")
        return [x for x in data if x.strip()]
    parts: list[str] = []
    cur: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.strip() == "---":
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(line)
    parts.append("".join(cur))
    return [p.strip("\n") for p in parts if p.strip()]
