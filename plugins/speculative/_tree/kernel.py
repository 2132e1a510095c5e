"""Triton tree attention for one sequence: the same result as :func:`.reference.tree_attention`
(shapes and meaning in that module's docstring).

Flash-decoding shaped, two launches:

* ``_tree_split_kernel``, one program per (row tile, KV head, split). A program's *rows* are
  the queries of all ``N`` tree nodes times the ``GROUP`` query heads that read its KV head
  (row ``r`` is node ``r // GROUP``, query head ``kvh * GROUP + r % GROUP``), up to
  ``ROWS`` of them (``N * GROUP`` padded to a power of two >= 16, at most :data:`MAX_ROWS`:
  a tree of tens of nodes is one row tile), loaded once as a ``[ROWS, D]`` tile. Splits
  ``0 .. n_split - 1`` each walk their share of the block table, :data:`KEYS_PER_STEP` keys
  (whole blocks) per step, so each context block's keys and values are read **once per KV
  head for the whole tree**, not once per node: scores and the P·V product are ``tl.dot``
  (the cache's dtype in, float32 accumulated; float32 caches in IEEE precision, and bfloat16
  ones too under Triton's interpreter, see :func:`_interpreted`), with an online softmax per
  row. The last split, ``n_split``, is the tree part: tiles of 32 tree
  nodes, each masked per row by one 32-bit word of the row's node's ancestor-or-self bitmask
  (bit ``j % 32`` of word ``j // 32`` of row ``i`` is set when node ``j`` is an
  ancestor-or-self of node ``i``), computed once per KV head rather than once per node. Each
  program stores its rows' running max, sum and (unnormalised) accumulator.
* ``_tree_reduce_kernel``, one program per (node, KV head): merges the ``n_split + 1`` partial
  states of each of the node's ``GROUP`` rows into ``out``: ``sum_i 2^(m_i - m) acc_i / sum_i
  2^(m_i - m) l_i`` (scores in log2 units, ``m`` the rows' largest ``m_i``).

The number of splits comes from the context's block count (the block table's width when
``context_len`` is a device tensor, whose value is then read on the device only) and the
device's SM count (:data:`HOST_SMS` off CUDA): about :data:`PROGRAMS_PER_SM` programs per SM,
each split at least :data:`MIN_KEYS_PER_SPLIT` keys (the partial states cost
``(n_split + 1) * N * Hq * D * 4`` bytes written and read again, which must stay well below
the context's own bytes), at most :data:`MAX_SPLITS`. The knobs are module constants, read at
every launch. A context of 0 tokens launches the tree split only.

Bytes per call (``L`` context tokens, fp16/bf16): keys and values ``4 * L * Hkv * D`` once
(per row tile), queries ``(n_split + 1)`` times per row tile (small, from L2), partial states
``8 * (n_split + 1) * N * Hq * D`` (written, read back). The earlier kernel (one program per
(node, KV head)) read the context ``N`` times and multiplied with broadcast sums instead of
``tl.dot``; on an H100 (ctx 4096, 28 nodes, H 32/8, D 128) it ran at 1.751 ms against 0.102 ms
for torch SDPA over a 28-token causal chain.

Why a bitmask rather than walking ``parents``: a parent walk is a chain of dependent scalar
loads (one key at a time, ``depth`` steps); the bitmask turns the tree into ordinary masked
tiles (32 keys per load, no data-dependent control flow), and costs ``N * ceil(N / 32)`` int32
words, built once per verify step on the host (:func:`pack_ancestor_bits`) and shared by every
layer and head.

Block size, head size and group size need not be powers of two (tiles are padded and masked).
The key and value caches may have any strides, as long as the stride along ``D`` is 1.

Why a tree costs more than a chain of ``N`` tokens on vLLM's CPU engine (see
``integration/adapters/speculative/tree.py``): while a tree proposer is active, the graft
backend's :class:`TreeAttention` owns *every* attention layer of *every* step (vLLM's
``CPU_ATTN`` backend is overridden; ``host_kernel`` is off), so vLLM's C++
``cpu_attention_with_kv_cache`` (vectorised, reads the paged cache in place in the cache's
dtype, fp32 accumulation) and its ``cpu_attn_reshape_and_cache`` never run: the graft backend
writes the cache in the documented layout in PyTorch (``write_kv``), runs
``plugins/attention/_shared.paged_attention`` (PyTorch, float32) over all rows of a step without
a tree (prefills included) and of a step with rows without a tree (the tree rows included, then
overwritten), and for each tree
``_tree.verify_pass_attention``, which gathers the whole context of the sequence per layer
(an indexed copy, a reshape copy, a float32 copy of keys and of values), materialises the
``[Hkv, GROUP, N + 1, L]`` float32 scores, masks and softmaxes them (two more passes). Plain
vLLM verifying a chain of ``N`` drafts runs one C++ call per layer for the whole batch, the
chain's ``N + 1`` queries reading the context together. So the
tree pays several full passes over the context in float32 per layer where the chain pays one
in the cache's dtype; this kernel is the CUDA path only (the adapter calls it on CUDA).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ...attention._kernel import FLOOR, attend_rows, online_softmax_start, online_softmax_step, qk_scores
from ...attention._shared import cache_strides

from .reference import check_shapes
from .tree import ancestor_mask

WORD = 32  # tree nodes per tile: one int32 word of the bitmask

#: sizing knobs, read at every launch (change them here, or sweep them: benchmarks/gpu/sweep_tree.py).
#: Compiled for sm_90 here (Triton 3.9, ptxas -v, fp16, D 128, GROUP 4): 128 rows x 32 keys per step
#: with 8 warps uses 255 registers and spills 8 bytes; 64 keys per step spills 156 bytes, 4 warps
#: spill over 1 KB; 64 rows do not spill (but a 28-node tree of GROUP 4 is then two row tiles).
KEYS_PER_STEP = 32  # context keys per inner step: max(1, KEYS_PER_STEP // block) whole blocks
MIN_KEYS_PER_SPLIT = 256  # a context split reads at least this many keys
PROGRAMS_PER_SM = 2  # target context-split programs per SM
MAX_SPLITS = 15  # context splits at most (the reduce loads all of a node's partials at once)
MAX_ROWS = 128  # query rows (nodes x group) per program
MAX_TILE = 128 * 128  # rows x padded head size per program (fewer rows for D > 128)
NUM_WARPS = 8  # the split kernel's warps (its tiles are up to [128, 128])
REDUCE_WARPS = 4
HOST_SMS = 4  # the SM count assumed without CUDA (Triton's interpreter)

_LOG2E = 1.4426950408889634


@triton.jit
def _context_share(
    len_ptr, context_len, width, split, n_split, pages_per_split, B: tl.constexpr, LEN_ON_DEVICE: tl.constexpr
):
    """``(L, first, last)``: the context length (the device's, clamped to ``[0, width * B]``, or
    the host's) and the blocks ``first .. last - 1`` that context split ``split`` reads (none for
    the tree's split, ``n_split``)."""
    if LEN_ON_DEVICE:
        L = tl.maximum(tl.load(len_ptr).to(tl.int32), 0)
    else:
        L = context_len
    nb = tl.minimum(tl.cdiv(L, B), width)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, nb)
    return L, first, tl.where(split < n_split, last, first)


@triton.jit
def _tree_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    table_ptr,
    len_ptr,
    kt_ptr,
    vt_ptr,
    bits_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    context_len,
    width,
    n_nodes,
    n_words,
    n_split,
    pages_per_split,
    s_qn,
    s_qh,
    s_kcn,
    s_kcb,
    s_kch,
    s_vcn,
    s_vcb,
    s_vch,
    s_ktn,
    s_kth,
    s_vtn,
    s_vth,
    s_pk,
    s_pr,
    qk_scale,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    PAGES: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    W: tl.constexpr,
    LEN_ON_DEVICE: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = tile * ROWS + tl.arange(0, ROWS)
    node = r // GROUP
    live = node < n_nodes
    d = tl.arange(0, DP)
    dm = d < D
    dt = kc_ptr.dtype.element_ty
    q = tl.load(
        q_ptr + node[:, None] * s_qn + (kvh * GROUP + r % GROUP)[:, None] * s_qh + d[None, :],
        mask=live[:, None] & dm[None, :],
        other=0.0,
    ).to(dt)  # [ROWS, DP]
    m, l, acc = online_softmax_start(ROWS, DP)

    # 1. splits 0 .. n_split - 1: their share of the context, whole blocks, PAGES per step
    L, first, last = _context_share(len_ptr, context_len, width, split, n_split, pages_per_split, B, LEN_ON_DEVICE)
    tok = tl.arange(0, PAGES * BP)
    slot = tok % BP
    for c in range(first, last, PAGES):
        page = c + tok // BP
        inside = page < last
        valid = inside & (slot < B) & (page * B + slot < L)
        blk = tl.load(table_ptr + page, mask=inside, other=0).to(tl.int64)
        k_rows = blk * s_kcn + slot * s_kcb + kvh * s_kch
        v_rows = blk * s_vcn + slot * s_vcb + kvh * s_vch
        m, l, acc = attend_rows(m, l, acc, q, kc_ptr, vc_ptr, k_rows, v_rows, d, valid, dm, qk_scale, IEEE, True, True)

    # 2. split n_split: the tree, W nodes per tile, each row masked by its node's bitmask word
    j = tl.arange(0, W)
    for w in range(0, tl.where(split == n_split, n_words, 0)):
        idx = w * W + j
        kv_mask = (idx < n_nodes)[:, None] & dm[None, :]
        k = tl.load(kt_ptr + idx[:, None] * s_ktn + kvh * s_kth + d[None, :], mask=kv_mask, other=0.0).to(dt)  # [W, DP]
        word = tl.load(bits_ptr + node * n_words + w, mask=live, other=0)  # [ROWS]
        anc = (((word[:, None] >> j[None, :]) & 1) != 0) & (idx < n_nodes)[None, :]
        s = qk_scores(q, k, qk_scale, IEEE)  # [ROWS, W]
        s = tl.where(anc, s, float("-inf"))
        v = tl.load(vt_ptr + idx[:, None] * s_vtn + kvh * s_vth + d[None, :], mask=kv_mask, other=0.0).to(dt)
        m, l, acc = online_softmax_step(m, l, acc, s, v, IEEE, True, True)

    at = kvh * s_pk + r * s_pr + split
    tl.store(pm_ptr + at, m, mask=live)
    tl.store(pl_ptr + at, l, mask=live)
    tl.store(pacc_ptr + at[:, None] * D + d[None, :], acc, mask=live[:, None] & dm[None, :])


@triton.jit
def _tree_reduce_kernel(
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    out_ptr,
    n_parts,
    s_pk,
    s_pr,
    s_on,
    s_oh,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    SP: tl.constexpr,
):
    node = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GP)
    sp = tl.arange(0, SP)
    d = tl.arange(0, DP)
    ok = (g < GROUP)[:, None] & (sp < n_parts)[None, :]  # [GP, SP]
    at = kvh * s_pk + (node * GROUP + g)[:, None] * s_pr + sp[None, :]
    m_i = tl.load(pm_ptr + at, mask=ok, other=float("-inf"))
    l_i = tl.load(pl_ptr + at, mask=ok, other=0.0)
    acc_i = tl.load(
        pacc_ptr + at[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & (d < D)[None, None, :], other=0.0
    )
    m = tl.maximum(tl.max(m_i, axis=1), FLOOR)  # finite for a live row: the tree's split saw the node
    w = tl.where(ok, tl.exp2(m_i - m[:, None]), 0.0)  # 0 for a split that read nothing (its max is -inf)
    l = tl.sum(l_i * w, axis=1)
    out = tl.sum(tl.where(ok[:, :, None], acc_i, 0.0) * w[:, :, None], axis=1) / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + node * s_on + (kvh * GROUP + g)[:, None] * s_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None] & (d < D)[None, :],
    )


def pack_ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """An ``[N, N]`` bool ancestor mask as ``[N, ceil(N / 32)]`` int32 words: bit ``j % 32`` of
    word ``j // 32`` of row ``i`` is ``mask[i, j]`` (bit 31 is the sign bit)."""
    n = mask.shape[0]
    words = -(-n // WORD)
    padded = torch.zeros(n, words * WORD, dtype=torch.int64, device=mask.device)
    padded[:, :n] = mask.to(torch.int64)
    shifts = torch.arange(WORD, dtype=torch.int64, device=mask.device)
    packed = (padded.view(n, words, WORD) << shifts).sum(-1)  # in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement
    return packed.to(torch.int32)


def _interpreted() -> bool:
    """Whether Triton runs interpreted (``TRITON_INTERPRET``, read as Triton reads it). Its
    interpreter's ``tl.dot`` multiplies bfloat16 tiles as their raw ``uint16`` storage (numpy has
    no bfloat16), so there bfloat16 tiles are multiplied in float32 (the IEEE path); compiled,
    bfloat16 goes to the tensor cores like float16."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_plan(device: torch.device, programs: int, blocks: int, block_size: int, pages: int) -> tuple[int, int]:
    """``(n_split, blocks per split)`` for ``blocks`` context blocks read by ``programs``
    (row tile, KV head) pairs, ``pages`` blocks per step: about :data:`PROGRAMS_PER_SM`
    programs per SM, at least :data:`MIN_KEYS_PER_SPLIT` keys per split, at most
    :data:`MAX_SPLITS` splits; ``(0, 0)`` without context. Host arithmetic only."""
    if blocks <= 0:
        return 0, 0
    sms = HOST_SMS  # also on a fake CUDA device (kit/fakedevice.py: CPU tensors that say cuda)
    if device.type == "cuda" and torch.cuda.is_available():
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    least = max(pages, -(-MIN_KEYS_PER_SPLIT // block_size))
    n = max(1, min(-(-PROGRAMS_PER_SM * sms // max(programs, 1)), blocks // least, MAX_SPLITS))
    per = -(-(-(-blocks // n)) // pages) * pages  # a whole number of steps
    return -(-blocks // per), per


def launch_plan(
    device: torch.device, n: int, hq: int, hkv: int, d: int, block_size: int, blocks: int
) -> tuple[int, int, int, int, int]:
    """``(rows, row tiles, blocks per step, n_split, blocks per split)`` of a launch for ``n``
    nodes, ``hq``/``hkv`` heads of size ``d`` and ``blocks`` context blocks, from the knobs (the
    split kernel runs ``row tiles * hkv * (n_split + 1)`` programs, the reduce ``n * hkv``)."""
    group = hq // hkv
    dp = max(16, triton.next_power_of_2(d))
    pages = max(1, KEYS_PER_STEP // triton.next_power_of_2(block_size))
    rows = min(max(16, triton.next_power_of_2(n * group)), max(16, min(MAX_ROWS, MAX_TILE // dp)))
    tiles = -(-(n * group) // rows)
    n_split, per_split = split_plan(device, tiles * hkv, blocks, block_size, pages)
    return rows, tiles, pages, n_split, per_split


def _context_length(context_len: int | torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``(the length tensor or None, the host length or 0)``: an int is the host's; a one-element
    integer tensor stays on the device, unread (the checks do not read the device)."""
    if not isinstance(context_len, torch.Tensor):
        return None, int(context_len)
    if context_len.numel() != 1 or context_len.dtype.is_floating_point:
        raise ValueError(
            f"context_len must be an int or a one-element integer tensor, got {context_len.dtype} "
            f"{tuple(context_len.shape)}"
        )
    return context_len, 0


def _ancestor_bits(bits: torch.Tensor | None, parents: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """The tree's ancestor bitmask, int32 ``[N, ceil(N / 32)]`` (built from ``parents`` unless one
    step's is reused), and its words per row."""
    if bits is None:
        bits = pack_ancestor_bits(ancestor_mask(parents))
    words = -(-n // WORD)
    if tuple(bits.shape) != (n, words) or bits.dtype != torch.int32:
        raise ValueError(
            f"ancestor_bits must be int32 [N, ceil(N / 32)] = {(n, words)}, got {bits.dtype} {tuple(bits.shape)}"
        )
    return bits, words


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int | torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    parents: torch.Tensor,
    scale: float,
    ancestor_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`.reference.tree_attention` by the Triton kernels. ``ancestor_bits`` (from
    :func:`pack_ancestor_bits`) may be passed to reuse one step's bitmask across layers;
    without it the bitmask is built from ``parents``. ``context_len`` may be an int or a
    one-element integer tensor on the device: a tensor is read by the kernel only (no host
    sync), so it is not range-checked here; the kernel clamps it to ``[0, block_table's width *
    block_size]``, and the splits are then sized for the whole width."""
    length, host_len = _context_length(context_len)
    on_device = length is not None
    n, hq, hkv, d, bs = check_shapes(q, k_cache, v_cache, block_table, host_len, k_tree, v_tree, parents)
    cache = cache_strides(k_cache, v_cache, "tree attention kernel")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    ancestor_bits, words = _ancestor_bits(ancestor_bits, parents, n)
    dev = q.device
    if q.stride(2) != 1:
        q = q.contiguous()
    k_tree, v_tree = k_tree.contiguous(), v_tree.contiguous()
    table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    bits = ancestor_bits.to(dev).contiguous()
    lens = table if length is None else length.to(device=dev, dtype=torch.int32).reshape(1)  # table: unread
    group = hq // hkv
    width = table.numel()
    blocks = width if on_device else -(-host_len // bs)
    bp, dp = triton.next_power_of_2(bs), max(16, triton.next_power_of_2(d))
    rows, tiles, pages, n_split, per_split = launch_plan(dev, n, hq, hkv, d, bs, blocks)
    parts = n_split + 1  # the context's splits, then the tree's
    pm, pl, pacc = _partial_states(hkv, tiles * rows, parts, d, dev)
    ieee = k_cache.dtype == torch.float32 or (k_cache.dtype == torch.bfloat16 and _interpreted())
    _tree_split_kernel[(tiles, hkv, parts)](
        q,
        k_cache,
        v_cache,
        table,
        lens,
        k_tree,
        v_tree,
        bits,
        pm,
        pl,
        pacc,
        host_len,
        width,
        n,
        words,
        n_split,
        per_split,
        q.stride(0),
        q.stride(1),
        *cache,
        k_tree.stride(0),
        k_tree.stride(1),
        v_tree.stride(0),
        v_tree.stride(1),
        pm.stride(0),
        pm.stride(1),
        float(scale) * _LOG2E,
        GROUP=group,
        ROWS=rows,
        B=bs,
        BP=bp,
        PAGES=pages,
        D=d,
        DP=dp,
        W=WORD,
        LEN_ON_DEVICE=on_device,
        IEEE=ieee,
        num_warps=NUM_WARPS,
    )
    return _reduce(pm, pl, pacc, out, group, dp)


def _partial_states(hkv: int, rows: int, parts: int, d: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The split kernel's outputs, float32: each row's running max and sum ``[Hkv, rows, parts]``
    and accumulator ``[Hkv, rows, parts, D]``, per part (the context's splits, then the tree's)."""
    pm = torch.empty(hkv, rows, parts, dtype=torch.float32, device=dev)
    return pm, torch.empty_like(pm), torch.empty(hkv, rows, parts, d, dtype=torch.float32, device=dev)


def _reduce(
    pm: torch.Tensor, pl: torch.Tensor, pacc: torch.Tensor, out: torch.Tensor, group: int, dp: int
) -> torch.Tensor:
    """``out [N, Hq, D]``: the partial states of each node's ``group`` rows merged by
    ``_tree_reduce_kernel`` (one program per node and KV head)."""
    hkv, _, parts, d = pacc.shape
    _tree_reduce_kernel[(out.shape[0], hkv)](
        pm,
        pl,
        pacc,
        out,
        parts,
        pm.stride(0),
        pm.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GP=triton.next_power_of_2(group),
        D=d,
        DP=dp,
        SP=max(2, triton.next_power_of_2(parts)),
        num_warps=REDUCE_WARPS,
    )
    return out
