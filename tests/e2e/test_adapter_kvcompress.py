"""The KV-compression adapter in vLLM's CPU engine (in-process) on the bundled tiny Llama.

* the noop compressor is called in both halves (scheduler and worker) every step and gives
  plain vLLM's greedy tokens, bit for bit in the log-probabilities;
* a test-only deterministic compressor (1 sink block + a window of 2 blocks, 32-token
  blocks) really frees blocks: each request holds at most sink + window + 1 blocks while its
  sequence grows to ~3x what they hold, the pool's free count stays within that bound, tokens
  equal plain vLLM's until the first eviction, and every log-probability equals that of a
  reference (transformers) whose attention is masked to the kept blocks, not plain causal
  attention;
* prefill chunks attend to the blocks kept so far (masked reference again); blocks shared
  through the prefix cache are pinned: held while shared, yet left out of attention;
* compressors that break the rules are stopped with an error naming them, one that needs
  scores is refused at start;
* a plain engine built afterwards in the same process is plain vLLM again.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default check fails on small VMs

import gc  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from vllm_graft.hooks import BlockView, Capabilities, Kind, KVCompressor, Registration, hookimpl  # noqa: E402
from vllm_graft.hooks import manager as manager_mod  # noqa: E402
from vllm_graft.integration.plan import plan_for  # noqa: E402

from . import kvcompress_scenario as scenario  # noqa: E402  (its code prompts)

pytestmark = pytest.mark.e2e

LLAMA = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
BLOCK = 32  # engine block size (CPU: a multiple of 32)
SINK, WINDOW = 1, 2  # blocks kept by the test compressor
NEW_TOKENS = 300  # ~3x the tokens of the blocks the test compressor keeps
ENGINE = {"dtype": "float32", "max_model_len": 1024, "block_size": BLOCK, "enforce_eager": True}
# Two code prompts of different lengths (38 and 71 tokens: their last prompt tokens lie in
# different blocks), so that a row given the other request's prompt length shows.
PROMPTS = scenario.PROMPTS[:2]
# A 185-token prompt, prefilled in chunks of CHUNK tokens: the third chunk already runs
# with a block dropped.
LONG_PROMPT = (
    scenario.PROMPTS[2] + PROMPTS[1].split("\n\n    def peek")[0]
    + "\n\n    def close(self):\n        if self._file is not None:\n            self._file.close()\n"
    "            self._file = None\n\n    def __enter__(self):\n        return self\n\n"
    "    def __exit__(self, *args):\n        self.close()\n\n\n" + PROMPTS[0])
CHUNK = 64


# ---------------------------------------------------------------- test-only compressors
def sink_window(num_blocks: int, sink: int, window: int) -> list[int]:
    return sorted(set(range(min(sink, num_blocks))) | set(range(max(0, num_blocks - window), num_blocks)))


class WindowParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sink_blocks: int = Field(SINK, ge=0, description="blocks kept at the start")
    window_blocks: int = Field(WINDOW, ge=1, description="most recent blocks kept (the last included)")


class SinkWindow(KVCompressor):
    """StreamingLLM at block granularity: the first blocks and the most recent ones. Records
    every view it is shown (class-level: the instance is built inside vLLM)."""

    views: list[BlockView] = []

    def keep(self, view):
        SinkWindow.views.append(view)
        mine = sink_window(view.num_blocks, self.params.sink_blocks, self.params.window_blocks)
        return sorted(set(mine) | view.pinned)


class DropsLast(KVCompressor):
    """Breaks a rule: drops the block being written once there are two."""

    def keep(self, view):
        return list(range(view.num_blocks - 1)) if view.num_blocks >= 2 else list(range(view.num_blocks))


SCORED_VIEWS: list[BlockView] = []


class WantsScores(KVCompressor):
    """Needs scores and implements no attend(): the worker's shared attention with mass serves it."""

    needs_scores = True

    def keep(self, view):
        SCORED_VIEWS.append(view)
        return list(range(view.num_blocks))


class _TestCompressors:
    @hookimpl
    def graft_register_kv_compressors(self, register):
        for name, cls, params in (("test-window", "SinkWindow", WindowParams),
                                  ("test-drops-last", "DropsLast", None),
                                  ("test-scores", "WantsScores", None)):
            extra = {"params": params} if params else {}
            register(Registration(name=name, summary=f"{cls} (test)", paper="-", impl=f"{__name__}:{cls}",
                                  capabilities=Capabilities(lossless=False), **extra))


@pytest.fixture(scope="module", autouse=True)
def registry_with_test_compressors():
    """The process-wide registry (what the bridge validates additional_config against)
    with the installed plugins plus the test compressors."""
    pm = manager_mod.make_plugin_manager()
    pm.register(_TestCompressors(), name="tests.e2e.test_adapter_kvcompress")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manager_mod, "_cached", (pm, pm.build_registry()))
        yield


# ------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(LLAMA)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert [len(i) // BLOCK for i in ids] == [1, 2]
    return ids


@pytest.fixture(scope="module")
def long_prompt_ids():
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(LLAMA)(LONG_PROMPT, add_special_tokens=False)["input_ids"]
    assert 2 * CHUNK < len(ids) <= 3 * CHUNK
    return ids


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[list[float]]  # of each sampled token
    events: dict[str, int]
    manager: str  # class of the KV-cache manager vLLM built
    spec: str
    held: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # row -> (computed tokens, blocks held) per step
    free_min: int = 0  # fewest free blocks in the pool during the run
    free_start: int = 0
    views: list[BlockView] = field(default_factory=list)  # what the test compressor was shown

    def step_starts(self, row: int) -> list[int]:
        """Tokens computed before each of the request's steps (prefill chunks, decodes)."""
        return [0] + sorted({n for n, _ in self.held[row]})


def deployment_plan(kvcompress=None, engine=None):
    data = {"model": str(LLAMA), "engine": {**ENGINE, **(engine or {})}}
    if kvcompress:
        data["kvcompress"] = kvcompress
    return plan_for(data)


def run(prompt_ids, kvcompress=None, new_tokens=NEW_TOKENS, engine=None) -> Run:
    """Generate greedily for the prompts, stepping the engine to watch its block pool."""
    from vllm import LLM, SamplingParams

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.runtime import RUNTIME

    llm = LLM(**launch.llm_kwargs(deployment_plan(kvcompress, engine), graft=bool(kvcompress)), seed=0)
    try:
        RUNTIME.events.clear()
        SinkWindow.views.clear()
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        kv = scheduler.kv_cache_manager
        (manager,) = kv.coordinator.single_type_managers
        pool = kv.block_pool
        r = Run([], [], {}, type(manager).__name__, type(manager.kv_cache_spec).__name__,
                free_start=pool.get_num_free_blocks())
        r.free_min = r.free_start
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
        rows = {}  # the engine's internal request id -> prompt index
        for i, prompt in enumerate(prompt_ids):
            rows[engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)] = i
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out  # the id given to add_request
            for req_id, blocks in manager.req_to_blocks.items():
                held = sum(not b.is_null for b in blocks)
                r.held.setdefault(rows[req_id], []).append((scheduler.requests[req_id].num_computed_tokens, held))
            r.free_min = min(r.free_min, pool.get_num_free_blocks())
        for i in range(len(prompt_ids)):
            out = final[f"r{i}"].outputs[0]
            r.tokens.append(list(out.token_ids))
            r.logprobs.append([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
        r.events = {ev: n for (kind, _, ev), n in RUNTIME.events.items() if kind == Kind.KVCOMPRESS}
        r.views = list(SinkWindow.views)
    finally:
        del llm
        gc.collect()
    return r


@pytest.fixture(scope="module")
def plain(prompt_ids):
    r = run(prompt_ids)
    assert (r.manager, r.spec) == ("FullAttentionManager", "FullAttentionSpec")
    assert r.events == {}
    return r


WINDOW_PLUGIN = {"plugin": "test-window", "params": {"sink_blocks": SINK, "window_blocks": WINDOW}}


@pytest.fixture(scope="module")
def window(prompt_ids, plain):
    return run(prompt_ids, WINDOW_PLUGIN)


# ------------------------------------------------------------------- masked reference
def reference_logprobs(prompt: list[int], tokens: list[int], starts: list[int] | None = None) -> list[float]:
    """Log-probabilities of ``tokens`` after ``prompt`` in transformers (fp32, eager), with
    plain causal attention, or (given the tokens computed before each of the request's
    steps, ``starts``) masked as the engine runs the test compressor: a query at position q,
    computed in the step that began with P tokens computed, reads the blocks sink_window
    keeps of those P tokens' blocks, the blocks the step writes, causally."""
    import torch

    model = _hf_model()
    ids = prompt + tokens[:-1]
    n = len(ids)
    mask = None
    if starts is not None:
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
        for q in range(n):
            p = max(s for s in starts if s <= q)
            nb = -(-p // BLOCK)
            kept = set(sink_window(nb, SINK, WINDOW)) | set(range(nb, q // BLOCK + 1))
            allowed[q, : q + 1] = torch.tensor([k // BLOCK in kept for k in range(q + 1)])
        mask = torch.zeros(1, 1, n, n)
        mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


_hf = []


def _hf_model():
    if not _hf:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.float32, attn_implementation="eager")
        _hf.append(model.eval())
    return _hf[0]


def first_eviction(num_prompt_tokens: int) -> int:
    """Index of the first generated token computed after a block was dropped: the decode
    step with q computed tokens drops one once ceil(q / BLOCK) > SINK + WINDOW."""
    q = (SINK + WINDOW) * BLOCK + 1
    return q - num_prompt_tokens + 1


# -------------------------------------------------------------------------------- tests
def test_noop_is_called_in_both_halves_and_matches_plain_vllm(prompt_ids, plain):
    noop = run(prompt_ids, {"plugin": "noop"})
    assert (noop.manager, noop.spec) == ("GraftKVCompressManager", "GraftKVCompressSpec")
    assert noop.tokens == plain.tokens
    assert noop.logprobs == plain.logprobs  # the same attention, bit for bit
    decode_steps = sum(len(t) - 1 for t in noop.tokens)  # one keep() per request and decode step
    assert noop.events == {"steps": decode_steps, "worker_steps": decode_steps}
    for row, trace in noop.held.items():  # nothing freed: every block of the sequence is held
        assert all(held == -(-n // BLOCK) for n, held in trace), row


def test_window_compressor_frees_blocks_and_bounds_what_a_request_holds(prompt_ids, plain, window):
    bound = SINK + WINDOW + 1  # kept blocks + the block the new token goes to
    for row, trace in window.held.items():
        longest = max(n for n, _ in trace)
        assert longest == len(prompt_ids[row]) + NEW_TOKENS - 2  # seen before the last step
        assert -(-longest // BLOCK) > 2 * bound  # what plain vLLM holds
        assert max(h for _, h in trace) == bound, (row, trace)
    # the pool: both requests together never took more than 2 x bound blocks; plain vLLM
    # took every block of both sequences
    assert window.free_start - window.free_min <= 2 * bound
    full = sum(-(-(len(p) + NEW_TOKENS - 2) // BLOCK) for p in prompt_ids)
    assert plain.free_start - plain.free_min >= full > 2 * 2 * bound
    decode_steps = sum(len(t) - 1 for t in window.tokens)
    assert window.events["steps"] == window.events["worker_steps"] == decode_steps
    # the last step is scheduled with prompt + NEW_TOKENS - 2 tokens computed: every block
    # of those but the kept ones was freed, each once
    per_request = [-(-(len(p) + NEW_TOKENS - 2) // BLOCK) - SINK - WINDOW for p in prompt_ids]
    assert window.events["blocks_freed"] == sum(per_request)
    assert window.events["blocks_skipped"] > window.events["blocks_freed"]  # per step, per row
    # generation completes with valid, finite tokens
    assert [len(t) for t in window.tokens] == [NEW_TOKENS] * 2
    assert all(math.isfinite(lp) for lps in window.logprobs for lp in lps)


def test_window_compressor_saw_each_request_with_its_own_prompt_length(prompt_ids, window):
    # Both halves ask keep() at every decode step q = prompt, ..., prompt + NEW_TOKENS - 2,
    # with the request's own prompt length (a worker row mapped to the wrong request breaks this).
    expected = {(len(p) + k, len(p)) for p in prompt_ids for k in range(NEW_TOKENS - 1)}
    seen = [(v.num_tokens, v.num_prompt_tokens) for v in window.views]
    assert set(seen) == expected
    assert len(seen) == 2 * len(expected)
    assert all(v.block_size == BLOCK and v.scores is None and not v.pinned for v in window.views)


def test_window_compressor_equals_masked_attention(prompt_ids, plain, window):
    for row, prompt in enumerate(prompt_ids):
        first = first_eviction(len(prompt))
        assert 0 < first < NEW_TOKENS // 2
        # before any block is dropped: plain vLLM's tokens
        assert window.tokens[row][:first] == plain.tokens[row][:first]
        got = window.logprobs[row]
        starts = window.step_starts(row)
        assert starts == [0] + list(range(len(prompt), len(prompt) + NEW_TOKENS - 1))  # prefill, decodes
        masked = reference_logprobs(prompt, window.tokens[row], starts)
        causal = reference_logprobs(prompt, window.tokens[row])
        err = max(abs(a - b) for a, b in zip(got, masked))
        assert err < 1e-4, f"row {row}: vLLM with the window compressor vs masked reference: {err}"
        # and the mask matters: after the first eviction plain attention gives other numbers
        diff = max(abs(a - b) for a, b in zip(got[first:], causal[first:]))
        assert diff > 50 * err + 1e-2, f"row {row}: {diff}"
        assert max(abs(a - b) for a, b in zip(got[:first], causal[:first])) < 1e-4


def test_prefill_chunks_attend_to_the_blocks_kept_so_far(prompt_ids, long_prompt_ids):
    """A long prompt prefilled in CHUNK-token chunks next to a short request: the chunk that
    starts with 2 x CHUNK tokens computed already reads a block fewer."""
    r = run([long_prompt_ids, prompt_ids[0]], WINDOW_PLUGIN, new_tokens=40,
            engine={"max_num_batched_tokens": CHUNK})
    prompts = [long_prompt_ids, prompt_ids[0]]
    # three chunks (the last one with the short request beside it), then decodes
    assert r.step_starts(0)[:5] == [0, CHUNK, 2 * CHUNK, len(long_prompt_ids), len(long_prompt_ids) + 1]
    assert 2 * CHUNK > (SINK + WINDOW) * BLOCK  # so the third chunk runs with a block dropped
    assert (2 * CHUNK, len(long_prompt_ids)) in {(v.num_tokens, v.num_prompt_tokens) for v in r.views}
    for row, prompt in enumerate(prompts):
        got = r.logprobs[row]
        masked = reference_logprobs(prompt, r.tokens[row], r.step_starts(row))
        err = max(abs(a - b) for a, b in zip(got, masked))
        assert err < 1e-4, f"row {row}: chunked prefill vs masked reference: {err}"
    # and the chunks matter: the same run with the prompt prefilled in one step (no block
    # dropped before decoding) gives other numbers
    starts = r.step_starts(0)
    one_step = reference_logprobs(long_prompt_ids, r.tokens[0], [0] + [s for s in starts if s >= len(long_prompt_ids)])
    diff = max(abs(a - b) for a, b in zip(r.logprobs[0], one_step))
    assert diff > max(1e-3, 20 * err), diff
    for trace in r.held.values():
        assert max(h for _, h in trace) <= SINK + WINDOW + -(-CHUNK // BLOCK) + 1  # + a chunk's blocks


def test_blocks_shared_through_the_prefix_cache_are_pinned_not_freed(prompt_ids):
    """Two requests with one prompt: the second hits the prefix cache for the prompt's full
    blocks, which both then share. They are pinned: never freed while shared, though the
    worker leaves the one outside the window out of attention, as the compressor chose."""
    prompt = prompt_ids[1]
    shared = len(prompt) // BLOCK  # full prompt blocks: [0, 1]
    new_tokens = 200
    r = run([prompt, prompt], WINDOW_PLUGIN, new_tokens=new_tokens)
    scheduler_views = [v for v in r.views if v.pinned]
    assert scheduler_views and all(v.pinned == frozenset(range(shared)) for v in scheduler_views)
    bound = SINK + WINDOW + 1
    for trace in r.held.values():
        assert max(h for _, h in trace) == bound + shared - SINK  # + block 1, shared, outside the window
    per_request = -(-(len(prompt) + new_tokens - 2) // BLOCK) - SINK - WINDOW - (shared - SINK)
    assert r.events["blocks_freed"] == 2 * per_request
    assert r.tokens[0] == r.tokens[1] and r.logprobs[0] == r.logprobs[1]
    masked = reference_logprobs(prompt, r.tokens[0], r.step_starts(0))
    assert max(abs(a - b) for a, b in zip(r.logprobs[0], masked)) < 1e-4


def test_a_rule_breaking_compressor_is_stopped_with_its_name(prompt_ids):
    from vllm_graft.integration.adapters.kvcompress.keep import KeepError

    with pytest.raises(Exception) as info:
        run(prompt_ids[:1], {"plugin": "test-drops-last"}, new_tokens=8)
    err = info.value
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    keep_errors = [e for e in chain if isinstance(e, KeepError)]
    assert keep_errors, f"no KeepError in {chain!r}"
    assert "'test-drops-last'" in str(keep_errors[0]) and "must be kept" in str(keep_errors[0])


def test_a_compressor_needing_scores_without_attend_gets_the_shared_attention(prompt_ids, plain):
    SCORED_VIEWS.clear()
    got = run(prompt_ids[:1], {"plugin": "test-scores"}, new_tokens=2)
    assert got.tokens == [t[:2] for t in plain.tokens[:1]]  # keeps every block: plain's greedy tokens
    assert SCORED_VIEWS and all(v.scores is not None and v.step_scores is not None for v in SCORED_VIEWS)
    assert any(s > 0 for v in SCORED_VIEWS for s in v.scores)  # the mass of real attention


def test_a_plain_engine_afterwards_is_unchanged(prompt_ids, plain, window):
    from vllm_graft.integration.adapters import backend
    from vllm_graft.integration.patches import PATCHES

    again = run(prompt_ids)
    assert (again.manager, again.spec) == ("FullAttentionManager", "FullAttentionSpec")
    assert again.tokens == plain.tokens and again.logprobs == plain.logprobs
    assert again.events == {}
    assert not backend.SEAMS.owners and not backend.SEAMS.rewriters and backend.SEAMS.customize_spec is None
    assert not [p for p in PATCHES.applied() if p.owner == "adapters.kvcompress"]
