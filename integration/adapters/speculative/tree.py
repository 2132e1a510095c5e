"""Tree verification inside vLLM's engine (issue 25, part 1): a proposer that drafts token
*trees* (``Proposer.drafts_trees``) has each tree verified in ONE forward of the target, with a
tree attention mask over the paged KV cache; the longest correct root-to-node path is accepted
and the KV of the rest discarded. vLLM 0.32/0.33 verify chains only (tree attention was removed
from vLLM), so this module adds what a chain verifier lacks, at four seams of the V1 model
runner (``GPUModelRunner``, which the CPU runner inherits):

1. **Drafts.** The tree's nodes, flattened in index order (parents first), are the request's
   draft tokens: vLLM schedules them as ``N`` speculative tokens after the root (the request's
   last verified token), computes their keys/values into the next ``N`` KV slots and one
   logits row each. :class:`~.drafting.Drafting` keeps each request's ``parents``.
2. **Positions** (patched ``_prepare_inputs``, after vLLM's): vLLM numbers the ``N + 1`` rows
   ``c, c + 1, ..., c + N`` (``c`` = tokens already computed). A node's rotary position must be
   its *depth*: node ``i`` gets ``c + depth[i]`` (1 for the root's children). The KV slots
   stay vLLM's (computed from the original positions before the rewrite), so every node has
   its own slot.
3. **Attention** (the graft attention backend, :mod:`..backend`, with :class:`TreeAttention` as
   its method): every row gets exact causal paged attention (``plugins/attention/_shared``), and
   the node rows of a tree request are recomputed with ``_tree.tree_attention``: node ``i``
   sees the context (the root included) and its own ancestors-or-self only.
4. **Verification** (patched ``_sample``, after vLLM's rejection sampler): for each tree
   request the logits rows (root, then node ``i`` at row ``i + 1``) go to
   ``_tree.verify_greedy`` (argmax; temperature 0) or ``_tree.verify_sampling`` (temperature
   sampling: recursive rejection sampling with deterministic drafts, lossless); the request's
   row of ``sampled_token_ids`` becomes the accepted path's tokens and the bonus token. vLLM's
   bookkeeping then sees ``len(path)`` accepted drafts: the scheduler keeps ``c + 1 +
   len(path)`` computed tokens. Last, the accepted nodes' keys/values move, in every layer's
   cache, from their slots to the slots right after the root (``c + 1 ...``), where vLLM will
   read them as the sequence's next positions; the slots after them are rewritten by later
   steps, as for rejected chain drafts.

Which requests get a tree (:func:`tree_verifiable`): temperature 0, or temperature sampling
without top-k, top-p, min-p, penalties, logit bias, bad words, allowed-token lists, structured
output or logprobs (what the verifier would have to reproduce of vLLM's sampler); for the
others the tree is cut to its first root-to-leaf path and vLLM verifies that chain (counted as
``tree_cut_to_chain``). A seeded sampled request gets no drafts, as for chains.

Limits, refused at start-up with the reason: one KV-cache group (plain decoder models); no
attention plugin or KV compressor in the same deployment (the tree needs the backend's own
attention and the cache's plain layout); the CPU engine (the CUDA route, Model Runner V2 and
the Triton kernel ``_tree.kernel`` in the engine are not wired yet). The attention is the
PyTorch reference: on CPU it is slower than vLLM's C++ kernel, so a tree's extra accepted
tokens must pay for that (see BENCHMARKS.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_graft.hooks import AttentionMethod, split_kv_cache

log = logging.getLogger("vllm_graft")

#: Sampling parameters a tree request may not use (value, the neutral one): the verifier
#: reproduces temperature sampling only.
_NEUTRAL = {"top_k": (0, -1, None), "top_p": (1.0, None), "min_p": (0.0, None),
            "presence_penalty": (0.0, None), "frequency_penalty": (0.0, None),
            "repetition_penalty": (1.0, None), "logit_bias": (None,), "bad_words": (None,),
            "allowed_token_ids": (None,), "logprobs": (None,), "structured_outputs": (None,)}
_GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it a temperature means greedy


def tree_verifiable(sampling_params: Any) -> bool:
    """Whether the tree verifier reproduces vLLM's sampling for these ``SamplingParams``."""
    if sampling_params is None:
        return False
    for name, neutral in _NEUTRAL.items():
        value = getattr(sampling_params, name, None)
        if value not in neutral and not (isinstance(value, (list, dict)) and not value):  # [] / {}: unset
            return False
    return not getattr(sampling_params, "logits_processors", None)


def _tree_parts():
    from vllm_graft.plugins.speculative import _tree

    return _tree


@dataclass
class StepTree:
    """One request's tree in the current step."""

    tree: Any  # ``_tree.DraftTree``: the nodes' tokens, parents and depths
    slots: np.ndarray  # [N + 1] KV slots of the root and the nodes, as vLLM assigned them
    mask: torch.Tensor  # [N + 1, N + 1] bool: the pass's rows (root first) each row may see


class TreeVerifier:
    """The per-worker state of tree verification (one per :class:`~.engine.GraftProposer`)."""

    def __init__(self, count) -> None:
        self.count = count
        self.step: dict[int, StepTree] = {}  # batch row -> its tree, this step

    # ---- 2. positions -------------------------------------------------------------------
    def prepare(self, runner: Any, step_trees: dict[str, tuple[list[int], list[int]]],
                num_scheduled: np.ndarray) -> None:
        """After vLLM's ``_prepare_inputs``: note this step's trees (request id -> ``(tokens,
        parents)``, :attr:`.drafting.Drafting.step_trees`), rewrite node positions. A tree left
        out here is verified by vLLM as the chain of its flattened nodes: still exact, as vLLM
        then computes and checks them as one sequence."""
        self.step = {}
        if not step_trees:
            return
        batch = runner.input_batch
        tables = batch.block_table
        if len(getattr(tables, "block_tables", [tables])) != 1:
            raise NotImplementedError("vllm-graft tree verification supports one KV-cache group "
                                      "(plain decoder models)")
        table = tables[0]
        blocks = table.get_numpy_array()
        size = int(table.block_size)
        qsl = runner.query_start_loc.np
        tree_mod = _tree_parts()
        for rid, (tokens, parents) in step_trees.items():
            row = batch.req_id_to_index.get(rid)
            n = len(parents)
            if row is None or int(num_scheduled[row]) != n + 1 or min(tokens) < 0:
                continue  # not a decode step with all its drafts (preempted, chunked, invalidated)
            first = int(qsl[row])
            context = int(batch.num_computed_tokens_cpu[row])  # the root's position
            tree = tree_mod.DraftTree(tokens, parents)
            runner.positions[first + 1:first + 1 + n] = (context + tree.depth).to(
                runner.positions.device, runner.positions.dtype)
            pos = context + np.arange(n + 1)
            slots = blocks[row, pos // size].astype(np.int64) * size + pos % size
            mask = tree_mod.ancestor_mask([-1, *(p + 1 for p in parents)])  # the root as node 0
            self.step[row] = StepTree(tree, slots, mask)

    def plan(self) -> dict[int, torch.Tensor]:
        """For the attention: batch row -> the pass mask of its tree (root first)."""
        return {row: t.mask for row, t in self.step.items()}

    # ---- 4. verification ----------------------------------------------------------------
    def verify(self, runner: Any, logits: torch.Tensor, spec_decode_metadata: Any, output: Any) -> None:
        """After vLLM's rejection sampler: replace each tree request's sampled tokens with its
        tree's verdict and move the accepted nodes' KV (see the module docstring)."""
        if not self.step or spec_decode_metadata is None or logits is None:
            return
        tree_mod = _tree_parts()
        drafts = list(spec_decode_metadata.num_draft_tokens)
        starts = np.concatenate([[0], np.cumsum(np.asarray(drafts) + 1)])
        sampled = output.sampled_token_ids
        batch = runner.input_batch
        moves_src: list[int] = []
        moves_dst: list[int] = []
        n_accepted = 0
        for row, t in self.step.items():
            tree, n = t.tree, len(t.tree)
            if row >= len(drafts) or drafts[row] != n:
                raise RuntimeError(f"vllm-graft tree verification: batch row {row} has {drafts[row] if row < len(drafts) else None} "
                                   f"draft rows, its tree {n} nodes")
            rows = logits[int(starts[row]):int(starts[row]) + n + 1]
            params = runner.requests[batch.req_ids[row]].sampling_params
            if params.temperature < _GREEDY_EPS:
                verdict = tree_mod.verify_greedy(tree, rows.argmax(dim=-1).cpu())
            else:
                probs = torch.softmax(rows.float() / float(params.temperature), dim=-1)
                one_hot = torch.zeros(n, rows.shape[-1], dtype=torch.float64)
                one_hot[torch.arange(n), tree.tokens] = 1.0
                generator = getattr(batch, "generators", {}).get(row)
                verdict = tree_mod.verify_sampling(tree, probs, one_hot, generator)
            emitted = verdict.tokens(tree)
            sampled[row].fill_(-1)
            sampled[row, :len(emitted)] = torch.tensor(emitted, dtype=sampled.dtype)
            for k, node in enumerate(verdict.accepted):
                if node != k:  # slot of node k-th on the path vs where the sequence needs it
                    moves_src.append(int(t.slots[1 + node]))
                    moves_dst.append(int(t.slots[1 + k]))
            n_accepted += len(verdict.accepted)
        if moves_src:
            move_kv(runner.kv_caches, moves_src, moves_dst)
        self.count("tree_verify", len(self.step))
        if n_accepted:
            self.count("tree_accepted", n_accepted)
        self.step = {}


def move_kv(kv_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Copy the keys/values at KV slots ``src`` to slots ``dst`` in every layer's cache (layout
    of ``split_kv_cache``). Sources are read before any destination is written."""
    for cache in kv_caches:
        if cache is None:
            continue
        size = cache.shape[2]
        s = torch.tensor(src, dtype=torch.long, device=cache.device)
        d = torch.tensor(dst, dtype=torch.long, device=cache.device)
        for part in split_kv_cache(cache):
            part[d // size, :, d % size] = part[s // size, :, s % size]


class TreeAttention(AttentionMethod):
    """The graft backend's attention while trees are verified (module docstring, seam 3): each
    tree request's rows (its root and nodes) by ``_tree.verify_pass_attention`` under its pass
    mask, every other sequence by exact causal paged attention. ``plan`` is the step's batch
    row -> pass mask map."""

    def plan(self, batch):
        return _ACTIVE.plan() if _ACTIVE is not None else {}

    def forward(self, query, kv_cache, batch, layer, plan=None):
        from vllm_graft.plugins.attention._shared import paged_attention

        if not plan:
            return paged_attention(query, kv_cache, batch, layer)
        qsl = batch.query_start_loc.tolist()
        num_seqs = len(qsl) - 1
        out = torch.empty_like(query)
        others = [i for i in range(num_seqs) if i not in plan]
        if others:  # the sequences without a tree, as one smaller batch
            dev = query.device
            rows = torch.cat([torch.arange(qsl[i], qsl[i + 1], device=dev) for i in others])
            lens = torch.tensor([qsl[i + 1] - qsl[i] for i in others], device=dev)
            sub = type(batch)(query_start_loc=torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(
                                  batch.query_start_loc.dtype),
                              seq_lens=batch.seq_lens[others], block_table=batch.block_table[others])
            out[rows] = paged_attention(query[rows], kv_cache, sub, layer)
        k_cache, v_cache = split_kv_cache(kv_cache)
        verify_pass_attention = _tree_parts().verify_pass_attention
        for row, mask in plan.items():
            start, end = qsl[row], qsl[row + 1]
            out[start:end] = verify_pass_attention(query[start:end], k_cache, v_cache, batch.block_table[row],
                                                   int(batch.seq_lens[row]), mask, layer.scale)
        return out


# ---------------------------------------------------------------- activation (the adapter)
_ACTIVE: TreeVerifier | None = None  # the verifier of this process's proposer
_ATTENTION = TreeAttention(None)


def drafts_trees(enabled: Any, plan: Any) -> bool:
    """Whether the enabled proposer drafts trees; refuses (ValueError naming the fix) what tree
    verification cannot run with (see the module docstring)."""
    from vllm_graft.integration.runtime import RUNTIME

    if not getattr(RUNTIME.instance(enabled), "drafts_trees", False):
        return False
    where = f"speculative plugin {enabled.name!r} drafts trees"
    others = [e.name for e in plan.enabled if str(e.kind) in ("attention", "kvcompress")]
    if others:
        raise ValueError(f"{where}, whose verification computes attention itself; it cannot be "
                         f"combined with {', '.join(repr(o) for o in others)} yet: leave those "
                         "out of the deployment, or turn the tree off (tree: false)")
    engine = getattr(plan.deployment, "engine", None) or {}
    if int(engine.get("tensor_parallel_size", 1) or 1) > 1 or int(engine.get("pipeline_parallel_size", 1) or 1) > 1:
        raise ValueError(f"{where}: tree verification runs on one rank so far (each rank would "
                         "verify and move KV on its own); set tensor_parallel_size and "
                         "pipeline_parallel_size to 1, or tree: false")
    if plan.platform not in (None, "cpu"):
        raise ValueError(f"{where}: tree verification runs on vLLM's CPU engine only so far "
                         f"(platform {plan.platform!r}); set tree: false to verify chains")
    return True


def activate_verifier(count) -> TreeVerifier:
    """The proposer's verifier, which the attention method reads its plan from."""
    global _ACTIVE
    _ACTIVE = TreeVerifier(count)
    return _ACTIVE


def install_attention(owner: str) -> None:
    from vllm_graft.integration.adapters import backend

    if backend.SEAMS.method is not None and backend.SEAMS.method is not _ATTENTION:
        raise ValueError(f"tree verification needs the graft attention backend's method, and "
                         f"attention plugin {backend.SEAMS.method_name!r} holds it")
    backend.install(owner)
    backend.SEAMS.method, backend.SEAMS.method_name = _ATTENTION, "tree-verification"
    backend.SEAMS.host_kernel = False


def uninstall_attention(owner: str) -> None:
    from vllm_graft.integration.adapters import backend

    global _ACTIVE
    _ACTIVE = None
    if backend.SEAMS.method is _ATTENTION:
        backend.SEAMS.method, backend.SEAMS.method_name = None, ""
        backend.uninstall(owner)


__all__ = ["TreeAttention", "TreeVerifier", "activate_verifier", "drafts_trees",
           "install_attention", "move_kv", "tree_verifiable", "uninstall_attention"]
