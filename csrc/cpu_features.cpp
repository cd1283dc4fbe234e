#include "cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define RP_X86 1
#endif

namespace rp {
namespace {

#ifdef RP_X86
unsigned long long xgetbv0() {
  unsigned int eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef RP_X86
  unsigned int a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;      // SSE + AVX state
  const bool zmm_ok = (xcr0 & 0xE6) == 0xE6;    // + opmask, ZMM_Hi256, Hi16_ZMM
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
  f.avx2_fma_f16c = ymm_ok && avx2 && fma && f16c;
  f.avx512 = f.avx2_fma_f16c && zmm_ok && avx512f && avx512bw && avx512vl;
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = f.avx512 && (a & (1u << 5));
#endif
  return f;
}

SimdLevel initial_level() {
  const char* env = std::getenv("ROUNDPIPE_SIMD");
  if (env == nullptr || *env == '\0') return best_simd_level();
  const SimdLevel wanted = parse_simd_level(env);
  if (static_cast<int>(wanted) > static_cast<int>(best_simd_level()))
    throw std::invalid_argument(std::string("ROUNDPIPE_SIMD=") + env +
                                " is not supported by this CPU (best: " +
                                simd_level_name(best_simd_level()) + ")");
  return wanted;
}

std::atomic<int>& level_slot() {
  static std::atomic<int> slot{static_cast<int>(initial_level())};
  return slot;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

SimdLevel best_simd_level() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512) return SimdLevel::Avx512;
  if (f.avx2_fma_f16c) return SimdLevel::Avx2;
  return SimdLevel::Scalar;
}

SimdLevel simd_level() { return static_cast<SimdLevel>(level_slot().load(std::memory_order_relaxed)); }

void set_simd_level(SimdLevel level) {
  if (static_cast<int>(level) > static_cast<int>(best_simd_level()))
    throw std::invalid_argument(std::string("simd level '") + simd_level_name(level) +
                                "' is not supported by this CPU (best: " +
                                simd_level_name(best_simd_level()) + ")");
  level_slot().store(static_cast<int>(level), std::memory_order_relaxed);
}

SimdLevel parse_simd_level(const std::string& name) {
  if (name == "scalar") return SimdLevel::Scalar;
  if (name == "avx2") return SimdLevel::Avx2;
  if (name == "avx512") return SimdLevel::Avx512;
  throw std::invalid_argument("simd level '" + name + "' is unknown; expected scalar, avx2 or avx512");
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::Avx512: return "avx512";
    case SimdLevel::Avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace rp
