// roundpipe._C: Python bindings only.  Logic lives in the per-concept sources.
//
// Buffers cross as raw addresses (Python ints from tensor.data_ptr()) plus
// dtype names, so the build needs no torch headers; the Python wrappers in
// roundpipe/_native.py check devices, contiguity and sizes before calling here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "convert.h"
#include "cpu_features.h"
#include "parallel.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

namespace {

rp::DType parse_dtype(const std::string& arg, const std::string& name) {
  if (name == "float32") return rp::DType::F32;
  if (name == "bfloat16") return rp::DType::BF16;
  if (name == "float16") return rp::DType::F16;
  throw py::value_error(arg + "='" + name + "' is not supported; expected float32, bfloat16 or float16");
}

void* as_ptr(const std::string& arg, std::uintptr_t addr, size_t n) {
  if (addr == 0 && n != 0) throw py::value_error(arg + " is a null pointer but n=" + std::to_string(n));
  return reinterpret_cast<void*>(addr);
}

void bind_cpu(py::module_& m) {
  m.def("simd_level", [] { return std::string(rp::simd_level_name(rp::simd_level())); },
        "SIMD level the kernels use now: 'avx512', 'avx2' or 'scalar'.");
  m.def("best_simd_level", [] { return std::string(rp::simd_level_name(rp::best_simd_level())); },
        "Highest SIMD level this CPU supports.");
  m.def("set_simd_level", [](const std::string& name) {
    try {
      rp::set_simd_level(rp::parse_simd_level(name));
    } catch (const std::invalid_argument& e) {
      throw py::value_error(std::string("level: ") + e.what());
    }
  }, py::arg("level"), "Force a SIMD level (for tests and benchmarks).");
  m.def("cpu_features", [] {
    const rp::CpuFeatures& f = rp::cpu_features();
    py::dict d;
    d["avx2_fma_f16c"] = f.avx2_fma_f16c;
    d["avx512"] = f.avx512;
    d["avx512_bf16"] = f.avx512_bf16;
    return d;
  });
  m.def("num_threads", &rp::max_threads, "OpenMP threads the kernels use.");
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw py::value_error("n=" + std::to_string(n) + " must be >= 1");
#ifdef _OPENMP
    omp_set_num_threads(n);
#endif
  }, py::arg("n"));
  m.def("openmp", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  }, "Whether the extension was built with OpenMP.");
}

void bind_convert(py::module_& m) {
  m.def("convert", [](std::uintptr_t src, const std::string& src_dtype, std::uintptr_t dst,
                      const std::string& dst_dtype, size_t n) {
    const rp::DType sd = parse_dtype("src_dtype", src_dtype), dd = parse_dtype("dst_dtype", dst_dtype);
    const void* s = as_ptr("src", src, n);
    void* d = as_ptr("dst", dst, n);
    py::gil_scoped_release release;
    rp::convert(s, sd, d, dd, n);
  }, py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"),
     "Convert n elements between float32/bfloat16/float16 buffers given by address "
     "(round-to-nearest-even).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "roundpipe native core";
  rp::simd_level();  // resolve ROUNDPIPE_SIMD now: a bad value fails the import, not a later call
  bind_cpu(m);
  bind_convert(m);
}
