// AVX-512 F/BW/VL conversion kernel (built with -mavx512f -mavx512bw -mavx512vl
// -mavx2 -mfma -mf16c).  bf16 rounding is done with integer arithmetic, not
// vcvtneps2bf16: that instruction flushes fp32 denormals to zero, which would
// make this level differ bit-wise from the others and from torch.
#include "convert.h"
#include "half.h"

#if defined(__x86_64__)
#include <immintrin.h>

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
  static void store(T* p, Vec v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};

struct F16K {
  using T = uint16_t;
  static Vec load(const T* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(T* p, Vec v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

#include "convert_body.h"

void rp::convert_range_avx512(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_dispatch(src, src_dt, dst, dst_dt, n);
}
#else  // not x86-64: never selected at run time, present only to link
void rp::convert_range_avx512(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_range_scalar(src, src_dt, dst, dst_dt, n);
}
#endif
