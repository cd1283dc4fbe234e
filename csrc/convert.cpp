// Scalar conversion kernel, and the multi-threaded, level-dispatched entry point.
#include "convert.h"

#include <cstring>

#include "cpu_features.h"
#include "half.h"
#include "parallel.h"
#include "vec_scalar.h"

#include "convert_body.h"

namespace rp {

size_t dtype_size(DType dt) { return dt == DType::F32 ? 4 : 2; }

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    default: return "float16";
  }
}

void convert_range_scalar(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_dispatch(src, src_dt, dst, dst_dt, n);
}

void convert(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  if (src_dt == dst_dt) {
    if (src != dst) std::memcpy(dst, src, n * dtype_size(src_dt));
    return;
  }
  using Fn = void (*)(const void*, DType, void*, DType, size_t);
  Fn fn = convert_range_scalar;
  switch (simd_level()) {
    case SimdLevel::Avx512: fn = convert_range_avx512; break;
    case SimdLevel::Avx2: fn = convert_range_avx2; break;
    default: break;
  }
  const size_t ss = dtype_size(src_dt), ds = dtype_size(dst_dt);
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  parallel_ranges(n, 32, size_t{1} << 16, [&](size_t b, size_t e) {
    fn(s + b * ss, src_dt, d + b * ds, dst_dt, e - b);
  });
}

}  // namespace rp
