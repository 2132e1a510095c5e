"""The FlashInfer paths with their inputs on the (fake) CUDA device and a fake ``flashinfer``
(tests/unit/test_flashinfer.py): Hydragen's merge_state merge and Token Recycling's top_k update
make every tensor on the inputs' device and read nothing back to the host."""
from __future__ import annotations

import types

import pytest
import torch

from vllm_graft.plugins.attention.hydragen import flashinfer as hfi
from vllm_graft.plugins.attention.hydragen.reference import merge
from vllm_graft.plugins.speculative.token_recycling import flashinfer as tfi
from vllm_graft.plugins.speculative.token_recycling.reference import topk_update_reference

from ..fake_flashinfer import FakeFlashInfer


@pytest.fixture
def fake(monkeypatch):
    return FakeFlashInfer().install(monkeypatch)


def _merge_case(seed, t=6, h=4, d=16):
    """Partials of ``t`` tokens (token i has i % 3 prefix partials, rows in order: two tree levels
    at most) and the reference merge: (o_s, lse_s, o_p, lse_p, part_start, part_rows, want)."""
    g = torch.Generator().manual_seed(seed)
    parts = [list(range(sum(j % 3 for j in range(i)), sum(j % 3 for j in range(i + 1)))) for i in range(t)]
    nr = sum(map(len, parts))
    start = torch.tensor([0] + [sum(map(len, parts[:i + 1])) for i in range(t)], dtype=torch.int32)
    rows = torch.tensor([r for p in parts for r in p], dtype=torch.int32)
    o_s, o_p = torch.randn(t, h, d, generator=g), torch.randn(nr, h, d, generator=g)
    lse_s, lse_p = torch.randn(t, h, generator=g), torch.randn(nr, h, generator=g)
    want = []
    for i in range(t):
        o, lse = o_s[i], lse_s[i]
        for r in parts[i]:
            o, lse = merge(o, lse, o_p[r], lse_p[r])
        want.append(o)
    return o_s, lse_s, o_p, lse_p, start, rows, torch.stack(want)


def _merged_on_the_device(device, case, merge_fn):
    """``merge_fn(partials, ix, plan, block_size, out)`` on the device: the result on the host,
    after checking it stayed on the device and read nothing back."""
    *partials, start, rows, want = case
    t, h, d = partials[0].shape
    with device:
        *dparts, dstart, drows = device.put(*partials, start, rows)
        ix = {"part_start": dstart, "part_rows": drows, "num_groups": 2}
        plan = types.SimpleNamespace(cache={}, prefixes=lambda bs: types.SimpleNamespace(depth=2))
        out = torch.empty(t, h, d, dtype=torch.float16, device=dparts[0].device)
        with device.region("merge"):
            got = merge_fn(tuple(dparts), ix, plan, 16, out)
        assert got.device == dparts[0].device
        got = got.cpu()
    assert not [s for s in device.syncs if s.region == "merge"]
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    return got


def test_hydragen_merge_state_path_on_the_device(device, fake):
    _merged_on_the_device(device, _merge_case(0), lambda parts, *rest: hfi.merge_partials(*parts, *rest))
    assert len([c for c in fake.calls if c[0] == "merge_state"]) == 2


def test_token_recycling_top_k_path_on_the_device(device, fake):
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 5, (5, 40), generator=g).float()
    tokens = torch.tensor([2, 7, 2, 0, 7])
    want = topk_update_reference(logits, tokens, torch.full((8, 6), -1, dtype=torch.int64))
    with device:
        dl, dt, dm = device.put(logits, tokens, torch.full((8, 6), -1, dtype=torch.int64))
        with device.region("update"):
            got = tfi.recycle_update(dl, dt, dm)
        assert got.device == dl.device
        got = got.cpu()
    assert not [s for s in device.syncs if s.region == "update"]
    assert torch.equal(got, want)


def test_hydragen_engine_merge_path_on_the_device(device):
    """The merge by vLLM's own ``merge_attn_states`` (engine_merge.py): every tensor on the inputs'
    device, nothing read back to the host, the reference's result (natural-log lse)."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    from vllm_graft.plugins.attention.hydragen.engine_merge import merge_partials_with

    _merged_on_the_device(device, _merge_case(2), lambda *a: merge_partials_with(merge_attn_states, *a))
