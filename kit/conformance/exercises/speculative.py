"""The kit's speculative exercise (simulated requests with repetitive 'target model'
continuations, drafts accepted as a verifier would) and the ``state`` check: a proposer
holds nothing of a request after ``finish()``.

The exercise calls every method of the contract as the speculative adapter does (``begin_step``,
``propose`` or ``propose_tree``, ``observe_topk`` where ``topk`` > 0, ``accepted``, ``finish``),
with ``max_tokens`` / ``max_nodes`` varying from step to step; the kit is the verifier (its
acceptance is the longest correct prefix of the drafts, or path of the tree). A draft must fit
the request's vocabulary: every token the kit shows a proposer (the requests, the target's
top-k, the random target of a self-speculative proposer) is below :data:`SPEC_VOCAB`.
"""

from __future__ import annotations

import random
from typing import Any

from ..base import Target, build

SPEC_REQUESTS = 6
SPEC_STEPS = 25
SPEC_VOCAB = 64
#: ``max_tokens`` per step (capped by the plugin's ``num_speculative_tokens``), varied as vLLM
#: varies it near a request's length limit; ``max_nodes`` of a tree step likewise.
SPEC_MAX_TOKENS = (4, 4, 2, 4, 1, 3)
TREE_MAX_NODES = (12, 12, 5, 12, 3)


def _truth(r: int, length: int) -> list[int]:
    """Request r's 'target model' continuation: a repetitive sequence (drafts can hit)."""
    rnd = random.Random(r)
    motif = [rnd.randrange(SPEC_VOCAB) for _ in range(3 + r % 4)]
    return [motif[i % len(motif)] if rnd.random() > 0.15 else rnd.randrange(SPEC_VOCAB) for i in range(length)]


def request_id(r: int) -> str:
    return f"graft-conformance-req-{r}"


def random_target(vocab: int = SPEC_VOCAB, dtype: str = "float32", seed: int = 0) -> Any:
    """A small random Llama-style :class:`~vllm_graft.hooks.contracts.target.TargetWeights`
    (4 layers, hidden 32, 4 query / 2 KV heads of 8, vocabulary ``vocab``), attached to a
    self-speculative proposer (``needs_target_weights``) before the exercise, as the vLLM
    adapter attaches the served model."""
    import torch

    from ....hooks.contracts.target import TargetLayer, TargetWeights

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden, heads, kv_heads, head_dim, inter = 32, 4, 2, 8, 48

    def r(*shape: int, scale: float = 0.2) -> Any:
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    def norm() -> Any:
        return (1 + torch.randn(hidden, generator=g) * 0.1).to(dt)

    layers = [
        TargetLayer(
            qkv=r((heads + 2 * kv_heads) * head_dim, hidden),
            o=r(hidden, heads * head_dim),
            gate_up=r(2 * inter, hidden),
            down=r(hidden, inter),
            input_norm=norm(),
            post_attention_norm=norm(),
        )
        for _ in range(4)
    ]
    return TargetWeights(
        embed=r(vocab, hidden, scale=1.0),
        layers=layers,
        final_norm=norm(),
        lm_head=r(vocab, hidden, scale=1.0),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        source="graft-conformance random target",
    )


def exercise_speculative(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    import numpy as np

    results = []
    if getattr(impl, "needs_target_weights", False):
        impl.attach_target(random_target(SPEC_VOCAB, dtype))
    topk = int(getattr(impl, "topk", 0) or 0)
    cap = int(getattr(impl.params, "num_speculative_tokens", 0) or 0) or max(SPEC_MAX_TOKENS)
    for r in range(SPEC_REQUESTS):
        rid = request_id(r)
        truth = _truth(r, 40 + SPEC_STEPS * 6)
        tokens = truth[:40]
        drafts_seen: list[list[int]] = []
        rnd = random.Random(1000 + r)
        for step in range(SPEC_STEPS):
            max_tokens = min(cap, SPEC_MAX_TOKENS[(step + r) % len(SPEC_MAX_TOKENS)])
            impl.begin_step(1, 1 + (len(drafts_seen[-1]) if drafts_seen else 0))
            if getattr(impl, "drafts_trees", False):
                max_nodes = TREE_MAX_NODES[(step + r) % len(TREE_MAX_NODES)]
                drafts_seen.append(_tree_step(t, impl, rid, tokens, truth, topk, rnd, rules, max_nodes))
                continue
            drafts = impl.propose(rid, list(tokens), max_tokens)
            try:
                drafts = [int(x) for x in drafts]
            except (TypeError, ValueError):
                raise t.fail(f"propose() returned {drafts!r}; it must return a list of token ids") from None
            if rules and (len(drafts) > max_tokens or any(x < 0 for x in drafts)):
                raise t.fail(
                    f"propose() returned {drafts} for max_tokens={max_tokens} ({rid}, "
                    f"{len(tokens)} tokens): at most max_tokens non-negative token ids"
                )
            if rules and any(x >= SPEC_VOCAB for x in drafts):
                raise t.fail(
                    f"propose() returned {drafts} ({rid}, {len(tokens)} tokens): token id(s) "
                    f"{sorted({x for x in drafts if x >= SPEC_VOCAB})} are outside the vocabulary "
                    f"[0, {SPEC_VOCAB}) (every token the kit showed it is below {SPEC_VOCAB}); "
                    "draft tokens the target could produce"
                )
            drafts = drafts[:max_tokens]
            nxt = truth[len(tokens) : len(tokens) + len(drafts) + 1]
            acc = 0
            while acc < len(drafts) and drafts[acc] == nxt[acc]:
                acc += 1
            if topk > 0:  # what the target predicted at each computed position (row 0: the true next)
                positions = [tokens[-1], *drafts]
                rows = [
                    [
                        truth[len(tokens) + j] if len(tokens) + j < len(truth) else 0,
                        *(rnd.randrange(SPEC_VOCAB) for _ in range(topk - 1)),
                    ]
                    for j in range(len(positions))
                ]
                impl.observe_topk(rid, positions, np.array(rows, dtype=np.int64))
            if drafts:
                impl.accepted(rid, acc, len(drafts))
            tokens += nxt[: acc + 1]
            drafts_seen.append(drafts)
        results.append((rid, drafts_seen))
    for r in range(SPEC_REQUESTS):
        impl.finish(request_id(r))
    return results


TREE_NODES = 12


def _tree_step(
    t: Target,
    impl: Any,
    rid: str,
    tokens: list[int],
    truth: list[int],
    topk: int,
    rnd: random.Random,
    rules: bool,
    max_nodes: int = TREE_NODES,
) -> list[int]:
    """One step of a proposer that drafts trees (``Proposer.drafts_trees``): its tree checked
    against the contract, verified greedily against the truth as the vLLM adapter's verifier
    would (the longest path of correct nodes), then top-k rows and acceptance reported."""
    import numpy as np

    answer = impl.propose_tree(rid, list(tokens), max_nodes)
    try:
        nodes, parents = ([int(x) for x in part] for part in answer)
    except (TypeError, ValueError):
        raise t.fail(
            f"propose_tree() returned {answer!r}; it must return (tokens, parents), two lists of ints"
        ) from None
    if rules and (
        len(nodes) != len(parents)
        or len(nodes) > max_nodes
        or any(x < 0 for x in nodes)
        or any(not -1 <= p < i for i, p in enumerate(parents))
    ):
        raise t.fail(
            f"propose_tree() returned tokens {nodes} and parents {parents} for max_nodes="
            f"{max_nodes}: equal lengths, at most max_nodes non-negative tokens, "
            "-1 <= parents[i] < i"
        )
    if rules and any(x >= SPEC_VOCAB for x in nodes):
        raise t.fail(
            f"propose_tree() returned tokens {nodes} ({rid}): token id(s) "
            f"{sorted({x for x in nodes if x >= SPEC_VOCAB})} are outside the vocabulary "
            f"[0, {SPEC_VOCAB}) (every token the kit showed it is below {SPEC_VOCAB})"
        )
    nodes, parents = nodes[:max_nodes], parents[:max_nodes]
    path: list[int] = []
    while len(tokens) + len(path) < len(truth):
        want, at = truth[len(tokens) + len(path)], path[-1] if path else -1
        child = next((i for i, p in enumerate(parents) if p == at and nodes[i] == want), None)
        if child is None:
            break
        path.append(child)
    if topk > 0:  # row 0 after the root; row i + 1 after node i (the truth on the accepted path)
        depth_of = {node: d for d, node in enumerate(path)}
        rows = [[truth[len(tokens)], *(rnd.randrange(SPEC_VOCAB) for _ in range(topk - 1))]]
        for i in range(len(nodes)):
            d = depth_of.get(i)
            first = (
                truth[len(tokens) + d + 1]
                if d is not None and len(tokens) + d + 1 < len(truth)
                else rnd.randrange(SPEC_VOCAB)
            )
            rows.append([first, *(rnd.randrange(SPEC_VOCAB) for _ in range(topk - 1))])
        impl.observe_topk(rid, [tokens[-1], *nodes], np.array(rows, dtype=np.int64))
    if nodes:
        impl.accepted(rid, len(path), len(nodes))
    tokens += truth[len(tokens) : len(tokens) + len(path) + 1]
    return nodes


def _holders(obj: Any, needles: set[str], path: str, depth: int, seen: set[int]) -> list[str]:
    if id(obj) in seen or depth > 5:
        return []
    seen.add(id(obj))
    found: list[str] = []
    if isinstance(obj, str):
        return [path] if obj in needles else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and k in needles:
                found.append(f"{path}[{k!r}]")
            found += _holders(v, needles, f"{path}[{k!r}]", depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            found += _holders(v, needles, f"{path}[{i}]", depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        if type(obj).__module__.split(".")[0] in ("torch", "numpy"):
            return found
        for k, v in vars(obj).items():
            found += _holders(v, needles, f"{path}.{k}", depth + 1, seen)
    return found


def check_state(t: Target) -> str:
    impl = build(t)
    exercise_speculative(t, impl, "float32", rules=False)  # ends with finish() for every request
    held = _holders(impl, {request_id(r) for r in range(SPEC_REQUESTS)}, "self", 0, set())
    if held:
        raise t.fail(
            f"after finish() it still holds finished requests in {held[:5]}; release per-request state in finish()"
        )
    return f"{SPEC_REQUESTS} requests x {SPEC_STEPS} steps, nothing held after finish()"
