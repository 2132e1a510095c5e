"""The pieces every workload is made of: the model's tokenizer (reduced to encode/decode), a
prompt, a workload's prompt set and its fingerprint, the build context a workload is a function
of, and the workload itself. Never imports vLLM."""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


class WorkloadError(ValueError):
    """A workload cannot be built with these settings (or does not exist)."""


@dataclass(frozen=True)
class RulerCase:
    """One prompt of the suite: ``token_ids`` ends where the model must write the answer;
    ``answers`` are the token ids to find (one for every task but ``multivalue``, where the
    output must hold each of them); ``depth`` is where the needle asked for sits in the
    haystack (0 = start, 1 = end; for ``multivalue`` and ``vartrack`` the first inserted
    line); ``source`` is the haystack's ``file@offset``; ``match`` how the output is scored
    (:func:`.ruler.score_case`): ``"prefix"`` (:mod:`.ruler`'s code form) or ``"contains"`` (RULER's own,
    :mod:`.ruler_prose`)."""

    task: str
    token_ids: tuple[int, ...]
    answers: tuple[tuple[int, ...], ...]
    depth: float
    source: str
    match: str = "prefix"


# --------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """The model's tokenizer, reduced to what the workloads need (no special tokens added)."""

    def __init__(
        self, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str], name: str = ""
    ) -> None:
        self._encode, self._decode, self.name = encode, decode, name

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))

    @classmethod
    def from_model(cls, model: str | os.PathLike[str]) -> "Tokenizer":
        """A model folder's ``tokenizer.json`` through the `tokenizers` library (fast, no
        transformers import); otherwise transformers' AutoTokenizer (folder or hub id)."""
        folder = Path(model)
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as Fast

            tok = Fast.from_file(str(folder / "tokenizer.json"))
            return cls(
                lambda t: tok.encode(t, add_special_tokens=False).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=False),
                str(folder),
            )
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(model))
        return cls(lambda t: hf(t, add_special_tokens=False)["input_ids"], lambda ids: hf.decode(ids), str(model))


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prompt:
    workload: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    max_tokens: int  # output budget of this request (the global one, or less to fit the context)
    source: str  # where it came from: "question 3", "json/decoder.py:JSONObject", ...
    group: int | None = None  # shared-prefix group

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "source": self.source,
            "group": self.group,
            "prompt_tokens": len(self.token_ids),
            "max_tokens": self.max_tokens,
            "text": self.text,
        }


@dataclass
class PromptSet:
    workload: "Workload"
    prompts: list[Prompt]
    stats: dict[str, Any] = field(default_factory=dict)  # workload-specific facts (shared prefix...)

    @property
    def name(self) -> str:
        return self.workload.name

    def fingerprint(self) -> str:
        return fingerprint(self.prompts)

    def to_json(self) -> dict[str, Any]:
        lengths = [len(p.token_ids) for p in self.prompts]
        return {
            "name": self.name,
            "describe": self.workload.describe,
            "num_prompts": len(self.prompts),
            "prompt_tokens": {
                "total": sum(lengths),
                "min": min(lengths, default=0),
                "max": max(lengths, default=0),
                "mean": sum(lengths) / len(lengths) if lengths else 0.0,
            },
            "fingerprint": self.fingerprint(),
            **self.stats,
        }


def fingerprint(prompts: Iterable[Prompt]) -> str:
    """SHA-256 of the prompts' token ids and output budgets (first 16 hex digits)."""
    data = json.dumps([[list(p.token_ids), p.max_tokens] for p in prompts], separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BuildContext:
    tokenizer: Tokenizer
    num_prompts: int
    max_tokens: int
    max_model_len: int
    seed: int
    stdlib: Path

    def rng(self, name: str, *extra: Any) -> random.Random:
        # String seeds are hashed with SHA-512 by `random`: stable across runs and machines.
        return random.Random(":".join(map(str, ("vllm-graft-bench", name, self.seed, *extra))))

    @property
    def prompt_budget(self) -> int:
        """The longest prompt that leaves room for ``max_tokens`` (+1 for scoring)."""
        return self.max_model_len - self.max_tokens - 1

    def make(
        self,
        workload: str,
        index: int,
        ids: Sequence[int],
        source: str,
        group: int | None = None,
        text: str | None = None,
    ) -> Prompt:
        ids = tuple(ids)
        if not ids:
            raise WorkloadError(f"{workload}: prompt {index} ({source}) is empty")
        budget = min(self.max_tokens, self.max_model_len - len(ids) - 1)
        if budget < 1:
            raise WorkloadError(
                f"{workload}: prompt {index} ({source}) has {len(ids)} tokens, "
                f"no room for output in max_model_len {self.max_model_len}"
            )
        return Prompt(workload, index, ids, self.tokenizer.decode(ids) if text is None else text, budget, source, group)


@dataclass(frozen=True)
class Workload:
    name: str
    summary: str  # one line
    describe: str  # what it models and how it is built
    build: Callable[[BuildContext], tuple[list[Prompt], dict[str, Any]]]
    in_all: bool = True  # run when no workload (or `all`) is named
