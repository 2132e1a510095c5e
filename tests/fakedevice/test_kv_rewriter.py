"""The KV-compression metadata rewriter (integration/adapters/kvcompress/engine.py::rewrite)
with vLLM's block table and seq_lens on the (fake) CUDA device, as vLLM 0.33's full CUDA
graphs need it: the same buffer addresses at capture and at every step after, the runner's
tensors untouched (the drafter gets the same metadata), no host sync, the compacted rows as
``plan.compact_rows`` makes them, and the host upper bound of the lengths lowered with them."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_graft.hooks import KVCompressor  # noqa: E402
from vllm_graft.integration.adapters.kvcompress import state as _state  # noqa: E402
from vllm_graft.integration.adapters.kvcompress.engine import rewrite  # noqa: E402
from vllm_graft.integration.adapters.kvcompress.plan import compact_rows  # noqa: E402
from vllm_graft.integration.adapters.kvcompress.rows import _StepRows, step_rows  # noqa: E402
from vllm_graft.integration.adapters.kvcompress.state import Active  # noqa: E402
from vllm_graft.integration.adapters.kvcompress.vllm_spec import GraftKVCompressSpec  # noqa: E402

B = 16  # block size
WIDTH = 12  # block-table columns
MAX_ROWS = 8  # max_num_seqs: the persistent buffers' rows


class SinkWindow(KVCompressor):
    """Keeps 1 sink block and the last 2 blocks."""

    def keep(self, view):
        n = view.num_blocks
        return sorted(set(range(min(1, n))) | set(range(max(0, n - 2), n)))


def _builder():
    spec = GraftKVCompressSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float32,
                               compressor="sw")
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=MAX_ROWS))
    return types.SimpleNamespace(kv_cache_spec=spec, block_size=B, vllm_config=config)


def _cm(computed, queries, padded):
    """vLLM's metadata of one step: rows of ``computed`` tokens before the step and
    ``queries`` new ones, padded to ``padded`` rows as for a CUDA graph (NULL blocks, 0 lengths)."""
    n = len(computed)
    seq = [c + q for c, q in zip(computed, queries)] + [0] * (padded - n)
    qsl = [0]
    for q in list(queries) + [0] * (padded - n):
        qsl.append(qsl[-1] + q)
    gen = torch.Generator().manual_seed(sum(computed) + padded)
    table = torch.randint(1, 1000, (padded, WIDTH), generator=gen, dtype=torch.int32)
    table[n:] = 0  # NULL_BLOCK_ID in the padded rows
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens.clone(), num_reqs=padded,
        num_actual_tokens=qsl[-1], max_query_len=max(queries), max_seq_len=max(seq),
        block_table_tensor=table, slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64))


def _runner(computed, queries):
    n = len(computed)
    batch = types.SimpleNamespace(num_reqs=n, req_ids=[f"r{i}" for i in range(n)],
                                  num_prompt_tokens=torch.tensor([c + q for c, q in zip(computed, queries)]).numpy())
    return types.SimpleNamespace(input_batch=batch)


@pytest.fixture
def active():
    previous = _state.get_active()
    _state.set_active(Active(SinkWindow(None), "sw", lambda event, n=1: None))
    yield _state.get_active()
    _state.set_active(previous)


def _put(device, cm):
    device.put(cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping)


def _build(builder, cm, computed=None, queries=None):
    """``rewrite`` as the patched ``_build_attention_metadata`` runs it: a step (with the
    scheduler's tokens) or, without ``computed``, a dummy / capture build."""
    previous = getattr(step_rows, "step", None), getattr(step_rows, "inside", False)
    step_rows.inside = True
    step_rows.step = None if computed is None else _StepRows(
        _runner(computed, queries), {f"r{i}": q for i, q in enumerate(queries)})
    try:
        return rewrite(builder, cm)
    finally:
        step_rows.step, step_rows.inside = previous


STEPS = [  # (computed before the step, query tokens, padded rows)
    ([5 * B + 3, 2 * B, 9 * B + 1], [1, 1, 1], 4),  # drops in rows 0 and 2
    ([B, 2 * B - 1], [1, 1], 2),  # nothing to drop
    ([7 * B, 3 * B + 2, 11 * B - 1, 4 * B], [1, 2 * B, 1, 1], 8),  # a prefill chunk among decodes
]


def test_the_rewriter_returns_the_same_buffers_at_capture_and_every_step(device, active):
    builder = _builder()
    cm = _cm([1] * MAX_ROWS, [1] * MAX_ROWS, MAX_ROWS)  # a capture batch: every row 1 token
    with device:
        _put(device, cm)
        with device.region("capture"):
            captured = _build(builder, cm)
        addresses = captured.block_table_tensor.data_ptr(), captured.seq_lens.data_ptr()
        assert captured.block_table_tensor is not cm.block_table_tensor
        assert torch.equal(captured.block_table_tensor, cm.block_table_tensor)
        assert torch.equal(captured.seq_lens, cm.seq_lens)
        for computed, queries, padded in STEPS:
            step = _cm(computed, queries, padded)
            _put(device, step)
            with device.region("step"):
                out = _build(builder, step, computed, queries)
            assert (out.block_table_tensor.data_ptr(), out.seq_lens.data_ptr()) == addresses
            assert out.block_table_tensor.shape == (padded, WIDTH) and out.seq_lens.shape == (padded,)
            assert out.block_table_tensor.device == step.block_table_tensor.device
    if not getattr(device, "real", False):  # the test's own checks read back outside the regions
        per = device.sync_counts()
        assert per.get("capture", 0) == 0 and per.get("step", 0) == 0, device.report()


@pytest.mark.parametrize("computed, queries, padded", STEPS)
def test_the_compacted_rows_are_compact_rows_and_the_runner_tensors_are_untouched(device, active, computed,
                                                                                  queries, padded):
    builder = _builder()
    cm = _cm(computed, queries, padded)
    table0, lens0, upper0 = cm.block_table_tensor.clone(), cm.seq_lens.clone(), cm.seq_lens_cpu_upper_bound.clone()
    with device:
        _put(device, cm)
        with device.region("step"):
            out = _build(builder, cm, computed, queries)
        step = step_rows.step  # reset by _build: recompute the skips on the host for the oracle
    skips = _StepRows(_runner(computed, queries), {f"r{i}": q for i, q in enumerate(queries)}).skips(
        _cm(computed, queries, padded), B, active)
    want_table, want_lens = compact_rows(table0, lens0, skips, B)
    got_table, got_lens = out.block_table_tensor.cpu(), out.seq_lens.cpu()
    assert got_lens.tolist() == want_lens.tolist()
    for i in range(padded):  # the columns a kernel reads: ceil(new length / B)
        used = -(-int(want_lens[i]) // B)
        assert got_table[i, :used].tolist() == want_table[i, :used].tolist(), i
    assert torch.equal(got_table[len(computed):], table0[len(computed):])  # padded rows: NULL blocks
    # the runner's tensors (shared with the drafter) are not written
    assert torch.equal(cm.block_table_tensor.cpu(), table0) and torch.equal(cm.seq_lens.cpu(), lens0)
    assert torch.equal(cm.seq_lens_cpu_upper_bound, upper0)
    # the host bound: block_size less per dropped block, a new CPU tensor; the cache reset
    assert out.seq_lens_cpu_upper_bound.device.type == "cpu"
    assert out.seq_lens_cpu_upper_bound.tolist() == [int(u) - B * len(s) for u, s in
                                                     zip(upper0, skips + [[]] * (padded - len(skips)))]
    assert out._num_computed_tokens_cache is None
    assert out.max_seq_len == max(out.seq_lens_cpu_upper_bound.tolist())
    assert any(skips) == (out.seq_lens_cpu_upper_bound is not cm.seq_lens_cpu_upper_bound)
    assert step is None
    if not getattr(device, "real", False):
        assert device.syncs == [], device.report()


def test_a_row_that_drops_nothing_copies_the_runners_values(device, active):
    computed, queries, padded = STEPS[1]
    builder = _builder()
    cm = _cm(computed, queries, padded)
    with device:
        _put(device, cm)
        out = _build(builder, cm, computed, queries)
    assert out.block_table_tensor is not cm.block_table_tensor and out.seq_lens is not cm.seq_lens
    assert torch.equal(out.block_table_tensor.cpu(), cm.block_table_tensor.cpu())
    assert torch.equal(out.seq_lens.cpu(), cm.seq_lens.cpu())
    assert out.seq_lens_cpu_upper_bound is cm.seq_lens_cpu_upper_bound  # nothing dropped


def test_reading_the_device_lengths_back_is_caught(active, monkeypatch):
    """The host sync the rewriter avoids, put back (the step's lengths read from the device
    seq_lens, as before): the fake device records it."""
    from vllm_graft.integration.adapters.kvcompress import rows
    from vllm_graft.kit.fakedevice import FakeDevice

    monkeypatch.setattr(rows, "host_seq_lens", lambda cm: cm.seq_lens)
    computed, queries, padded = STEPS[0]
    cm = _cm(computed, queries, padded)
    device = FakeDevice()
    with device:
        _put(device, cm)
        _build(_builder(), cm, computed, queries)
    assert [s.op for s in device.syncs] == ["tolist"]


def test_the_pinned_copy_branch_of_the_fill_runs_on_the_fake_device(device, monkeypatch):
    """``RowBuffers.fill`` stages its index in pinned host memory when CUDA is there (a branch no
    CPU run took): on the fake device, with ``torch.cuda.is_available()`` answering as on a GPU
    machine (pinned memory is plain host memory there), it fills the same rows as the host path,
    reading nothing back."""
    from vllm_graft.integration.adapters.kvcompress.plan import RowBuffers, compaction_index

    if getattr(device, "real", False):
        pytest.skip("on a real GPU the branch runs in every device test")
    cm = _cm([5 * B + 3, 2 * B, 9 * B + 1], [1, 1, 1], 4)
    skips = [[1, 2], [], [3], []]
    index = compaction_index(skips, cm.seq_lens.tolist(), B, WIDTH)
    want_table, want_lens = RowBuffers(MAX_ROWS, cm.block_table_tensor, cm.seq_lens).fill(
        cm.block_table_tensor, cm.seq_lens, index)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with device:
        table, lens = device.put(cm.block_table_tensor.clone(), cm.seq_lens.clone())
        with device.region("fill"):
            got_table, got_lens = RowBuffers(MAX_ROWS, table, lens).fill(table, lens, index)
        assert device.is_marked(got_table) and device.is_marked(got_lens)
    assert not device.sync_counts().get("fill"), device.report()
    assert torch.equal(got_table.cpu(), want_table) and torch.equal(got_lens.cpu(), want_lens)
    assert not torch.equal(want_lens, cm.seq_lens)  # rows were compacted
