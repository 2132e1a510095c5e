"""Training text for the bundled tiny models: the Python standard library.

The corpus is the ``.py`` source of the standard library of the interpreter
that runs the script (``sysconfig.get_paths()["stdlib"]``), so every machine
has it and nothing is downloaded. Rules (recorded in ``models/corpus.json``):

* every ``*.py`` file under the stdlib directory, walked in sorted order of the
  POSIX relative path;
* excluded: any file with a path component in ``EXCLUDED_DIRS`` (test suites,
  third-party ``site-packages``, caches);
* decoded as UTF-8, falling back to Latin-1 for the few files that are not;
* held out (by file): ``sha256(HOLDOUT_SALT + relpath)`` read as an integer,
  modulo 1000, below ``HOLDOUT_PER_MILLE`` (30, i.e. ~3% of files);
* documents are joined with the ``<|endoftext|>`` token (id 0) in file order.

The byte-level BPE tokenizer (``VOCAB_SIZE`` tokens) is trained on the
training split only.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
HOLDOUT_SALT = "graft-heldout:"
HOLDOUT_PER_MILLE = 30
VOCAB_SIZE = 4096
EOS = "<|endoftext|>"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_held_out(relpath: str) -> bool:
    digest = hashlib.sha256((HOLDOUT_SALT + relpath).encode()).hexdigest()
    return int(digest, 16) % 1000 < HOLDOUT_PER_MILLE


@dataclass
class Corpus:
    root: str
    python: str
    train_files: list[str] = field(default_factory=list)
    heldout_files: list[str] = field(default_factory=list)
    train_texts: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)
    latin1_files: list[str] = field(default_factory=list)

    def fingerprint(self, which: str) -> str:
        h = hashlib.sha256()
        files = self.train_files if which == "train" else self.heldout_files
        texts = self.train_texts if which == "train" else self.heldout_texts
        for f, t in zip(files, texts):
            h.update(f.encode())
            h.update(b"\0")
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.hexdigest()

    def manifest(self) -> dict:
        return {
            "python": self.python,
            "stdlib_dir": self.root,
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "holdout_rule": (
                f"int(sha256('{HOLDOUT_SALT}' + relpath), 16) % 1000 < {HOLDOUT_PER_MILLE}"
            ),
            "n_train_files": len(self.train_files),
            "n_heldout_files": len(self.heldout_files),
            "train_chars": sum(map(len, self.train_texts)),
            "heldout_chars": sum(map(len, self.heldout_texts)),
            "train_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in self.train_texts),
            "heldout_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in self.heldout_texts),
            "train_sha256": self.fingerprint("train"),
            "heldout_sha256": self.fingerprint("heldout"),
            "latin1_fallback_files": self.latin1_files,
            "heldout_files": self.heldout_files,
        }


def load_corpus(root: str | os.PathLike | None = None) -> Corpus:
    base = Path(root).resolve() if root else stdlib_dir()
    paths = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                paths.append(Path(dirpath, name).relative_to(base).as_posix())
    paths.sort()
    corpus = Corpus(root=str(base), python=sys.version.split()[0])
    for rel in paths:
        raw = (base / rel).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
            corpus.latin1_files.append(rel)
        if is_held_out(rel):
            corpus.heldout_files.append(rel)
            corpus.heldout_texts.append(text)
        else:
            corpus.train_files.append(rel)
            corpus.train_texts.append(text)
    return corpus


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE over the training texts; deterministic for a given input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def to_hf_tokenizer(tok):
    """Wrap a ``tokenizers.Tokenizer`` so ``save_pretrained`` writes HF files."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer, texts: list[str]) -> list[int]:
    """Token ids of ``texts`` joined by EOS (EOS before each document)."""
    eos_id = tokenizer.token_to_id(EOS) if hasattr(tokenizer, "token_to_id") else tokenizer.convert_tokens_to_ids(EOS)
    if hasattr(tokenizer, "encode_batch"):
        encs = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    else:
        encs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    for ids in encs:
        out.append(eos_id)
        out.extend(ids)
    return out
