// The element kinds of one optimizer call, chosen once per range.
//
// Included by a kernel body after its level's vec_<level>.h (which defines the
// kinds F32K/BF16K/F16K in an anonymous namespace).  with_kinds<BF16Out>(...)
// calls fn(GK{}, SK{}) with the kind that loads the gradient's dtype and the
// kind that stores the shadow copy (NoShadowK when there is none; BF16Out for
// a bf16 one, so a level can substitute a faster or streaming bf16 store), and
// the kernel instantiates its typed loop as body<decltype(gk), decltype(sk)>.
// with_master_kinds adds the master's kind in front (fp32, or bf16 rounded to nearest or
// stochastically: MasterF32K / MasterBF16K / MasterBF16SrK).
#pragma once

#include <cstddef>
#include <cstdint>

#include "convert.h"

namespace {

// "No shadow copy": stores nothing.
struct NoShadowK {
  using T = uint16_t;
  static void store(T*, Vec) {}
};

// How a kernel reads and writes the master weight: fp32, or bf16 rounded from the fp32
// result to nearest even or stochastically (half.h).  store() writes the new weight and
// returns it as stored (what the shadow copy then receives); key and i (the element index
// of the vector's first lane) feed the stochastic rounding's counter-based bits.
struct MasterF32K {
  using T = float;
  static Vec load(const T* p) { return F32K::load(p); }
  static Vec store(T* p, Vec v, uint64_t, size_t) {
    F32K::store(p, v);
    return v;
  }
};
struct MasterBF16K {
  using T = uint16_t;
  static Vec load(const T* p) { return BF16K::load(p); }
  static Vec store(T* p, Vec v, uint64_t, size_t) {
    const Vec r = vround_bf16_ne(v);
    BF16K::store(p, r);   // exact: r is a bf16 value
    return r;
  }
};
struct MasterBF16SrK {
  using T = uint16_t;
  static Vec load(const T* p) { return BF16K::load(p); }
  static Vec store(T* p, Vec v, uint64_t key, size_t i) {
    const Vec r = vround_bf16_sr(v, key, i);
    BF16K::store(p, r);
    return r;
  }
};

template <class BF16Out, class Fn>
void with_kinds(rp::DType grad_dtype, const void* shadow, rp::DType shadow_dtype, Fn&& fn) {
  const auto with_shadow = [&](auto gk) {
    if (!shadow) return fn(gk, NoShadowK{});
    switch (shadow_dtype) {
      case rp::DType::F32: return fn(gk, F32K{});
      case rp::DType::BF16: return fn(gk, BF16Out{});
      case rp::DType::F16: return fn(gk, F16K{});
    }
  };
  switch (grad_dtype) {
    case rp::DType::F32: return with_shadow(F32K{});
    case rp::DType::BF16: return with_shadow(BF16K{});
    case rp::DType::F16: return with_shadow(F16K{});
  }
}

// with_kinds, with the master's kind first: fn(MK{}, GK{}, SK{}).
template <class BF16Out, class Fn>
void with_master_kinds(rp::DType param_dtype, bool stochastic, rp::DType grad_dtype, const void* shadow,
                       rp::DType shadow_dtype, Fn&& fn) {
  const auto go = [&](auto mk) {
    with_kinds<BF16Out>(grad_dtype, shadow, shadow_dtype, [&](auto gk, auto sk) { fn(mk, gk, sk); });
  };
  if (param_dtype != rp::DType::BF16) return go(MasterF32K{});
  if (stochastic) return go(MasterBF16SrK{});
  return go(MasterBF16K{});
}

}  // namespace
