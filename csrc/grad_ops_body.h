// Body of one SIMD level's gradient kernels.  Included by exactly one
// translation unit per level after its vec_<level>.h and a definition of
// `Sq16`: 16 double lanes with `void add(size_t j, Vec x)` adding x*x (exact
// in double) to lanes [j * kWidth, (j + 1) * kWidth) and `void get(double*)`.
// Defines sumsq_dispatch and accumulate_dispatch in an anonymous namespace.
#pragma once

#include <cstring>

#include "grad_ops.h"

namespace {

constexpr size_t kLanes = 16;
static_assert(kLanes % kWidth == 0, "a lane block must hold whole vectors");

template <class GK>
double sumsq_typed(const void* src, size_t n) {
  using G = typename GK::T;
  const G* g = static_cast<const G*>(src);
  Sq16 acc;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (size_t j = 0; j < kLanes / kWidth; ++j) acc.add(j, GK::load(g + i + j * kWidth));
  if (i < n) {  // zero-padded tail: 0 * 0 adds nothing
    G tail[kLanes] = {};
    std::memcpy(tail, g + i, (n - i) * sizeof(G));
    for (size_t j = 0; j < kLanes / kWidth; ++j) acc.add(j, GK::load(tail + j * kWidth));
  }
  double l[kLanes];
  acc.get(l);
  // Fixed pairwise reduction, the same at every level.
  for (size_t w = kLanes / 2; w >= 1; w /= 2)
    for (size_t j = 0; j < w; ++j) l[j] = l[j] + l[j + w];
  return l[0];
}

double sumsq_dispatch(const void* src, rp::DType dt, size_t n) {
  switch (dt) {
    case rp::DType::F32: return sumsq_typed<F32K>(src, n);
    case rp::DType::BF16: return sumsq_typed<BF16K>(src, n);
    case rp::DType::F16: return sumsq_typed<F16K>(src, n);
  }
  return 0.0;
}

template <class SK>
void accumulate_typed(float* dst, const void* src, size_t n) {
  using S = typename SK::T;
  const S* s = static_cast<const S*>(src);
  size_t i = 0;
  for (; i + kWidth <= n; i += kWidth) F32K::store(dst + i, vadd(F32K::load(dst + i), SK::load(s + i)));
  if (i < n) {
    float td[kWidth] = {};
    S ts[kWidth] = {};
    std::memcpy(td, dst + i, (n - i) * sizeof(float));
    std::memcpy(ts, s + i, (n - i) * sizeof(S));
    F32K::store(td, vadd(F32K::load(td), SK::load(ts)));
    std::memcpy(dst + i, td, (n - i) * sizeof(float));
  }
}

void accumulate_dispatch(float* dst, const void* src, rp::DType dt, size_t n) {
  switch (dt) {
    case rp::DType::F32: return accumulate_typed<F32K>(dst, src, n);
    case rp::DType::BF16: return accumulate_typed<BF16K>(dst, src, n);
    case rp::DType::F16: return accumulate_typed<F16K>(dst, src, n);
  }
}

}  // namespace
