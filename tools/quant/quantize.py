"""``vllm-graft quantize METHOD [options] MODEL OUT``: write a pre-quantised checkpoint.

For every linear weight ``P.weight`` of the model (Llama layout: ``q/k/v/o_proj``,
``gate/up/down_proj``; and ``model.embed_tokens``/``lm_head`` when the method
``covers_embeddings`` and the embeddings are not tied) the plugin's ``quantize`` gives the
tensors stored as ``P.<name>``; they must match its ``stored_tensors(out, in)``. Everything
else (norms) is kept, cast to ``--dtype``. ``config.json`` gets ``"quantization_config":
{"quant_method": "graft-METHOD", "graft_format": 1, "params": {...}, "embeddings": bool}``
and the tokenizer and generation files are copied, so ``vllm serve OUT`` /
``LLM(model=OUT)`` loads it with the plugin, no deployment needed.

Methods that need calibration (``QuantMethod.needs_calibration``) get, per weight, the
squared gradients of the language-model loss on calibration text (``--calibration``,
default: the bundled corpus), computed with transformers on the unquantised model; a method
whose ``calibration_statistic`` is ``"activations"`` gets instead each layer's mean squared
input activation per channel (``[in]``, ``diag(X^T X) / T``), from forward passes only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

#: The linear layers of the Llama layout that vLLM builds with the quant config.
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
COPY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


class QuantizeError(ValueError):
    pass


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "quantize",
        help="write a pre-quantised checkpoint that vLLM loads with a quant plugin",
        description="Quantise (or compress) every linear weight of MODEL with the quant plugin "
        "METHOD and write the checkpoint to OUT (safetensors, config.json with its "
        "quantization_config, tokenizer files). `vllm serve OUT` then uses the plugin.",
    )
    p.add_argument("method", help="a quant plugin (see `vllm-graft plugins --kind quant`)")
    p.add_argument("model", help="the unquantised model folder")
    p.add_argument("out", help="the folder to write (must not exist, or be empty)")
    p.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a plugin parameter (repeatable; values are JSON or plain strings)",
    )
    p.add_argument("--bits", type=int, help="shortcut for --param bits=N")
    p.add_argument(
        "--dtype",
        choices=("auto", "float16", "bfloat16", "float32"),
        default="auto",
        help="dtype of the weights before quantisation and of the unquantised tensors "
        "(default: the model's; dfloat11 needs bfloat16)",
    )
    p.add_argument(
        "--calibration", help="text file for calibration (methods that need it; default: the bundled corpus)"
    )
    p.set_defaults(func=cmd_quantize)

    e = sub.add_parser(
        "quant-eval",
        help="perplexity on held-out text and checkpoint size of models in vLLM",
        description="For each MODEL (a plain or a pre-quantised checkpoint), in vLLM (in-process "
        "engine): perplexity of held-out text of the bundled corpus (prompt_logprobs over fixed "
        "windows: the model's own distribution, teacher-forced), checkpoint bytes and bits per "
        "parameter stored. The first model is the baseline for the relative change. Not the "
        "perplexity `vllm-graft bench` reports: that one scores each arm's generated outputs "
        "under the unmodified model, so it also moves with every token the quantised model "
        "chose differently (issue 64 saw +0.16% here and +7.9% there for one method). No speed column: "
        "one engine at a time cannot alternate arms; `vllm-graft bench DEPLOYMENT` does, with "
        "the spread of its paired runs.",
    )
    e.add_argument("models", nargs="+", metavar="MODEL")
    e.add_argument("--dtype", default="auto", help="engine dtype (default: each checkpoint's)")
    e.add_argument("--windows", type=int, default=16, help="held-out windows scored (default 16)")
    e.add_argument("--window-len", type=int, default=512, help="tokens per window (default 512)")
    e.add_argument(
        "--method",
        action="append",
        default=[],
        metavar="NAME[:{JSON}]",
        help="also evaluate the first MODEL with the registered quant plugin NAME applied when "
        "vLLM loads it (online, a deployment's quant section; a third party's plugin too), "
        "with --params or its own JSON (validated by its parameter model); repeatable or a "
        "comma list. Its size columns are the source checkpoint's (bits/param not shown)",
    )
    e.add_argument("--params", metavar="JSON", help="parameters for every --method plugin (under NAME:{JSON})")
    e.add_argument("--json", action="store_true", help="print JSON only")
    e.set_defaults(func=cmd_quant_eval)

    from . import kernel_bench as quant_kernel_bench

    quant_kernel_bench.add_command(sub)  # quant-kernel-bench


def cmd_quantize(args: argparse.Namespace, console: Any) -> int:
    from ...launch.exits import EXIT_INVALID, EXIT_OK

    try:
        params = parse_params(args.param)
        if args.bits is not None:
            params["bits"] = args.bits
        report = quantize_checkpoint(
            args.method, args.model, args.out, params, dtype=args.dtype, calibration=args.calibration, log=console.print
        )
    except QuantizeError as e:
        console.print(f"[red]vllm-graft quantize: {e}[/red]")
        return EXIT_INVALID
    console.print(json.dumps(report, indent=2))
    return EXIT_OK


def cmd_quant_eval(args: argparse.Namespace, console: Any) -> int:
    from ...launch.exits import EXIT_OK
    from ...launch.engine import apply_env_defaults

    from ...launch.exits import EXIT_USAGE
    from ..plugin_args import PluginArgError, parse_json_params, parse_spec, split_list, validate

    try:  # every plugin and its parameters validated before any engine starts
        common = parse_json_params(getattr(args, "params", None))
        methods = []
        for item in [x for part in getattr(args, "method", None) or [] for x in split_list(part)]:
            name, own = parse_spec(item)
            methods.append({"plugin": name, "params": validate("quant", name, {**common, **(own or {})})})
    except PluginArgError as e:
        console.print(f"[red]vllm-graft quant-eval: {e}[/red]")
        return EXIT_USAGE
    apply_env_defaults(in_process=True)
    if args.json:  # stdout holds the JSON only: vLLM's log lines go to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    rows = [
        evaluate(
            m,
            dtype=args.dtype,
            windows=args.windows,
            window_len=args.window_len,
        )
        for m in args.models
    ]
    rows += [
        evaluate(
            args.models[0],
            dtype=args.dtype,
            windows=args.windows,
            window_len=args.window_len,
            quant=q,
        )
        for q in methods
    ]
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_change_pct"] = round(100 * (r["perplexity"] / base - 1), 3)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            stored = r["checkpoint_dtype"] + " checkpoint"
            console.print(
                f"{r['model']}: ppl {r['perplexity']:.4f} ({r['ppl_change_pct']:+.2f}%), "
                f"{r['checkpoint_bytes']} bytes, "
                + (f"{r['bits_per_param']:.3f} bits/param stored, " if r["bits_per_param"] is not None else "")
                + f"{r['quant_method'] or 'unquantised'} ({stored}, computed in {r['dtype']})"
                + (f", params {json.dumps(r['params'])}" if r["params"] else "")
            )
        console.print(json.dumps(rows))
        console.print("speed: `vllm-graft bench DEPLOYMENT` (arms alternated, with their spread)")
    return EXIT_OK


def evaluate(
    model: str,
    *,
    dtype: str = "auto",
    windows: int = 16,
    window_len: int = 512,
    quant: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Held-out perplexity and size of one model in vLLM (in-process engine).
    ``quant`` (``{"plugin", "params"}``): with that quant plugin applied at load (a
    deployment's ``quant`` section); the sizes are then the source checkpoint's."""
    import gc
    import math

    from safetensors import safe_open
    from vllm import LLM, SamplingParams

    path = Path(model)
    files = sorted(path.glob("*.safetensors"))
    n_bytes = sum(f.stat().st_size for f in files)
    cfg = json.loads((path / "config.json").read_text())
    tensor_bytes = 0
    float_bytes: dict[str, int] = {}  # the checkpoint's floating dtypes, by bytes held
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = n * SAFETENSORS_BYTES.get(t.get_dtype(), 4)
                tensor_bytes += size
                if t.get_dtype() in SAFETENSORS_FLOATS:
                    name = SAFETENSORS_FLOATS[t.get_dtype()]
                    float_bytes[name] = float_bytes.get(name, 0) + size
    engine = {"dtype": dtype, "max_model_len": max(window_len + 8, 1024), "enforce_eager": True}
    if quant is None:
        llm = LLM(model=str(path), **engine, seed=0)
    else:
        from ...launch import engine as launch
        from ...integration.plan import plan_for

        plan = plan_for(
            {"model": str(path.resolve()), "engine": engine, "quant": quant},
            source=f"quant-eval --method {quant['plugin']}",
        )
        # every parameter the plugin ran with, its defaults included (not only those given)
        (enabled,) = plan.by_kind("quant")
        quant = {**quant, "params": enabled.params.model_dump(mode="json")}
        llm = LLM(**launch.llm_kwargs(plan, graft=True), seed=0)
    try:
        tok = llm.get_tokenizer()
        ids = tok(corpus_text("heldout", 400_000)).input_ids
        chunks = [ids[i * window_len : (i + 1) * window_len] for i in range(windows)]
        chunks = [c for c in chunks if len(c) == window_len]
        out = llm.generate(
            [{"prompt_token_ids": c} for c in chunks],
            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
            use_tqdm=False,
        )
        nll = []
        for c, o in zip(chunks, out):
            for t, lp in zip(c[1:], o.prompt_logprobs[1:]):
                nll.append(-lp[t].logprob)
        if quant is not None:  # what the plugin did (the in-process engine's runtime)
            from ...integration.runtime import RUNTIME

            report = RUNTIME.report()
        engine_dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    q = cfg.get("quantization_config") or {}
    if quant is not None:
        q = {"quant_method": f"{quant['plugin']} (online)", "params": quant["params"], "runtime_report": report}
    n_weights = _source_params(cfg, path)
    return {
        "model": str(path),
        "quant_method": q.get("quant_method"),
        "params": q.get("params"),
        "dtype": engine_dtype,  # what vLLM computed in
        # what the checkpoint's floating tensors are stored in (most bytes; bits_per_param counts them)
        "checkpoint_dtype": max(float_bytes, key=float_bytes.__getitem__) if float_bytes else "none",
        "perplexity": math.exp(sum(nll) / len(nll)),
        "scored_tokens": len(nll),
        "checkpoint_bytes": n_bytes,
        "tensor_bytes": tensor_bytes,
        "bits_per_param": 8 * tensor_bytes / n_weights if quant is None else None,
        "params_count": n_weights,
        **({"runtime_report": q["runtime_report"]} if quant is not None else {}),
    }


#: bytes per element of safetensors' dtypes (others: counted as 4)
SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1}
#: safetensors' floating dtype names -> torch's
SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _source_params(cfg: dict[str, Any], path: Path) -> int:
    """Parameters of the unquantised Llama model ``cfg`` describes (for bits per parameter)."""
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i + 2 * h
    emb = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return L * per_layer + emb + h


def parse_params(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise QuantizeError(f"--param {item!r}: write KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _plugin(method: str, params: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from ...hooks import Kind, QuantMethod, RegistryError, get_registry

    registry = get_registry()
    try:
        entry = registry.get(Kind.QUANT, method)
    except (RegistryError, KeyError) as e:
        names = [e.name for e in registry.entries(Kind.QUANT)]
        raise QuantizeError(f"unknown quant plugin {method!r}; installed: {', '.join(names)}") from e
    reg = entry.registration
    try:
        p = reg.params.model_validate(params)
    except ValidationError as e:
        raise QuantizeError(f"bad parameters for {method!r}: {e}") from e
    cls = reg.load()
    if not (isinstance(cls, type) and issubclass(cls, QuantMethod)):
        raise QuantizeError(f"quant plugin {method!r}: impl {reg.impl!r} is not a QuantMethod")
    plugin = cls(p)
    if plugin.stored_tensors(1, 1) is None:
        raise QuantizeError(
            f"quant plugin {method!r} quantises online only (it defines no "
            "stored_tensors): enable it in a deployment on the unquantised model"
        )
    return plugin, reg


def _source_config(src: Path, dst: Path) -> dict[str, Any]:
    """The unquantised model's config.json, refused with the reason where ``quantize`` cannot
    take the model or write into ``dst``."""
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise QuantizeError(f"{src}: no config.json (give a local model folder)")
    cfg = json.loads(cfg_path.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise QuantizeError(
            f"{src}: architecture {arch} is not supported by `quantize` (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "quantization_config" in cfg:
        raise QuantizeError(
            f"{src}: already quantised ({cfg['quantization_config'].get('quant_method')}); give the unquantised model"
        )
    if dst.exists() and any(dst.iterdir()):
        raise QuantizeError(f"{dst}: exists and is not empty")
    return cfg


def _targets(src: Path, cfg: dict[str, Any], state: dict[str, Any], covers_embeddings: bool) -> tuple[list[str], bool]:
    """The weights to quantise (every linear layer's, and the embeddings where the plugin covers
    them and they are not tied), and whether the embeddings are among them."""
    tied = bool(cfg.get("tie_word_embeddings", False))
    embeddings = covers_embeddings and not tied and all(k in state for k in EMBEDDINGS)
    targets = [
        k for k in state if k.endswith(".weight") and state[k].dim() == 2 and k.rsplit(".", 2)[-2] in LINEAR_SUFFIXES
    ]
    if embeddings:
        targets += list(EMBEDDINGS)
    if not targets:
        raise QuantizeError(
            f"{src}: no linear weights found (expected names ending in "
            f"{', '.join(s + '.weight' for s in LINEAR_SUFFIXES)})"
        )
    return targets, embeddings


def quantize_checkpoint(
    method: str,
    model: str,
    out: str,
    params: dict[str, Any],
    *,
    dtype: str = "auto",
    calibration: str | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Write the checkpoint; returns a report (bytes, bits per weight, layers)."""
    import torch
    from safetensors.torch import load_file, save_file

    from ...integration.adapters.quant.checkpoint import CHECKPOINT_FORMAT, quantization_name

    plugin, reg = _plugin(method, params)
    src, dst = Path(model), Path(out)
    cfg = _source_config(src, dst)
    model_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    target = model_dtype if dtype == "auto" else dtype
    if target not in reg.capabilities.dtypes:
        raise QuantizeError(
            f"{method!r} supports dtype(s) {', '.join(reg.capabilities.dtypes)}, the "
            f"weights would be {target}; pass --dtype {reg.capabilities.dtypes[0]}"
        )
    tdtype = getattr(torch, target)

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"{src}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))

    targets, embeddings = _targets(src, cfg, state, plugin.covers_embeddings)

    sens = None
    if getattr(plugin, "needs_calibration", False):
        statistic = getattr(plugin, "calibration_statistic", "gradients")
        n_tokens = getattr(plugin.params, "calibration_tokens", 4096)
        if statistic == "activations":
            log(f"calibrating {method} on {calibration or 'the bundled corpus'} (mean squared input activations)")
            sens = activation_moments(src, targets, calibration, n_tokens)
        else:
            log(f"calibrating {method} on {calibration or 'the bundled corpus'} (squared gradients)")
            sens = squared_gradients(src, targets, calibration, n_tokens)

    out_state: dict[str, torch.Tensor] = {}
    quantised_elems = quantised_bytes = 0
    for name, t in state.items():
        if name not in targets:
            out_state[name] = t.to(tdtype) if t.is_floating_point() else t
            continue
        w = t.to(tdtype)
        prefix = name[: -len(".weight")]
        got = plugin.quantize(w, sensitivity=sens[name]) if sens is not None else plugin.quantize(w)
        specs = plugin.stored_tensors(*w.shape)
        _check_stored(method, prefix, got, specs)
        for k, v in got.items():
            out_state[f"{prefix}.{k}"] = v.contiguous()
            quantised_bytes += v.numel() * v.element_size()
        quantised_elems += w.numel()

    dst.mkdir(parents=True, exist_ok=True)
    save_file(out_state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    new_cfg = dict(cfg)
    for key in ("torch_dtype", "dtype"):
        if key in new_cfg or key == "dtype":
            new_cfg[key] = target
    new_cfg["quantization_config"] = {
        "quant_method": quantization_name(method),
        "graft_format": CHECKPOINT_FORMAT,
        "params": plugin.checkpoint_params(),
        "embeddings": embeddings,
    }
    (dst / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    for fname in COPY_FILES:
        if (src / fname).is_file():
            shutil.copy2(src / fname, dst / fname)

    src_bytes = sum(f.stat().st_size for f in files)
    out_bytes = (dst / "model.safetensors").stat().st_size
    ref_bytes = sum(t.numel() for t in state.values()) * torch.finfo(tdtype).bits // 8
    report = {
        "method": method,
        "params": plugin.checkpoint_params(),
        "out": str(dst),
        "layers": len(targets),
        "embeddings_quantised": embeddings,
        "quantised_weights": quantised_elems,
        "bits_per_quantised_weight": round(8 * quantised_bytes / max(quantised_elems, 1), 3),
        "checkpoint_bytes": out_bytes,
        "source_bytes": src_bytes,
        f"{target}_checkpoint_bytes": ref_bytes,
        f"ratio_to_{target}": round(out_bytes / ref_bytes, 4),
    }
    return report


def _check_stored(method: str, prefix: str, got: Any, specs: Any) -> None:
    if not isinstance(got, dict) or set(got) != set(specs):
        raise QuantizeError(
            f"{method}: quantize() for {prefix} returned {sorted(got) if isinstance(got, dict) else type(got)}, "
            f"but stored_tensors() declares {sorted(specs)}"
        )
    for k, spec in specs.items():
        v = got[k]
        if str(v.dtype).removeprefix("torch.") != spec.dtype:
            raise QuantizeError(f"{method}: {prefix}.{k} is {v.dtype}, stored_tensors() says {spec.dtype}")
        if spec.ragged and v.dim() != 1 or not spec.ragged and tuple(v.shape) != tuple(spec.shape):
            raise QuantizeError(
                f"{method}: {prefix}.{k} has shape {tuple(v.shape)}, stored_tensors() says {spec.shape}"
            )


def _calibration_model(model: Path, calibration: str | None, n_tokens: int) -> tuple[Any, Any]:
    """The unquantised model (transformers, float32, eval mode) and the calibration token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = Path(calibration).read_text() if calibration else corpus_text("train", 60_000)
    tok = AutoTokenizer.from_pretrained(str(model))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    ids = tok(text, return_tensors="pt").input_ids[0][:n_tokens]
    if ids.numel() < 64:
        raise QuantizeError(f"calibration text has only {ids.numel()} tokens; give more (--calibration)")
    lm.eval()
    return lm, ids


CALIBRATION_WINDOW = 256


def activation_moments(model: Path, targets: list[str], calibration: str | None, n_tokens: int) -> dict[str, Any]:
    """Per weight ``P.weight`` ``[out, in]``: the mean over calibration tokens of the squared input
    of module ``P`` per input channel, ``[in]`` float32 (``diag(X^T X) / T``, the diagonal of the
    layer Hessian GPTQ-family methods use, up to a factor), from forward passes (windows of 256)."""
    import torch

    lm, ids = _calibration_model(model, calibration, n_tokens)
    modules = dict(lm.named_modules())
    missing = [t for t in targets if t[: -len(".weight")] not in modules]
    if missing:
        raise QuantizeError(f"calibration: transformers' model has no module {missing[0][: -len('.weight')]}")
    sums = {t: torch.zeros(modules[t[: -len(".weight")]].weight.shape[1]) for t in targets}
    count = [0]

    def hook(name):
        def record(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] += (x * x).sum(0)

        return record

    handles = [modules[t[: -len(".weight")]].register_forward_pre_hook(hook(t)) for t in targets]
    try:
        with torch.no_grad():
            for start in range(0, ids.numel() - 1, CALIBRATION_WINDOW):
                x = ids[start : start + CALIBRATION_WINDOW][None]
                lm(input_ids=x)
                count[0] += x.shape[1]
    finally:
        for h in handles:
            h.remove()
    return {t: s / max(count[0], 1) for t, s in sums.items()}


def squared_gradients(model: Path, targets: list[str], calibration: str | None, n_tokens: int) -> dict[str, Any]:
    """Per weight: the sum over calibration windows of the squared gradient of the mean
    next-token loss (the diagonal Fisher information SqueezeLLM weights its k-means with),
    computed in float32 with transformers."""
    import torch

    lm, ids = _calibration_model(model, calibration, n_tokens)
    params = dict(lm.named_parameters())
    missing = [t for t in targets if t not in params]
    if missing:
        raise QuantizeError(f"calibration: transformers' model has no parameter {missing[0]}")
    sens = {t: torch.zeros_like(params[t]) for t in targets}
    window = CALIBRATION_WINDOW
    for start in range(0, ids.numel() - 1, window):
        x = ids[start : start + window + 1][None]
        if x.shape[1] < 2:
            break
        lm.zero_grad()
        loss = torch.nn.functional.cross_entropy(lm(input_ids=x[:, :-1]).logits[0], x[0, 1:])
        loss.backward()
        for t in targets:
            sens[t] += params[t].grad.detach() ** 2
    return sens


# ------------------------------------------------------------------- the bundled corpus
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HOLDOUT_SALT = "graft-heldout:"
HOLDOUT_PER_MILLE = 30
EOS = "<|endoftext|>"


def corpus_text(split: str, max_chars: int) -> str:
    """Text of the bundled models' corpus (models/corpus.py: the standard library's ``.py``
    files, sorted; ~3% of files held out by a salted hash), ``split`` "train" or "heldout",
    documents joined by the end-of-text token, cut at ``max_chars``."""
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out: list[str] = []
    size = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if any(part in EXCLUDED_DIRS for part in path.relative_to(root).parts):
            continue
        held = int(hashlib.sha256((HOLDOUT_SALT + rel).encode()).hexdigest(), 16) % 1000 < HOLDOUT_PER_MILLE
        if held != (split == "heldout"):
            continue
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        out.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return EOS.join(out)[:max_chars]


__all__ = ["add_command", "quantize_checkpoint", "evaluate", "QuantizeError", "squared_gradients", "activation_moments"]
