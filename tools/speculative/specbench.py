"""`vllm-graft specbench`: the speculative proposers side by side, in one run.

Arms (deployment files, default from ``deployments/``): ``plain`` (no speculation),
``vllm-ngram`` (vLLM's built-in ``ngram`` proposer, set through the deployment's ``engine:
speculative_config``; no graft plugin) and one per graft proposer (``spec-<name>.yaml``); any
registered proposer without such a file (a third party's), or ``NAME:{JSON}``, runs on
``plain.yaml``'s model with that plugin and its parameters (``--params``).
Each (arm, workload) pair gets a fresh in-process vLLM engine in its own spawned process,
so no proposer learns from another workload, and runs, in order, on disjoint prompts of the workload:

* warm-up (not reported): ``--b1-prompts`` requests one after another, then as many at once;
* batch 1: ``--b1-prompts`` requests one after another;
* batch B for each ``--batch`` B > 1: B requests submitted together (one ``generate``).

Workloads: those of :mod:`.workloads` (``code-completion``, ``extractive``, ``chat``...),
greedy; and ``parallel-sampling``: code-completion prompts with ``n=8`` samples each at
temperature 0.8 (batch B = B/8 prompts x 8 samples; batch 1 = one prompt x 8).

Figures, per arm, workload and batch (vLLM's own counters, ``LLM.get_metrics()``, as
differences around each run):

* ``acc_per_verify``: accepted draft tokens / verify steps (``vllm:spec_decode_num_accepted_
  tokens`` / ``vllm:spec_decode_num_drafts``: steps in which a request had drafts checked);
* ``fwd_per_token``: target forward passes per output token = (output tokens - accepted
  drafts) / output tokens (each step a request takes part in is one target forward pass for
  it and yields its accepted drafts plus one token; 1.0 without speculation);
* ``tok_s``: output tokens / wall time of the run; ``speedup`` = tok_s / plain's tok_s at
  the same batch and workload;
* ``identical``: greedy workloads: every request's output tokens equal plain's.

All arms run with ``enforce_eager`` (no torch.compile), as the graft speculative adapter's
e2e tests do; timings on a shared CPU are noisy (``--repeat`` is not offered: run it twice).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Sequence

from ..command_line import CommaLists, add_comma_list, tool_parser

DEFAULT_ARMS = ("plain", "vllm-ngram", "token-recycling", "lookahead", "pooled-ngram", "adaptive")
DEFAULT_WORKLOADS = ("code-completion", "extractive", "chat", "parallel-sampling")
PARALLEL = "parallel-sampling"
N_SAMPLES = 8
COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}


#: The folder arms are named in (``--deployments``; the environment carries it to the spawned
#: engine processes): ``deployments/`` by default, ``deployments/smollm2`` for the real model.
ARMS_DIR_ENV = "VLLM_GRAFT_SPECBENCH_DEPLOYMENTS"


def arm_file(arm: str) -> Path:
    """``DIR/spec-<arm>.yaml`` (``plain``: ``DIR/plain.yaml``; DIR: ``--deployments``, default
    ``deployments/``), or ``arm`` itself when it names a ``.yaml`` file."""
    from ...launch.engine import deployments_dir

    if arm.endswith((".yaml", ".yml")):
        return Path(arm)
    folder = Path(os.environ.get(ARMS_DIR_ENV) or deployments_dir())
    return folder / ("plain.yaml" if arm == "plain" else f"spec-{arm}.yaml")


def arm_plan(arm: str, params: dict[str, Any] | None = None) -> Any:
    """The validated plan an arm runs. ``NAME`` is ``deployments/spec-NAME.yaml`` (``plain``,
    ``vllm-ngram`` and the built-in proposers have one) or a path to a ``.yaml``; any other
    registered speculative plugin (a third party's too) runs on ``deployments/plain.yaml``'s
    model and engine with ``speculative: {plugin: NAME, params}``. Parameters (``params``:
    ``--params``; a ``NAME:{JSON}`` entry's own over them) override those of the arm's graft
    proposer (a file's included; arms without one, plain and vllm-ngram, are left as they are)
    and are validated by the plugin's parameter model.
    Unknown: :class:`~vllm_graft.tools.plugin_args.PluginArgError` naming the choices."""
    from ...integration.plan import plan_for
    from ..plugin_args import PluginArgError, parse_spec, registration, validate

    name, own = parse_spec(arm) if not arm.endswith((".yaml", ".yml")) else (arm, None)
    path = arm_file(name)
    if path.is_file():
        if not (params or own):
            return plan_for(path)
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
        spec = data.get("speculative")
        if isinstance(spec, dict) and spec.get("plugin"):  # the file's proposer, its parameters overridden
            spec["params"] = validate(
                "speculative", spec["plugin"], {**(spec.get("params") or {}), **(params or {}), **(own or {})}
            )
        elif own:
            raise PluginArgError(f"arm {arm!r}: {path} enables no graft proposer to give parameters to")
        return plan_for(data, source=str(path), base_dir=path.parent)
    try:
        registration("speculative", name)
    except PluginArgError as e:
        raise PluginArgError(f"arm {arm!r}: no file {path} and {e}") from None
    merged = validate("speculative", name, {**(params or {}), **(own or {})})
    base = plan_for(arm_file("plain")).deployment
    return plan_for(
        {"model": str(base.model), "engine": dict(base.engine), "speculative": {"plugin": name, "params": merged}},
        source=f"specbench arm {arm}",
    )


def _counters(llm: Any) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is not None and hasattr(m, "value"):
            out[key] += float(m.value)
    return out


def _prompt_sets(
    tokenizer: Any, workloads: Sequence[str], total: int, max_tokens: int, max_model_len: int, seed: int
) -> dict[str, list[Any]]:
    from .. import workloads as wl

    out = {}
    for name in workloads:
        source = "code-completion" if name == PARALLEL else name
        (ps,) = wl.build(
            [source], tokenizer, num_prompts=total, max_tokens=max_tokens, max_model_len=max_model_len, seed=seed
        )
        out[name] = ps.prompts
    return out


def _runs(workload: str, b1_prompts: int, batches: Sequence[int]) -> list[tuple[int, slice, bool]]:
    """(batch, prompt slice, sequential) per run, on disjoint prompts."""
    per = (lambda b: max(1, b // N_SAMPLES)) if workload == PARALLEL else (lambda b: b)
    n1 = 1 if workload == PARALLEL else b1_prompts
    # warm-up (batch 0, not reported): the first prompts, one by one then one batch, so that
    # one-time costs (first shapes, allocations) fall outside the timed runs
    out: list[tuple[int, slice, bool]] = [(0, slice(0, n1), True), (0, slice(n1, 2 * n1), False)]
    start = 2 * n1
    out.append((1, slice(start, start + n1), True))
    start += n1
    for b in batches:
        out.append((b, slice(start, start + per(b)), False))
        start += per(b)
    return out


def prompts_needed(workloads: Sequence[str], b1_prompts: int, batches: Sequence[int]) -> int:
    return max(_runs(w, b1_prompts, batches)[-1][1].stop for w in workloads)


def run_arm(
    arm: str,
    workload: str,
    prompts: list[Any],
    *,
    b1_prompts: int,
    batches: Sequence[int],
    max_tokens: int,
    seed: int,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ...launch.engine import llm_kwargs

    plan = arm_plan(arm, params)
    kwargs = llm_kwargs(plan, graft=bool(plan.enabled), seed=seed, enforce_eager=True, disable_log_stats=False)
    llm = LLM(**kwargs)
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=8)
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], warm, use_tqdm=False)
        result: dict[str, Any] = {"runs": []}
        for batch, sl, sequential in _runs(workload, b1_prompts, batches):
            chunk = prompts[sl]
            if workload == PARALLEL:
                sampling = [
                    SamplingParams(n=N_SAMPLES, temperature=0.8, seed=seed + p.index, max_tokens=p.max_tokens)
                    for p in chunk
                ]
            else:
                sampling = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in chunk]
            inputs = [TokensPrompt(prompt_token_ids=list(p.token_ids)) for p in chunk]
            before = _counters(llm)
            t0 = time.perf_counter()
            if sequential:
                outs = [o for i, sp in zip(inputs, sampling) for o in llm.generate([i], sp, use_tqdm=False)]
            else:
                outs = llm.generate(inputs, sampling, use_tqdm=False)
            wall = time.perf_counter() - t0
            if batch == 0:
                continue  # warm-up
            after = _counters(llm)
            d = {k: after[k] - before[k] for k in COUNTERS}
            tokens = [list(c.token_ids) for o in outs for c in o.outputs]
            n_out = sum(len(t) for t in tokens)
            result["runs"].append(
                {
                    "batch": batch,
                    "requests": len(chunk),
                    "sequences": len(tokens),
                    "output_tokens": n_out,
                    "wall_s": wall,
                    "tok_s": n_out / wall if wall else 0.0,
                    **{k: int(v) for k, v in d.items()},
                    "acc_per_verify": d["accepted"] / d["drafts"] if d["drafts"] else 0.0,
                    "fwd_per_token": (n_out - d["accepted"]) / n_out if n_out else 1.0,
                    "greedy_tokens": None if workload == PARALLEL else tokens,
                }
            )
        from ...integration.runtime import RUNTIME

        result["plugins"] = RUNTIME.report() if plan.enabled else []
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def summarize(results: dict[str, dict[str, Any]], workloads: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (workload, arm): acceptance over all its runs; tok/s and speedup per batch."""
    rows = []
    for w in workloads:
        plain = results.get("plain", {}).get(w)
        for arm, per_w in results.items():
            r = per_w.get(w)
            if r is None:
                continue
            runs = r["runs"]
            acc = sum(x["accepted"] for x in runs)
            drafts = sum(x["drafts"] for x in runs)
            out = sum(x["output_tokens"] for x in runs)
            row: dict[str, Any] = {
                "workload": w,
                "arm": arm,
                "acc_per_verify": acc / drafts if drafts else 0.0,
                "fwd_per_token": (out - acc) / out if out else 1.0,
                "output_tokens": out,
            }
            identical = None
            if plain is not None and w != PARALLEL:
                identical = all(a["greedy_tokens"] == b["greedy_tokens"] for a, b in zip(runs, plain["runs"]))
                row.update(greedy_agreement(runs, plain["runs"]))
            row["identical"] = identical
            for x in runs:
                b = x["batch"]
                row[f"tok_s@{b}"] = x["tok_s"]
                if plain is not None:
                    base = next((y for y in plain["runs"] if y["batch"] == b), None)
                    if base and base["tok_s"]:
                        row[f"speedup@{b}"] = x["tok_s"] / base["tok_s"]
            rows.append(row)
    return rows


def greedy_agreement(runs: Sequence[dict[str, Any]], plain_runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per request against plain's: the share of requests with identical greedy tokens, and the
    mean position of the first differing output token over those that differ (None if none do):
    the lossless contract in a dtype where verifying k+1 tokens in one pass can round differently
    from decoding them one at a time (bfloat16)."""
    same, firsts = 0, []
    pairs = [(a, b) for x, y in zip(runs, plain_runs) for a, b in zip(x["greedy_tokens"], y["greedy_tokens"])]
    for a, b in pairs:
        if a == b:
            same += 1
            continue
        firsts.append(next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b))))
    return {
        "identical_share": same / len(pairs) if pairs else None,
        "first_diff_mean": sum(firsts) / len(firsts) if firsts else None,
        "requests": len(pairs),
    }


def _identical_cell(r: dict[str, Any]) -> str:
    if r["identical"] is None:
        return "-"
    if r["identical"]:
        return "yes"
    same = round(r["identical_share"] * r["requests"])
    return f"NO ({same}/{r['requests']}; first diff at {r['first_diff_mean']:.1f})"


def render(rows: list[dict[str, Any]], batches: Sequence[int]) -> str:
    cols = ["workload", "arm", "acc/verify", "fwd/token", "identical"]
    for b in (1, *batches):
        cols += [f"tok/s@{b}", f"x plain@{b}"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            r["workload"],
            r["arm"],
            f"{r['acc_per_verify']:.2f}",
            f"{r['fwd_per_token']:.3f}",
            _identical_cell(r),
        ]
        for b in (1, *batches):
            cells.append(f"{r.get(f'tok_s@{b}', 0):.0f}")
            s = r.get(f"speedup@{b}")
            cells.append("-" if s is None else f"{s:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from ...launch.engine import apply_env_defaults
    from ...integration.plan import plan_for
    from ..workloads import Tokenizer

    apply_env_defaults(in_process=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from ..plugin_args import PluginArgError, parse_json_params, split_list

    if getattr(args, "deployments", None):
        os.environ[ARMS_DIR_ENV] = str(Path(args.deployments).resolve())
    arms = [a for part in args.arms for a in split_list(part)]
    try:
        params = parse_json_params(args.params)
        for arm in arms:  # every arm's deployment validated before any engine starts
            arm_plan(arm, params)
    except PluginArgError as e:
        raise SystemExit(f"specbench: {e}") from None
    workloads = [w for part in args.workload for w in part.split(",") if w]
    batches = sorted({int(b) for part in args.batch for b in part.split(",") if b and int(b) > 1})
    plan = plan_for(arm_file("plain"))
    model = plan.deployment.model
    if model is None:
        raise SystemExit(f"specbench: {arm_file('plain')} names no model (its tokenizer makes the prompts)")
    max_model_len = int(plan.deployment.engine.get("max_model_len", 2048))
    tok = Tokenizer.from_model(model)
    total = prompts_needed(workloads, args.b1_prompts, batches)
    sets = _prompt_sets(tok, workloads, total, args.max_tokens, max_model_len, args.seed)
    results: dict[str, dict[str, Any]] = {}
    ctx = multiprocessing.get_context("spawn")
    for arm in arms:
        for w in workloads:
            t0 = time.perf_counter()
            # A child process per engine: vLLM 0.32's CPU platform rescans sys.modules for
            # Triton kernels at every engine start and trips over what its own ngram proposer
            # imported (numba), so a second engine in one process fails after an ngram one.
            with ctx.Pool(1) as pool:
                results.setdefault(arm, {})[w] = pool.apply(
                    run_arm,
                    (arm, w, sets[w]),
                    dict(
                        b1_prompts=args.b1_prompts,
                        batches=batches,
                        max_tokens=args.max_tokens,
                        seed=args.seed,
                        params=params,
                    ),
                )
            print(f"[specbench] {arm} / {w}: {time.perf_counter() - t0:.1f}s", flush=True)
    rows = summarize(results, workloads)
    table = render(rows, batches)
    print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "schema": "vllm-graft-specbench/1",
                    "model": model,
                    "arms": arms,
                    "workloads": workloads,
                    "batches": [1, *batches],
                    "max_tokens": args.max_tokens,
                    "max_model_len": max_model_len,
                    "seed": args.seed,
                    "b1_prompts": args.b1_prompts,
                    "rows": rows,
                    "results": results,
                    "table": table,
                },
                indent=1,
                default=str,
            )
        )
    return 0


def add_command(sub: Any) -> None:
    help = (
        "speculative proposers vs vLLM's ngram and plain vLLM "
        "(acceptance, forward passes per token, tokens/s at several batch sizes)"
    )
    p = tool_parser(sub, "specbench", help, lambda args, console=None: main(args), None)
    add_comma_list(
        p,
        "--arms",
        DEFAULT_ARMS,
        "; an arm X is deployments/spec-X.yaml (plain: deployments/plain.yaml) or a .yaml path; any other "
        "registered speculative plugin (a third party's too), or X:{JSON} with its "
        "parameters, runs on deployments/plain.yaml's model with that proposer",
    )
    p.add_argument(
        "--params",
        metavar="JSON",
        help="parameters for every arm's graft proposer (over a spec-X.yaml file's, under an "
        "X:{JSON} entry's), e.g. '{\"num_speculative_tokens\": 6}'; validated by the "
        "plugin's parameter model; plain and vllm-ngram are left as they are",
    )
    add_comma_list(p, "--workload", DEFAULT_WORKLOADS)
    p.add_argument("--batch", action=CommaLists, default=["16,32"], help="batch sizes besides 1 (default: 16,32)")
    p.add_argument("--b1-prompts", type=int, default=4, help="requests run one by one at batch 1")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--deployments",
        metavar="DIR",
        help="the folder arms are named in (DIR/plain.yaml, DIR/spec-X.yaml; default deployments/): "
        "deployments/smollm2 for the real model",
    )
    p.add_argument("--json", help="write every figure (and the greedy tokens) to this file")
