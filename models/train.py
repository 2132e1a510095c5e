"""Train the bundled tiny models (tokenizer + dense Llama or Mixtral MoE).

    python models/train.py --model dense     # -> models/graft-tiny-llama/
    python models/train.py --model moe       # -> models/graft-tiny-mixtral/
    python models/train.py --model recall    # -> models/graft-tiny-llama-recall/
                                             #    (fine-tunes graft-tiny-llama to copy)

Deterministic for a given seed, corpus and machine *as long as the step
budget is reached before the time cap*: the learning-rate schedule follows
``progress = max(step / steps, elapsed / minutes)``, so on a fast enough
machine it is purely step-driven (the committed runs record which bound
ended each phase), and on a slow one training still stops within the cap.

Recipe (see models/README.md): phase 1 at sequence 512, batch 4, AdamW
lr 3e-3 (betas 0.9/0.95, wd 0.1, clip 1.0), 50 warm-up steps then cosine to
10%; phase 2 extends the context at sequence 2048, batch 1, lr 3e-4 -> 3e-5.

``--model recall`` starts from the weights and tokenizer of ``--init``
(graft-tiny-llama) and trains two phases (sequence 512, batch 4, lr 2e-3;
then sequence 2048, batch 1, lr 1e-3; both cosine to 10%) on a mixture of
training-split windows, windows where spans of the window itself are repeated
later (distance 64 to ~1900 tokens) and sequences holding a repeated
random-token span (``recall_sample``), with an auxiliary loss that trains two
heads to attend like induction heads and one like a previous-token head
(``attention_supervision``). See models/README.md.
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

FOLDERS = {"dense": "graft-tiny-llama", "moe": "graft-tiny-mixtral", "recall": "graft-tiny-llama-recall"}

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
    "recall": dict(steps=1200, long_steps=400),
}
# time caps of the two phases (recall: seq 512 then seq 2048, both on the recall mixture)
DEFAULT_MINUTES = {"dense": (24.0, 4.0), "moe": (24.0, 4.0), "recall": (16.0, 8.0)}


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


# ----------------------------------------------------------------------------- recall mixture
# Shares of the four kinds of training sequences of ``--model recall`` (see ``recall_sample``).
RECALL_MIX = dict(natural=0.2, self_copy=0.4, random_copy=0.2, random_repeat=0.2)
SPAN_MIN, SPAN_MAX = 8, 256  # copied span lengths, log-uniform
DIST_MIN, DIST_MAX = 64, 1900  # distance from a span's first copy to its repeat, uniform
PERIOD_MIN, PERIOD_MAX = 16, 512  # random_repeat: period of the repeated random span, log-uniform


def _span_len(rng: random.Random, lo: int = SPAN_MIN, hi: int = SPAN_MAX) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _place(rng: random.Random, n: int, span: int) -> tuple[int, int] | None:
    """(source, destination) of a span repeated later in a sequence of n tokens, or None."""
    hi = min(DIST_MAX, n - span)
    lo = max(DIST_MIN, span)  # the repeat never overlaps its source
    if hi < lo:
        return None
    d = rng.randint(lo, hi)
    src = rng.randint(0, n - span - d)
    return src, src + d


def _random_tokens(rng: random.Random, n: int, vocab: int) -> torch.Tensor:
    return torch.tensor([rng.randint(1, vocab - 1) for _ in range(n)])


def recall_sample(data: torch.Tensor, n: int, rng: random.Random, vocab: int, mix: dict = RECALL_MIX):
    """One training sequence of n tokens for ``--model recall``, and its kind.

    All text comes from the training split (a random window of n tokens).

    * ``natural``: the window as it is.
    * ``self_copy``: 1-4 spans of the window itself (8-256 tokens, log-uniform) overwrite the
      text 64-1900 tokens later (uniform distance, capped by the sequence): generic copying of
      text from anywhere earlier.
    * ``random_copy``: a span of uniformly random token ids (1..vocab-1, 8-256 long) is written
      into the window and repeated 64-1900 tokens later, half the time a third time after that.
    * ``random_repeat``: the whole sequence is one random span (16-512 tokens, log-uniform)
      repeated end to end (the classic induction-head data).
    """
    r = rng.random()
    kind, acc = "random_repeat", 0.0
    for k, share in mix.items():
        acc += share
        if r < acc:
            kind = k
            break
    start = rng.randint(0, data.numel() - n - 1)
    x = data[start:start + n].clone().long()
    if kind == "self_copy":
        for _ in range(rng.randint(1, 4)):
            span = _span_len(rng)
            where = _place(rng, n, span)
            if where:
                src, dst = where
                x[dst:dst + span] = x[src:src + span].clone()
    elif kind == "random_copy":
        span = _span_len(rng)
        where = _place(rng, n, span)
        if where:
            src, dst = where
            rnd = _random_tokens(rng, span, vocab)
            x[src:src + span] = rnd
            x[dst:dst + span] = rnd
            if rng.random() < 0.5 and dst + 2 * span <= n:
                third = rng.randint(dst + span, n - span)
                x[third:third + span] = rnd
    elif kind == "random_repeat":
        span = _span_len(rng, PERIOD_MIN, min(PERIOD_MAX, n // 2))
        x = _random_tokens(rng, span, vocab).repeat(n // span + 1)[:n]
    return x, kind


# Attention supervision of --model recall: (layer, query head) pairs trained to attend like an
# induction head (see induction_targets), and one trained to attend to the previous token (the
# first half of the induction circuit: it writes the previous token into each position).
SUPERVISED_HEADS = ((1, 0), (2, 2))
PREVIOUS_TOKEN_HEAD = (0, 0)


def induction_targets(x: list[int]) -> tuple[list[int], list[int]]:
    """(query positions, key positions) of the induction pattern of a token sequence: a query at
    position t whose last three tokens x[t-2..t] occurred before, most recently ending at j < t-1,
    should attend to j + 1, the token that followed them then. Computed from the tokens alone,
    for any sequence (natural text included)."""
    last: dict[tuple[int, int, int], int] = {}
    qs, ks = [], []
    for t in range(2, len(x)):
        key = (x[t - 2], x[t - 1], x[t])
        j = last.get(key)
        if j is not None and j + 1 < t:
            qs.append(t)
            ks.append(j + 1)
        last[key] = t
    return qs, ks


def attention_supervision(coef: float):
    """Extra loss: coef x the mean, over SUPERVISED_HEADS at the induction positions and over
    PREVIOUS_TOKEN_HEAD at every position after the first, of -log(attention probability on the
    target). Needs the eager attention (weights returned)."""

    def extra(out, x: torch.Tensor):
        losses = []
        n = x.shape[1]
        layer, head = PREVIOUS_TOKEN_HEAD
        a = out.attentions[layer][:, head]
        losses.append(-torch.log(a[:, torch.arange(1, n), torch.arange(0, n - 1)].float().clamp_min(1e-30)).mean())
        for b in range(x.shape[0]):
            qs, ks = induction_targets(x[b].tolist())
            if not qs:
                continue
            q = torch.tensor(qs)
            k = torch.tensor(ks)
            for layer, head in SUPERVISED_HEADS:
                a = out.attentions[layer][b, head]
                losses.append(-torch.log(a[q, k].float().clamp_min(1e-30)).mean())
        return coef * torch.stack(losses).mean() if losses else None

    return extra


@torch.no_grad()
def copy_probe(model, data: torch.Tensor, vocab: int, seed: int = 0) -> dict:
    """Mean loss (nats) on the first vs the second copy of (a) a 64-token random span at
    positions 100 and 164 (near) or 300 and 1500 (random) and (b) a 128-token training-text span at 200 and 1700, each in a
    2048-token training window (first token of each copy excluded)."""
    rng = random.Random(seed)
    start = rng.randint(0, data.numel() - 2049)
    out = {}
    for name, (src, dst, span) in {"near": (100, 164, 64), "random": (300, 1500, 64),
                                   "text": (200, 1700, 128)}.items():
        x = data[start:start + 2048].clone().long()
        if name != "text":
            x[src:src + span] = torch.tensor([rng.randint(1, vocab - 1) for _ in range(span)])
        x[dst:dst + span] = x[src:src + span].clone()
        was = model.training
        model.eval()
        logits = model(input_ids=x[None]).logits[0].float()
        model.train(was)
        nll = torch.nn.functional.cross_entropy(logits[:-1], x[1:], reduction="none")
        # target t is predicted at position t-1: nll[t-1]
        first = nll[src:src + span - 1].mean().item()
        second = nll[dst:dst + span - 1].mean().item()
        out[f"{name}_first"] = round(first, 3)
        out[f"{name}_second"] = round(second, 3)
    return out


def run_phase(model, data, *, kind, seq, batch, steps, minutes, peak, final, warmup,
              gen, log, name, clip=1.0, wd=0.1, sampler=None, probe=None, extra_loss=None):
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
        if sampler is None:
            starts = torch.randint(0, n_tokens - seq - 1, (batch,), generator=gen)
            x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
        else:
            x = torch.stack([sampler(seq + 1) for _ in range(batch)])
        kwargs = {"output_router_logits": True} if kind == "moe" else {}
        if extra_loss is not None:
            kwargs["output_attentions"] = True
        out = model(input_ids=x[:, :-1], **kwargs)
        logits = out.logits.float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss = ce
        aux = None
        if kind == "moe" and getattr(out, "aux_loss", None) is not None:
            aux = out.aux_loss
            loss = ce + aux_coef * aux
        extra = extra_loss(out, x[:, :-1]) if extra_loss is not None else None
        if extra is not None:
            loss = loss + extra
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
            if extra is not None:
                rec["attn_sup"] = round(extra.item(), 4)
            if probe is not None and (step % 50 == 0 or step == 1):
                rec.update(probe())
            log.append(rec)
            print(json.dumps(rec), flush=True)
    el = time.perf_counter() - t0
    if probe is not None:
        log.append(dict(phase=name, step=step, final_probe=True, **probe()))
        print(json.dumps(log[-1]), flush=True)
    return dict(phase=name, seq=seq, batch=batch, steps_budget=steps, minutes_cap=minutes, steps=step,
                tokens=tokens, seconds=round(el, 1), ended_by=ended_by,
                time_driven_steps=int(time_driven), final_loss_ema=round(ema or 0.0, 4),
                lr_peak=peak, lr_final=final, warmup=warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["dense", "moe", "recall"], required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=None, help="phase-1 step budget (seq 512, batch 4)")
    ap.add_argument("--long-steps", type=int, default=None, help="phase-2 step budget (seq 2048, batch 1)")
    ap.add_argument("--minutes", type=float, default=None, help="phase-1 time cap (default 24; recall 16)")
    ap.add_argument("--long-minutes", type=float, default=None, help="phase-2 time cap (default 4; recall 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default models/<name>)")
    ap.add_argument("--corpus-root", default=None, help="stdlib dir (default: this interpreter's)")
    ap.add_argument("--init", type=Path, default=HERE / FOLDERS["dense"],
                    help="recall only: the model whose weights and tokenizer are fine-tuned")
    ap.add_argument("--lr", type=float, default=2e-3,
                    help="recall only: peak learning rate of phase 1 (cosine to 10%%); phase 2 starts at half")
    ap.add_argument("--attn-sup", type=float, default=1.0,
                    help="recall only: weight of the induction attention supervision (0: off)")
    ap.add_argument("--short-seq", type=int, default=512,
                    help="recall only: phase-1 sequence length (batch 2048 // it)")
    ap.add_argument("--mix", default=",".join(str(v) for v in RECALL_MIX.values()),
                    help="recall only: shares of " + "/".join(RECALL_MIX) + " sequences")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    out_dir = args.out or HERE / FOLDERS[args.model]
    steps = args.steps or DEFAULTS[args.model]["steps"]
    minutes = args.minutes if args.minutes is not None else DEFAULT_MINUTES[args.model][0]
    long_minutes = args.long_minutes if args.long_minutes is not None else DEFAULT_MINUTES[args.model][1]
    long_steps = args.long_steps if args.long_steps is not None else DEFAULTS[args.model]["long_steps"]
    if args.model == "recall":
        return main_recall(args, out_dir, steps, minutes, long_steps, long_minutes)

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
    phases = [run_phase(model, data, kind=args.model, seq=512, batch=4, steps=steps, minutes=minutes,
                        peak=3e-3, final=3e-4, warmup=50, gen=gen, log=log, name="seq512")]
    if long_steps > 0:
        phases.append(run_phase(model, data, kind=args.model, seq=2048, batch=1, steps=long_steps,
                                minutes=long_minutes, peak=3e-4, final=3e-5, warmup=10, gen=gen,
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


def main_recall(args, out_dir: Path, steps: int, minutes: float, long_steps: int, long_minutes: float) -> None:
    """Fine-tune ``args.init`` on the recall mixture (``recall_sample``): phase 1 at sequence 512,
    batch 4 (many short repeats: induction heads form), phase 2 at sequence 2048, batch 1
    (distances up to 1900 tokens)."""
    import shutil

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    t_all = time.perf_counter()
    corp = corpus_mod.load_corpus(args.corpus_root)
    tok = Tokenizer.from_file(str(args.init / "tokenizer.json"))  # the init model's, unchanged
    train_ids = corpus_mod.encode_stream(tok, corp.train_texts)  # training split only
    data = torch.tensor(train_ids, dtype=torch.int32)
    vocab = tok.get_vocab_size()
    t_prep = time.perf_counter() - t_all
    print(f"corpus: {len(corp.train_files)} train files, {len(train_ids)} train tokens; prep {t_prep:.1f}s",
          flush=True)

    # eager attention: the attention supervision needs the attention weights
    attn = "eager" if args.attn_sup > 0 else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation=attn)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"recall: {n_params} parameters from {args.init}", flush=True)
    rng = random.Random(args.seed)
    kinds: dict[str, int] = {}
    shares = [float(v) for v in args.mix.split(",")]
    if len(shares) != len(RECALL_MIX) or abs(sum(shares) - 1.0) > 1e-6 or min(shares) < 0:
        raise SystemExit(f"--mix needs {len(RECALL_MIX)} non-negative shares summing to 1 "
                         f"({'/'.join(RECALL_MIX)}), got {args.mix!r}")
    mix = dict(zip(RECALL_MIX, shares))

    def sampler(n: int) -> torch.Tensor:
        x, kind = recall_sample(data, n, rng, vocab, mix)
        kinds[kind] = kinds.get(kind, 0) + 1
        return x

    def probe() -> dict:
        return copy_probe(model, data, vocab)

    gen = torch.Generator().manual_seed(args.seed)
    log: list[dict] = []
    phases = []
    for name, seq, batch, n_steps, cap, peak in ((f"recall{args.short_seq}", args.short_seq,
                                                  2048 // args.short_seq, steps, minutes, args.lr),
                                                ("recall2048", 2048, 1, long_steps, long_minutes, args.lr / 2)):
        if n_steps <= 0:
            continue
        kinds.clear()
        phases.append(run_phase(model, data, kind="dense", seq=seq, batch=batch, steps=n_steps, minutes=cap,
                                peak=peak, final=peak / 10, warmup=30, gen=gen, log=log, name=name,
                                sampler=sampler, probe=probe,
                                extra_loss=attention_supervision(args.attn_sup) if args.attn_sup > 0 else None))
        phases[-1]["sequences_by_kind"] = dict(kinds)
    train_seconds = time.perf_counter() - t_all

    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.config._attn_implementation = "sdpa"  # not saved in config.json; as the init model
    # a continued run (--init = the output folder) writes beside it first, then replaces it
    in_place = args.init.resolve() == out_dir.resolve()
    save_dir = out_dir.with_name(out_dir.name + ".new") if in_place else out_dir
    save_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(save_dir, safe_serialization=True)
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.init / f, save_dir / f)
    if in_place:
        for f in save_dir.iterdir():
            os.replace(f, out_dir / f.name)
        save_dir.rmdir()

    import tokenizers
    import transformers

    default_out = args.out is None
    record = dict(
        model="recall", folder=out_dir.name, init=args.init.name, seed=args.seed, parameters=n_params,
        weights_bytes=(out_dir / "model.safetensors").stat().st_size,
        threads=args.threads, prep_seconds=round(t_prep, 1), total_seconds=round(train_seconds, 1),
        tokens_seen=sum(p["tokens"] for p in phases), phases=phases,
        data=dict(mix=mix, span=[SPAN_MIN, SPAN_MAX], distance=[DIST_MIN, DIST_MAX],
                  random_repeat_period=[PERIOD_MIN, PERIOD_MAX],
                  train_tokens=len(train_ids), train_sha256=corp.fingerprint("train"),
                  python=corp.python),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                     python=sys.version.split()[0], torch=torch.__version__,
                     transformers=transformers.__version__, tokenizers=tokenizers.__version__),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        log=log,
    )
    # the recall model is trained in two runs (see models/README.md): the second continues the first
    stage = "train_recall_continued.json" if args.init.name == FOLDERS["recall"] else "train_recall.json"
    log_path = HERE / "logs" / stage if default_out else out_dir / "train_log.json"
    log_path.parent.mkdir(exist_ok=True)
    log_path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "log"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
