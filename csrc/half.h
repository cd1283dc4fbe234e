// Scalar fp32 <-> bf16/fp16 conversions, bit-exact with the SIMD paths.
//
// Every function is `static inline` on purpose: this header is included by
// translation units compiled with AVX2/AVX-512 flags, and an out-of-line copy
// with external linkage could be picked by the linker for the baseline code
// and fault on an older CPU.
//
// Rounding: round-to-nearest-even everywhere.  bf16 NaN -> 0x7FC0 (as torch's
// scalar conversion); fp16 NaN keeps sign and top payload bits with the quiet
// bit set (as the F16C instruction vcvtps2ph does).
#pragma once

#include <cstdint>
#include <cstring>

namespace rp {

static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e != 0) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_f32(sign);
  e = 113;  // subnormal: normalise so the leading one lands on bit 10
  while (!(m & 0x400u)) { m <<= 1; --e; }
  return bits_f32(sign | (e << 23) | ((m & 0x3ffu) << 13));
}

static inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf / NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                                               // normal half
    uint32_t r = ax - 0x38000000u;
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t e = ax >> 23;  // subnormal half or zero: units of 2^-24
  if (e < 102) return static_cast<uint16_t>(sign);
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// ---- bf16 masters: round to nearest or stochastically -------------------------------------------
//
// A bf16 master is updated in fp32 and rounded back.  Stochastic rounding adds 16
// random bits below the bf16 mantissa and truncates: x rounds away from zero with
// probability (dropped bits) / 2^16, so the rounding is unbiased (E[round(x)] = x
// up to 2^-16 of an ulp).  The bits come from a counter-based hash, not a stream:
// element i of a tensor with 64-bit key k (roundpipe/optim/rounding.py derives it
// from the seed, the step and the parameter's index) always gets
//   h = lowbias32(lowbias32(lo32(i) ^ lo32(k)) ^ hi32(k) ^ hi32(i) * 0x9E3779B9),  bits = h >> 16
// so the result depends on neither the thread split nor the SIMD level (the vector
// levels compute the same 32-bit integer arithmetic lane by lane).  lowbias32 is
// Chris Wellons' 32-bit integer hash (bias ~0.17 of the ideal avalanche).
static inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

constexpr uint32_t kGolden32 = 0x9E3779B9u;

// The 16 random bits of element i under key k (see above).
static inline uint32_t sr_bits(uint64_t k, uint64_t i) {
  const uint32_t h = lowbias32(static_cast<uint32_t>(i) ^ static_cast<uint32_t>(k));
  return lowbias32(h ^ static_cast<uint32_t>(k >> 32) ^ static_cast<uint32_t>(i >> 32) * kGolden32) >> 16;
}

// f rounded to bf16 after adding `add` to its bits (NaN -> 0x7FC0): add = 0x7FFF + lsb
// rounds to nearest even, add = sr_bits(...) stochastically.
static inline uint16_t f32_to_bf16_add(float f, uint32_t add) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + add) >> 16);
}

}  // namespace rp
