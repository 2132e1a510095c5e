"""SWIFT self-speculation (plugins/speculative/swift) without vLLM: the layer-skipped decoder
against transformers' Llama on the bundled model, the per-request draft cache and its rollback,
the layer-set search, the proposer's contract, and the parameter/deployment checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_graft.hooks import TargetLayer, TargetWeights
from vllm_graft.plugins.speculative.swift import SwiftParams
from vllm_graft.plugins.speculative.swift.policy import LayerSkipSearch, skippable_sublayers, spread
from vllm_graft.plugins.speculative.swift.reference import DraftCache, SkipDecoder, Swift

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama"
CODE = ("import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n"
        "        argv = sys.argv[1:]\n    for arg in argv:\n        print(arg)\n")


def weights_from_checkpoint(folder: Path = MODEL, dtype=torch.float32, fused=True) -> TargetWeights:
    """TargetWeights from a transformers Llama checkpoint (fused q/k/v and gate/up like vLLM,
    as tensors; ``fused=False``: the same as callables over the separate projections)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    sd = {k: v.to(dtype) for k, v in load_file(str(folder / "model.safetensors")).items()}
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = (sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        g, u = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
        if fused:
            qkv, gate_up = torch.cat([q, k, v]), torch.cat([g, u])
        else:
            def qkv(x, q=q, k=k, v=v):
                return torch.cat([x @ q.T, x @ k.T, x @ v.T], dim=-1)

            def gate_up(x, g=g, u=u):
                return torch.cat([x @ g.T, x @ u.T], dim=-1)
        layers.append(TargetLayer(qkv=qkv, o=sd[p + "self_attn.o_proj.weight"], gate_up=gate_up,
                                  down=sd[p + "mlp.down_proj.weight"],
                                  input_norm=sd[p + "input_layernorm.weight"],
                                  post_attention_norm=sd[p + "post_attention_layernorm.weight"]))
    return TargetWeights(
        embed=sd["model.embed_tokens.weight"], layers=layers, final_norm=sd["model.norm.weight"],
        lm_head=sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"],
        rope_theta=cfg["rope_parameters"]["rope_theta"], source=folder.name)


def random_weights(layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, inter=48, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s

    return TargetWeights(
        embed=r(vocab, hidden, s=1.0),
        layers=[TargetLayer(qkv=r((heads + 2 * kv_heads) * head_dim, hidden), o=r(hidden, heads * head_dim),
                            gate_up=r(2 * inter, hidden), down=r(hidden, inter),
                            input_norm=1 + r(hidden, s=0.1), post_attention_norm=1 + r(hidden, s=0.1))
                for _ in range(layers)],
        final_norm=1 + r(hidden, s=0.1), lm_head=r(vocab, hidden, s=1.0), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, vocab_size=vocab)


@pytest.fixture(scope="module")
def tiny():
    return weights_from_checkpoint()


@pytest.fixture(scope="module")
def prompt():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODEL / "tokenizer.json")).encode(CODE).ids


# ------------------------------------------------------------------------ the decoder
def test_skip_nothing_is_the_full_model(tiny, prompt):
    """Nothing skipped = transformers' LlamaForCausalLM on the same checkpoint (fp32)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    got = SkipDecoder(tiny).forward(prompt)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_projections_as_callables_match_tensors(tiny, prompt):
    """A projection given as a callable (how the vLLM adapter passes the target's own linear
    layers) computes what the same weights given as a tensor do."""
    a = SkipDecoder(tiny).forward(prompt, frozenset({3, 4}))
    b = SkipDecoder(weights_from_checkpoint(fused=False)).forward(prompt, frozenset({3, 4}))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_skipping_changes_the_output_and_only_the_skipped_sublayers_run(tiny, prompt):
    d = SkipDecoder(tiny)
    full = d.forward(prompt)
    assert not torch.allclose(d.forward(prompt, frozenset({2})), full)  # attention of layer 1
    assert not torch.allclose(d.forward(prompt, frozenset({3})), full)  # its MLP
    cache = DraftCache(frozenset({2, 5}))
    d.forward(prompt, frozenset({2, 5}), cache)
    assert sorted(cache.k) == [0, 2, 3]  # attention of layer 1 skipped: no keys kept for it


@pytest.mark.parametrize("skip", [frozenset(), frozenset({2, 3}), frozenset({3, 4, 5})])
def test_cached_decoding_equals_one_forward(tiny, prompt, skip):
    """Prompt, then tokens one by one and in chunks through the cache = one uncached forward."""
    d = SkipDecoder(tiny)
    want = d.forward(prompt, skip)
    cache = DraftCache(skip)
    got = [d.forward(prompt[:10], skip, cache)]
    got += [d.forward([t], skip, cache) for t in prompt[10:15]]
    got.append(d.forward(prompt[15:], skip, cache))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    assert cache.tokens == prompt


def test_rollback_discards_rejected_drafts(tiny, prompt):
    """Keys/values of rejected drafts are cut; feeding the accepted tokens after a rollback
    gives what a cache that never saw the drafts gives."""
    d = SkipDecoder(tiny)
    skip = frozenset({3})
    cache = DraftCache(skip)
    d.forward(prompt[:20], skip, cache)
    d.forward([7, 8, 9], skip, cache)  # drafts; the target rejects all but the first
    cache.truncate(21)
    after = d.forward(prompt[21:24], skip, cache)
    clean = DraftCache(skip)
    d.forward(prompt[:20] + [7], skip, clean)
    want = d.forward(prompt[21:24], skip, clean)
    torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)
    assert cache.tokens == prompt[:20] + [7] + prompt[21:24]


def test_rope_table_from_the_target_is_used():
    w = random_weights()
    d = SkipDecoder(w)
    toks = list(range(12))
    base = d.forward(toks)
    n = 64
    inv = 1.0 / (w.rope_theta ** (torch.arange(0, w.head_dim, 2, dtype=torch.float64) / w.head_dim))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    same = SkipDecoder(TargetWeights(**{**vars(w), "rope_cos_sin": torch.cat([f.cos(), f.sin()], -1).float()}))
    torch.testing.assert_close(same.forward(toks), base, atol=1e-5, rtol=1e-5)
    scaled = SkipDecoder(TargetWeights(**{**vars(w), "rope_cos_sin": torch.cat([(f / 4).cos(), (f / 4).sin()], -1).float()}))
    assert not torch.allclose(scaled.forward(toks), base)
    with pytest.raises(ValueError, match="RoPE table"):
        SkipDecoder(TargetWeights(**{**vars(w), "rope_cos_sin": torch.zeros(4, w.head_dim)})).forward(toks)


# ------------------------------------------------------------------------ the search
def test_skippable_sublayers_and_spread():
    assert skippable_sublayers(4) == [2, 3, 4, 5]
    assert skippable_sublayers(2, keep_ends=False) == [0, 1, 2, 3]
    assert skippable_sublayers(2) == []
    assert spread([2, 3, 4, 5], 2) == frozenset({5, 3})
    assert len(spread(list(range(60)), 30)) == 30


def test_search_finds_the_best_set_and_respects_the_budget():
    """A score with one best set: exhaustive when the budget covers the space, within budget."""
    target = frozenset({4, 9, 12})
    calls = []

    def score(s):
        calls.append(s)
        return len(s & target) - 0.01 * sum(s)

    search = LayerSkipSearch(list(range(2, 14)), 3, budget=10_000, seed=1)
    best, _ = search.run(score)
    assert best == target
    assert len(calls) == len(set(calls)) == search.evaluated  # no set scored twice
    small = LayerSkipSearch(list(range(2, 14)), 3, budget=7, seed=1)
    found = small.run(score)
    assert small.evaluated == 7
    assert LayerSkipSearch(list(range(2, 14)), 3, budget=7, seed=1).run(score) == found  # seeded
    with pytest.raises(ValueError, match="n_skip"):
        LayerSkipSearch([2, 3], 3, budget=4)


def test_search_on_the_model_finds_the_best_set(tiny, prompt):
    """On the bundled model, with a budget that covers all 6 ways to skip 2 of the 4 skippable
    sub-layers, the search picks the set whose greedy tokens match the full model's most often."""
    from itertools import combinations

    s = Swift(SwiftParams(skip_ratio=0.25, search_budget=50))
    s.attach_target(tiny)
    s.search(prompt)
    info = s.describe()["search"]
    assert info["candidates"] == 6 and info["tokens_scored"] == len(prompt)
    d = s.decoder
    full = d.forward(prompt).argmax(-1)
    rates = {frozenset(k): (d.forward(prompt, frozenset(k)).argmax(-1) == full).float().mean().item()
             for k in combinations([2, 3, 4, 5], 2)}
    assert info["match"] == pytest.approx(max(rates.values()), abs=1e-4)
    assert rates[frozenset(info["skipped"])] == max(rates.values()) > min(rates.values())
    assert s.skip == frozenset(info["skipped"])


# ------------------------------------------------------------------------ the proposer
def greedy(d: SkipDecoder, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(int(d.forward(out)[-1].argmax()))
    return out[len(tokens):]


def test_proposer_drafts_the_skipped_models_greedy_tokens_and_rolls_back(tiny, prompt):
    """Simulated verification against the full model: each step's drafts are the skipped model's
    greedy continuation of the request's tokens, whatever was accepted before."""
    s = Swift(SwiftParams(skip_layers=[3], confidence=0.0, num_speculative_tokens=3))
    s.attach_target(tiny)
    d = s.decoder
    tokens = list(prompt[:30])
    accepted = 0
    for _ in range(6):
        drafts = s.propose("r", tokens, 3)
        assert drafts == greedy_skip(d, tokens, 3, frozenset({3}))
        truth = greedy(d, tokens, len(drafts) + 1)
        a = 0
        while a < len(drafts) and drafts[a] == truth[a]:
            a += 1
        s.accepted("r", a, len(drafts))
        accepted += a
        tokens += truth[:a + 1]
        assert len(s.caches["r"]) <= len(tokens) + 3
    info = s.describe()
    assert info["accepted"] == accepted > 0
    assert info["live_requests"] == 1
    s.finish("r")
    assert s.describe()["live_requests"] == 0 and not s.caches


def greedy_skip(d: SkipDecoder, tokens: list[int], n: int, skip: frozenset[int]) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(int(d.forward(out, skip)[-1].argmax()))
    return out[len(tokens):]


def test_confidence_stops_drafting(tiny, prompt):
    s = Swift(SwiftParams(skip_layers=[3], confidence=0.0, num_speculative_tokens=4))
    s.attach_target(tiny)
    assert len(s.propose("a", prompt, 4)) == 4
    s2 = Swift(SwiftParams(skip_layers=[3], confidence=0.999, num_speculative_tokens=4))
    s2.attach_target(tiny)
    assert len(s2.propose("a", prompt, 4)) < 4
    assert s2.describe()["stopped_low_confidence"] == 1
    assert len(s.propose("b", prompt, 2)) == 2  # max_tokens bounds it


def test_no_target_drafts_nothing_and_short_contexts_wait_for_the_search(tiny):
    s = Swift(SwiftParams())
    assert s.propose("r", [1, 2, 3], 4) == [] and s.describe()["no_target"] == 1
    s.attach_target(tiny)
    assert s.propose("r", [1, 2, 3], 4) == [] and "search" not in s.describe()
    s.propose("r", list(range(5, 40)), 4)
    assert s.describe()["search"]["tokens_scored"] == 35


def test_attach_refuses_what_it_cannot_skip():
    with pytest.raises(ValueError, match="lower skip_ratio to at most 0.50"):
        Swift(SwiftParams(skip_ratio=0.6)).attach_target(random_weights(layers=4))
    with pytest.raises(ValueError, match="skip_layers \\[9\\]"):
        Swift(SwiftParams(skip_layers=[9])).attach_target(random_weights(layers=4))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        SkipDecoder(TargetWeights(**{**vars(random_weights()), "num_kv_heads": 3}))


# ------------------------------------------------------------------------ parameters / deployment
def test_params_refuse_bad_values():
    from pydantic import ValidationError

    for bad in ({"skip_ratio": 0}, {"skip_ratio": 1.0}, {"confidence": 1.0}, {"skip_layers": []},
                {"skip_layers": [2, 2]}, {"search_min_tokens": 300, "search_tokens": 256},
                {"unknown": 1}):
        with pytest.raises(ValidationError):
            SwiftParams(**bad)


def test_deployment_refusals(tmp_path):
    from vllm_graft.hooks import DeploymentError, Environment, get_registry, validate

    env = Environment(platform="cpu", vllm_version="0.32.0")
    reg = get_registry()
    ok = validate({"model": str(MODEL), "speculative": {"plugin": "swift"}}, reg, env)
    assert ok.by_kind("speculative")[0].name == "swift"
    cases = [
        ({"engine": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
        ({"engine": {"quantization": "fp8"}}, "quantization='fp8'"),
        ({"speculative": {"plugin": "swift", "params": {"skip_ratio": 0.9}}}, "lower skip_ratio"),
        ({"speculative": {"plugin": "swift", "params": {"skip_layers": [8]}}}, "skip_layers \\[8\\]"),
        ({"model": str(ROOT / "models" / "graft-tiny-mixtral")}, "MixtralForCausalLM"),
    ]
    for change, match in cases:
        data = {"model": str(MODEL), "speculative": {"plugin": "swift"}, **change}
        with pytest.raises(DeploymentError, match=match):
            validate(data, reg, env)
    q = tmp_path / "q"
    q.mkdir()
    cfg = json.loads((MODEL / "config.json").read_text())
    (q / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(DeploymentError, match="quantized checkpoint \\(awq\\)"):
        validate({"model": str(q), "speculative": {"plugin": "swift"}}, reg, env)


# ------------------------------------------------------------------------ the adapter's description
class UnquantizedLinearMethod:  # named as vLLM's: what the adapter accepts
    pass


class Fp8LinearMethod:
    pass


class FakeLinear(torch.nn.Module):
    """Stands in for vLLM's linear layers: ``layer(x) -> (x @ W.T, None)``."""

    def __init__(self, weight, method=UnquantizedLinearMethod):
        super().__init__()
        self.w, self.quant_method, self.bias = weight, method(), None

    def forward(self, x):
        return x @ self.w.T, None


class _Apply:
    def apply(self, layer, x, bias=None):  # vLLM's LinearMethodBase.apply(layer, x, bias)
        return x @ layer.w.T


UnquantizedLinearMethod.apply = _Apply.apply


class FakeNorm:
    """Stands in for vLLM's RMSNorm layer: called with ``x``."""

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, x):
        from vllm_graft.plugins.speculative.swift.reference import rms_norm

        return rms_norm(x, self.weight, 1e-5)


class FakeRope:
    """Stands in for vLLM's rotary embedding: ``(positions, q, k) -> (q, k)`` in place, NeoX."""

    is_neox_style = True

    def __init__(self, table, head_dim):
        self.cos_sin_cache, self.rotary_dim, self.head_dim = table, head_dim, head_dim

    def __call__(self, positions, q, k):
        half = self.rotary_dim // 2
        cos, sin = self.cos_sin_cache[positions, :half][:, None], self.cos_sin_cache[positions, half:][:, None]
        for x in (q, k):
            v = x.view(x.shape[0], -1, self.head_dim)
            a, b = v[..., :half].clone(), v[..., half:].clone()
            v[..., :half], v[..., half:] = a * cos - b * sin, b * cos + a * sin
        return q, k


def fake_vllm_llama(w: TargetWeights, name="LlamaForCausalLM", quantized=False):
    """An object shaped like vLLM's LlamaForCausalLM (the attributes the adapter reads)."""
    from types import SimpleNamespace as NS

    n = 64
    inv = 1.0 / (w.rope_theta ** (torch.arange(0, w.head_dim, 2, dtype=torch.float64) / w.head_dim))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    rope = FakeRope(torch.cat([f.cos(), f.sin()], -1).float(), w.head_dim)
    layers = [NS(self_attn=NS(qkv_proj=FakeLinear(l.qkv, Fp8LinearMethod if quantized else UnquantizedLinearMethod),
                              o_proj=FakeLinear(l.o), attn=NS(sliding_window=None), rotary_emb=rope,
                              num_heads=w.num_heads, total_num_heads=w.num_heads,
                              num_kv_heads=w.num_kv_heads, head_dim=w.head_dim),
                 mlp=NS(gate_up_proj=FakeLinear(l.gate_up), down_proj=FakeLinear(l.down)),
                 input_layernorm=FakeNorm(l.input_norm), post_attention_layernorm=FakeNorm(l.post_attention_norm))
              for l in w.layers]
    cls = type(name, (), {})
    model = cls()
    model.model = NS(layers=layers, norm=FakeNorm(w.final_norm))
    model.embed_input_ids = lambda ids: w.embed[ids]
    model.compute_logits = lambda h: h @ w.lm_head.T
    return model


def vllm_config(tp=1, pp=1, vocab=64):
    from types import SimpleNamespace as NS

    return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
              model_config=NS(hf_config=NS(rms_norm_eps=1e-5, vocab_size=vocab), model="fake"))


def test_adapter_describes_a_vllm_llama_and_shares_its_tensors():
    from vllm_graft.integration.adapters.speculative.target import target_weights

    w = random_weights()
    model = fake_vllm_llama(w)
    got = target_weights(model, vllm_config())
    layer = model.model.layers[2]
    # the norms' own weights, shared (one F.rms_norm op each), the linear layers called
    for norm, theirs in ((got.layers[2].input_norm, layer.input_layernorm), (got.final_norm, model.model.norm)):
        ours = getattr(norm, "weight", norm)  # the weight, or vLLM's C++ kernel over it where vLLM is loaded
        assert ours.data_ptr() == theirs.weight.data_ptr()
    assert got.layers[2].qkv.__defaults__[0] is layer.self_attn.qkv_proj
    assert got.rope is layer.self_attn.rotary_emb
    assert got.rope_cos_sin is layer.self_attn.rotary_emb.cos_sin_cache
    toks = list(range(20))
    for skip in (frozenset(), frozenset({3, 4})):
        torch.testing.assert_close(SkipDecoder(got).forward(toks, skip), SkipDecoder(w).forward(toks, skip),
                                   atol=1e-5, rtol=1e-5)


def test_adapter_calls_a_norm_it_cannot_apply_as_a_weight():
    """A norm with another epsilon than the model's stays the target's callable layer."""
    from vllm_graft.integration.adapters.speculative.target import target_weights

    w = random_weights()
    model = fake_vllm_llama(w)
    odd = model.model.layers[1].input_layernorm
    odd.variance_epsilon = 1e-3
    got = target_weights(model, vllm_config())
    assert got.layers[1].input_norm is odd
    assert got.layers[0].input_norm is not model.model.layers[0].input_layernorm
    toks = list(range(20))
    torch.testing.assert_close(SkipDecoder(got).forward(toks), SkipDecoder(w).forward(toks), atol=1e-5, rtol=1e-5)


def test_adapter_norm_through_vllms_kernel_is_the_norm():
    """Where vLLM's C++ kernels are loaded, a norm is applied by its ``rms_norm`` op: the same
    values as the plain RMSNorm (fp32 and bf16)."""
    pytest.importorskip("vllm._custom_ops")
    from vllm_graft.integration.adapters.speculative.target import _FusedRMSNorm
    from vllm_graft.plugins.speculative.swift.reference import rms_norm

    op = getattr(torch.ops._C, "rms_norm", None)
    if op is None:
        pytest.skip("vLLM's rms_norm kernel is not loaded")
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(3, 256, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
        torch.testing.assert_close(_FusedRMSNorm(w, 1e-5, op)(x), rms_norm(x, w, 1e-5), atol=tol, rtol=tol)


def test_adapter_refuses_what_it_cannot_describe():
    from vllm_graft.integration.adapters.speculative.target import TargetUnsupported, target_weights

    w = random_weights()
    with pytest.raises(TargetUnsupported, match="MixtralForCausalLM.*choose another speculative plugin"):
        target_weights(fake_vllm_llama(w, name="MixtralForCausalLM"), vllm_config())
    with pytest.raises(TargetUnsupported, match="tensor_parallel_size=2.*run on one rank"):
        target_weights(fake_vllm_llama(w), vllm_config(tp=2))
    with pytest.raises(TargetUnsupported, match="qkv_proj is quantized \\(Fp8LinearMethod\\).*unquantized"):
        target_weights(fake_vllm_llama(w, quantized=True), vllm_config())


def test_adaptive_forwards_the_target_to_a_wrapped_swift(tiny, prompt):
    from vllm_graft.hooks import get_registry

    entry = get_registry().get("speculative", "adaptive")
    adaptive = entry.registration.load()(entry.registration.params(
        proposer="swift", params={"skip_layers": [3], "confidence": 0.0}))
    assert adaptive.needs_target_weights
    adaptive.attach_target(tiny)
    assert adaptive.inner.decoder is not None
    assert len(adaptive.inner.propose("r", prompt, 3)) == 3
