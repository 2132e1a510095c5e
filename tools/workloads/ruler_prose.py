"""RULER's own task forms on a prose haystack (``vllm-graft kvbench --suite ruler --ruler-form prose``):
the form a pretrained model is judged on, as kvpress's leaderboard judges it.

:mod:`.ruler` rebuilds RULER's tasks as code for the bundled models (trained on CPython source);
a pretrained assistant model such as SmolLM2-135M just continues that code (plain vLLM scored
0 of 3 on its ``single`` at 4K). RULER (Hsieh et al., 2024) writes its needles and questions
in natural language; this module follows its task definitions in its own wording:

* ``single``: one needle sentence "One of the special magic numbers for <key> is: <value>." in
  the haystack; the prompt asks for the key's number and ends with the start of the answer
  ("The special magic number for <key> mentioned in the text above is").
* ``multikey``: :data:`MULTIKEY_KEYS` such needles with different keys; one is asked for.
* ``multivalue``: :data:`MULTIVALUE_VALUES` needles of one key with different values; the
  question asks for all of them.
* ``vartrack``: a chain of :data:`VARTRACK_HOPS` + 1 assignments ``VAR <A> = <value>``,
  ``VAR <B> = VAR <A>``, ... in a haystack of repeated filler sentences (RULER's own choice for
  this task); the question asks for every variable that holds the value.

Keys are random ``adjective-noun`` pairs, values 7-digit numbers, variable names 5 random
upper-case letters: drawn fresh from a seeded generator for every case. Two haystacks
(:data:`HAYSTACKS`): ``noise``, a few filler sentences repeated (RULER's niah_single_1 and its
variable tracking), and ``essay``, English prose available offline in place of RULER's essays
(Paul Graham's, a download): CPython's reference documentation (``pydoc_data.topics``, its
prose paragraphs, about 400 K characters), a window at a random offset per case.

* ``qa``: one question over a long document, in RULER's QA wording ("Answer the question based
  on the given documents ... Question: ... Answer:", the answer's start given as the other
  tasks give it). RULER's documents come from SQuAD / HotpotQA (downloads); here
  :data:`QA_DOCUMENTS` generated two-sentence documents (``Document: <name> works as a <trade> in
  <city>. In the evenings, ...``), each person in a city and trade of their own, are spread
  through the haystack, and the question asks one person's city or trade in turn. A synthetic
  stand-in for RULER's QA, not its data: a hundred such documents as the whole haystack (every
  answer word beside several names) scored 0 of 4 on plain SmolLM2-135M at 4K, beyond this model.

What plain vLLM on SmolLM2-135M makes of them at 4K (``vllm-graft kvbench --model
~/.cache/vllm-graft/models/smollm2-135m --suite ruler --ruler-form FORM --compressors ''
--context 4096 --ruler-tasks all --ruler-cases 4``, 2026-12-05): ``noise`` single 1.0,
multikey 0.75, multivalue 0.56, vartrack 0; ``essay`` 0.25 / 0.25 / 0.13 / 0 (it answers
version-like strings, ``"1.0"``, or a distractor's number: the reference is full of numbers).
So ``noise`` is the form the model is judged on, and ``vartrack`` (it writes ``A) 5 B) <value>``)
is left out of kvbench's default tasks, as in the code form.

Scoring is RULER's (``string_match_all``): the fraction of the answers that occur in the
output, here as contiguous token ids of ``" " + answer`` (the tokenizers this is used with
give a word or number after a space the same ids wherever it stands). Never imports vLLM.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Callable

from .base import RulerCase, Tokenizer, WorkloadError

#: Needles in a ``multikey`` prompt (one asked for, the rest distractors), as RULER's multikey_1.
MULTIKEY_KEYS = 4
#: Values of the one key in a ``multivalue`` prompt (RULER's default).
MULTIVALUE_VALUES = 4
#: Hops of the ``vartrack`` chain (RULER's default: one chain of 4 hops, 5 variables).
VARTRACK_HOPS = 4
#: Documents in a ``qa`` prompt: one answers the question, the others are about other people
#: in other cities and trades (a wrong document's answer scores 0).
QA_DOCUMENTS = 5
#: Digits of a value (RULER's numbers).
VALUE_DIGITS = 7

_ADJECTIVES = (
    "amber",
    "bitter",
    "brave",
    "calm",
    "clever",
    "crimson",
    "curious",
    "distant",
    "eager",
    "early",
    "fancy",
    "gentle",
    "golden",
    "happy",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "kind",
    "lazy",
    "lively",
    "lucky",
    "mellow",
    "misty",
    "noble",
    "odd",
    "pale",
    "proud",
    "quick",
    "quiet",
    "rapid",
    "rustic",
    "silent",
    "silver",
    "sleepy",
    "smooth",
    "steady",
    "sunny",
    "tidy",
    "wild",
)
_NOUNS = (
    "anchor",
    "badge",
    "basket",
    "beacon",
    "bridge",
    "candle",
    "canyon",
    "castle",
    "cellar",
    "comet",
    "cottage",
    "desert",
    "falcon",
    "feather",
    "forest",
    "garden",
    "glacier",
    "harbor",
    "island",
    "kettle",
    "ladder",
    "lantern",
    "meadow",
    "mirror",
    "needle",
    "orchard",
    "palace",
    "pebble",
    "pillow",
    "quarry",
    "river",
    "saddle",
    "shelter",
    "spider",
    "statue",
    "tunnel",
    "valley",
    "violin",
    "wagon",
    "window",
)
#: The filler of ``vartrack``'s haystack: a few plain sentences, repeated.
NOISE = "The river runs down to the sea. The hills are quiet tonight. The day goes slowly by. Here we rest. "
_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

_INTRO = (
    "Some special magic numbers are hidden in the following text. Make sure to memorize them: "
    "you will be asked about them afterwards.\n\n"
)
_VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"


@lru_cache(maxsize=1)
def _prose() -> str:
    from pydoc_data.topics import topics

    # paragraphs of prose only: the reference's code samples (indented) and headings left out
    paras = [p.strip().replace("\n", " ") for t in sorted(topics) for p in topics[t].split("\n\n")]
    return " ".join(p for p in paras if p.count(". ") >= 1 and not p.startswith(("*", "-", ">>>")))


def _haystack(tokenizer: Tokenizer, rng: random.Random, tokens: int, noise: bool) -> tuple[list[str], str]:
    """About ``tokens`` tokens of haystack as a list of sentences, and its source."""
    if noise:
        n = max(1, tokens // len(tokenizer.encode(NOISE)) + 1)
        return [s + ". " for s in (NOISE * n).split(". ") if s.strip()], "noise"
    text = _prose()
    start = rng.randrange(0, len(text) // 2)
    start = text.find(". ", start) + 2  # a sentence's start
    chunk = text[start : start + tokens * 8]  # more characters than tokens (~4.5 per token)
    ids = tokenizer.encode(chunk)[:tokens]
    body = tokenizer.decode(ids)
    body = body[: body.rfind(". ") + 2] if ". " in body else body
    return [s + ". " for s in body.split(". ") if s.strip()], f"pydoc_data.topics@{start}"


def _insert(sentences: list[str], inserts: list[tuple[float, str]]) -> str:
    """The sentences with each ``(depth, needle)`` placed at the sentence boundary nearest it."""
    n = len(sentences)
    at: dict[int, list[str]] = {}
    for depth, needle in inserts:
        at.setdefault(max(0, min(n, round(depth * n))), []).append(needle + " ")
    parts: list[str] = []
    for k in range(n + 1):
        parts += at.get(k, [])
        if k < n:
            parts.append(sentences[k])
    return "".join(parts).strip()


def _fresh_pair(rng: random.Random, taken: set[str], first: tuple[str, ...], second: tuple[str, ...], sep: str) -> str:
    """A word of ``first`` and one of ``second`` joined by ``sep``, not yet in ``taken`` (added)."""
    while True:
        k = f"{rng.choice(first)}{sep}{rng.choice(second)}"
        if k not in taken:
            taken.add(k)
            return k


def _key(rng: random.Random, taken: set[str]) -> str:
    return _fresh_pair(rng, taken, _ADJECTIVES, _NOUNS, "-")


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS))
        if v not in taken:
            taken.add(v)
            return v


def _var(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice(_UPPER) for _ in range(5))
        if v not in taken:
            taken.add(v)
            return v


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _ask_one(key: str) -> str:
    return (
        f"\n\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )


def _spread(rng: random.Random, count: int, lo: float = 0.05, hi: float = 0.95) -> list[float]:
    width = (hi - lo) / count
    return [lo + width * (i + rng.random()) for i in range(count)]


# One case's draws: ``(intro, inserts, question, answers, depth)``.
_Draw = Callable[[random.Random, int], tuple[str, list[tuple[float, str]], str, list[str], float]]


def _single(rng: random.Random, i: int):
    key, value = _key(rng, set()), _number(rng, set())
    depth = rng.uniform(0.05, 0.95)
    return _INTRO, [(depth, _needle(key, value))], _ask_one(key), [value], depth


def _multikey(rng: random.Random, i: int):
    keys: set[str] = set()
    values: set[str] = set()
    pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(MULTIKEY_KEYS)]
    depths = _spread(rng, MULTIKEY_KEYS)
    ask = i % MULTIKEY_KEYS  # the key asked for cycles through the positions
    inserts = [(d, _needle(k, v)) for d, (k, v) in zip(depths, pairs)]
    key, value = pairs[ask]
    return _INTRO, inserts, _ask_one(key), [value], depths[ask]


def _multivalue(rng: random.Random, i: int):
    key = _key(rng, set())
    values: set[str] = set()
    vals = [_number(rng, values) for _ in range(MULTIVALUE_VALUES)]
    depths = _spread(rng, MULTIVALUE_VALUES)
    question = (
        f"\n\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
        f"The special magic numbers for {key} mentioned in the provided text are"
    )
    return _INTRO, [(d, _needle(key, v)) for d, v in zip(depths, vals)], question, vals, depths[0]


def _vartrack(rng: random.Random, i: int):
    names: set[str] = set()
    chain = [_var(rng, names) for _ in range(VARTRACK_HOPS + 1)]
    value = _number(rng, set())
    depths = _spread(rng, VARTRACK_HOPS + 1)
    inserts = [(depths[0], f"VAR {chain[0]} = {value}.")]
    inserts += [(d, f"VAR {b} = VAR {a}.") for d, a, b in zip(depths[1:], chain, chain[1:])]
    question = (
        f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain of variable assignments in the text above, {len(chain)} "
        f"variables are assigned the value {value}, they are:"
    )
    return _VT_INTRO, inserts, question, chain, depths[0]


_FIRST = (
    "Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Keiko", "Luca",
    "Mara", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wendell", "Yara",
)  # fmt: skip
_LAST = (
    "Abbott", "Brennan", "Castillo", "Dalton", "Eriksen", "Fischer", "Garcia", "Holloway", "Ivanova", "Jensen",
    "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quinlan", "Rossi", "Santos", "Tanaka",
)  # fmt: skip
#: ``qa``'s answers: the city a person works in, or their trade (each a word the model knows).
_CITIES = (
    "Lisbon", "Oslo", "Cairo", "Dublin", "Vienna", "Lima", "Seoul", "Nairobi", "Prague", "Quito", "Madrid",
    "Athens", "Helsinki", "Manila", "Warsaw", "Bogota", "Hanoi", "Zurich", "Havana", "Jakarta",
)  # fmt: skip
_JOBS = (
    "baker", "carpenter", "dentist", "pilot", "nurse", "lawyer", "painter", "farmer", "teacher", "chemist",
    "plumber", "librarian", "tailor", "surgeon", "jeweler", "architect", "butcher", "journalist",
)  # fmt: skip
_HOBBIES = (
    "plays the violin", "grows tomatoes", "collects stamps", "runs along the river", "bakes bread for friends",
    "reads old maps", "repairs bicycles", "sings in a choir", "paints birds", "climbs hills",
)  # fmt: skip
_QA_INTRO = "Answer the question based on the given documents.\n\nThe following are given documents.\n\n"


def _person(rng: random.Random, taken: set[str]) -> str:
    return _fresh_pair(rng, taken, _FIRST, _LAST, " ")


def _document(name: str, job: str, city: str, hobby: str) -> str:
    return f"Document: {name} works as a {job} in {city}. In the evenings, {name.split()[0]} {hobby}."


def _qa(rng: random.Random, i: int):
    names: set[str] = set()
    people = [_person(rng, names) for _ in range(QA_DOCUMENTS)]
    jobs, cities = rng.sample(_JOBS, QA_DOCUMENTS), rng.sample(_CITIES, QA_DOCUMENTS)
    depths = _spread(rng, QA_DOCUMENTS)
    docs = [_document(p, j, c, rng.choice(_HOBBIES)) for p, j, c in zip(people, jobs, cities)]
    ask = i % QA_DOCUMENTS  # the document asked about cycles through the positions
    name = people[ask]
    if i % 2 == 0:  # the city, then the trade, in turn
        question, answer, start = f"In which city does {name} work?", cities[ask], f"{name} works in"
    else:
        question, answer, start = f"What is the profession of {name}?", jobs[ask], f"{name} works as a"
    prompt = f"\n\nAnswer the question based on the given documents. Question: {question} Answer: {start}"
    return _QA_INTRO, list(zip(depths, docs)), prompt, [answer], depths[ask]


_DRAWS: dict[str, _Draw] = {
    "single": _single,
    "multikey": _multikey,
    "multivalue": _multivalue,
    "vartrack": _vartrack,
    "qa": _qa,
}
#: The haystacks: ``noise`` (:data:`NOISE` repeated, RULER's niah_single_1 and variable
#: tracking) and ``essay`` (CPython's reference prose, in place of RULER's essays; the needle
#: tasks only, ``vartrack`` keeps the noise as RULER's does).
HAYSTACKS = ("noise", "essay")


def prose_cases(
    tokenizer: Tokenizer, task: str, num: int, context_tokens: int, seed: int, haystack: str = "noise"
) -> list[RulerCase]:
    """``num`` cases of ``task`` (prompts of at most ``context_tokens`` tokens) in ``haystack``
    (:data:`HAYSTACKS`), deterministic in ``seed``: :class:`.base.RulerCase` with
    ``match="contains"``."""
    draw, noise = _DRAWS[task], haystack == "noise" or task == "vartrack"
    rng = random.Random(f"vllm-graft-ruler-prose:{task}:{seed}:{context_tokens}:{haystack}")
    out = []
    for i in range(num):
        intro, inserts, question, answers, depth = draw(rng, i)
        fixed = len(tokenizer.encode(intro + question + " ".join(n for _, n in inserts)))
        room = context_tokens - fixed - 2 * len(inserts) - 8
        if room < 64:
            raise WorkloadError(f"ruler {task}: a context of {context_tokens} tokens leaves no room for a haystack")
        for _ in range(4):  # the haystack's tokens shift a little once needles sit between its sentences
            sentences, source = _haystack(tokenizer, rng, room, noise)
            ids = tokenizer.encode(intro + _insert(sentences, inserts) + question)
            if len(ids) <= context_tokens:
                break
            room -= len(ids) - context_tokens + 8
        else:
            raise WorkloadError(f"ruler {task}: could not fit a prompt in {context_tokens} tokens")
        out.append(
            RulerCase(
                task,
                tuple(ids),
                tuple(tuple(tokenizer.encode(" " + a)) for a in answers),
                round(depth, 3),
                source,
                match="contains",
            )
        )
    return out
