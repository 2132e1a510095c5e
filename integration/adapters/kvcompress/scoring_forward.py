"""The vLLM half of scoring passes (``KVCompressor.scoring_pass``, e.g. KVzip): the model's own
forward over a compressor's pass tokens, run in the worker once a request's prompt is prefilled.

Called from the scores channel (:meth:`.scores._Scores.finalize`, after the step's sampling, so
the step's logits and vLLM's persistent input buffers are untouched). Per pass: the token ids
and positions ``context_len ...`` are fresh tensors on the runner's device; ``set_forward_context``
gets a :class:`~.scoring_pass.PassMetadata` for every attention layer of the KV-cache group and
an empty slot mapping, so vLLM's ``unified_kv_cache_update`` writes nothing and each graft
backend's ``forward`` runs :func:`~.scoring_pass.pass_forward` (the request's cached context plus
the pass's local K/V). The hidden states are discarded (no logits). The pair scores, a max over
the passes, go to the compressor's ``pass_block_scores``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from ....hooks import KVCompressor
from .plan import KVCompressError
from .scoring_pass import PassMetadata, stacked

log = logging.getLogger("vllm_graft")

#: the runner attribute caching the tokenizer's encode for the passes' texts
_TOKENIZE = "_graft_pass_tokenize"


def _tokenize(runner: Any) -> Callable[[str], list[int]]:
    fn = getattr(runner, _TOKENIZE, None)
    if fn is None:
        from vllm.tokenizers import cached_tokenizer_from_config

        tok = cached_tokenizer_from_config(runner.model_config)

        def fn(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        setattr(runner, _TOKENIZE, fn)
    return fn


def _group(runner: Any) -> Any:
    groups = list(getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or ())
    if len(groups) != 1:
        raise KVCompressError(
            f"vllm-graft kvcompress scoring pass: the model has {len(groups)} KV-cache groups; scoring "
            "passes read one group's cache (a model of full-attention layers only)"
        )
    return groups[0]


def run_passes(runner: Any, compressor: KVCompressor, req_id: str, context_len: int) -> torch.Tensor | None:
    """The compressor's passes over request ``req_id``'s first ``context_len`` tokens: the pair
    scores ``[layers, H_kv, context_len]`` (float32, on the runner's device; this rank's KV
    heads), or None when the compressor asks for no pass."""
    from vllm.forward_context import set_forward_context

    state = runner.requests.get(req_id)
    if state is None or state.prompt_token_ids is None:
        raise KVCompressError(
            f"vllm-graft kvcompress scoring pass: request {req_id!r} has no prompt token ids in the "
            "worker (prompt embeddings are not supported by scoring passes)"
        )
    context = list(state.prompt_token_ids[:context_len])
    passes = list(compressor.scoring_passes(context, _tokenize(runner)))
    if not passes:
        return None
    group = _group(runner)
    block_size = group.kv_cache_spec.block_size
    blocks = list(state.block_ids[0])[: -(-context_len // block_size)]
    device = runner.device
    meta = PassMetadata(torch.tensor(blocks, dtype=torch.long, device=device), block_size, context_len)
    names = list(group.layer_names)
    for p in passes:
        ids = torch.tensor(p.token_ids, dtype=torch.int32, device=device)
        n = ids.shape[0]
        positions = torch.arange(context_len, context_len + n, dtype=torch.int64, device=device)
        meta.observe_from, meta.num_actual_tokens = p.observe_from, n
        with (
            torch.inference_mode(),
            set_forward_context({name: meta for name in names}, runner.vllm_config, num_tokens=n, slot_mapping={}),
        ):
            runner.model(input_ids=ids, positions=positions, intermediate_tensors=None, inputs_embeds=None)
    if meta.layers != len(names) * len(passes):
        raise KVCompressError(
            f"vllm-graft kvcompress scoring pass: {meta.layers} layer forwards ran the pass, expected "
            f"{len(names)} layers x {len(passes)} passes; the model's attention did not reach the graft "
            "backend (is the deployment's attention backend one vllm-graft routes?)"
        )
    return stacked(meta)


def pass_block_scores(runner: Any, compressor: KVCompressor, req_id: str, context_len: int) -> Any:
    """``(block scores [ceil(context_len / block_size)], pair scores, seconds)``: :func:`run_passes`
    reduced by the compressor (on the device, this rank's share); the scores None where the
    compressor asked for no pass."""
    t0 = time.perf_counter()
    pair = run_passes(runner, compressor, req_id, context_len)
    scores = None if pair is None else compressor.pass_block_scores(pair, _group(runner).kv_cache_spec.block_size)
    return scores, pair, time.perf_counter() - t0
