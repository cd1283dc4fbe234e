// AVX2 + FMA + F16C primitives (8 fp32 lanes) for the *_avx2.cpp kernels.
//
// Same names as vec_scalar.h (see there).  bf16 stores round to nearest even
// with integer arithmetic and turn NaN into 0x7FC0, as rp::f32_to_bf16 does.
// Include only from translation units built with the AVX2 flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "half.h"

namespace {

constexpr size_t kWidth = 8;
using Vec = __m256;

struct F32K {
  using T = float;
  static Vec load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, Vec v) { _mm256_storeu_ps(p, v); }
};

struct BF16K {
  using T = uint16_t;
  static Vec load(const T* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(T* p, Vec v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

struct F16K {
  using T = uint16_t;
  static Vec load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(T* p, Vec v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vsqrt(Vec a) { return _mm256_sqrt_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmax_nan(Vec a, Vec b) {
  return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

// sign(a): 1, -1 or +0 (also for -0 and NaN), as torch.sign on CPU.
inline Vec vsign(Vec a) {
  const Vec zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one),
                       _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one));
}

// ---- 8-bit codes (adam8bit_body.h; see vec_scalar.h): gathers from the map and the LUT ----------
using VecI = __m256i;
constexpr int kEncodeRun = 8;
constexpr size_t kDecodeBlock = 256;  // rp::kQuantBlock
struct Codes {
  Codes(const float* map, const uint8_t* lut, const uint16_t* /*tree*/, uint16_t /*top*/) : map_(map), lut_(lut) {}
  void decode_block(const uint8_t* q, float* out) const {
    for (size_t j = 0; j < kDecodeBlock; j += 8)
      _mm256_storeu_ps(out + j, _mm256_i32gather_ps(map_, _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                              reinterpret_cast<const __m128i*>(q + j))), 4));
  }
  void encode(uint8_t* out, const VecI* bins) const {
    // The LUT has 3 bytes of slack after its last bin: each lookup reads 4 bytes, the low one is the code.
    const int* lut = reinterpret_cast<const int*>(lut_);
    for (int j = 0; j < kEncodeRun; j += 2) {
      const __m256i ca = _mm256_and_si256(_mm256_i32gather_epi32(lut, bins[j], 1), _mm256_set1_epi32(0xff));
      const __m256i cb = _mm256_and_si256(_mm256_i32gather_epi32(lut, bins[j + 1], 1), _mm256_set1_epi32(0xff));
      const __m256i w = _mm256_packus_epi32(ca, cb);            // per 128-bit half: a's 4, b's 4 (16-bit)
      const __m256i bytes = _mm256_packus_epi16(w, w);           // per half: those 8 as bytes, twice
      const __m256i order = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * j), _mm256_castsi256_si128(order));
    }
  }

 private:
  const float* map_;
  const uint8_t* lut_;
};
inline VecI vtrunc(Vec a) { return _mm256_cvttps_epi32(a); }
inline Vec vabs(Vec a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
// ---- bf16 masters (see vec_scalar.h and half.h) ------------------------------------------------
inline __m256i vlowbias32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
// a's bits plus `add`, truncated to bf16 (low 16 bits cleared); NaN -> 0x7FC00000.
inline Vec vbf16_add(Vec a, __m256i add) {
  __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(a), add),
                               _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan));
}
inline Vec vround_bf16_ne(Vec a) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(a), 16), _mm256_set1_epi32(1));
  return vbf16_add(a, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
// i is a multiple of kWidth (ranges start at aligned elements), so no lane carries into hi32(i).
inline Vec vround_bf16_sr(Vec a, uint64_t key, size_t i) {
  const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i h = vlowbias32(_mm256_xor_si256(lanes, _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(key)))));
  const uint32_t k1 = static_cast<uint32_t>(key >> 32) ^ static_cast<uint32_t>(i >> 32) * rp::kGolden32;
  h = vlowbias32(_mm256_xor_si256(h, _mm256_set1_epi32(static_cast<int>(k1))));
  return vbf16_add(a, _mm256_srli_epi32(h, 16));
}

inline float vreduce_max(Vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

}  // namespace
