// AVX2 + FMA + F16C conversion kernel (built with -mavx2 -mfma -mf16c).
#include "convert.h"
#include "half.h"

#if defined(__x86_64__)
#include <immintrin.h>

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

}  // namespace

#include "convert_body.h"

void rp::convert_range_avx2(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_dispatch(src, src_dt, dst, dst_dt, n);
}
#else  // not x86-64: never selected at run time, present only to link
void rp::convert_range_avx2(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_range_scalar(src, src_dt, dst, dst_dt, n);
}
#endif
