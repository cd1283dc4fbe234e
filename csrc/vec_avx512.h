// AVX-512 F/BW/VL primitives (16 fp32 lanes) for the *_avx512.cpp kernels.
//
// Same names as vec_scalar.h (see there).  BF16K rounds with integer
// arithmetic; BF16NeK uses the AVX512_BF16 instruction vcvtneps2bf16, which is
// one instruction instead of seven but treats denormal inputs as zero and keeps
// NaN payloads, so a vector holding a denormal or a NaN falls back to BF16K's
// rounding and every level stays bit-identical.  Use BF16NeK only when
// rp::cpu_features().avx512_bf16 is true.  Include only from translation units
// built with the AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "half.h"

namespace {

constexpr size_t kWidth = 16;
using Vec = __m512;

struct F32K {
  using T = float;
  static Vec load(const T* p) { return _mm512_loadu_ps(p); }
  static void store(T* p, Vec v) { _mm512_storeu_ps(p, v); }
};

struct BF16K {
  using T = uint16_t;
  static Vec load(const T* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static __m256i pack(Vec v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }
  static void store(T* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack(v)); }
};

struct BF16NeK {
  using T = uint16_t;
  static Vec load(const T* p) { return BF16K::load(p); }
  static __m256i pack(Vec v) {
    // |v| - 1 < 0x7fffff as unsigned <=> v is a nonzero denormal.
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 odd = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(mag, _mm512_set1_epi32(1)),
                                                  _mm512_set1_epi32(0x7fffff)) |
                          _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (odd) return BF16K::pack(v);
    const __m256bh r = _mm512_cvtneps_pbh(v);
    return reinterpret_cast<const __m256i&>(r);
  }
  static void store(T* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack(v)); }
};

// A bf16 store that bypasses the cache (non-temporal), for a copy this core
// does not read again (the upload copy): it saves the read-for-ownership of
// each line, 2 of the ~30 bytes of DRAM traffic per parameter of the fused
// step (measured here, 100M parameters: 112 vs 120 ms).  Needs 32-byte
// aligned addresses and an _mm_sfence() before the data is handed on.
template <class K>
struct StreamK {
  using T = uint16_t;
  static void store(T* p, Vec v) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), K::pack(v)); }
};

// Calls fn(K{}) with the kind that stores a bf16 shadow whose range starts at
// element `begin`: vcvtneps2bf16 where the CPU has AVX512_BF16, streaming
// stores when the shadow is bf16 and its vectors are 32-byte aligned there
// (then fenced, so the caller's barrier orders them).
template <class Fn>
void with_bf16_store(const void* shadow, bool bf16_shadow, size_t begin, Fn&& fn) {
  const bool stream = shadow && bf16_shadow && (reinterpret_cast<std::uintptr_t>(shadow) + 2 * begin) % 32 == 0;
  const bool ne = rp::cpu_features().avx512_bf16;
  if (stream) {
    if (ne)
      fn(StreamK<BF16NeK>{});
    else
      fn(StreamK<BF16K>{});
    _mm_sfence();
  } else if (ne) {
    fn(BF16NeK{});
  } else {
    fn(BF16K{});
  }
}

struct F16K {
  using T = uint16_t;
  static Vec load(const T* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(T* p, Vec v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vsqrt(Vec a) { return _mm512_sqrt_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmax_nan(Vec a, Vec b) {
  const __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_max_ps(a, b), nan, _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
}

// sign(a): 1, -1 or +0 (also for -0 and NaN), as torch.sign on CPU.
inline Vec vsign(Vec a) {
  const Vec zero = _mm512_setzero_ps();
  const Vec pos = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
  return _mm512_mask_mov_ps(pos, _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
}

// ---- 8-bit codes (adam8bit_body.h; see vec_scalar.h): permutes, no gathers -------------------
// On this AMD EPYC (2 cores; 10M-parameter AdamW8bit step, bf16 gradient and copy, one thread)
// the four gathers per vector (two from the maps, two from the 64 KB LUTs) were ~90% of the
// step: 51 ms, 4.8 ms with them replaced by conversions (wrong codes; timing only; one run).  Here the map is held in registers as
// 16-bit halves and decoded by word permutes; encoding runs adam8bit.h's binary search on 32
// bins of 16 bits at once (vpermw / vpermt2w over the tree's levels), one lookup per step.
// 1M parameters, one thread: 2.2 ns/parameter with gathers, 0.72 without.
using VecI = __m512i;
constexpr int kEncodeRun = 16;  // a whole block: 8 searches of 32 bins
constexpr size_t kDecodeBlock = 256;  // rp::kQuantBlock
struct Codes {
  Codes(const float* map, const uint8_t* /*lut*/, const uint16_t* tree, uint16_t top) : top_(_mm512_set1_epi16(static_cast<short>(top))) {
    // words_[0]: the map values' low 16 bits, words_[1] their high 16 bits, 32 per register.
    alignas(64) uint16_t words[2][256];
    for (int j = 0; j < 256; ++j) {
      uint32_t bits;
      std::memcpy(&bits, map + j, sizeof bits);
      words[0][j] = static_cast<uint16_t>(bits);
      words[1][j] = static_cast<uint16_t>(bits >> 16);
    }
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 8; ++j) words_[h][j] = _mm512_load_si512(words[h] + 32 * j);
    level_[0] = _mm512_set1_epi16(static_cast<short>(tree[0]));
    for (int t = 1; t < 6; ++t) level_[t] = _mm512_loadu_si512(tree + (1 << t) - 1);      // 2^t <= 32 entries
    for (int j = 0; j < 2; ++j) level6_[j] = _mm512_loadu_si512(tree + 63 + 32 * j);    // 64 entries
    for (int j = 0; j < 4; ++j) level7_[j] = _mm512_loadu_si512(tree + 127 + 32 * j);   // 128 entries
  }
  // map[q[j]] for j < kDecodeBlock, 32 at a time: the high and the low 16 bits of the 32 map
  // values, each from 4 two-register word permutes (index bits 0-5) and blends (bits 6, 7),
  // interleaved into floats.  The index's 64-bit groups go in the order that makes the
  // in-lane interleave come out in element order.
  void decode_block(const uint8_t* q, float* out) const {
    const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
    for (size_t j = 0; j < kDecodeBlock; j += 32) {
      const __m512i i = _mm512_permutexvar_epi64(
          order, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j))));
      const __mmask32 b6 = _mm512_test_epi16_mask(i, _mm512_set1_epi16(64));
      const __mmask32 b7 = _mm512_test_epi16_mask(i, _mm512_set1_epi16(128));
      __m512i half[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i* w = words_[h];
        const __m512i r0 = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(w[0], i, w[1]),
                                                   _mm512_permutex2var_epi16(w[2], i, w[3]));
        const __m512i r1 = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(w[4], i, w[5]),
                                                   _mm512_permutex2var_epi16(w[6], i, w[7]));
        half[h] = _mm512_mask_blend_epi16(b7, r0, r1);
      }
      _mm512_storeu_si512(out + j, _mm512_unpacklo_epi16(half[0], half[1]));
      _mm512_storeu_si512(out + j + 16, _mm512_unpackhi_epi16(half[0], half[1]));
    }
  }

  // Codes of kEncodeRun vectors of bins into out[0 .. kEncodeRun * kWidth): eight searches of
  // 32 bins each, interleaved step by step.  One search is a chain of 8 dependent lookups; the
  // whole step took 1.10 ns/parameter with one search at a time, 0.84 with four interleaved,
  // 0.72 with eight (1M parameters, one thread, here).
  void encode(uint8_t* out, const VecI* bins) const {
    constexpr int kChains = kEncodeRun / 2;
    __m512i b[kChains], k[kChains];
    for (int c = 0; c < kChains; ++c) {
      // Bins are 0..65535: 16-bit lanes hold them exactly.
      b[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(bins[2 * c])),
                                _mm512_cvtepi32_epi16(bins[2 * c + 1]), 1);
      k[c] = step(_mm512_setzero_si512(), level_[0], b[c]);   // k: the bits found so far
    }
    for (int t = 1; t < 6; ++t)
      for (int c = 0; c < kChains; ++c) k[c] = step(k[c], _mm512_permutexvar_epi16(k[c], level_[t]), b[c]);
    for (int c = 0; c < kChains; ++c) k[c] = step(k[c], _mm512_permutex2var_epi16(level6_[0], k[c], level6_[1]), b[c]);
    for (int c = 0; c < kChains; ++c) {
      const __m512i lo = _mm512_permutex2var_epi16(level7_[0], k[c], level7_[1]);
      const __m512i hi = _mm512_permutex2var_epi16(level7_[2], k[c], level7_[3]);
      k[c] = step(k[c], _mm512_mask_blend_epi16(_mm512_test_epi16_mask(k[c], _mm512_set1_epi16(64)), lo, hi), b[c]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * c), _mm512_cvtepi16_epi8(_mm512_min_epu16(k[c], top_)));
    }
  }

 private:
  // 2k + (entry <= bins), lane by lane.
  static __m512i step(__m512i k, __m512i entry, __m512i bins) {
    const __m512i twice = _mm512_add_epi16(k, k);
    return _mm512_mask_add_epi16(twice, _mm512_cmple_epu16_mask(entry, bins), twice, _mm512_set1_epi16(1));
  }
  __m512i words_[2][8];
  __m512i level_[6], level6_[2], level7_[4], top_;
};
inline VecI vtrunc(Vec a) { return _mm512_cvttps_epi32(a); }
inline Vec vabs(Vec a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff))); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline float vreduce_max(Vec a) { return _mm512_reduce_max_ps(a); }

// ---- bf16 masters (see vec_scalar.h and half.h) ------------------------------------------------
inline __m512i vlowbias32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
// a's bits plus `add`, truncated to bf16 (low 16 bits cleared); NaN -> 0x7FC00000.
inline Vec vbf16_add(Vec a, __m512i add) {
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(a), add),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}
inline Vec vround_bf16_ne(Vec a) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16), _mm512_set1_epi32(1));
  return vbf16_add(a, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
// i is a multiple of kWidth (ranges start at aligned elements), so no lane carries into hi32(i).
inline Vec vround_bf16_sr(Vec a, uint64_t key, size_t i) {
  const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i h = vlowbias32(_mm512_xor_si512(lanes, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(key)))));
  const uint32_t k1 = static_cast<uint32_t>(key >> 32) ^ static_cast<uint32_t>(i >> 32) * rp::kGolden32;
  h = vlowbias32(_mm512_xor_si512(h, _mm512_set1_epi32(static_cast<int>(k1))));
  return vbf16_add(a, _mm512_srli_epi32(h, 16));
}

}  // namespace
