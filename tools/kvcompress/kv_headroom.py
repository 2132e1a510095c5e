"""`vllm-graft kv-headroom`: how far is each block-eviction policy from the best a
block-granular selection could do on this model, and is its difference from `streaming` real?

For the perplexity texts of ``kvbench`` (the same stdlib windows, seed and ``--gen-tokens``
decoded tail), it replays in transformers what a request sees under each policy: prefill in
``--chunk``-token steps, then one token per step, after every step the plugin's own planner
(``keep``) deciding which blocks stay, and every later query's attention masked to them (one
forward pass with a per-query mask, exact because a token's keys and values are computed from
its own masked row). The decoded tokens' perplexity ("gen ppl") is what it reports: the
tokens a compressor changes while a request generates.

Arms (budgets of ``--fractions`` of the context, in blocks):

* ``streaming``: the `streaming` plugin (1 sink block, the rest recent);
* ``snapkv``: the `snapkv` plugin, scores from its observation window (one block);
  ``snapkv-recent``: with half its budget recent; ``snapkv-wide``: a window of half the
  budget (512 tokens at 1/2 of 2K, 128 at 1/8). These four take ``kvbench``'s parameters
  for its arms of the same names;
* ``prompt-mean``: the same SnapKV planner, each prompt block scored by the mean attention
  mass the prompt's queries put on it (every query that can see it);
* ``oracle``: the same planner, each block scored by the mass that the *decoded tokens
  themselves* put on it under full attention: it uses the future, so no compressor can run it.
  It shows what attention-mass scoring could gain at best if its scores foresaw the decoded
  tokens (a reference, not a strict bound: the blocks that most lower the loss need not be the
  most attended).
* any other registered kvcompress plugin, by name (a third party's too; ``NAME:{JSON}`` or
  ``--params`` for its parameters): its budget set as ``kvbench`` sets it, its own ``keep``
  asked after every step; a scored plugin gets the mass of the prompt queries its
  ``score_positions`` select (what it would accumulate while decoding is not replayed).

Scores are summed over layers and heads, like the plugins'. Beside each arm's change against
plain attention, the change against ``streaming`` at the same budget with a 90% interval from a
paired bootstrap over texts (an interval that straddles 0 means the texts do not tell the two
apart), and against ``streaming+k``: streaming with the ``k`` = ``--gen-tokens`` / block more
blocks that SnapKV keeps by the end of the decoded tail (it compresses the prompt only), so at
least the blocks the SnapKV-planner arms hold at every step (column "blocks": the mean over
the decoded tokens' queries). The ``streaming`` and ``snapkv`` figures are the plugins' own
in vLLM, not a model of them: ``tests/e2e/test_scored_compressors_masked.py`` holds this
replay's gen ppl to vLLM's for both plugins (to 1e-4), and ``kvbench`` on the same texts
gives the same figures.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from ..command_line import write_json
from .kvbench import _arms, add_text_arguments

DEFAULT_MODEL = "graft-tiny-llama-recall"
ARMS = ("streaming", "snapkv", "snapkv-recent", "snapkv-wide", "prompt-mean", "oracle")


def step_bounds(prompt: int, n: int, chunk: int) -> list[int]:
    """vLLM's steps for one request: prefill chunks of ``chunk`` up to ``prompt``, then one
    token per step up to ``n`` positions."""
    return list(range(0, prompt, chunk)) + list(range(prompt, n)) + [n]


def replay_allowed(n: int, prompt: int, block: int, chunk: int, keep: Callable[[int], list[int]]):
    """``[n, n]`` bool: which keys each query sees when ``keep(num_tokens)`` (the blocks kept
    after the step that ends at ``num_tokens``) decides after every step; a step's queries do
    not see blocks dropped after earlier steps."""
    import torch

    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    dropped: set[int] = set()
    bounds = step_bounds(prompt, n, chunk)
    for s0, s1 in zip(bounds, bounds[1:]):
        for b in dropped:
            allowed[s0:s1, b * block : (b + 1) * block] = False
        nb = -(-s1 // block)
        dropped |= set(range(nb)) - set(keep(s1))
    return allowed


def block_mass(att_sum, rows: slice, n: int, block: int):
    """Attention mass the queries ``rows`` put on each block (``att_sum``: ``[n, n]``, summed
    over layers and heads)."""
    import torch

    per_key = att_sum[rows].sum(0)
    nb = -(-n // block)
    return torch.nn.functional.pad(per_key, (0, nb * block - n)).view(nb, block).sum(-1)


def planner(plugin: str, params: dict[str, Any]):
    """The ``plugin`` compressor built from the registry, as vLLM's adapter builds it."""
    from ...hooks import get_registry

    reg = get_registry().get("kvcompress", plugin).registration
    return reg.load()(reg.params(**params))


def arm_choice(
    name: str, context: int, block: int, frac: int, extra: int, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``{"plugin", "params"}`` of an arm at budget 1/``frac``: ``kvbench``'s own arm for
    the plugins; ``prompt-mean`` and ``oracle`` are SnapKV's planner with a 1-token window
    (their scores come from elsewhere); ``streaming+`` is streaming with ``extra`` more blocks.
    Any other ``name`` is a registered kvcompress plugin (``NAME`` or ``NAME:{JSON}``) as
    ``kvbench`` builds its arm (``params``: ``--params``, under the entry's own)."""
    if name not in ARMS and name != "streaming+":
        arms = _arms(context, block, [name], (frac,), params=params)[1:]
        ((_, choice),) = arms
        if isinstance(choice, list) or choice["plugin"] == "kv4":
            raise SystemExit(
                f"kv-headroom: {name!r}: a storage format is not an eviction policy; "
                "kv-headroom replays which blocks a policy keeps"
            )
        return choice
    base = {"prompt-mean": "snapkv", "oracle": "snapkv", "streaming+": "streaming"}.get(name, name)
    choice = dict(_arms(context, block, [base], (frac,)))[f"{base} 1/{frac}"]
    params = dict(choice["params"])
    if base == "snapkv" and name != base:
        params["window_tokens"] = 1
    if name == "streaming+":
        params["budget_blocks"] += extra
    return {"plugin": choice["plugin"], "params": params}


def bootstrap(diffs: list[float], tokens: list[int], *, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """90% interval of ``exp(sum(diffs) / sum(tokens)) - 1`` resampling texts."""
    rng = random.Random(seed)
    k = len(diffs)
    stats = []
    for _ in range(reps):
        idx = [rng.randrange(k) for _ in range(k)]
        stats.append(math.exp(sum(diffs[i] for i in idx) / sum(tokens[i] for i in idx)) - 1)
    stats.sort()
    return stats[int(0.05 * reps)], stats[int(0.95 * reps) - 1]


def study(
    model_dir: str,
    texts,
    *,
    block: int,
    chunk: int,
    gen: int,
    fractions,
    arms,
    progress: Callable[[str], None] = lambda s: None,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Gen ppl of every arm at every budget (``fractions`` of each text's blocks) with its
    comparisons (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ...hooks import BlockView

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    nll: dict[str, list[float]] = {}
    kept_blocks: dict[str, list[float]] = {}
    tokens: list[int] = []
    extra = -(-gen // block)  # the generated blocks SnapKV keeps beyond its budget

    def gen_nll(ids, allowed, want_att=False):
        n = len(ids) - 1
        mask = torch.zeros(1, 1, n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[:n]]), attention_mask=mask, output_attentions=want_att)
        logp = torch.log_softmax(out.logits[0].float(), -1)[torch.arange(n), torch.tensor(ids[1:])]
        att = sum(a[0].sum(0) for a in out.attentions) if want_att else None
        return -float(logp[n - gen :].sum()), att

    for t, (ids, _) in enumerate(texts):
        ids = list(ids)
        # positions 0..n-1 (the last token is only a target); the prompt is all but the last
        # `gen` tokens (as kvbench's), so the tail's targets are predicted from positions n-gen..n-1
        n, prompt = len(ids) - 1, len(ids) - gen
        full = torch.tril(torch.ones(n, n, dtype=torch.bool))
        base, att = gen_nll(ids, full, want_att=True)
        nll.setdefault("plain", []).append(base)
        tokens.append(gen)
        nbp = -(-prompt // block)
        context = -(-len(ids) // block) * block  # the budgets are fractions of the text's blocks
        sources = {  # block scores over the prompt's blocks for the arms not scored by their window
            "prompt-mean": block_mass(att, slice(0, prompt), n, block)
            / block_mass(full[:prompt].float(), slice(0, prompt), n, block).clamp(min=1),
            "oracle": block_mass(att, slice(prompt - 1, n), n, block),  # the queries predicting the tail
        }
        for frac in fractions:
            for name in [*arms, "streaming+"]:
                choice = arm_choice(name, context, block, frac, extra, params)
                comp = planner(choice["plugin"], choice["params"])
                if not comp.needs_scores:  # streaming, or any registered policy without scores

                    def keep(s, comp=comp):
                        return comp.keep(BlockView(s, block, prompt))
                else:
                    if name in sources:
                        scores = sources[name]
                    elif name in ARMS:  # SnapKV's own: the mass of its observation window's queries
                        window = choice["params"]["window_tokens"]
                        scores = block_mass(att, slice(max(0, prompt - window), prompt), n, block)
                    else:  # another scored plugin: the mass of the prompt queries it scores with
                        lo, hi = comp.score_positions(prompt)
                        scores = block_mass(att, slice(max(0, lo), min(hi, prompt)), n, block)
                    sc = scores[:nbp].tolist()

                    def keep_scored(s, comp=comp, sc=sc):
                        nb = -(-s // block)
                        return comp.keep(BlockView(s, block, prompt, tuple(sc + [0.0] * (nb - len(sc)))[:nb]))

                    keep = keep_scored
                allowed = replay_allowed(n, prompt, block, chunk, keep)
                label = f"streaming+{extra} 1/{frac}" if name == "streaming+" else f"{name} 1/{frac}"
                nll.setdefault(label, []).append(gen_nll(ids, allowed)[0])
                # blocks seen by the queries that predict the tail (prompt and generated), their mean
                nb = -(-n // block)
                seen = torch.nn.functional.pad(allowed[prompt - 1 :], (0, nb * block - n)).view(gen, nb, block).any(-1)
                kept_blocks.setdefault(label, []).append(float(seen.sum(-1).float().mean()))
        progress(f"text {t + 1}/{len(texts)}")
    return _summary(nll, kept_blocks, tokens, extra)


def _summary(
    nll: dict[str, list[float]], kept_blocks: dict[str, list[float]], tokens: list[int], extra: int
) -> dict[str, Any]:
    """Each arm's gen ppl over all texts, its change against plain and, for a scored arm, against
    streaming at the same budget and at that budget plus SnapKV's ``extra`` blocks (90% bootstrap)."""
    rows = []
    total = sum(tokens)
    plain = math.exp(sum(nll["plain"]) / total)
    rows.append({"arm": "plain", "gen_ppl": plain, "change": 0.0, "blocks": None})
    for label, vals in nll.items():
        if label == "plain":
            continue
        ppl = math.exp(sum(vals) / total)
        row = {
            "arm": label,
            "gen_ppl": ppl,
            "change": ppl / plain - 1,
            "blocks": sum(kept_blocks[label]) / len(kept_blocks[label]),
        }
        frac = label.rsplit(" ", 1)[1]
        refs = (
            ()
            if label.startswith("streaming")
            else (("vs_streaming", f"streaming {frac}"), ("vs_streaming_more", f"streaming+{extra} {frac}"))
        )
        for key, ref in refs:
            diffs = [a - b for a, b in zip(vals, nll[ref])]
            row[key] = math.exp(sum(diffs) / total) - 1
            row[key + "_90"] = bootstrap(diffs, tokens)
        rows.append(row)
    return {"plain_gen_ppl": plain, "gen_tokens": total, "extra_blocks": extra, "rows": rows}


def main(args) -> int:
    from ..workloads import Tokenizer, stdlib_texts

    console = Console()
    from ...launch.engine import models_dir

    model = args.model or str(models_dir() / DEFAULT_MODEL)
    if not 0 < args.gen_tokens < args.context // 2:
        raise SystemExit(f"kv-headroom: --gen-tokens must be between 1 and half the context ({args.context // 2})")
    from ...hooks import get_registry
    from ..plugin_args import PluginArgError, parse_json_params, parse_spec, split_list

    arms = split_list(args.arms)
    try:
        params = parse_json_params(args.params)
        named = {a: parse_spec(a)[0] for a in arms if a not in ARMS}
    except PluginArgError as e:
        raise SystemExit(f"kv-headroom: {e}") from None
    registry = get_registry()
    unknown = [a for a, name in named.items() if ("kvcompress", name) not in registry or name in ("kv4", "noop")]
    if unknown:
        known = [n for n in registry.names("kvcompress") if n not in ("kv4", "noop")]
        raise SystemExit(
            f"kv-headroom: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)} or a "
            f"registered kvcompress plugin ({', '.join(known)}), optionally NAME:{{JSON params}}"
        )
    for a, name in named.items():
        reg = registry.get("kvcompress", name).registration
        if getattr(reg.load(), "per_head", False):
            raise SystemExit(
                f"kv-headroom: {name!r} chooses blocks per KV head (keep_heads), which this "
                "replay does not model; measure it with kvbench"
            )
    if "streaming" not in arms:
        arms.insert(0, "streaming")  # the reference of the comparison
    tok = Tokenizer.from_model(model)
    texts = stdlib_texts(tok, num=args.texts, tokens=args.context - 1, seed=args.seed)
    fractions = tuple(int(f) for f in args.fractions.split(","))
    blocks = -(-(args.context - 1) // args.block)
    small = [f for f in fractions if blocks // f < 2]
    if small:
        raise SystemExit(
            f"kv-headroom: --fractions {','.join(map(str, small))} leave fewer than 2 of the context's "
            f"{blocks} blocks of {args.block} tokens; use smaller fractions or a longer --context"
        )
    context = -(-args.context // args.block) * args.block
    for a in named:  # parameters validated (by each plugin's model) before the model is loaded
        for frac in fractions:
            arm_choice(a, context, args.block, frac, 0, params)
    res = study(
        model,
        texts,
        block=args.block,
        chunk=args.chunk,
        gen=args.gen_tokens,
        fractions=fractions,
        arms=arms,
        progress=lambda s: console.print(f"[dim]{s}[/]"),
        params=params,
    )
    table = Table(
        title=f"gen ppl of the last {args.gen_tokens} tokens of {args.texts} texts "
        f"({res['gen_tokens']} tokens), block {args.block}: plain {res['plain_gen_ppl']:.3f}"
    )
    for col in (
        "arm",
        "blocks",
        "gen ppl",
        "vs plain",
        "vs streaming [90%]",
        f"vs streaming+{res['extra_blocks']} [90%]",
    ):
        table.add_column(col)

    def vs(r, key):
        if key not in r:
            return ""
        lo, hi = r[key + "_90"]
        return f"{100 * r[key]:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"

    for r in res["rows"]:
        table.add_row(
            r["arm"],
            "" if r["blocks"] is None else f"{r['blocks']:.1f}",
            f"{r['gen_ppl']:.3f}",
            f"{100 * r['change']:+.1f}%",
            vs(r, "vs_streaming"),
            vs(r, "vs_streaming_more"),
        )
    console.print(table)
    write_json(args.json, res)
    return 0


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "kv-headroom",
        help="KV eviction policies against an oracle and against streaming, with intervals",
        description=__doc__.split("\n\n", 1)[1].split("\n\nScores")[0],
    )
    p.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma list (default all: {', '.join(ARMS)}); also any registered kvcompress plugin "
        "by name (a third party's too), optionally NAME:{JSON} with its parameters, its budget "
        "set as kvbench sets it (budget_blocks and sink_blocks where its parameter model has "
        "them); a scored plugin's (needs_scores) blocks are scored by the mass of the prompt "
        "queries its score_positions select (decode-time accumulation is not replayed), and "
        "per-KV-head plugins are refused",
    )
    p.add_argument(
        "--params",
        metavar="JSON",
        help="parameters for the registered-plugin arms of --arms that are not kv-headroom's own "
        "(under a NAME:{JSON} entry's), validated by each plugin's parameter model",
    )
    add_text_arguments(p, texts=16, model=DEFAULT_MODEL)
    p.add_argument("--json", help="write the rows to this file")
    p.set_defaults(func=lambda args, console=None: main(args))
