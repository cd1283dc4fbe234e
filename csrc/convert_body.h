// Body of one SIMD level's conversion kernel.  Included by exactly one
// translation unit per level after it has defined, in an anonymous namespace,
// the lane width `kWidth`, the vector type `Vec` and three element kinds
// `F32K`, `BF16K`, `F16K`, each with `using T`, `static Vec load(const T*)` and
// `static void store(T*, Vec)`.  Tails use the scalar helpers of half.h.
#pragma once

namespace {

template <class K> inline float scalar_to_f32(typename K::T v);
template <> inline float scalar_to_f32<F32K>(float v) { return v; }
template <> inline float scalar_to_f32<BF16K>(uint16_t v) { return rp::bf16_to_f32(v); }
template <> inline float scalar_to_f32<F16K>(uint16_t v) { return rp::f16_to_f32(v); }

template <class K> inline typename K::T scalar_from_f32(float v);
template <> inline float scalar_from_f32<F32K>(float v) { return v; }
template <> inline uint16_t scalar_from_f32<BF16K>(float v) { return rp::f32_to_bf16(v); }
template <> inline uint16_t scalar_from_f32<F16K>(float v) { return rp::f32_to_f16(v); }

template <class S, class D>
void convert_typed(const void* src, void* dst, size_t n) {
  const auto* s = static_cast<const typename S::T*>(src);
  auto* d = static_cast<typename D::T*>(dst);
  size_t i = 0;
  for (; i + kWidth <= n; i += kWidth) D::store(d + i, S::load(s + i));
  for (; i < n; ++i) d[i] = scalar_from_f32<D>(scalar_to_f32<S>(s[i]));
}

template <class S>
void convert_from(const void* src, void* dst, rp::DType dst_dt, size_t n) {
  switch (dst_dt) {
    case rp::DType::F32: convert_typed<S, F32K>(src, dst, n); break;
    case rp::DType::BF16: convert_typed<S, BF16K>(src, dst, n); break;
    case rp::DType::F16: convert_typed<S, F16K>(src, dst, n); break;
  }
}

void convert_dispatch(const void* src, rp::DType src_dt, void* dst, rp::DType dst_dt, size_t n) {
  switch (src_dt) {
    case rp::DType::F32: convert_from<F32K>(src, dst, dst_dt, n); break;
    case rp::DType::BF16: convert_from<BF16K>(src, dst, dst_dt, n); break;
    case rp::DType::F16: convert_from<F16K>(src, dst, dst_dt, n); break;
  }
}

}  // namespace
