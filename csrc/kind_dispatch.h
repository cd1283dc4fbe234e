// The element kinds of one optimizer call, chosen once per range.
//
// Included by a kernel body after its level's vec_<level>.h (which defines the
// kinds F32K/BF16K/F16K in an anonymous namespace).  with_kinds<BF16Out>(...)
// calls fn(GK{}, SK{}) with the kind that loads the gradient's dtype and the
// kind that stores the shadow copy (NoShadowK when there is none; BF16Out for
// a bf16 one, so a level can substitute a faster or streaming bf16 store), and
// the kernel instantiates its typed loop as body<decltype(gk), decltype(sk)>.
#pragma once

#include "convert.h"

namespace {

// "No shadow copy": stores nothing.
struct NoShadowK {
  using T = uint16_t;
  static void store(T*, Vec) {}
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

}  // namespace
