"""SWIFT self-speculation (`swift`) in vLLM's CPU engine on the bundled tiny Llama: the draft
model is vLLM's own loaded model with sub-layers skipped (its linear layers called in place,
no weights copied), greedy outputs are identical to plain vLLM's, drafts are verified and
accepted (the plugin's counts agree with vLLM's spec-decode counters), and per-request draft
caches are released when vLLM reports the requests finished. One plain and one graft engine."""
from __future__ import annotations

import pytest

from vllm_graft.hooks import Kind

from .test_adapters_speculative_quant import PROMPTS, _events, _greedy, _tokens, engine

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32
PROMPTS = PROMPTS + [
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv = [1, 2,",
]
# 2 of the model's 8 sub-layers skipped; draft every step (the tiny model's top-1
# probabilities are low, so a confidence threshold would stop most drafts)
SWIFT = {"plugin": "swift", "params": {"num_speculative_tokens": 3, "skip_ratio": 0.25,
                                       "confidence": 0.0, "search_budget": 6}}


def _counter(llm, name):
    return sum(float(m.value) for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def test_swift_is_lossless_and_its_drafts_are_accepted():
    from vllm_graft.integration.runtime import RUNTIME

    with engine(None) as llm:
        plain = _tokens(llm.generate(PROMPTS, _greedy(NEW_TOKENS), use_tqdm=False))
    with engine({"speculative": SWIFT}, disable_log_stats=False) as llm:
        spec = llm.llm_engine.vllm_config.speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("custom_class", 3)
        plugin = RUNTIME.instances[(Kind.SPECULATIVE, "swift")]
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        layer = model.model.layers[1]
        # the draft calls the target's own layers: nothing of the model copied
        w = plugin.decoder.w
        # the norm's own weight, applied by vLLM's C++ rms_norm kernel
        assert w.layers[1].input_norm.weight.data_ptr() == layer.input_layernorm.weight.data_ptr()
        assert w.layers[1].qkv.__defaults__[0] is layer.self_attn.qkv_proj
        assert w.rope is layer.self_attn.rotary_emb and w.lm_head == model.compute_logits
        before = {k: _counter(llm, f"vllm:spec_decode_num_{k}") for k in ("draft_tokens", "accepted_tokens")}
        got = _tokens(llm.generate(PROMPTS, _greedy(NEW_TOKENS), use_tqdm=False))
        after = {k: _counter(llm, f"vllm:spec_decode_num_{k}") for k in before}
        events = dict(_events(Kind.SPECULATIVE, "swift"))
        described = plugin.describe()
        llm.generate(PROMPTS[:1], _greedy(1), use_tqdm=False)  # delivers the finishes
        live = plugin.describe()["live_requests"]
    print(events, described)
    assert got == plain, "swift: greedy output differs from plain vLLM"
    assert 0 < events["accepted"] <= events["verified"] <= events["drafted"]
    assert after["draft_tokens"] - before["draft_tokens"] == events["verified"]
    assert after["accepted_tokens"] - before["accepted_tokens"] == events["accepted"]
    assert events["propose"] < sum(len(t) for t in got)  # accepted drafts saved target steps
    assert described["accepted"] == events["accepted"]
    assert described["target"]["layers"] == 4 and described["target"]["source"].startswith("vLLM LlamaForCausalLM")
    assert len(described["search"]["skipped"]) == 2 and set(described["search"]["skipped"]) <= {2, 3, 4, 5}
    assert live <= 1  # all released but the one request of the last generate
