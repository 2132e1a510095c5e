"""The step's drafts ride on the worker's ``sample_tokens`` output, so the multiprocess engine
core does not ask the worker for them in a round trip of its own
(``adapters/speculative/engine.py``, "The drafts ride with the step's output")."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from vllm_graft.integration.adapters.speculative import engine
from vllm_graft.integration.adapters.speculative.engine import GraftProposer


class Runner:
    def __init__(self, drafter, req_ids, drafts):
        self.drafter, self.req_ids, self.drafts, self.takes = drafter, req_ids, drafts, 0

    def take_draft_token_ids(self):
        self.takes += 1
        return None if self.drafts is None else DraftTokenIds(self.req_ids, self.drafts)


def _worker(drafter, output, req_ids=("a", "b"), drafts=([1, 2], []), backend="mp"):
    runner = Runner(drafter, list(req_ids), None if drafts is None else [list(d) for d in drafts])
    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))
    worker = SimpleNamespace(model_runner=runner, vllm_config=config)
    wrapped = engine._worker_sample_tokens_wrapper(lambda self, grammar: output)
    return wrapped(worker, None), runner


def _output():
    return ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[5], [6]])


def test_the_worker_attaches_what_take_draft_token_ids_answers_a_copy_of_its_ids():
    out, runner = _worker(GraftProposer.__new__(GraftProposer), _output())
    drafts = getattr(out, engine.DRAFTS_ATTRIBUTE)
    assert (drafts.req_ids, drafts.draft_token_ids) == (["a", "b"], [[1, 2], []])
    runner.req_ids.append("c")  # the runner's list changes with the next step: the ride's does not
    assert drafts.req_ids == ["a", "b"]
    # through pickle, as the multiprocess executor's queue carries it
    back = pickle.loads(pickle.dumps(out))
    assert getattr(back, engine.DRAFTS_ATTRIBUTE).draft_token_ids == [[1, 2], []]
    # no drafts this step (take_draft_token_ids answers None): None rides, not "unknown"
    out, _ = _worker(GraftProposer.__new__(GraftProposer), _output(), drafts=None)
    assert getattr(out, engine.DRAFTS_ATTRIBUTE) is None


def test_the_worker_leaves_other_drafters_and_outputs_alone():
    out, runner = _worker(object(), _output())  # vLLM's own proposer (ngram, suffix, EAGLE)
    assert not hasattr(out, engine.DRAFTS_ATTRIBUTE) and runner.takes == 0
    out, runner = _worker(GraftProposer.__new__(GraftProposer), EMPTY_MODEL_RUNNER_OUTPUT)
    assert out is EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(out, engine.DRAFTS_ATTRIBUTE)  # vLLM's shared one
    # an in-process engine (UniProcExecutor, "uni") or Ray: their take_draft_token_ids is not
    # patched, so nothing is attached (and the runner is not asked twice)
    for backend in ("uni", "ray"):
        out, runner = _worker(GraftProposer.__new__(GraftProposer), _output(), backend=backend)
        assert not hasattr(out, engine.DRAFTS_ATTRIBUTE) and runner.takes == 0
    async_output = SimpleNamespace(get_output=lambda: None)  # an asynchronous scheduler's output
    out, runner = _worker(GraftProposer.__new__(GraftProposer), async_output)
    assert not hasattr(out, engine.DRAFTS_ATTRIBUTE) and runner.takes == 0


class Executor:
    """The engine core's side: ``sample_tokens`` returns what the worker sent;
    ``take_draft_token_ids`` is the round trip (counted)."""

    def __init__(self):
        self.round_trips = 0
        self.sample_tokens = engine._executor_sample_tokens_wrapper(Executor._sample).__get__(self)
        self.take_draft_token_ids = engine._executor_take_drafts_wrapper(Executor._take).__get__(self)
        self.next_output = None

    def _sample(self, grammar_output, non_block=False):
        return self.next_output

    def _take(self):
        self.round_trips += 1
        return "asked"


def test_the_engine_core_answers_from_the_ride_once_and_asks_otherwise():
    ex = Executor()
    ride = DraftTokenIds(["a"], [[7]])
    ex.next_output = SimpleNamespace(**{engine.DRAFTS_ATTRIBUTE: ride})
    ex.sample_tokens(None)
    assert ex.take_draft_token_ids() is ride and ex.round_trips == 0
    assert ex.take_draft_token_ids() == "asked" and ex.round_trips == 1  # used once: the next take asks
    ex.next_output = SimpleNamespace(**{engine.DRAFTS_ATTRIBUTE: None})  # the worker had no drafts
    ex.sample_tokens(None)
    assert ex.take_draft_token_ids() is None and ex.round_trips == 1
    ex.next_output = SimpleNamespace()  # no ride (another proposer, an aggregated output)
    ex.sample_tokens(None)
    assert ex.take_draft_token_ids() == "asked" and ex.round_trips == 2
    ex.next_output = SimpleNamespace(**{engine.DRAFTS_ATTRIBUTE: ride})
    ex.sample_tokens(None)
    ex.next_output = SimpleNamespace(**{engine.DRAFTS_ATTRIBUTE: ride})
    ex.sample_tokens(None, non_block=True)  # a Future's result is not read here: no stale ride kept
    assert ex.take_draft_token_ids() == "asked" and ex.round_trips == 3


def test_the_three_patches_are_in_the_register():
    from vllm_graft.integration import targets

    for t in (targets.SPEC_WORKER_SAMPLE_TOKENS, targets.SPEC_EXECUTOR_SAMPLE_TOKENS, targets.SPEC_EXECUTOR_TAKE_DRAFTS):
        assert t in targets.PATCH_TARGETS and callable(getattr(t.resolve(), t.attribute))
