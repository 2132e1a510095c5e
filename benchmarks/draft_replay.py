"""Replay a workload's greedy outputs through speculative proposers, without an engine: how many
tokens each decode step would produce and compute, per arm, on exactly the same text.

    .venv/bin/python benchmarks/draft_replay.py ARM [ARM ...] [--workload extractive]
        [--num-prompts 64] [--max-tokens 64] [--batch 32] [--step-ms A,B]

An ARM is a deployment YAML with a graft ``speculative:`` plugin that drafts chains from the text
alone (not ``adaptive``, whose choices follow measured step times the replay does not have:
replay the proposer it wraps), or ``vllm-suffix`` (vLLM's
``suffix`` method driven as ``v1/spec_decode/suffix_decoding.py`` drives Arctic Inference's
``SuffixDecodingCache``, with vLLM's defaults: tree depth 24, up to 24 drafts, spec factor 1.0,
min token probability 0.1), or ``vllm-suffix:K`` (at most K drafts).

The greedy outputs come from plain vLLM once (a child process, in-process engine, greedy, end of
sequence honoured, as the bench runs) and are kept in ``--cache`` (default under /tmp) for the next
call. Then each arm replays them as the engine would run them at ``--batch`` requests in flight (the
next request starts when one ends): each decode step, every live request proposes from its prompt
and the output so far, the drafts' longest prefix equal to the true output is accepted, plus the
one token the target adds. A draft is at most the output tokens left (the engine would verify a
longer one and drop the rest). The proposer sees the calls the adapter makes (``begin_step``,
``accepted`` then ``propose`` per request, ``finish``). The prompts' prefill steps (one token each)
are left out: they are the same for every arm.

Printed per arm: decode steps, tokens computed (requests + drafts verified) and produced per
request-step, the drafts' acceptance, the proposer's own time, and a *modelled* decode time
``sum over steps of (A + B x tokens computed)`` with ``--step-ms A,B`` (milliseconds; default from
``step_log.py`` on this machine's CPU engine at batch 32: a plain 32-token step 8-9 ms, a
138-token drafting step 20 ms), as a ratio to plain. The model is a guide for choosing what to run
in the engine, not a figure: the bench's wall-clock ratio decides.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import child_engine_setup, run_in_child  # noqa: E402

PLAIN = str(Path(__file__).resolve().parent.parent / "deployments" / "plain.yaml")


def _greedy_child(path: str, graft: bool, settings: dict, out) -> None:
    launch, plan, ps = child_engine_setup(path, settings["workload"], settings["num_prompts"], settings["max_tokens"])
    from vllm import SamplingParams

    prompts = [list(p.token_ids) for p in ps.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"])
    with launch.in_process_engine(plan, graft=False, max_num_seqs=settings["batch"]) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out.send([{"prompt": p, "output": list(o.outputs[0].token_ids)} for p, o in zip(prompts, outs)])


def cache_path(workload: str, num_prompts: int, max_tokens: int) -> Path:
    """Where the greedy outputs of a workload are kept between calls (``--cache``'s default)."""
    return Path(f"/tmp/graft-replay-{workload}-{num_prompts}x{max_tokens}.json")


def greedy_texts(settings: dict, cache: Path) -> list[dict]:
    if cache.exists():
        return json.loads(cache.read_text())
    texts = run_in_child(_greedy_child, PLAIN, False, settings, what="the plain greedy run")
    cache.write_text(json.dumps(texts))
    return texts


class SuffixArm:
    """vLLM's ``suffix`` drafter's calls into ``SuffixDecodingCache`` (see the module docstring)."""

    def __init__(self, k: int = 24, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
        self.k, self.depth, self.factor, self.min_prob = k, depth, factor, min_prob
        self.seen: dict[str, int] = {}

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> None:
        return None

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        pass

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int, prompt_len: int) -> list[int]:
        import numpy as np

        if request_id not in self.cache.active_requests:
            self.cache.start_request(request_id, np.asarray(token_ids[:prompt_len], dtype=np.int32))
            self.seen[request_id] = prompt_len
        new = token_ids[self.seen[request_id] :]
        self.seen[request_id] = len(token_ids)
        self.cache.add_active_response(request_id, list(new))
        pattern = np.asarray(token_ids[-self.depth :], dtype=np.int32)
        draft = self.cache.speculate(
            request_id,
            pattern,
            max_spec_tokens=min(self.k, max_tokens),
            max_spec_factor=self.factor,
            min_token_prob=self.min_prob,
        )
        return list(draft.token_ids)

    def finish(self, request_id: str) -> None:
        self.cache.stop_request(request_id)


def speculative_plugin(path: str, what: str = "replay") -> tuple[Any, Any]:
    """The deployment's enabled speculative plugin (validated, as the runtime gets it) and an
    instance of it, built from the registry as the runtime builds it."""
    from vllm_graft.hooks import Kind
    from vllm_graft.integration.plan import plan_for

    enabled = plan_for(path).by_kind(Kind.SPECULATIVE)
    if not enabled:
        raise SystemExit(f"{path}: no speculative: section (a graft proposer) to {what}")
    (e,) = enabled
    return e, e.entry.registration.load()(e.params)


class GraftArm:
    """A deployment's speculative plugin, built from the registry as the runtime builds it."""

    def __init__(self, path: str) -> None:
        e, self.impl = speculative_plugin(path)
        if e.name == "adaptive":
            raise SystemExit(
                f"{path}: adaptive chooses by measured step times, which a replay does not "
                "have; replay the proposer it wraps (its params.proposer) instead"
            )
        params = e.params
        if getattr(self.impl, "drafts_trees", False) or getattr(self.impl, "topk", 0):
            raise SystemExit(f"{path}: replay drafts chains from text alone (no trees, no target top-k)")
        self.k = int(getattr(params, "num_speculative_tokens", 4))

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> Any:
        return self.impl.begin_step(num_requests, num_tokens)

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        self.impl.accepted(request_id, num_accepted, num_verified)

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int, prompt_len: int) -> list[int]:
        return list(self.impl.propose(request_id, token_ids, min(self.k, max_tokens)))[:max_tokens]

    def finish(self, request_id: str) -> None:
        self.impl.finish(request_id)


def replay(arm: Any, texts: list[dict], batch: int, step_ms: tuple[float, float]) -> dict:
    """Run the texts through ``arm`` at ``batch`` requests in flight; totals over decode steps."""
    queue = deque(range(len(texts)))
    live: dict[int, int] = {}  # text index -> output tokens produced so far
    last: dict[int, tuple[int, int]] = {}  # text index -> (accepted, verified) of its previous step
    steps = computed = produced = drafted = accepted_total = 0
    model_s = propose_s = 0.0
    prev_tokens = 0
    while queue or live:
        while queue and len(live) < batch:
            i = queue.popleft()
            live[i] = 1  # the prefill step produced the first token
            if len(texts[i]["output"]) <= 1:
                live.pop(i)
        if not live:
            continue
        t = time.perf_counter()
        on = arm.begin_step(len(live), prev_tokens)
        drafts: dict[int, list[int]] = {}
        for i, pos in live.items():
            rid = str(i)
            if i in last:
                arm.accepted(rid, *last.pop(i))
            out = texts[i]["output"]
            if on is False:
                drafts[i] = []
                continue
            ctx = texts[i]["prompt"] + out[:pos]
            drafts[i] = arm.propose(rid, ctx, len(out) - pos, len(texts[i]["prompt"]))
        propose_s += time.perf_counter() - t
        step_tokens = step_produced = 0
        for i, d in drafts.items():
            out, pos = texts[i]["output"], live[i]
            n = 0
            while n < len(d) and pos + n < len(out) and d[n] == out[pos + n]:
                n += 1
            gained = min(n + 1, len(out) - pos)
            if d:
                last[i] = (n, len(d))
            live[i] = pos + gained
            step_tokens += 1 + len(d)
            step_produced += gained
            drafted += len(d)
            accepted_total += n
        steps += 1
        computed += step_tokens
        produced += step_produced
        prev_tokens = step_tokens
        model_s += (step_ms[0] + step_ms[1] * step_tokens) / 1e3
        for i in [i for i, pos in live.items() if pos >= len(texts[i]["output"])]:
            live.pop(i)
            last.pop(i, None)
            arm.finish(str(i))
    return {
        "steps": steps,
        "computed": computed,
        "produced": produced,
        "drafted": drafted,
        "accepted": accepted_total,
        "model_s": model_s,
        "propose_s": propose_s,
    }


class PlainArm:
    def begin_step(self, num_requests: int, num_tokens: int = 0) -> bool:
        return False

    def accepted(self, *a) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arms", nargs="+", help="deployment YAML files, vllm-suffix or vllm-suffix:K")
    ap.add_argument("--workload", default="extractive")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--step-ms", default="5.0,0.108", help="modelled step time A + B x tokens, in ms")
    ap.add_argument("--cache", default=None, help="greedy outputs file (default under /tmp)")
    args = ap.parse_args(argv)
    a, b = (float(x) for x in args.step_ms.split(","))
    settings = {
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "batch": max(args.batch, 8),
    }
    cache = Path(args.cache) if args.cache else cache_path(args.workload, args.num_prompts, args.max_tokens)
    texts = greedy_texts(settings, cache)
    base = replay(PlainArm(), texts, args.batch, (a, b))
    print(
        f"{args.workload}, {len(texts)} prompts, batch {args.batch}, modelled step {a} + {b} x tokens ms; "
        f"plain: {base['steps']} steps, {base['produced']} tokens, {base['model_s'] * 1e3:.0f} ms modelled"
    )
    print(f"{'arm':40} {'steps':>6} {'comp/rs':>8} {'prod/rs':>8} {'accept':>7} {'propose ms':>10} {'x plain':>8}")
    for name in args.arms:
        if name.startswith("vllm-suffix"):
            k = int(name.split(":")[1]) if ":" in name else 24
            arm: Any = SuffixArm(k=k)
        else:
            arm = GraftArm(name)
        r = replay(arm, texts, args.batch, (a, b))
        rs = r["computed"] - r["drafted"]  # request-steps
        ratio = base["model_s"] / (r["model_s"] + r["propose_s"])
        print(
            f"{Path(name).stem[:40]:40} {r['steps']:>6} {r['computed'] / rs:>8.2f} {r['produced'] / rs:>8.2f} "
            f"{r['accepted'] / max(1, r['drafted']):>7.3f} {r['propose_s'] * 1e3:>10.1f} {ratio:>8.3f}"
        )


if __name__ == "__main__":
    main()
