"""SWIFT self-speculation in plain PyTorch: the target model with some of its sub-layers
skipped is the draft model (no weights of its own).

The decoder is the target's (:class:`~vllm_graft.hooks.TargetWeights`): ``L`` layers, each
two *sub-layers* numbered ``2 * i`` (attention of layer ``i``) and ``2 * i + 1`` (its MLP);
a skipped sub-layer adds nothing to the residual stream. :class:`SkipDecoder` runs it over
any set of skipped sub-layers, with or without a per-request dense KV cache
(:class:`DraftCache`, keys and values of the attention sub-layers it runs, one row per
position). With nothing skipped it is the target model's forward.

The draft cache holds the draft model's own keys and values: they are computed by the
layer-skipped model, not copied from vLLM's paged cache (a plugin sees token ids only), so the
draft feeds each token it has not seen once: the prompt when a request starts, then each
step's bonus token (drafts it proposed and the target accepted are already in it; the rest
are rolled back: the cache is cut to the longest prefix it shares with the request's tokens).

No Triton kernel: the draft forward is a few dense matmuls per token (the projections are
the target's own linear layers inside vLLM), RMSNorm, RoPE and one fused
``scaled_dot_product_attention`` over a short dense cache; nothing here is a kernel-shaped hot
loop of its own. At batch 1 on the CPU a draft forward of a small model costs its op count
(microseconds per op) more than its arithmetic, so each step is kept to few ops: the rotation's
``cos``/``sin`` rows are looked up once per forward for every layer, q and k are rotated together
in one ``addcmul``, attention is one op, the LM head runs on the last position only, and without
a confidence threshold the draft token is an ``argmax`` (no softmax over the vocabulary).
``benchmarks/swift_draft.py`` times a draft forward's pieces against a plain vLLM step.

Paper: Xia et al., SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference
Acceleration (ICLR 2025); Zhang et al., Draft & Verify (ACL 2024).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ....hooks import SelfSpeculativeProposer, TargetWeights

from .policy import LayerSkipSearch, skippable_sublayers


# ------------------------------------------------------------------------- the decoder
def _apply(proj: Any, x: torch.Tensor) -> torch.Tensor:
    """A projection of :class:`~vllm_graft.hooks.TargetLayer`: tensor ``W [out, in]`` or callable."""
    if isinstance(proj, torch.Tensor):
        return F.linear(x, proj)
    return proj(x)


def rms_norm(x: torch.Tensor, weight: Any, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (``weight`` a tensor: one ``F.rms_norm`` op, which reduces in float32 for
    half-precision inputs; a callable is the target's own norm, applied as is)."""
    if not isinstance(weight, torch.Tensor):
        return weight(x)
    return F.rms_norm(x, weight.shape, weight, eps)


class DraftCache:
    """One request's dense KV cache of the draft model: per attention sub-layer it runs,
    keys and values ``[kv_heads, capacity, head_dim]``; ``tokens`` are the ids whose keys and
    values it holds (positions ``0 .. len(tokens) - 1``), for a ``skip`` set."""

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.tokens: list[int] = []
        self.verified = 0  # leading tokens known to be the request's own (not drafts)

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` positions (rejected drafts' keys and values go)."""
        del self.tokens[n:]
        self.verified = min(self.verified, n)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [kv_heads, n, head_dim]`` at positions ``start ..``; return the layer's
        keys and values for positions ``0 .. start + n - 1``."""
        end = start + k.shape[1]
        buf_k, buf_v = self.k.get(layer), self.v.get(layer)
        if buf_k is None or buf_v is None or buf_k.shape[1] < end:  # (k and v are stored together)
            cap = max(64, end, 2 * (buf_k.shape[1] if buf_k is not None else 0))
            new_k = k.new_empty(k.shape[0], cap, k.shape[2])
            new_v = v.new_empty(v.shape[0], cap, v.shape[2])
            if buf_k is not None and buf_v is not None:
                new_k[:, :start] = buf_k[:, :start]
                new_v[:, :start] = buf_v[:, :start]
            self.k[layer], self.v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, start:end] = k
        buf_v[:, start:end] = v
        return buf_k[:, :end], buf_v[:, :end]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


class SkipDecoder:
    """The target's decoder (:class:`~vllm_graft.hooks.TargetWeights`) run over a chosen
    set of skipped sub-layers."""

    def __init__(self, w: TargetWeights) -> None:
        if w.num_heads % w.num_kv_heads:
            raise ValueError(f"num_heads ({w.num_heads}) must be a multiple of num_kv_heads ({w.num_kv_heads})")
        if not w.layers:
            raise ValueError("the target has no decoder layers")
        self.w = w
        self.num_layers = len(w.layers)
        self.num_sublayers = 2 * self.num_layers
        self.rotary_dim = w.rotary_dim or w.head_dim
        self.q_size = w.num_heads * w.head_dim
        self.kv_size = w.num_kv_heads * w.head_dim
        self.scale = w.head_dim**-0.5
        self._cos_sin: torch.Tensor | None = w.rope_cos_sin
        self._rot: torch.Tensor | None = None  # see rotation()

    # ---- pieces
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.w.embed
        return e[ids] if isinstance(e, torch.Tensor) else e(ids)

    def device(self) -> torch.device:
        """Where the target's weights are (the draft's tensors are made there)."""
        for t in (self.w.embed, self.w.lm_head, self.w.final_norm):
            weight = t if isinstance(t, torch.Tensor) else getattr(t, "weight", None)
            if isinstance(weight, torch.Tensor):
                return weight.device
        return torch.device("cpu")

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, need: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``need``: one past the largest position (given, it saves a host sync)."""
        need = int(positions.max()) + 1 if need is None else need
        table = self._cos_sin
        if table is None or (self.w.rope_cos_sin is None and table.shape[0] < need):
            n = max(need, 2 * (table.shape[0] if table is not None else 256))
            inv = 1.0 / (
                self.w.rope_theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)
            )
            freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv)
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(positions.device)
            self._cos_sin = table
        elif table.shape[0] < need:
            raise ValueError(f"position {need - 1} is past the target's RoPE table ({table.shape[0]} positions)")
        cs = table[positions].to(dtype)
        half = self.rotary_dim // 2
        return cs[:, :half], cs[:, half:]

    def rotation(
        self, positions: torch.Tensor, dtype: torch.dtype, need: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos2, sin2)``, each ``[T, 1, rotary_dim]``: ``[cos, cos]`` and ``[-sin, sin]`` at
        ``positions``, so that NeoX's rotation is ``x * cos2 + roll(x, rotary_dim / 2) * sin2``
        (computed once per forward, shared by every layer)."""
        need = int(positions.max()) + 1 if need is None else need
        rot = self._rot
        if rot is None or rot.shape[0] < need or rot.dtype != dtype or rot.device != positions.device:
            # [positions, 2, rotary_dim] for the positions seen so far (doubling, at most the
            # target's table): one index per forward after that
            cap = max(need, 256, 2 * rot.shape[0] if rot is not None else 0)
            limit = self.w.rope_cos_sin.shape[0] if self.w.rope_cos_sin is not None else None
            if limit is not None and need > limit:
                raise ValueError(f"position {need - 1} is past the target's RoPE table ({limit} positions)")
            cap = cap if limit is None else min(cap, limit)
            cos, sin = self.cos_sin(torch.arange(cap, device=positions.device), dtype, need=cap)
            rot = self._rot = torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=1)
        r = rot[positions]
        return r[:, 0:1], r[:, 1:2]

    def rope(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """NeoX rotation of ``x [T, heads, head_dim]``'s first ``rotary_dim`` dimensions
        (``cos2, sin2`` from :meth:`rotation`): ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``."""
        r = self.rotary_dim
        if r == x.shape[-1]:
            return torch.addcmul(x * cos2, x.roll(r // 2, dims=-1), sin2)
        xr = x[..., :r]
        return torch.cat([torch.addcmul(xr * cos2, xr.roll(r // 2, dims=-1), sin2), x[..., r:]], dim=-1)

    def attention(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos2: Any,
        sin2: Any,
        cache: DraftCache | None,
        start: int,
        seen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention sub-layer ``i`` of ``x [n, hidden]`` (normed) at positions ``start ..``.
        ``cos2, sin2``: :meth:`rotation` (``None``: the target's own rotary op ``w.rope``).
        ``seen [n, start + n]`` (True: the query sees the key) for ``n > 1`` after a cache
        (``start > 0``); ``n > 1`` from position 0 is plainly causal."""
        w, layer = self.w, self.w.layers[i]
        n, heads, kv_heads, dim = x.shape[0], w.num_heads, w.num_kv_heads, w.head_dim
        qkv = _apply(layer.qkv, x)
        if cos2 is not None:  # q and k rotated together: one rotation per layer
            qk = self.rope(qkv[:, : self.q_size + self.kv_size].view(n, heads + kv_heads, dim), cos2, sin2)
            q, k = qk[:, :heads], qk[:, heads:]
        else:  # the target's own rotary op
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = w.rope(positions, q.contiguous(), k.contiguous())
            q, k = q.reshape(n, heads, dim), k.reshape(n, kv_heads, dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, kv_heads, dim)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, n, head_dim]
        if cache is not None:
            k, v = cache.write(i, k, v, start)
        # one fused op: queries [1, heads, n, D] against keys/values [1, kv_heads, total, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k[None],
            v[None],
            attn_mask=seen,
            is_causal=n > 1 and seen is None,
            scale=self.scale,
            enable_gqa=heads != kv_heads,
        )
        return _apply(layer.o, out[0].transpose(0, 1).reshape(n, self.q_size))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.w.layers[i]
        gate, up = _apply(layer.gate_up, x).chunk(2, dim=-1)
        return _apply(layer.down, F.silu(gate) * up)

    # ---- the forward
    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int],
        skip: frozenset[int] = frozenset(),
        cache: DraftCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` (float32) after each of ``tokens``, which follow the
        cache's tokens (positions from ``len(cache)``; no cache: positions from 0); with
        ``last_only``, ``[1, vocab]`` after the last one (the LM head runs on it alone). The
        cache, if given, must have been filled with the same ``skip``; it gains ``tokens``."""
        if cache is not None and cache.skip != skip:
            raise ValueError(f"the cache was filled skipping {sorted(cache.skip)}, not {sorted(skip)}")
        w = self.w
        start = len(cache) if cache is not None else 0
        n = len(tokens)
        dev = self.device()
        ids = torch.as_tensor(tokens if isinstance(tokens, list) else list(tokens), dtype=torch.long, device=dev)
        positions = torch.arange(start, start + n, device=dev)
        h = self.embed(ids)
        cos2 = sin2 = None
        if w.rope_cos_sin is not None or w.rope is None:  # the table: one rotation for every layer
            cos2, sin2 = self.rotation(positions, h.dtype, need=start + n)
        # query j (position start + j) sees keys 0 .. start + j: one mask for every layer
        seen = torch.arange(start + n, device=dev)[None, :] <= positions[:, None] if n > 1 and start else None
        eps = w.rms_norm_eps
        for i, layer in enumerate(w.layers):
            if 2 * i not in skip:
                h = h + self.attention(i, rms_norm(h, layer.input_norm, eps), positions, cos2, sin2, cache, start, seen)
            if 2 * i + 1 not in skip:
                h = h + self.mlp(i, rms_norm(h, layer.post_attention_norm, eps))
        if last_only:
            h = h[-1:]
        logits = _apply(w.lm_head, rms_norm(h, w.final_norm, eps))
        if cache is not None:
            cache.tokens.extend(int(t) for t in tokens)
        return logits[:, : w.vocab_size].float()


# ---------------------------------------------------------------------- the proposer
def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, known to be at least ``start``."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_scorer(decoder: SkipDecoder, tokens: Sequence[int]) -> tuple[Callable[[frozenset[int]], float], int]:
    """SWIFT's objective on a context: the share of positions of ``tokens`` at which the
    layer-skipped model's greedy next token equals the full model's (one full forward, then
    one forward per scored skip set, no cache). Returns ``(score, positions scored)``."""
    full = decoder.forward(tokens).argmax(-1)

    def score(skip: frozenset[int]) -> float:
        return (decoder.forward(tokens, skip).argmax(-1) == full).float().mean().item()

    return score, len(tokens)


class Swift(SelfSpeculativeProposer):
    """SWIFT: drafts with the target model minus a searched set of its sub-layers.

    The skipped set is searched once, on the first request with at least
    ``search_min_tokens`` tokens (its first ``search_tokens`` tokens), and shared by every
    request after (SWIFT's context-based layer-set optimisation, cached for the task); a
    fixed ``skip_layers`` disables the search. Drafting stops early when the draft's top-1
    probability falls below ``confidence`` (SWIFT's confidence-aware drafting)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.decoder: SkipDecoder | None = None
        self.skip: frozenset[int] | None = None
        self.caches: dict[str, DraftCache] = {}
        self.search_info: dict[str, Any] = {}
        self.stats = dict.fromkeys(
            (
                "proposals",
                "drafted",
                "draft_forwards",
                "fed_tokens",
                "stopped_low_confidence",
                "verified",
                "accepted",
                "no_target",
            ),
            0,
        )
        self.draft_seconds = 0.0

    # ---- the target
    def attach_target(self, weights: TargetWeights) -> None:
        decoder = SkipDecoder(weights)
        p = self.params
        if p.skip_layers is not None:
            bad = [s for s in p.skip_layers if not 0 <= s < decoder.num_sublayers]
            if bad:
                raise ValueError(
                    f"swift: skip_layers {bad} are not sub-layers of the target, which has "
                    f"{decoder.num_layers} layers: sub-layers 0..{decoder.num_sublayers - 1} "
                    "(2*i: attention of layer i, 2*i+1: its MLP)"
                )
            self.skip = frozenset(p.skip_layers)
        else:
            candidates = skippable_sublayers(decoder.num_layers, p.keep_ends)
            n_skip = self.num_skipped(decoder.num_sublayers)
            if n_skip > len(candidates):
                raise ValueError(
                    f"swift: skip_ratio {p.skip_ratio} asks to skip {n_skip} of the target's "
                    f"{decoder.num_sublayers} sub-layers, but only {len(candidates)} may be skipped"
                    + (" (keep_ends keeps the first and last layer)" if p.keep_ends else "")
                    + f"; lower skip_ratio to at most {len(candidates) / decoder.num_sublayers:.2f}"
                    + (" or set keep_ends: false" if p.keep_ends else "")
                )
        self.decoder = decoder
        self.caches.clear()

    def num_skipped(self, num_sublayers: int) -> int:
        return max(1, round(self.params.skip_ratio * num_sublayers))

    def search(self, token_ids: Sequence[int]) -> None:
        """Choose the skipped sub-layers on this context (see :func:`match_scorer`)."""
        assert self.decoder is not None
        p, d = self.params, self.decoder
        t0 = time.perf_counter()
        score, n = match_scorer(d, list(token_ids[: p.search_tokens]))
        search = LayerSkipSearch(
            skippable_sublayers(d.num_layers, p.keep_ends),
            self.num_skipped(d.num_sublayers),
            budget=p.search_budget,
            seed=p.seed,
        )
        best, best_score = search.run(score)
        self.skip = best
        self.caches.clear()
        self.search_info = {
            "skipped": sorted(best),
            "match": round(best_score, 4),
            "tokens_scored": n,
            "candidates": search.evaluated,
            "seconds": round(time.perf_counter() - t0, 3),
        }

    # ---- the Proposer contract
    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        d, p = self.decoder, self.params
        if d is None:
            self.stats["no_target"] += 1
            return []
        if self.skip is None:
            if len(token_ids) < p.search_min_tokens:
                return []
            self.search(token_ids)
        t0 = time.perf_counter()
        skip = self.skip
        assert skip is not None
        cache = self.caches.get(request_id)
        if cache is None or cache.skip != skip:
            cache = self.caches[request_id] = DraftCache(skip)
        keep = common_prefix(cache.tokens, token_ids, cache.verified)
        keep = min(keep, len(token_ids) - 1)  # the last token is fed for its logits
        cache.truncate(keep)
        tail = token_ids[keep:]
        logits = d.forward(tail, skip, cache, last_only=True)[0]
        cache.verified = len(token_ids)
        self.stats["fed_tokens"] += len(tail)
        forwards = 1
        drafts: list[int] = []
        n = min(max_tokens, p.num_speculative_tokens)
        while len(drafts) < n:
            if p.confidence > 0:
                top_p, top_t = torch.softmax(logits, dim=-1).max(dim=-1)
                if float(top_p) < p.confidence:
                    self.stats["stopped_low_confidence"] += 1
                    break
                top = int(top_t)
            else:  # no early stop: the greedy token alone (no softmax over the vocabulary)
                top = int(logits.argmax())
            drafts.append(top)
            if len(drafts) < n:
                logits = d.forward([top], skip, cache)[0]
                forwards += 1
        self.stats["proposals"] += 1
        self.stats["drafted"] += len(drafts)
        self.stats["draft_forwards"] += forwards
        self.draft_seconds += time.perf_counter() - t0
        return drafts

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        self.stats["verified"] += num_verified
        self.stats["accepted"] += num_accepted

    def finish(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    def describe(self) -> dict[str, Any]:
        d = self.decoder
        out: dict[str, Any] = {
            **self.stats,
            "draft_seconds": round(self.draft_seconds, 3),
            "live_requests": len(self.caches),
            "cache_bytes": sum(c.nbytes for c in self.caches.values()),
        }
        if d is not None:
            out["target"] = {"source": d.w.source, "layers": d.num_layers, "sublayers": d.num_sublayers}
        if self.skip is not None:
            out["skipped_sublayers"] = sorted(self.skip)
        if self.search_info:
            out["search"] = self.search_info
        return out
