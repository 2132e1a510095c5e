"""The conformance kit catches what it claims to: each check is run on a plugin broken in
exactly the way the check is about, and must fail naming the problem (and pass on the
same plugin fixed)."""
from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_graft.hooks import (
    AttentionMethod,
    Capabilities,
    KernelParams,
    Kind,
    KVCompressor,
    MoEScheduler,
    NoParams,
    Proposer,
    QuantMethod,
    Registration,
)
from vllm_graft.hooks.registry import Entry, Source
from vllm_graft.kit.conformance import checks as c
from vllm_graft.plugins.attention._shared import paged_attention

from .planted_plugins import Window  # one sink block and the two most recent (target() names it here)


def target(kind, cls, *, params=NoParams, lossless=True, values=None, **caps):
    reg = Registration(name="subject", kind=kind, summary="under test", paper="-", params=params,
                       impl=f"{__name__}:{cls.__name__}",
                       capabilities=Capabilities(lossless=lossless, **caps))
    return c.Target(Entry(reg, Source("test-pkg", "0", "subject")), values or {})


# ------------------------------------------------------------------------------ params
class Bounded(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: int = Field(4, ge=1)
    ratio: float = Field(0.5, gt=0, le=1)


class Unbounded(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: int = 4  # a negative window is accepted: the kit must notice nothing (no bound declared)
    name: str = "x"


class LaxTypes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: object = 4  # accepts anything: no wrong type exists, so the kit cannot test one


class Required(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


class WithExample(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"path": "m.json"}]})
    path: str


class KeepAll(KVCompressor):
    def keep(self, view):
        return list(range(view.num_blocks))


def test_params_reject_counts_bounds_and_types():
    summary = c.check_params_reject(target(Kind.KVCOMPRESS, KeepAll, params=Bounded))
    # unknown field + (wrong type, ge) for window + (wrong type, gt, le) for ratio
    assert summary == "refused 6 bad parameter sets"


def test_params_reject_ignores_fields_without_a_testable_wrong_value():
    assert c.check_params_reject(target(Kind.KVCOMPRESS, KeepAll, params=LaxTypes)) == \
        "refused 1 bad parameter sets"


class Lenient(BaseModel):
    """Turns any junk into the default instead of refusing it."""
    model_config = ConfigDict(extra="forbid")
    window: int = 4

    @field_validator("window", mode="before")
    @classmethod
    def _default_on_junk(cls, v):
        return v if isinstance(v, int) else 4


def test_params_reject_fails_on_a_model_that_swallows_bad_values():
    with pytest.raises(c.ConformanceError, match=r"accepted window = 'not-a-number'"):
        c.check_params_reject(target(Kind.KVCOMPRESS, KeepAll, params=Lenient))


def test_params_reject_skips_unions():
    class Either(BaseModel):
        model_config = ConfigDict(extra="forbid")
        label: str | int = "x"  # a union: no single wrong type, not tested

    assert c.check_params_reject(target(Kind.KVCOMPRESS, KeepAll, params=Either)) == \
        "refused 1 bad parameter sets"


def test_unbounded_int_is_not_invented_a_bound():
    assert "refused 3" in c.check_params_reject(target(Kind.KVCOMPRESS, KeepAll, params=Unbounded))


def test_example_params_from_defaults_examples_or_error():
    assert c.example_params(target(Kind.KVCOMPRESS, KeepAll, params=Bounded).entry) == {}
    assert c.example_params(target(Kind.KVCOMPRESS, KeepAll, params=WithExample).entry) == {"path": "m.json"}
    with pytest.raises(c.ConformanceError, match="required fields and no example"):
        c.example_params(target(Kind.KVCOMPRESS, KeepAll, params=Required).entry)


def test_registration_check_builds_and_fails_on_bad_describe():
    assert "builds" in c.check_registration(target(Kind.KVCOMPRESS, KeepAll))
    with pytest.raises(c.ConformanceError, match="not JSON-serialisable"):
        c.check_registration(target(Kind.KVCOMPRESS, BadDescribe))
    with pytest.raises(c.ConformanceError, match="not a subclass"):
        c.check_registration(target(Kind.ATTENTION, KeepAll))


class BadDescribe(KeepAll):
    def describe(self):
        return {"tensor": torch.zeros(1)}


# ----------------------------------------------------------------------------- kvcompress
class Resurrecting(KVCompressor):
    """Drops odd blocks on odd steps, then keeps everything again: KV it freed comes back."""

    def keep(self, view):
        n = view.num_blocks
        if (view.num_tokens // 13) % 2:
            return sorted({i for i in range(n) if i % 2 == 0 or i == n - 1} | view.pinned)
        return list(range(n))


class IgnoresPinned(KVCompressor):
    def keep(self, view):
        return [view.num_blocks - 1]


def test_kvcompress_contract():
    assert "keep the kvcompress contract" in c.check_contract(target(Kind.KVCOMPRESS, Window, lossless=False))
    with pytest.raises(c.ConformanceError, match="dropped earlier"):
        c.check_contract(target(Kind.KVCOMPRESS, Resurrecting, lossless=False))
    with pytest.raises(c.ConformanceError, match="pinned"):
        c.check_contract(target(Kind.KVCOMPRESS, IgnoresPinned, lossless=False))
    with pytest.raises(c.ConformanceError, match="declared lossless but dropped"):
        c.check_contract(target(Kind.KVCOMPRESS, Window, lossless=True))


# ------------------------------------------------------------------------------ attention
class Exact(AttentionMethod):
    def forward(self, query, kv_cache, batch, layer, plan=None):
        return paged_attention(query, kv_cache, batch, layer)


class NoCausalMask(AttentionMethod):
    """Lets prefill queries see later keys: wrong only for the multi-token rows."""

    def forward(self, query, kv_cache, batch, layer, plan=None):
        out = paged_attention(query, kv_cache, batch, layer)
        for i in range(batch.seq_lens.numel()):
            q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
            if q1 - q0 > 1:
                out[q0] = out[q1 - 1]
        return out


def test_attention_contract_against_the_kits_own_oracle():
    assert "max|err| vs exact" in c.check_contract(target(Kind.ATTENTION, Exact))
    with pytest.raises(c.ConformanceError, match="differs from exact causal attention"):
        c.check_contract(target(Kind.ATTENTION, NoCausalMask))
    # a plugin that does not claim to be exact is not compared with exact attention, but the
    # first position of a sequence sees one key (its own) whatever the method
    with pytest.raises(c.ConformanceError, match=r"forward\(\) gave the query at position 0"):
        c.check_contract(target(Kind.ATTENTION, NoCausalMask, lossless=False))


def test_attention_head_size_filter():
    with pytest.raises(c.Skipped, match="head sizes"):
        c.check_contract(target(Kind.ATTENTION, Exact, head_sizes=(256,)))


# ---------------------------------------------------------------------------- speculative
class Repeat(Proposer):
    """Drafts the token that followed the last occurrence of the last token; keeps stats."""

    def __init__(self, params):
        super().__init__(params)
        self.stats: dict[str, list[int]] = {}

    def propose(self, request_id, token_ids, max_tokens):
        last = token_ids[-1]
        for i in range(len(token_ids) - 2, -1, -1):
            if token_ids[i] == last:
                return token_ids[i + 1:i + 1 + max_tokens]
        return []

    def accepted(self, request_id, num_accepted, num_verified):
        self.stats.setdefault(request_id, []).append(num_accepted)

    def finish(self, request_id):
        self.stats.pop(request_id, None)


class Leaky(Repeat):
    def finish(self, request_id):
        pass


class TooMany(Repeat):
    def propose(self, request_id, token_ids, max_tokens):
        return [1] * (max_tokens + 1)


def test_speculative_contract_and_state():
    t = target(Kind.SPECULATIVE, Repeat)
    assert c.check_contract(t)
    assert "nothing held" in c.check_state(t)
    with pytest.raises(c.ConformanceError, match=r"still holds finished requests in .*self\.stats\["):
        c.check_state(target(Kind.SPECULATIVE, Leaky))
    with pytest.raises(c.ConformanceError, match="at most max_tokens"):
        c.check_contract(target(Kind.SPECULATIVE, TooMany))


# ----------------------------------------------------------------------------------- quant
class Dense(QuantMethod):
    def quantize(self, weight):
        return {"w": weight.clone()}

    def apply(self, tensors, x, bias):
        return torch.nn.functional.linear(x, tensors["w"], bias)


class Int8(QuantMethod):
    def quantize(self, weight):
        scale = weight.abs().amax(1, keepdim=True).float() / 127
        return {"q": (weight.float() / scale).round().to(torch.int8), "s": scale}

    def apply(self, tensors, x, bias):
        w = (tensors["q"].float() * tensors["s"]).to(x.dtype)
        return torch.nn.functional.linear(x, w, bias)


class Garbage(Dense):
    def apply(self, tensors, x, bias):
        return -2 * super().apply(tensors, x, bias)


class KernelledInt8(Int8):
    """Its 'triton' path is off by a constant: parity must catch it."""

    def apply(self, tensors, x, bias):
        out = super().apply(tensors, x, bias)
        return out + 0.5 if self.params.kernel == "triton" else out


def test_quant_contract():
    assert c.check_contract(target(Kind.QUANT, Dense))
    assert "rel.err" in c.check_contract(target(Kind.QUANT, Int8, lossless=False))
    with pytest.raises(c.ConformanceError, match="declared lossless"):
        c.check_contract(target(Kind.QUANT, Int8, lossless=True))
    with pytest.raises(c.ConformanceError, match="worse than returning zeros"):
        c.check_contract(target(Kind.QUANT, Garbage, lossless=False))


def test_parity_skips_without_kernel_and_catches_a_wrong_kernel(monkeypatch):
    with pytest.raises(c.Skipped, match="cannot switch the plugin to a Triton path"):
        c.check_parity(target(Kind.QUANT, Int8, lossless=False))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(c.ConformanceError, match="'triton' differs from 'reference'"):
        c.check_parity(target(Kind.QUANT, KernelledInt8, params=KernelParams, lossless=False))
    monkeypatch.setattr(KernelledInt8, "apply", Int8.apply)
    assert "triton matches reference" in c.check_parity(
        target(Kind.QUANT, KernelledInt8, params=KernelParams, lossless=False))


# ------------------------------------------------------------------------------------- moe
class Observer(MoEScheduler):
    def __init__(self, params):
        super().__init__(params)
        self.seen = 0

    def observe(self, layer_idx, topk_ids, topk_weights):
        self.seen += topk_ids.shape[0]


class MaskThree(MoEScheduler):
    def adjust_logits(self, layer_idx, router_logits):
        out = router_logits.clone()
        out[:, 3] = float("-inf")
        return out


class BadIds(MoEScheduler):
    def route(self, layer_idx, router_logits, top_k, renormalize):
        w, ids = c.model_topk(router_logits, top_k, renormalize)
        return w, ids + router_logits.shape[1]


class InPlace(MoEScheduler):
    def adjust_logits(self, layer_idx, router_logits):
        router_logits[:, 0] = 0
        return router_logits


def test_moe_contract():
    assert c.check_contract(target(Kind.MOE, Observer))
    assert c.check_contract(target(Kind.MOE, MaskThree, lossless=False))
    with pytest.raises(c.ConformanceError, match="declared lossless but adjust_logits changed"):
        c.check_contract(target(Kind.MOE, MaskThree))
    with pytest.raises(c.ConformanceError, match="expert ids outside"):
        c.check_contract(target(Kind.MOE, BadIds, lossless=False))
    with pytest.raises(c.ConformanceError, match="in place"):
        c.check_contract(target(Kind.MOE, InPlace, lossless=False))


def test_resolve_specs(registry):
    builtin = c.resolve_specs(["builtin"], registry)
    assert {(e.kind.value, e.name) for e in builtin} >= {(k.value, "noop") for k in Kind}
    assert all(e.source.package == "vllm-graft" for e in builtin)
    assert [e.name for e in c.resolve_specs(["moe:noop"], registry)] == ["noop"]
    with pytest.raises(ValueError, match="write 'kind:name'"):
        c.resolve_specs(["noop"], registry)
    with pytest.raises(ValueError, match="is the plugin's package installed"):
        c.resolve_specs(["moe:nope"], registry)


class MisDeclared(Int8):
    """Declares its stored tensors with a wrong dtype: a checkpoint would not load."""

    def stored_tensors(self, out_features, in_features):
        from vllm_graft.hooks import StoredTensor

        return {"q": StoredTensor((out_features, in_features), "int8"),
                "s": StoredTensor((out_features, 1), "float16")}


def test_quant_stored_tensors_must_match_quantize():
    with pytest.raises(c.ConformanceError, match=r"quantize\(\)\['s'\] is torch.float32, stored_tensors\(\) says float16"):
        c.check_contract(target(Kind.QUANT, MisDeclared, lossless=False))


# ----------------------------------------------------------------- kvcompress storage format
from vllm_graft.plugins.kvcompress.kv4 import KV4Params  # noqa: E402
from vllm_graft.plugins.kvcompress.kv4.reference import KV4  # noqa: E402


class DropsDecodeWrites(KV4):
    """Stores prefill chunks but loses one-token (decode) writes."""

    def write(self, key, value, kv_cache, slot_mapping):
        if int((slot_mapping >= 0).sum()) > 4:
            super().write(key, value, kv_cache, slot_mapping)


class MisplacesBlocks(KV4):
    """Reads the block table one column off (attends to another sequence's blocks)."""

    def forward(self, query, kv_cache, batch, layer, observe=None):
        from vllm_graft.hooks import PagedBatch

        shifted = PagedBatch(batch.query_start_loc, batch.seq_lens, batch.block_table.roll(1, dims=1))
        return super().forward(query, kv_cache, shifted, layer, observe)


class NoMass(KV4):
    def forward(self, query, kv_cache, batch, layer, observe=None):
        return super().forward(query, kv_cache, batch, layer, None)


def test_kvcompress_storage_format_contract():
    ok = c.check_contract(target(Kind.KVCOMPRESS, KV4, params=KV4Params, lossless=False, role="storage"))
    # 2 dtypes x 3 format cases (a storage format is not an eviction compressor: no keep())
    assert ok.startswith("6 generated case(s) keep the kvcompress contract")
    for broken, match in ((DropsDecodeWrites, "off exact attention"), (MisplacesBlocks, "off exact attention"),
                          (NoMass, "returned mass None")):
        with pytest.raises(c.ConformanceError, match=match):
            c.check_contract(target(Kind.KVCOMPRESS, broken, params=KV4Params, lossless=False, role="storage"))


# ------------------------------------------------------------- kvcompress: block_scores
class KeyScored(KVCompressor):
    """Scores blocks from the cache (block_scores), as knorm and keydiff do."""

    needs_scores = True
    kv_layouts = ("blocked", "packed")

    def keep(self, view):
        return list(range(view.num_blocks))

    def block_scores(self, kv_cache, batch, layer):
        keys, _ = layer.kv_layout.split(kv_cache)
        table = batch.block_table.long().clamp(min=0)
        return keys[table].float().abs().mean(dim=(2, 3, 4))  # [S, W]


class KeyScoredWrongShape(KeyScored):
    def block_scores(self, kv_cache, batch, layer):
        return super().block_scores(kv_cache, batch, layer)[:, :1]


class KeyScoredBlockedOnly(KeyScored):
    """Claims packed but reads the cache as if blocked."""

    def block_scores(self, kv_cache, batch, layer):
        n, h, b, c = kv_cache.shape
        keys = kv_cache.reshape(n, h, 2, b, c // 2)[:, :, 0]
        return keys[batch.block_table.long().clamp(min=0)].float().abs().mean(dim=(2, 3, 4))


def test_block_scores_are_checked_for_shape_and_every_claimed_layout():
    assert "keep the kvcompress contract" in c.check_contract(target(Kind.KVCOMPRESS, KeyScored, lossless=False))
    with pytest.raises(c.ConformanceError, match=r"block_scores\(\) returned .*\[num_seqs, max_blocks\]"):
        c.check_contract(target(Kind.KVCOMPRESS, KeyScoredWrongShape, lossless=False))
    with pytest.raises(c.ConformanceError, match=r"block_scores\(\) differs .* from the blocked cache's"):
        c.check_contract(target(Kind.KVCOMPRESS, KeyScoredBlockedOnly, lossless=False))
