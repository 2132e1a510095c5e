"""Evaluate the bundled tiny models on the held-out split of the stdlib corpus.

    python models/evaluate.py            # writes models/eval.json and models/EVAL.md

* Held-out perplexity of each model (fp16 weights run in fp32) on windows of
  2048 tokens cut from the held-out stream (files joined by <|endoftext|>);
  every token of a window except its first is a target.
* n-gram baselines fitted on the training split with the same tokenizer and
  scored on exactly the same targets (their context is the preceding token(s)
  of the stream): unigram add-one, bigram add-one, bigram and trigram
  interpolated Kneser-Ney (discount n1 / (n1 + 2 n2) per order).
* Perplexity by target position in the window: 1-511, 512-1023, 1024-2047.
* Per held-out file perplexity, MoE expert load, and greedy continuations of
  held-out code.
* Copying (``copy_eval``): loss and top-1 accuracy on the second copy of a
  repeated span against its first copy: (a) 128 uniformly random tokens
  repeated right after themselves (the induction-head probe) and (b) a
  128-token held-out span copied ~1500-1700 tokens later into its own
  2048-token held-out window (recall from distant context).
"""

from __future__ import annotations

import torch

torch.set_flush_denormal(True)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as corpus_mod  # noqa: E402

MODELS = {"dense": "graft-tiny-llama", "moe": "graft-tiny-mixtral", "recall": "graft-tiny-llama-recall"}
COPY_TRIALS = 8
COPY_SPAN = 128
WINDOW = 2048
BUCKETS = [(1, 512), (512, 1024), (1024, 2048)]
SAMPLE_FILES = ["reprlib.py", "wsgiref/handlers.py", "email/feedparser.py", "turtledemo/chaos.py"]
SAMPLE_NEW_TOKENS = 48


# ----------------------------------------------------------------------------- n-gram baselines
def _lookup(sorted_keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(sorted_keys, query)
    idx_c = np.minimum(idx, len(sorted_keys) - 1)
    hit = sorted_keys[idx_c] == query
    return np.where(hit, values[idx_c], 0)


def _discount(counts: np.ndarray) -> float:
    n1 = int((counts == 1).sum())
    n2 = int((counts == 2).sum())
    return n1 / (n1 + 2 * n2) if n1 + 2 * n2 > 0 else 0.75


class NGramBaselines:
    """Count-based language models over token ids (vocab V)."""

    def __init__(self, train: np.ndarray, V: int):
        t = train.astype(np.int64)
        self.V = V
        self.N = len(t)
        self.uni = np.bincount(t, minlength=V).astype(np.float64)
        # bigram types and counts
        bk, bc = np.unique(t[:-1] * V + t[1:], return_counts=True)
        self.bk, self.bc = bk, bc.astype(np.float64)
        self.ctx1 = np.bincount(t[:-1], minlength=V).astype(np.float64)  # c(v .)
        self.types_after1 = np.bincount(bk // V, minlength=V).astype(np.float64)  # N1+(v .)
        cont = np.bincount(bk % V, minlength=V).astype(np.float64)  # N1+(. w)
        d0 = _discount(cont)
        n_types = float(len(bk))
        self.p_low = np.maximum(cont - d0, 0) / n_types + d0 * (cont > 0).sum() / n_types / V
        self.d2 = _discount(bc)
        # trigram types and counts
        tk, tc = np.unique((t[:-2] * V + t[1:-1]) * V + t[2:], return_counts=True)
        self.tk, self.tc = tk, tc.astype(np.float64)
        self.d3 = _discount(tc)
        ctx2k, ctx2c = np.unique(t[:-2] * V + t[1:-1], return_counts=True)  # c(u v .)
        self.ctx2k, self.ctx2c = ctx2k, ctx2c.astype(np.float64)
        self.ctx2_types = np.bincount(np.searchsorted(ctx2k, tk // V), minlength=len(ctx2k)).astype(np.float64)
        # middle order of the trigram model: continuation counts N1+(. v w)
        vw = tk % (V * V)
        mk, mc = np.unique(vw, return_counts=True)
        self.mk, self.mc = mk, mc.astype(np.float64)
        self.dm = _discount(mc)
        self.mid_denom = np.bincount(vw // V, minlength=V).astype(np.float64)  # sum_w N1+(. v w)
        self.mid_types = np.bincount(mk // V, minlength=V).astype(np.float64)  # |{w: N1+(. v w) > 0}|

    def unigram_add1(self, w):
        return (self.uni[w] + 1) / (self.N + self.V)

    def bigram_add1(self, v, w):
        return (_lookup(self.bk, self.bc, v * self.V + w) + 1) / (self.ctx1[v] + self.V)

    def bigram_kn(self, v, w):
        c = _lookup(self.bk, self.bc, v * self.V + w)
        cv = self.ctx1[v]
        p = (np.maximum(c - self.d2, 0) + self.d2 * self.types_after1[v] * self.p_low[w]) / np.maximum(cv, 1)
        return np.where(cv > 0, p, self.p_low[w])

    def _mid_kn(self, v, w):
        c = _lookup(self.mk, self.mc, v * self.V + w)
        den = self.mid_denom[v]
        p = (np.maximum(c - self.dm, 0) + self.dm * self.mid_types[v] * self.p_low[w]) / np.maximum(den, 1)
        return np.where(den > 0, p, self.p_low[w])

    def trigram_kn(self, u, v, w):
        V = self.V
        c = _lookup(self.tk, self.tc, (u * V + v) * V + w)
        ctx = u * V + v
        idx = np.minimum(np.searchsorted(self.ctx2k, ctx), len(self.ctx2k) - 1)
        hit = self.ctx2k[idx] == ctx
        cuv = np.where(hit, self.ctx2c[idx], 0)
        types = np.where(hit, self.ctx2_types[idx], 0)
        low = self._mid_kn(v, w)
        p = (np.maximum(c - self.d3, 0) + self.d3 * types * low) / np.maximum(cuv, 1)
        return np.where(cuv > 0, p, low)


# ----------------------------------------------------------------------------- model scoring
def windows(n: int):
    return [(s, min(s + WINDOW, n)) for s in range(0, n, WINDOW) if min(s + WINDOW, n) - s >= 2]


@torch.no_grad()
def model_nll(model, held: np.ndarray, expert_counts: dict | None = None):
    """NLL (nats) per target: array aligned with the stream (NaN where not a target)."""
    nll = np.full(len(held), np.nan)
    for s, e in windows(len(held)):
        x = torch.from_numpy(held[s:e].astype(np.int64))[None]
        kwargs = {"output_router_logits": True} if expert_counts is not None else {}
        out = model(input_ids=x, **kwargs)
        logp = torch.log_softmax(out.logits[0, :-1].float(), -1)
        nll[s + 1:e] = -logp.gather(1, x[0, 1:, None])[:, 0].double().numpy()
        if expert_counts is not None:
            k = model.config.num_experts_per_tok
            for layer, rl in enumerate(out.router_logits):
                top = rl.topk(k, dim=-1).indices.reshape(-1)
                expert_counts.setdefault(layer, np.zeros(model.config.num_local_experts))
                expert_counts[layer] += np.bincount(top.numpy(), minlength=model.config.num_local_experts)
    return nll


@torch.no_grad()
def copy_eval(model, held: np.ndarray, V: int, trials: int = COPY_TRIALS, span: int = COPY_SPAN) -> dict:
    """Mean NLL (nats) and top-1 accuracy on the first and the second copy of a repeated span
    (the first token of each copy, which nothing predicts, is not scored).

    ``random``: ``trials`` sequences of 128 uniform random tokens (ids 1..V-1) preceded by
    <|endoftext|> and repeated once, right after themselves (distance 128).
    ``heldout_far``: ``trials`` held-out windows of 2048 tokens in which the span at a random
    position in 64..319 overwrites the tokens 1500-1700 positions later (the first copy is
    scored in place, so both copies are the same tokens)."""
    rng = np.random.default_rng(0)
    out = {}
    for name in ("random", "heldout_far"):
        acc = {"first_nll": [], "second_nll": [], "first_acc": [], "second_acc": []}
        for _ in range(trials):
            if name == "random":
                rnd = rng.integers(1, V, span)
                x = np.concatenate([[0], rnd, rnd])
                src, dst = 1, 1 + span
            else:
                start = int(rng.integers(0, len(held) - WINDOW))
                x = held[start:start + WINDOW].copy()
                src = int(rng.integers(64, 320))
                dst = src + int(rng.integers(1500, 1701))
                dst = min(dst, WINDOW - span)
                x[dst:dst + span] = x[src:src + span]
            t = torch.from_numpy(x.astype(np.int64))[None]
            logits = model(input_ids=t).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="none").numpy()
            hit = (logits.argmax(-1) == t[0, 1:]).numpy()
            # target i is predicted at position i-1; skip each copy's first token
            for key, a in (("first", src), ("second", dst)):
                acc[f"{key}_nll"].append(nll[a:a + span - 1].mean())
                acc[f"{key}_acc"].append(hit[a:a + span - 1].mean())
        out[name] = {k: round(float(np.mean(v)), 4) for k, v in acc.items()}
    return out


def ppl(nll: np.ndarray) -> float:
    return float(math.exp(np.nanmean(nll)))


def target_positions(n: int) -> np.ndarray:
    pos = np.full(n, -1)
    for s, e in windows(n):
        pos[s + 1:e] = np.arange(1, e - s)
    return pos


def greedy_samples(model, tok, texts: dict[str, str]) -> list[dict]:
    out = []
    for name, text in texts.items():
        # prompt: the file up to the end of the first 'def' line after 40% of it (without its
        # newline: byte-level BPE merges a newline with the next line's indentation), last ~1200 chars
        start = text.find("def ", int(len(text) * 0.4))
        end = text.find("\n", start) if start >= 0 else int(len(text) * 0.5)
        prompt = text[max(0, end - 1200):end]
        prompt = prompt[prompt.find("\n") + 1:]  # start on a line boundary
        ids = tok.encode(prompt, add_special_tokens=False).ids
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False,
                                 eos_token_id=0, pad_token_id=0)[0, len(ids):].tolist()
        truth_ids = tok.encode(text[end:end + 2000], add_special_tokens=False).ids[:SAMPLE_NEW_TOKENS]
        out.append(dict(file=name, prompt_tail=prompt[-300:], prompt_tokens=len(ids),
                        continuation=tok.decode(gen), reference=tok.decode(truth_ids),
                        matching_prefix_tokens=next((i for i, (a, b) in enumerate(zip(gen, truth_ids)) if a != b),
                                                    min(len(gen), len(truth_ids)))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus-root", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    corp = corpus_mod.load_corpus(args.corpus_root)
    tok = Tokenizer.from_file(str(HERE / MODELS[args.models[0]] / "tokenizer.json"))
    for m in args.models[1:]:
        other = Tokenizer.from_file(str(HERE / MODELS[m] / "tokenizer.json"))
        assert other.to_str() == tok.to_str(), "the models must share one tokenizer"
    V = tok.get_vocab_size()
    train = np.array(corpus_mod.encode_stream(tok, corp.train_texts), dtype=np.int64)
    held = np.array(corpus_mod.encode_stream(tok, corp.heldout_texts), dtype=np.int64)
    # file index of each held-out token (EOS opens each document)
    file_idx = np.cumsum(held == 0) - 1
    pos = target_positions(len(held))
    tgt = pos >= 1
    print(f"train {len(train)} tokens, held-out {len(held)} tokens, {int(tgt.sum())} targets", flush=True)

    ng = NGramBaselines(train, V)
    w = held
    v = np.concatenate([[0], held[:-1]])
    u = np.concatenate([[0, 0], held[:-2]])
    base_nll = {
        "unigram add-one": -np.log(ng.unigram_add1(w)),
        "bigram add-one": -np.log(ng.bigram_add1(v, w)),
        "bigram Kneser-Ney": -np.log(ng.bigram_kn(v, w)),
        "trigram Kneser-Ney": -np.log(ng.trigram_kn(u, v, w)),
    }
    for k in base_nll:
        base_nll[k] = np.where(tgt, base_nll[k], np.nan)
    print({k: round(ppl(x), 2) for k, x in base_nll.items()}, flush=True)

    results: dict = dict(
        corpus=dict(python=corp.python, stdlib_dir=corp.root, train_tokens=int(len(train)),
                    heldout_tokens=int(len(held)), targets=int(tgt.sum()), window=WINDOW,
                    heldout_files=corp.heldout_files, heldout_sha256=corp.fingerprint("heldout")),
        discounts=dict(bigram=ng.d2, trigram=ng.d3, trigram_middle=ng.dm),
        perplexity={}, perplexity_excluding_encodings={}, by_position={}, by_file={}, expert_load={},
        samples={}, copying={},
    )
    all_nll = dict(base_nll)
    for m in args.models:
        path = HERE / MODELS[m]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        counts: dict | None = {} if m == "moe" else None
        t = time.perf_counter()
        all_nll[MODELS[m]] = model_nll(model, held, counts)
        print(f"{m}: ppl {ppl(all_nll[MODELS[m]]):.2f} ({time.perf_counter() - t:.1f}s)", flush=True)
        if counts is not None:
            results["expert_load"][MODELS[m]] = {
                f"layer{k}": [round(float(x), 4) for x in c / c.sum()] for k, c in counts.items()}
        texts = {f: corp.heldout_texts[corp.heldout_files.index(f)] for f in SAMPLE_FILES
                 if f in corp.heldout_files}
        results["samples"][MODELS[m]] = greedy_samples(model, tok, texts)
        results["copying"][MODELS[m]] = copy_eval(model, held, V)
        print(f"{m}: copying {results['copying'][MODELS[m]]}", flush=True)
        del model

    not_codec = np.array([not f.startswith("encodings/") for f in corp.heldout_files])[file_idx]
    for name, nll in all_nll.items():
        results["perplexity"][name] = round(ppl(nll), 3)
        results["perplexity_excluding_encodings"][name] = round(ppl(np.where(not_codec, nll, np.nan)), 3)
        results["by_position"][name] = {
            f"{a}-{b - 1}": round(ppl(np.where((pos >= a) & (pos < b), nll, np.nan)), 3) for a, b in BUCKETS}
        results["by_file"][name] = {
            f: round(ppl(np.where(file_idx == i, nll, np.nan)), 3) for i, f in enumerate(corp.heldout_files)
            if np.any(tgt & (file_idx == i))}
    results["seconds"] = round(time.perf_counter() - t0, 1)
    (HERE / "eval.json").write_text(json.dumps(results, indent=1) + "\n")
    (HERE / "EVAL.md").write_text(render_md(results))
    print(json.dumps({k: results[k] for k in ("perplexity", "by_position")}, indent=1))


def render_md(r: dict) -> str:
    names = list(r["perplexity"])
    models = [n for n in names if n.startswith("graft-")]
    bkn = r["perplexity"]["bigram Kneser-Ney"]
    c = r["corpus"]
    lines = [
        "# Held-out evaluation of the bundled tiny models",
        "",
        "Generated by `python models/evaluate.py` (see `models/README.md` for the corpus and training).",
        f"Held-out split: {len(c['heldout_files'])} stdlib files of Python {c['python']}, "
        f"{c['heldout_tokens']:,} tokens, {c['targets']:,} scored targets in windows of {c['window']} tokens. "
        "Baselines are fitted on the training split "
        f"({c['train_tokens']:,} tokens) with the same tokenizer and scored on the same targets.",
        "",
        "## Perplexity",
        "",
        "`excl. encodings/`: the same targets without the held-out codec modules (mostly"
        " character-map tables, which n-grams predict very well).",
        "",
        "| model | perplexity | vs bigram Kneser-Ney | excl. encodings/ | vs bigram KN | "
        + " | ".join(f"pos {k}" for k in r["by_position"][names[0]]) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(r["by_position"][names[0]]),
    ]
    bkn_x = r["perplexity_excluding_encodings"]["bigram Kneser-Ney"]
    for n in names:
        bp = " | ".join(f"{x:.1f}" for x in r["by_position"][n].values())
        px = r["perplexity_excluding_encodings"][n]
        lines.append(f"| {n} | {r['perplexity'][n]:.1f} | {r['perplexity'][n] / bkn:.2f}x | {px:.1f} | "
                     f"{px / bkn_x:.2f}x | {bp} |")
    if r.get("copying"):
        lines += ["", "## Copying from context", "",
                  f"`python models/evaluate.py`, function `copy_eval`: mean loss (nats) and top-1 accuracy on the "
                  f"second copy of a repeated {COPY_SPAN}-token span against its first copy, {COPY_TRIALS} trials "
                  "each (the first token of each copy not scored). *random*: uniform random token ids "
                  f"repeated right after themselves (the induction-head probe). *held-out, far*: a span at "
                  "position 64-319 of a 2048-token held-out window overwrites the tokens 1500-1700 positions "
                  "later. A model that copies has a far lower loss on the second copy.", "",
                  "| model | random: 1st copy loss | 2nd copy loss | 2nd copy top-1 | held-out far: 1st copy loss "
                  "| 2nd copy loss | 1st copy top-1 | 2nd copy top-1 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for m, c in r["copying"].items():
            a, b = c["random"], c["heldout_far"]
            lines.append(f"| {m} | {a['first_nll']:.2f} | {a['second_nll']:.2f} | {a['second_acc']:.1%} | "
                         f"{b['first_nll']:.2f} | {b['second_nll']:.2f} | {b['first_acc']:.1%} | "
                         f"{b['second_acc']:.1%} |")
    lines += ["", "## Perplexity by held-out file", "",
              "| file | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for f in r["by_file"][names[0]]:
        lines.append(f"| {f} | " + " | ".join(f"{r['by_file'][n][f]:.1f}" for n in names) + " |")
    if r["expert_load"]:
        lines += ["", "## MoE expert load (share of top-2 slots per expert, held-out)", ""]
        for m, layers in r["expert_load"].items():
            lines.append(f"{m}:")
            lines.append("")
            for layer, share in layers.items():
                lines.append(f"- {layer}: " + ", ".join(f"{x:.3f}" for x in share))
    lines += ["", "## Greedy continuations of held-out code", "",
              f"Prompt: the held-out file up to the end of the first `def` line after 40% of it (last ~1200 "
              "characters, no trailing newline); "
              f"{SAMPLE_NEW_TOKENS} new tokens, greedy, fp32.", ""]
    for m in models:
        lines += [f"### {m}", ""]
        for s in r["samples"][m]:
            lines += [f"`{s['file']}` ({s['prompt_tokens']} prompt tokens; first "
                      f"{s['matching_prefix_tokens']} tokens match the file)", "",
                      "Prompt (tail):", "", "```python", s["prompt_tail"], "```", "",
                      "Model:", "", "```python", s["continuation"], "```", "",
                      "Actual file:", "", "```python", s["reference"], "```", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
