"""The report's speculative counters against vLLM's (issue 35): what Drafting counts per step,
how `vllm-graft report` waits for the last events, reads /metrics and explains differences."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np

from vllm_graft.hooks import Proposer
from vllm_graft.cli import engine_commands as run
from vllm_graft.integration.adapters.speculative.drafting import Drafting


class Repeat(Proposer):
    def __init__(self, params=None):
        pass

    def propose(self, request_id, token_ids, max_tokens):
        return [token_ids[-1]] * max_tokens


def make(k=3):
    counts = Counter()
    d = Drafting(Repeat(), "repeat", k=k, max_model_len=100, vocab_size=50,
                 count=lambda ev, n: counts.update({ev: n}))
    return d, counts


def rows(*seqs):
    ids = np.zeros((len(seqs) + 1, 100), dtype=np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return ids, np.array([len(s) for s in seqs] + [0], dtype=np.int32)


def test_accepted_is_counted_in_the_step_that_verified_the_drafts():
    d, counts = make()
    d.step_started([], {})
    ids, n = rows([1, 2, 3])
    d.propose(["a"], [[3]], n, ids)
    # the next step verifies a's 3 drafts (one slot invalidated by vLLM: -1); the target keeps 1
    d.step_started([], {"a": [3, -1, 3]})
    ids, n = rows([1, 2, 3, 3, 7])
    d.propose(["a"], [[3, 7]], n, ids)
    assert counts["verified"] == 2 and counts["accepted"] == 1
    assert "verified_without_propose" not in counts


def test_drafts_verified_in_a_step_without_propose_are_counted_at_the_next_step():
    # vLLM skips the drafter when a request is within k tokens of max_model_len and verifies
    # placeholder drafts (token id 0) of its own: no propose() sees that step's outcome
    d, counts = make()
    d.step_started([], {"a": [0, 0, 0], "b": [0]})
    d.step_started(["a"], {"b": [0]})  # no propose in between
    assert counts["verified_without_propose"] == 4
    d.step_started(["b"], {})
    assert counts["verified_without_propose"] == 5
    assert "verified" not in counts and "accepted" not in counts


def test_notes_compare_with_metrics_and_name_each_difference():
    events = {"verified": 592, "verified_without_propose": 4, "accepted": 180, "drafted": 636,
              "seeded_undrafted": 48}
    metrics = {"vllm:spec_decode_num_draft_tokens_total": 596.0,
               "vllm:spec_decode_num_accepted_tokens_total": 184.0}
    draft, acc, drafted, seeded = run.spec_counter_notes(events, metrics)
    assert "spec_decode_num_draft_tokens" in draft and "/metrics: 596, equal" in draft
    assert "/metrics: 184, DIFFERENT" in acc and "placeholder drafts" in acc and "max_model_len" in acc
    assert "44 of these were never verified" in drafted
    assert "48" in seeded and "seeded" in seeded
    # equal figures, no extra lines; no metrics given: no comparison
    plain = {"verified": 10, "accepted": 4, "drafted": 10}
    lines = run.spec_counter_notes(plain, {"vllm:spec_decode_num_draft_tokens_total": 10.0,
                                           "vllm:spec_decode_num_accepted_tokens_total": 4.0})
    assert len(lines) == 2 and all(", equal" in x for x in lines)
    assert "/metrics" not in " ".join(run.spec_counter_notes(plain))
    missing = run.spec_counter_notes(plain, {})
    assert "no such counter" in missing[0]


def test_parse_metrics_sums_label_sets_and_skips_comments():
    text = ("# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.\n"
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 700.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 44.0\n'
            "process_open_fds 12.0\n"
            "garbage line\n")
    m = run.parse_metrics(text)
    assert m["vllm:spec_decode_num_draft_tokens_total"] == 744.0 and m["process_open_fds"] == 12.0
    assert "garbage" not in m


def _write(folder, name, written_at, events):
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({
        "pid": 1, "process": name.rsplit("-", 1)[0], "written_at": written_at, "tensor_parallel_rank": None,
        "plugins": [{"kind": "speculative", "name": "p", "events": events}]}))


class Clock:
    def __init__(self, now):
        self.now = now
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def test_report_waits_until_no_process_rewrote_its_report_for_a_while(tmp_path):
    f = tmp_path / "r"
    _write(f, "VllmWorker-0-11", 100.0, {"accepted": 5})
    clock = Clock(100.5)  # written half a second ago: the last events may still be on their way
    summed, settled = run.read_settled_reports(str(f), quiet_s=2.5, timeout_s=6, clock=clock, sleep=clock.sleep)
    assert settled and clock.slept and clock.now >= 102.5
    assert summed["plugins"][0]["events"] == {"accepted": 5}
    # long idle files: still one quiet period from the call, since events counted just before it
    # are written only within a report period (a run of 20 requests can take less than one)
    clock = Clock(200.0)
    _, settled = run.read_settled_reports(str(f), quiet_s=2.5, timeout_s=6, clock=clock, sleep=clock.sleep)
    assert settled and 202.5 <= clock.now < 203


def test_report_sees_events_written_after_it_was_called(tmp_path):
    """The race CI met: every file long idle (written at activation), the run's events counted in
    the last half second and written by the worker's reporter a moment after the call."""
    f = tmp_path / "r"
    _write(f, "VllmWorker-0-11", 90.0, {})
    clock = Clock(100.0)

    def sleep(s):
        clock.sleep(s)
        if not (f / "VllmWorker-0-11.json").read_text().count("accepted"):
            _write(f, "VllmWorker-0-11", 100.6, {"accepted": 7})  # the reporter's next period

    summed, settled = run.read_settled_reports(str(f), quiet_s=2.5, timeout_s=6, clock=clock, sleep=sleep)
    assert settled and summed["plugins"][0]["events"] == {"accepted": 7} and clock.now >= 103.1


def test_report_gives_up_waiting_on_a_busy_server_and_says_so(tmp_path):
    f = tmp_path / "r"
    clock = Clock(100.0)

    def sleep(s):  # the worker rewrites its report every second while it serves
        clock.sleep(s)
        _write(f, "VllmWorker-0-11", clock.now - 0.2, {"accepted": int(clock.now)})

    _write(f, "VllmWorker-0-11", 99.9, {"accepted": 1})
    _, settled = run.read_settled_reports(str(f), quiet_s=2.5, timeout_s=6, clock=clock, sleep=sleep)
    assert settled is False and clock.now <= 106.5


def test_reports_of_an_earlier_server_run_in_the_same_folder_are_flagged():
    procs = [{"process": "MainProcess"}, {"process": "EngineCore"}, {"process": "VllmWorker-0"}]
    assert run._earlier_runs(procs) == 0
    assert run._earlier_runs(procs + [{"process": "EngineCore"}, {"process": "VllmWorker-0"}]) == 2


def test_report_reads_a_saved_copy_of_metrics(tmp_path):
    # /metrics is gone once the server stops; a stopped server's reports are the complete ones
    saved = tmp_path / "metrics.txt"
    saved.write_text('# HELP x\nvllm:spec_decode_num_draft_tokens_total{engine="0"} 12.0\n'
                     'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 5.0\n')
    got = run._fetch_metrics(str(saved))
    assert got["vllm:spec_decode_num_draft_tokens_total"] == 12.0
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == 5.0


def _count_and_exit(folder: str) -> None:
    from vllm_graft.hooks import Kind, get_registry, validate
    from vllm_graft.integration.runtime import Runtime

    rt = Runtime(plan=validate({"speculative": {"plugin": "lookahead"}}, get_registry()))
    rt.start_reporting(folder)  # written at once, with no events yet
    rt.count(Kind.SPECULATIVE, "lookahead", "verified", 7)  # then it ends within a report period


def test_a_forked_process_writes_its_last_events_as_it_exits(tmp_path):
    # vLLM's engine core and workers are multiprocessing children: a forked one ends through
    # os._exit, which runs no atexit handler (issue 64: a stopped server's worker lost its last
    # second); multiprocessing's exit finalizers do run
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_count_and_exit, args=(str(tmp_path),), name="VllmWorker-0")
    p.start()
    p.join(30)
    assert p.exitcode == 0
    (report,) = tmp_path.glob("VllmWorker-0-*.json")
    assert json.loads(report.read_text())["pid"] == p.pid
    (plugin,) = run.read_reports(str(tmp_path))["plugins"]
    assert plugin["events"] == {"verified": 7}


def test_no_drafts_in_a_step_over_the_deployments_load_limit():
    # issue 64: lookahead lost to plain vLLM under load (47.8 s against 39.3 s at 48 concurrent
    # requests); `speculative.max_batch` is a stated limit the adapter enforces
    counts = Counter()
    d = Drafting(Repeat(), "repeat", k=3, max_model_len=100, vocab_size=50,
                 count=lambda ev, n: counts.update({ev: n}), max_batch=2)
    d.step_started([], {})
    ids, n = rows([1, 2], [3, 4], [5, 6])
    assert d.propose(["a", "b", "c"], [[2], [4], [6]], n, ids) == [[], [], []]  # 3 decoding > 2
    assert counts["over_max_batch"] == 1 and "propose" not in counts and "drafted" not in counts
    d.step_started([], {})
    ids, n = rows([1, 2, 2], [3, 4, 4])
    assert d.propose(["a", "b"], [[2], [4]], n, ids) == [[2, 2, 2], [4, 4, 4]]  # 2: drafts again
    assert counts["propose"] == 2 and counts["over_max_batch"] == 1


def test_the_load_limit_is_validated_and_travels_with_the_deployment():
    import pytest

    from vllm_graft.hooks import DeploymentError, get_registry, validate

    plan = validate({"speculative": {"plugin": "lookahead", "max_batch": 8}}, get_registry())
    assert plan.deployment.speculative.max_batch == 8
    assert '"max_batch":8' in plan.deployment.to_json()  # what every vLLM process receives
    with pytest.raises(DeploymentError) as info:
        validate({"speculative": {"plugin": "lookahead", "max_batch": 0}}, get_registry())
    assert "max_batch" in str(info.value) and "greater than or equal to 1" in str(info.value)
