"""One small contract per plugin kind.

A registration's ``impl`` names a class implementing the contract of its kind. The
class is built with its validated parameter model instance (``cls(params, **context)``).
The vLLM adapters in ``vllm_graft.integration`` call these methods; nothing here knows
about vLLM, so a plugin is testable with plain tensors.

Shapes follow vLLM's conventions: query ``[T, H, D]`` (tokens of all sequences packed),
paged KV cache ``[num_blocks, H_kv, block_size, 2*D]`` (per block and head: the keys, then the
values; see :func:`split_kv_cache`),
block tables ``[num_seqs, max_blocks]`` of physical block ids.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

from pydantic import BaseModel

from .registry import Kind

if TYPE_CHECKING:  # torch is only needed by implementations
    import torch

P = TypeVar("P", bound=BaseModel)


class PluginImpl(ABC, Generic[P]):
    """Base of every contract: holds the validated parameters."""

    kind: Kind

    def __init__(self, params: P) -> None:
        self.params = params

    def describe(self) -> dict[str, Any]:
        """What the plugin did so far, for `vllm-graft demo` and benchmark reports."""
        return {}


# ---------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttentionLayer:
    """Static facts about one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    block_size: int
    #: the decoder layer's index in the model (0-based; -1 where unknown), for per-layer
    #: choices such as a head map
    index: int = -1


@dataclass
class PagedBatch:
    """One step's batch in paged form.

    ``query_start_loc[i]:query_start_loc[i+1]`` are sequence i's query rows;
    ``seq_lens[i]`` counts its tokens including the new ones (its queries are the last
    ``q_len`` positions, attending causally); ``block_table[i]`` lists its physical blocks.
    """

    query_start_loc: "torch.Tensor"  # [num_seqs + 1] int32
    seq_lens: "torch.Tensor"  # [num_seqs] int32
    block_table: "torch.Tensor"  # [num_seqs, max_blocks] int32


def split_kv_cache(kv_cache: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(key_cache, value_cache)``, each ``[num_blocks, H_kv, block_size, D]``, as views of
    one layer's paged cache ``[num_blocks, H_kv, block_size, 2*D]``.

    The last two dims are not "K and V side by side per token": for each block and KV head
    the memory holds the block's keys ``[block_size, D]`` followed by its values (vLLM's CPU
    layout, read by its kernel as ``view(N, H_kv, 2*block_size, D).chunk(2, dim=2)``).
    """
    n, h, b, d2 = kv_cache.shape
    kv = kv_cache.view(n, h, 2, b, d2 // 2)
    return kv[:, :, 0], kv[:, :, 1]


class AttentionMethod(PluginImpl[P]):
    """Attention over a paged KV cache."""

    kind = Kind.ATTENTION

    def plan(self, batch: PagedBatch) -> Any:
        """Once per step, before any layer runs (e.g. find shared prefixes). Default: nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        query: "torch.Tensor",
        kv_cache: "torch.Tensor",
        batch: PagedBatch,
        layer: AttentionLayer,
        plan: Any = None,
    ) -> "torch.Tensor":
        """Return the attention output ``[T, H, D]`` for ``query`` ``[T, H, D]``."""


# --------------------------------------------------------------------------- kvcompress
@dataclass(frozen=True)
class BlockView:
    """What a compressor sees of one request's KV blocks (pure Python, no tensors).

    ``scores[i]`` is block i's accumulated importance (e.g. attention mass) where the
    method collects it (``needs_scores``), else ``None``; a block dropped at an earlier
    step has score ``-inf``. ``pinned`` are blocks it must keep (shared by the
    prefix cache with other requests).
    """

    num_tokens: int
    block_size: int
    num_prompt_tokens: int
    scores: Sequence[float] | None = None
    pinned: frozenset[int] = frozenset()

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)


class KVCompressor(PluginImpl[P]):
    """Chooses which KV blocks of a request to keep.

    How vLLM calls it (the KV-compression adapter). Once per engine step, for every
    request that already has computed tokens, :meth:`keep` is asked which of the request's
    ``view.num_blocks`` logical blocks (those holding its ``view.num_tokens`` computed
    tokens, block ``i`` holding tokens ``[i*block_size, (i+1)*block_size)``) stay:

    * in the **scheduler**, with ``pinned`` set: the blocks not kept are freed (they return
      to vLLM's block pool, so the request holds fewer blocks);
    * in the **worker**, with the same ``num_tokens``, ``block_size`` and ``num_prompt_tokens``
      but ``pinned`` empty and ``scores`` ``None``: the blocks not kept are left out of the
      step's attention. The step's new tokens (positions ``num_tokens`` onwards) always
      attend to every kept block and to each other, causally. Keys are stored with their
      positions already applied (RoPE), so dropping blocks keeps positions right.

    Rules for the answer (:func:`check_keep` checks them on every call; a violation stops
    the engine with an error naming the plugin):

    * a sorted list of distinct ints, each in ``range(view.num_blocks)``;
    * it contains the last block, ``view.num_blocks - 1`` (the one being written), and
      every block in ``view.pinned`` (shared with other requests through the prefix cache:
      they are never freed);
    * a block once dropped stays dropped: a later call (larger ``num_tokens``) must not
      keep it again, as its KV is gone.

    Determinism. A compressor without scores is asked by both halves, which must reach the
    same decision on their own: ``keep`` must depend only on ``num_tokens``,
    ``block_size`` and ``num_prompt_tokens``, and on ``pinned`` only by adding the pinned
    blocks to its answer (``sorted(set(mine) | view.pinned)``). A pinned block the worker
    drops stays held until no other request shares it, then it is freed.

    Scores. A compressor that needs scores (H2O, SnapKV: attention mass per block) sets
    :attr:`needs_scores` and implements :meth:`attend`: the worker then runs the layer's
    attention through it and adds the mass it reports to each block's score (summed over
    heads, layers and the queries :meth:`score_positions` selects). ``keep`` is asked in the
    **worker only**, once per step after the forward pass, with ``num_tokens`` = all tokens
    computed so far, ``scores`` set and ``pinned`` empty; the blocks it drops leave
    attention from the next step on and travel to the scheduler, which frees them (blocks
    shared through the prefix cache once no longer shared).
    """

    kind = Kind.KVCOMPRESS

    #: True if :meth:`keep` needs ``view.scores``; the compressor then implements :meth:`attend`.
    needs_scores: bool = False

    @abstractmethod
    def keep(self, view: BlockView) -> list[int]:
        """Sorted logical block indices to keep (see the class docstring for the rules)."""

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        """Token positions ``[start, end)`` whose queries' attention counts towards the
        scores (``needs_scores`` only). Default: every query."""
        return (0, 1 << 62)

    def attend(self, query: "torch.Tensor", kv_cache: "torch.Tensor", batch: PagedBatch,
               layer: AttentionLayer, observe: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """Causal attention over the paged batch (``needs_scores`` only), as
        :meth:`AttentionMethod.forward` (the cache in the layout of :func:`split_kv_cache`),
        plus the attention mass per block: ``(out [T, H, D], mass [num_seqs, max_blocks])``,
        ``mass[i, j]`` = the softmax probability that the queries of sequence ``i`` with
        ``observe[t]`` True put on the keys of block-table column ``j``, summed over heads
        and those queries."""
        raise NotImplementedError(f"{type(self).__name__} sets needs_scores but implements no attend()")


class KVCacheFormat(KVCompressor):
    """A KV-cache *storage format* (e.g. 4-bit): how each token's keys and values are stored
    in vLLM's paged cache and read back by attention. It evicts nothing (:meth:`keep` keeps
    every block) and composes with at most one eviction compressor in a deployment's
    ``kvcompress:`` list (registered with ``Capabilities(role="storage")``).

    How vLLM uses it (the KV-compression adapter). Each full-attention layer's KV-cache spec
    gets ``dtype=uint8`` and ``state_content_bytes`` = :meth:`bytes_per_token` (one KV head,
    K and V and their scales), so vLLM's page size, and with it the number of blocks that
    fit in the KV memory, is the format's, not the dense one's. The layer's cache is then a
    ``uint8`` tensor ``[num_blocks, H_kv, block_size, bytes_per_token]``:

    * :meth:`write` stores a step's new keys/values at their slots (vLLM's
      ``do_kv_cache_update``; slot = block * block_size + offset, negative = padding);
    * :meth:`forward` is the layer's causal attention over the paged batch, reading the
      cache in the format (dequantising inside the attention). With ``observe`` given (an
      eviction compressor that needs scores, e.g. H2O, is combined with the format), it also
      returns the attention mass per block as :meth:`KVCompressor.attend` does; else the
      mass is ``None``.
    """

    #: role of a storage format within its kind (see ``Capabilities.role``)
    role = "storage"

    def keep(self, view: BlockView) -> list[int]:
        return list(range(view.num_blocks))

    @abstractmethod
    def bytes_per_token(self, head_size: int, block_size: int) -> int:
        """Bytes one token of one KV head takes in a page (keys, values, their scales)."""

    def unsupported(self, head_size: int, block_size: int) -> str | None:
        """Why this format cannot store a layer of ``head_size`` with blocks of
        ``block_size`` tokens (a message naming the fix), or None if it can."""
        return None

    @abstractmethod
    def write(self, key: "torch.Tensor", value: "torch.Tensor", kv_cache: "torch.Tensor",
              slot_mapping: "torch.Tensor") -> None:
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping[:T]`` in ``kv_cache``."""

    @abstractmethod
    def forward(self, query: "torch.Tensor", kv_cache: "torch.Tensor", batch: PagedBatch,
                layer: AttentionLayer, observe: "torch.Tensor | None" = None
                ) -> tuple["torch.Tensor", "torch.Tensor | None"]:
        """``(out [T, H, D], mass [num_seqs, max_blocks] or None)``: causal attention of
        ``query`` over the paged batch stored in this format (see the class docstring)."""


class KeepError(ValueError):
    """A :meth:`KVCompressor.keep` answer breaks the rules (the message names the plugin)."""


def check_keep(view: BlockView, kept: Any, plugin: str = "?") -> list[int]:
    """``kept`` (what ``keep(view)`` returned) as a list of ints, if it follows the rules of
    :meth:`KVCompressor.keep` that one answer can show; else :class:`KeepError`.

    (The "once dropped, stays dropped" rule spans calls: the adapter checks it against the
    blocks it already freed.)
    """
    def fail(why: str) -> KeepError:
        shown = kept if not isinstance(kept, (list, tuple)) or len(kept) <= 16 else \
            f"{list(kept[:16])}... ({len(kept)} items)"
        return KeepError(
            f"kvcompress plugin {plugin!r}: keep() returned {shown!r} for {view.num_tokens} tokens "
            f"in {view.num_blocks} blocks of {view.block_size} (prompt {view.num_prompt_tokens} "
            f"tokens, pinned {sorted(view.pinned)}); {why}")

    if hasattr(kept, "tolist") and not isinstance(kept, (list, tuple)):
        kept = kept.tolist()  # a numpy array or torch tensor
    if not isinstance(kept, (list, tuple, range)):
        raise fail("it must be a list of block indices")
    from operator import index  # accepts ints and numpy/torch integer scalars

    out: list[int] = []
    for i in kept:
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(index(i))
        except TypeError:
            raise fail(f"{i!r} is not a block index (an int)") from None
    n = view.num_blocks
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise fail(f"block(s) {bad} are out of range(0, {n})")
    if any(a >= b for a, b in zip(out, out[1:])):
        raise fail("indices must be sorted ascending, without duplicates")
    if n and out[-1:] != [n - 1]:
        raise fail(f"the last block ({n - 1}, being written) must be kept")
    missing = sorted(view.pinned - set(out))
    if missing:
        raise fail(f"pinned block(s) {missing} (shared with other requests) must be kept")
    return out


def dropped_blocks(view: BlockView, kept: Sequence[int]) -> list[int]:
    """The blocks of ``view`` not in ``kept``, ascending."""
    keep = set(kept)
    return [i for i in range(view.num_blocks) if i not in keep]


# -------------------------------------------------------------------------- speculative
class Proposer(PluginImpl[P]):
    """Proposes draft tokens; the target model verifies them (chain verification: the
    longest prefix of the drafts that the target would have produced itself is kept, so
    greedy output does not depend on the drafts).

    How many tokens: if the plugin's parameter model has a field ``num_speculative_tokens``,
    its value is the most drafts per step (vLLM reserves that many verification slots per
    request); otherwise the adapter uses ``DEFAULT_NUM_SPECULATIVE_TOKENS`` (4). Each call's
    ``max_tokens`` is that number, or less near the model's length limit.

    Calls, per request and engine step once the request has produced a token:
    ``accepted`` (how the previous drafts fared, when there were any), then ``propose``.
    ``finish`` comes once the request has ended (finished or aborted), with the engine's
    next step: that is when vLLM tells its workers.
    """

    kind = Kind.SPECULATIVE

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``token_ids``.

        ``token_ids`` is the request's whole sequence so far: prompt, then every output
        token (the one just sampled last). Return fewer, or ``[]``, when unsure; extra
        tokens beyond ``max_tokens`` are dropped. ``request_id`` is stable for the request's
        life, so per-request state can be kept under it until :meth:`finish`.
        """

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        """The target kept the first ``num_accepted`` of the ``num_verified`` drafts it
        checked for ``request_id`` in the step just run (the drafts this plugin proposed
        last; vLLM verifies fewer when it trims them, e.g. at the length limit). For
        adaptive draft lengths and acceptance statistics. Default: nothing."""

    def finish(self, request_id: str) -> None:
        """The request ended (finished or aborted): release its state. Default: nothing."""

    # ---- optional extras; a proposer that does not ask for them costs nothing extra ----
    #: How many of the target's most probable next tokens per verified position this
    #: proposer wants through :meth:`observe_topk` (Token Recycling). 0 (the default): the
    #: adapter computes no top-k and never calls :meth:`observe_topk`. Read once, when the
    #: adapter builds the proposer (a class attribute or one set in ``__init__``).
    topk: int = 0

    def observe_topk(self, request_id: str, tokens: Sequence[int], topk_ids: Any) -> None:
        """What the target predicted in the step just run, called before :meth:`accepted`
        and :meth:`propose` of that step, only when :attr:`topk` > 0.

        ``topk_ids`` is an int array ``[len(tokens), topk]``: row ``j`` holds the target's
        ``topk`` most probable next tokens (most probable first) after the prefix ending in
        ``tokens[j]``. ``tokens`` are the positions the step computed logits for: the
        request's last token before the step, then each draft token the step verified (in
        order; rows after the first rejected draft were computed on a rejected prefix, but
        still say what tends to follow that token). Default: nothing."""

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> None:
        """A step's drafting begins; ``num_requests`` requests will be asked to
        :meth:`propose` (the batch size, for adaptive draft lengths). ``num_tokens`` is how
        many tokens the target computed in the step just run (prompt chunks, one per
        decoding request, the drafts it verified; 0 when unknown). Default: nothing."""


# -------------------------------------------------------------------------------- quant
@dataclass(frozen=True)
class StoredTensor:
    """One tensor a quantised layer keeps in a checkpoint, for an ``[out, in]`` weight.

    ``shape[0]`` is the weight's output rows (``out``): vLLM's weight loaders fuse the
    shards of q/k/v and gate/up along it, as they fuse ``weight``. A ``ragged`` tensor is
    1-D with a length only the checkpoint knows (``shape == (-1,)``, e.g. an entropy-coded
    stream); it is not fused: :meth:`QuantMethod.load` gets one per shard. ``dtype`` is a
    torch dtype name (``"uint8"``, ``"int8"``, ``"float16"``, ``"bfloat16"``, ...).
    """

    shape: tuple[int, ...]
    dtype: str
    ragged: bool = False


class QuantMethod(PluginImpl[P]):
    """Quantises a linear layer's weight and computes with the quantised form.

    Online (an unquantised checkpoint, ``quant: {plugin: NAME}`` in a deployment): vLLM
    loads the full-precision weight ``[out, in]`` (fused q/k/v and gate/up shards
    included), then ``apply`` computes with ``load({name: [t]}, [out])`` of
    ``quantize(weight)``.

    Pre-quantised checkpoints (optional: a plugin that only quantises online leaves
    :meth:`stored_tensors` returning ``None``). ``vllm-graft quantize NAME MODEL OUT`` writes,
    for every linear weight ``P.weight`` of ``MODEL``, the tensors ``P.<name>`` that
    ``quantize`` returns, and in ``config.json`` ``"quantization_config": {"quant_method":
    "graft-NAME", "graft_format": 1, "params": {...}, "embeddings": bool}`` where ``params``
    is :meth:`checkpoint_params`. vLLM picks such a checkpoint up without a flag; each layer
    then registers :meth:`stored_tensors` instead of ``weight``, vLLM's weight loaders fill
    them (fusing shards along dim 0), :meth:`verify` checks each shard, and :meth:`load` turns
    them, split per shard, into the tensors ``apply`` gets. A missing tensor, an unquantised
    ``weight`` where stored tensors belong, a wrong shape or dtype, or a ``verify`` that
    raises, stops loading with an error naming the checkpoint tensor.
    """

    kind = Kind.QUANT

    #: True if the method also stores the embedding table and the LM head (pre-quantised
    #: checkpoints; they are then computed by :meth:`embed` and :meth:`apply`).
    covers_embeddings: bool = False

    @abstractmethod
    def quantize(self, weight: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """The tensors that replace ``weight`` ``[out, in]`` in a checkpoint."""

    @abstractmethod
    def apply(
        self, tensors: dict[str, "torch.Tensor"], x: "torch.Tensor", bias: "torch.Tensor | None"
    ) -> "torch.Tensor":
        """``x @ W.T + bias`` computed from the quantised ``tensors``."""

    def stored_tensors(self, out_features: int, in_features: int) -> dict[str, StoredTensor] | None:
        """What ``quantize`` returns for an ``[out, in]`` weight (names, shapes, dtypes), so
        a pre-quantised checkpoint can be loaded. ``None`` (default): online only."""
        return None

    def checkpoint_params(self) -> dict[str, Any]:
        """The parameters written into a checkpoint's ``quantization_config.params``; a
        checkpoint is loaded with a plugin built from them. Default: all parameters."""
        return self.params.model_dump(mode="json")

    def verify(self, shard: dict[str, "torch.Tensor"]) -> None:
        """Check one shard's stored tensors as read from a checkpoint (e.g. a checksum);
        raise ``ValueError("<tensor name>: what is wrong")`` so the error names the
        checkpoint tensor. Called once per shard before :meth:`load`. Default: nothing."""

    def load(self, stored: dict[str, list["torch.Tensor"]], shard_rows: list[int]) -> dict[str, "torch.Tensor"]:
        """The tensors ``apply`` computes with, from a layer's stored tensors, each given as
        one tensor per shard (``shard_rows``: the output rows of each shard, e.g. q, k, v).
        Raise ``ValueError`` naming the tensor (the key) if one is corrupt.
        Default: each name's shards concatenated along dim 0."""
        import torch

        return {k: v[0] if len(v) == 1 else torch.cat(v, 0) for k, v in stored.items()}

    def embed(self, tensors: dict[str, "torch.Tensor"], ids: "torch.Tensor") -> "torch.Tensor":
        """Rows ``ids`` of the embedding table stored as ``tensors`` (``covers_embeddings``)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not store embedding tables")


# ---------------------------------------------------------------------------------- moe
#: The steps of an MoE scheduler, in the order a layer runs them (see :class:`MoEScheduler`).
MOE_STEPS = ("adjust_logits", "route", "observe")


@dataclass(frozen=True)
class MoEModel:
    """Static facts about the model's MoE layers, given to each scheduler once at activation
    (:meth:`MoEScheduler.bind`), before the engine builds any layer.

    ``layers`` are the decoder-layer indices that may hold an MoE block (``layer_idx`` in the
    calls below): all of ``range(num_layers)`` unless the model's config says which ones.
    """

    num_layers: int  # decoder layers
    num_experts: int  # E, routed experts per MoE layer
    top_k: int  # experts per token (the model's)
    layers: tuple[int, ...] = ()  # decoder layers with an MoE block; () = all of range(num_layers)
    model: str = ""  # the model's path or id, for messages

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.layers or tuple(range(self.num_layers))


class MoEScheduler(PluginImpl[P]):
    """Decides, changes or watches which experts each token goes to, in every MoE layer.

    A scheduler implements one or more of three steps. For every MoE layer and forward
    step the MoE adapter calls them with ``layer_idx``, the index of the decoder layer the
    MoE block belongs to (0-based, read from the layer's name: 3 for
    ``model.layers.3.block_sparse_moe``), on that step's ``T`` tokens (all sequences packed,
    prefill and decode alike) and the model's ``E`` experts:

    1. :meth:`adjust_logits`, before top-k: change the router logits ``[T, E]`` (switch an
       expert off with ``-inf``, add a bias). Default: unchanged.
    2. :meth:`route`: turn the logits into ``(topk_weights, topk_ids)``. Not overriding it
       leaves routing to the model's own top-k (vLLM's router for the layer).
    3. :meth:`observe`, after routing: see what the layer will compute with (expert
       placement, caching, traces). Default: nothing.

    Composition. A deployment's ``moe:`` list is applied in its order (:class:`MoEChain`):

    * every plugin's ``adjust_logits`` runs first, in list order, each on the previous
      one's output;
    * then the **last** plugin in the list whose class overrides ``route`` routes the
      adjusted logits; routers earlier in the list are not asked to route. If no plugin
      overrides ``route``, the model's own top-k routes the adjusted logits;
    * then every plugin's ``observe`` runs, in list order, with the final routing.

    So a mask (``adjust_logits``) composes with any router, and a tracer (``observe``) sees
    the effect of both, wherever it stands in the list. Which steps a class implements is
    read from the class (:meth:`implements`), once, not per call.
    """

    kind = Kind.MOE

    def bind(self, model: MoEModel) -> None:
        """Called once at activation with the model's MoE facts (layers, ``E``, ``top_k``),
        before any layer runs. Check the parameters against them here (an expert index out
        of range, a mask leaving fewer than ``top_k`` experts...) and raise ``ValueError``
        with a message naming the parameter: the adapter refuses the deployment with it.
        Default: nothing."""

    def adjust_logits(self, layer_idx: int, router_logits: "torch.Tensor") -> "torch.Tensor":
        """The router logits ``[T, E]`` to route with instead of ``router_logits``.

        Same shape and dtype (the model's). Return a new tensor: do not modify
        ``router_logits`` in place. Default: ``router_logits`` unchanged.

        Example (switch expert 3 off)::

            def adjust_logits(self, layer_idx, router_logits):
                out = router_logits.clone()
                out[:, 3] = float("-inf")
                return out
        """
        return router_logits

    def route(
        self, layer_idx: int, router_logits: "torch.Tensor", top_k: int, renormalize: bool
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(topk_weights [T, top_k], topk_ids [T, top_k])`` from ``router_logits [T, E]``.

        ``top_k`` and ``renormalize`` are the model's: with ``renormalize`` a token's
        weights sum to 1 (a softmax over its chosen experts' logits), without it they are
        the chosen experts' softmax probabilities over all ``E`` experts. The layer uses the
        weights as float32 and the ids as int32 (:class:`MoEChain` converts them, onto the
        logits' device). Unused slots (a token routed to fewer than ``top_k`` experts) carry weight
        0 and any valid expert id.

        Not overriding this leaves routing to the model's own top-k.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} does not route: the model's own top-k does "
            "(MoEChain calls route only on classes that override it)")

    def observe(self, layer_idx: int, topk_ids: "torch.Tensor", topk_weights: "torch.Tensor") -> None:
        """The routing the layer computes with: ``topk_ids [T, k]`` (logical expert ids,
        integer) and ``topk_weights [T, k]`` (floating point). Read them; do not modify
        them. Default: nothing.
        """

    @classmethod
    def implements(cls, step: str) -> bool:
        """Whether this class overrides ``step`` (one of :data:`MOE_STEPS`)."""
        if step not in MOE_STEPS:
            raise ValueError(f"unknown MoE step {step!r}; the steps are {', '.join(MOE_STEPS)}")
        return getattr(cls, step) is not getattr(MoEScheduler, step)


class MoEChain:
    """A deployment's MoE schedulers, composed as :class:`MoEScheduler` describes.

    ``schedulers`` are ``(name, scheduler)`` pairs in the deployment's order. ``count``,
    if given, is called as ``count(name, event, n)`` to record what each plugin did, per
    layer call: the step it ran (``"adjust_logits"``, ``"route"``, ``"observe"``, n=1)
    and ``"tokens"`` (the ``T`` tokens it was given, once per layer call).

    Calling the chain runs one layer's routing: ``chain(layer_idx, router_logits, top_k,
    renormalize, model_topk)`` where ``model_topk(logits) -> (topk_weights, topk_ids)`` is
    the model's own routing, used when no plugin routes.
    """

    def __init__(
        self,
        schedulers: Sequence[tuple[str, MoEScheduler]],
        count: "Callable[[str, str, int], None] | None" = None,
    ) -> None:
        self.schedulers = list(schedulers)
        if not self.schedulers:
            raise ValueError("an MoE chain needs at least one scheduler")
        for name, s in self.schedulers:
            if not isinstance(s, MoEScheduler):
                raise TypeError(f"MoE plugin {name!r}: {type(s).__qualname__} is not a "
                                "vllm_graft.hooks.MoEScheduler")
            if not any(type(s).implements(step) for step in MOE_STEPS):
                raise TypeError(f"MoE plugin {name!r}: {type(s).__qualname__} overrides none of "
                                f"{', '.join(MOE_STEPS)}, so it would do nothing")
        steps = {step: [(n, s) for n, s in self.schedulers if type(s).implements(step)]
                 for step in MOE_STEPS}
        self.adjusters: list[tuple[str, MoEScheduler]] = steps["adjust_logits"]
        routers = steps["route"]
        #: The plugin that routes (the last router in the list), or None: the model routes.
        self.router: tuple[str, MoEScheduler] | None = routers[-1] if routers else None
        #: Plugins that override ``route`` but are not asked to (a later one routes).
        self.overruled: list[str] = [n for n, _ in routers[:-1]]
        self.observers: list[tuple[str, MoEScheduler]] = steps["observe"]
        called = {id(s) for _, s in self.adjusters + self.observers}
        if self.router is not None:
            called.add(id(self.router[1]))
        #: Names of the plugins called at each layer call (the ones that count tokens).
        self.participants: list[str] = [n for n, s in self.schedulers if id(s) in called]
        self._count = count

    @property
    def routes(self) -> bool:
        """Whether a plugin routes (else the model's own top-k does)."""
        return self.router is not None

    def __call__(
        self,
        layer_idx: int,
        router_logits: "torch.Tensor",
        top_k: int,
        renormalize: bool,
        model_topk: "Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]",
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """``(topk_weights, topk_ids)`` for one layer call (see the class docstring)."""
        count = self._count
        num_tokens = router_logits.shape[0]
        logits = router_logits
        for name, s in self.adjusters:
            out = s.adjust_logits(layer_idx, logits)
            if tuple(out.shape) != tuple(logits.shape):
                raise ValueError(f"MoE plugin {name!r}: adjust_logits returned shape "
                                 f"{tuple(out.shape)} for logits of shape {tuple(logits.shape)}")
            logits = out
            if count is not None:
                count(name, "adjust_logits", 1)
        if self.router is None:
            weights, ids = model_topk(logits)
        else:
            name, s = self.router
            weights, ids = s.route(layer_idx, logits, top_k, renormalize)
            want = (num_tokens, top_k)
            if tuple(weights.shape) != want or tuple(ids.shape) != want:
                raise ValueError(f"MoE plugin {name!r}: route returned weights {tuple(weights.shape)} "
                                 f"and ids {tuple(ids.shape)}; both must be [T, top_k] = {list(want)}")
            if ids.is_floating_point() or not weights.is_floating_point():
                raise TypeError(f"MoE plugin {name!r}: route must return (floating weights, integer "
                                f"ids), got ({weights.dtype}, {ids.dtype})")
            weights = weights.to(logits.device).float().contiguous()
            ids = ids.to(logits.device).int().contiguous()
            if count is not None:
                count(name, "route", 1)
        for name, s in self.observers:
            s.observe(layer_idx, ids, weights)
            if count is not None:
                count(name, "observe", 1)
        if count is not None:
            for name in self.participants:
                count(name, "tokens", num_tokens)
        return weights, ids


#: Contract class per kind, for validating implementations.
CONTRACTS: dict[Kind, type[PluginImpl]] = {
    Kind.ATTENTION: AttentionMethod,
    Kind.KVCOMPRESS: KVCompressor,
    Kind.SPECULATIVE: Proposer,
    Kind.QUANT: QuantMethod,
    Kind.MOE: MoEScheduler,
}
