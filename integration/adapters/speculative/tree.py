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
   its method): rows without a tree get exact causal paged attention, and the rows of a tree
   request (root and nodes) attention under its pass mask: node ``i`` sees the context (the root
   included) and its own ancestors-or-self only. On vLLM's CPU engine, where the layer's ISA
   keeps vLLM's own cache layout (``cpu_vec``: ``vec``/``vec16``, checked once per process), vLLM
   writes the cache and its C++ kernel computes the causal rows: a step without trees entirely
   (the backend's ``plain`` seam), a step with trees and other rows for all its rows, after
   which only the tree rows are overwritten by their masked pass, ``_tree.verify_pass_attention``
   over the same cache (the backend's ``amends``/``amend`` seam); a step of trees alone runs
   only the passes. Elsewhere on CPU (another ISA, e.g.
   ``amx``, said once in the log) the backend writes the ``blocked`` layout and every row runs
   in PyTorch (``plugins/attention/_shared`` for the causal rows, then the masked pass). On
   CUDA (``packed``) the Triton kernel ``_tree.kernel`` computes the tree rows (the context read
   from the paged cache, the pass's own keys/values gathered from their slots) and the shared
   PyTorch attention the others. The cache is read through ``layer.kv_layout``. The step's
   indices (:class:`TreePlan`) are built once on the host and moved once; the layers read them
   without a host sync.
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

Limits, refused at start-up with the reason (:func:`drafts_trees`): one KV-cache group (plain
decoder models); no attention plugin or KV compressor in the same deployment (the tree needs
the backend's attention seam for itself); one rank (TP = PP = 1); vLLM's CPU engine or CUDA
(other platforms have no path). On CUDA the patched methods are Model Runner V1's, which
``integration/model_runner.py`` selects (vLLM also picks V1 for a ``custom_class`` proposer); the
backend's full CUDA graphs are off while the method is set. On CPU with a ``cpu_vec`` ISA a
tree step costs vLLM's kernel over the other rows plus the masked pass over each tree's rows
(its whole sequence read once per layer, in PyTorch); with another ISA every layer of every step runs in
PyTorch, slower than vLLM's C++ kernel, so a tree's extra accepted tokens must pay for that
(see docs/benchmarks/speculative.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ....hooks import BLOCKED, PACKED, AttentionMethod, Kind, KVCacheLayout
from ...runtime import RUNTIME

if TYPE_CHECKING:  # for the doctor's attribute rows: what is read of vLLM's runner
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU engine's runner subclasses it

log = logging.getLogger("vllm_graft")

#: Sampling parameters a tree request may not use (value, the neutral one): the verifier
#: reproduces temperature sampling only.
_NEUTRAL = {
    "top_k": (0, -1, None),
    "top_p": (1.0, None),
    "min_p": (0.0, None),
    "presence_penalty": (0.0, None),
    "frequency_penalty": (0.0, None),
    "repetition_penalty": (1.0, None),
    "logit_bias": (None,),
    "bad_words": (None,),
    "allowed_token_ids": (None,),
    "logprobs": (None,),
    "structured_outputs": (None,),
}
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
    from ....plugins.speculative import _tree

    return _tree


@dataclass
class StepTree:
    """One request's tree in the current step (host data, from ``_prepare_inputs``)."""

    tree: Any  # ``_tree.DraftTree``: the nodes' tokens, parents and depths
    slots: np.ndarray  # [N + 1] KV slots of the root and the nodes, as vLLM assigned them
    mask: torch.Tensor  # [N + 1, N + 1] bool: the pass's rows (root first) each row may see
    start: int = 0  # the root's query row in the step
    context: int = 0  # tokens before the root (the root's position)


class TreeVerifier:
    """The per-worker state of tree verification (one per :class:`~.engine.GraftProposer`)."""

    def __init__(self, count) -> None:
        self.count = count
        self.step: dict[int, StepTree] = {}  # batch row -> its tree, this step
        #: batch rows with query tokens this step that carry no tree (causal attention)
        self.others = False
        #: the step's attention plan (:class:`TreePlan`); its ``layout`` is the cache's
        self.last_plan: TreePlan | None = None

    # ---- 2. positions -------------------------------------------------------------------
    def prepare(
        self, runner: GPUModelRunner, step_trees: dict[str, tuple[list[int], list[int]]], num_scheduled: np.ndarray
    ) -> None:
        """After vLLM's ``_prepare_inputs``: note this step's trees (request id -> ``(tokens,
        parents)``, :attr:`.drafting.Drafting.step_trees`), rewrite node positions (one copy to
        the device per step). A tree left out here is verified by vLLM as the chain of its
        flattened nodes: still exact, as vLLM then computes and checks them as one sequence."""
        self.step = {}
        self.last_plan = None
        if not step_trees:
            return
        batch = runner.input_batch
        tables = batch.block_table
        if len(getattr(tables, "block_tables", [tables])) != 1:
            raise NotImplementedError("vllm-graft tree verification supports one KV-cache group (plain decoder models)")
        table = tables[0]
        blocks = table.get_numpy_array()
        size = int(table.block_size)
        qsl = runner.query_start_loc.np
        tree_mod = _tree_parts()
        rows: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for rid, (tokens, parents) in step_trees.items():
            row = batch.req_id_to_index.get(rid)
            n = len(parents)
            if row is None or int(num_scheduled[row]) != n + 1 or min(tokens) < 0:
                continue  # not a decode step with all its drafts (preempted, chunked, invalidated)
            first = int(qsl[row])
            context = int(batch.num_computed_tokens_cpu[row])  # the root's position
            tree = tree_mod.DraftTree(tokens, parents)
            rows.append(np.arange(first + 1, first + 1 + n))
            values.append(context + tree.depth.numpy())
            pos: np.ndarray = context + np.arange(n + 1)
            slots = blocks[row, pos // size].astype(np.int64) * size + pos % size
            mask = tree_mod.ancestor_mask([-1, *(p + 1 for p in parents)])  # the root as node 0
            self.step[row] = StepTree(tree, slots, mask, first, context)
        if rows:
            dev = runner.positions.device
            index = torch.from_numpy(np.concatenate(rows)).to(dev)
            runner.positions[index] = torch.from_numpy(np.concatenate(values)).to(dev, runner.positions.dtype)
        self.others = any(int(num_scheduled[r]) > 0 for r in range(len(num_scheduled)) if r not in self.step)

    def plan(self, batch: Any) -> "TreePlan | None":
        """For the attention (once per step): the step's trees with their device indices."""
        if not self.step:
            return None
        self.last_plan = TreePlan.build(self.step, self.others, batch.query_start_loc.device)
        return self.last_plan

    # ---- 4. verification ----------------------------------------------------------------
    def verify(
        self, runner: GPUModelRunner, logits: torch.Tensor, spec_decode_metadata: SpecDecodeMetadata, output: Any
    ) -> None:
        """After vLLM's rejection sampler: replace each tree request's sampled tokens with its
        tree's verdict and move the accepted nodes' KV (see the module docstring). Reads the
        logits back once for the greedy trees and once for the sampled ones."""
        if not self.step or spec_decode_metadata is None or logits is None:
            return
        tree_mod = _tree_parts()
        drafts = list(spec_decode_metadata.num_draft_tokens)
        starts = np.concatenate([[0], np.cumsum(np.asarray(drafts) + 1)])
        batch = runner.input_batch
        greedy: list[tuple[int, StepTree]] = []
        sampling: list[tuple[int, StepTree, float]] = []
        for row, t in self.step.items():
            n = len(t.tree)
            if row >= len(drafts) or drafts[row] != n:
                raise RuntimeError(
                    f"vllm-graft tree verification: batch row {row} has {drafts[row] if row < len(drafts) else None} "
                    f"draft rows, its tree {n} nodes"
                )
            temperature = float(runner.requests[batch.req_ids[row]].sampling_params.temperature)
            if temperature < _GREEDY_EPS:
                greedy.append((row, t))
            else:
                sampling.append((row, t, temperature))

        def logit_rows(items) -> torch.Tensor:  # the trees' logits rows, in order, on their device
            idx = np.concatenate([np.arange(starts[it[0]], starts[it[0]] + len(it[1].tree) + 1) for it in items])
            return logits[torch.from_numpy(idx).to(logits.device)]

        verdicts: dict[int, Any] = {}
        if greedy:
            top = logit_rows(greedy).argmax(dim=-1).cpu()  # one read-back for every greedy tree
            at = 0
            for row, t in greedy:
                verdicts[row] = tree_mod.verify_greedy(t.tree, top[at : at + len(t.tree) + 1])
                at += len(t.tree) + 1
        if sampling:
            temps = torch.tensor(
                [temp for _, t, temp in sampling for _ in range(len(t.tree) + 1)], dtype=torch.float32
            ).to(logits.device)
            probs = torch.softmax(logit_rows(sampling).float() / temps[:, None], dim=-1).cpu()  # one read-back
            at = 0
            for row, t, _ in sampling:
                n = len(t.tree)
                one_hot = torch.zeros(n, probs.shape[-1], dtype=torch.float64)
                one_hot[torch.arange(n), t.tree.tokens] = 1.0
                generator = getattr(batch, "generators", {}).get(row)
                verdicts[row] = tree_mod.verify_sampling(t.tree, probs[at : at + n + 1], one_hot, generator)
                at += n + 1
        sampled = output.sampled_token_ids
        rows = sorted(verdicts)
        block = torch.full((len(rows), sampled.shape[1]), -1, dtype=sampled.dtype)
        moves_src: list[int] = []
        moves_dst: list[int] = []
        n_accepted = 0
        for i, row in enumerate(rows):
            t, verdict = self.step[row], verdicts[row]
            emitted = verdict.tokens(t.tree)
            block[i, : len(emitted)] = torch.tensor(emitted, dtype=sampled.dtype)
            for k, node in enumerate(verdict.accepted):
                if node != k:  # slot of node k-th on the path vs where the sequence needs it
                    moves_src.append(int(t.slots[1 + node]))
                    moves_dst.append(int(t.slots[1 + k]))
            n_accepted += len(verdict.accepted)
        sampled[torch.tensor(rows, dtype=torch.long).to(sampled.device)] = block.to(sampled.device)
        if moves_src:
            layout = self.last_plan.layout if self.last_plan is not None else None
            if layout is None:
                raise RuntimeError(
                    "vllm-graft tree verification: accepted nodes' KV must move but no "
                    "attention layer ran the step's tree plan, so the cache layout is "
                    "unknown (is the graft attention backend installed?)"
                )
            move_kv(runner.kv_caches, moves_src, moves_dst, layout)
        self.count("tree_verify", len(self.step))
        if n_accepted:
            self.count("tree_accepted", n_accepted)
        self.step = {}
        self.last_plan = None


def move_kv(kv_caches: list[torch.Tensor], src: list[int], dst: list[int], layout: KVCacheLayout = BLOCKED) -> None:
    """Copy the keys/values at KV slots ``src`` to slots ``dst`` in every layer's cache
    ``[num_blocks, H_kv, block_size, 2*D]`` in ``layout`` (the one the layers ran with).
    Sources are read before any destination is written. The slot indices go to the caches'
    device once per call, not per layer."""
    if not src:
        return
    index: dict[tuple, tuple[torch.Tensor, ...]] = {}
    for cache in kv_caches:
        if cache is None:
            continue
        size = cache.shape[2]
        key = (cache.device, size)
        if key not in index:
            slots = torch.tensor([src, dst], dtype=torch.long).to(cache.device)
            index[key] = (slots[0] // size, slots[0] % size, slots[1] // size, slots[1] % size)
        s_blk, s_off, d_blk, d_off = index[key]
        # packed: a token's key and value are one row of C; blocked: keys and values apart
        parts = (cache,) if layout.name == PACKED.name else layout.split(cache)
        for part in parts:
            part[d_blk, :, d_off] = part[s_blk, :, s_off]


@dataclass
class PassRows:
    """One tree's verify pass in the step: its query rows ``start:start + R`` (root first)."""

    row: int  # batch row
    start: int
    size: int  # R = nodes + 1
    context: int  # tokens before the root
    parents: torch.Tensor  # [R] (host): the pass as a tree, the root as node 0
    mask: torch.Tensor  # [R, R] bool, on the device
    bits: torch.Tensor | None  # [R, ceil(R / 32)] int32 ancestor bitmask (device; Triton path)
    at: int  # offset of its rows in TreePlan.pos / .batch_rows


@dataclass
class TreePlan:
    """The step's tree passes for :class:`TreeAttention`: built once per step on the host and
    moved to the device once, read by every layer without a host sync."""

    trees: list[PassRows]
    others: bool  # rows without a tree: computed by causal paged attention first
    pos: torch.Tensor  # [sum R] positions of every pass row (device)
    batch_rows: torch.Tensor  # [sum R] batch row of every pass row (device)
    #: the Triton kernel's module (``_tree.kernel``) on CUDA where Triton imports, else None
    kernel: Any = None
    layout: KVCacheLayout | None = None  # the cache layout the layers ran with (for move_kv)
    _slots: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (block size, block, offset)

    def __bool__(self) -> bool:
        return bool(self.trees)

    @classmethod
    def build(cls, step: dict[int, StepTree], others: bool, device: torch.device) -> "TreePlan":
        kernel = _triton_kernel() if device.type == "cuda" else None
        trees, pos, brow, bits, masks = [], [], [], [], []
        at = 0
        for row, t in sorted(step.items()):
            r = t.mask.shape[0]
            parents = torch.cat([torch.tensor([-1]), t.tree.parents + 1])
            trees.append(PassRows(row, t.start, r, t.context, parents, t.mask, None, at))
            pos.append(torch.arange(t.context, t.context + r))
            brow.append(torch.full((r,), row, dtype=torch.long))
            masks.append(t.mask.reshape(-1))
            if kernel is not None:
                bits.append(kernel.pack_ancestor_bits(t.mask).reshape(-1))
            at += r
        # one copy each to the device; every tree's pieces are views of them
        masks_dev = torch.cat(masks).to(device)
        bits_dev = torch.cat(bits).to(device) if kernel is not None else None
        b = m = 0
        for p in trees:
            p.mask = masks_dev[m : m + p.size * p.size].view(p.size, p.size)
            m += p.size * p.size
            if bits_dev is not None:
                words = -(-p.size // 32)
                p.bits = bits_dev[b : b + p.size * words].view(p.size, words)
                b += p.size * words
        return cls(trees, others, torch.cat(pos).to(device), torch.cat(brow).to(device), kernel)

    def pass_slots(self, block_table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset) ``[sum R]`` of every pass row in the step's block table (on the
        device; computed at the first layer, kept for the others)."""
        if self._slots is None or self._slots[0] != block_size:
            blk = block_table[self.batch_rows, self.pos // block_size].long()
            self._slots = (block_size, blk, self.pos % block_size)
        return self._slots[1], self._slots[2]


@functools.cache  # an import cache: the same answer for every deployment of the process
def _triton_kernel():
    """The Triton tree kernel's module (``_tree.kernel``), or None where Triton cannot be
    imported (logged once)."""
    try:
        from ....plugins.speculative._tree import kernel
    except ImportError as e:
        log.warning(
            "vllm-graft tree verification: Triton cannot be imported (%s); the tree rows "
            "run the PyTorch reference on the device (slow)",
            e,
        )
        return None
    return kernel


def _log_path(path: str, device: torch.device) -> None:
    if RUNTIME.once(("tree verification path", path)):
        log.info("vllm-graft tree verification: tree rows by %s on %s", path, device)


class TreeAttention(AttentionMethod):
    """The graft backend's attention while trees are verified (module docstring, seam 3).
    ``plan`` is the step's :class:`TreePlan` (None without trees). Three ways, by route:

    * vLLM's CPU engine with the cache in vLLM's own layout (``cpu_vec``, the layer's ISA
      checked, :func:`..backend.stock_layout_checked`): a step without trees is :meth:`plain`
      (vLLM's C++ kernel computes it); on a step with trees and other rows vLLM's kernel
      computes every row (exact for the requests without a tree; causal, so wrong, for a
      tree's rows), then :meth:`amend` overwrites each tree's rows with its masked pass
      (``_tree.verify_pass_attention``, which reads the views' strides); a step of trees alone
      (batch 1) is only the passes (:meth:`forward`), over vLLM's cache.
    * vLLM's CPU engine otherwise (an ISA whose layout is not checked, e.g. ``amx``: the
      ``blocked`` layout, said once in the log) and the generic backend: :meth:`forward`, every
      row by exact causal paged attention (``plugins/attention/_shared``, skipped when every row
      is a tree's), then the tree rows under their pass masks by ``verify_pass_attention``.
    * CUDA (``packed``): :meth:`forward`, the tree rows by the Triton kernel ``_tree.kernel``
      (the context from the paged cache, the pass's own keys/values gathered from their slots);
      no step is handed to vLLM's kernel there (:meth:`plain` is False off the CPU engine).
    """

    kv_layouts = ("blocked", "packed", "cpu_vec")
    #: the backend's count for a layer whose tree rows :meth:`amend` overwrote
    amend_event = "stock_layers_with_tree"

    def plan(self, batch):
        verifier = current_verifier()
        return verifier.plan(batch) if verifier is not None else None

    def plain(self, plan) -> bool:
        """A step without trees is plain causal attention: on vLLM's CPU engine (where the backend
        asks only with the cache in ``cpu_vec``) vLLM's kernel computes it. Never on CUDA, whose
        backends ask unconditionally: the same would hold there (vLLM's kernels read their own
        packed cache), but that path is not checked on a GPU yet, so it stays :meth:`forward`."""
        return not plan and _cpu_engine()

    def amends(self, plan) -> bool:
        """A step with trees and rows without one: vLLM's kernel first, then :meth:`amend` (the CPU
        backend asks only with the cache in ``cpu_vec``). A step whose rows are all trees' would
        have every row of vLLM's output overwritten: :meth:`forward` computes just the passes."""
        return bool(plan) and plan.others

    def amend(self, query, kv_cache, batch, layer, plan, output) -> None:
        """Overwrite each tree's rows of ``output [T, H, D]`` (vLLM's kernel's, causal) with its
        masked pass; the other rows are vLLM's, exact."""
        plan.layout = layer.kv_layout
        _log_path(
            f"vLLM's kernel, then _tree.verify_pass_attention over the {layer.kv_layout.name} cache", query.device
        )
        self._pass_rows(query, kv_cache, batch, layer, plan, output)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        from ....plugins.attention._shared import paged_attention

        if not plan:
            return paged_attention(query, kv_cache, batch, layer)
        layout = layer.kv_layout
        plan.layout = layout
        out = paged_attention(query, kv_cache, batch, layer) if plan.others else torch.zeros_like(query)
        if plan.kernel is None:
            _log_path("the PyTorch reference (_tree.verify_pass_attention)", query.device)
            self._pass_rows(query, kv_cache, batch, layer, plan, out)
            return out
        _log_path("the Triton kernel (_tree.kernel)", query.device)
        k_cache, v_cache = layout.split(kv_cache)  # [num_blocks, H_kv, B, D] each
        blk, off = plan.pass_slots(batch.block_table, kv_cache.shape[2])
        k_pass, v_pass = k_cache[blk, :, off], v_cache[blk, :, off]  # [sum R, H_kv, D]
        kc, vc = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # the kernel's [N, B, H_kv, D]
        for p in plan.trees:
            rows = slice(p.at, p.at + p.size)
            out[p.start : p.start + p.size] = plan.kernel.tree_attention_triton(
                query[p.start : p.start + p.size],
                kc,
                vc,
                batch.block_table[p.row],
                p.context,
                k_pass[rows],
                v_pass[rows],
                p.parents,
                layer.scale,
                ancestor_bits=p.bits,
            )
        return out

    @staticmethod
    def _pass_rows(query, kv_cache, batch, layer, plan, out) -> None:
        """Each tree's rows of ``out`` by its masked pass over the cache (in ``layer.kv_layout``)."""
        k_cache, v_cache = layer.kv_layout.split(kv_cache)  # [num_blocks, H_kv, B, D] each
        verify_pass_attention = _tree_parts().verify_pass_attention
        for p in plan.trees:
            out[p.start : p.start + p.size] = verify_pass_attention(
                query[p.start : p.start + p.size],
                k_cache,
                v_cache,
                batch.block_table[p.row],
                p.context + p.size,
                p.mask,
                layer.scale,
            )


@functools.cache  # the platform does not change in a process
def _cpu_engine() -> bool:
    """This process runs vLLM's CPU platform."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# ---------------------------------------------------------------- activation (the adapter)
@dataclass
class SpeculativeState:
    """The speculative adapter's per-deployment state (``SpeculativeAdapter.State``, on the
    runtime): the tree verifier of this process's proposer, which the tree attention reads (set
    by :func:`activate_verifier`, cleared by :func:`uninstall_attention` and by deactivation)."""

    tree_verifier: TreeVerifier | None = None


def _state() -> SpeculativeState:
    return RUNTIME.kind_state(Kind.SPECULATIVE, SpeculativeState)


def current_verifier() -> TreeVerifier | None:
    state = RUNTIME.adapter_state.get(Kind.SPECULATIVE)  # reading makes no state
    return None if state is None else state.tree_verifier


def set_verifier(verifier: TreeVerifier | None) -> None:
    _state().tree_verifier = verifier


#: The attention method the tree verification installs (stateless: it reads the verifier
#: from the runtime; one object, so that the backend's seam can be told apart)
_ATTENTION = TreeAttention(None)


def drafts_trees(enabled: Any, plan: Any) -> bool:
    """Whether the enabled proposer drafts trees; refuses (ValueError naming the fix) what tree
    verification cannot run with (see the module docstring)."""
    if not getattr(RUNTIME.instance(enabled), "drafts_trees", False):
        return False
    where = f"speculative plugin {enabled.name!r} drafts trees"
    others = [e.name for e in plan.enabled if str(e.kind) in ("attention", "kvcompress")]
    if others:
        raise ValueError(
            f"{where}, whose verification computes attention itself; it cannot be "
            f"combined with {', '.join(repr(o) for o in others)} yet: leave those "
            "out of the deployment, or turn the tree off (tree: false)"
        )
    engine = getattr(plan.deployment, "engine", None) or {}
    if int(engine.get("tensor_parallel_size", 1) or 1) > 1 or int(engine.get("pipeline_parallel_size", 1) or 1) > 1:
        raise ValueError(
            f"{where}: tree verification runs on one rank so far (each rank would "
            "verify and move KV on its own); set tensor_parallel_size and "
            "pipeline_parallel_size to 1, or tree: false"
        )
    if plan.platform not in (None, "cpu", "cuda"):
        raise ValueError(
            f"{where}: tree verification runs on vLLM's CPU engine and on CUDA (the "
            f"Triton tree kernel, Model Runner V1) only; platform {plan.platform!r} has "
            "neither path. Set tree: false to verify chains"
        )
    # CUDA: the patches below (GPUModelRunner._prepare_inputs, _sample) are V1-only targets, so
    # integration/model_runner.py selects Model Runner V1 or refuses VLLM_USE_V2_MODEL_RUNNER=1; vLLM
    # itself also picks V1 for a custom_class proposer (config/vllm.py:3066-3068 in 0.33).
    return True


def activate_verifier(count) -> TreeVerifier:
    """The proposer's verifier, which the attention method reads its plan from. ``count`` (the
    proposer's events) also counts the backend's layers while the tree attention holds its
    method (``plan``, ``forward``, ``stock_layers``, ``stock_layers_with_tree``)."""
    from .. import backend

    verifier = TreeVerifier(count)
    set_verifier(verifier)
    if backend.SEAMS.method is _ATTENTION:
        backend.SEAMS.count = count
    return verifier


def install_attention(owner: str) -> None:
    from .. import backend

    if backend.SEAMS.method is not None and backend.SEAMS.method is not _ATTENTION:
        raise ValueError(
            f"tree verification needs the graft attention backend's method, and "
            f"attention plugin {backend.SEAMS.method_name!r} holds it"
        )
    backend.require_layout("tree-verification", TreeAttention.kv_layouts, what="attention method")
    backend.install(owner)
    backend.SEAMS.method, backend.SEAMS.method_name = _ATTENTION, "tree-verification"
    backend.SEAMS.host_kernel = False


def uninstall_attention(owner: str) -> None:
    from .. import backend

    set_verifier(None)
    if backend.SEAMS.method is _ATTENTION:
        backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count = None, "", None
        backend.uninstall(owner)


__all__ = [
    "TreeAttention",
    "TreeVerifier",
    "activate_verifier",
    "drafts_trees",
    "install_attention",
    "move_kv",
    "tree_verifiable",
    "uninstall_attention",
]
