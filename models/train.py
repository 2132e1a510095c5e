"""Train the bundled tiny models (tokenizer + dense Llama or Mixtral MoE).

    python models/train.py --model dense     # -> models/graft-tiny-llama/
    python models/train.py --model moe       # -> models/graft-tiny-mixtral/

Deterministic for a given seed, corpus and machine *as long as the step
budget is reached before the time cap*: the learning-rate schedule follows
``progress = max(step / steps, elapsed / minutes)``, so on a fast enough
machine it is purely step-driven (the committed runs record which bound
ended each phase), and on a slow one training still stops within the cap.

Recipe (see models/README.md): phase 1 at sequence 512, batch 4, AdamW
lr 3e-3 (betas 0.9/0.95, wd 0.1, clip 1.0), 50 warm-up steps then cosine to
10%; phase 2 extends the context at sequence 2048, batch 1, lr 3e-4 -> 3e-5.
"""

from __future__ import annotations

import torch

torch.set_flush_denormal(True)  # first torch call: denormals slow CPU backward up to 1.7x

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as corpus_mod  # noqa: E402

FOLDERS = {"dense": "graft-tiny-llama", "moe": "graft-tiny-mixtral"}

COMMON = dict(
    vocab_size=corpus_mod.VOCAB_SIZE,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    hidden_act="silu",
)

# Default step budgets. Phase 1 is 1500 x 4 x 512 = 3.07M tokens: ~13-14 min
# at the ~3,900 tokens/s measured undisturbed on the 2-core machine, and still
# step-driven (reproducible) under the 24-minute cap down to ~2,150 tokens/s.
DEFAULTS = {
    "dense": dict(steps=1500, long_steps=160),
    "moe": dict(steps=1500, long_steps=160),
}


def build_config(kind: str):
    if kind == "dense":
        from transformers import LlamaConfig

        cfg = LlamaConfig(intermediate_size=688, rope_theta=10000.0, attention_bias=False,
                          mlp_bias=False, **COMMON)
    else:
        from transformers import MixtralConfig

        cfg = MixtralConfig(
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            output_router_logits=False,
            sliding_window=None,
            rope_theta=10000.0,
            **COMMON,
        )
    return cfg


def build_model(kind: str):
    from transformers import AutoModelForCausalLM

    cfg = build_config(kind)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    torch.use_deterministic_algorithms(True, warn_only=True)


def lr_at(progress: float, step: int, peak: float, final: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return final + 0.5 * (peak - final) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def run_phase(model, data, *, kind, seq, batch, steps, minutes, peak, final, warmup,
              gen, log, name, clip=1.0, wd=0.1):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak, betas=(0.9, 0.95), eps=1e-8,
    )
    n_tokens = data.numel()
    model.train()
    t0 = time.perf_counter()
    step = 0
    tokens = 0
    ended_by = "steps"
    time_driven = 0  # steps whose lr came from the time cap (not reproducible bit for bit)
    ema = None
    aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0) if kind == "moe" else 0.0
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(step / steps, elapsed / (minutes * 60.0))
        if progress >= 1.0:
            ended_by = "steps" if step >= steps else "time"
            break
        time_driven += step >= warmup and elapsed / (minutes * 60.0) > step / steps
        lr = lr_at(progress, step, peak, final, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_tokens - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
        kwargs = {"output_router_logits": True} if kind == "moe" else {}
        out = model(input_ids=x[:, :-1], **kwargs)
        logits = out.logits.float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss = ce
        aux = None
        if kind == "moe" and getattr(out, "aux_loss", None) is not None:
            aux = out.aux_loss
            loss = ce + aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        step += 1
        tokens += batch * seq
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        if step % 25 == 0 or step == 1:
            el = time.perf_counter() - t0
            rec = dict(phase=name, step=step, tokens=tokens, loss=round(ce.item(), 4), loss_ema=round(ema, 4),
                       lr=round(lr, 6), gnorm=round(float(gnorm), 3), elapsed_s=round(el, 1),
                       tok_per_s=round(tokens / max(el, 1e-9), 1))
            if aux is not None:
                rec["aux"] = round(aux.item(), 4)
            log.append(rec)
            print(json.dumps(rec), flush=True)
    el = time.perf_counter() - t0
    return dict(phase=name, seq=seq, batch=batch, steps_budget=steps, minutes_cap=minutes, steps=step,
                tokens=tokens, seconds=round(el, 1), ended_by=ended_by,
                time_driven_steps=int(time_driven), final_loss_ema=round(ema or 0.0, 4),
                lr_peak=peak, lr_final=final, warmup=warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["dense", "moe"], required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=None, help="phase-1 step budget (seq 512, batch 4)")
    ap.add_argument("--long-steps", type=int, default=None, help="phase-2 step budget (seq 2048, batch 1)")
    ap.add_argument("--minutes", type=float, default=24.0, help="phase-1 time cap")
    ap.add_argument("--long-minutes", type=float, default=4.0, help="phase-2 time cap")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default models/<name>)")
    ap.add_argument("--corpus-root", default=None, help="stdlib dir (default: this interpreter's)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    out_dir = args.out or HERE / FOLDERS[args.model]
    steps = args.steps or DEFAULTS[args.model]["steps"]
    long_steps = args.long_steps if args.long_steps is not None else DEFAULTS[args.model]["long_steps"]

    t_all = time.perf_counter()
    corp = corpus_mod.load_corpus(args.corpus_root)
    tok = corpus_mod.train_tokenizer(corp.train_texts)
    train_ids = corpus_mod.encode_stream(tok, corp.train_texts)
    held_ids = corpus_mod.encode_stream(tok, corp.heldout_texts)
    data = torch.tensor(train_ids, dtype=torch.int32)
    t_prep = time.perf_counter() - t_all
    print(f"corpus: {len(corp.train_files)} train files, {len(train_ids)} train tokens, "
          f"{len(held_ids)} held-out tokens; prep {t_prep:.1f}s", flush=True)

    model = build_model(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params} parameters", flush=True)

    gen = torch.Generator().manual_seed(args.seed)
    log: list[dict] = []
    phases = [run_phase(model, data, kind=args.model, seq=512, batch=4, steps=steps, minutes=args.minutes,
                        peak=3e-3, final=3e-4, warmup=50, gen=gen, log=log, name="seq512")]
    if long_steps > 0:
        phases.append(run_phase(model, data, kind=args.model, seq=2048, batch=1, steps=long_steps,
                                minutes=args.long_minutes, peak=3e-4, final=3e-5, warmup=10, gen=gen,
                                log=log, name="seq2048"))
    train_seconds = time.perf_counter() - t_all

    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.config.output_router_logits = False
    model.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(out_dir)
    corpus_mod.to_hf_tokenizer(tok).save_pretrained(out_dir)

    import tokenizers
    import transformers

    manifest = corp.manifest()
    manifest.update(vocab_size=tok.get_vocab_size(), train_tokens=len(train_ids), heldout_tokens=len(held_ids))
    default_out = args.out is None
    # a run into the default folder records the corpus and its log under models/; any other run
    # writes both beside its weights
    (HERE / "corpus.json" if default_out else out_dir / "corpus.json").write_text(
        json.dumps(manifest, indent=1) + "\n")
    record = dict(
        model=args.model, folder=out_dir.name, seed=args.seed, parameters=n_params,
        weights_bytes=(out_dir / "model.safetensors").stat().st_size,
        threads=args.threads, prep_seconds=round(t_prep, 1), total_seconds=round(train_seconds, 1),
        tokens_seen=sum(p["tokens"] for p in phases), phases=phases,
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                     python=sys.version.split()[0], torch=torch.__version__,
                     transformers=transformers.__version__, tokenizers=tokenizers.__version__),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        log=log,
    )
    log_path = HERE / "logs" / f"train_{args.model}.json" if default_out else out_dir / "train_log.json"
    log_path.parent.mkdir(exist_ok=True)
    log_path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "log"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
