"""DFloat11 in plain NumPy (encoder) and vectorised PyTorch (decoder, the CPU path).

Layout of one compressed ``[out, in]`` bf16 weight (what a checkpoint stores per shard):

* ``sign_mantissa`` ``[out, in]`` uint8: bit 7 the sign, bits 0-6 the mantissa (raw);
* ``exponents`` uint8: the Huffman bitstream of the 8-bit exponents in row-major order,
  MSB first, padded with 3 zero bytes (so the decoder may always read 3 bytes);
* ``code_lengths`` uint8 ``[256]``: the canonical Huffman code length per exponent value
  (0: the value does not occur);
* ``chunk_offsets`` int32: bit position where chunk ``k`` (symbols ``k*chunk ...``) starts;
* ``header`` int64 ``[4]``: number of weights, bits in the stream, CRC-32 of the original
  bf16 bytes, chunk size.

Decoding runs every chunk in parallel (one lane each) for ``chunk`` steps: read a
``max_code_len``-bit window at the lane's bit position, look up (symbol, length) in a
table of ``2**max_code_len`` entries, advance.
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np
import torch
import torch.nn.functional as F

from ....hooks import QuantMethod, StoredTensor

from .._shared import fallback_once, scratch
from .cpu import decode_bf16, lanes_out, tables

# ------------------------------------------------------------------------- Huffman codes


def code_lengths(counts: np.ndarray, max_len: int) -> np.ndarray:
    """Huffman code lengths (uint8 ``[256]``) for symbol ``counts``, none longer than
    ``max_len``: rare symbols' counts are raised until the longest code fits."""
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    lengths: np.ndarray = np.zeros(256, dtype=np.uint8)
    if len(present) == 0:
        return lengths
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    c = counts[present].astype(np.float64)
    floor = 0.0
    while True:
        w = np.maximum(c, floor)
        heap: list[tuple[float, int, tuple[int, ...]]] = [(float(w[i]), i, (i,)) for i in range(len(present))]
        heapq.heapify(heap)
        depth: np.ndarray = np.zeros(len(present), dtype=np.int64)
        tie = len(present)
        while len(heap) > 1:
            a, _, sa = heapq.heappop(heap)
            b, _, sb = heapq.heappop(heap)
            for s in sa + sb:
                depth[s] += 1
            heapq.heappush(heap, (a + b, tie, sa + sb))
            tie += 1
        if depth.max() <= max_len:
            lengths[present] = depth
            return lengths
        floor = max(floor * 2, w.sum() / 2 ** (max_len - 1))


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values (int64 ``[256]``) for the code ``lengths``."""
    codes: np.ndarray = np.zeros(256, dtype=np.int64)
    code, prev = 0, 0
    for sym in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[sym]) - prev
        prev = int(lengths[sym])
        codes[sym] = code
        code += 1
    return codes


def decode_table(lengths: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(symbol, length)`` lookup tables (uint8/int64 ``[2**max_len]``) indexed by the next
    ``max_len`` bits of the stream, on ``lengths``' device (built on the host: called at load,
    never per call)."""
    lens = lengths.cpu().numpy().astype(np.int64)
    if lens.max(initial=0) > max_len:
        raise ValueError(f"code_lengths: a code of {lens.max()} bits exceeds max_code_len {max_len}")
    codes = canonical_codes(lens)
    sym: np.ndarray = np.zeros(1 << max_len, dtype=np.uint8)
    ln: np.ndarray = np.zeros(1 << max_len, dtype=np.int64)
    for s in np.flatnonzero(lens):
        lo = int(codes[s]) << (max_len - int(lens[s]))
        hi = (int(codes[s]) + 1) << (max_len - int(lens[s]))
        if hi > 1 << max_len:
            raise ValueError("code_lengths: not a valid prefix code (Kraft sum above 1)")
        sym[lo:hi], ln[lo:hi] = s, lens[s]
    return torch.from_numpy(sym).to(lengths.device), torch.from_numpy(ln).to(lengths.device)


# ----------------------------------------------------------------------------- encoder
def split_bf16(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(exponent, sign_mantissa)`` uint8 arrays of a bf16 tensor."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"dfloat11 compresses bfloat16 weights, got {weight.dtype}")
    bits = weight.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exponent, sign_mantissa


def crc_bf16(weight: torch.Tensor) -> int:
    return zlib.crc32(weight.detach().cpu().contiguous().view(torch.int16).numpy().tobytes())


def encode(weight: torch.Tensor, chunk: int = 128, max_code_len: int = 12) -> dict[str, torch.Tensor]:
    """Compress one bf16 weight (any shape; rows are dim 0) into the stored tensors (encoded
    on the host with NumPy, returned on ``weight``'s device)."""
    exponent, sign_mantissa = split_bf16(weight)
    flat = exponent.reshape(-1)
    n = flat.size
    lengths = code_lengths(np.bincount(flat, minlength=256), max_code_len)
    codes = canonical_codes(lengths)
    ln = lengths.astype(np.int64)[flat]
    starts = np.concatenate([[0], np.cumsum(ln)])
    total = int(starts[-1])
    # Expand every code into its bits, MSB first, then pack.
    rep_code: np.ndarray = np.repeat(codes[flat], ln)
    rep_len: np.ndarray = np.repeat(ln, ln)
    k = np.arange(total, dtype=np.int64) - np.repeat(starts[:-1], ln)
    bits = ((rep_code >> (rep_len - 1 - k)) & 1).astype(np.uint8)
    stream = np.concatenate([np.packbits(bits), np.zeros(3, dtype=np.uint8)])
    offsets = starts[:-1][::chunk].astype(np.int32) if n else np.zeros(0, np.int32)
    header = np.array([n, total, crc_bf16(weight), chunk], dtype=np.int64)
    return {
        k: torch.from_numpy(v).to(weight.device)
        for k, v in (
            ("sign_mantissa", sign_mantissa.copy()),
            ("exponents", stream),
            ("code_lengths", lengths),
            ("chunk_offsets", offsets),
            ("header", header),
        )
    }


# ----------------------------------------------------------------------------- decoder
def decode_exponents(
    stream: torch.Tensor,
    chunk_pos: torch.Tensor,
    table_base: torch.Tensor,
    sym_table: torch.Tensor,
    len_table: torch.Tensor,
    chunk: int,
    max_len: int,
) -> torch.Tensor:
    """Decode ``chunk`` symbols from every chunk start in parallel.

    ``stream`` uint8, ``chunk_pos`` int64 ``[C]`` bit positions, ``table_base`` int64 ``[C]``
    the offset of each chunk's table in ``sym_table``/``len_table``. Returns uint8
    ``[C, chunk]`` (symbols past a shard's end are garbage: the caller drops them)."""
    s = stream.to(torch.int64)
    nbytes = s.numel()
    pos = chunk_pos.clone()
    out = torch.empty((chunk_pos.numel(), chunk), dtype=torch.uint8, device=stream.device)
    shift_base = 24 - max_len
    mask = (1 << max_len) - 1
    for j in range(chunk):
        byte = (pos >> 3).clamp_(max=nbytes - 3)
        w = (s[byte] << 16) | (s[byte + 1] << 8) | s[byte + 2]
        idx = ((w >> (shift_base - (pos & 7))) & mask) + table_base
        out[:, j] = sym_table[idx]
        pos += len_table[idx]
    return out


def join_bf16(exponent: torch.Tensor, sign_mantissa: torch.Tensor) -> torch.Tensor:
    """The bf16 tensor whose bits are ``sign | exponent | mantissa``."""
    sm = sign_mantissa.to(torch.int32)
    bits = ((sm & 0x80) << 8) | (exponent.to(torch.int32) << 7) | (sm & 0x7F)
    return bits.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 wraps to the same bits


def decode(tensors: dict[str, torch.Tensor], max_code_len: int = 12) -> torch.Tensor:
    """The bf16 weight of one stored shard (what :func:`encode` returned)."""
    n, _, _, chunk = (int(v) for v in tensors["header"])
    sym, ln = decode_table(tensors["code_lengths"], max_code_len)
    pos = tensors["chunk_offsets"].to(torch.int64)
    exps = decode_exponents(tensors["exponents"], pos, torch.zeros_like(pos), sym, ln, chunk, max_code_len).reshape(-1)[
        :n
    ]
    sm = tensors["sign_mantissa"]
    return join_bf16(exps.reshape(sm.shape), sm)


# ---------------------------------------------------------------------- the QuantMethod
STORED = ("sign_mantissa", "exponents", "code_lengths", "chunk_offsets", "header")


class DFloat11(QuantMethod):
    """Stores bf16 weights Huffman-compressed; decodes a layer's weight before each matmul."""

    covers_embeddings = True

    def quantize(self, weight):
        p = self.params
        return encode(weight, p.chunk, p.max_code_len)

    def stored_tensors(self, out_features, in_features):
        ragged = {
            k: StoredTensor((-1,), dt, ragged=True)
            for k, dt in (
                ("exponents", "uint8"),
                ("code_lengths", "uint8"),
                ("chunk_offsets", "int32"),
                ("header", "int64"),
            )
        }
        return {"sign_mantissa": StoredTensor((out_features, in_features), "uint8"), **ragged}

    def verify(self, shard):
        """Sizes against the header, then decode once: the CRC-32 must match."""
        h = shard["header"]
        if h.numel() != 4:
            raise ValueError(f"header: {h.numel()} values, expected 4")
        n, nbits, crc, chunk = (int(v) for v in h)
        sm = shard["sign_mantissa"]
        if n != sm.numel() or chunk != self.params.chunk:
            raise ValueError(
                f"header: {n} weights in chunks of {chunk}, but sign_mantissa has "
                f"{sm.numel()} and the checkpoint's chunk is {self.params.chunk}"
            )
        if shard["code_lengths"].numel() != 256:
            raise ValueError(f"code_lengths: {shard['code_lengths'].numel()} entries, expected 256")
        if shard["chunk_offsets"].numel() != -(-n // chunk):
            raise ValueError(f"chunk_offsets: {shard['chunk_offsets'].numel()} entries, expected {-(-n // chunk)}")
        if shard["exponents"].numel() != -(-nbits // 8) + 3:
            raise ValueError(
                f"exponents: {shard['exponents'].numel()} bytes, the header says "
                f"{nbits} bits ({-(-nbits // 8) + 3} bytes with padding)"
            )
        try:
            w = decode(shard, self.params.max_code_len)
        except ValueError as e:
            raise ValueError(str(e)) from None
        if crc_bf16(w) != crc:
            raise ValueError(
                "exponents/code_lengths/chunk_offsets/sign_mantissa: the decoded "
                "weight's CRC-32 does not match the header's (corrupt checkpoint)"
            )

    def load(self, stored, shard_rows):
        """Join the shards into one stream, one list of chunk positions and one lookup table
        per shard (the adapter has :meth:`verify`-ed each shard)."""
        L = self.params.max_code_len
        streams, positions, bases, syms, lens, counts = [], [], [], [], [], []
        bit_base = 0
        for i in range(len(stored["header"])):
            t = {k: stored[k][i] for k in STORED}
            sym, ln = decode_table(t["code_lengths"], L)
            streams.append(t["exponents"])
            positions.append(t["chunk_offsets"].to(torch.int64) + bit_base)
            bases.append(
                torch.full((t["chunk_offsets"].numel(),), i << L, dtype=torch.int64, device=t["chunk_offsets"].device)
            )
            syms.append(sym)
            lens.append(ln)
            counts.append(int(t["header"][0]))
            bit_base += t["exponents"].numel() * 8
        sm = stored["sign_mantissa"]
        device = sm[0].device
        return {
            "sign_mantissa": torch.cat(sm, 0) if len(sm) > 1 else sm[0],
            "stream": torch.cat(streams),
            "chunk_pos": torch.cat(positions),
            "table_base": torch.cat(bases),
            "sym_table": torch.cat(syms),
            "len_table": torch.cat(lens).to(torch.uint8),
            "shard_counts": torch.tensor(counts, dtype=torch.int64, device=device),
            # where each chunk's symbols land in the flat weight and how many (both decoders),
            # and the C++ decoder's lookup tables (24 KiB per shard at max_code_len 12)
            **dict(zip(("lane_start", "lane_count"), lanes_out(counts, self.params.chunk, device))),
            **dict(zip(("multi_table", "single_table"), tables(torch.cat(syms), torch.cat(lens), L))),
        }

    def checkpoint_params(self):
        return self.params.model_dump(mode="json", exclude={"kernel", "cpu_decoder"})

    def weight(self, tensors, reuse: bool = False) -> torch.Tensor:
        """The exact bf16 weight ``[out, in]``, decoded from ``tensors`` (what ``load`` made);
        with ``reuse``, the C++ decoder writes it into a buffer that the next decode of a
        weight of this shape overwrites (for a weight used at once, as ``apply`` does)."""
        chunk = self.params.chunk
        if (
            self.params.kernel == "reference"
            and self.params.cpu_decoder == "cpp"
            and tensors["stream"].device.type == "cpu"
            and "lane_start" in tensors
        ):
            sm = tensors["sign_mantissa"]
            w, reason = decode_bf16(
                tensors,
                chunk,
                self.params.max_code_len,
                scratch(sm.shape, torch.bfloat16, sm.device) if reuse else None,
            )
            if w is not None:
                return w
            fallback_once("dfloat11", "decoder", reason, "cpu_decoder")
        decoder = decode_exponents
        if self.params.kernel == "triton":
            from .kernel import decode_exponents as decoder
        exps = decoder(
            tensors["stream"],
            tensors["chunk_pos"],
            tensors["table_base"],
            tensors["sym_table"],
            tensors["len_table"].to(torch.int64),
            chunk,
            self.params.max_code_len,
        )
        sm = tensors["sign_mantissa"]
        n = sm.numel()
        # Drop the symbols past each shard's end without reading a count on the host (no sync:
        # this runs inside vLLM's CUDA graphs): one shard is its first n symbols; several are
        # scattered to where their lanes start, their padding to a spare slot past the end.
        if tensors["shard_counts"].numel() == 1:
            flat = exps.reshape(-1)[:n]
        else:
            j = torch.arange(chunk, dtype=torch.int64, device=exps.device)
            start, count = tensors["lane_start"], tensors["lane_count"]
            where = torch.where(j < count[:, None], start[:, None] + j, n)
            flat = exps.new_empty(n + 1).scatter_(0, where.reshape(-1), exps.reshape(-1))[:n]
        return join_bf16(flat.reshape(sm.shape), sm)

    def apply(self, tensors, x, bias):
        return F.linear(x, self.weight(tensors, reuse=True).to(x.dtype), bias)

    def embed(self, tensors, ids):
        return F.embedding(ids, self.weight(tensors, reuse=True))
