// AVX-512 Adam kernel (see adam_body.h for the arithmetic).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "adam.h"

#include <cstdint>

#include "cpu_features.h"

#if defined(__x86_64__)
#include "vec_avx512.h"

#include "adam_body.h"

void rp::adam_range_avx512(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end) {
  // vcvtneps2bf16 for the shadow where the CPU has AVX512_BF16 (see vec_avx512.h).
  // A bf16 shadow whose vectors are 32-byte aligned is written with streaming
  // stores (see StreamK); the fence orders them before the caller's barrier.
  const bool stream = t.shadow && t.shadow_dtype == DType::BF16 &&
                      (reinterpret_cast<std::uintptr_t>(t.shadow) + 2 * begin) % 32 == 0;
  const bool ne = cpu_features().avx512_bf16;
  if (stream) {
    if (ne)
      adam_dispatch<StreamK<BF16NeK>>(t, c, begin, end);
    else
      adam_dispatch<StreamK<BF16K>>(t, c, begin, end);
    _mm_sfence();
  } else if (ne) {
    adam_dispatch<BF16NeK>(t, c, begin, end);
  } else {
    adam_dispatch<BF16K>(t, c, begin, end);
  }
}
#else  // not x86-64: never selected at run time, present only to link
void rp::adam_range_avx512(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end) {
  adam_range_scalar(t, c, begin, end);
}
#endif
