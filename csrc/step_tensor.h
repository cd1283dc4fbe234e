// What every fused optimizer step knows of one tensor besides its state: the
// master (fp32, or bf16 computed in fp32 and rounded), the gradient in its
// download dtype, the optional low-precision "shadow" upload copy, the count.
// The kernels' tensor structs (AdamTensor, Adam8bitTensor, OptimTensor) add
// their state to it; the bindings fill these fields once for all of them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "convert.h"

namespace rp {

struct StepTensor {
  void* param = nullptr;            // fp32, or bf16 (param_dtype): computed in fp32, then rounded
  DType param_dtype = DType::F32;
  bool stochastic = false;           // a bf16 master's rounding: stochastic, else to nearest even
  uint64_t round_key = 0;            // the stochastic rounding's key for this tensor and step (half.h)
  const void* grad = nullptr;
  DType grad_dtype = DType::F32;
  void* shadow = nullptr;
  DType shadow_dtype = DType::BF16;
  size_t n = 0;
};

}  // namespace rp
