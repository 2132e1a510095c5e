"""DFloat11's Triton Huffman decoder against the torch decoder, under the interpreter."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.quant.dfloat11 import DFloat11Params  # noqa: E402
from vllm_graft.plugins.quant.dfloat11.reference import DFloat11  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("shards", [[(24, 40)], [(16, 40), (8, 40), (8, 40)]])
def test_triton_decoder_gives_the_exact_weight(shards):
    g = torch.Generator().manual_seed(len(shards))
    ws = [(torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for s in shards]
    ref = DFloat11(DFloat11Params(chunk=16))
    tri = DFloat11(DFloat11Params(chunk=16, kernel="triton"))
    stored = [ref.quantize(w) for w in ws]
    t = ref.load({k: [s[k] for s in stored] for k in stored[0]}, [w.shape[0] for w in ws])
    want = torch.cat(ws)
    got = tri.weight(t)
    mismatches = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    print(f"triton Huffman decoder, shards {shards}: {mismatches} mismatching weights (max error 0 expected)")
    assert mismatches == 0 and torch.equal(got.view(torch.int16), ref.weight(t).view(torch.int16))
    assert "kernel" not in tri.checkpoint_params()
