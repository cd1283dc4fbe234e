// Scalar "vector" primitives (one lane) for the baseline kernels.
//
// The same names as vec_avx2.h / vec_avx512.h, so one kernel body compiles at
// every level: the width `kWidth`, the lane type `Vec`, the element kinds
// F32K/BF16K/F16K (load to and store from fp32, RNE rounding) and the lane-wise
// arithmetic v*().  Each operation rounds once, like the vector instruction it
// stands for, which is what keeps the levels bit-identical.  Anonymous namespace:
// see the ODR note in half.h.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "half.h"

namespace {

constexpr size_t kWidth = 1;
using Vec = float;

struct F32K {
  using T = float;
  static Vec load(const T* p) { return *p; }
  static void store(T* p, Vec v) { *p = v; }
};
struct BF16K {
  using T = uint16_t;
  static Vec load(const T* p) { return rp::bf16_to_f32(*p); }
  static void store(T* p, Vec v) { *p = rp::f32_to_bf16(v); }
};
struct F16K {
  using T = uint16_t;
  static Vec load(const T* p) { return rp::f16_to_f32(*p); }
  static void store(T* p, Vec v) { *p = rp::f32_to_f16(v); }
};

inline Vec vset(float x) { return x; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline Vec vsub(Vec a, Vec b) { return a - b; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vdiv(Vec a, Vec b) { return a / b; }
inline Vec vsqrt(Vec a) { return std::sqrt(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }  // a * b + c, one rounding
// max(a, b) with NaN propagation as torch.maximum's vector path: an unordered
// pair gives the all-ones NaN; otherwise b unless a > b (maxps semantics).
inline Vec vmax_nan(Vec a, Vec b) {
  if (a != a || b != b) return rp::bits_f32(0xffffffffu);
  return a > b ? a : b;
}

// sign(a): 1, -1 or +0 (also for -0 and NaN), as torch.sign on CPU.
inline Vec vsign(Vec a) { return a > 0.0f ? 1.0f : a < 0.0f ? -1.0f : 0.0f; }

// ---- 8-bit codes (adam8bit_body.h) ---------------------------------------------------------
// VecI: int32 lanes (bins).  Codes: one state's map (256 fp32 codes) and bin -> code table
// (LUT): decode_block(q, out) writes map[q[j]] to out[j], j < kDecodeBlock; encode(out, bins) writes the codes of kEncodeRun
// vectors of bins to out[0 .. kEncodeRun * kWidth).  vec_avx512.h's Codes holds the map in registers and
// searches `tree` (adam8bit.h's CodeSearch) instead of reading the LUT; the codes are the same.
using VecI = int32_t;
constexpr int kEncodeRun = 8;
constexpr size_t kDecodeBlock = 256;  // rp::kQuantBlock
struct Codes {
  Codes(const float* map, const uint8_t* lut, const uint16_t* /*tree*/, uint16_t /*top*/) : map_(map), lut_(lut) {}
  void decode_block(const uint8_t* q, float* out) const {
    for (size_t j = 0; j < kDecodeBlock; ++j) out[j] = map_[q[j]];
  }
  void encode(uint8_t* out, const VecI* bins) const {
    for (int j = 0; j < kEncodeRun; ++j) out[j] = lut_[bins[j]];
  }

 private:
  const float* map_;
  const uint8_t* lut_;
};
inline VecI vtrunc(Vec a) { return static_cast<int32_t>(a); }  // toward zero; callers keep a in int range
inline Vec vabs(Vec a) { return std::fabs(a); }
// maxps / minps semantics: a unless it is not greater (smaller) than b, so a NaN `a` gives b.
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }
inline Vec vmin(Vec a, Vec b) { return a < b ? a : b; }
inline float vreduce_max(Vec a) { return a; }

// ---- bf16 masters (half.h: the rounding and the counter-based bits) ---------------------------
// The value rounded to bf16 (as an fp32 lane), to nearest even or stochastically with the bits
// of elements i .. i + kWidth - 1 under `key`; NaN becomes the bf16 NaN 0x7FC0.
inline Vec vround_bf16_ne(Vec a) { return rp::bf16_to_f32(rp::f32_to_bf16(a)); }
inline Vec vround_bf16_sr(Vec a, uint64_t key, size_t i) {
  return rp::bf16_to_f32(rp::f32_to_bf16_add(a, rp::sr_bits(key, i)));
}

}  // namespace
