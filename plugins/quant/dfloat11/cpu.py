"""DFloat11's CPU decoder: the reference's table-lookup Huffman decode written as a C++ loop
(one pass per chunk, symbol after symbol, every chunk of the weight on torch's intra-op
threads) that writes the bf16 weight directly (exponent joined with sign and mantissa).

The torch decoder (``reference.decode_exponents``) runs ``chunk`` steps of about ten tensor
operations over all chunks at once: vectorised, but every step makes int64 passes over the
whole weight, so a layer costs ~10 ms per million weights on 2 cores. This loop reads each
symbol's bits once, ~1-2 ns per weight. Same table, same bit positions, same result
(``tests/unit/test_quant_dfloat11.py`` holds it equal to the reference bit for bit).

Built on first use with ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler, as
vLLM's CPU engine itself does for torch.compile) into torch's extension cache, so the compile
(~30-60 s) happens once per machine and source version. :func:`decoder` returns ``None``, with
the reason, where it cannot be built: the plugin then says so in the log and uses the torch
decoder.
"""

from __future__ import annotations

import torch

from .._shared import cpu_extension

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

// Decode every lane (chunk) of one weight's exponent stream and join each exponent with its
// sign/mantissa byte into bf16 bits. stream: uint8 (padded with 3 bytes); pos, base,
// out_start, out_count: int64 [lanes]; multi: int32, indexed by the next max_len bits: the
// codes that lie whole inside them (up to 3: symbols in bits 0-23, their count in 24-25,
// their bits in 26-30); single: int16, the first code alone (length << 8 | symbol), for a
// lane's last symbols; a lane's tables start at base; sm: uint8 [n]; out: bf16 [n], written
// and returned.
torch::Tensor dfloat11_decode_bf16(torch::Tensor stream, torch::Tensor pos, torch::Tensor base,
                                   torch::Tensor multi, torch::Tensor single, torch::Tensor out_start,
                                   torch::Tensor out_count, torch::Tensor sm, int64_t max_len,
                                   torch::Tensor out) {
  TORCH_CHECK(stream.is_contiguous() && pos.is_contiguous() && base.is_contiguous() &&
              multi.is_contiguous() && single.is_contiguous() && out_start.is_contiguous() &&
              out_count.is_contiguous() && sm.is_contiguous(), "dfloat11: tensors must be contiguous");
  TORCH_CHECK(max_len >= 1 && max_len <= 16, "dfloat11: max_len out of range");
  TORCH_CHECK(stream.numel() >= 4, "dfloat11: stream shorter than its padding");
  TORCH_CHECK(multi.scalar_type() == torch::kInt32 && single.scalar_type() == torch::kInt16 &&
              stream.scalar_type() == torch::kUInt8 && sm.scalar_type() == torch::kUInt8 &&
              multi.numel() == single.numel(), "dfloat11: unexpected tables or dtypes");
  const int64_t n = sm.numel();
  const int64_t lanes = pos.numel();
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.numel() == n,
              "dfloat11: out must be contiguous bf16 with one value per weight");
  const uint8_t* s = stream.data_ptr<uint8_t>();
  const int64_t* p0 = pos.data_ptr<int64_t>();
  const int64_t* b0 = base.data_ptr<int64_t>();
  const uint32_t* multip = reinterpret_cast<const uint32_t*>(multi.data_ptr<int32_t>());
  const uint16_t* singlep = reinterpret_cast<const uint16_t*>(single.data_ptr<int16_t>());
  const int64_t* os = out_start.data_ptr<int64_t>();
  const int64_t* oc = out_count.data_ptr<int64_t>();
  const uint8_t* smp = sm.data_ptr<uint8_t>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t last = stream.numel() - 4;  // a symbol inside the stream never reads past it
  const int shift = 32 - static_cast<int>(max_len);
  const uint32_t mask = (1u << max_len) - 1u;
  for (int64_t l = 0; l < lanes; ++l)
    TORCH_CHECK(os[l] >= 0 && oc[l] >= 0 && os[l] + oc[l] <= n && b0[l] >= 0 &&
                b0[l] + (int64_t(1) << max_len) <= multi.numel(), "dfloat11: lane out of range");
  // The next max_len bits at a bit position (big-endian: the stream is MSB first).
  auto window = [&](int64_t bit) -> uint32_t {
    int64_t byte = bit >> 3;
    if (byte > last) byte = last;
    uint32_t w;
    std::memcpy(&w, s + byte, 4);
    return (__builtin_bswap32(w) >> (shift - int(bit & 7))) & mask;
  };
  auto join = [&](int64_t at, uint32_t e) {
    const uint32_t m = smp[at];
    o[at] = uint16_t(((m & 0x80u) << 8) | ((e & 0xFFu) << 7) | (m & 0x7Fu));
  };
  // A lane's codes depend on each other (the next position needs this code's length): G lanes
  // are decoded side by side in one thread so that their chains overlap in the CPU, each
  // lookup taking up to 3 codes while at least 3 symbols are left, then one at a time.
  constexpr int64_t G = 8;
  const int64_t groups = (lanes + G - 1) / G;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t l0 = g * G;
      const int64_t nl = std::min(G, lanes - l0);
      int64_t bit[G], at[G], left[G];
      const uint32_t* mt[G];
      const uint16_t* st[G];
      for (int64_t i = 0; i < nl; ++i) {
        bit[i] = p0[l0 + i];
        mt[i] = multip + b0[l0 + i];
        st[i] = singlep + b0[l0 + i];
        at[i] = os[l0 + i];
        left[i] = oc[l0 + i];
      }
      auto take = [&](int64_t i) {  // up to 3 codes of lane i, which has at least 3 left
        const uint32_t e = mt[i][window(bit[i])];
        const uint32_t k = (e >> 24) & 3u;
        join(at[i], e);
        join(at[i] + 1, e >> 8);  // past k: rewritten by the next lookup
        join(at[i] + 2, e >> 16);
        at[i] += k;
        left[i] -= k;
        bit[i] += e >> 26;
      };
      if (nl == G) {  // rounds every lane can take unchecked: each takes at most 3 a round
        for (int64_t rounds = 1; rounds > 0;) {
          int64_t fewest = left[0];
          for (int64_t i = 1; i < G; ++i) fewest = std::min(fewest, left[i]);
          rounds = fewest / 3;
          for (int64_t r = 0; r < rounds; ++r)
            for (int64_t i = 0; i < G; ++i) take(i);
        }
      }
      for (bool more = true; more;) {
        more = false;
        for (int64_t i = 0; i < nl; ++i) {
          if (left[i] < 3) continue;
          more = true;
          take(i);
        }
      }
      for (int64_t i = 0; i < nl; ++i) {
        for (; left[i] > 0; --left[i], ++at[i]) {
          const uint32_t e = st[i][window(bit[i])];
          join(at[i], e);
          bit[i] += e >> 8;
        }
      }
    }
  });
  return out;
}
"""


def decoder():
    """``(function, None)`` once the C++ decoder is built, else ``(None, reason)``."""
    module, reason = cpu_extension("vllm_graft_dfloat11_cpu", _SOURCE, ["dfloat11_decode_bf16"])
    return (module.dfloat11_decode_bf16 if module is not None else None), reason


def tables(sym_table: torch.Tensor, len_table: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ decoder's tables from the reference's (``2**max_len`` entries per shard, shards
    one after another): ``multi`` int32, every code lying whole in the next ``max_len`` bits
    (up to 3: symbols in bits 0-23, how many in bits 24-25, their bits in 26-30), and
    ``single`` int16, the first code alone (``length << 8 | symbol``)."""
    size = 1 << max_len
    sym = sym_table.to(torch.int64).view(-1, size)
    ln = len_table.to(torch.int64).view(-1, size)
    idx = torch.arange(size, dtype=torch.int64, device=sym.device)
    multi = torch.zeros_like(sym)
    used = torch.zeros_like(sym)  # bits taken so far
    count = torch.zeros_like(sym)
    alive = torch.ones_like(sym, dtype=torch.bool)
    for k in range(3):
        rest = ((idx << used) & (size - 1)).clamp(min=0)  # the bits after the codes taken, 0-filled
        s_k, l_k = sym.gather(1, rest), ln.gather(1, rest)
        alive &= (l_k > 0) & (used + l_k <= max_len)  # the k-th code lies whole in the window
        multi |= torch.where(alive, s_k << (8 * k), 0)
        used = torch.where(alive, used + l_k, used)
        count += alive.to(torch.int64)
    multi |= (count << 24) | (used << 26)
    single = (sym | (ln << 8)).to(torch.int16)
    return multi.to(torch.int32).reshape(-1), single.reshape(-1)


def lanes_out(
    counts: list[int], chunk: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each lane's symbols go in the flat weight, and how many it has: shards (each
    ``counts[i]`` weights, its own chunks) are laid one after another (on ``device``)."""
    starts, sizes = [], []
    offset = 0
    for c in counts:
        k = torch.arange(-(-c // chunk), dtype=torch.int64, device=device) * chunk
        starts.append(k + offset)
        sizes.append(torch.clamp(c - k, max=chunk))
        offset += c
    return torch.cat(starts), torch.cat(sizes)


def decode_bf16(tensors: dict[str, torch.Tensor], chunk: int, max_len: int, out: torch.Tensor | None = None):
    """``(weight, None)``: the bf16 weight ``[out, in]`` through the C++ decoder, written into
    ``out`` when given (e.g. ``quant._shared.scratch``); ``(None, reason)`` where it cannot be
    built. ``tensors``: what ``DFloat11.load`` made, on the CPU."""
    fn, reason = decoder()
    if fn is None:
        return None, reason
    sm = tensors["sign_mantissa"]
    if out is None:
        out = torch.empty(sm.shape, dtype=torch.bfloat16, device=sm.device)
    fn(
        tensors["stream"],
        tensors["chunk_pos"],
        tensors["table_base"],
        tensors["multi_table"],
        tensors["single_table"],
        tensors["lane_start"],
        tensors["lane_count"],
        sm.reshape(-1),
        max_len,
        out.view(-1),
    )
    return out, None
