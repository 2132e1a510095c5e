"""A scored compressor end to end against an independent reference: SnapKV in vLLM's CPU
engine (the worker scores and decides, the scheduler frees, attention leaves the freed blocks
out) gives, for a continuation decoded after the prompt (teacher-forced), the log-probabilities
of a transformers model whose attention is masked to the prompt blocks SnapKV keeps, the
blocks being chosen here from transformers' own attention probabilities: the observation
window's mass per block, summed over heads and layers, through the plugin's planner."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama-recall"
B, P, G, WINDOW = 32, 536, 48, 32  # block, prompt and continuation tokens, observation window
PARAMS = {"budget_blocks": 6, "sink_blocks": 1, "window_tokens": WINDOW, "recent_blocks": 2}


def _reference(ids: list[int]) -> tuple[list[int], list[float], list[float]]:
    """(prompt blocks kept, masked log-probs of the continuation, plain log-probs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_graft.hooks import BlockView, get_registry

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    nb = -(-P // B)
    with torch.no_grad():
        attentions = model(input_ids=torch.tensor([ids[:P]]), output_attentions=True).attentions
    mass = torch.zeros(nb)
    for a in attentions:  # [1, H, q, k] per layer: the window's queries, every head
        per_key = a[0, :, P - WINDOW:, :].sum((0, 1))
        mass += torch.nn.functional.pad(per_key, (0, nb * B - P)).view(nb, B).sum(-1)
    reg = get_registry().get("kvcompress", "snapkv").registration
    kept = reg.load()(reg.params(**PARAMS)).keep(BlockView(P, B, P, tuple(mass.tolist())))

    n = P + G - 1
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    dropped = torch.tensor([k // B not in kept for k in range(P)])
    allowed[P:, :P] &= ~dropped  # decode steps (queries from position P on) read the kept blocks
    mask = torch.zeros(1, 1, n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    rest = torch.tensor(ids[P:P + G])
    out = []
    for m in (mask, None):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:n]]), attention_mask=m).logits[0].float()
        out.append(torch.log_softmax(logits[P - 1:], -1)[torch.arange(G), rest].tolist())
    return kept, out[0], out[1]


def test_snapkv_in_vllm_equals_attention_masked_to_the_blocks_it_keeps():
    from vllm import LLM

    from vllm_graft.integration import launch
    from vllm_graft.integration.forcing import ForceTokens, forced_logprobs, forced_params
    from vllm_graft.integration.workloads import Tokenizer, stdlib_texts

    (ids, _), = stdlib_texts(Tokenizer.from_model(str(MODEL)), num=1, tokens=P + G, seed=1)
    ids = list(ids)
    kept, masked, full = _reference(ids)
    assert len(kept) == PARAMS["budget_blocks"] < -(-P // B) and {0, 15, 16} <= set(kept)  # sink, recent 2

    plan = launch.plan_from_dict({
        "model": str(MODEL), "kvcompress": {"plugin": "snapkv", "params": PARAMS},
        "engine": {"dtype": "float32", "max_model_len": 1024, "block_size": B, "enforce_eager": True,
                   "max_num_batched_tokens": 128, "enable_prefix_caching": False}})
    llm = LLM(**launch.llm_kwargs(plan), seed=0, logits_processors=[ForceTokens])
    try:
        rest = ids[P:P + G]
        got = forced_logprobs(llm.generate([{"prompt_token_ids": ids[:P]}], forced_params(rest),
                                           use_tqdm=False)[0], rest)
    finally:
        llm.llm_engine.engine_core.shutdown()
    to_masked = max(abs(a - b) for a, b in zip(got, masked))
    to_full = max(abs(a - b) for a, b in zip(got, full))
    print(f"kept prompt blocks {kept}; max |vLLM - masked reference| {to_masked:.2e}, "
          f"|vLLM - plain reference| {to_full:.2e}")
    assert to_masked < 1e-3
    assert to_full > 0.05  # the blocks SnapKV dropped mattered: this is not plain attention
    # the first token is sampled from the prefill, which attends to the whole prompt
    assert abs(got[0] - full[0]) < 1e-3
