"""`vllm-graft treebench`: tree versus chain speculative verification, as accepted tokens per
verify step, in one run on the same prompts, without vLLM (issue 25, part 1).

This is a *logical* measurement: it counts target forward passes and the draft tokens each
one accepts, never wall-clock time (one forward over a tree of tens of nodes costs about one
decode step on a GPU, not on this reference loop's CPU). It needs no engine: a reference
speculative-decoding loop runs the bundled model (``models/graft-tiny-llama``) in
PyTorch/transformers, greedy, batch 1, prompts one after another.

The verify step
---------------
Each verify step is ONE forward of the target over the verified tokens not yet in its KV cache
plus the flattened draft tree (:class:`TreeTarget`):

* inputs: the *pending* tokens (the previous step's accepted drafts and bonus token: their
  keys/values are recomputed here rather than gathered out of the tree, which keeps the cache
  a plain prefix), then the tree's nodes in index order;
* a custom 4D float attention mask ``[1, 1, Q, K]`` of 0 / -inf (transformers returns a 4D
  mask unchanged, ``masking_utils``): a pending token sees the cache and the pending tokens up
  to itself (causal); a tree node sees the cache, every pending token and its
  ancestors-or-self (``DraftTree.ancestor_mask``);
* ``position_ids``: pending token ``r`` at ``cached + r``; tree node ``i`` at ``context
  length - 1 + depth[i]`` (the context being the cache plus the pending tokens);
* the KV cache (a ``DynamicCache``) is cropped back after the forward, dropping the tree's
  entries (only the verified prefix stays; the accepted nodes come back as the next step's
  pending tokens).

The root's prediction is the last pending row; node ``i``'s is row ``P + i``. Their argmax go
to ``verify_greedy``, which gives the accepted path and the bonus token. The first forward of
a prompt is its prefill (the whole prompt pending, no tree), which emits the first token.
Drafts never go deeper than the output budget left (``max_tokens - emitted - 1``), so every
arm emits exactly ``max_tokens`` tokens per prompt (EOS is not special: ``ignore_eos``).

Arms (each with a fresh proposer state per workload, shared by that workload's prompts as the
real proposers share theirs across requests):

* ``greedy``: plain greedy, one token per forward: the reference output;
* ``recycling-chain``: Token Recycling's chain (``RecyclingMatrix.chain``, ``--chain-length``);
* ``recycling-tree``: its static tree (``RecyclingMatrix.tree`` with ``--breadth``);
* ``recycling-chain-wide``: a chain with as many tokens as the tree arm would draft at that
  point (the same verify width as the tree);
* ``lookahead-chain`` / ``lookahead-tree`` / ``lookahead-chain-wide``: the same for the trie
  (``TokenTrie.continuation``; ``TokenTrie.branches``, ``--branches`` chains merged by
  ``DraftTree.from_chains``).

Learning, as the proposers do in vLLM: Token Recycling's matrix takes, from each forward's
logits, the target's top-``--k`` after the root and after every tree node (rejected ones too:
the rows the step computed), and after the prompt's last token at prefill; the trie inserts
every complete ``--trie-depth`` window of the sequence before each draft.

Figures per (workload, arm), summed over the prompts:

* ``forwards``: target forward passes (prefill included); ``verify steps``: the forwards after
  prefill that checked a non-empty draft (steps with nothing to draft are plain decode steps);
* ``nodes/verify``: draft tree nodes per verify step (the verify width, the root excluded);
* ``acc/verify``: accepted draft tokens per verify step (as specbench's ``acc/verify``: vLLM's
  accepted tokens / drafts); ``acc/step``: accepted per decode forward (empty drafts count);
* ``tok/fwd``: output tokens per forward (1.0 for greedy);
* ``identical``: prompts whose output tokens equal greedy's (every arm must have all of them:
  the command fails otherwise);
* ratios per proposer: tree / chain and tree / chain-wide, of ``acc/verify`` and ``tok/fwd``
  (issue 25's target: tree >= 1.3x chain on code, read on ``acc/verify``).

Defaults: 8 prompts x 64 tokens of ``code-completion`` and ``extractive``; chains of 4 tokens;
the Token Recycling tree ``--breadth 4,2,1,1`` (28 nodes at depth 4, the chain's depth; fewer
while the matrix has empty cells); the lookahead tree 4 branches of 4 tokens (at most 16
nodes; the trie usually has fewer). The chain-wide arms show what the same verify width buys
as one long chain; note that ``TokenTrie.continuation`` matches a shorter suffix when asked
for more tokens (a window holds the match and the drafts), so lookahead's wide chain is not
simply the chain made longer. float32 on CPU, one torch thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..command_line import add_comma_list, from_args, tool_parser

DEFAULT_WORKLOADS = ("code-completion", "extractive")
PROPOSERS = ("recycling", "lookahead")
SHAPES = ("chain", "tree", "chain-wide")
ARMS = ("greedy", *(f"{p}-{s}" for p in PROPOSERS for s in SHAPES))
TARGET_RATIO = 1.3
SCHEMA = "vllm-graft-treebench/1"


# ------------------------------------------------------------------------------ plugin parts
def speculative_parts() -> tuple[Any, Any, Any]:
    """``(tree, recycling_policy, lookahead_policy)`` modules, reached through the registry as
    tools reach plugins: the two proposers' ``policy`` parts, and the tree primitives, which
    live beside them in the speculative plugins' package (``_tree``, registered by no one)."""
    from ...hooks import get_registry

    reg = get_registry()
    recycling = reg.get("speculative", "token-recycling").registration
    lookahead = reg.get("speculative", "lookahead").registration
    tree = importlib.import_module(recycling.package.rpartition(".")[0] + "._tree")
    return tree, recycling.part("policy"), lookahead.part("policy")


# ------------------------------------------------------------------------------ the target
def tree_inputs(
    cached: int, n_pending: int, parents: Any, depth: Any, ancestors: Any, dtype: Any = None
) -> tuple[Any, Any]:
    """``(mask [1, 1, Q, K], position_ids [1, Q])`` for one verify forward: ``Q = n_pending +
    N`` queries (the pending tokens, then the ``N`` tree nodes) over ``K = cached + Q`` keys
    (see the module docstring). ``ancestors``: the tree's ``[N, N]`` ancestor-or-self mask."""
    import torch

    dtype = dtype or torch.float32
    n = len(parents)
    q = n_pending + n
    allowed = torch.zeros(q, cached + q, dtype=torch.bool)
    allowed[:, :cached] = True
    allowed[:n_pending, cached : cached + n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool).tril()
    allowed[n_pending:, cached : cached + n_pending] = True
    allowed[n_pending:, cached + n_pending :] = ancestors
    mask = torch.zeros(q, cached + q, dtype=dtype).masked_fill(~allowed, float("-inf"))
    context = cached + n_pending
    positions = torch.cat(
        [torch.arange(cached, context, dtype=torch.long), context - 1 + torch.as_tensor(depth, dtype=torch.long)]
    )
    return mask[None, None], positions[None]


class TreeTarget:
    """The target model with one sequence's KV cache (the verified prefix)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: Any = None
        self.cached = 0
        self.forwards = 0

    def start(self) -> None:
        """A new sequence: an empty cache."""
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers before 4.56 takes no config
            self.cache = DynamicCache()
        self.cached = 0

    def forward(self, pending: Sequence[int], tree: Any) -> Any:
        """One forward over ``pending`` (verified tokens not in the cache yet, at least one)
        and the draft ``tree``; returns the logits ``[len(pending) + N, V]``. Afterwards the
        cache holds the verified prefix: what it held plus ``pending``."""
        import torch

        p, n = len(pending), len(tree)
        if p < 1:
            raise ValueError("a verify forward needs at least one pending token (the root)")
        dtype = next(self.model.parameters()).dtype
        mask, positions = tree_inputs(self.cached, p, tree.parents, tree.depth, tree.ancestor_mask(), dtype)
        ids = torch.cat([torch.as_tensor(list(pending), dtype=torch.long), tree.tokens])[None]
        with torch.no_grad():
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True
            )
        if n:
            self.cache.crop(-n)  # drop the tree: negative = tokens to remove (transformers 4 and 5)
        self.cached += p
        if self.cache.get_seq_length() != self.cached:
            raise RuntimeError(f"KV cache holds {self.cache.get_seq_length()} tokens, expected {self.cached}")
        self.forwards += 1
        return out.logits[0]


def clip_depth(tree_mod: Any, tree: Any, max_depth: int) -> Any:
    """``tree`` without its nodes deeper than ``max_depth`` (ancestors are never deeper than
    their descendants, so every kept node keeps its parent; indices are renumbered)."""
    keep = [i for i, d in enumerate(tree.depth.tolist()) if d <= max_depth]
    if len(keep) == len(tree):
        return tree
    new = {old: j for j, old in enumerate(keep)}
    parents = [-1 if int(tree.parents[i]) < 0 else new[int(tree.parents[i])] for i in keep]
    return tree_mod.DraftTree([int(tree.tokens[i]) for i in keep], parents)


# ------------------------------------------------------------------------------ proposers
@dataclass
class Settings:
    chain_length: int = 4
    breadth: tuple[int, ...] = (4, 2, 1, 1)
    k: int = 8  # Token Recycling: successors kept per token
    branches: int = 4  # lookahead tree: chains merged
    trie_depth: int = 8
    min_match: int = 1
    max_nodes: int = 200_000


class Drafter:
    """One arm's proposer: ``draft(seq, budget)`` -> DraftTree (no deeper than ``budget``);
    ``learn(root, tree, rows)`` from a forward's logits rows (root first, then each node)."""

    def __init__(self, parts: tuple[Any, Any, Any], arm: str, s: Settings) -> None:
        self.tree_mod, rec, la = parts
        self.arm, self.s = arm, s
        self.proposer, _, self.shape = arm.partition("-")
        self.matrix = rec.RecyclingMatrix(s.k) if self.proposer == "recycling" else None
        self.trie = la.TokenTrie(s.trie_depth, s.max_nodes) if self.proposer == "lookahead" else None
        self.inserted = 0

    def start(self) -> None:
        self.inserted = 0  # trie windows of the new sequence inserted so far

    def _tree(self, seq: Sequence[int], budget: int) -> Any:
        T = self.tree_mod.DraftTree
        if self.matrix is not None:
            return clip_depth(self.tree_mod, T.from_nodes(self.matrix.tree(seq[-1], self.s.breadth)), budget)
        length = min(self.s.chain_length, budget)
        assert self.trie is not None  # an arm has a recycling matrix or a lookahead trie
        return T.from_chains(self.trie.branches(seq, length, self.s.branches, self.s.min_match))

    def _chain(self, seq: Sequence[int], length: int) -> list[int]:
        if self.matrix is not None:
            return self.matrix.chain(seq[-1], length)
        assert self.trie is not None  # an arm has a recycling matrix or a lookahead trie
        return self.trie.continuation(seq, length, self.s.min_match)

    def draft(self, seq: Sequence[int], budget: int) -> Any:
        T = self.tree_mod.DraftTree
        if self.trie is not None:
            stop = max(self.inserted, len(seq) - self.trie.depth + 1)
            self.trie.insert_range(seq, self.inserted, stop)
            self.inserted = stop
        if self.proposer == "greedy" or budget <= 0:
            return T([], [])
        if self.shape == "tree":
            return self._tree(seq, budget)
        length = min(self.s.chain_length, budget)
        if self.shape == "chain-wide":
            length = min(len(self._tree(seq, budget)), budget)
        return T.from_chains([self._chain(seq, length)])

    def learn(self, root: int, tree: Any, rows: Any) -> None:
        if self.matrix is None:
            return
        import torch

        k = min(self.s.k, int(rows.shape[-1]))
        ids = torch.topk(rows.float(), k, dim=-1).indices.numpy()
        self.matrix.update([int(root), *tree.tokens.tolist()], ids)


# ------------------------------------------------------------------------------ the loop
@dataclass
class PromptRun:
    tokens: list[int]
    forwards: int = 0
    steps: int = 0  # decode forwards (after prefill)
    verify_steps: int = 0  # decode forwards with a non-empty draft
    nodes: int = 0  # draft nodes verified, over all steps
    accepted: int = 0  # draft tokens accepted
    accept_hist: dict[int, int] = field(default_factory=dict)


def generate(
    target: TreeTarget, drafter: Drafter, verify_greedy: Any, prompt: Sequence[int], max_tokens: int
) -> PromptRun:
    """Greedy speculative decoding of ``max_tokens`` tokens after ``prompt`` (module docstring)."""
    T = drafter.tree_mod.DraftTree
    target.start()
    drafter.start()
    empty = T([], [])
    prompt = [int(t) for t in prompt]
    logits = target.forward(prompt, empty)  # prefill
    drafter.learn(prompt[-1], empty, logits[-1:])
    out = [int(logits[-1].argmax())]
    run = PromptRun(out, forwards=1)
    pending = out[-1:]
    while len(out) < max_tokens:
        seq = prompt + out
        tree = drafter.draft(seq, max_tokens - len(out) - 1)
        logits = target.forward(pending, tree)
        rows = logits[len(pending) - 1 :]  # the root's prediction, then each node's
        verdict = verify_greedy(tree, rows.argmax(-1))
        drafter.learn(seq[-1], tree, rows)
        emitted = verdict.tokens(tree)
        out += emitted
        pending = emitted
        run.forwards += 1
        run.steps += 1
        if len(tree):
            run.verify_steps += 1
            run.nodes += len(tree)
            run.accepted += len(verdict.accepted)
            run.accept_hist[len(verdict.accepted)] = run.accept_hist.get(len(verdict.accepted), 0) + 1
    assert len(out) == max_tokens, (len(out), max_tokens)
    return run


def run_arm(
    model: Any, parts: tuple[Any, Any, Any], arm: str, prompts: Sequence[tuple[Sequence[int], int]], settings: Settings
) -> list[PromptRun]:
    """Every prompt ``(token_ids, max_tokens)`` in order, with one proposer state."""
    target = TreeTarget(model)
    drafter = Drafter(parts, arm, settings)
    return [generate(target, drafter, parts[0].verify_greedy, p, m) for p, m in prompts]


# ------------------------------------------------------------------------------ figures
def figures(runs: Sequence[PromptRun], reference: Sequence[PromptRun] | None) -> dict[str, Any]:
    """The figures of one (workload, arm) (module docstring), from its prompts' runs and the
    greedy arm's (``identical``)."""
    out = sum(len(r.tokens) for r in runs)
    fwd = sum(r.forwards for r in runs)
    steps = sum(r.steps for r in runs)
    verify = sum(r.verify_steps for r in runs)
    nodes = sum(r.nodes for r in runs)
    acc = sum(r.accepted for r in runs)
    hist: dict[int, int] = {}
    for r in runs:
        for a, c in r.accept_hist.items():
            hist[a] = hist.get(a, 0) + c
    same = None if reference is None else sum(a.tokens == b.tokens for a, b in zip(runs, reference))
    return {
        "prompts": len(runs),
        "output_tokens": out,
        "forwards": fwd,
        "decode_steps": steps,
        "verify_steps": verify,
        "draft_nodes": nodes,
        "accepted": acc,
        "nodes_per_verify": nodes / verify if verify else 0.0,
        "acc_per_verify": acc / verify if verify else 0.0,
        "acc_per_step": acc / steps if steps else 0.0,
        "tok_per_fwd": out / fwd if fwd else 0.0,
        "identical": same,
        "accept_hist": dict(sorted(hist.items())),
    }


def ratios(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per proposer: tree / chain and tree / chain-wide of ``acc_per_verify`` and ``tok_per_fwd``."""
    out = []
    for p in PROPOSERS:
        chain, tree, wide = (rows.get(f"{p}-{s}") for s in ("chain", "tree", "chain-wide"))
        if tree is None:
            continue
        r: dict[str, Any] = {"proposer": p}
        for name, base in (("chain", chain), ("chain_wide", wide)):
            for key in ("acc_per_verify", "tok_per_fwd"):
                r[f"{key}_vs_{name}"] = tree[key] / base[key] if base and base[key] else None
        x = r["acc_per_verify_vs_chain"]
        r["target_met"] = None if x is None else x >= TARGET_RATIO
        out.append(r)
    return out


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def render(results: dict[str, dict[str, Any]]) -> str:
    """Markdown tables: the arms per workload, then the tree/chain ratios."""
    cols = [
        "workload",
        "arm",
        "forwards",
        "verify steps",
        "nodes/verify",
        "acc/verify",
        "acc/step",
        "tok/fwd",
        "identical",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for w, res in results.items():
        for arm, f in res["arms"].items():
            ident = "-" if f["identical"] is None else f"{f['identical']}/{f['prompts']}"
            lines.append(
                "| "
                + " | ".join(
                    [
                        w,
                        arm,
                        str(f["forwards"]),
                        str(f["verify_steps"]),
                        _f(f["nodes_per_verify"], ".1f"),
                        _f(f["acc_per_verify"]),
                        _f(f["acc_per_step"]),
                        _f(f["tok_per_fwd"], ".3f"),
                        ident,
                    ]
                )
                + " |"
            )
    cols = [
        "workload",
        "proposer",
        "tree/chain acc/verify",
        "tree/chain tok/fwd",
        "tree/chain-wide acc/verify",
        "tree/chain-wide tok/fwd",
        f">= {TARGET_RATIO}x chain",
    ]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for w, res in results.items():
        for r in res["ratios"]:
            lines.append(
                "| "
                + " | ".join(
                    [
                        w,
                        r["proposer"],
                        _f(r["acc_per_verify_vs_chain"]),
                        _f(r["tok_per_fwd_vs_chain"]),
                        _f(r["acc_per_verify_vs_chain_wide"]),
                        _f(r["tok_per_fwd_vs_chain_wide"]),
                        {True: "yes", False: "no", None: "-"}[r["target_met"]],
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ command
def load_model(path: str | Path, dtype: str = "float32") -> Any:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from .. import workloads as wl

    if args.model is None:
        from ...launch.engine import models_dir

        args.model = str(models_dir() / "graft-tiny-llama")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = from_args(Settings, args)  # max_nodes has no argument: its default
    if max(settings.breadth) > settings.k:
        raise SystemExit(f"--breadth {settings.breadth} needs --k >= {max(settings.breadth)}")
    arms = [a for part in args.arms for a in part.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; accepted: {', '.join(ARMS)}")
    if "greedy" not in arms:
        arms.insert(0, "greedy")
    arms.sort(key=ARMS.index)
    workloads = wl.parse_names(args.workload)
    model = load_model(args.model, args.dtype)
    parts = speculative_parts()
    tok = wl.Tokenizer.from_model(args.model)
    max_model_len = int(model.config.max_position_embeddings)
    sets = wl.build(
        workloads,
        tok,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        max_model_len=max_model_len,
        seed=args.seed,
    )
    print(
        f"[treebench] logical figures (accepted tokens per verify forward), not wall-clock; "
        f"chain length {settings.chain_length}, recycling tree breadth {settings.breadth} "
        f"(k={settings.k}), lookahead tree {settings.branches} branches",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for ps in sets:
        prompts = [(p.token_ids, p.max_tokens) for p in ps.prompts]
        per_arm: dict[str, list[PromptRun]] = {}
        rows: dict[str, dict[str, Any]] = {}
        for arm in arms:
            t0 = time.perf_counter()
            per_arm[arm] = run_arm(model, parts, arm, prompts, settings)
            rows[arm] = figures(per_arm[arm], None if arm == "greedy" else per_arm["greedy"])
            rows[arm]["seconds"] = time.perf_counter() - t0
            print(f"[treebench] {ps.name} / {arm}: {rows[arm]['seconds']:.1f}s", flush=True)
        results[ps.name] = {"fingerprint": ps.fingerprint(), "arms": rows, "ratios": ratios(rows)}
        raw[ps.name] = {
            a: [{"tokens": r.tokens, "forwards": r.forwards, "accepted": r.accepted} for r in runs]
            for a, runs in per_arm.items()
        }
    table = render(results)
    print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "schema": SCHEMA,
                    "model": str(args.model),
                    "dtype": args.dtype,
                    "figure": "logical: accepted draft tokens per verify forward (not wall-clock)",
                    "settings": {**settings.__dict__, "breadth": list(settings.breadth)},
                    "recycling_tree_nodes": _tree_size(settings.breadth),
                    "num_prompts": args.num_prompts,
                    "max_tokens": args.max_tokens,
                    "seed": args.seed,
                    "results": results,
                    "runs": raw,
                    "table": table,
                },
                indent=1,
            )
        )
    differ = [
        (w, a)
        for w, r in results.items()
        for a, f in r["arms"].items()
        if f["identical"] is not None and f["identical"] != f["prompts"]
    ]
    if differ:
        print(f"[treebench] ERROR: output differs from greedy in {differ}")
        return 1
    return 0


def _tree_size(breadth: Sequence[int]) -> int:
    """Nodes of a full static tree with this breadth per depth (the node budget)."""
    total, level = 0, 1
    for b in breadth:
        level *= b
        total += level
    return total


def add_command(sub: Any) -> None:
    help = (
        "tree vs chain speculative verification on the bundled "
        "model without vLLM: accepted tokens per verify step (logical, not wall-clock)"
    )
    p = tool_parser(sub, "treebench", help, lambda args, console=None: main(args), None)
    add_comma_list(p, "--arms", ARMS, ": all of them; greedy always runs")
    add_comma_list(p, "--workload", DEFAULT_WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--chain-length", type=int, default=4, help="chain arms' draft tokens")
    p.add_argument(
        "--breadth",
        type=_ints,
        default=(4, 2, 1, 1),
        help="Token Recycling tree: children per node at each depth (default 4,2,1,1: 28 nodes, depth 4)",
    )
    p.add_argument("--k", type=int, default=8, help="Token Recycling: successors kept per token")
    p.add_argument(
        "--branches", type=int, default=4, help="lookahead tree: trie branches of --chain-length tokens merged"
    )
    p.add_argument("--trie-depth", type=int, default=8, help="lookahead: tokens per trie window")
    p.add_argument("--min-match", type=int, default=1, help="lookahead: shortest suffix matched")
    p.add_argument("--model", default=None, help="HF Llama folder (default: the bundled graft-tiny-llama)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the figures do not depend on it, and a shared CPU "
        "stalls multi-threaded small matmuls; 0: torch's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure and every arm's output tokens to this file")
