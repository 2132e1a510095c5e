"""``kvzip`` in vLLM's CPU engine (in-process) on the bundled tiny llama:

* the pair scores its scoring passes compute inside the engine (the model's own forward over the
  reconstruction tokens, attending over the request's paged context KV plus the pass's local
  K/V) equal those of transformers' eager attention over the same sequences (context, then the
  pass), chunked (several passes, max over them) and unchunked (one pass);
* with a budget of the whole context nothing is dropped and the greedy tokens are plain vLLM's
  (the passes write nothing into the cache); with a small budget blocks are freed and every
  request finishes, its agreement with plain vLLM reported.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.integration.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.e2e

LLAMA = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
BLOCK = 32
ENGINE = {"dtype": "float32", "max_model_len": 1024, "block_size": BLOCK, "enforce_eager": True}
CONTEXT = 200  # tokens of the scored prompt
NEW = 32


def _prompts(n=2, tokens=640):
    from vllm_graft.kit.conformance.engine import long_prompts

    return [p[:tokens] for p in long_prompts(LLAMA)[:n]]


def _generate(params, prompts, new_tokens, pairs=False):
    """Greedy tokens (and, with ``pairs``, the engine's pair scores per prompt) and the plugin's
    events; ``params`` None: plain vLLM."""
    from vllm import SamplingParams

    from vllm_graft.integration.adapters.kvcompress import state
    from vllm_graft.integration.runtime import RUNTIME
    from vllm_graft.launch.engine import in_process_engine

    base = {"model": str(LLAMA), "engine": ENGINE}
    dep = base if params is None else {**base, "kvcompress": {"plugin": "kvzip", "params": params}}
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with in_process_engine(plan_for(dep), graft=params is not None, seed=0) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        got = {}
        if pairs:
            recent = state.get_active().scored.recent_pairs  # by the worker's request ids, in order
            assert len(recent) == len(prompts)
            got = [x.clone() for x in recent.values()]
        events = {e: n for (_, name, e), n in RUNTIME.events.items() if name == "kvzip"}
    return tokens, got, events


def _transformers_pairs(context, passes):
    """Per layer, KV head and context token: the largest attention probability an observed query
    of a pass pays it, over the query heads of the KV head's group and over the passes, from
    transformers' eager attention over ``context + pass`` (the dense reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.float32, attn_implementation="eager")
    cfg = model.config
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    N = len(context)
    best = None
    with torch.no_grad():
        for p in passes:
            ids = torch.tensor([list(context) + list(p.token_ids)])
            att = model(ids, output_attentions=True).attentions  # per layer [1, H, T, T]
            per = torch.stack([a[0, :, N + p.observe_from :, :N] for a in att])  # [L, H, n_obs, N]
            L, H = per.shape[:2]
            per = per.view(L, H // G, G, -1, N).amax(dim=(2, 3))  # [L, H_kv, N]
            best = per if best is None else torch.maximum(best, per)
    return best


def _passes(params, context):
    from transformers import AutoTokenizer

    from vllm_graft.plugins.kvcompress.kvzip import KVzipParams
    from vllm_graft.plugins.kvcompress.kvzip.reference import KVzip

    tok = AutoTokenizer.from_pretrained(LLAMA)
    kv = KVzip(KVzipParams(**params))
    return kv.scoring_passes(context, lambda text: tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("chunk", [96, 512])
def test_engine_pair_scores_equal_transformers_attention(chunk):
    params = {"budget_blocks": 4, "chunk_tokens": chunk}
    (context,) = _prompts(1, CONTEXT)
    passes = _passes(params, context)
    assert len(passes) == (3 if chunk == 96 else 1)
    _, (pair,), events = _generate(params, [context], 2, pairs=True)
    assert events["scoring_passes"] == 1 and events["pass_layers"] == 4 * len(passes)
    want = _transformers_pairs(context, passes)
    assert pair.shape == want.shape == (4, 2, CONTEXT)
    torch.testing.assert_close(pair, want, atol=2e-5, rtol=1e-4)


def test_chunked_passes_score_otherwise_than_one_pass():
    """The chunking is the paper's approximation, not a different way to compute the same scores:
    the queries differ (each chunk repeated after the prompt alone). Both equal transformers above;
    here they differ from each other while ranking the context's blocks alike for the most part."""
    (context,) = _prompts(1, CONTEXT)
    chunked = _transformers_pairs(context, _passes({"chunk_tokens": 96}, context))
    whole = _transformers_pairs(context, _passes({"chunk_tokens": 512}, context))
    assert not torch.allclose(chunked, whole, atol=1e-3)
    from vllm_graft.plugins.kvcompress.kvzip.reference import block_scores_from_pairs

    a, b = block_scores_from_pairs(chunked, BLOCK), block_scores_from_pairs(whole, BLOCK)
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.5


@pytest.fixture(scope="module")
def plain():
    return _generate(None, _prompts(), NEW)[0]


def test_a_budget_of_the_whole_context_gives_plain_tokens(plain):
    tokens, _, events = _generate({"budget_blocks": 640 // BLOCK, "chunk_tokens": 256}, _prompts(), NEW)
    assert events["scoring_passes"] == 2 and events.get("blocks_freed", 0) == 0
    assert tokens == plain


def test_a_small_budget_frees_blocks(plain):
    tokens, _, events = _generate({"budget_blocks": 6, "chunk_tokens": 256}, _prompts(), NEW)
    assert events["scoring_passes"] == 2
    # 20 prompt blocks each, 6 kept: 14 freed per request
    assert events["blocks_freed"] == 2 * 14 and events["blocks_skipped"] > 0
    assert all(len(t) == NEW for t in tokens)
    agree = sum(x == y for a, b in zip(plain, tokens) for x, y in zip(a, b))
    print(f"kvzip budget 6/20 blocks: {agree}/{sum(map(len, plain))} greedy tokens agree with plain vLLM")
