"""``adakv`` (per-KV-head budgets) end to end in vLLM's CPU engine against an independent
reference. transformers replays vLLM's steps (prefill chunks of 128 tokens, then one decode
step per token), scores blocks per KV head from its own attention probabilities (the
observation window's queries, summed over the query heads of each KV head's group and over
layers), asks ``keep_heads`` after each step, and masks each query head's later attention to
the blocks its KV head kept. vLLM's log-probabilities must equal that per-head masked replay,
the blocks no head keeps must be freed from vLLM's block pool, and the per-head masking must
matter (the replay in which every head reads the union differs)."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from vllm_graft.integration.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama-recall"
B, P, G = 32, 536, 48  # block, prompt and continuation tokens
ADAKV = {"budget_blocks": 5, "held_blocks": 7, "sink_blocks": 1, "window_tokens": 32, "recent_blocks": 2}


def _replay(ids: list[int], params: dict, chunk: int = 128):
    """Log-probs of ``ids[1:]`` replaying vLLM's steps with per-head decisions, the same with
    every head reading the union of the kept blocks, and the last ``keep_heads`` answer."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_graft.hooks import BlockView, get_registry

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    H, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    g = H // hkv
    reg = get_registry().get("kvcompress", "adakv").registration
    comp = reg.load()(reg.params(**params))
    n = len(ids) - 1
    bounds = list(range(0, P, chunk)) + list(range(P, n)) + [n]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed = causal[None].repeat(H, 1, 1)  # per query head
    union_allowed = causal.clone()
    dropped = [set() for _ in range(hkv)]
    scores = [[] for _ in range(hkv)]
    kept = None

    def bias(a, s1):
        return torch.zeros(a.shape[:-2] + (s1, s1)).masked_fill_(~a[..., :s1, :s1], torch.finfo(torch.float32).min)

    for s0, s1 in zip(bounds, bounds[1:]):
        for h in range(hkv):  # this step's queries do not read what the head dropped before
            for b in dropped[h]:
                allowed[h * g:(h + 1) * g, s0:s1, b * B:(b + 1) * B] = False
        for b in set.intersection(*dropped):
            union_allowed[s0:s1, b * B:(b + 1) * B] = False
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids[:s1]]), attention_mask=bias(allowed, s1)[None],
                        output_attentions=True).attentions
        nb = -(-s1 // B)
        lo, hi = comp.score_positions(P)
        lo, hi = max(s0, lo), min(s1, hi)
        for h in range(hkv):
            per_key = sum(a[0, h * g:(h + 1) * g, lo:hi, :].sum((0, 1)) for a in att) if hi > lo else torch.zeros(s1)
            mass = torch.nn.functional.pad(per_key, (0, nb * B - s1)).view(nb, B).sum(-1).tolist()
            scores[h] = [x + m for x, m in zip(scores[h] + [0.0] * (nb - len(scores[h])), mass)]
        head_view = tuple(tuple(float("-inf") if i in dropped[h] else x for i, x in enumerate(scores[h]))
                          for h in range(hkv))
        kept = comp.keep_heads(BlockView(s1, B, P, tuple(map(sum, zip(*head_view))), head_scores=head_view))
        for h in range(hkv):
            dropped[h] |= set(range(nb)) - set(kept[h])
    out = []
    for a in (allowed, union_allowed):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:n]]), attention_mask=bias(a, n)[None] if a.dim() == 3
                           else bias(a, n)[None, None]).logits[0].float()
        out.append(torch.log_softmax(logits, -1)[torch.arange(n), torch.tensor(ids[1:])].tolist())
    return out[0], out[1], kept


def _vllm(ids: list[int], kvcompress: dict) -> tuple[list[float], dict]:
    """Log-probs of ids[1:] in vLLM (prompt log-probs, then the forced continuation) and the
    plugin's events."""
    from vllm import LLM

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.forcing import ForceTokens, forced_logprobs, forced_params
    from vllm_graft.integration.runtime import RUNTIME

    data = {"model": str(MODEL), "engine": {"dtype": "float32", "max_model_len": 1024, "block_size": B,
                                            "enforce_eager": True, "max_num_batched_tokens": 128,
                                            "enable_prefix_caching": False},
            "kvcompress": kvcompress}
    llm = LLM(**launch.llm_kwargs(plan_for(data), graft=True), seed=0, logits_processors=[ForceTokens])
    RUNTIME.events.clear()
    try:
        rest = ids[P:]
        out = llm.generate([{"prompt_token_ids": ids[:P]}], forced_params(rest, prompt_logprobs=0), use_tqdm=False)[0]
        prompt = [lp[t].logprob for t, lp in zip(ids[1:P], out.prompt_logprobs[1:])]
        events = {ev: n for (_, name, ev), n in RUNTIME.events.items() if name == kvcompress["plugin"]}
        return prompt + forced_logprobs(out, rest), events
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_adakv_in_vllm_equals_attention_masked_per_kv_head_and_frees_what_no_head_keeps():
    from vllm_graft.tools.workloads import Tokenizer, stdlib_texts

    (ids, _), = stdlib_texts(Tokenizer.from_model(str(MODEL)), num=1, tokens=P + G, seed=1)
    ids = list(ids)
    ref, ref_union, kept = _replay(ids, ADAKV)
    prompt_blocks = -(-P // B)
    union = sorted({b for k in kept for b in k if b < prompt_blocks})
    per_head = [[b for b in k if b < prompt_blocks] for k in kept]
    assert per_head[0] != per_head[1], "the heads chose the same blocks: nothing per head to check"
    assert len(union) <= ADAKV["held_blocks"] and all(len(k) <= ADAKV["budget_blocks"] + 1 for k in per_head)
    got, events = _vllm(ids, {"plugin": "adakv", "params": ADAKV})
    worst = max(abs(a - b) for a, b in zip(got, ref))
    masking = max(abs(a - b) for a, b in zip(ref[P - 1:], ref_union[P - 1:]))
    print(f"adakv: prompt blocks kept per KV head {per_head}, held (union) {union}; "
          f"max |vLLM - per-head masked replay| {worst:.2e} over {len(ref)} tokens; per-head masking moved the "
          f"decoded log-probs by up to {masking:.2e}; events {events}")
    assert worst < 1e-3
    assert masking > 1e-3  # each head reading only its blocks is not the union's attention
    # blocks no head keeps were returned to vLLM's pool; the others are masked per head
    assert events["blocks_freed"] == prompt_blocks - len(union)
    assert events["head_blocks_dropped"] == sum(prompt_blocks - len(k) for k in per_head)
