"""Fault injection in vLLM's CPU engine: a plugin of each kind that raises in its hot path,
returns malformed results, or is slow (``tests/unit/fault_plugins.py``).

What each case asserts, and why:

* **stops with the message**: an exception a plugin raises, or a result that breaks its kind's
  contract, is raised inside vLLM's engine step (the scheduler for ``keep``, the worker's forward
  for the others), as an error that names the plugin and the rule. vLLM cannot fail one request
  from inside a step: its engine core logs ``EngineCore encountered a fatal error`` and dies, and
  the front end raises ``EngineDeadError`` (:func:`test_multiprocess_engine_dies_with_the_plugins_message`
  shows that through the default multiprocess engine). The in-process engine used for the other
  cases (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) raises the error from ``LLM.generate`` itself and
  is not used again (a fresh engine per case: a tiny model starts in seconds);
* **documented fallback, logged**: drafts beyond ``max_tokens`` are dropped, as
  ``Proposer.propose`` documents; the adapter says so once in the log and the tokens are those
  of the same proposer behaving;
* **slow**: a plugin that sleeps in every hot-path call delays its requests; they finish with the
  healthy tokens. Nothing in vLLM times out a slow scheduler step; the multiprocess executor (CPU,
  or more than one GPU) gives each ``execute_model`` ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
  (300 s) and then kills the engine; a single GPU (``UniProcExecutor``) has no timeout.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: errors inspected here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.unit import fault_plugins  # noqa: E402
from tests.unit.fault_plugins import FAULT  # noqa: E402
from vllm_graft.integration.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "models" / "graft-tiny-llama"
MIXTRAL = ROOT / "models" / "graft-tiny-mixtral"
ENGINE = {"dtype": "float32", "max_model_len": 512, "block_size": 32, "enforce_eager": True}
NEW_TOKENS = 6
# 71 tokens of the tiny Llama's tokenizer: three KV blocks of 32, two of them full
PROMPT = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
          "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
          "    def peek(self):\n        return self.items[-1]\n\n    def __len__(self):")


@pytest.fixture(scope="module", autouse=True)
def registry_with_faults():
    from vllm_graft.hooks import manager as manager_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manager_mod, "_cached", fault_plugins.registry_with_faults())
        yield
    FAULT.mode = None


def generate(llm, prompts=(PROMPT,), mode: str | None = None) -> list[list[int]]:
    """Greedy tokens with ``FAULT.mode`` switched on for this call only."""
    from vllm import SamplingParams

    FAULT.mode, FAULT.calls = mode, 0
    try:
        outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    finally:
        FAULT.mode = None
    return [list(o.outputs[0].token_ids) for o in outs]


def messages(err: BaseException | None) -> str:
    out = []
    while err is not None:
        out.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return "\n".join(out)


def start(kind: str, **params):
    from vllm_graft.launch import engine as launch

    model = MIXTRAL if kind == "moe" else LLAMA
    plan = plan_for({"model": str(model), "engine": ENGINE,
                     kind: {"plugin": f"fault-{kind}", "params": params}})
    return launch.in_process_engine(plan, seed=0)


# (kind, fault, what the error must say, prompts); SHORT: the cases CI runs (one raise and one
# malformed result per kind); GRAFT_FAULTS_FULL=1 (make faults-full) runs them all
PINNED = (PROMPT, PROMPT)  # the second request hits the prefix cache: blocks 0 and 1 are shared
FATAL = [
    ("attention", "raise", ["attention plugin 'fault-attention': forward() raised RuntimeError: "
                            "injected fault in forward", "must not raise"], None),
    ("attention", "raise_plan", ["attention plugin 'fault-attention': plan() raised RuntimeError"], None),
    ("attention", "shape", ["attention plugin 'fault-attention' returned shape", "must return [T, H, D]"], None),
    ("attention", "dtype", ["'fault-attention': forward() returned a torch.int32 tensor", "floating-point"], None),
    ("attention", "not_tensor", ["'fault-attention': forward() returned NoneType"], None),
    ("kvcompress", "raise", ["kvcompress plugin 'fault-kvcompress': keep() raised RuntimeError"], None),
    ("kvcompress", "out_of_range", ["'fault-kvcompress': keep() returned", "are out of range(0, "], None),
    ("kvcompress", "unsorted", ["'fault-kvcompress': keep() returned", "must be sorted ascending"], None),
    ("kvcompress", "drop_last", ["'fault-kvcompress': keep() returned",
                                 "being written) must be kept"], None),
    ("kvcompress", "drop_pinned", ["'fault-kvcompress': keep() returned",
                                   "pinned block(s) [0, 1] (shared with other requests) must be kept"], PINNED),
    ("speculative", "raise", ["speculative plugin 'fault-speculative': propose() raised RuntimeError"], None),
    *[("speculative", mode, ["speculative plugin 'fault-speculative' proposed",
                             "propose() must return a list of token ids in [0, 4096)"], None)
      for mode in ("oov", "not_list", "string")],
    ("quant", "raise", ["quant plugin 'fault-quant': apply() raised RuntimeError"], None),
    *[("quant", mode, ["quant plugin 'fault-quant': apply() returned", "expected shape"], None)
      for mode in ("shape", "dtype")],
    ("moe", "raise", ["MoE plugin 'fault-moe': route() raised RuntimeError"], None),
    *[("moe", mode, ["MoE plugin 'fault-moe': route returned expert ids outside [0, 8)"], None)
      for mode in ("ids_high", "ids_negative")],
    ("moe", "topk_shape", ["MoE plugin 'fault-moe': route returned weights", "both must be [T, top_k]"], None),
]
SHORT = {("attention", "raise"), ("attention", "dtype"), ("kvcompress", "raise"), ("kvcompress", "drop_pinned"),
         ("speculative", "raise"), ("speculative", "oov"), ("quant", "raise"), ("quant", "shape"),
         ("moe", "raise"), ("moe", "ids_high")}
FULL = os.environ.get("GRAFT_FAULTS_FULL") == "1"


@pytest.mark.parametrize("kind,mode,expected,prompts",
                         [c for c in FATAL if FULL or c[:2] in SHORT], ids=lambda v: v if isinstance(v, str) else "")
def test_fault_stops_the_engine_naming_the_plugin_and_the_rule(kind, mode, expected, prompts):
    """A fresh engine per case: after an exception inside a step, vLLM's scheduler state is not
    consistent (in-process, a later step loops in ``Scheduler.schedule``); vLLM's default engine
    ends its core there (see the multiprocess test)."""
    with start(kind) as llm:
        generate(llm)  # serves while the plugin behaves
        with pytest.raises(Exception) as info:
            generate(llm, prompts or (PROMPT,), mode)
    msg = messages(info.value)
    assert FAULT.calls > 0
    for text in expected:
        assert text in msg, msg


def test_a_keep_answering_the_worker_differently_cannot_make_it_read_a_freed_block(caplog):
    """The scheduler's call drops block 0 and frees it; the worker's call for the same view keeps
    it. Without the frees, attention read a block the pool may have handed to another request,
    without a word; then the frees check stopped the engine (issue 64: the read reached the
    worker all the same, one step before). Now the worker leaves out every block the scheduler
    freed: the engine serves on, with the scheduler's decisions, and the plugin is named once."""
    from vllm_graft.hooks import Kind
    from vllm_graft.integration.runtime import RUNTIME

    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        with start("kvcompress") as llm:
            generate(llm)
            got = generate(llm, (PROMPT,), "differs")
            after = generate(llm)  # and serves on
            events = RUNTIME.counts(Kind.KVCOMPRESS, "fault-kvcompress")
    assert got[0] and after[0]
    assert events.get("keep_disagreed", 0) > 0, events
    said = [r.getMessage() for r in caplog.records if "answered the scheduler and the worker" in r.getMessage()]
    assert len(said) == 1 and "'fault-kvcompress'" in said[0] and "the scheduler freed block(s) [0]" in said[0], said


@pytest.mark.parametrize("kind", ["attention", "kvcompress", "speculative", "quant", "moe"])
def test_slow_plugin_delays_but_finishes_with_the_same_tokens(kind, caplog):
    """A plugin that sleeps in every hot-path call: its requests finish, with the tokens of the
    same plugin behaving. For the proposer, drafts beyond ``max_tokens`` are dropped (the
    documented fallback) and said once in the log, with the same tokens again."""
    with start(kind) as llm:
        healthy = generate(llm)
        assert generate(llm, mode="slow") == healthy
        assert FAULT.calls > 0  # it did sleep in the hot path
        if kind == "speculative":
            with caplog.at_level(logging.WARNING, logger="vllm_graft"):
                assert generate(llm, mode="too_many") == healthy
            assert FAULT.calls > 0
            assert "speculative plugin 'fault-speculative' proposed 5 drafts where 2 were asked" in caplog.text


# --------------------------------------------------------------------- multiprocess engine
SCRIPT = textwrap.dedent("""
    import sys
    from vllm import SamplingParams
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.plan import plan_for
    plan = plan_for({"model": sys.argv[1], "engine": %r,
                     "kvcompress": {"plugin": "fault-kvcompress", "params": {"fault": "drop_last"}}})
    from vllm import LLM
    llm = LLM(**launch.llm_kwargs(plan, graft=True))
    try:
        llm.generate([%r], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    except Exception as e:
        # the client's verdict goes to its own file: vLLM's child processes share stdout, and a
        # log line of theirs once landed between the words of a print here
        open("client.txt", "w").write("CLIENT-ERROR " + type(e).__name__)
        sys.exit(3)
    open("client.txt", "w").write("NO-ERROR")
""") % (ENGINE, PROMPT)


def test_multiprocess_engine_dies_with_the_plugins_message(tmp_path):
    """vLLM's default engine (engine core in its own process): a contract broken in the
    scheduler's ``keep`` kills the engine core, which logs the plugin's error; the client gets
    ``EngineDeadError`` and the process ends (no hung request)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    # the engine core is spawned: it finds the fault plugins through an entry point
    path = os.pathsep.join([fault_plugins.install_entry_point(tmp_path / "site"), str(ROOT)])
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(LLAMA)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert (tmp_path / "client.txt").read_text() == "CLIENT-ERROR EngineDeadError", out[-4000:]
    assert "EngineCore encountered a fatal error" in out
    assert "kvcompress plugin 'fault-kvcompress': keep() returned" in out
    assert "being written) must be kept" in out
