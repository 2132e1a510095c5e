"""The kit's ``engine`` check: the plugin in vLLM's CPU engine (in-process) on a bundled model.

A lossless plugin must give plain vLLM's greedy tokens on the same prompts; a lossy one
must run and its agreement with plain vLLM is reported. The plugin's events in the
runtime prove vLLM's code path reached it. Plain outputs are cached per model, so a suite
checking many plugins pays for each plain engine once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_graft.hooks import Kind

from vllm_graft.kit.conformance.base import ConformanceError, Skipped, Target

#: Short code prompts (no near-tie greedy step on the bundled models; see tests/e2e/test_models.py).
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_config(path):\n    \"\"\"Return the parsed contents of the file at *path*.\"\"\"\n    with open(path",
]
NEW_TOKENS = 16
ENGINE = {"max_model_len": 512, "enforce_eager": True}

_plain_cache: dict[str, list[list[int]]] = {}


def pick_model(t: Target) -> Path:
    """The bundled model the plugin applies to: one of its declared architectures, an MoE
    model for MoE schedulers, else the dense model."""
    from vllm_graft.integration.launch import models_dir

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


def _generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def run_engine_check(t: Target) -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise Skipped("vLLM is not installed (pip install 'vllm-graft[cpu]')") from None
    from vllm_graft.integration.launch import in_process_engine, plan_from_dict
    from vllm_graft.integration.runtime import RUNTIME

    model = pick_model(t)
    caps = t.entry.registration.capabilities
    if "cpu" not in caps.platforms:
        raise Skipped("the plugin does not declare the 'cpu' platform")
    dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    engine = {**ENGINE, "dtype": dtype}
    base = {"model": str(model), "engine": engine}
    key = json.dumps(base, sort_keys=True)
    deployment = {**base, t.kind.value: {"plugin": t.entry.name, "params": t.params}}
    if key not in _plain_cache:
        with in_process_engine(plan_from_dict(base, source="conformance"), graft=False, seed=0) as llm:
            _plain_cache[key] = _generate(llm)
    plain = _plain_cache[key]
    with in_process_engine(plan_from_dict(deployment, source="conformance"), seed=0) as llm:
        graft = _generate(llm)
        events = {ev: n for (kind, name, ev), n in RUNTIME.events.items()
                  if kind == t.kind and name == t.entry.name}
    same = sum(a == b for a, b in zip(plain, graft))
    agree = sum(x == y for a, b in zip(plain, graft) for x, y in zip(a, b))
    total = sum(len(a) for a in plain)
    summary = (f"{model.name} {dtype}: {same}/{len(plain)} sequences identical to plain vLLM, "
               f"{agree}/{total} tokens agree; plugin events {events}")
    print(summary)
    if caps.lossless and graft != plain:
        first = next(i for i, (a, b) in enumerate(zip(plain, graft)) if a != b)
        raise ConformanceError(
            f"{t.spec}: declared lossless, but prompt {first} gives {graft[first]} where plain "
            f"vLLM gives {plain[first]} ({summary})")
    if not events:
        raise ConformanceError(f"{t.spec}: the engine ran but recorded no event of the plugin; "
                               "its adapter never reached it")
    return summary
