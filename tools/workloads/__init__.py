"""The built-in workloads of `vllm-graft bench`: deterministic prompt sets defined in code.

Every workload is a function of (tokenizer, number of prompts, output budget, context
length, seed) and nothing else, so the two arms of a bench run, and two runs with the same
settings on the same machine, get the same prompt token ids. The code workloads read the
``.py`` sources of the standard library of the running interpreter
(``sysconfig.get_paths()["stdlib"]``), the same folder the bundled models were trained on
(see models/README.md); another Python version has other sources, hence other prompts: the
``fingerprint`` of each prompt set, recorded in bench's JSON, tells whether two runs used
the same prompts.

This module never imports vLLM.

The package: :mod:`.base` (tokenizer, prompts, prompt sets, the build context),
:mod:`.sources` (the stdlib sources: files, function heads, token windows),
:mod:`.prompts` (the short and code workloads: chat, shared-prefix, long-context,
code-completion, extractive), :mod:`.long_context` (needle-in-a-haystack texts and the
long-recall workload), :mod:`.ruler` (the RULER-style tasks of ``kvbench --suite ruler``) and
:mod:`.registry` (the registry of workloads, ``parse_names``, ``build``).
"""

from __future__ import annotations

from .base import BuildContext, Prompt, PromptSet, Tokenizer, Workload, WorkloadError, fingerprint
from .long_context import LONG_RECALL_LEAD, LONG_RECALL_SPAN, Needle, needle_haystack
from .prompts import (
    CHAT_FORMATS,
    CHAT_QUESTIONS,
    CODE_COMPLETION_MAX_TOKENS,
    EXTRACTIVE_MAX_LINES,
    LONG_CONTEXT_TOKENS,
    SHARED_PREFIX_GROUP,
    SHARED_PREFIX_TOKENS,
    SYSTEM_PROMPT,
    _common_prefix,
)
from .registry import WORKLOADS, UnknownWorkloadError, build, parse_names
from .sources import EXCLUDED_DIRS, FunctionHead, function_heads, stdlib_dir, stdlib_files, stdlib_texts

__all__ = [
    "BuildContext",
    "CHAT_FORMATS",
    "CHAT_QUESTIONS",
    "CODE_COMPLETION_MAX_TOKENS",
    "EXCLUDED_DIRS",
    "EXTRACTIVE_MAX_LINES",
    "FunctionHead",
    "LONG_CONTEXT_TOKENS",
    "LONG_RECALL_LEAD",
    "LONG_RECALL_SPAN",
    "Needle",
    "Prompt",
    "PromptSet",
    "SHARED_PREFIX_GROUP",
    "SHARED_PREFIX_TOKENS",
    "SYSTEM_PROMPT",
    "Tokenizer",
    "UnknownWorkloadError",
    "WORKLOADS",
    "Workload",
    "WorkloadError",
    "_common_prefix",
    "build",
    "fingerprint",
    "function_heads",
    "needle_haystack",
    "parse_names",
    "stdlib_dir",
    "stdlib_files",
    "stdlib_texts",
]
