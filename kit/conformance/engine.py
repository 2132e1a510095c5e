"""The kit's ``engine`` check: the plugin in vLLM's CPU engine (in-process) on a bundled model.

A lossless plugin must give plain vLLM's greedy tokens on the same prompts; a lossy one
must run and its agreement with plain vLLM is reported. The plugin's events in the
runtime prove vLLM's code path reached it, and a plugin that changes what vLLM computes must
show that it acted (:data:`EFFECTS`): a lossy plugin one of its kind's effect events (a KV
compressor freeing or skipping blocks, a storage format writing KV, an MoE scheduler adjusting,
routing or pruning, a quant method computing with its weights, an attention method running its
own forward), a proposer that drafts in the kit's exercise ``drafted`` tokens. A plugin whose
parameters make it act nowhere on the kit's workload fails, naming the event expected and how
to give the kit other parameters (``graft_conformance("kind:name", params={...})``).

The workload is chosen so the built-ins act with their default parameters: short code prompts
(:data:`PROMPTS`), and for an eviction compressor long ones (:data:`LONG_PROMPT_TOKENS` tokens
of standard-library source in blocks of :data:`LONG_BLOCK`: more than the 16-block budgets of the
built-ins). Plain outputs are cached per model and workload, so a suite checking many plugins
pays for each plain engine once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...hooks import Kind

from .base import ConformanceError, Skipped, Target

#: Short code prompts (no near-tie greedy step on the bundled models; see tests/e2e/test_models.py).
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    'def read_config(path):\n    """Return the parsed contents of the file at *path*."""\n    with open(path',
]
NEW_TOKENS = 16
ENGINE = {"max_model_len": 512, "enforce_eager": True}

#: The eviction compressors' workload: prompts this long (tokens of standard-library source),
#: in KV blocks of ``LONG_BLOCK`` tokens (vLLM's CPU engine takes multiples of 32), so that a
#: budget of up to ``LONG_PROMPT_TOKENS // LONG_BLOCK - 1`` blocks has something to evict.
LONG_PROMPT_TOKENS = 640
LONG_PROMPTS = 2
LONG_BLOCK = 32
LONG_NEW_TOKENS = 32
LONG_ENGINE = {"max_model_len": 1024, "block_size": LONG_BLOCK, "enforce_eager": True}

#: Per kind: the events (``RUNTIME.count``) of which at least one proves the plugin changed what
#: vLLM computed; required of a lossy plugin. A storage format (role ``storage``): ``write``.
EFFECTS: dict[Kind, tuple[str, ...]] = {
    Kind.KVCOMPRESS: ("blocks_freed", "blocks_skipped", "head_blocks_dropped", "layer_blocks_dropped"),
    Kind.MOE: ("slots_skipped", "route", "adjust_logits"),
    Kind.QUANT: ("apply", "captured", "embed", "dense"),
    Kind.ATTENTION: ("forward",),
    Kind.SPECULATIVE: ("drafted",),
}
STORAGE_EFFECTS = ("write",)

_plain_cache: dict[str, list[list[int]]] = {}


def pick_model(t: Target) -> Path:
    """The bundled model the plugin applies to: one of its declared architectures, an MoE
    model for MoE schedulers, else the dense model."""
    from ...launch.engine import models_dir

    try:
        root = models_dir()
    except FileNotFoundError as e:
        raise Skipped(str(e)) from None
    models = {}
    for cfg in sorted(root.glob("*/config.json")):
        models[cfg.parent] = json.loads(cfg.read_text()).get("architectures", [])
    wanted = t.entry.registration.capabilities.architectures
    for path, archs in models.items():
        is_moe = any("Mixtral" in a or "Moe" in a for a in archs)
        if wanted is not None:
            if set(archs) & set(wanted):
                return path
        elif (t.kind is Kind.MOE) == is_moe:
            return path
    raise Skipped(f"no bundled model in {root} fits (architectures {wanted}, kind {t.kind.value})")


def _generate(llm: Any, prompts: list[Any], new_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, sp, use_tqdm=False)]


def evicts(t: Target) -> bool:
    """An eviction compressor (kind kvcompress, not a storage format)."""
    return t.kind is Kind.KVCOMPRESS and t.entry.registration.capabilities.role != "storage"


def long_prompts(model: Path) -> list[list[int]]:
    """:data:`LONG_PROMPTS` prompts of :data:`LONG_PROMPT_TOKENS` token ids: standard-library
    source (the bundled models' training text), else the short prompts repeated."""
    from ...tools.workloads import Tokenizer

    tok = Tokenizer.from_model(str(model))
    try:
        from ...tools.workloads import stdlib_texts

        return [list(ids) for ids, _ in stdlib_texts(tok, num=LONG_PROMPTS, tokens=LONG_PROMPT_TOKENS, seed=3)]
    except Exception:  # no readable standard library: the code prompts, repeated
        out = []
        for i in range(LONG_PROMPTS):
            ids: list[int] = []
            while len(ids) < LONG_PROMPT_TOKENS:
                ids += tok.encode("\n\n".join(PROMPTS[i:] + PROMPTS[:i]) + "\n\n")
            out.append(ids[:LONG_PROMPT_TOKENS])
        return out


def expected_effects(t: Target) -> tuple[str, ...]:
    """The events of which the engine run must show one (empty: nothing required): see
    :data:`EFFECTS`. A proposer (lossless by verification) must draft if it drafts in the kit's
    own exercise (the ``noop`` proposer drafts nothing there and is not asked to)."""
    caps = t.entry.registration.capabilities
    if t.kind is Kind.SPECULATIVE:
        return EFFECTS[t.kind] if _drafts_in_exercise(t) else ()
    if caps.lossless:
        return ()
    if t.kind is Kind.KVCOMPRESS and caps.role == "storage":
        return STORAGE_EFFECTS
    return EFFECTS[t.kind]


def _drafts_in_exercise(t: Target) -> bool:
    from .base import build
    from .exercises.speculative import exercise_speculative

    results = exercise_speculative(t, build(t), "float32", False)
    return any(len(drafts) for _, steps in results for drafts in steps)


def run_engine_check(t: Target) -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise Skipped("vLLM is not installed (pip install 'vllm-graft[cpu]')") from None
    from ...launch.engine import in_process_engine
    from ...integration.plan import plan_for
    from ...integration.runtime import RUNTIME

    model = pick_model(t)
    caps = t.entry.registration.capabilities
    if "cpu" not in caps.platforms:
        raise Skipped("the plugin does not declare the 'cpu' platform")
    dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    expected = expected_effects(t)
    if evicts(t):
        engine = {**LONG_ENGINE, "dtype": dtype}
        prompts: list[Any] = long_prompts(model)
        new_tokens = LONG_NEW_TOKENS
        workload = (
            f"{len(prompts)} prompts of {LONG_PROMPT_TOKENS} tokens "
            f"({LONG_PROMPT_TOKENS // LONG_BLOCK} blocks of {LONG_BLOCK}), {new_tokens} new tokens"
        )
    else:
        engine = {**ENGINE, "dtype": dtype}
        prompts, new_tokens = list(PROMPTS), NEW_TOKENS
        workload = f"{len(prompts)} short code prompts, {new_tokens} new tokens"
    base = {"model": str(model), "engine": engine}
    key = json.dumps({**base, "prompts": prompts, "new_tokens": new_tokens}, sort_keys=True)
    deployment = {**base, t.kind.value: {"plugin": t.entry.name, "params": t.params}}
    if key not in _plain_cache:
        with in_process_engine(plan_for(base, source="conformance"), graft=False, seed=0) as llm:
            _plain_cache[key] = _generate(llm, prompts, new_tokens)
    plain = _plain_cache[key]
    with in_process_engine(plan_for(deployment, source="conformance"), seed=0) as llm:
        graft = _generate(llm, prompts, new_tokens)
        events = {ev: n for (kind, name, ev), n in RUNTIME.events.items() if kind == t.kind and name == t.entry.name}
    same = sum(a == b for a, b in zip(plain, graft))
    agree = sum(x == y for a, b in zip(plain, graft) for x, y in zip(a, b))
    total = sum(len(a) for a in plain)
    summary = (
        f"{model.name} {dtype}, {workload}: {same}/{len(plain)} sequences identical to plain "
        f"vLLM, {agree}/{total} tokens agree; plugin events {events}"
    )
    print(summary)
    if caps.lossless and graft != plain:
        first = next(i for i, (a, b) in enumerate(zip(plain, graft)) if a != b)
        raise ConformanceError(
            f"{t.spec}: declared lossless, but prompt {first} gives {graft[first]} where plain "
            f"vLLM gives {plain[first]} ({summary})"
        )
    if not events:
        raise ConformanceError(
            f"{t.spec}: the engine ran but recorded no event of the plugin; its adapter never reached it"
        )
    if expected and not any(events.get(ev, 0) > 0 for ev in expected):
        why = (
            "it drafts in the kit's exercise"
            if t.kind is Kind.SPECULATIVE
            else "it is declared lossy (capabilities lossless=False)"
        )
        raise ConformanceError(
            f"{t.spec}: {why}, but in vLLM's engine it never acted: no "
            f"{' / '.join(repr(e) for e in expected)} event with parameters {t.params or '(defaults)'} "
            f"on the kit's workload ({workload}; events {events}). Give the kit parameters that make "
            f"it act there (e.g. a budget smaller than the prompts): "
            f"pytest.mark.graft_conformance({t.spec!r}, params={{...}}) on the test that uses "
            "graft_check"
        )
    acted = {ev: events[ev] for ev in expected if events.get(ev, 0) > 0}
    return summary + (f"; it acted: {acted}" if acted else "")
