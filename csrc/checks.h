// Argument checks shared by the bindings and the per-concept sources.
//
// Every check throws std::invalid_argument (pybind11 turns it into ValueError)
// with the argument's name, its value and the constraint.  Sizes are checked
// with overflow-free arithmetic: a size_t that wraps would otherwise turn a
// huge request into a tiny one (HostArena.reserve(2**64-4095) used to reserve
// 0 bytes and succeed) or a division by zero (pack_lpt([2**64-1], 1) died of
// SIGFPE).  No buffer can be larger than PTRDIFF_MAX bytes, so byte counts
// above that are rejected up front; then sums of a few of them, and roundings
// up to an alignment of at most that, cannot wrap.
//
// Buffers cross the binding as raw addresses: what can be checked is null,
// alignment, size arithmetic and overlap.  That n elements really lie at the
// address is the caller's contract (the Python wrappers derive both from one
// tensor).
//
// Baseline translation units only: these inline functions have external
// linkage, so a copy compiled with SIMD flags could be picked by the linker
// for baseline code (docs/architecture.md, "Native build").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace rp::check {

// Largest size in bytes of any object (and of any sum of sizes we accept).
constexpr size_t kMaxBytes = static_cast<size_t>(std::numeric_limits<std::ptrdiff_t>::max());
// Most threads one call may ask for: beyond this the thread pool's creation
// can fail, and libgomp then ends the process instead of reporting an error.
constexpr int kMaxThreads = 256;

inline std::string hex(std::uintptr_t a) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  do {
    s.insert(s.begin(), digits[a & 15]);
    a >>= 4;
  } while (a);
  return "0x" + s;
}

// A double for an error message, "%g" style: "inf", "nan", "-1", "1e+300".
inline std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// a * b, or invalid_argument naming `what` when the product exceeds kMaxBytes.
inline size_t mul(const std::string& what, size_t a, size_t b) {
  if (a && b > kMaxBytes / a)
    throw std::invalid_argument(what + "=" + std::to_string(a) + " x " + std::to_string(b) +
                                " bytes is more than the largest possible buffer (" + std::to_string(kMaxBytes) +
                                " bytes)");
  return a * b;
}

// total + n, or invalid_argument naming `what` when the sum exceeds kMaxBytes.
inline size_t add(const std::string& what, size_t total, size_t n) {
  if (n > kMaxBytes || total > kMaxBytes - n)
    throw std::invalid_argument(what + " add up to more than " + std::to_string(kMaxBytes) +
                                " (the largest possible buffer): " + std::to_string(total) + " + " +
                                std::to_string(n));
  return total + n;
}

// n <= limit, or invalid_argument "arg=n must be at most limit".
inline void at_most(const std::string& arg, size_t n, size_t limit, const std::string& why = "") {
  if (n > limit)
    throw std::invalid_argument(arg + "=" + std::to_string(n) + " must be at most " + std::to_string(limit) +
                                (why.empty() ? "" : " (" + why + ")"));
}

inline void threads(const std::string& arg, long long n) {
  if (n < 1 || n > kMaxThreads)
    throw std::invalid_argument(arg + "=" + std::to_string(n) + " must be in [1, " + std::to_string(kMaxThreads) +
                                "]");
}

// The byte size of n elements of `elem` bytes at `addr`, after checking that
// the address is not null (unless n is 0), is a multiple of `align`, and that
// the byte count neither overflows nor runs past the end of the address space.
inline size_t span(const std::string& arg, std::uintptr_t addr, size_t n, size_t elem, size_t align) {
  if (addr == 0 && n != 0) throw std::invalid_argument(arg + " is a null pointer but n=" + std::to_string(n));
  if (align > 1 && addr % align != 0)
    throw std::invalid_argument(arg + "=" + hex(addr) + " is not aligned to its element size (" +
                                std::to_string(align) + " bytes)");
  const size_t bytes = mul(arg + ": n", n, elem);
  if (addr > std::numeric_limits<std::uintptr_t>::max() - bytes)
    throw std::invalid_argument(arg + "=" + hex(addr) + " + " + std::to_string(bytes) +
                                " bytes runs past the end of the address space");
  return bytes;
}

// Byte ranges a call reads (inputs) and writes (outputs).  An output that
// overlaps another output or an input would make the result depend on the
// order of the sweep (or, for memcpy, be undefined), so it is rejected;
// inputs may share memory with each other.
class OverlapCheck {
 public:
  void add(std::string label, std::uintptr_t addr, size_t bytes, bool output) {
    if (bytes) spans_.push_back({addr, addr + bytes, std::move(label), output});
  }
  void check(const std::string& hint) const {
    std::vector<const Span*> order;
    for (const Span& s : spans_) order.push_back(&s);
    std::sort(order.begin(), order.end(), [](const Span* a, const Span* b) { return a->begin < b->begin; });
    const Span* out = nullptr;  // output reaching furthest so far
    const Span* in = nullptr;   // input reaching furthest so far
    for (const Span* s : order) {
      if (out && out->end > s->begin) fail(*out, *s, hint);
      if (s->output && in && in->end > s->begin) fail(*in, *s, hint);
      const Span*& slot = s->output ? out : in;
      if (!slot || s->end > slot->end) slot = s;
    }
  }

 private:
  struct Span {
    std::uintptr_t begin, end;
    std::string label;
    bool output;
  };
  [[noreturn]] static void fail(const Span& a, const Span& b, const std::string& hint) {
    throw std::invalid_argument(b.label + " overlaps " + a.label + " in memory; " + hint);
  }
  std::vector<Span> spans_;
};

}  // namespace rp::check
