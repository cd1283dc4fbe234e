// Run-time SIMD level: detected once with CPUID, overridable for tests.
//
// The extension is compiled for the baseline x86-64 ISA; each SIMD level lives
// in its own translation unit built with that level's -m flags (see setup.py),
// and the functions here choose which one runs.  ROUNDPIPE_SIMD=scalar|avx2|avx512
// forces a level at load time; set_simd_level() does it at run time.
#pragma once

#include <string>

namespace rp {

enum class SimdLevel : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

struct CpuFeatures {
  bool avx2_fma_f16c = false;   // AVX2 + FMA + F16C, OS saves YMM state
  bool avx512 = false;          // AVX-512 F/BW/VL, OS saves ZMM state
  bool avx512_bf16 = false;     // AVX512_BF16 (vcvtneps2bf16)
};

const CpuFeatures& cpu_features();
SimdLevel best_simd_level();          // highest level this CPU supports
SimdLevel simd_level();               // level in use now
void set_simd_level(SimdLevel level); // throws std::invalid_argument if unsupported
SimdLevel parse_simd_level(const std::string& name);  // throws on unknown names
const char* simd_level_name(SimdLevel level);

}  // namespace rp
