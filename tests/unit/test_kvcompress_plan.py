"""KV compression without vLLM: the rules a keep() answer must follow, what the scheduler
frees, what the worker leaves out of attention, how a block-table row is rewritten, and that
the two halves agree over a whole generation (a step-by-step simulation)."""

import numpy as np
import pytest
import torch

from vllm_graft.hooks import BlockView, Capabilities, KVCompressor, NoParams, Registration, get_registry, hookimpl
from vllm_graft.integration.adapters.kvcompress.keep import KeepError, check_keep, dropped_blocks
from vllm_graft.integration.adapters.kvcompress.plan import (
    blocks_to_free,
    blocks_to_skip,
    compact_rows,
    runs,
)

from .builds import vllm_loaded_by

B = 32


class SinkWindow(KVCompressor):
    """1 sink block + a window of 2 blocks (the last included), plus pinned blocks."""

    def __init__(self, params=None, sink=1, window=2):
        super().__init__(params)
        self.sink, self.window = sink, window

    def keep(self, view):
        n = view.num_blocks
        mine = set(range(min(self.sink, n))) | set(range(max(0, n - self.window), n))
        return sorted(mine | view.pinned)


class Answers(KVCompressor):
    """Returns a fixed answer."""

    def __init__(self, answer):
        super().__init__(None)
        self.answer = answer

    def keep(self, view):
        return self.answer


def view(num_tokens, pinned=(), prompt=10):
    return BlockView(num_tokens=num_tokens, block_size=B, num_prompt_tokens=prompt, pinned=frozenset(pinned))


# ------------------------------------------------------------------------ check_keep
def test_a_valid_answer_comes_back_as_ints():
    v = view(129, pinned={1})  # 5 blocks, the last one partial
    assert check_keep(v, [0, 1, 4], "p") == [0, 1, 4]
    assert check_keep(v, (0, 1, 4), "p") == [0, 1, 4]
    assert check_keep(v, np.array([0, 1, 4]), "p") == [0, 1, 4]
    assert check_keep(v, [np.int64(0), 1, torch.tensor(4)], "p") == [0, 1, 4]
    assert check_keep(view(0), [], "p") == []  # no blocks yet: nothing to keep


@pytest.mark.parametrize("answer, why", [
    ([0, 1], "the last block (4, being written) must be kept"),
    ([1, 0, 4], "sorted ascending, without duplicates"),
    ([0, 1, 1, 4], "sorted ascending, without duplicates"),
    ([0, 4], "pinned block(s) [1]"),
    ([0, 1, 5], "block(s) [5] are out of range(0, 5)"),
    ([-1, 1, 4], "block(s) [-1] are out of range"),
    ([0.0, 1, 4], "0.0 is not a block index"),
    ([True, 1, 4], "True is not a block index"),
    ({0, 1, 4}, "must be a list of block indices"),
    (None, "must be a list of block indices"),
    ("014", "must be a list of block indices"),
])
def test_each_broken_rule_is_named_with_the_plugin(answer, why):
    with pytest.raises(KeepError) as info:
        check_keep(view(129, pinned={1}), answer, "my-evict")
    msg = str(info.value)
    assert msg.startswith("kvcompress plugin 'my-evict': keep() returned")
    assert why in msg and "129 tokens in 5 blocks of 32" in msg


def test_dropped_blocks_is_the_complement():
    assert dropped_blocks(view(129), [0, 3, 4]) == [1, 2]
    assert dropped_blocks(view(129), [0, 1, 2, 3, 4]) == []


def test_the_noop_keeps_everything_and_passes_the_checks():
    entry = get_registry().get("kvcompress", "noop")
    noop = entry.registration.load()(entry.registration.params())
    assert noop.needs_scores is False
    for n in (1, 31, 32, 33, 200, 2048):
        v = view(n, pinned={0})
        assert dropped_blocks(v, check_keep(v, noop.keep(v), "noop")) == []


# ---------------------------------------------------------------- scheduler: blocks_to_free
def held(n, null=(), shared=()):
    """``n`` blocks as (is_null, ref_cnt)."""
    return [(i in null, 0 if i in null else (2 if i in shared else 1)) for i in range(n)]


def free(compressor, num_tokens, held_blocks, name="sw"):
    return blocks_to_free(compressor, name, num_tokens=num_tokens, block_size=B, num_prompt_tokens=10,
                          held=held_blocks)


def test_the_scheduler_frees_what_is_not_kept_and_not_freed_yet():
    sw = SinkWindow()
    assert free(sw, 96, held(3)) == []  # 3 blocks: all kept
    assert free(sw, 97, held(4)) == [1]  # the 4th block starts: block 1 leaves the window
    assert free(sw, 97, held(5)) == [1]  # a block allocated past the computed tokens is not asked about
    assert free(sw, 200, held(7, null={1})) == [2, 3, 4]  # block 1 went earlier
    assert free(sw, 200, held(7, null={1, 2, 3, 4})) == []


def test_shared_blocks_are_pinned_and_never_freed():
    seen = []

    class Spy(SinkWindow):
        def keep(self, view):
            seen.append(view.pinned)
            return super().keep(view)

    assert free(Spy(), 200, held(7, null={1}, shared={0, 2, 3})) == [4]
    assert seen == [frozenset({0, 2, 3})]
    with pytest.raises(KeepError, match=r"'forgets': .*pinned block\(s\) \[2\]"):
        free(Answers([0, 6]), 200, held(7, shared={2}), name="forgets")


def test_keeping_a_block_freed_earlier_is_an_error():
    with pytest.raises(KeepError, match=r"'back': .*block\(s\) \[1\] were dropped at an earlier step"):
        free(Answers([0, 1, 6]), 200, held(7, null={1, 2}), name="back")


def test_no_decision_before_every_computed_token_has_a_block():
    # A prefix-cache hit is appended after remove_skipped_blocks: the plugin is not asked.
    calls = []

    class Spy(SinkWindow):
        def keep(self, view):
            calls.append(view)
            return super().keep(view)

    assert free(Spy(), 200, held(3)) is None
    assert free(Spy(), 0, []) is None
    assert calls == []


# ------------------------------------------------------------------- worker: blocks_to_skip
def skip(compressor, num_tokens, name="sw"):
    return blocks_to_skip(compressor, name, num_tokens=num_tokens, block_size=B, num_prompt_tokens=10)


def test_the_worker_skips_what_keep_drops_with_no_pins():
    sw = SinkWindow()
    assert skip(sw, 0) == []  # a first prefill: nothing computed, no call
    assert skip(sw, 96) == []
    assert skip(sw, 97) == [1]
    assert skip(sw, 200) == [1, 2, 3, 4]
    with pytest.raises(KeepError, match="'bad'.*must be kept"):
        skip(Answers([0]), 200, name="bad")


def test_runs_groups_consecutive_indices():
    assert runs([]) == []
    assert runs([1, 2, 5, 7, 8, 9]) == [(1, 3), (5, 6), (7, 10)]


# --------------------------------------------------------------------- the row rewrite
def test_compact_rows_moves_kept_blocks_left_and_shortens_the_row():
    table = torch.tensor([[11, 12, 13, 14, 15, 16, 0, 0],
                          [21, 22, 23, 0, 0, 0, 0, 0],
                          [31, 32, 33, 34, 35, 36, 37, 38]], dtype=torch.int32)
    seq_lens = torch.tensor([6 * B - 5, 3 * B, 8 * B], dtype=torch.int32)
    before = (table.clone(), seq_lens.clone())
    new_table, new_lens = compact_rows(table, seq_lens, [[1, 2, 3], [], [0, 6]], B)
    assert new_table.tolist() == [[11, 15, 16, 0, 0, 0, 0, 0],
                                  [21, 22, 23, 0, 0, 0, 0, 0],
                                  [32, 33, 34, 35, 36, 38, 0, 0]]
    assert new_lens.tolist() == [3 * B - 5, 3 * B, 6 * B]
    assert new_table.dtype == table.dtype and new_lens.dtype == seq_lens.dtype
    assert torch.equal(table, before[0]) and torch.equal(seq_lens, before[1])  # inputs untouched


def test_compact_rows_leaves_rows_past_the_plan_alone():
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    new_table, new_lens = compact_rows(table, torch.tensor([128, 128, 128]), [[1]], B)
    assert new_table.tolist() == [[0, 2, 3, 0], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert new_lens.tolist() == [96, 128, 128]


def test_the_shortened_row_reads_exactly_the_kept_tokens():
    # Row i, position j < new seq_len reads physical slot table[i, j // B] * B + j % B: the
    # kept blocks' tokens in order, then the step's new tokens; no freed block's slot.
    physical = [7, 3, 9, 4, 8, 1]  # 6 blocks; the step's 1 query token is the last position
    num_tokens = 5 * B + 10  # computed before the step (last block partial)
    table = torch.tensor([physical + [0, 0]], dtype=torch.int32)
    seq_len = num_tokens + 1
    dropped = skip(SinkWindow(), num_tokens)
    assert dropped == [1, 2, 3]
    new_table, new_lens = compact_rows(table, torch.tensor([seq_len]), [dropped], B)
    slots = [int(new_table[0, j // B]) * B + j % B for j in range(int(new_lens[0]))]
    kept_positions = [p for p in range(seq_len) if p // B not in dropped]
    assert slots == [physical[p // B] * B + p % B for p in kept_positions]
    assert kept_positions[-1] == seq_len - 1  # the query is still the last position


# ------------------------------------------------------------------ both halves over a run
@pytest.mark.parametrize("prompt, shared_until", [(38, None), (71, None), (150, 260)])
def test_scheduler_and_worker_agree_over_a_generation(prompt, shared_until):
    """Simulate vLLM's order per step: the scheduler frees (with P computed tokens), then
    allocates the step's blocks; the worker then attends with the same P. With
    ``shared_until``, the prompt's full blocks are shared with another request (pinned)
    until that step."""
    sw = SinkWindow()
    blocks: list[list] = []  # [is_null, ref_cnt]
    freed_total = 0
    max_held = 0
    for computed in range(prompt, prompt + 300):
        if shared_until is not None:
            for i in range(min(prompt // B, len(blocks))):
                if not blocks[i][0]:
                    blocks[i][1] = 2 if computed < shared_until else 1
        if blocks:
            to_free = free(sw, computed, [tuple(b) for b in blocks])
            for i in to_free:
                assert blocks[i][1] == 1  # never a shared block
                blocks[i] = [True, 0]
            freed_total += len(to_free)
        while len(blocks) < -(-(computed + 1) // B):  # the step's new token needs a slot
            blocks.append([False, 1])
        held_now = sum(not b[0] for b in blocks)
        max_held = max(max_held, held_now)
        skipped = skip(sw, computed)
        read = [i for i in range(len(blocks)) if i not in skipped]
        assert all(not blocks[i][0] for i in read), "the worker must never read a freed block"
        assert set(skipped) >= {i for i, b in enumerate(blocks) if b[0]}
        if shared_until is None or computed >= shared_until:
            assert held_now <= 1 + 2 + 1
    if shared_until is None:
        assert max_held == 4
    assert freed_total == -(-(prompt + 299) // B) - 3


# ---------------------------------------------------------------------- activation
class NeedsScores(KVCompressor):
    needs_scores = True

    def keep(self, view):
        return list(range(view.num_blocks))


class _Plugin:
    @hookimpl
    def graft_register_kv_compressors(self, register):
        register(Registration(name="scored", summary="needs scores (test)", paper="-",
                              impl=f"{__name__}:NeedsScores", params=NoParams,
                              capabilities=Capabilities(lossless=False)))


def test_a_compressor_that_needs_scores_without_attend_gets_the_shared_attention():
    """A scorer is its policy alone: the worker runs the shared attention with mass for it
    (reading both cache layouts), where a plugin with its own attend keeps it."""
    import torch

    from vllm_graft.hooks import make_plugin_manager, validate
    from vllm_graft.integration.adapters.kvcompress.engine import ADAPTER
    from vllm_graft.integration.adapters.kvcompress.shared_attention import (
        attend_with_mass,
        layouts_read,
        uses_shared_attention,
    )
    from vllm_graft.integration.runtime import Runtime
    from vllm_graft.kit.conformance.exercises.attention import attention_case
    from vllm_graft.kit.conformance.exercises.kvcompress import _observed

    pm = make_plugin_manager(entry_points=False, trace=False)
    pm.register(_Plugin(), name="scored-test")
    plan = validate({"kvcompress": {"plugin": "scored"}}, pm.build_registry())
    runtime = Runtime()
    try:
        ADAPTER.activate(plan.by_kind("kvcompress"), plan, runtime)  # no longer refused
        impl = runtime.instance(plan.by_kind("kvcompress")[0])
    finally:
        ADAPTER.deactivate()
    assert uses_shared_attention(impl) and layouts_read(impl) == ("blocked", "packed", "cpu_vec")
    q, kv, batch, layer = attention_case((4, 2, 64, 16), "float32", seed=3, cache="blocked")
    out, mass = attend_with_mass(impl, q, kv, batch, layer, _observed(q.shape[0]))
    assert out.shape == q.shape and torch.isfinite(mass).all() and mass.sum() > 0

    class OwnAttend(NeedsScores):
        kv_layouts = ("blocked",)

        def attend(self, query, kv_cache, batch, layer, observe, head_mask=None):
            return "own", None

    own = OwnAttend(NoParams())
    assert not uses_shared_attention(own) and layouts_read(own) == ("blocked",)
    assert attend_with_mass(own, q, kv, batch, layer, None) == ("own", None)


def test_the_adapter_module_and_its_pure_logic_load_no_vllm():
    code = ("import vllm_graft.integration.adapters.kvcompress.engine as k\n"
            "from vllm_graft.integration.adapters.kvcompress import channel, plan, rows, salt, scores, state")
    assert vllm_loaded_by(code) == "[]"


# ------------------------------------------------------------- prefix-cache salt, scores
def test_the_salt_names_the_compressor_and_its_parameters_and_keeps_the_users():
    from vllm_graft.integration.adapters.kvcompress.salt import cache_salt, salted

    reg = get_registry().get("kvcompress", "streaming").registration
    a = cache_salt("streaming", reg.params(budget_blocks=4))
    b = cache_salt("streaming", reg.params(budget_blocks=8))
    assert a == 'vllm-graft/kvcompress/streaming/{"budget_blocks":4,"sink_blocks":1}' and a != b
    assert salted(None, a) == a and salted("", a) == a
    assert salted("user", a) == a + "|user"
    assert salted("user", None) == "user" and salted(None, None) is None


def test_worker_scores_accumulate_per_logical_block_and_drops_are_final():
    """The worker half of the scores channel without vLLM: a step's mass per compacted
    column lands on the right logical block, keep() sees -inf for dropped blocks, and only
    newly dropped blocks are reported."""
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _StepPlan

    reg = get_registry().get("kvcompress", "h2o").registration
    h2o = reg.load()(reg.params(budget_blocks=3, sink_blocks=1, recent_blocks=1))
    events = []
    sc = _Scores(h2o, "h2o", lambda ev, n: events.append((ev, n)))

    def step(computed, q, mass_row, skip):
        nb = -(-(computed + q) // B)
        cols = [j for j in range(nb) if j not in skip]
        sc.pending = _StepPlan([("r", computed, q, 10, skip)], [cols], torch.ones(q, dtype=torch.bool),
                               torch.tensor([mass_row + [0.0] * (8 - len(mass_row))]), B)
        return sc.finalize()

    # 4 blocks after the step: over budget 3 -> sink 0, last 3, heaviest of {1, 2}
    assert step(3 * B, 1, [1.0, 0.2, 0.9, 0.1], []) == {"r": [1]}
    assert sc.skip("r", 3 * B + 1, B) == [1]
    # compacted columns [0, 2, 3] -> logical [0, 2, 3]; block 2 gets mass, block 3 little
    assert step(4 * B, 1, [0.5, 0.5, 0.1, 0.0], [1]) == {"r": [3]}  # block 4 opened
    assert sc.reqs["r"].scores[:4] == pytest.approx([1.5, 0.2, 1.4, 0.2])
    assert step(4 * B + 1, 1, [0.5, 0.5, 0.0], [1, 3]) == {}  # nothing new
    sc.forget(["r"])
    assert sc.skip("r", 4 * B + 2, B) == [] and "r" not in sc.reqs
    assert ("worker_steps", 1) in events
