"""The KV-compression contracts: an eviction compressor (role ``eviction``) chooses which
KV blocks stay; a storage format (role ``storage``) sets how K/V are stored."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from operator import index as _index
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..kinds import Kind
from .attention import AttentionLayer, PagedBatch
from .base import P, PluginImpl, ShapeProblem

if TYPE_CHECKING:  # torch is only needed by implementations
    import torch


@dataclass(frozen=True)
class BlockView:
    """What a compressor sees of one request's KV blocks (pure Python, no tensors).

    ``scores[i]`` is block i's accumulated importance (e.g. attention mass) where the
    method collects it (``needs_scores``), else ``None``; a block dropped at an earlier
    step has score ``-inf``. ``pinned`` are blocks it must keep (shared by the
    prefix cache with other requests).

    ``head_scores[h][i]`` (a :attr:`KVCompressor.per_head` compressor only, else ``None``):
    block i's score from KV head h alone (the mass of the query heads that read KV head h);
    ``-inf`` where head h dropped the block earlier. ``scores`` is then their sum over heads
    (``-inf`` where every head dropped the block).

    ``layer_scores[l][i]`` (a :attr:`KVCompressor.per_layer` compressor only, else ``None``): block
    i's score from decoder layer l alone (``-inf`` where layer l dropped the block earlier);
    ``scores`` is their sum over layers.

    ``step_scores[i]`` (``needs_scores`` only, where the worker asks; else ``None``): block i's
    mass from **this step's** queries alone (those :meth:`KVCompressor.score_positions` selects,
    summed over heads and layers), the part this step added to ``scores``; ``0.0`` for a block
    no observed query of the step read, ``-inf`` for a block dropped earlier. A scorer that
    ranks blocks by the current query (TOVA) reads it; one that accumulates (H2O) reads
    ``scores``.

    ``request_id``: the request's id (vLLM's, stable over every step of the request, the same in
    the scheduler and the worker), to key per-request state a compressor keeps itself; ``None``
    where the caller has no request (e.g. a view built by hand or by the conformance kit). A
    compressor without scores must still decide from the view's numbers alone (see
    "Determinism" in :class:`KVCompressor`).

    ``step_scores`` and ``request_id`` default to ``None``, so views built without them (older
    callers, tests) stay valid: read them with a fallback.
    """

    num_tokens: int
    block_size: int
    num_prompt_tokens: int
    scores: Sequence[float] | None = None
    pinned: frozenset[int] = frozenset()
    head_scores: Sequence[Sequence[float]] | None = None
    step_scores: Sequence[float] | None = None
    request_id: str | None = None
    layer_scores: Sequence[Sequence[float]] | None = None

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)


@dataclass(frozen=True)
class ScoringPass:
    """One extra forward pass a :attr:`KVCompressor.scoring_pass` compressor asks the worker to
    run over a request's context once its prompt is prefilled (e.g. KVzip's reconstruction:
    "repeat the context" followed by a chunk of it).

    ``token_ids`` are fed after the context (positions ``num_prompt_tokens`` on); every layer's
    queries attend to the context's cached KV and, causally, to the pass's own keys, which are
    never written to the cache (the pass's KV is discarded). The queries from index
    ``observe_from`` of ``token_ids`` on are the ones whose attention scores the context."""

    token_ids: tuple[int, ...]
    observe_from: int = 0


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

    Scores. A compressor that needs scores (H2O, SnapKV, TOVA: attention mass per block) sets
    :attr:`needs_scores`: the worker then runs the layer's attention with per-block mass and adds
    the mass to each block's score. By default that is the shared attention with mass (exact
    PyTorch, or its Triton decode kernel where the plugin's parameters say ``kernel: triton``),
    so a scorer is its policy alone; one with its own attention (a storage format, its own
    kernel) implements :meth:`attend` instead. The mass is summed over heads, layers and the
    queries :meth:`score_positions` selects. ``keep`` is asked in the
    **worker only**, once per step after the forward pass, with ``num_tokens`` = all tokens
    computed so far, ``scores`` set and ``pinned`` empty; the blocks it drops leave
    attention from the next step on and travel to the scheduler, which frees them (blocks
    shared through the prefix cache once no longer shared).

    Per KV head (:attr:`per_head`, with ``needs_scores``; e.g. AdaKV). vLLM frees KV per block,
    for every layer and head at once, but a head may stop *reading* a block. Such a compressor
    implements :meth:`keep_heads`: per KV head, the sorted blocks that head keeps, each list
    following the rules above (last block kept; a block a head dropped stays dropped for that
    head). It is asked instead of ``keep`` (in the worker, once per step, with
    ``view.head_scores`` set); the block-level answer is the **union** over heads (a block is
    freed only when no head keeps it), and inside the kept blocks each head attends only to
    the blocks it kept: :meth:`attend` gets ``head_mask`` and reports mass per KV head.
    :meth:`keep` must still answer (e.g. the union), for the callers that ask per block.

    Per layer (:attr:`per_layer`, with ``needs_scores``; e.g. PyramidKV). The same, with decoder
    layers in place of KV heads: :meth:`keep_layers` answers per layer (``view.layer_scores``
    set), the block-level answer is the union over layers, and each layer attends only to the
    blocks it kept. A layer's smaller budget frees nothing another layer keeps: vLLM frees a
    block for every layer at once. Not with :attr:`per_head`, nor with :meth:`block_scores`.

    Testing a compressor. :func:`check_keep` (and :func:`check_keep_heads`,
    :func:`dropped_blocks`, :func:`union_of_heads`; all exported by ``vllm_graft.hooks``) are
    the checks the adapter and the conformance kit run on every answer: call them in your own
    tests. :func:`vllm_graft.plugins.paged.paged_attention_with_mass` is the exact PyTorch
    :meth:`attend` the built-in scored compressors use (its Triton decode kernel beside it).
    """

    kind = Kind.KVCOMPRESS

    #: True if :meth:`keep` needs ``view.scores`` (the worker's shared attention with mass, or
    #: the compressor's own :meth:`attend`, computes them).
    needs_scores: bool = False
    #: True (with ``needs_scores``) if the compressor chooses blocks per KV head
    #: (:meth:`keep_heads`); its :meth:`attend` then takes ``head_mask`` and reports mass per KV head.
    per_head: bool = False
    #: True (with ``needs_scores``) if the compressor chooses blocks per decoder layer
    #: (:meth:`keep_layers`); each layer then attends only to the blocks it kept.
    per_layer: bool = False
    #: True (with ``needs_scores``) if the KV of the blocks :meth:`keep` drops is folded into the
    #: kept blocks' KV instead of being lost (merge-on-evict, e.g. D2O): see :meth:`merge`.
    merges: bool = False
    #: True (with ``needs_scores``) if the compressor scores the prompt by extra forward passes of
    #: its own (:meth:`scoring_passes`, reduced by :meth:`pass_block_scores`; e.g. KVzip)
    scoring_pass: bool = False
    #: the ``KVCacheLayout`` names the compressor's own :meth:`attend` reads the cache in (see
    #: ``hooks.contracts.attention.KVCacheLayout``); the shared attention reads both
    kv_layouts: tuple[str, ...] = ("blocked",)

    @abstractmethod
    def keep(self, view: BlockView) -> list[int]:
        """Sorted logical block indices to keep (see the class docstring for the rules)."""

    def keep_heads(self, view: BlockView) -> list[list[int]]:
        """Per KV head (``len(view.head_scores)`` of them), the sorted logical blocks that head
        keeps (:attr:`per_head` compressors only; see "Per KV head" in the class docstring)."""
        raise NotImplementedError(f"{type(self).__name__} sets per_head but implements no keep_heads()")

    def keep_layers(self, view: BlockView) -> list[list[int]]:
        """Per decoder layer (``len(view.layer_scores)`` of them), the sorted logical blocks that
        layer keeps (:attr:`per_layer` compressors only; see "Per layer" in the class docstring)."""
        raise NotImplementedError(f"{type(self).__name__} sets per_layer but implements no keep_layers()")

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        """Token positions ``[start, end)`` whose queries' attention counts towards the
        scores (``needs_scores`` only). Default: every query."""
        return (0, 1 << 62)

    def scoring_passes(
        self, prompt_token_ids: Sequence[int], tokenize: Callable[[str], list[int]]
    ) -> Sequence[ScoringPass]:
        """:attr:`scoring_pass` compressors only: the forward passes (:class:`ScoringPass`) to run
        over a request's context once its ``prompt_token_ids`` are prefilled. ``tokenize(text)``
        gives the model's token ids of a text (no special tokens). The worker runs each pass in a
        scoring-only attention (nothing is written to the cache, no block is allocated) and keeps,
        per layer, KV head and context token, the **largest** softmax probability that a pass's
        observed queries (over the query heads of the KV head's group) put on that token, over all
        passes: the ``pair_scores`` :meth:`pass_block_scores` reduces."""
        return ()

    def pass_block_scores(self, pair_scores: "torch.Tensor", block_size: int) -> "torch.Tensor":
        """:attr:`scoring_pass` compressors only: ``pair_scores [layers, H_kv, num_prompt_tokens]``
        (float32, see :meth:`scoring_passes`; under tensor parallelism this rank's KV heads) ->
        one score per prompt block ``[ceil(num_prompt_tokens / block_size)]``, added to the
        blocks' ``view.scores`` before :meth:`keep` is asked at the end of the prompt. The scores
        of the ranks are summed, so a score should be a sum over KV heads. On the input's device,
        no host sync."""
        raise NotImplementedError(f"{type(self).__name__} sets scoring_pass but implements no pass_block_scores()")

    def block_scores(
        self,
        kv_cache: "torch.Tensor",
        batch: PagedBatch,
        layer: AttentionLayer,
        query: "torch.Tensor | None" = None,
        observe: "torch.Tensor | None" = None,
        mass: "torch.Tensor | None" = None,
    ) -> "torch.Tensor | None":
        """Optional (``needs_scores`` only): this layer's score of each block read from the cache
        itself, **in place of** the attention mass, for scorers of what the keys say (K-norm: key
        norms; KeyDiff: how far a block's keys are from the sequence's mean key) or of what the
        keys say to the queries' statistics (Expected Attention). ``query`` ``[T, H, D]`` is the
        step's (positions applied) and ``observe`` ``[T]`` bool marks the queries
        :meth:`score_positions` selects, as :meth:`attend` gets them; ``mass`` ``[S, max_blocks]``
        is this layer's attention mass of those queries (what the scores would have been), for a
        scorer that combines it with what the keys say (R-KV: importance minus redundancy).
        ``None`` where a caller has none: score from the cache alone, or score nothing with
        zeros. Take only the arguments you use: the worker passes those the signature names. A
        float tensor
        ``[num_seqs, max_blocks]``: entry ``[i, j]`` scores block-table column ``j`` of sequence
        ``i`` (columns past ``ceil(seq_lens[i] / block_size)`` are ignored). The worker sums it
        over layers into the step's scores exactly as it sums the mass (``view.step_scores``:
        this step's; ``view.scores``: over the steps). Read the cache through
        ``layer.kv_layout.split`` (list the layouts in ``kv_layouts``); no host sync; leave the
        inputs unmodified. Default None: the scores are the attention mass. Not with
        :attr:`per_head`."""
        return None

    def merge(
        self,
        dropped_k: "torch.Tensor",
        dropped_v: "torch.Tensor",
        kept_k: "torch.Tensor",
        kept_v: "torch.Tensor",
        state: "torch.Tensor | None" = None,
    ) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]:
        """:attr:`merges` compressors only: fold the KV of the tokens this step's :meth:`keep`
        dropped into the kept tokens' KV, for one request and one layer. The worker calls it once
        per (request, layer) at a step that drops blocks, after the forward pass and before the
        blocks are freed, and writes the answer back into the kept blocks in place.

        ``dropped_k``/``dropped_v`` ``[H_kv, E, D]``: the dropped blocks' keys (positions applied)
        and values, in logical order (``E`` = dropped blocks x block_size: dropped blocks are
        full); ``kept_k``/``kept_v`` ``[H_kv, M, D]``: every kept token's, in logical order (the
        last block's unwritten slots left out). ``state``: what this method returned as its third
        value at the request's previous merge in this layer (None at the first), e.g. a running
        threshold. Returns ``(kept_k, kept_v, state)``, the first two of the inputs' shape and
        dtype. On the inputs' device, no host sync; the inputs may be modified. A request whose
        blocks are merged into shares no prefix-cache blocks with another (its blocks' content no
        longer matches their token hash): the adapter salts each such request on its own."""
        raise NotImplementedError(f"{type(self).__name__} sets merges but implements no merge()")

    def attend(
        self,
        query: "torch.Tensor",
        kv_cache: "torch.Tensor",
        batch: PagedBatch,
        layer: AttentionLayer,
        observe: "torch.Tensor",
        head_mask: "torch.Tensor | None" = None,
    ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Optional (``needs_scores`` only; default: the worker's shared attention with mass).
        Causal attention over the paged batch, as
        :meth:`AttentionMethod.forward` (the cache in ``layer.kv_layout``: read it with
        ``layer.kv_layout.split(kv_cache)``; list the layouts you read in ``kv_layouts``),
        plus the attention mass per block: ``(out [T, H, D], mass [num_seqs, max_blocks])``,
        ``mass[i, j]`` = the softmax probability that the queries of sequence ``i`` with
        ``observe[t]`` True put on the keys of block-table column ``j``, summed over heads
        and those queries.

        :attr:`per_head` compressors only: ``head_mask [num_seqs, H_kv, max_blocks]`` bool (True:
        KV head h of sequence i reads block-table column j; query head q reads KV head
        ``q // (H / H_kv)``), and ``mass`` is ``[num_seqs, H_kv, max_blocks]``: summed over the
        query heads of each KV head's group (not over all heads). Other compressors are called
        without ``head_mask``."""
        raise NotImplementedError(
            f"{type(self).__name__} implements no attend(): the worker runs the shared attention with mass"
        )


# ------------------------------------------------------------------ the rules of keep()
class KeepError(ValueError):
    """A :meth:`KVCompressor.keep` answer breaks the rules (the message names the plugin)."""


def check_keep(view: BlockView, kept: Any, plugin: str = "?") -> list[int]:
    """``kept`` (what ``keep(view)`` returned) as a list of ints, if it follows the rules of
    :meth:`KVCompressor.keep` that one answer can show; else :class:`KeepError`.

    The KV-compression adapter runs it on every answer in vLLM's engine and the conformance kit
    on every generated view; call it in a compressor's own tests::

        kept = check_keep(view, MyCompressor(params).keep(view), "my-compressor")

    (The "once dropped, stays dropped" rule spans calls: the adapter checks it against the
    blocks it already freed; in a test, keep the :func:`dropped_blocks` of earlier answers.)
    Accepts lists, tuples, ranges, numpy arrays and tensors of integers.
    """

    def fail(why: str) -> KeepError:
        shown = (
            kept
            if not isinstance(kept, (list, tuple)) or len(kept) <= 16
            else f"{list(kept[:16])}... ({len(kept)} items)"
        )
        return KeepError(
            f"kvcompress plugin {plugin!r}: keep() returned {shown!r} for {view.num_tokens} tokens "
            f"in {view.num_blocks} blocks of {view.block_size} (prompt {view.num_prompt_tokens} "
            f"tokens, pinned {sorted(view.pinned)}); {why}"
        )

    if hasattr(kept, "tolist") and not isinstance(kept, (list, tuple)):
        kept = kept.tolist()  # a numpy array or torch tensor
    if not isinstance(kept, (list, tuple, range)):
        raise fail("it must be a list of block indices")
    out: list[int] = []
    for i in kept:
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(_index(i))  # ints and numpy/torch integer scalars
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


def check_keep_heads(view: BlockView, kept: Any, plugin: str = "?") -> list[list[int]]:
    """``kept`` (what ``keep_heads(view)`` returned, a per-head compressor's answer) as one
    list of ints per KV head, each following the rules of :func:`check_keep`; else
    :class:`KeepError`. The block-level answer is their union (:func:`union_of_heads`)."""
    return _check_per_unit(view, kept, plugin, len(view.head_scores or ()), "keep_heads", "KV head", "head_scores")


def check_keep_layers(view: BlockView, kept: Any, plugin: str = "?") -> list[list[int]]:
    """``kept`` (what ``keep_layers(view)`` returned, a per-layer compressor's answer) as one
    list of ints per decoder layer, each following the rules of :func:`check_keep`; else
    :class:`KeepError`. The block-level answer is their union (:func:`union_of_heads`)."""
    return _check_per_unit(view, kept, plugin, len(view.layer_scores or ()), "keep_layers", "layer", "layer_scores")


def _check_per_unit(view: BlockView, kept: Any, plugin: str, units: int, method: str, unit: str, field: str):
    if not isinstance(kept, (list, tuple)) or len(kept) != units:
        raise KeepError(
            f"kvcompress plugin {plugin!r}: {method}() returned {kept!r:.200} for {view.num_tokens} tokens "
            f"in {view.num_blocks} blocks; it must be a list of {units} block lists, one per {unit} "
            f"(len(view.{field}))"
        )
    out = []
    for h, blocks in enumerate(kept):
        try:
            out.append(check_keep(view, blocks, plugin))
        except KeepError as e:
            raise KeepError(f"{e} (the list of {unit} {h} in {method}())") from None
    return out


def union_of_heads(kept: Sequence[Sequence[int]]) -> list[int]:
    """The blocks some head keeps (a block is freed only when no head keeps it), ascending."""
    return sorted(set().union(*map(set, kept))) if kept else []


def dropped_blocks(view: BlockView, kept: Sequence[int]) -> list[int]:
    """The blocks of ``view`` not in ``kept``, ascending."""
    keep = set(kept)
    return [i for i in range(view.num_blocks) if i not in keep]


class KVCacheFormat(PluginImpl[P]):
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
      ``do_kv_cache_update``; slot = block * block_size + offset, negative = padding), told
      which layer it writes (``layer``, as :meth:`forward` is) for a format with per-layer
      state such as codebooks;
    * :meth:`forward` is the layer's causal attention over the paged batch, reading the
      cache in the format (dequantising inside the attention). With ``observe`` given (an
      eviction compressor that needs scores, e.g. H2O, is combined with the format), it also
      returns the attention mass per block as :meth:`KVCompressor.attend` does; else the
      mass is ``None``.
    """

    kind = Kind.KVCOMPRESS

    @abstractmethod
    def bytes_per_token(self, head_size: int, block_size: int) -> int:
        """Bytes one token of one KV head takes in a page (keys, values, their scales)."""

    def unsupported(self, head_size: int, block_size: int) -> str | None:
        """Why this format cannot store a layer of ``head_size`` with blocks of
        ``block_size`` tokens (a message naming the fix), or None if it can."""
        return None

    @abstractmethod
    def write(
        self,
        key: "torch.Tensor",
        value: "torch.Tensor",
        kv_cache: "torch.Tensor",
        slot_mapping: "torch.Tensor",
        layer: AttentionLayer | None = None,
    ) -> None:
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping[:T]`` in ``kv_cache``.

        ``layer``: the layer written (its :attr:`AttentionLayer.index` keys per-layer state);
        ``None`` where a caller has no layer (a test, the conformance kit). The adapter passes it
        only to a ``write`` whose signature names ``layer`` (one written before it was part of
        the contract is called without it). Likewise ``positions`` (``[T]`` int64, each token's
        position in its sequence, from vLLM's attention metadata; ``None`` where the route has
        none) only to a ``write`` that names it: a format that undoes RoPE (``xquant``)."""

    @abstractmethod
    def forward(
        self,
        query: "torch.Tensor",
        kv_cache: "torch.Tensor",
        batch: PagedBatch,
        layer: AttentionLayer,
        observe: "torch.Tensor | None" = None,
    ) -> tuple["torch.Tensor", "torch.Tensor | None"]:
        """``(out [T, H, D], mass [num_seqs, max_blocks] or None)``: causal attention of
        ``query`` over the paged batch stored in this format (see the class docstring)."""


# ------------------------------------------------------------------ the shape check
def _flag_refusals(
    impl: type, scored: bool, per_head: bool, per_layer: bool, merges: bool, passes: bool
) -> list[ShapeProblem]:
    """The flag combinations of :func:`shape_problems` that a compressor class cannot have alone."""

    def own(method: str) -> bool:
        return getattr(impl, method, None) is not getattr(KVCompressor, method)

    refusals: list[tuple[bool, str, str]] = [
        (per_layer and per_head, "per_layer", "per_head is set too (choose per KV head or per layer)"),
        (
            per_layer and not scored,
            "per_layer",
            "it does not set needs_scores (per-layer decisions come from per-layer mass)",
        ),
        (
            per_layer and own("block_scores"),
            "per_layer",
            "it scores blocks from the cache (block_scores: one score per block, not per layer)",
        ),
        (
            per_layer and not own("keep_layers"),
            "per_layer",
            "it implements no keep_layers() (see the built-in pyramidkv plugin)",
        ),
        (
            per_head and not scored,
            "per_head",
            "it does not set needs_scores (per-head decisions come from per-head mass)",
        ),
        (
            per_head and own("block_scores"),
            "per_head",
            "it scores blocks from the cache (block_scores: one score per block, not per KV head)",
        ),
        (
            per_head and not own("keep_heads"),
            "per_head",
            "it implements no keep_heads() (see the built-in adakv plugin)",
        ),
        (merges and not scored, "merges", "it does not set needs_scores (the worker merges what it decides to drop)"),
        (
            merges and (per_head or per_layer),
            "merges",
            "it chooses blocks per KV head or per layer (a masked block is not dropped)",
        ),
        (merges and not own("merge"), "merges", "it implements no merge() (see the built-in d2o plugin)"),
        (
            passes and not scored,
            "scoring_pass",
            "it does not set needs_scores (the worker adds the passes' scores to the blocks' scores)",
        ),
        (
            passes and (per_head or per_layer or merges),
            "scoring_pass",
            "it chooses blocks per KV head or per layer, or merges (a pass scores blocks, for all at once)",
        ),
        (
            passes and not (own("scoring_passes") and own("pass_block_scores")),
            "scoring_pass",
            "it implements no scoring_passes() and pass_block_scores() (see the built-in kvzip plugin)",
        ),
    ]
    what = {
        "per_layer": "chooses blocks per layer",
        "per_head": "chooses blocks per KV head",
        "merges": "merges evicted KV",
        "scoring_pass": "scores the prompt by forward passes of its own",
    }
    return [ShapeProblem(f"{what[flag]} ({flag} = True), but {why}") for bad, flag, why in refusals if bad]


def shape_problems(impl: type, others: Sequence[tuple[str, str, type | None]] = ()) -> list[ShapeProblem]:
    """What a KV-compression plugin's class cannot be, alone or beside the deployment's
    ``others`` (``(kind, name, impl class or None)`` of every other plugin enabled): the legal
    combinations of its flags (``needs_scores``, ``per_head``, ``per_layer``, ``merges``) and
    methods, and what they may be combined with. Pure (no vLLM, no instance): deployment
    validation, ``vllm-graft check`` and the kit run it; the adapter only wires what passed.

    What it may be combined with follows from its shape, so no registration writes it by hand:
    a compressor that needs scores computes them in the worker's own attention (no attention
    plugin); one that masks per head or per layer, or merges, needs the dense cache (no storage
    format); a storage format stores KV in its own layout, which an attention plugin cannot read.
    """
    attention = [f"attention:{name}" for kind, name, _ in others if kind == "attention"]
    formats = [
        f"kvcompress:{name}"
        for kind, name, cls in others
        if kind == "kvcompress" and isinstance(cls, type) and issubclass(cls, KVCacheFormat)
    ]
    if issubclass(impl, KVCacheFormat):
        return [
            ShapeProblem("it stores KV in its own layout, which an attention plugin cannot read", a) for a in attention
        ]
    out: list[ShapeProblem] = []
    scored = bool(getattr(impl, "needs_scores", False))
    per_head, per_layer, merges = (bool(getattr(impl, f, False)) for f in ("per_head", "per_layer", "merges"))
    passes = bool(getattr(impl, "scoring_pass", False))
    out += _flag_refusals(impl, scored, per_head, per_layer, merges, passes)
    if scored:
        why = "it needs attention scores, which it computes in the worker's own attention"
        out += [ShapeProblem(why, a) for a in attention]
    if passes:
        why = "its scoring passes read the dense cache, which a storage format does not keep"
        out += [ShapeProblem(why, f) for f in formats]
    if per_head or per_layer or merges:
        why = "it merges into the dense cache" if merges else "it masks blocks per KV head or per layer"
        out += [ShapeProblem(f"{why}, which a storage format's attention does not do", f) for f in formats]
    return out
