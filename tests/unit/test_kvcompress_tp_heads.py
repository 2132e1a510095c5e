"""A per-head compressor under tensor parallelism (``kvcompress.engine._tensor_parallel_heads``):
the ranks' per-head mass is gathered in rank order, so every rank allocates over all KV heads and
masks its own; where vLLM replicates a KV head over ranks (more ranks than KV heads) the ranks'
shares of it are summed. The two-rank engine case is tests/e2e/test_tensor_parallel.py (adakv);
here the gather is vLLM's functions replaced by a fake group of ranks, to reach the replicated
layout that two CPU ranks of the bundled model (2 KV heads) do not."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed import communication_op, parallel_state  # noqa: E402

from vllm_graft.integration.adapters.kvcompress.engine import _tensor_parallel_heads  # noqa: E402


def _ranks(monkeypatch, tp: int, rank: int, shards: list) -> None:
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(communication_op, "tensor_model_parallel_all_gather",
                        lambda x, dim=-1: torch.cat(shards, dim=dim))


def test_one_rank_is_the_mass_itself(monkeypatch):
    mass = torch.rand(3, 4, 5)
    _ranks(monkeypatch, 1, 0, [])
    got, first = _tensor_parallel_heads(mass, 4)
    assert got is mass and first == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_split_heads_are_gathered_in_rank_order(monkeypatch, rank):
    shards = [torch.rand(2, 2, 6) for _ in range(2)]  # 4 KV heads, 2 a rank
    _ranks(monkeypatch, 2, rank, shards)
    got, first = _tensor_parallel_heads(shards[rank], 4)
    assert torch.equal(got, torch.cat(shards, dim=1)) and first == 2 * rank


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_replicated_head_sums_its_ranks_shares(monkeypatch, rank):
    shards = [torch.rand(2, 1, 6) for _ in range(4)]  # 2 KV heads over 4 ranks: head r // 2
    _ranks(monkeypatch, 4, rank, shards)
    got, first = _tensor_parallel_heads(shards[rank], 2)
    assert got.shape == (2, 2, 6) and first == rank // 2
    assert torch.allclose(got[:, 0], shards[0][:, 0] + shards[1][:, 0])
    assert torch.allclose(got[:, 1], shards[2][:, 0] + shards[3][:, 0])
