"""`vllm-graft kvbench`: KV-compression figures versus plain vLLM on the bundled model.

For plain vLLM and each eviction compressor (``streaming``, ``h2o``, ``snapkv`` by default; any
registered kvcompress plugin by name, a third party's included, with ``--params`` or
``NAME:{JSON}``) at budgets of 1/2, 1/4 and 1/8 of the context (in KV blocks), one in-process
engine each, with a fixed
KV pool (``--pool-blocks``) and chunked prefill (``--chunk`` tokens per step, so eviction
also happens between prefill chunks):

* **ppl**: perplexity of ``--texts`` stdlib windows of ``--context`` - 1 tokens: the prompt's
  tokens from vLLM's prompt log-probabilities (every prompt token after the first, each
  computed with the KV the compressor kept at that point in the chunked prefill), the last
  ``--gen-tokens`` decoded after that prompt, teacher-forced (:mod:`.forcing`: one decode
  step each, the log-probability vLLM reports for it);
* **gen ppl**: the perplexity of those decoded tokens alone: what a compressor changes while
  a request generates, the compressor's whole effect for SnapKV (it compresses once the
  prompt is in), with the blocks held while they decode (column "(gen)", median);
* **needle EM**: exact match on :func:`~.workloads.needle_haystack` (``--needles`` prompts
  of ``--context`` - ``--decode-tokens`` - 1 tokens, greedy): the output starts with the
  needle's value;
* **blocks/req**: KV blocks each request holds, read from vLLM's block pool every step
  (the manager's block table, freed entries excluded): the peak over the run (prefill
  chunks included), and the median while decoding (column "(decode)"; a request that
  vLLM preempts recomputes its prompt and output as a prefill, which the peak includes);
* **max concurrent**: the most needle requests running at once (all submitted together,
  each generating ``--decode-tokens``) in the fixed pool.

The 4-bit storage format ``kv4`` (alone: ``--compressors kv4``; with an eviction compressor:
``kv4+streaming``, ``kv4+h2o``, ...) changes the page size, not the blocks a request
holds: its arms get the same KV *memory* as the ``--pool-blocks`` dense blocks
(``kv_cache_memory_bytes``) and vLLM sizes the pool from the format's pages (column "pool":
the blocks vLLM allocated; "page B": one block's bytes over all layers).

``--suite ruler`` measures instead the RULER-style suite (:mod:`~.workloads.ruler`): for plain
vLLM and every arm, ``--ruler-cases`` prompts of each task (``single``, ``multikey``,
``multivalue``; ``vartrack``, and ``qa`` in the prose forms, when named in ``--ruler-tasks``) of
about ``--context`` - 64 tokens with random values to retrieve (``--ruler-form``: stdlib code,
or RULER's own wording), all submitted at once in the fixed pool, scored on the greedy output;
printed as the RULER average per compressor (rows) and budget as the share of the context's
blocks kept (columns: ``--fractions``, e.g. 3/4, 1/2, 1/4: kvpress's ratios 0.25, 0.5, 0.75),
then per task with each arm's difference from plain and its paired error; ``--ruler-out
FILE.json`` (written after every arm: a cut run keeps what it ran) holds the summary, and
``FILE.svg`` the score-vs-ratio plot (:mod:`.ruler_report`). Perplexity and needles are not measured in this mode. ``--kvpress
FILE.json`` (kvpress_compare's ``--ruler`` results on the same prompts, checked by a digest of
their token ids) prints NVIDIA kvpress's RULER average beside ours per press and ratio kept, with
the difference and the tasks where ours loses; ``--ruler-from FILE.json`` reads the arms from
earlier ``--ruler-out`` files instead of running them.

SnapKV compresses after the prompt is prefilled, so its perplexity over prompt tokens is
plain vLLM's by construction (its ppl differs from plain's only through the decoded
tokens), its prefill holds the whole prompt, and it keeps every generated block beyond its
budget (column "(gen)").
"""

from __future__ import annotations

import json
import math
import os
import time
from fractions import Fraction
from typing import Any, Sequence, TypedDict

from ..command_line import write_json
from .ruler_report import RULER_ROOM, kept, kept_blocks, kept_label, parse_budgets, ruler_max_tokens

DEFAULT_MODEL = "graft-tiny-llama"


#: kvbench's own arms: budgets and parameters it knows how to set for these built-ins
BUILTIN_ARMS = (
    "streaming",
    "h2o",
    "h2o-mean",
    "snapkv",
    "snapkv-recent",
    "snapkv-wide",
    "adakv",
    "adakv-half",
    "kv4",
    "kv4+streaming",
    "kv4+h2o",
    "kv4+snapkv",
)


def _generic_params(name: str, budget: int) -> dict[str, Any] | None:
    """A registered compressor kvbench has no arm of its own for: the budget in
    ``budget_blocks`` and one sink in ``sink_blocks`` where its parameter model has those
    fields; ``None`` when it has no ``budget_blocks`` (one arm, not one per fraction)."""
    from ..plugin_args import param_fields

    fields = param_fields("kvcompress", name)
    if "budget_blocks" not in fields:
        return None
    return {"budget_blocks": budget, **({"sink_blocks": 1} if "sink_blocks" in fields else {})}


def _arms(
    context: int,
    block: int,
    which: list[str],
    fractions: Sequence[int | str | Fraction] = (2, 4, 8),
    h2o_recent: float = 0.5,
    h2o_heavy: int | None = None,
    params: dict[str, Any] | None = None,
) -> list[tuple[str, Any]]:
    """``(label, kvcompress section)`` per arm: plain, then each compressor of ``which`` at each
    budget of ``fractions`` (N: 1/N of the context's blocks kept; ``"a/b"`` or a Fraction: that
    share). An entry of ``which`` is one of :data:`BUILTIN_ARMS` or the name of any registered
    kvcompress plugin (``kv4+NAME`` composes it with kv4), optionally followed by ``:{JSON}``,
    parameters for that entry; ``params`` apply to every entry's compressor. Given parameters
    override kvbench's own (the budget included) and are validated by the plugin's parameter model."""
    from ..plugin_args import PluginArgError, parse_spec, validate

    blocks = context // block
    arms: list[tuple[str, Any]] = [("plain", None)]
    try:
        specs = [parse_spec(w) for w in which]
    except PluginArgError as e:
        raise SystemExit(f"kvbench: {e}") from None
    for spec, own in specs:
        if spec == "kv4":  # the storage format alone; --params are the eviction compressors'
            try:
                arms.append(
                    ("kv4", {"plugin": "kv4", **({"params": validate("kvcompress", "kv4", own)} if own else {})})
                )
            except PluginArgError as e:
                raise SystemExit(f"kvbench: {e}") from None
    done: set[str] = set()  # registered plugins without a budget: one arm each
    for frac in fractions:
        share = kept(frac)
        budget = kept_blocks(blocks, share)
        for spec, own in specs:
            if spec == "kv4":
                continue
            name, fmt = spec, None
            if name.startswith("kv4+"):
                fmt, name = {"plugin": "kv4"}, name[len("kv4+") :]
            if name == "streaming":
                arm_params: dict[str, Any] = {"budget_blocks": budget, "sink_blocks": 1}
            elif name in ("h2o", "h2o-mean", "d2o"):  # d2o drops what h2o drops (then merges)
                recent = min(budget - 1, max(1, round(budget * h2o_recent)))
                if h2o_heavy is not None:  # a fixed number of heavy blocks, the rest recent
                    recent = max(1, budget - 1 - h2o_heavy)
                arm_params = {
                    "budget_blocks": budget,
                    "sink_blocks": 1,
                    "recent_blocks": recent,
                    **({"score": "mean"} if name == "h2o-mean" else {}),
                }
            elif name in ("snapkv", "snapkv-recent", "snapkv-wide"):
                window = (budget // 2) * block if name == "snapkv-wide" else block  # wide: half the budget
                arm_params = {"budget_blocks": budget, "sink_blocks": 1, "window_tokens": window}
                if name == "snapkv-recent":
                    arm_params["recent_blocks"] = min(budget - 1, max(1, round(budget * h2o_recent)))
            elif name in ("adakv", "adakv-half"):
                # per KV head, at snapkv's memory: at most `budget` prompt blocks held (the union
                # over heads); each head reads `budget` of them on average (adakv: all of the
                # union once it is full) or half of that (adakv-half: per-head masking)
                per_head = budget if name == "adakv" else max(3, budget // 2)
                arm_params = {
                    "budget_blocks": per_head,
                    "held_blocks": budget,
                    "sink_blocks": 1,
                    "window_tokens": block,
                }
            else:
                from ...hooks import get_registry

                if ("kvcompress", name) not in get_registry() or name == "kv4":
                    known = [n for n in get_registry().names("kvcompress") if n not in ("noop", "kv4")]
                    raise SystemExit(
                        f"kvbench: unknown compressor {name!r}: kvbench's arms are "
                        f"{', '.join(BUILTIN_ARMS)}, and any registered kvcompress plugin "
                        f"by name ({', '.join(known)}), optionally NAME:{{JSON params}}"
                    )
                generic = _generic_params(name, budget)
                if generic is None:
                    if spec in done:
                        continue
                    done.add(spec)
                arm_params = generic if generic is not None else {}
            plugin = name if name not in BUILTIN_ARMS else name.split("-")[0]
            arm_params = {**arm_params, **(params or {}), **(own or {})}
            try:
                validate("kvcompress", plugin, arm_params)
            except PluginArgError as e:
                raise SystemExit(f"kvbench: {e}") from None
            choice = {"plugin": plugin, "params": arm_params}
            label = name if spec in done else f"{name} {kept_label(share)}"
            if fmt is None:
                arms.append((label, choice))
            else:
                arms.append((f"kv4+{label}", [choice, fmt]))
    return arms


def _uses_kv4(kvcompress: Any) -> bool:
    items = kvcompress if isinstance(kvcompress, list) else [kvcompress] if kvcompress else []
    return any(c.get("plugin") == "kv4" for c in items)


class _Pool(TypedDict):
    """The cache geometry and the fixed pool every arm runs in (:func:`run_arm`'s keywords)."""

    block: int
    chunk: int
    pool: int
    context: int
    max_seqs: int


def _pool(args: Any) -> _Pool:
    return _Pool(block=args.block, chunk=args.chunk, pool=args.pool_blocks, context=args.context, max_seqs=args.needles)


def run_arm(
    model: str,
    kvcompress: dict[str, Any] | None,
    texts,
    needles,
    *,
    block: int,
    chunk: int,
    pool: int,
    context: int,
    max_seqs: int,
    decode: int = 384,
    gen: int = 128,
    ruler: Sequence[Any] = (),
) -> dict[str, Any]:
    """One arm: ``texts`` for perplexity and ``needles`` for needle EM (either may be empty:
    skipped), and the RULER-style ``ruler`` cases (:mod:`~.workloads.ruler`, all submitted at
    once in the fixed pool, greedy), scored per case into ``ruler_scores``."""
    from vllm import LLM

    from ...launch import engine as launch
    from ...integration.plan import plan_for
    from ...integration.forcing import ForceTokens

    engine_args = {
        "dtype": "float32",
        "max_model_len": context,
        "block_size": block,
        "enforce_eager": True,
        "num_gpu_blocks_override": pool,
        "max_num_batched_tokens": chunk,
        "max_num_seqs": max_seqs,
        "enable_prefix_caching": False,
    }
    saved_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if _uses_kv4(kvcompress):
        # a storage format: the same KV memory as `pool` dense blocks; vLLM sizes the pool
        # from the format's page (the env variable would override the memory given here)
        del engine_args["num_gpu_blocks_override"]
        engine_args["kv_cache_memory_bytes"] = pool * _dense_page_bytes(model, block)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    data: dict[str, Any] = {"model": model, "engine": engine_args}
    if kvcompress:
        data["kvcompress"] = kvcompress
    plan = plan_for(data)
    t0 = time.time()
    try:
        llm = LLM(**launch.llm_kwargs(plan, graft=bool(kvcompress)), seed=0, logits_processors=[ForceTokens])
    finally:
        if saved_space is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved_space
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    (mgr,) = sched.kv_cache_manager.coordinator.single_type_managers
    kv_config = sched.kv_cache_config
    spec = kv_config.kv_cache_groups[0].kv_cache_spec
    layers = sum(len(g.layer_names) for g in kv_config.kv_cache_groups)
    res: dict[str, Any] = {"pool_blocks": kv_config.num_blocks, "page_bytes": spec.page_size_bytes * layers}
    try:

        def drive(reqs, params):
            peak, decode_held, running, outs = 0, [], 0, {}
            for rid, ids in reqs:
                engine.add_request(rid, {"prompt_token_ids": list(ids)}, params)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        outs[o.request_id] = o
                running = max(running, len(sched.running))
                for rid, blocks in mgr.req_to_blocks.items():
                    held = sum(not b.is_null for b in blocks)
                    peak = max(peak, held)
                    req = sched.requests.get(rid)
                    # decoding: past the first step after the prompt (a scored compressor's
                    # decision at the prompt's end is freed at the next scheduling)
                    if req is not None and req.num_computed_tokens > req.num_prompt_tokens:
                        decode_held.append(held)
            decode_held.sort()
            return outs, peak, decode_held[len(decode_held) // 2] if decode_held else 0, running

        if ruler:
            res.update(_run_ruler(drive, ruler))
        if not texts and not needles:
            res["seconds"] = round(time.time() - t0, 1)
            return res
        res.update(_perplexity(drive, texts, gen))
        res.update(_needles(drive, needles, decode), seconds=round(time.time() - t0, 1))
    finally:
        engine.engine_core.shutdown()
        del llm
    return res


def _perplexity(drive, texts, gen: int) -> dict[str, Any]:
    """One text at a time: its prompt's log-probs, then its last ``gen`` tokens decoded after
    it, forced (the perplexity of what the compressed cache generates from)."""
    from vllm import SamplingParams

    from ...integration.forcing import forced_logprobs, forced_params

    nll, n_tok, peak_ppl, gen_nll, gen_held = 0.0, 0, 0, 0.0, []
    for i, (ids, _) in enumerate(texts):
        prompt, rest = list(ids[: len(ids) - gen]), list(ids[len(ids) - gen :])
        params = (
            forced_params(rest, prompt_logprobs=0)
            if rest
            else SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        )
        outs, peak, held, _ = drive([(f"t{i}", prompt)], params)
        peak_ppl = max(peak_ppl, peak)
        gen_held.append(held)
        out = outs[f"t{i}"]
        for tok, lp in zip(prompt[1:], out.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            n_tok += 1
        gen_nll -= sum(forced_logprobs(out, rest)) if rest else 0.0
    n_gen = gen * len(texts)
    return {
        "ppl": math.exp((nll + gen_nll) / (n_tok + n_gen)),
        "ppl_tokens": n_tok + n_gen,
        "gen_ppl": math.exp(gen_nll / n_gen) if n_gen else float("nan"),
        "gen_tokens": n_gen,
        "median_blocks_gen": sorted(gen_held)[len(gen_held) // 2] if gen_held else 0,
        "peak_blocks_ppl": peak_ppl,
    }


def _needles(drive, needles, decode: int) -> dict[str, Any]:
    """Every needle prompt at once in the fixed pool, greedy: exact match of the answer."""
    from vllm import SamplingParams

    reqs = [(f"n{i}", n.token_ids) for i, n in enumerate(needles)]
    longest = max(len(n.answer_ids) for n in needles)
    outs, peak, median_decode, running = drive(
        reqs, SamplingParams(max_tokens=max(longest + 2, decode), temperature=0.0, ignore_eos=True)
    )
    hits = [
        list(outs[f"n{i}"].outputs[0].token_ids[: len(n.answer_ids)]) == list(n.answer_ids)
        for i, n in enumerate(needles)
    ]
    return {
        "needle_em": sum(hits) / len(hits),
        "needle_hits": hits,
        "peak_blocks": peak,
        "median_blocks_decode": median_decode,
        "max_concurrent": running,
    }


def _run_ruler(drive, cases: Sequence[Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from ..workloads.ruler import score_case

    reqs = [(f"r{i}", c.token_ids) for i, c in enumerate(cases)]
    outs, peak, median_decode, running = drive(
        reqs, SamplingParams(max_tokens=ruler_max_tokens(cases), temperature=0.0, ignore_eos=True)
    )
    outputs = [list(outs[f"r{i}"].outputs[0].token_ids) for i in range(len(cases))]
    return {
        "ruler_scores": [score_case(c, o) for c, o in zip(cases, outputs)],
        "ruler_tasks": [c.task for c in cases],
        "ruler_outputs": outputs,
        "ruler_peak_blocks": peak,
        "ruler_median_blocks_decode": median_decode,
        "ruler_max_concurrent": running,
    }


def _dense_page_bytes(model: str, block: int) -> int:
    """Bytes of one dense float32 block over all layers (K and V), from the model's config."""
    cfg = json.loads((__import__("pathlib").Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * kv_heads * block * 2 * head * 4


def main(args) -> int:
    from ...launch import engine as launch
    from ..plugin_args import PluginArgError, parse_json_params, split_list
    from ..workloads import Tokenizer, needle_haystack, stdlib_texts

    check_suite_args(args)
    launch.apply_env_defaults(in_process=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from ...launch.engine import models_dir

    model = args.model or str(models_dir() / DEFAULT_MODEL)
    tok = Tokenizer.from_model(model)
    room = args.decode_tokens + 1  # output tokens
    if not 0 <= args.gen_tokens < args.context // 2:
        raise SystemExit(f"kvbench: --gen-tokens must be between 0 and half the context ({args.context // 2})")
    try:
        fractions = parse_budgets(args.fractions)
    except ValueError as e:
        raise SystemExit(f"kvbench: --fractions {args.fractions}: {e}") from None
    try:
        params = parse_json_params(args.params)
    except PluginArgError as e:
        raise SystemExit(f"kvbench: {e}") from None
    # every arm named and its parameters validated before any text is read or engine started
    arms = _arms(
        args.context, args.block, split_list(args.compressors), fractions, args.h2o_recent, args.h2o_heavy, params
    )
    if args.suite == "ruler":
        return _main_ruler(args, model, tok, arms)
    texts = stdlib_texts(tok, num=args.texts, tokens=args.context - 1, seed=args.seed)
    needles = needle_haystack(tok, num_prompts=args.needles, context_tokens=args.context - room, seed=args.seed)
    rows = []
    for label, kv in arms:
        r = run_arm(model, kv, texts, needles, **_pool(args), decode=args.decode_tokens, gen=args.gen_tokens)
        r["arm"], r["kvcompress"] = label, kv
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "needle_hits"}), flush=True)
    base = rows[0]
    print()
    print(
        f"context {args.context} tokens, block {args.block}, chunk {args.chunk}, pool {args.pool_blocks} blocks, "
        f"{args.texts} ppl texts ({base['ppl_tokens']} tokens, the last {args.gen_tokens} of each decoded: "
        f"gen ppl), {args.needles} needles"
    )
    head = (
        f"{'arm':<20}{'pool':>6}{'page B':>8}{'blocks/req':>11}{'(decode)':>9}{'vs plain':>9}"
        f"{'KV B vs plain':>14}{'max conc.':>10}{'ppl':>9}{'Δppl':>8}{'gen ppl':>9}{'Δgen':>8}{'(gen)':>6}"
        f"{'needle EM':>10}"
    )
    print(head)
    for r in rows:
        note = " (prompt ppl is plain's)" if "snapkv" in r["arm"] or "adakv" in r["arm"] else ""
        print(
            f"{r['arm']:<20}{r['pool_blocks']:>6}{r['page_bytes']:>8}{r['peak_blocks']:>11}{r['median_blocks_decode']:>9}"
            f"{base['peak_blocks'] / max(1, r['peak_blocks']):>8.1f}x"
            f"{base['peak_blocks'] * base['page_bytes'] / max(1, r['peak_blocks'] * r['page_bytes']):>13.1f}x"
            f"{r['max_concurrent']:>10}"
            f"{r['ppl']:>9.3f}{100 * (r['ppl'] / base['ppl'] - 1):>+7.1f}%"
            f"{r['gen_ppl']:>9.3f}{100 * (r['gen_ppl'] / base['gen_ppl'] - 1):>+7.1f}%{r['median_blocks_gen']:>6}"
            f"{r['needle_em']:>10.2f}{note}"
        )
    write_json(args.json, rows)
    return 0


def _main_ruler(args, model: str, tok, arms: list[tuple[str, Any]]) -> int:
    """``--suite ruler``: the RULER-style cases through every arm, then the score-vs-ratio
    tables (and ``--ruler-out`` / ``--ruler-svg``)."""
    from . import kvpress_compare, ruler_report
    from ..workloads.ruler import ruler_suite

    tasks = parse_ruler_tasks(args.ruler_tasks, args.ruler_form)
    cases = ruler_suite(
        tok,
        tasks=tasks,
        num_per_task=args.ruler_cases,
        context_tokens=args.context - RULER_ROOM,
        seed=args.seed,
        form=args.ruler_form,
    )
    longest = max(len(c.token_ids) for c in cases) + ruler_max_tokens(cases)
    if longest > args.context:  # cannot happen with RULER_ROOM over the answers' length; checked
        raise SystemExit(f"kvbench: a RULER case needs {longest} tokens, more than --context {args.context}")
    case_digest = kvpress_compare.digest([c.token_ids for c in cases])
    rows = load_ruler_results(args.ruler_from, cases, case_digest, context=args.context) if args.ruler_from else []
    theirs = None
    if args.kvpress:  # checked before any engine starts
        theirs = read_kvpress_results(args.kvpress)
        labels = [r["arm"] for r in rows] if args.ruler_from else [label for label, _ in arms]
        try:
            kvpress_compare.check_ruler_results(
                theirs, digest=case_digest, labels=labels, tasks=tasks, case_tasks=[c.task for c in cases]
            )
        except kvpress_compare.RulerMismatch as e:
            raise SystemExit(f"kvbench: --kvpress: {e}") from None
    for label, kv in [] if args.ruler_from else arms:
        r = run_arm(model, kv, [], [], **_pool(args), ruler=cases)
        r["arm"], r["kvcompress"] = label, kv
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("ruler_outputs", "ruler_tasks")}), flush=True)
        # after each arm, what has run so far (a --ruler-from file): a run cut short loses one arm, not all
        write_json(
            args.ruler_out, {"partial": True, "context": args.context, "ruler_digest": case_digest, "rows": rows}
        )
    summary = ruler_report.summarize(rows, tasks, cases_per_task=args.ruler_cases, context=args.context)
    summary.update(
        seed=args.seed, ruler_context=args.context - RULER_ROOM, ruler_digest=case_digest, ruler_form=args.ruler_form
    )
    print()
    print(
        f"RULER-style suite ({args.ruler_form} form): {', '.join(tasks)}; {args.ruler_cases} cases each, prompts of "
        f"{min(len(c.token_ids) for c in cases)}-{max(len(c.token_ids) for c in cases)} tokens "
        f"(context {args.context}, block {args.block}, chunk {args.chunk}, pool {args.pool_blocks} blocks); "
        + (
            "the fraction of the answers in the greedy output (RULER's string_match_all)"
            if args.ruler_form != "code"
            else "exact match of the greedy output (multivalue: the fraction of values found)"
        )
    )
    print(ruler_report.tables(summary))
    beside = None
    if theirs is not None:
        beside = kvpress_compare.ruler_beside(rows, theirs, tasks=tasks, digest=case_digest)
        print(kvpress_beside_title(beside, args.context, args.block))
        print(kvpress_compare.format_ruler_beside(beside))
    write_json(args.ruler_out, {**summary, "rows": rows})
    svg_path = args.ruler_svg or (os.path.splitext(args.ruler_out)[0] + ".svg" if args.ruler_out else None)
    if svg_path:
        with open(svg_path, "w") as f:
            f.write(ruler_report.svg(summary, beside=beside))
    write_json(args.json, rows)
    return 0


def load_ruler_results(
    paths: Sequence[str], cases: Sequence[Any], digest: str, *, context: int
) -> list[dict[str, Any]]:
    """``--ruler-from``: kvbench's RULER rows from earlier runs (``--ruler-out`` files, or ``--json``
    lists; a later file's arm replaces an earlier one's, in its place), instead of running the arms.
    A file must be of these ``cases`` (the prompts this command builds): its digest of their token
    ids, where it has one (``--ruler-out`` writes it), must be ``digest``; every row must score
    the same cases (their tasks, in order), and where a row keeps its outputs they must score as
    it recorded on these cases (a file from before the digest has no other proof). Refused with
    a message naming the file otherwise."""
    from ..workloads.ruler import score_case

    case_tasks = [c.task for c in cases]
    rows: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"kvbench: --ruler-from {path}: {e}") from None
        got = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(got, list) or not got:
            raise SystemExit(f"kvbench: --ruler-from {path}: no rows (a --ruler-out or --json file of --suite ruler)")
        meta = data if isinstance(data, dict) else {}
        if meta.get("context", context) != context:
            raise SystemExit(f"kvbench: --ruler-from {path}: measured at --context {meta['context']}, not {context}")
        if meta.get("ruler_digest") not in (None, digest):
            raise SystemExit(
                f"kvbench: --ruler-from {path}: measured on other RULER prompts (digest {meta['ruler_digest']}, "
                f"these: {digest}): give the --ruler-tasks, --ruler-cases, --context and --seed it was run with"
            )
        for r in got:
            if list(r.get("ruler_tasks", [])) != case_tasks:
                raise SystemExit(
                    f"kvbench: --ruler-from {path}: {r.get('arm')!r} scored other cases than "
                    f"--ruler-tasks {','.join(dict.fromkeys(case_tasks))} --ruler-cases "
                    f"{len(case_tasks) // max(1, len(set(case_tasks)))}"
                )
            outputs = r.get("ruler_outputs")
            if outputs is not None:
                again = [score_case(c, o) for c, o in zip(cases, outputs)]
                if len(outputs) != len(cases) or again != [float(x) for x in r["ruler_scores"]]:
                    raise SystemExit(
                        f"kvbench: --ruler-from {path}: {r['arm']!r}'s outputs do not score as recorded on these "
                        "prompts: it was measured on others (--seed, --context?)"
                    )
            elif "ruler_digest" not in meta:
                raise SystemExit(
                    f"kvbench: --ruler-from {path}: neither a digest of its prompts nor {r['arm']!r}'s outputs: "
                    "nothing shows it ran these prompts"
                )
            rows[r["arm"]] = r
    return list(rows.values())


def read_kvpress_results(paths: Sequence[str]) -> dict[str, Any]:
    """``--kvpress``: kvpress_compare's ``--json`` files (merged, a later arm wins)."""
    from .kvpress_compare import read_kvpress

    try:
        return read_kvpress(paths)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"kvbench: --kvpress {' '.join(paths)}: not kvpress_compare's --json ({e!r})") from None


def kvpress_beside_title(beside: dict[str, Any], context: int, block: int) -> str:
    """The line above the side-by-side table: what kvpress ran and how its budget was set."""
    v = beside.get("versions") or {}
    budget = (
        f"kvpress keeps as many tokens of each prompt as kvbench's budget holds (1/2 of {context}: "
        f"{context // block // 2 * block})"
        if beside.get("budget") == "context"
        else "kvpress removes the fraction 1 - 1/N of each prompt's tokens (its compression_ratio)"
    )
    return (
        f"\nBeside kvpress {v.get('kvpress', '?')} (transformers {v.get('transformers', '?')}), the same "
        f"{beside['cases']} prompts (digest {beside['digest']}); RULER average, vllm-graft minus kvpress; "
        f"{budget}; kvpress compresses per layer and head, token by token, once after the prefill:\n"
    )


def check_suite_args(args) -> None:
    """Refuse the ``--ruler-*`` options without ``--suite ruler`` and bad values, before any
    text is read or engine started."""
    if args.suite != "ruler":
        given = [f for f in ("ruler_out", "ruler_svg", "ruler_from", "kvpress") if getattr(args, f, None)]
        if given:
            raise SystemExit(f"kvbench: --{given[0].replace('_', '-')} needs --suite ruler")
        return
    parse_ruler_tasks(args.ruler_tasks, args.ruler_form)
    if args.ruler_cases < 1:
        raise SystemExit("kvbench: --ruler-cases must be at least 1")


def parse_ruler_tasks(value: str, form: str = "code") -> list[str]:
    """``--ruler-tasks``: a comma list of :data:`~.workloads.ruler.RULER_TASKS`, or ``all`` (every
    task ``form`` has: the code form has no ``qa``)."""
    from ..workloads.base import WorkloadError
    from ..workloads.ruler import RULER_TASKS, check_form_tasks, tasks_of

    names = list(tasks_of(form)) if value.strip() == "all" else [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in names if t not in RULER_TASKS]
    if unknown or not names:
        raise SystemExit(
            f"kvbench: unknown RULER task(s) {', '.join(unknown) or '(none given)'}: "
            f"the tasks are {', '.join(RULER_TASKS)} (or all)"
        )
    try:
        check_form_tasks(names, form)
    except WorkloadError as e:
        raise SystemExit(f"kvbench: {e}") from None
    return names


def _add_ruler_arguments(p: Any) -> None:
    """kvbench --suite ruler and its arguments."""
    from ..workloads.ruler import DEFAULT_TASKS as DEFAULT_RULER_TASKS, RULER_FORMS

    p.add_argument(
        "--suite",
        choices=["ruler"],
        help="ruler: instead of perplexity and needles, the RULER-style suite (tools/workloads/ruler.py: "
        "single, multikey, multivalue and vartrack retrieval on stdlib code, exact match of the greedy "
        "output) for every arm, printed as a score-vs-ratio table (rows: compressor; columns: the "
        "budget as a fraction of the context's blocks) and a per-task table",
    )
    p.add_argument(
        "--ruler-tasks",
        default=",".join(DEFAULT_RULER_TASKS),
        metavar="LIST",
        help=f"--suite ruler: the tasks, a comma list or all (default {','.join(DEFAULT_RULER_TASKS)}: "
        "plain vLLM on the bundled recall model gets 1 of 16 vartrack cases)",
    )
    p.add_argument(
        "--ruler-form",
        choices=RULER_FORMS,
        default="code",
        help="--suite ruler: code (default: the tasks on stdlib source, for the bundled models trained on it), or "
        "RULER's own natural-language needles and questions (a pretrained model, such as smollm2-135m) in "
        "repeated filler sentences (noise) or English prose (essay: CPython's reference documentation)",
    )
    p.add_argument(
        "--ruler-cases", type=int, default=16, metavar="N", help="--suite ruler: cases per task (default 16)"
    )
    p.add_argument(
        "--ruler-out",
        metavar="FILE.json",
        help="--suite ruler: write the summary (scores per arm and task) and the rows to this file, "
        "and the plot beside it (FILE.svg) unless --ruler-svg names another",
    )
    p.add_argument(
        "--ruler-svg",
        metavar="FILE.svg",
        help="--suite ruler: write the score-vs-ratio plot (SVG, one line per compressor, plain "
        "vLLM as the dashed reference) to this file",
    )
    p.add_argument(
        "--ruler-from",
        action="append",
        metavar="FILE.json",
        help="--suite ruler: instead of running the arms, read their rows from earlier runs' --ruler-out "
        "(or --json) files, checked to be of the prompts this command builds (repeat to merge; a later "
        "file's arm wins); --compressors is not run",
    )
    p.add_argument(
        "--kvpress",
        action="append",
        metavar="FILE.json",
        help="--suite ruler: kvpress's results on the same prompts (kvpress_compare --ruler ... --json, "
        "repeat to merge): prints kvpress's RULER average beside vllm-graft's per press and ratio kept, "
        "with the difference; refused before any engine starts if they are of other prompts (digest) "
        "or lack an arm of a press both projects have",
    )


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "kvbench",
        help="KV-compression figures: blocks held, concurrency, perplexity, needle retrieval",
        description=__doc__.split("\n\n", 1)[1].split("\n\nSnapKV")[0],
    )
    p.add_argument(
        "--compressors",
        default="streaming,h2o,snapkv",
        help="comma list (default the three eviction compressors): any registered kvcompress "
        "plugin by name (a third party's too: its parameter model's budget_blocks and "
        "sink_blocks fields get the budget and 1 sink; without budget_blocks it runs once), "
        "each optionally NAME:{JSON} with its own parameters (they override kvbench's and "
        "are validated by the plugin's parameter model); "
        "kvbench's own arms besides the plugins: h2o-mean (score: mean), "
        "snapkv-recent (recent_blocks: the --h2o-recent share), snapkv-wide (window_tokens: "
        "half the budget), adakv (per-KV-head budgets at snapkv's memory: budget_blocks = "
        "held_blocks = the budget), adakv-half (each head reads half the held blocks on average), "
        "kv4 (the 4-bit "
        "storage format alone) and kv4+streaming, kv4+h2o, kv4+snapkv (composed)",
    )
    p.add_argument(
        "--params",
        metavar="JSON",
        help="parameters for every named eviction compressor, e.g. '{\"sink_blocks\": 2}' "
        "(over kvbench's own, under a NAME:{JSON} entry's)",
    )
    p.add_argument(
        "--h2o-recent",
        type=float,
        default=0.5,
        metavar="F",
        help="share of an h2o (and snapkv-recent) budget kept for the recent window (default 0.5, as in the H2O paper)",
    )
    p.add_argument(
        "--h2o-heavy",
        type=int,
        metavar="N",
        help="h2o: N heavy blocks at every budget, the rest (after the sink) recent (instead of --h2o-recent)",
    )
    add_text_arguments(p, texts=4, model=DEFAULT_MODEL)
    p.add_argument("--pool-blocks", type=int, default=256, help="fixed KV pool in blocks (default 256)")
    p.add_argument("--needles", type=int, default=16, help="needle prompts (default 16)")
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=384,
        help="tokens each needle request generates (default 384: requests overlap in decode, "
        "so the pool, not the prefill schedule, bounds concurrency)",
    )
    p.add_argument("--json", help="write the rows to this file")
    _add_ruler_arguments(p)
    p.set_defaults(func=lambda args, console=None: main(args))


def add_text_arguments(p: Any, *, texts: int, model: str) -> None:
    """The model, the budgets, the perplexity texts and the cache geometry, shared with
    ``kv-headroom`` (same defaults, so the two measure the same tokens)."""
    p.add_argument("--model", help=f"model folder (default: the bundled {model})")
    p.add_argument(
        "--fractions",
        default="2,4,8",
        help="budgets, the share of the context's blocks kept: N for 1/N, or a/b (3/4, 1/2, 1/4 are kvpress's "
        "compression ratios 0.25, 0.5, 0.75; default 2,4,8)",
    )
    p.add_argument("--context", type=int, default=2048, help="context tokens (default 2048)")
    p.add_argument("--block", type=int, default=32, help="KV block size (default 32)")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk: max_num_batched_tokens (default 128)")
    p.add_argument("--texts", type=int, default=texts, help=f"perplexity texts (default {texts})")
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=128,
        help="last tokens of each perplexity text decoded (teacher-forced) after the rest as "
        "prompt: the gen ppl column (default 128; 0: prompt only)",
    )
    p.add_argument("--seed", type=int, default=0)
