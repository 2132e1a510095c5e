"""RULER-style synthetic retrieval tasks on stdlib source (``vllm-graft kvbench --suite ruler``).

NVIDIA's kvpress reports task accuracy against compression ratio on RULER (Hsieh et al., 2024,
"RULER: What's the Real Context Size of Your Long-Context Language Models?"). These are
RULER's retrieval and tracing tasks rebuilt for the bundled recall model
(``models/graft-tiny-llama-recall``, a 5M-parameter model trained on CPython stdlib source and
fine-tuned to copy from distant context): the haystack is a window of stdlib ``.py`` source
(the windows :func:`~.sources.stdlib_texts` gives), and what is retrieved is a fresh random
value drawn from a seeded generator for every case, so no answer can have been memorised in
training. Every prompt is about ``context_tokens`` tokens and ends where the model must write
the answer; a case is scored on the greedy output by exact match (:func:`score_case`).

The tasks (:data:`RULER_TASKS`):

* ``single``: one needle line ``SECRET_<TAG> = "<value>"`` (:func:`~.long_context.needle_haystack`,
  reused); the prompt ends with ``SECRET_<TAG> = "``; the output must start with ``<value>"``.
* ``multikey``: :data:`MULTIKEY_KEYS` needle lines with different tags (the others are
  distractors of the same form), spread over the haystack; the question asks for one of them.
* ``multivalue``: one tag inserted :data:`MULTIVALUE_VALUES` times with different values; the
  answers are all of them; the score is the fraction of the values found in the output.
* ``vartrack``: variable tracking in code: ``<V1> = "<value>"`` and then ``<V2> = <V1>``,
  ``<V3> = <V2>`` ... (:data:`VARTRACK_HOPS` assignments, random upper-case names) scattered in
  order through the haystack; the question asks for the value of the last variable.
* ``qa`` (RULER's own wording only, :mod:`.ruler_prose`): one question over a long document of
  short documents about people; no code form.

Values are :data:`VALUE_LETTERS` random lower-case letters (about 7 tokens), tags 4 random
upper-case letters, resampled until their tokens do not merge with the quotes around them (so
a value's tokens are the same wherever it appears, and matching output token ids is exact).

What was chosen, and why. Plain vLLM on the recall model at kvbench's default context (2048:
prompts of ~1,900-1,984 tokens; the model has 2048 positions, so there is no longer one); the
suite's own figures, with their commands, are in docs/benchmarks/kvcompress.md ("RULER-style
suite"). The tuning below was exploratory (a one-off script over ``ruler_suite`` and kvbench's
``run_arm``, 16 cases per form, not in the repo):

* values of 8 random letters, as ``needle_haystack``'s: the model usually finds the needle and
  often slips inside the value (``vql.end...`` for ``vqlwgexv``), so exact match is about 0.45
  on ``single``: well above chance (0: the values are random), well below 1.0. Not shortened.
* ``multikey``: 2 keys scored 0.31-0.38, 4 keys 0.31-0.38, 8 keys 0.06; with 4 keys it never
  answered with a distractor's value (0 of 16: it finds the key asked for or copies nothing),
  so :data:`MULTIKEY_KEYS` = 4, the most distractors that keep it near ``single``.
* ``multivalue``: the model writes one value and then continues the code that followed that
  line, mostly the most recently inserted value (its induction heads were trained to
  copy after the most recent match). RULER's score (the fraction of the values in the output)
  is kept, so a case scores at most about 1/:data:`MULTIVALUE_VALUES` in practice: 2 values
  scored 0.28-0.31, 3 values 0.17-0.23, 4 values 0.13. :data:`MULTIVALUE_VALUES` = 3: above
  chance, and it rewards a compressor that keeps any one of the three lines.
* ``vartrack``: 0 of 8 or 16 in every form tried (1 of 16 through kvbench later): ``assert <V2> == "`` after one hop (``<V2> = <V1>``),
  ``assert <V3> == "`` after two, and a question ``<V3> = `` that would let the model walk the
  chain in its output (it did not even copy ``<V2>`` from the line ``<V3> = <V2>``). A task the
  model cannot do uncompressed says nothing about compression, so it is built and tested here
  but left out of :data:`DEFAULT_TASKS` (kvbench's ``--ruler-tasks`` runs it when named).
* the haystack's last, cut line is dropped so the question starts a line (``single`` keeps
  ``needle_haystack``'s form); this changed nothing measurable (within the noise of 16 cases).

Never imports vLLM.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

from .base import RulerCase, Tokenizer, WorkloadError
from .long_context import needle_haystack
from .ruler_prose import prose_cases
from .sources import stdlib_texts

#: The task names, in the order the tables list them.
RULER_TASKS = ("single", "multikey", "multivalue", "vartrack", "qa")
#: The tasks of the ``code`` form (``qa``, a question over documents, is built in RULER's own
#: wording only: :mod:`.ruler_prose`).
CODE_TASKS = ("single", "multikey", "multivalue", "vartrack")
#: The forms of the tasks: ``code`` (this module, for the bundled models trained on source), and
#: RULER's own wording (:mod:`.ruler_prose`, for a pretrained model) in a haystack of repeated
#: filler sentences (``noise``) or of English prose (``essay``).
RULER_FORMS = ("code", "noise", "essay")
#: The tasks plain vLLM on the recall model scores clearly above chance on (the default suite:
#: ``vartrack`` is built and tested but plain vLLM gets 1 of 16, too rare to say anything
#: about compression; name it with ``--ruler-tasks`` to run it anyway).
DEFAULT_TASKS = ("single", "multikey", "multivalue")
#: Needle lines in a ``multikey`` prompt (one asked for, the rest distractors).
MULTIKEY_KEYS = 4
#: Values of the one key in a ``multivalue`` prompt.
MULTIVALUE_VALUES = 3
#: Assignments in a ``vartrack`` chain (the first binds the value).
VARTRACK_HOPS = 3
#: Letters in a random value.
VALUE_LETTERS = 8
#: Tokens left out of the haystack for the inserted lines and the question, per inserted line.
_LINE_TOKENS = 24
_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LOWER = "abcdefghijklmnopqrstuvwxyz"


def score_case(case: RulerCase, output_ids: Sequence[int]) -> float:
    """The case's score, 0..1, on the greedy output's token ids: for ``multivalue``, and for
    every task of a ``"contains"`` case (RULER's ``string_match_all``), the fraction of the
    answers whose token ids occur (contiguously) in the output; for the other tasks 1.0 when the
    output starts with the answer's token ids, else 0.0."""
    out = tuple(output_ids)
    if case.task == "multivalue" or case.match == "contains":
        found = sum(_contains(out, a) for a in case.answers)
        return found / len(case.answers)
    (answer,) = case.answers
    return 1.0 if out[: len(answer)] == answer else 0.0


def _contains(seq: tuple[int, ...], sub: tuple[int, ...]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _clean(tokenizer: Tokenizer, word: str, before: str, after: str) -> bool:
    """``word`` tokenizes the same between ``before`` and ``after`` as alone (no merge across)."""
    return tokenizer.encode(before + word + after) == (
        tokenizer.encode(before) + tokenizer.encode(word) + tokenizer.encode(after)
    )


def _value(tokenizer: Tokenizer, rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice(_LOWER) for _ in range(VALUE_LETTERS))
        if v not in taken and _clean(tokenizer, v, 'X = "', '"\n'):
            taken.add(v)
            return v


def _name(tokenizer: Tokenizer, rng: random.Random, taken: set[str], letters: int = 4) -> str:
    while True:
        n = "".join(rng.choice(_UPPER) for _ in range(letters))
        if n not in taken and all(n not in t and t not in n for t in taken):
            taken.add(n)
            return n


def _insert(tokenizer: Tokenizer, hay_ids: Sequence[int], inserts: list[tuple[float, str]], question: str) -> str:
    """The haystack's text with each ``(depth, line)`` inserted at the line boundary nearest
    that depth (lines at the same boundary in the given order), then the question."""
    lines = tokenizer.decode(hay_ids).splitlines(keepends=True)
    if len(lines) > 2 and not lines[-1].endswith("\n"):
        lines = lines[:-1]  # the window's last line is cut: the question starts a line of its own
    n = len(lines)
    at: dict[int, list[str]] = {}
    for depth, line in inserts:
        k = max(1, min(n - 1, round(depth * n)))
        at.setdefault(k, []).append(line)
    parts: list[str] = []
    for k, line in enumerate(lines):
        parts += at.get(k, [])
        parts.append(line)
    return "".join(parts).rstrip("\n") + "\n" + question


def _case(
    tokenizer: Tokenizer,
    task: str,
    text: str,
    answers: list[str],
    depth: float,
    source: str,
    context_tokens: int,
) -> RulerCase:
    ids = tokenizer.encode(text)
    if len(ids) > context_tokens:
        raise WorkloadError(f"ruler {task}: a prompt of {len(ids)} tokens exceeds {context_tokens} ({source})")
    return RulerCase(
        task,
        tuple(ids),
        tuple(tuple(tokenizer.encode(a)) for a in answers),
        round(depth, 3),
        source,
    )


def _spread(rng: random.Random, count: int, lo: float = 0.05, hi: float = 0.95) -> list[float]:
    """``count`` sorted depths in [lo, hi], one drawn in each of ``count`` equal slices."""
    width = (hi - lo) / count
    return [lo + width * (i + rng.random()) for i in range(count)]


def _single(tokenizer, num, context_tokens, seed, root) -> list[RulerCase]:
    out = []
    for n in needle_haystack(tokenizer, num_prompts=num, context_tokens=context_tokens + 1, seed=seed, root=root):
        out.append(RulerCase("single", n.token_ids, (n.answer_ids,), n.depth, n.source))
    return out


# One window's lines: ``(inserts, question, answers, depth)`` from the task's draws and the window's index.
_Window = Callable[[random.Random, int], tuple[list[tuple[float, str]], str, list[str], float]]


def _cases(tokenizer, task: str, num, context_tokens, seed, root, lines: int, offset: int, window: _Window):
    """A task's ``num`` cases: its draws (``random.Random`` seeded by the task, the seed and the
    context), ``num`` haystack windows leaving room for ``lines`` inserted lines and the question
    (``offset`` parts the tasks' windows: ``seed + offset``), and in each the lines, question and
    answers ``window`` draws."""
    rng = random.Random(f"vllm-graft-ruler:{task}:{seed}:{context_tokens}")
    texts = stdlib_texts(
        tokenizer, num=num, tokens=context_tokens - _LINE_TOKENS * (lines + 1), seed=seed + offset, root=root
    )
    out = []
    for i, (ids, source) in enumerate(texts):
        inserts, question, answers, depth = window(rng, i)
        text = _insert(tokenizer, ids, inserts, question)
        out.append(_case(tokenizer, task, text, answers, depth, source, context_tokens))
    return out


def _multikey(tokenizer, num, context_tokens, seed, root) -> list[RulerCase]:
    def window(rng: random.Random, i: int):
        tags: set[str] = set()
        values: set[str] = set()
        keys = [(_name(tokenizer, rng, tags), _value(tokenizer, rng, values)) for _ in range(MULTIKEY_KEYS)]
        depths = _spread(rng, MULTIKEY_KEYS)
        ask = i % MULTIKEY_KEYS  # the key asked for cycles through the positions
        inserts = [(d, f'SECRET_{t} = "{v}"\n') for d, (t, v) in zip(depths, keys)]
        tag, value = keys[ask]
        return inserts, f'SECRET_{tag} = "', [value + '"'], depths[ask]

    return _cases(tokenizer, "multikey", num, context_tokens, seed, root, MULTIKEY_KEYS, 0, window)


def _multivalue(tokenizer, num, context_tokens, seed, root) -> list[RulerCase]:
    def window(rng: random.Random, i: int):
        tag = _name(tokenizer, rng, set())
        values: set[str] = set()
        vals = [_value(tokenizer, rng, values) for _ in range(MULTIVALUE_VALUES)]
        depths = _spread(rng, MULTIVALUE_VALUES)
        inserts = [(d, f'SECRET_{tag} = "{v}"\n') for d, v in zip(depths, vals)]
        return inserts, f'SECRET_{tag} = "', list(vals), depths[0]

    return _cases(tokenizer, "multivalue", num, context_tokens, seed, root, MULTIVALUE_VALUES, 1, window)


def _vartrack(tokenizer, num, context_tokens, seed, root) -> list[RulerCase]:
    def window(rng: random.Random, i: int):
        names: set[str] = set()
        chain = [_name(tokenizer, rng, names, 5) for _ in range(VARTRACK_HOPS)]
        value = _value(tokenizer, rng, set())
        depths = _spread(rng, VARTRACK_HOPS)
        inserts = [(depths[0], f'{chain[0]} = "{value}"\n')]
        inserts += [(d, f"{b} = {a}\n") for d, a, b in zip(depths[1:], chain, chain[1:])]
        return inserts, f'assert {chain[-1]} == "', [value + '"'], depths[0]

    return _cases(tokenizer, "vartrack", num, context_tokens, seed, root, VARTRACK_HOPS, 2, window)


_BUILDERS = {"single": _single, "multikey": _multikey, "multivalue": _multivalue, "vartrack": _vartrack}


def tasks_of(form: str) -> tuple[str, ...]:
    """The tasks ``form`` builds (``--ruler-tasks all``): the code form has no ``qa``."""
    return CODE_TASKS if form == "code" else RULER_TASKS


def check_form_tasks(tasks: Sequence[str], form: str) -> None:
    """Refuse, naming the fix, a task of ``tasks`` that ``form`` does not build."""
    if missing := [t for t in tasks if t not in tasks_of(form)]:
        raise WorkloadError(
            f"RULER task(s) {', '.join(missing)} have no code form: give --ruler-form noise (or essay), "
            f"or the code form's tasks {', '.join(CODE_TASKS)}"
        )


def ruler_suite(
    tokenizer: Tokenizer,
    *,
    tasks: Sequence[str],
    num_per_task: int,
    context_tokens: int,
    seed: int = 0,
    root: Path | None = None,
    form: str = "code",
) -> list[RulerCase]:
    """``num_per_task`` cases of each task of ``tasks`` (names from :data:`RULER_TASKS`), in
    that order, each a prompt of at most ``context_tokens`` tokens (a few dozen fewer, since
    the haystack is cut before the lines are inserted); deterministic in ``seed``. ``form``
    (:data:`RULER_FORMS`): ``"code"``, this module's tasks on stdlib source (the bundled
    models), or ``"noise"`` / ``"essay"``, RULER's own natural-language forms in that haystack
    (:mod:`.ruler_prose`: a pretrained model)."""
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown:
        raise WorkloadError(f"unknown RULER task(s) {', '.join(unknown)}: the tasks are {', '.join(RULER_TASKS)}")
    if form not in RULER_FORMS:
        raise WorkloadError(f"unknown RULER form {form!r}: the forms are {', '.join(RULER_FORMS)}")
    check_form_tasks(tasks, form)
    out: list[RulerCase] = []
    for task in tasks:
        if form != "code":
            out += prose_cases(tokenizer, task, num_per_task, context_tokens, seed, haystack=form)
        else:
            out += _BUILDERS[task](tokenizer, num_per_task, context_tokens, seed, root)
    return out
