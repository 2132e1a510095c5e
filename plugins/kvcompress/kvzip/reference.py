"""KVzip at block granularity (see ``__init__``), in plain PyTorch.

* :func:`reconstruction_passes`: the chunked reconstruction prompts (what the worker feeds);
* :func:`pass_attention`: one layer of a reconstruction pass, dense: the pass's queries over
  the context's keys and, causally, the pass's own, with the per-pair score (the oracle of the
  worker's paged scoring attention);
* :func:`block_scores_from_pairs`: pair scores -> one score per block;
* :class:`KVzip`: the compressor (the keep policy of SnapKV's family, scope ``prompt``, once the
  prompt is in; its scores are the passes' only).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ....hooks import BlockView, PolicyCompressor, ScoringPass


def reconstruction_passes(
    context: Sequence[int], prompt: Sequence[int], chunk_tokens: int, resume_tokens: int = 0
) -> list[ScoringPass]:
    """One pass per chunk of ``chunk_tokens`` tokens of ``context``: ``prompt`` (the repeat
    instruction's ids), past the first chunk the previous chunk's last ``resume_tokens`` tokens,
    then the chunk; the chunk's queries (from ``observe_from`` on) are the ones that score."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    context = list(context)
    out = []
    for start in range(0, len(context), chunk_tokens):
        head = list(prompt)
        if start and resume_tokens:
            head += context[max(0, start - resume_tokens) : start]
        out.append(ScoringPass(tuple(head + context[start : start + chunk_tokens]), observe_from=len(head)))
    return out


def pass_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx_keys: torch.Tensor,
    ctx_values: torch.Tensor,
    scale: float,
    observe_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a reconstruction pass: ``query [n, H, D]`` with the pass's own ``key`` and
    ``value [n, H_kv, D]`` (positions applied), over the context's ``ctx_keys``/``ctx_values``
    ``[H_kv, N, D]`` and causally over the pass's keys. Returns ``(out [n, H, D], pair [H_kv, N])``:
    ``pair[h, j]`` = the largest softmax probability any query from ``observe_from`` on, of any
    query head reading KV head ``h``, puts on context token ``j`` (0 where none observes)."""
    n, H, D = query.shape
    hkv, N = ctx_keys.shape[0], ctx_keys.shape[1]
    G = H // hkv
    q = query.float().view(n, hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    k = torch.cat([ctx_keys.float(), key.float().transpose(0, 1)], dim=1)  # [Hkv, N + n, D]
    v = torch.cat([ctx_values.float(), value.float().transpose(0, 1)], dim=1)
    logits = torch.einsum("hgtd,hsd->hgts", q, k) * scale
    own = torch.arange(n, device=query.device)
    future = own[None, :] > own[:, None]  # [t, s]: pass key s after query t
    mask = torch.cat([torch.zeros(n, N, dtype=torch.bool, device=query.device), future], dim=1)
    prob = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", prob, v).permute(2, 0, 1, 3).reshape(n, H, D)
    seen = prob[:, :, observe_from:, :N]
    pair = seen.amax(dim=(1, 2)) if seen.shape[2] else torch.zeros(hkv, N, device=query.device)
    return out.to(query.dtype), pair


def block_scores_from_pairs(pair_scores: torch.Tensor, block_size: int, reduce: str = "max") -> torch.Tensor:
    """``pair_scores [L, H_kv, N]`` -> ``[ceil(N / block_size)]``: per layer and KV head the max
    (``reduce`` "max") or mean ("mean") over each block's tokens, summed over layers and heads."""
    L, hkv, N = pair_scores.shape
    nb = -(-N // block_size)
    pad = nb * block_size - N
    s = pair_scores.float()
    if reduce == "max":
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(L, hkv, nb, block_size)
        per = s.amax(-1)
    elif reduce == "mean":
        total = torch.nn.functional.pad(s, (0, pad)).view(L, hkv, nb, block_size).sum(-1)
        count = torch.full((nb,), float(block_size), device=s.device)
        if pad:
            count[-1] = block_size - pad
        per = total / count
    else:
        raise ValueError(f"block_reduce must be 'max' or 'mean', got {reduce!r}")
    return per.sum(dim=(0, 1))


class KVzip(PolicyCompressor):
    needs_scores = True
    scoring_pass = True
    scope = "prompt"  # the generated blocks are all kept
    when = "prefill"

    def score_positions(self, num_prompt_tokens: int) -> tuple[int, int]:
        """No query of the request's own steps scores: the reconstruction passes do."""
        return (0, 0)

    def score(self, view: BlockView) -> Sequence[float] | None:
        return view.scores

    def protected_start(self, view: BlockView) -> int:
        """The prompt's last block, the one being written when the prompt's end is decided, stays
        (so the budget counts the same blocks at every later step)."""
        return max(0, view.num_prompt_tokens - 1) // view.block_size

    def scoring_passes(
        self, prompt_token_ids: Sequence[int], tokenize: Callable[[str], list[int]]
    ) -> list[ScoringPass]:
        p = self.params
        return reconstruction_passes(prompt_token_ids, tokenize(p.repeat_prompt), p.chunk_tokens, p.resume_tokens)

    def pass_block_scores(self, pair_scores: torch.Tensor, block_size: int) -> torch.Tensor:
        return block_scores_from_pairs(pair_scores, block_size, self.params.block_reduce)
