"""MoE-layer time in vLLM's CPU engine: plain top-2 vs dynamic-topk, with pruned slots computed
with weight 0 (the route before the skip) and left out (the skip). Issue 21.

What is timed: vLLM's own MoE layer of ``models/shapes/mixtral-110m`` (hidden 512, 8 experts of
intermediate 1024, top-2; 8 layers; random weights, ``load_format: dummy``), float32, eager: the
``experts`` module of layer 0 of the model vLLM built (``MoERunner._forward_impl``: router, then
``RoutedExperts.forward_modular``, vLLM's quant method and ``cpu_fused_moe``), one engine, the
arms interleaved on the same layer and weights:

  plain     the model's own top-2: the runner with vLLM's ``CPURouter`` and the experts' own path
  weight-0  dynamic-topk routing, pruned slots computed with weight 0 (``graft_skip`` off; in an
            engine: ``VLLM_GRAFT_MOE_SKIP=0``)
  skip-all  dynamic-topk routing, pruned slots left out in every layer call (``VLLM_GRAFT_MOE_SKIP=1``)
  skip      the default: left out in layer calls with at least 32 pruned slots, else weight-0

Router logits: the ones the bundled trained ``graft-tiny-mixtral`` (top-2 of 8, the same routing
shape) computes in its 4 MoE layers on the bench's chat and code-completion prompts (recorded
with a forward pre-hook on its MoE layers, plain vLLM, greedy), pooled; dummy weights give
near-uniform logits, under which dynamic-topk prunes nothing. Each call takes a window of
``T`` consecutive recorded tokens (a fixed list of windows, the same for every arm); ``T=8``
is a decode step of 8 sequences, ``T=512`` a prefill chunk. The hidden states are random.

Also printed: the share of slots pruned in the windows, whether skip and weight-0 outputs are
bit-identical on every window, and the layer time split into routing (``select_experts``) and
experts (``forward_modular``).

    .venv/bin/python benchmarks/moe_skip.py [--tokens 8,512] [--repeat 9] [--calls 16]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_skip.py --kernel    # the experts only

``--kernel`` times the experts alone, without an engine: vLLM's ``cpu_fused_moe`` (the kernel
``CPUUnquantizedExperts.apply`` calls) on prepacked random weights of the same shape, with the
same routings (plain: softmax top-2, renormalised; dynamic-topk: the plugin's reference), the
skip through the adapter's own ``run_kept``; its thread count follows ``OMP_NUM_THREADS`` (the
engine's in-process worker binds its own), so the work can be timed on one thread, where the
shared machine's scheduling delays at each parallel region's barrier do not enter.

Each round runs every arm, in rotating order, over the same ``--calls`` windows, timing every
call. Printed per arm: the median over rounds of the mean call time, and the "best" time (each
window's fastest round, averaged over windows: on a shared machine other jobs only add time). The
machine is shared: compare arms of one run, and repeat runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "graft-tiny-mixtral"
SHAPE = ROOT / "models" / "shapes" / "mixtral-110m"


def _shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def record_logits(num_prompts: int, max_tokens: int) -> torch.Tensor:
    """Router logits ``[N, 8]`` of graft-tiny-mixtral's MoE layers on the bench prompts."""
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    from vllm_graft.tools.workloads import Tokenizer, build

    sets = build(["chat", "code-completion"], Tokenizer.from_model(TINY), num_prompts=num_prompts,
                 max_tokens=max_tokens, max_model_len=2048)
    prompts = [{"prompt_token_ids": list(p.token_ids)} for s in sets for p in s.prompts]
    llm = LLM(model=str(TINY), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0)
    seen: list[torch.Tensor] = []
    try:
        layers = llm.apply_model(lambda m: [x for x in m.modules() if isinstance(x, MoERunnerInterface)])[0]
        hooks = [layer.register_forward_pre_hook(lambda mod, args: seen.append(args[1].detach().float().clone()))
                 for layer in layers]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        for h in hooks:
            h.remove()
    finally:
        _shutdown(llm)
    return torch.cat(seen)


def _report(T, pruned, same, arms, times, repeat, calls, parts=None) -> None:
    def med(v):  # median over rounds of the mean over windows
        return statistics.median(statistics.fmean(rnd) for rnd in v)

    def best(v):  # mean over windows of the fastest round (noise on a shared machine only adds)
        return statistics.fmean(min(col) for col in zip(*v))

    print(f"T={T} tokens per call: {pruned:.1%} of slots pruned by dynamic-topk; skip, skip-all == weight-0 "
          f"bit for bit on all {calls} windows: {same}")
    extra = f" {'routing':>8s} {'experts':>8s}" if parts else ""
    print(f"  {'arm':9s} {'median ms':>9s} {'vs plain':>8s} {'best ms':>8s} {'vs plain':>8s}{extra}   (ms per "
          f"call; median of {repeat} rounds x {calls} calls; best: each call's fastest round)")
    p_med, p_best = med(times["plain"]), best(times["plain"])
    for a in arms:
        m, b = med(times[a]), best(times[a])
        tail = f" {1e3 * best(parts[0][a]):8.3f} {1e3 * best(parts[1][a]):8.3f}" if parts else ""
        print(f"  {a:9s} {1e3 * m:9.3f} {p_med / m:7.2f}x {1e3 * b:8.3f} {p_best / b:7.2f}x{tail}")


def kernel_only(args, logits: torch.Tensor) -> None:
    """The experts alone: vLLM's cpu_fused_moe at the shape, the same routings and windows."""
    import json

    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from vllm_graft.integration.adapters.moe.engine import SKIP_MIN_DEFAULT
    from vllm_graft.integration.adapters.moe.skip import run_kept
    from vllm_graft.plugins.moe.dynamic_topk.reference import dynamic_topk

    cfg = json.loads((SHAPE / "config.json").read_text())
    H, I, E, k = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], cfg["num_experts_per_tok"]
    g = torch.Generator().manual_seed(0)
    w13 = cpu_prepack_moe_weight(torch.randn(E, 2 * I, H, generator=g) * 0.02, "vec")
    w2 = cpu_prepack_moe_weight(torch.randn(E, H, I, generator=g) * 0.02, "vec")

    def kernel(x, w, ids):
        out = torch.empty(x.shape[0], H)
        cpu_fused_moe(out, x, w13, w2, None, None, w.contiguous(), ids.to(torch.int32).contiguous(), "silu", "vec")
        return out

    threshold = 0.8 if args.threshold is None else args.threshold
    print(f"vLLM cpu_fused_moe at the shape of {SHAPE.name} (hidden {H}, {E} experts, intermediate {I}, "
          f"top-{k}), float32, {torch.get_num_threads()} threads; dynamic-topk mass threshold {threshold}; "
          f"router logits: graft-tiny-mixtral, {logits.shape[0]} token x layer rows")
    arms = ["plain", "weight-0", "skip-all", "skip"]
    for T in [int(t) for t in args.tokens.split(",")]:
        starts = torch.randint(0, logits.shape[0] - T, (args.calls,), generator=g).tolist()
        x = torch.randn(T, H, generator=g)
        cases = []
        for s0 in starts:
            lg = logits[s0:s0 + T]
            pw, pid = lg.softmax(-1).topk(k, dim=-1)
            dw, did, _ = dynamic_topk(lg, k, True, threshold=threshold)
            cases.append(((pw / pw.sum(-1, keepdim=True)).contiguous(), pid.int().contiguous(),
                          dw.contiguous(), did.int().contiguous()))
        pruned = float(torch.cat([c[2] for c in cases]).eq(0).float().mean())

        def call(a, c):
            if a == "plain":
                return kernel(x, c[0], c[1])
            if a == "weight-0":
                return kernel(x, c[2], c[3])
            done = run_kept(x, c[2], c[3], kernel, min_pruned=1 if a == "skip-all" else SKIP_MIN_DEFAULT)
            return kernel(x, c[2], c[3]) if done is None else done[0]

        same = all(torch.equal(call("skip-all", c), call("weight-0", c)) and torch.equal(call("skip", c), call("weight-0", c))
                   for c in cases)
        times = {a: [] for a in arms}
        for r in range(args.repeat):
            for a in arms[r % len(arms):] + arms[:r % len(arms)]:
                ts = []
                for c in cases:
                    t0 = time.perf_counter()
                    call(a, c)
                    ts.append(time.perf_counter() - t0)
                times[a].append(ts)
        _report(T, pruned, same, arms, times, args.repeat, args.calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8,512", help="tokens per layer call (comma-separated)")
    ap.add_argument("--repeat", type=int, default=9, help="rounds (medians over rounds)")
    ap.add_argument("--calls", type=int, default=16, help="layer calls per arm and round")
    ap.add_argument("--threshold", type=float, default=None, help="dynamic-topk threshold (default: the plugin's)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload for the logits")
    ap.add_argument("--kernel", action="store_true", help="time the experts alone (cpu_fused_moe), no engine")
    args = ap.parse_args()

    logits = record_logits(args.prompts, 32)
    if args.kernel:
        return kernel_only(args, logits)

    from vllm import LLM
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from vllm_graft.hooks import Kind
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.adapters.moe.engine import SKIP_MIN_DEFAULT, GraftRouter
    from vllm_graft.integration.plan import plan_for
    from vllm_graft.integration.runtime import RUNTIME

    params = {} if args.threshold is None else {"threshold": args.threshold}
    plan = plan_for({"model": str(SHAPE),
                     "engine": {"dtype": "float32", "max_model_len": 2048, "load_format": "dummy"},
                     "moe": [{"plugin": "dynamic-topk", "params": params}]})
    llm = LLM(**launch.llm_kwargs(plan), seed=0)
    runner = None
    try:
        runner = sorted(llm.apply_model(lambda m: [x for x in m.modules() if isinstance(x, MoERunner)])[0],
                        key=lambda r: r.layer_name)[0]
        assert isinstance(runner.router, GraftRouter), type(runner.router)
        graft_router, experts = runner.router, runner.routed_experts
        inst = RUNTIME.instances[(Kind.MOE, "dynamic-topk")]
        config = llm.llm_engine.vllm_config
        H = experts.hidden_size

        def arm(name: str) -> None:
            runner.router = graft_router.inner if name == "plain" else graft_router
            experts.graft_skip = name.startswith("skip")
            experts.graft_skip_min = 1 if name == "skip-all" else SKIP_MIN_DEFAULT

        print(f"vLLM MoE layer {runner.layer_name} of {SHAPE.name} (hidden {H}, {experts.global_num_experts} "
              f"experts, intermediate {experts.intermediate_size_per_partition}, top-{experts.top_k}), float32, "
              f"{torch.get_num_threads()} threads; dynamic-topk {inst.params.criterion} threshold "
              f"{inst.params.threshold}; router logits: graft-tiny-mixtral, {logits.shape[0]} token x layer rows")
        g = torch.Generator().manual_seed(0)
        arms = ["plain", "weight-0", "skip-all", "skip"]
        for T in [int(t) for t in args.tokens.split(",")]:
            starts = torch.randint(0, logits.shape[0] - T, (args.calls,), generator=g).tolist()
            windows = [logits[s:s + T].contiguous() for s in starts]
            x = torch.randn(T, H, generator=g)
            w_all = torch.cat([inst.route(0, lg, experts.top_k, True)[0] for lg in windows])
            pruned = float((w_all == 0).float().mean())
            with torch.inference_mode(), set_forward_context(None, config):
                same = True
                for lg in windows:  # warm-up, and the exactness check
                    outs = {}
                    for a in arms:
                        arm(a)
                        outs[a] = runner._forward_impl(x, lg, None).clone()
                    same &= torch.equal(outs["skip"], outs["weight-0"]) and torch.equal(outs["skip-all"], outs["weight-0"])
                # per arm: [round][window] seconds, for the layer, its routing and its experts
                layer = {a: [] for a in arms}
                route = {a: [] for a in arms}
                kern = {a: [] for a in arms}
                for r in range(args.repeat):
                    for a in arms[r % len(arms):] + arms[:r % len(arms)]:
                        arm(a)
                        lt, rt, kt = [], [], []
                        for lg in windows:
                            t0 = time.perf_counter()
                            runner._forward_impl(x, lg, None)
                            t1 = time.perf_counter()
                            w, ids = runner.router.select_experts(x, lg)
                            t2 = time.perf_counter()
                            experts.forward_modular(x, w, ids)
                            t3 = time.perf_counter()
                            lt.append(t1 - t0)
                            rt.append(t2 - t1)
                            kt.append(t3 - t2)
                        layer[a].append(lt)
                        route[a].append(rt)
                        kern[a].append(kt)

            _report(T, pruned, same, arms, layer, args.repeat, args.calls, parts=(route, kern))
    finally:
        if runner is not None:
            runner.router = graft_router
            experts.graft_skip, experts.graft_skip_min = True, SKIP_MIN_DEFAULT
        _shutdown(llm)


if __name__ == "__main__":
    main()
