// roundpipe._C: Python bindings only.  Logic lives in the per-concept sources.
//
// Buffers cross as raw addresses (Python ints from tensor.data_ptr()) plus
// dtype names, so the build needs no torch headers; the Python wrappers in
// roundpipe/_native.py check devices, contiguity and sizes before calling here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "convert.h"
#include "copy_cuda.h"
#include "copy_engine.h"
#include "copy_host.h"
#include "cpu_features.h"
#include "cuda_loader.h"
#include "fence.h"
#include "host_arena.h"
#include "parallel.h"
#include "window_pack.h"

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

const char* state_name(rp::FenceState s) {
  return s == rp::FenceState::Done ? "done" : s == rp::FenceState::Failed ? "failed" : "pending";
}

void bind_fence(py::module_& m) {
  m.def("cuda_status", &rp::cuda::status,
        "Which CUDA library the arena and copy engine loaded, or why none (loads it on first call).");
  m.def("cuda_flavor", [] {
    const rp::cuda::Api* a = rp::cuda::api();
    return std::string(!a ? "none" : a->flavor == rp::cuda::Flavor::Runtime ? "runtime" : "driver");
  }, "'runtime', 'driver' (page-locking only) or 'none'.");
  py::class_<rp::Fence, std::shared_ptr<rp::Fence>>(m, "Fence", "Completion of asynchronous work.")
      .def("done", &rp::Fence::done, "True when complete; RuntimeError when the work failed.")
      .def("wait", &rp::Fence::wait, py::call_guard<py::gil_scoped_release>(),
           "Blocks (GIL released) until complete; RuntimeError when the work failed.")
      .def_property_readonly("state", [](rp::Fence& f) { return std::string(state_name(f.poll())); })
      .def_property_readonly("error", &rp::Fence::error)
      .def_property_readonly("kind", [](const rp::Fence& f) { return std::string(f.kind()); })
      .def_property_readonly("cuda_event", [](const rp::Fence& f) { return reinterpret_cast<std::uintptr_t>(f.cuda_event()); },
                             "Raw cudaEvent_t (0 for host fences).");
  py::class_<rp::HostFence, rp::Fence, std::shared_ptr<rp::HostFence>>(
      m, "HostFence", "A fence completed by a host thread: the host copy backend, or by hand (tests).")
      .def(py::init<bool>(), py::arg("set") = false)
      .def("set", &rp::HostFence::set)
      .def("fail", &rp::HostFence::fail, py::arg("message"))
      .def("wait_for", [](rp::HostFence& f, double seconds) {
        if (!(seconds >= 0)) throw py::value_error("seconds=" + std::to_string(seconds) + " must be >= 0");
        py::gil_scoped_release release;
        return f.block_for(seconds) != rp::FenceState::Pending;
      }, py::arg("seconds"), "Waits at most `seconds`; True when no longer pending.");
  py::class_<rp::CudaEventFence, rp::Fence, std::shared_ptr<rp::CudaEventFence>>(m, "CudaEventFence")
      .def_static("borrow", [](std::uintptr_t event) { return rp::CudaEventFence::borrow(reinterpret_cast<void*>(event)); },
                  py::arg("event"), "Wraps a raw cudaEvent_t; the caller keeps the event alive.")
      .def_static("record", [](std::uintptr_t stream, int device) {
        return rp::CudaEventFence::record(reinterpret_cast<void*>(stream), device);
      }, py::arg("stream"), py::arg("device"), "Records a new event (owned) on a raw cudaStream_t of `device`.")
      .def("make_stream_wait", [](const rp::CudaEventFence& f, std::uintptr_t stream) {
        f.make_stream_wait(reinterpret_cast<void*>(stream));
      }, py::arg("stream"), "Makes a raw cudaStream_t wait for this event on the GPU.");
}

rp::ArenaBackend parse_backend(const std::string& name) {
  if (name == "auto") return rp::ArenaBackend::Auto;
  if (name == "host") return rp::ArenaBackend::Host;
  if (name == "cuda") return rp::ArenaBackend::Cuda;
  throw py::value_error("backend='" + name + "' is unknown; expected 'auto', 'host' or 'cuda'");
}

void bind_arena(py::module_& m) {
  py::register_exception<rp::ArenaExhausted>(m, "ArenaExhaustedError", PyExc_MemoryError);
  py::class_<rp::ArenaBlock>(m, "ArenaBlock", py::buffer_protocol(),
                             "A block of a HostArena; returned to it when this object dies.")
      .def_buffer([](rp::ArenaBlock& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      })
      .def_property_readonly("address", [](const rp::ArenaBlock& b) { return reinterpret_cast<std::uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &rp::ArenaBlock::nbytes);
  py::class_<rp::HostArena, std::shared_ptr<rp::HostArena>>(m, "HostArena")
      .def(py::init([](size_t chunk_bytes, size_t alignment, size_t limit_bytes, const std::string& backend) {
        rp::ArenaOptions o;
        o.chunk_bytes = chunk_bytes;
        o.alignment = alignment;
        o.limit_bytes = limit_bytes;
        o.backend = parse_backend(backend);
        return std::make_shared<rp::HostArena>(o);
      }), py::arg("chunk_bytes"), py::arg("alignment"), py::arg("limit_bytes"), py::arg("backend"))
      .def("allocate", [](std::shared_ptr<rp::HostArena> self, size_t nbytes) {
        py::gil_scoped_release release;  // may page-lock a chunk or wait for fences
        return std::make_unique<rp::ArenaBlock>(std::move(self), nbytes);
      }, py::arg("nbytes"))
      .def("record", [](rp::HostArena& a, std::uintptr_t address, rp::FencePtr fence) {
        a.record(reinterpret_cast<void*>(address), std::move(fence));
      }, py::arg("address"), py::arg("fence"))
      .def("collect", &rp::HostArena::collect)
      .def("synchronize", &rp::HostArena::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &rp::HostArena::reserve, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("release_unused", &rp::HostArena::release_unused, py::call_guard<py::gil_scoped_release>())
      .def("block_of", [](const rp::HostArena& a, std::uintptr_t address) {
        return a.block_of(reinterpret_cast<void*>(address));
      }, py::arg("address"), "(start, size) of the live block holding `address`, or (0, 0).")
      .def_property_readonly("pinned", &rp::HostArena::pinned)
      .def_property_readonly("backend", &rp::HostArena::backend_name)
      .def("stats", [](const rp::HostArena& a) {
        const rp::ArenaStats s = a.stats();
        py::dict d;
        d["reserved_bytes"] = s.reserved_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["requested_bytes"] = s.requested_bytes;
        d["pending_bytes"] = s.pending_bytes;
        d["free_bytes"] = s.free_bytes;
        d["largest_free_block"] = s.largest_free_block;
        d["peak_in_use_bytes"] = s.peak_in_use_bytes;
        d["peak_reserved_bytes"] = s.peak_reserved_bytes;
        d["limit_bytes"] = s.limit_bytes;
        d["num_chunks"] = s.num_chunks;
        d["num_blocks"] = s.num_blocks;
        d["num_pending"] = s.num_pending;
        d["num_free_segments"] = s.num_free_segments;
        d["num_allocations"] = s.num_allocations;
        d["fragmentation"] = s.fragmentation;
        return d;
      });
}

std::vector<rp::CopyOp> parse_ops(const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, size_t>>& ops) {
  std::vector<rp::CopyOp> out;
  out.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& [dst, src, n] = ops[i];
    if (n && (!dst || !src)) throw py::value_error("ops[" + std::to_string(i) + "] has a null address for " + std::to_string(n) + " bytes");
    out.push_back(rp::CopyOp{reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n});
  }
  return out;
}

void bind_copy_engine(py::module_& m) {
  py::enum_<rp::CopyQueue>(m, "CopyQueue")
      .value("act_up", rp::CopyQueue::ActUp)
      .value("act_down", rp::CopyQueue::ActDown)
      .value("param_up", rp::CopyQueue::ParamUp)
      .value("grad_down", rp::CopyQueue::GradDown);
  m.def("pack_lpt", [](const std::vector<size_t>& sizes, size_t windows, size_t align) {
    std::vector<std::vector<std::tuple<size_t, size_t, size_t>>> out;
    for (const auto& win : rp::pack_lpt(sizes, windows, align)) {
      out.emplace_back();
      for (const rp::Piece& p : win) out.back().emplace_back(p.tensor, p.offset, p.length);
    }
    return out;
  }, py::arg("sizes"), py::arg("windows"), py::arg("align"),
     "LPT packing of byte sizes into windows: per window, (tensor, offset, length) pieces.");
  using Ops = std::vector<std::tuple<std::uintptr_t, std::uintptr_t, size_t>>;
  py::class_<rp::CopyEngine>(m, "CopyEngine")
      .def("submit", [](rp::CopyEngine& e, rp::CopyQueue q, const Ops& ops, std::vector<rp::FencePtr> after, int64_t tag) {
        auto parsed = parse_ops(ops);
        py::gil_scoped_release release;  // the CUDA backend may wait for host fences
        return e.submit(q, std::move(parsed), std::move(after), tag);
      }, py::arg("queue"), py::arg("ops"), py::arg("after"), py::arg("tag") = -1,
         "Queues (dst, src, nbytes) copies behind the fences in `after`; returns a Fence.")
      .def("submit_windows", [](rp::CopyEngine& e, rp::CopyQueue q, const Ops& ops,
                                std::vector<rp::FencePtr> window_after, size_t align, int64_t tag) {
        auto parsed = parse_ops(ops);
        py::gil_scoped_release release;
        return e.submit_windows(q, parsed, window_after, align, tag);
      }, py::arg("queue"), py::arg("ops"), py::arg("window_after"), py::arg("align"), py::arg("tag") = -1,
         "LPT-packs the copies into len(window_after) windows, window w behind window_after[w] (None: none).")
      .def("synchronize", &rp::CopyEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("backend", &rp::CopyEngine::backend);
  py::class_<rp::HostCopyEngine, rp::CopyEngine>(m, "HostCopyEngine")
      .def(py::init<int>(), py::arg("threads_per_copy") = 1)
      .def("pause", &rp::HostCopyEngine::pause)
      .def("resume", &rp::HostCopyEngine::resume)
      .def("history", [](const rp::HostCopyEngine& e) {
        std::vector<std::pair<std::string, int64_t>> out;
        for (const auto& [q, tag] : e.history()) out.emplace_back(rp::queue_name(q), tag);
        return out;
      }, "(queue name, tag) of started submissions, oldest first.");
  py::class_<rp::CudaCopyEngine, rp::CopyEngine>(m, "CudaCopyEngine")
      .def(py::init([](int device, const std::vector<std::uintptr_t>& streams) {
        std::vector<void*> raw;
        for (auto s : streams) raw.push_back(reinterpret_cast<void*>(s));
        return std::make_unique<rp::CudaCopyEngine>(device, raw);
      }), py::arg("device"), py::arg("streams") = std::vector<std::uintptr_t>{})
      .def_property_readonly("device", &rp::CudaCopyEngine::device)
      .def("stream", [](const rp::CudaCopyEngine& e, rp::CopyQueue q) { return reinterpret_cast<std::uintptr_t>(e.stream(q)); },
           py::arg("queue"), "Raw cudaStream_t of a queue (wrap with torch.cuda.ExternalStream).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "roundpipe native core";
  rp::simd_level();  // resolve ROUNDPIPE_SIMD now: a bad value fails the import, not a later call
  bind_cpu(m);
  bind_convert(m);
  bind_fence(m);
  bind_arena(m);
  bind_copy_engine(m);
}
