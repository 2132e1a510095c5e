"""`vllm-graft attention-bytes`: KV bytes that attention reads per decode step, plain paged
attention versus an attention plugin, computed by the plugin's own planner (no engine).

``hydragen``: ``batch`` sequences share a ``prefix``-token prompt and have each decoded
``suffix`` tokens of their own; the block tables are laid out as vLLM's prefix cache lays them
out (the shared full blocks have the same ids in every row), the Hydragen planner finds the
groups, and :func:`~vllm_graft.plugins.attention.hydragen.policy.kv_bytes_read` counts
what is read: plain reads every sequence's whole context, Hydragen the shared blocks once
plus each suffix. The ratio approaches the batch size as the prefix dominates the suffixes.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from ..command_line import tool_parser


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not out or any(x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return out


def hydragen_rows(
    batch: int, prefix: int, suffix: int, block_size: int, bytes_per_token: int, samples: int = 1
) -> dict[str, Any]:
    """One configuration: ``batch`` sequences (``batch // samples`` prompts of ``samples``
    samples each when ``samples`` > 1: a prompt-specific part of ``suffix`` tokens shared by
    its samples, then one decoded token each) over a ``prefix``-token shared prefix."""
    from ...hooks import get_registry

    policy = get_registry().get("attention", "hydragen").registration.part("policy")
    kv_bytes_read, plan_prefixes = policy.kv_bytes_read, policy.plan_prefixes

    shared = prefix // block_size  # full blocks of the prefix: what the prefix cache shares
    ids = iter(range(10**9))
    root = [next(ids) for _ in range(shared)]
    rows, seq_lens = [], []
    per_prompt = max(1, samples)
    for p in range(-(-batch // per_prompt)):
        n = prefix + suffix + 1  # the new token is the last
        own_start = shared * block_size
        common = [next(ids) for _ in range((n - 1 - own_start) // block_size)] if samples > 1 else []
        for _ in range(min(per_prompt, batch - p * per_prompt)):
            tail = [next(ids) for _ in range(-(-n // block_size) - shared - len(common))]
            rows.append(root + common + tail)
            seq_lens.append(n)
    plan = plan_prefixes(rows, seq_lens, [1] * len(rows), block_size)
    plain, read = kv_bytes_read(plan, seq_lens, bytes_per_token)
    return {
        "batch": batch,
        "prefix": prefix,
        "suffix": suffix,
        "samples": samples,
        "groups": len(plan.groups),
        "depth": plan.depth,
        "plain_bytes": plain,
        "plugin_bytes": read,
        "ratio": plain / read,
    }


def cmd_attention_bytes(args: argparse.Namespace, console: Console) -> int:
    bytes_per_token = 2 * args.kv_heads * args.head_dim * args.dtype_bytes * args.layers
    results = [
        hydragen_rows(b, p, s, args.block_size, bytes_per_token, args.samples)
        for p in args.prefix
        for b in args.batch
        for s in args.suffix
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "plugin": "hydragen",
                    "bytes_per_token": bytes_per_token,
                    "block_size": args.block_size,
                    "rows": results,
                },
                indent=1,
            )
        )
        return 0
    t = Table(
        title=f"KV bytes read per decode step, plain vs hydragen ({args.layers} layers, "
        f"{args.kv_heads} KV heads, head_dim {args.head_dim}, {args.dtype_bytes}-byte "
        f"KV, block {args.block_size}" + (f", {args.samples} samples per prompt" if args.samples > 1 else "") + ")"
    )
    for col in ("batch", "prefix", "own tokens", "groups", "plain MiB", "hydragen MiB", "ratio", "ratio / batch"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            str(r["batch"]),
            str(r["prefix"]),
            str(r["suffix"] + 1),
            f"{r['groups']} (depth {r['depth']})",
            f"{r['plain_bytes'] / 2**20:.1f}",
            f"{r['plugin_bytes'] / 2**20:.1f}",
            f"{r['ratio']:.1f}x",
            f"{r['ratio'] / r['batch']:.2f}",
        )
    console.print(t)
    console.print(
        "own tokens: each sequence's tokens after the shared prefix, the new one included. "
        "The ratio approaches the batch size as the shared prefix dominates."
    )
    return 0


def add_command(sub: Any) -> None:
    p = tool_parser(
        sub,
        "attention-bytes",
        "model the KV bytes attention reads per decode step (plain vs hydragen)",
        cmd_attention_bytes,
        __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # the grid's axes: every combination is a row
    for flag, default, unit, what in (
        ("--batch", [8, 32, 128], "N", "sequences sharing the prefix"),
        ("--prefix", [1024, 4096], "T", "shared prefix tokens"),
        ("--suffix", [0, 64, 256], "T", "tokens each sequence has of its own before the new one"),
    ):
        p.add_argument(
            flag,
            type=_ints,
            default=default,
            metavar=f"{unit}[,{unit}]",
            help=f"{what} (default {','.join(map(str, default))})",
        )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        metavar="N",
        help="samples per prompt (n>1 sampling: the own tokens are the prompt's, shared "
        "by its samples up to the new token: a two-level tree; default 1)",
    )
    p.add_argument("--block-size", type=int, default=16, metavar="B", help="KV block size (default 16)")
    p.add_argument("--layers", type=int, default=32, help="layers (default 32: Llama-3-8B)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per KV element (default 2: fp16)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
