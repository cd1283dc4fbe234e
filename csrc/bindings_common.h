// Helpers shared by the binding sources (bindings.cpp, bindings_optim.cpp): dtype names, checked
// buffer spans and raw addresses as pybind11 receives them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "convert.h"

namespace rp::bind {

namespace py = pybind11;

inline rp::DType parse_dtype(const std::string& arg, const std::string& name) {
  if (name == "float32") return rp::DType::F32;
  if (name == "bfloat16") return rp::DType::BF16;
  if (name == "float16") return rp::DType::F16;
  throw py::value_error(arg + "='" + name + "' is not supported; expected float32, bfloat16 or float16");
}

// An n-element buffer of `dt` at `addr` (checks.h: null, alignment, size); its byte size.
inline size_t elems(const std::string& arg, std::uintptr_t addr, size_t n, rp::DType dt) {
  return rp::check::span(arg, addr, n, rp::dtype_size(dt), rp::dtype_size(dt));
}

inline void* ptr(std::uintptr_t addr) { return reinterpret_cast<void*>(addr); }

inline std::string item(const std::string& arg, size_t i) { return arg + "[" + std::to_string(i) + "]"; }

}  // namespace rp::bind
