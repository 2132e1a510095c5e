"""Where a `swift` draft step's time goes, against one plain vLLM decode step, at batch 1.

    .venv/bin/python benchmarks/swift_draft.py [DEPLOYMENT] [--workload code-completion]
        [--max-tokens 64] [--repeat 50]

DEPLOYMENT defaults to ``deployments/spec-swift.yaml``. Two fresh child processes (the plain
twin, then the deployment; ``vllm-graft bench`` builds both arms the same way) each start the
engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), generate the workload's first prompt
once to warm up (the swift arm also searches its skip set then), and then generate it again one
``LLMEngine.step()`` at a time (greedy, ``ignore_eos``), timing every step. The swift arm also
times each ``propose`` call (the whole draft: feeding the tokens the draft has not seen, then
one forward per further draft) inside its steps.

Then, in the swift arm, on the draft model's cache as the request left it, the draft forward's
pieces (medians of ``--repeat`` calls, milliseconds, one token at a time as in drafting):
``forward``: one whole draft forward of one token; ``full eager``: the same with nothing
skipped (the target model run through the draft's code); per sub-layer kind the run ones'
total (norm + projections + attention or MLP) and the final norm + LM head; ``draft loop``:
what a ``propose`` costs beyond its forwards (softmax / argmax / host reads); ``prompt feed``:
the draft's prefill of the whole prompt (once per request, inside its first ``propose``).

The figures are per-process medians on this machine's torch threads: run it under the CPU lock
(``flock /tmp/h/cpu.lock``) with nothing else running, or say that the machine was loaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import ROOT, child_engine_setup, run_in_child  # noqa: E402
from _timing import median_ms  # noqa: E402


def _child(path: str, graft: bool, settings: dict, out) -> None:
    launch, plan, ps = child_engine_setup(path, settings["workload"], 1, settings["max_tokens"])
    from vllm import SamplingParams

    prompt_ids = list(ps.prompts[0].token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], ignore_eos=True)
    row: dict = {"prompt_tokens": len(prompt_ids)}
    with launch.in_process_engine(plan, graft=graft) as llm:
        llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)  # warm-up (and search)
        llm.reset_prefix_cache()
        plugin = None
        if graft:
            from vllm_graft.hooks import Kind
            from vllm_graft.integration.runtime import RUNTIME

            (e,) = RUNTIME.enabled(Kind.SPECULATIVE)
            plugin = RUNTIME.instance(e)
        calls: list[float] = []
        if plugin is not None:
            original = plugin.propose

            def timed(*a, **k):
                t = time.perf_counter()
                r = original(*a, **k)
                calls.append(time.perf_counter() - t)
                return r

            plugin.propose = timed
            forwards0 = plugin.stats["draft_forwards"]
        engine = llm.llm_engine
        engine.add_request("timed", {"prompt_token_ids": prompt_ids}, params)
        steps = []  # (seconds, propose seconds in the step)
        while engine.has_unfinished_requests():
            n_calls = len(calls)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            steps.append((dt, sum(calls[n_calls:])))
        if plugin is not None:
            plugin.propose = original
            row["draft_forwards"] = plugin.stats["draft_forwards"] - forwards0
            row["describe"] = {k: v for k, v in plugin.describe().items() if k in ("skipped_sublayers", "search")}
            row["pieces"] = _pieces(plugin, prompt_ids, settings["repeat"])
    # the first step prefills the prompt (and samples the first token)
    decode = steps[1:]
    row.update(
        prefill_ms=steps[0][0] * 1e3,
        first_propose_ms=steps[0][1] * 1e3,
        decode_steps=len(decode),
        decode_tokens=settings["max_tokens"] - 1,  # the prefill step samples the first
        step_ms=statistics.median(s[0] for s in decode) * 1e3,
        max_step_ms=max(s[0] for s in decode) * 1e3,
        decode_s=sum(s[0] for s in decode),
        propose_ms=statistics.median(s[1] for s in decode) * 1e3 if graft else 0.0,
        propose_s=sum(s[1] for s in decode),
    )
    out.send(row)


def _pieces(plugin, prompt_ids: list[int], repeat: int) -> dict:
    """Medians (ms) of the draft forward and its pieces at the request's context."""
    import torch

    from vllm_graft.plugins.speculative.swift.reference import DraftCache, rms_norm

    d, skip = plugin.decoder, plugin.skip
    w = d.w
    pieces: dict[str, float] = {}
    cache = DraftCache(skip)
    d.forward(prompt_ids, skip, cache)
    full = DraftCache(frozenset())
    d.forward(prompt_ids, frozenset(), full)
    n = len(cache)
    tok = [prompt_ids[-1]]

    def one(c: DraftCache, s: frozenset) -> None:
        d.forward(tok, s, c)
        c.truncate(n)

    pieces["forward"] = median_ms(lambda: one(cache, skip), repeat, warmup=3)
    pieces["full eager"] = median_ms(lambda: one(full, frozenset()), repeat, warmup=3)
    pieces["prompt feed"] = median_ms(lambda: d.forward(prompt_ids, skip, DraftCache(skip)), max(3, repeat // 10))

    with torch.inference_mode():
        ids = torch.tensor(tok, dtype=torch.long)
        h = d.embed(ids)
        positions = torch.tensor([n])
        cos2 = sin2 = None
        if w.rope_cos_sin is not None or w.rope is None:  # as SkipDecoder.forward rotates
            cos2, sin2 = d.rotation(positions, h.dtype, n + 1)
        pieces["rotation (once per forward)"] = median_ms(
            lambda: d.rotation(positions, h.dtype, n + 1), repeat, warmup=3
        )
        pieces["embed"] = median_ms(lambda: d.embed(ids), repeat, warmup=3)
        attn = mlp = norm = 0.0
        n_attn = n_mlp = 0
        for i in range(d.num_layers):
            layer = w.layers[i]
            x = rms_norm(h, layer.input_norm, w.rms_norm_eps)
            norm += 2 * median_ms(lambda: rms_norm(h, layer.input_norm, w.rms_norm_eps), repeat, warmup=3)
            if 2 * i not in skip:
                n_attn += 1

                def a(i=i, x=x) -> None:
                    d.attention(i, x, positions, cos2, sin2, cache, n, None)
                    cache.truncate(n)

                attn += median_ms(a, repeat, warmup=3)
            if 2 * i + 1 not in skip:
                n_mlp += 1
                mlp += median_ms(lambda i=i, x=x: d.mlp(i, x), repeat, warmup=3)
        pieces[f"attention x{n_attn}"] = attn
        pieces[f"mlp x{n_mlp}"] = mlp
        pieces[f"rms norms (x{2 * d.num_layers - len(skip)} run)"] = (
            norm / 2 * (2 * d.num_layers - len(skip)) / d.num_layers
        )
        pieces["final norm + lm head"] = median_ms(
            lambda: w.lm_head(rms_norm(h, w.final_norm, w.rms_norm_eps)), repeat, warmup=3
        )
        logits = d.forward(tok, skip, cache)[-1]
        cache.truncate(n)

        def loop() -> None:
            probs = torch.softmax(logits, dim=-1)
            top_p, top = probs.max(dim=-1)
            float(top_p), int(top)

        pieces["draft loop (softmax, max, reads)"] = median_ms(loop, repeat, warmup=3)
        x = rms_norm(h, w.layers[1].input_norm, w.rms_norm_eps)
        pieces["one qkv projection"] = median_ms(lambda: w.layers[1].qkv(x), repeat, warmup=3)
    return pieces


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("deployment", nargs="?", default=str(ROOT / "deployments" / "spec-swift.yaml"))
    ap.add_argument("--workload", default="code-completion")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=50)
    a = ap.parse_args(argv)
    settings = {"workload": a.workload, "max_tokens": a.max_tokens, "repeat": a.repeat}
    plain = run_in_child(_child, a.deployment, False, settings, what="the plain engine")
    swift = run_in_child(_child, a.deployment, True, settings, what="the swift engine")
    print(
        f"# {a.deployment}: {a.workload}, first prompt ({plain['prompt_tokens']} tokens), {a.max_tokens} tokens, batch 1"
    )
    print()
    print(
        "| arm | decode steps | tokens | median step ms | slowest step ms | ms / token | median propose ms | propose share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in (("plain", plain), ("swift", swift)):
        per_tok = r["decode_s"] / max(1, r["decode_tokens"]) * 1e3
        share = f"{r['propose_s'] / r['decode_s'] * 100:.0f}%" if r["propose_s"] else "-"
        print(
            f"| {name} | {r['decode_steps']} | {r['decode_tokens']} | {r['step_ms']:.2f} | {r['max_step_ms']:.1f} | {per_tok:.2f} "
            f"| {r['propose_ms']:.2f} | {share} |"
        )
    fwd = swift["draft_forwards"]
    print()
    print(
        f"swift: {fwd} draft forwards in {swift['decode_steps'] + 1} proposes; prefill step "
        f"{swift['prefill_ms']:.1f} ms (its propose {swift['first_propose_ms']:.1f} ms) against plain's "
        f"{plain['prefill_ms']:.1f} ms; {swift['describe']}"
    )
    print()
    print("| draft piece (swift arm, one token) | ms |")
    print("|---|---:|")
    for k, v in swift["pieces"].items():
        print(f"| {k} | {v:.3f} |")
    print(f"| plain decode step (engine, above) | {plain['step_ms']:.3f} |")


if __name__ == "__main__":
    main()
