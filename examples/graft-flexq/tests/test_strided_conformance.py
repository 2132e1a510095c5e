"""The conformance kit on the package's second plugin, the `strided` KV compressor, at a
budget small enough that the kit's requests lose blocks; and its policy's rules directly."""
import pytest

from vllm_graft.hooks import BlockView, check_keep
from graft_flexq.strided import Strided, StridedParams


@pytest.mark.graft_conformance("kvcompress:strided", params={"budget_blocks": 4, "sink_blocks": 1})
def test_conformance(graft_check):
    graft_check()


@pytest.mark.parametrize("params", [dict(budget_blocks=4), dict(budget_blocks=8, sink_blocks=2, stride=3),
                                    dict(budget_blocks=6, recent_blocks=1), dict(budget_blocks=5, sink_blocks=0)])
def test_budget_and_monotone(params):
    comp = Strided(StridedParams(**params))
    dropped: set[int] = set()
    for tokens in range(1, 40 * 16, 5):
        view = BlockView(tokens, 16, 64)
        kept = check_keep(view, comp.keep(view), "strided")
        assert kept[-1] == view.num_blocks - 1 and len(kept) <= comp.params.budget_blocks
        assert not dropped & set(kept), "a dropped block came back"
        dropped |= set(range(view.num_blocks)) - set(kept)


def test_thins_the_middle():
    comp = Strided(StridedParams(budget_blocks=8, sink_blocks=1, recent_blocks=3))
    # 20 blocks: sink 0, window 17-19, and the 4 newest of the odd blocks 1..15 in between
    assert comp.keep(BlockView(20 * 16, 16, 64)) == [0, 9, 11, 13, 15, 17, 18, 19]
    assert comp.keep(BlockView(20 * 16, 16, 64, pinned=frozenset({2}))) == [0, 2, 9, 11, 13, 15, 17, 18, 19]
