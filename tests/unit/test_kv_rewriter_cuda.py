"""The KV-compression rewriter's parts for vLLM 0.33's CUDA route, on the host: the gather
index built from the host-known drops (plan.compaction_index) and the persistent buffers it
fills (plan.RowBuffers) against plan.compact_rows; kernel blocks smaller than the KV-cache
blocks; the manager's block size found from the runner's KV-cache groups; what the rewriter
refuses. The device half (addresses, no host sync) is tests/fakedevice/test_kv_rewriter.py."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm_graft.integration.adapters.kvcompress.plan import (
    KVCompressError,
    RowBuffers,
    compact_rows,
    compaction_index,
)

B = 16


def _random_case(seed, rows=6, width=10):
    rng = np.random.default_rng(seed)
    lens, skips = [], []
    for _ in range(rows):
        n = int(rng.integers(1, width * B + 1))
        last = (n - 1) // B
        skip = sorted(rng.choice(last, size=int(rng.integers(0, last + 1)), replace=False).tolist()) if last else []
        lens.append(n)
        skips.append(skip)
    table = torch.from_numpy(rng.integers(1, 10_000, (rows + 2, width)).astype(np.int32))
    table[rows:] = 0  # padded rows
    seq_lens = torch.tensor(lens + [0, 0], dtype=torch.int32)
    return table, seq_lens, skips


@pytest.mark.parametrize("seed", range(8))
def test_the_buffers_hold_what_compact_rows_makes_on_every_column_a_kernel_reads(seed):
    table, seq_lens, skips = _random_case(seed)
    want_table, want_lens = compact_rows(table, seq_lens, skips, B)
    buf = RowBuffers(16, table, seq_lens)
    before = table.clone(), seq_lens.clone()
    got_table, got_lens = buf.fill(table, seq_lens, compaction_index(skips, seq_lens.numpy(), B, table.shape[1]))
    assert got_table.data_ptr() == buf.table.data_ptr() and got_lens.data_ptr() == buf.seq_lens.data_ptr()
    assert got_lens.tolist() == want_lens.tolist()
    for i in range(table.shape[0]):
        used = -(-int(want_lens[i]) // B)
        assert got_table[i, :used].tolist() == want_table[i, :used].tolist()
    assert torch.equal(table, before[0]) and torch.equal(seq_lens, before[1])


def test_the_index_names_each_dropping_row_its_loss_and_its_kept_columns():
    index = compaction_index([[1, 2], [], [0]], [5 * B + 1, 3 * B, 3 * B], B, 8)
    # widest used row: 6 columns; row 0 keeps 0, 3, 4, 5; row 2 keeps 1, 2
    assert index.tolist() == [[0, 2 * B, 0, 3, 4, 5, -1, -1],
                              [2, B, 1, 2, -1, -1, -1, -1]]
    assert index.dtype == np.int32
    assert compaction_index([[], []], [B, B], B, 8) is None


def test_kernel_blocks_smaller_than_the_kv_cache_blocks_drop_all_their_columns():
    """A KV-cache block of 2 kernel blocks: logical block b is columns 2b and 2b+1."""
    k = B // 2
    table = torch.arange(1, 13, dtype=torch.int32).view(1, 12)
    seq_lens = torch.tensor([4 * B + 3], dtype=torch.int32)  # 5 logical blocks, 9 kernel columns used
    index = compaction_index([[1, 2]], seq_lens.numpy(), B, 12, blocks_per_block=2)
    got_table, got_lens = RowBuffers(2, table, seq_lens).fill(table, seq_lens, index)
    assert got_lens.tolist() == [2 * B + 3]
    used = -(-int(got_lens[0]) // k)
    assert got_table[0, :used].tolist() == [1, 2, 7, 8, 9]
    # the same as compacting the table of kernel blocks with the kernel columns as blocks
    want_table, _ = compact_rows(table, seq_lens, [[2, 3, 4, 5]], k)
    assert got_table[0, :used].tolist() == want_table[0, :used].tolist()


@pytest.mark.parametrize("skip, why", [([3], "last"), ([5], "last"), ([-1], "last")])
def test_a_skip_of_the_last_block_or_past_the_row_is_refused(skip, why):
    with pytest.raises(KVCompressError, match=r"row 0 .*full blocks before the row's last one"):
        compaction_index([skip], [3 * B + 2], B, 8)


def test_the_buffers_refuse_nothing_that_fits_and_say_what_does_not():
    table = torch.zeros(4, 8, dtype=torch.int32)
    buf = RowBuffers(8, table, torch.zeros(4, dtype=torch.int32))
    assert buf.fits(table) and buf.fits(torch.zeros(8, 8, dtype=torch.int32))
    assert not buf.fits(torch.zeros(9, 8, dtype=torch.int32))
    assert not buf.fits(torch.zeros(4, 9, dtype=torch.int32))


# ----------------------------------------------------------------------------- with vLLM
def _spec(block_size, compressor="sw"):
    from vllm_graft.integration.adapters.kvcompress.vllm_spec import GraftKVCompressSpec

    return GraftKVCompressSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16,
                               compressor=compressor)


def _runner(*specs):
    groups = [types.SimpleNamespace(kv_cache_spec=s) for s in specs]
    return types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(kv_cache_groups=groups))


def test_the_manager_block_size_is_the_groups_whose_kernel_spec_the_builder_got():
    pytest.importorskip("vllm")
    from dataclasses import replace

    from vllm_graft.integration.adapters.kvcompress.engine import _manager_block_size

    manager = _spec(32)
    kernel = replace(manager, block_size=16)  # what AttentionGroup hands the builder
    assert _manager_block_size(_runner(manager), kernel) == 32
    assert _manager_block_size(_runner(manager), manager) == 32
    assert _manager_block_size(_runner(_spec(32, "other")), kernel) == 16  # not this compressor's
    assert _manager_block_size(types.SimpleNamespace(), kernel) == 16  # no config: the builder's
    with pytest.raises(NotImplementedError, match=r"block sizes \[16, 32\]"):
        _manager_block_size(_runner(manager, _spec(16)), kernel)


def test_a_table_that_outgrows_the_buffers_is_refused_once_sized_from_the_config():
    pytest.importorskip("vllm")
    from vllm_graft.integration.adapters.kvcompress.engine import _row_buffers

    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=4))
    builder = types.SimpleNamespace(vllm_config=config)
    cm = types.SimpleNamespace(block_table_tensor=torch.zeros(2, 8, dtype=torch.int32),
                               seq_lens=torch.zeros(2, dtype=torch.int32))
    buf = _row_buffers(builder, cm)
    assert buf.table.shape == (4, 8) and _row_buffers(builder, cm) is buf
    cm.block_table_tensor = torch.zeros(4, 8, dtype=torch.int32)
    assert _row_buffers(builder, cm) is buf  # up to max_num_seqs rows: the same buffers
    cm.block_table_tensor = torch.zeros(2, 9, dtype=torch.int32)
    with pytest.raises(KVCompressError, match=r"changed from \(4, 8\).*to \(2, 9\)"):
        _row_buffers(builder, cm)
