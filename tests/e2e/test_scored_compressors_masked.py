"""Scored compressors end to end against an independent reference. In vLLM's CPU engine the
worker scores and decides, the scheduler frees, attention leaves the freed blocks out; here
transformers replays the same steps (prefill chunks of 128 tokens, then one decode step per
token), scores blocks from its own attention probabilities (summed over heads and layers),
asks the plugin's planner which to keep after each step, and masks later steps' attention to
them. vLLM's log-probabilities must equal the masked reference's, not plain attention's:

* SnapKV: the observation window's mass, one decision once the prompt is in; a continuation
  decoded after the prompt (teacher-forced);
* H2O: mass accumulated over every query, a decision after every step, prefill chunks
  included (so its prompt log-probabilities are checked too)."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from vllm_graft.integration.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama-recall"
B, P, G, WINDOW = 32, 536, 48, 32  # block, prompt and continuation tokens, observation window
SNAPKV = {"budget_blocks": 6, "sink_blocks": 1, "window_tokens": WINDOW, "recent_blocks": 2}


def _replay(ids: list[int], plugin: str, params: dict, chunk: int = 128) -> tuple[list[float], list[list[int]]]:
    """Log-probs of ``ids[1:]`` in transformers replaying vLLM's steps with ``plugin``'s
    decisions (prefill in ``chunk``-token steps up to P, then one token per step), and the
    blocks kept after each step."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_graft.hooks import BlockView, get_registry

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    reg = get_registry().get("kvcompress", plugin).registration
    comp = reg.load()(reg.params(**params))
    n = len(ids) - 1  # the last token is only a target
    bounds = list(range(0, P, chunk)) + list(range(P, n)) + [n]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    dropped: set[int] = set()
    scores: list[float] = []
    decisions = []
    for s0, s1 in zip(bounds, bounds[1:]):
        for b in dropped:  # this step's queries do not read blocks dropped after earlier steps
            allowed[s0:s1, b * B:(b + 1) * B] = False
        mask = torch.zeros(1, 1, s1, s1).masked_fill_(~allowed[:s1, :s1], torch.finfo(torch.float32).min)
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids[:s1]]), attention_mask=mask, output_attentions=True).attentions
        nb = -(-s1 // B)
        lo, hi = comp.score_positions(P)  # the queries whose attention counts
        lo, hi = max(s0, lo), min(s1, hi)
        per_key = sum(a[0, :, lo:hi, :].sum((0, 1)) for a in att) if hi > lo else torch.zeros(s1)
        mass = torch.nn.functional.pad(per_key, (0, nb * B - s1)).view(nb, B).sum(-1).tolist()
        scores = [x + m for x, m in zip(scores + [0.0] * (nb - len(scores)), mass)]
        shown = tuple(float("-inf") if i in dropped else x for i, x in enumerate(scores))
        kept = comp.keep(BlockView(s1, B, P, shown))
        dropped |= set(range(nb)) - set(kept)
        decisions.append(kept)
    mask = torch.zeros(1, 1, n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:n]]), attention_mask=mask).logits[0].float()
    logp = torch.log_softmax(logits, -1)[torch.arange(n), torch.tensor(ids[1:])].tolist()
    return logp, decisions


def _vllm(ids: list[int], kvcompress: dict | None) -> tuple[list[float], list[float]]:
    """(prompt log-probs of ids[1:P], forced log-probs of ids[P:]) in vLLM."""
    from vllm import LLM

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.forcing import ForceTokens, forced_logprobs, forced_params

    data = {"model": str(MODEL), "engine": {"dtype": "float32", "max_model_len": 1024, "block_size": B,
                                            "enforce_eager": True, "max_num_batched_tokens": 128,
                                            "enable_prefix_caching": False}}
    if kvcompress:
        data["kvcompress"] = kvcompress
    llm = LLM(**launch.llm_kwargs(plan_for(data), graft=bool(kvcompress)), seed=0,
              logits_processors=[ForceTokens])
    try:
        rest = ids[P:]
        out = llm.generate([{"prompt_token_ids": ids[:P]}], forced_params(rest, prompt_logprobs=0), use_tqdm=False)[0]
        prompt = [lp[t].logprob for t, lp in zip(ids[1:P], out.prompt_logprobs[1:])]
        return prompt, forced_logprobs(out, rest)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_snapkv_in_vllm_equals_attention_masked_to_the_blocks_it_keeps():
    from vllm_graft.tools.workloads import Tokenizer, stdlib_texts

    (ids, _), = stdlib_texts(Tokenizer.from_model(str(MODEL)), num=1, tokens=P + G, seed=1)
    ids = list(ids)
    ref, decisions = _replay(ids, "snapkv", SNAPKV)
    kept = [b for b in decisions[-1] if b * B < P]
    assert len(kept) == SNAPKV["budget_blocks"] < -(-P // B) and {0, 15, 16} <= set(kept)  # sink, recent 2
    assert all(d == list(range(len(d))) for d in decisions[:len(range(0, P, 128)) - 1])  # nothing mid-prefill
    prompt, forced = _vllm(ids, {"plugin": "snapkv", "params": SNAPKV})
    plain_prompt, plain_forced = _vllm(ids, None)
    worst = max(abs(a - b) for a, b in zip(prompt + forced, ref))
    off_plain = max(abs(a - b) for a, b in zip(forced, plain_forced))
    print(f"snapkv: kept prompt blocks {kept}; max |vLLM - masked replay| {worst:.2e} over {len(ref)} tokens, "
          f"|vLLM - plain| {off_plain:.2e} (decoded tokens)")
    assert worst < 1e-3
    assert off_plain > 0.05  # the blocks SnapKV dropped mattered: this is not plain attention
    # the prompt is prefilled with full attention; SnapKV acts once it is in
    assert max(abs(a - b) for a, b in zip(prompt, plain_prompt)) < 1e-3


@pytest.mark.parametrize("score", ["sum", pytest.param("mean", marks=pytest.mark.full)])
def test_h2o_in_vllm_equals_attention_masked_to_the_blocks_it_keeps_step_by_step(score):
    from vllm_graft.tools.workloads import Tokenizer, stdlib_texts

    (ids, _), = stdlib_texts(Tokenizer.from_model(str(MODEL)), num=1, tokens=P + G, seed=2)
    ids = list(ids)
    params = {"budget_blocks": 6, "sink_blocks": 1, "recent_blocks": 2, "score": score}
    ref, decisions = _replay(ids, "h2o", params)
    prompt, forced = _vllm(ids, {"plugin": "h2o", "params": params})
    got = prompt + forced
    worst = max(abs(a - b) for a, b in zip(got, ref))
    plain_prompt, plain_forced = _vllm(ids, None)
    off_plain = max(abs(a - b) for a, b in zip(got, plain_prompt + plain_forced))
    heavy = sorted({b for kept in decisions for b in kept if 0 < b < P // B - 3})
    print(f"h2o score {score}: kept after the prompt {decisions[len(range(0, P, 128)) - 1]}, heavy blocks "
          f"ever kept {heavy}; max |vLLM - masked replay| {worst:.2e} over {len(got)} tokens, "
          f"|vLLM - plain| {off_plain:.2e}")
    assert worst < 1e-3
    assert off_plain > 0.05 and heavy  # blocks were dropped, and some kept for their score


def test_kv_headroom_replay_gives_vllm_decoded_perplexity_for_streaming_and_snapkv():
    """`vllm-graft kv-headroom` rebuilds each policy's attention from the plugin's planner;
    its decoded-tail perplexity must be vLLM's for the same plugin and parameters."""
    import math

    from vllm_graft.tools.kvcompress.kv_headroom import study
    from vllm_graft.tools.workloads import Tokenizer, stdlib_texts

    (ids, _), = stdlib_texts(Tokenizer.from_model(str(MODEL)), num=1, tokens=P + G, seed=3)
    budget = -(-(P + G) // B) // 3  # kv-headroom's budget at --fractions 3
    res = study(str(MODEL), [(ids, "")], block=B, chunk=128, gen=G, fractions=(3,), arms=["streaming", "snapkv"])
    rows = {r["arm"]: r["gen_ppl"] for r in res["rows"]}
    params = {"streaming": {"budget_blocks": budget, "sink_blocks": 1},
              "snapkv": {"budget_blocks": budget, "sink_blocks": 1, "window_tokens": 32, "recent_blocks": 0}}
    for plugin, p in params.items():
        _, forced = _vllm(list(ids), {"plugin": plugin, "params": p})
        in_vllm = math.exp(-sum(forced) / len(forced))
        print(f"{plugin} budget {budget}: gen ppl kv-headroom {rows[f'{plugin} 1/3']:.5f}, vLLM {in_vllm:.5f}")
        assert rows[f"{plugin} 1/3"] == pytest.approx(in_vllm, rel=1e-4)
    assert abs(rows["streaming 1/3"] / rows["plain"] - 1) > 1e-3  # the budget bites
