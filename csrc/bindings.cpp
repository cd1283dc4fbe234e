// roundpipe._C: Python bindings only.  Logic lives in the per-concept sources.
//
// Buffers cross as raw addresses (Python ints from tensor.data_ptr()) plus
// dtype names, so the build needs no torch headers; the Python wrappers in
// roundpipe/_native.py check devices, contiguity and sizes before calling here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam.h"
#include "convert.h"
#include "cpu_features.h"
#include "grad_ops.h"
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

// ---- adam: fused optimizer step and gradient passes --------------------------

using Addrs = std::vector<std::uintptr_t>;

void check_len(const std::string& arg, size_t got, size_t want) {
  if (got != want)
    throw py::value_error(arg + " has " + std::to_string(got) + " entries but params has " + std::to_string(want) +
                          "; every per-tensor list must have one entry per parameter");
}

std::string item(const std::string& arg, size_t i) { return arg + "[" + std::to_string(i) + "]"; }

// Byte ranges the step reads (gradients) and writes (everything else).  Any
// output overlapping another output or an input would make the result depend
// on the order of the sweep, so it is rejected; inputs may share memory.
class OverlapCheck {
 public:
  void add(std::string label, std::uintptr_t addr, size_t bytes, bool output) {
    if (bytes) spans_.push_back({addr, addr + bytes, std::move(label), output});
  }
  void check() {
    std::sort(spans_.begin(), spans_.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    const Span* out = nullptr;  // output reaching furthest so far
    const Span* in = nullptr;   // input reaching furthest so far
    for (const Span& s : spans_) {
      if (out && out->end > s.begin) fail(*out, s);
      if (s.output && in && in->end > s.begin) fail(*in, s);
      const Span*& slot = s.output ? out : in;
      if (!slot || s.end > slot->end) slot = &s;
    }
  }

 private:
  struct Span {
    std::uintptr_t begin, end;
    std::string label;
    bool output;
  };
  [[noreturn]] static void fail(const Span& a, const Span& b) {
    throw py::value_error(b.label + " overlaps " + a.label +
                          " in memory; outputs must not share memory with each other or with the gradients");
  }
  std::vector<Span> spans_;
};

void check_range(const std::string& arg, double v, double lo, double hi, bool hi_open) {
  if (!(v >= lo && (hi_open ? v < hi : v <= hi)))
    throw py::value_error(arg + "=" + std::to_string(v) + " must be in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + (hi_open ? ")" : "]"));
}

void adam_step(const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes,
               const Addrs& exp_avgs, const Addrs& exp_avg_sqs, const Addrs& max_exp_avg_sqs, const Addrs& shadows,
               const std::vector<std::string>& shadow_dtypes, const std::vector<size_t>& numels,
               const std::vector<double>& steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled, bool amsgrad, bool maximize, double grad_mul) {
  const size_t count = params.size();
  check_len("grads", grads.size(), count);
  check_len("grad_dtypes", grad_dtypes.size(), count);
  check_len("exp_avgs", exp_avgs.size(), count);
  check_len("exp_avg_sqs", exp_avg_sqs.size(), count);
  if (amsgrad) check_len("max_exp_avg_sqs (amsgrad=True)", max_exp_avg_sqs.size(), count);
  else if (!max_exp_avg_sqs.empty())
    throw py::value_error("max_exp_avg_sqs must be empty when amsgrad=False, got " +
                          std::to_string(max_exp_avg_sqs.size()) + " entries");
  check_len("shadows", shadows.size(), count);
  check_len("shadow_dtypes", shadow_dtypes.size(), count);
  check_len("numels", numels.size(), count);
  check_len("steps", steps.size(), count);
  check_range("lr", lr, 0.0, INFINITY, true);
  check_range("beta1", beta1, 0.0, 1.0, true);
  check_range("beta2", beta2, 0.0, 1.0, true);
  check_range("eps", eps, 0.0, INFINITY, true);
  check_range("weight_decay", weight_decay, 0.0, INFINITY, true);
  if (!std::isfinite(grad_mul)) throw py::value_error("grad_mul=" + std::to_string(grad_mul) + " must be finite");

  rp::AdamOptions opt;
  opt.lr = lr, opt.beta1 = beta1, opt.beta2 = beta2, opt.eps = eps, opt.weight_decay = weight_decay;
  opt.decoupled = decoupled, opt.amsgrad = amsgrad, opt.maximize = maximize, opt.grad_mul = grad_mul;
  std::vector<rp::AdamTensor> ts(count);
  OverlapCheck overlaps;
  for (size_t i = 0; i < count; ++i) {
    rp::AdamTensor& t = ts[i];
    const size_t n = numels[i];
    if (!(steps[i] >= 1)) throw py::value_error(item("steps", i) + "=" + std::to_string(steps[i]) + " must be >= 1");
    t.n = n;
    t.step = steps[i];
    t.param = static_cast<float*>(as_ptr(item("params", i), params[i], n));
    t.grad_dtype = parse_dtype(item("grad_dtypes", i), grad_dtypes[i]);
    t.grad = as_ptr(item("grads", i), grads[i], n);
    t.exp_avg = static_cast<float*>(as_ptr(item("exp_avgs", i), exp_avgs[i], n));
    t.exp_avg_sq = static_cast<float*>(as_ptr(item("exp_avg_sqs", i), exp_avg_sqs[i], n));
    if (amsgrad) t.max_exp_avg_sq = static_cast<float*>(as_ptr(item("max_exp_avg_sqs", i), max_exp_avg_sqs[i], n));
    if (shadows[i]) {
      t.shadow = reinterpret_cast<void*>(shadows[i]);
      t.shadow_dtype = parse_dtype(item("shadow_dtypes", i), shadow_dtypes[i]);
    }
    overlaps.add(item("params", i), params[i], 4 * n, true);
    overlaps.add(item("grads", i), grads[i], rp::dtype_size(t.grad_dtype) * n, false);
    overlaps.add(item("exp_avgs", i), exp_avgs[i], 4 * n, true);
    overlaps.add(item("exp_avg_sqs", i), exp_avg_sqs[i], 4 * n, true);
    if (amsgrad) overlaps.add(item("max_exp_avg_sqs", i), max_exp_avg_sqs[i], 4 * n, true);
    if (t.shadow) overlaps.add(item("shadows", i), shadows[i], rp::dtype_size(t.shadow_dtype) * n, true);
  }
  overlaps.check();
  py::gil_scoped_release release;
  rp::adam_step(ts.data(), ts.size(), opt);
}

void bind_adam(py::module_& m) {
  m.def("adam_step", &adam_step, py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("shadows"), py::arg("shadow_dtypes"),
        py::arg("numels"), py::arg("steps"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"),
        py::arg("grad_mul"),
        "One fused Adam/AdamW step over a group of fp32 tensors given by address: per-tensor lists of "
        "params, grads (+ dtype), moments, max_exp_avg_sqs (amsgrad only, else empty), shadow copies "
        "(0 = none, + dtype), element counts and step numbers (>= 1, after increment). The gradient is "
        "multiplied by grad_mul (clip_coef / loss_scale). Arithmetic equals torch's fused CPU AdamW.");
  m.def("grad_sumsq", [](const Addrs& grads, const std::vector<std::string>& dtypes, const std::vector<size_t>& numels) {
    check_len("dtypes", dtypes.size(), grads.size());
    check_len("numels", numels.size(), grads.size());
    std::vector<rp::GradRef> refs(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      refs[i].dtype = parse_dtype(item("dtypes", i), dtypes[i]);
      refs[i].data = as_ptr(item("grads", i), grads[i], numels[i]);
      refs[i].n = numels[i];
    }
    py::gil_scoped_release release;
    return rp::grad_sumsq(refs.data(), refs.size());
  }, py::arg("grads"), py::arg("dtypes"), py::arg("numels"),
     "Sum of squares (double) of all elements of the gradients given by address; inf/NaN iff any "
     "element is inf/NaN. Identical at every SIMD level for a given thread count.");
  m.def("accumulate", [](std::uintptr_t dst, std::uintptr_t src, const std::string& src_dtype, size_t n) {
    const rp::DType sd = parse_dtype("src_dtype", src_dtype);
    float* d = static_cast<float*>(as_ptr("dst", dst, n));
    const void* s = as_ptr("src", src, n);
    if (n && !(dst == src && sd == rp::DType::F32) && dst < src + n * rp::dtype_size(sd) && src < dst + 4 * n)
      throw py::value_error("dst and src overlap in memory; accumulate needs separate buffers (or the same fp32 one)");
    py::gil_scoped_release release;
    rp::accumulate(d, s, sd, n);
  }, py::arg("dst"), py::arg("src"), py::arg("src_dtype"), py::arg("n"),
     "dst (float32, n elements) += src converted to float32.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "roundpipe native core";
  bind_cpu(m);
  bind_convert(m);
  bind_adam(m);
}
