"""Planted broken plugins, one family per kind, for the conformance kit's own tests
(``test_kit_planted.py``): each is a working plugin with one method broken the way a real bug
breaks it (zeros, a constant, one block off, out of the vocabulary, wrong weights...), so the
kit must fail it naming that method. Registered as the kit sees any plugin: a
:class:`~vllm_graft.hooks.Registration` whose ``impl`` is ``"tests.unit.planted_plugins:Class"``
(:func:`planted`), not installed through an entry point."""
from __future__ import annotations

import dataclasses

import torch
from pydantic import BaseModel

from vllm_graft.hooks import (
    BLOCKED,
    AttentionMethod,
    Capabilities,
    Kind,
    KVCompressor,
    MoEScheduler,
    NoParams,
    PagedBatch,
    Proposer,
    QuantMethod,
    Registration,
    StoredTensor,
)
from vllm_graft.hooks.registry import Entry, Source
from vllm_graft.kit.conformance.checks import Target, model_topk
from vllm_graft.plugins.attention._shared import paged_attention, paged_attention_with_mass


def planted(kind: Kind, cls: type, *, params: type[BaseModel] = NoParams, lossless: bool = False,
            values: dict | None = None, **caps) -> Target:
    """The kit's target for class ``cls`` of this module, registered as plugin ``planted``."""
    reg = Registration(name="planted", kind=kind, summary="a planted broken plugin", paper="-",
                       params=params, impl=f"{__name__}:{cls.__name__}",
                       capabilities=Capabilities(lossless=lossless, **caps))
    return Target(Entry(reg, Source("planted-pkg", "0", "planted")), values or {})


# ------------------------------------------------------------------------------ kvcompress
class Window(KVCompressor):
    """Correct: one sink block and the two most recent."""

    def keep(self, view):
        n = view.num_blocks
        return sorted({0, *range(max(0, n - 2), n)} | view.pinned)


class KeepOffByOne(KVCompressor):
    """Its window ends one block early: drops the block being written."""

    def keep(self, view):
        n = view.num_blocks
        return sorted({0, *range(max(0, n - 3), n - 1)} | view.pinned) if n > 1 else [0]


class Scored(Window):
    """Correct scored compressor: exact attention with mass (the built-ins' helper)."""

    needs_scores = True

    def attend(self, query, kv_cache, batch, layer, observe):
        return paged_attention_with_mass(query, kv_cache, batch, layer, observe)


class AttendZeros(Scored):
    """attend returns zeros for the output and the mass."""

    def attend(self, query, kv_cache, batch, layer, observe):
        return torch.zeros_like(query), torch.zeros(batch.block_table.shape, dtype=torch.float32)


class AttendConstantMass(Scored):
    """Right output, but the same mass on every block (the trial's TOVA copy)."""

    def attend(self, query, kv_cache, batch, layer, observe):
        out, _ = super().attend(query, kv_cache, batch, layer, observe)
        return out, torch.ones(batch.block_table.shape, dtype=torch.float32)


class AttendMassOffByOneBlock(Scored):
    """Right output, mass reported one block-table column late."""

    def attend(self, query, kv_cache, batch, layer, observe):
        out, mass = super().attend(query, kv_cache, batch, layer, observe)
        return out, mass.roll(1, dims=1)


class AttendReadsOffByOneBlock(Scored):
    """Reads the block table one column off (another sequence's blocks)."""

    def attend(self, query, kv_cache, batch, layer, observe):
        shifted = PagedBatch(batch.query_start_loc, batch.seq_lens, batch.block_table.roll(1, dims=1))
        return super().attend(query, kv_cache, shifted, layer, observe)


class NeverScores(Scored):
    """score_positions selects no query: its scores would stay 0."""

    def score_positions(self, num_prompt_tokens):
        return (num_prompt_tokens, num_prompt_tokens)


class PerHead(Scored):
    """Correct per-KV-head compressor: each head keeps the same window; masked attention."""

    per_head = True

    def keep_heads(self, view):
        return [self.keep(view) for _ in view.head_scores]

    def attend(self, query, kv_cache, batch, layer, observe, head_mask=None):
        return paged_attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)


class PerHeadIgnoresMask(PerHead):
    """Ignores head_mask: every head reads every block; mass per KV head all the same."""

    def attend(self, query, kv_cache, batch, layer, observe, head_mask=None):
        out, mass = paged_attention_with_mass(query, kv_cache, batch, layer, observe)
        hkv = layer.num_kv_heads
        return out, (mass / hkv)[:, None, :].expand(-1, hkv, -1).contiguous()


class ScoredClaimsPackedReadsBlocked(Scored):
    """Claims the packed layout, but its attend reads the cache in the blocked memory order."""

    kv_layouts = ("blocked", "packed")

    def attend(self, query, kv_cache, batch, layer, observe):
        return paged_attention_with_mass(query, kv_cache, batch, dataclasses.replace(layer, kv_layout=BLOCKED),
                                         observe)


# ------------------------------------------------------------------------------- attention
class Exact(AttentionMethod):
    def forward(self, query, kv_cache, batch, layer, plan=None):
        return paged_attention(query, kv_cache, batch, layer)


class ExactPacked(Exact):
    """Correct, in both layouts."""

    kv_layouts = ("blocked", "packed")


class ClaimsPackedReadsBlocked(ExactPacked):
    """Claims the packed layout, but reads the cache in the blocked memory order (ignores
    ``layer.kv_layout``)."""

    def forward(self, query, kv_cache, batch, layer, plan=None):
        return paged_attention(query, kv_cache, batch, dataclasses.replace(layer, kv_layout=BLOCKED))


class ClaimsPackedViewsBlocked(ExactPacked):
    """Claims the packed layout, but views the cache as blocked memory (``view`` fails on an
    NHD-ordered cache)."""

    def forward(self, query, kv_cache, batch, layer, plan=None):
        n, h, b, c = kv_cache.shape
        kv_cache.view(n, h, 2, b, c // 2)
        return super().forward(query, kv_cache, batch, layer)


class UnknownLayout(Exact):
    kv_layouts = ("paged-nhd",)


class ForwardZeros(AttentionMethod):
    """A lossy method whose forward returns zeros."""

    def forward(self, query, kv_cache, batch, layer, plan=None):
        return torch.zeros_like(query)


class ForwardOffByOneBlock(AttentionMethod):
    """Reads the block table one column off."""

    def forward(self, query, kv_cache, batch, layer, plan=None):
        shifted = PagedBatch(batch.query_start_loc, batch.seq_lens, batch.block_table.roll(1, dims=1))
        return paged_attention(query, kv_cache, shifted, layer)


class HostKernelButSparse(Exact):
    """Lossy, says the host's kernel computes it (uses_host_kernel), but its forward is off."""

    def uses_host_kernel(self):
        return True

    def forward(self, query, kv_cache, batch, layer, plan=None):
        out = super().forward(query, kv_cache, batch, layer)
        return out * 0.5


# ----------------------------------------------------------------------------- speculative
class Repeat(Proposer):
    """Correct: the tokens that followed the last earlier occurrence of the last token."""

    def propose(self, request_id, token_ids, max_tokens):
        last = token_ids[-1]
        for i in range(len(token_ids) - 2, -1, -1):
            if token_ids[i] == last:
                return list(token_ids[i + 1:i + 1 + max_tokens])
        return []


class OutOfVocab(Repeat):
    """Drafts token ids shifted past the vocabulary."""

    def propose(self, request_id, token_ids, max_tokens):
        return [x + 1000 for x in super().propose(request_id, token_ids, max_tokens)]


class IgnoresMaxTokens(Repeat):
    """Always drafts 4 tokens, whatever max_tokens says."""

    def propose(self, request_id, token_ids, max_tokens):
        return (list(token_ids[-4:]) * 2)[:4]


class TreeIgnoresMaxNodes(Repeat):
    """A tree proposer that always drafts a 6-node chain."""

    drafts_trees = True

    def propose_tree(self, request_id, token_ids, max_nodes):
        nodes = (list(token_ids[-6:]) * 2)[:6]
        return nodes, list(range(-1, len(nodes) - 1))


# ----------------------------------------------------------------------------------- quant
class Int8(QuantMethod):
    """Correct: per-row int8, with a pre-quantised checkpoint format."""

    def quantize(self, weight):
        scale = weight.abs().amax(1, keepdim=True).float().clamp_min(1e-8) / 127
        return {"q": (weight.float() / scale).round().to(torch.int8), "s": scale}

    def stored_tensors(self, out_features, in_features):
        return {"q": StoredTensor((out_features, in_features), "int8"),
                "s": StoredTensor((out_features, 1), "float32")}

    def apply(self, tensors, x, bias):
        w = (tensors["q"].float() * tensors["s"]).to(x.dtype)
        return torch.nn.functional.linear(x, w, bias)


class ApplyZeros(Int8):
    def apply(self, tensors, x, bias):
        return torch.zeros(*x.shape[:-1], tensors["q"].shape[0], dtype=x.dtype)


class DenseWeightTransposedRows(Int8):
    """dense_weight gives the rows in reverse order: the host's GEMM would differ from apply()."""

    def dense_weight(self, tensors):
        return (tensors["q"].float() * tensors["s"]).flip(0).to(torch.float32)


class LoadReversesShards(Int8):
    """load() puts a fused layer's shards in reverse order (k before q...)."""

    def load(self, stored, shard_rows):
        return {k: torch.cat(v[::-1], 0) for k, v in stored.items()}


class EmbedOffByOne(Int8):
    """Stores embeddings, but embed() returns the next row."""

    covers_embeddings = True

    def embed(self, tensors, ids):
        rows = (ids + 1).clamp_max(tensors["q"].shape[0] - 1)
        return (tensors["q"][rows].float() * tensors["s"][rows]).to(torch.float32)


class BadCheckpointParams(Int8):
    def checkpoint_params(self):
        return {"graft_conformance_unknown_field": 1}


class RSparse(QuantMethod):
    """Correct, lossy: R-Sparse (issue 64's outside author), the input channels of largest |x|
    per token computed exactly, the rest through a rank-16 SVD of the weight."""

    rank, exact_share = 16, 8  # 1 input channel in 8 exact

    def quantize(self, weight):
        u, s, vh = torch.linalg.svd(weight.float(), full_matrices=False)
        return {"dense": weight, "a": u[:, : self.rank] * s[: self.rank], "b": vh[: self.rank]}

    def low_rank(self, tensors, rest):
        return (rest @ tensors["b"].T) @ tensors["a"].T

    def apply(self, tensors, x, bias):
        xf = x.float()
        top = xf.abs().topk(max(1, x.shape[-1] // self.exact_share), dim=-1).indices
        exact = torch.zeros_like(xf).scatter(-1, top, xf.gather(-1, top))
        out = exact @ tensors["dense"].float().T + self.low_rank(tensors, xf - exact)
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def error_bound(self, layer):
        # measured on the kit's layers: 0.55-0.58 on random ones (a flat spectrum: rank 16 holds
        # little, so the bound there says little), 0.028 on the structured one
        return 0.8 if layer == "random" else 0.06


class RSparseLowRankZeros(RSparse):
    """Its low-rank path returns zeros: 0.74 / 0.165 off, a +4.3% perplexity on a real model."""

    def low_rank(self, tensors, rest):
        return torch.zeros(*rest.shape[:-1], tensors["a"].shape[0], dtype=rest.dtype)


class RSparseLowRankZerosNoBound(RSparseLowRankZeros):
    def error_bound(self, layer):
        return None


class RSparseBoundNotRelative(RSparse):
    def error_bound(self, layer):
        return 1.5


# ------------------------------------------------------------------------------------- moe
class TopK(MoEScheduler):
    """Correct: the model's own top-k."""

    def route(self, layer_idx, router_logits, top_k, renormalize):
        return model_topk(router_logits, top_k, renormalize)


class UniformWeights(TopK):
    """The right experts with equal weights (sum to 1, so a sum check passes)."""

    def route(self, layer_idx, router_logits, top_k, renormalize):
        w, ids = super().route(layer_idx, router_logits, top_k, renormalize)
        return torch.full_like(w, 1.0 / top_k), ids


class SameExpertTwice(TopK):
    """Sends each token to its top expert in every slot."""

    def route(self, layer_idx, router_logits, top_k, renormalize):
        w, ids = super().route(layer_idx, router_logits, top_k, renormalize)
        return w, ids[:, :1].expand_as(ids).contiguous()


class PlacementOffByOne(TopK):
    """Its placement numbers the experts from 1."""

    def bind(self, model):
        self.model = model

    def expert_placement(self):
        return [[e + 1 for e in range(self.model.num_experts)] for _ in self.model.moe_layers]
