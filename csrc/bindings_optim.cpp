// roundpipe._C, optimizers: the fused Adam, AdamW8bit, SGD, Adagrad and Lion steps and the gradient
// passes (bindings only; see bindings.cpp for the conventions every entry point follows).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "adam.h"
#include "adam8bit.h"
#include "bindings_common.h"
#include "checks.h"
#include "grad_ops.h"
#include "optimizers.h"
#include "parallel.h"

namespace rp::bind {
namespace {

// ---- optimizers: fused Adam, SGD, Adagrad, Lion steps and the gradient passes --------------------------

using Addrs = std::vector<std::uintptr_t>;

void check_len(const std::string& arg, size_t got, size_t want) {
  if (got != want)
    throw py::value_error(arg + " has " + std::to_string(got) + " entries but params has " + std::to_string(want) +
                          "; every per-tensor list must have one entry per parameter");
}

void check_range(const std::string& arg, double v, double lo, double hi, bool hi_open) {
  if (!(v >= lo && (hi_open ? v < hi : v <= hi)))
    throw py::value_error(arg + "=" + std::to_string(v) + " must be in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + (hi_open ? ")" : "]"));
}

// The per-tensor lists every optimizer step takes, checked entry by entry: params
// (fp32 or bf16 masters, `masters`) and numels, grads (+ dtype), shadows (0 = none, + dtype); the state
// buffers are added with f32().  check() then rejects any overlap of an output.
class GroupArgs {
 public:
  GroupArgs(const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes, const Addrs& shadows,
            const std::vector<std::string>& shadow_dtypes, const std::vector<size_t>& numels, double grad_mul)
      : params_(params), grads_(grads), grad_dtypes_(grad_dtypes), shadows_(shadows), shadow_dtypes_(shadow_dtypes),
        numels_(numels) {
    check_len("grads", grads.size(), size());
    check_len("grad_dtypes", grad_dtypes.size(), size());
    check_len("shadows", shadows.size(), size());
    check_len("shadow_dtypes", shadow_dtypes.size(), size());
    check_len("numels", numels.size(), size());
    if (!std::isfinite(grad_mul)) throw py::value_error("grad_mul=" + std::to_string(grad_mul) + " must be finite");
  }

  size_t size() const { return params_.size(); }

  // The masters' dtypes (empty: all float32) and a bf16 master's rounding: stochastic with
  // round_keys[i] (one per tensor, half.h), else to nearest even.
  void masters(const std::vector<std::string>& param_dtypes, const std::string& rounding,
               const std::vector<uint64_t>& round_keys) {
    if (!param_dtypes.empty()) check_len("param_dtypes", param_dtypes.size(), size());
    if (rounding != "nearest" && rounding != "stochastic")
      throw py::value_error("rounding='" + rounding + "' must be 'nearest' or 'stochastic'");
    stochastic_ = rounding == "stochastic";
    if (stochastic_) check_len("round_keys (rounding='stochastic')", round_keys.size(), size());
    param_dtypes_ = param_dtypes;
    round_keys_ = round_keys;
  }

  // Entry i's fp32 output buffer `arg`[i] of n (default numels[i]) elements: checked, recorded, returned.
  float* f32(const char* arg, size_t i, std::uintptr_t addr) { return f32(arg, i, addr, numels_[i]); }
  float* f32(const char* arg, size_t i, std::uintptr_t addr, size_t n) {
    overlaps_.add(item(arg, i), addr, elems(item(arg, i), addr, n, rp::DType::F32), true);
    return static_cast<float*>(ptr(addr));
  }

  // Entry i's byte output buffer `arg`[i] of numels[i] elements (8-bit codes).
  uint8_t* u8(const char* arg, size_t i, std::uintptr_t addr) {
    overlaps_.add(item(arg, i), addr, rp::check::span(item(arg, i), addr, numels_[i], 1, 1), true);
    return static_cast<uint8_t*>(ptr(addr));
  }

  // A read-only buffer of `bytes` bytes shared by the group (a code table).
  const void* input(const std::string& arg, std::uintptr_t addr, size_t bytes) {
    overlaps_.add(arg, addr, rp::check::span(arg, addr, bytes, 1, 1), false);
    return ptr(addr);
  }

  // Fills the fields every kernel's tensor struct shares (rp::StepTensor: param, grad, shadow, n).
  void fill(size_t i, rp::StepTensor& t) {
    t.n = numels_[i];
    t.param_dtype = param_dtypes_.empty() ? rp::DType::F32 : parse_dtype(item("param_dtypes", i), param_dtypes_[i]);
    if (t.param_dtype == rp::DType::F16)
      throw py::value_error(item("param_dtypes", i) + "='float16': a master is float32 or bfloat16");
    overlaps_.add(item("params", i), params_[i], elems(item("params", i), params_[i], t.n, t.param_dtype), true);
    t.param = ptr(params_[i]);
    t.stochastic = stochastic_;
    t.round_key = round_keys_.empty() ? 0 : round_keys_[i];
    t.grad_dtype = parse_dtype(item("grad_dtypes", i), grad_dtypes_[i]);
    t.grad = ptr(grads_[i]);
    overlaps_.add(item("grads", i), grads_[i], elems(item("grads", i), grads_[i], t.n, t.grad_dtype), false);
    if (shadows_[i]) {
      t.shadow = ptr(shadows_[i]);
      t.shadow_dtype = parse_dtype(item("shadow_dtypes", i), shadow_dtypes_[i]);
      overlaps_.add(item("shadows", i), shadows_[i], elems(item("shadows", i), shadows_[i], t.n, t.shadow_dtype), true);
    }
  }

  void check() { overlaps_.check("outputs must not share memory with each other or with the gradients"); }

 private:
  const Addrs &params_, &grads_;
  const std::vector<std::string>& grad_dtypes_;
  const Addrs& shadows_;
  const std::vector<std::string>& shadow_dtypes_;
  const std::vector<size_t>& numels_;
  std::vector<std::string> param_dtypes_;
  bool stochastic_ = false;
  std::vector<uint64_t> round_keys_;
  rp::check::OverlapCheck overlaps_;
};

using Dtypes = std::vector<std::string>;
using Keys = std::vector<uint64_t>;

void check_steps(const std::vector<double>& steps, size_t count) {
  check_len("steps", steps.size(), count);
  for (size_t i = 0; i < count; ++i)
    if (!(steps[i] >= 1)) throw py::value_error(item("steps", i) + "=" + std::to_string(steps[i]) + " must be >= 1");
}

// The options of an Adam step with lr, betas, eps and weight_decay checked (ValueError naming them).
rp::AdamOptions adam_options(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                             bool amsgrad, bool maximize, double grad_mul, double predict) {
  check_range("lr", lr, 0.0, INFINITY, true);
  check_range("beta1", beta1, 0.0, 1.0, true);
  check_range("beta2", beta2, 0.0, 1.0, true);
  check_range("eps", eps, 0.0, INFINITY, true);
  check_range("weight_decay", weight_decay, 0.0, INFINITY, true);
  rp::AdamOptions opt;
  opt.lr = lr, opt.beta1 = beta1, opt.beta2 = beta2, opt.eps = eps, opt.weight_decay = weight_decay;
  opt.decoupled = decoupled, opt.amsgrad = amsgrad, opt.maximize = maximize, opt.grad_mul = grad_mul;
  opt.predict = predict;
  return opt;
}

void adam_step(const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes,
               const Addrs& exp_avgs, const Addrs& exp_avg_sqs, const Addrs& max_exp_avg_sqs, const Addrs& shadows,
               const std::vector<std::string>& shadow_dtypes, const std::vector<size_t>& numels,
               const std::vector<double>& steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled, bool amsgrad, bool maximize, double grad_mul, double predict,
               const Dtypes& param_dtypes, const std::string& rounding, const Keys& round_keys) {
  GroupArgs args(params, grads, grad_dtypes, shadows, shadow_dtypes, numels, grad_mul);
  args.masters(param_dtypes, rounding, round_keys);
  check_range("predict", predict, 0.0, INFINITY, true);
  const size_t count = args.size();
  check_len("exp_avgs", exp_avgs.size(), count);
  check_len("exp_avg_sqs", exp_avg_sqs.size(), count);
  if (amsgrad) check_len("max_exp_avg_sqs (amsgrad=True)", max_exp_avg_sqs.size(), count);
  else if (!max_exp_avg_sqs.empty())
    throw py::value_error("max_exp_avg_sqs must be empty when amsgrad=False, got " +
                          std::to_string(max_exp_avg_sqs.size()) + " entries");
  check_steps(steps, count);
  const rp::AdamOptions opt =
      adam_options(lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, grad_mul, predict);
  std::vector<rp::AdamTensor> ts(count);
  for (size_t i = 0; i < count; ++i) {
    rp::AdamTensor& t = ts[i];
    t.step = steps[i];
    args.fill(i, t);
    t.exp_avg = args.f32("exp_avgs", i, exp_avgs[i]);
    t.exp_avg_sq = args.f32("exp_avg_sqs", i, exp_avg_sqs[i]);
    if (amsgrad) t.max_exp_avg_sq = args.f32("max_exp_avg_sqs", i, max_exp_avg_sqs[i]);
  }
  args.check();
  py::gil_scoped_release release;
  rp::adam_step(ts.data(), ts.size(), opt);
}

// Adam / AdamW over 8-bit blockwise moments (adam8bit.h).  tables: the addresses of
// code1 (256 fp32), lut1 (65536 + 3 bytes), code2, lut2.
void adam8bit_step(const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes,
                   const Addrs& state1s, const Addrs& state2s, const Addrs& absmax1s, const Addrs& absmax2s,
                   const Addrs& shadows, const std::vector<std::string>& shadow_dtypes,
                   const std::vector<size_t>& numels, const std::vector<double>& steps, const Addrs& tables,
                   double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                   bool maximize, double grad_mul, double predict, const Dtypes& param_dtypes,
                   const std::string& rounding, const Keys& round_keys) {
  GroupArgs args(params, grads, grad_dtypes, shadows, shadow_dtypes, numels, grad_mul);
  args.masters(param_dtypes, rounding, round_keys);
  check_range("predict", predict, 0.0, INFINITY, true);
  const size_t count = args.size();
  for (const auto& [name, list] : {std::pair<const char*, const Addrs&>{"state1s", state1s}, {"state2s", state2s},
                                   {"absmax1s", absmax1s}, {"absmax2s", absmax2s}})
    check_len(name, list.size(), count);
  check_steps(steps, count);
  if (tables.size() != 4)
    throw py::value_error("tables has " + std::to_string(tables.size()) +
                          " entries; expected 4 addresses: code1, lut1, code2, lut2");
  const rp::AdamOptions opt =
      adam_options(lr, beta1, beta2, eps, weight_decay, decoupled, false, maximize, grad_mul, predict);
  rp::Adam8bitTables tab;
  tab.code1 = static_cast<const float*>(args.input("tables[0] (code1)", tables[0], 256 * sizeof(float)));
  tab.lut1 = static_cast<const uint8_t*>(args.input("tables[1] (lut1)", tables[1], rp::kQuantBins + 3));
  tab.code2 = static_cast<const float*>(args.input("tables[2] (code2)", tables[2], 256 * sizeof(float)));
  tab.lut2 = static_cast<const uint8_t*>(args.input("tables[3] (lut2)", tables[3], rp::kQuantBins + 3));
  if (reinterpret_cast<std::uintptr_t>(tab.code1) % 4 || reinterpret_cast<std::uintptr_t>(tab.code2) % 4)
    throw py::value_error("tables: code1 and code2 must be 4-byte aligned fp32 arrays");

  std::vector<rp::Adam8bitTensor> ts(count);
  for (size_t i = 0; i < count; ++i) {
    rp::Adam8bitTensor& t = ts[i];
    t.step = steps[i];
    args.fill(i, t);
    const size_t blocks = t.n / rp::kQuantBlock + (t.n % rp::kQuantBlock != 0);
    t.state1 = args.u8("state1s", i, state1s[i]);
    t.state2 = args.u8("state2s", i, state2s[i]);
    t.absmax1 = args.f32("absmax1s", i, absmax1s[i], blocks);
    t.absmax2 = args.f32("absmax2s", i, absmax2s[i], blocks);
  }
  args.check();
  py::gil_scoped_release release;
  rp::adam8bit_step(ts.data(), ts.size(), opt, tab);
}

// SGD, Adagrad and Lion: one state buffer per tensor (`states`; empty for SGD
// without momentum), per-tensor step numbers (Adagrad) or first flags (SGD).
void optim_step(rp::OptimOptions opt, const char* states_arg, const Addrs& params, const Addrs& grads,
                const std::vector<std::string>& grad_dtypes, const Addrs& states, const Addrs& shadows,
                const std::vector<std::string>& shadow_dtypes, const std::vector<size_t>& numels,
                const std::vector<double>& steps, const std::vector<bool>& firsts, const Dtypes& param_dtypes,
                const std::string& rounding, const Keys& round_keys) {
  GroupArgs args(params, grads, grad_dtypes, shadows, shadow_dtypes, numels, opt.grad_mul);
  args.masters(param_dtypes, rounding, round_keys);
  check_range("predict", opt.predict, 0.0, INFINITY, true);
  const size_t count = args.size();
  const bool stateless = opt.kind == rp::OptimKind::Sgd && opt.momentum == 0.0;
  if (stateless && !states.empty())
    throw py::value_error(std::string(states_arg) + " must be empty when momentum=0, got " +
                          std::to_string(states.size()) + " entries");
  if (!stateless) check_len(states_arg, states.size(), count);
  if (opt.kind == rp::OptimKind::Adagrad) check_steps(steps, count);
  if (opt.kind == rp::OptimKind::Sgd) check_len("firsts", firsts.size(), count);
  check_range("lr", opt.lr, 0.0, INFINITY, true);
  check_range("weight_decay", opt.weight_decay, 0.0, INFINITY, true);
  std::vector<rp::OptimTensor> ts(count);
  for (size_t i = 0; i < count; ++i) {
    rp::OptimTensor& t = ts[i];
    args.fill(i, t);
    if (!stateless) t.state = args.f32(states_arg, i, states[i]);
    if (opt.kind == rp::OptimKind::Adagrad) t.step = steps[i];
    if (opt.kind == rp::OptimKind::Sgd) t.first = firsts[i];
  }
  args.check();
  py::gil_scoped_release release;
  rp::optim_step(ts.data(), ts.size(), opt);
}

}  // namespace

void bind_optimizers(py::module_& m) {
  m.def("sgd_step", [](const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes,
                       const Addrs& momentum_buffers, const Addrs& shadows, const std::vector<std::string>& shadow_dtypes,
                       const std::vector<size_t>& numels, const std::vector<bool>& firsts, double lr, double momentum,
                       double dampening, double weight_decay, bool nesterov, bool maximize, double grad_mul,
                       double predict, const Dtypes& param_dtypes, const std::string& rounding, const Keys& round_keys) {
    check_range("momentum", momentum, 0.0, INFINITY, true);
    if (!std::isfinite(dampening)) throw py::value_error("dampening=" + std::to_string(dampening) + " must be finite");
    if (nesterov && (momentum == 0.0 || dampening != 0.0))
      throw py::value_error("nesterov=True needs momentum > 0 and dampening=0, got momentum=" +
                            std::to_string(momentum) + ", dampening=" + std::to_string(dampening));
    rp::OptimOptions o;
    o.kind = rp::OptimKind::Sgd, o.lr = lr, o.momentum = momentum, o.dampening = dampening;
    o.weight_decay = weight_decay, o.nesterov = nesterov, o.maximize = maximize, o.grad_mul = grad_mul;
    o.predict = predict;
    optim_step(o, "momentum_buffers", params, grads, grad_dtypes, momentum_buffers, shadows, shadow_dtypes, numels,
               {}, firsts, param_dtypes, rounding, round_keys);
  }, py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"), py::arg("momentum_buffers"), py::arg("shadows"),
     py::arg("shadow_dtypes"), py::arg("numels"), py::arg("firsts"), py::kw_only(), py::arg("lr"),
     py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("maximize"),
     py::arg("grad_mul"), py::arg("predict") = 0.0, py::arg("param_dtypes") = Dtypes{}, py::arg("rounding") = "nearest",
     py::arg("round_keys") = Keys{},
     "One fused SGD step over a group of fp32 tensors given by address (per-tensor lists as adam_step; "
     "momentum_buffers empty when momentum=0; firsts[i]: the buffer is new and takes the gradient). "
     "Arithmetic equals torch.optim.SGD's.");
  m.def("adagrad_step", [](const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes,
                           const Addrs& sums, const Addrs& shadows, const std::vector<std::string>& shadow_dtypes,
                           const std::vector<size_t>& numels, const std::vector<double>& steps, double lr,
                           double lr_decay, double weight_decay, double eps, bool maximize, double grad_mul,
                           double predict, const Dtypes& param_dtypes, const std::string& rounding,
                           const Keys& round_keys) {
    check_range("lr_decay", lr_decay, 0.0, INFINITY, true);
    check_range("eps", eps, 0.0, INFINITY, true);
    rp::OptimOptions o;
    o.kind = rp::OptimKind::Adagrad, o.lr = lr, o.lr_decay = lr_decay, o.weight_decay = weight_decay, o.eps = eps;
    o.maximize = maximize, o.grad_mul = grad_mul, o.predict = predict;
    optim_step(o, "sums", params, grads, grad_dtypes, sums, shadows, shadow_dtypes, numels, steps, {}, param_dtypes,
               rounding, round_keys);
  }, py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"), py::arg("sums"), py::arg("shadows"),
     py::arg("shadow_dtypes"), py::arg("numels"), py::arg("steps"), py::kw_only(), py::arg("lr"), py::arg("lr_decay"),
     py::arg("weight_decay"), py::arg("eps"), py::arg("maximize"), py::arg("grad_mul"), py::arg("predict") = 0.0, py::arg("param_dtypes") = Dtypes{}, py::arg("rounding") = "nearest",
     py::arg("round_keys") = Keys{},
     "One fused Adagrad step over a group of fp32 tensors given by address (per-tensor lists as adam_step; "
     "steps: >= 1, after increment). Arithmetic equals torch.optim.Adagrad(fused=True)'s.");
  m.def("lion_step", [](const Addrs& params, const Addrs& grads, const std::vector<std::string>& grad_dtypes,
                        const Addrs& exp_avgs, const Addrs& shadows, const std::vector<std::string>& shadow_dtypes,
                        const std::vector<size_t>& numels, double lr, double beta1, double beta2, double weight_decay,
                        bool maximize, double grad_mul, double predict, const Dtypes& param_dtypes,
                        const std::string& rounding, const Keys& round_keys) {
    check_range("beta1", beta1, 0.0, 1.0, true);
    check_range("beta2", beta2, 0.0, 1.0, true);
    rp::OptimOptions o;
    o.kind = rp::OptimKind::Lion, o.lr = lr, o.beta1 = beta1, o.beta2 = beta2, o.weight_decay = weight_decay;
    o.maximize = maximize, o.grad_mul = grad_mul, o.predict = predict;
    optim_step(o, "exp_avgs", params, grads, grad_dtypes, exp_avgs, shadows, shadow_dtypes, numels, {}, {},
               param_dtypes, rounding, round_keys);
  }, py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"), py::arg("exp_avgs"), py::arg("shadows"),
     py::arg("shadow_dtypes"), py::arg("numels"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
     py::arg("weight_decay"), py::arg("maximize"), py::arg("grad_mul"), py::arg("predict") = 0.0, py::arg("param_dtypes") = Dtypes{}, py::arg("rounding") = "nearest",
     py::arg("round_keys") = Keys{},
     "One fused Lion step (Chen et al. 2023, decoupled weight decay) over a group of fp32 tensors given by "
     "address (per-tensor lists as adam_step).");
}

void bind_adam(py::module_& m) {
  m.def("adam_step", &adam_step, py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("shadows"), py::arg("shadow_dtypes"),
        py::arg("numels"), py::arg("steps"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"),
        py::arg("grad_mul"), py::arg("predict") = 0.0, py::arg("param_dtypes") = Dtypes{},
        py::arg("rounding") = "nearest", py::arg("round_keys") = Keys{},
        "One fused Adam/AdamW step over a group of fp32 tensors given by address: per-tensor lists of "
        "params (fp32, or bfloat16 masters named in param_dtypes: computed in fp32, rounded to nearest or "
        "stochastically with round_keys[i], one 64-bit key per tensor), grads (+ dtype), moments, max_exp_avg_sqs (amsgrad only, else empty), shadow copies "
        "(0 = none, + dtype), element counts and step numbers (>= 1, after increment). The gradient is "
        "multiplied by grad_mul (clip_coef / loss_scale). Arithmetic equals torch's fused CPU AdamW.");
  m.def("adam8bit_step", &adam8bit_step, py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"),
        py::arg("state1s"), py::arg("state2s"), py::arg("absmax1s"), py::arg("absmax2s"), py::arg("shadows"),
        py::arg("shadow_dtypes"), py::arg("numels"), py::arg("steps"), py::arg("tables"), py::kw_only(),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("decoupled"), py::arg("maximize"), py::arg("grad_mul"), py::arg("predict") = 0.0, py::arg("param_dtypes") = Dtypes{},
        py::arg("rounding") = "nearest", py::arg("round_keys") = Keys{},
        "One fused Adam/AdamW step over fp32 tensors with 8-bit blockwise moments (bitsandbytes 0.50's format), "
        "given by address: per-tensor lists as adam_step, with uint8 codes (state1s: m, state2s: v) and fp32 "
        "absmax per 256-element block; tables: code1, lut1, code2, lut2 (roundpipe/optim/blockwise.py). "
        "Arithmetic equals bitsandbytes' CPU AdamW8bit.");
  m.def("grad_sumsq", [](const Addrs& grads, const std::vector<std::string>& dtypes, const std::vector<size_t>& numels) {
    check_len("dtypes", dtypes.size(), grads.size());
    check_len("numels", numels.size(), grads.size());
    std::vector<rp::GradRef> refs(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      refs[i].dtype = parse_dtype(item("dtypes", i), dtypes[i]);
      elems(item("grads", i), grads[i], numels[i], refs[i].dtype);
      refs[i].data = ptr(grads[i]);
      refs[i].n = numels[i];
    }
    py::gil_scoped_release release;
    return rp::grad_sumsq(refs.data(), refs.size());
  }, py::arg("grads"), py::arg("dtypes"), py::arg("numels"),
     "Sum of squares (double) of all elements of the gradients given by address; inf/NaN iff any "
     "element is inf/NaN. Identical at every SIMD level for a given thread count.");
  m.def("accumulate", [](std::uintptr_t dst, std::uintptr_t src, const std::string& src_dtype, size_t n) {
    const rp::DType sd = parse_dtype("src_dtype", src_dtype);
    const size_t dst_bytes = elems("dst", dst, n, rp::DType::F32), src_bytes = elems("src", src, n, sd);
    if (n && !(dst == src && sd == rp::DType::F32) && dst < src + src_bytes && src < dst + dst_bytes)
      throw py::value_error("dst and src overlap in memory; accumulate needs separate buffers (or the same fp32 one)");
    py::gil_scoped_release release;
    rp::accumulate(static_cast<float*>(ptr(dst)), ptr(src), sd, n);
  }, py::arg("dst"), py::arg("src"), py::arg("src_dtype"), py::arg("n"),
     "dst (float32, n elements) += src converted to float32.");
}

}  // namespace rp::bind
