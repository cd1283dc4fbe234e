// roundpipe._C: Python bindings only.  Logic lives in the per-concept sources.
//
// Buffers cross as raw addresses (Python ints from tensor.data_ptr()) plus
// dtype names, so the build needs no torch headers; the Python wrappers check
// devices, dtypes, contiguity and sizes before calling here, and every entry
// point checks again what an address-level call can check (checks.h): names,
// counts, null pointers, element alignment, size overflow, overlap.  A bad
// argument is a ValueError or TypeError, never a crash.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "adam.h"
#include "adam8bit.h"
#include "checks.h"
#include "convert.h"
#include "copy_cuda.h"
#include "copy_engine.h"
#include "copy_host.h"
#include "cpu_features.h"
#include "cuda_loader.h"
#include "fence.h"
#include "grad_ops.h"
#include "host_arena.h"
#include "nvme_io.h"
#include "optimizers.h"
#include "parallel.h"
#include "window_pack.h"
#include "bindings_common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using rp::bind::elems;
using rp::bind::item;
using rp::bind::parse_dtype;
using rp::bind::ptr;

namespace {


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
    rp::check::threads("n", n);
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
    rp::check::OverlapCheck overlaps;
    overlaps.add("src", src, elems("src", src, n, sd), false);
    if (!(src == dst && sd == dd)) overlaps.add("dst", dst, elems("dst", dst, n, dd), true);
    overlaps.check("the conversion needs separate buffers (or the same one with the same dtype)");
    py::gil_scoped_release release;
    rp::convert(ptr(src), sd, ptr(dst), dd, n);
  }, py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"),
     "Convert n elements between float32/bfloat16/float16 buffers given by address "
     "(round-to-nearest-even).");
}

// Copies every (dsts[k] <- srcs[k], nbytes[k]) in one parallel pass over all their bytes: a stage's
// tensors copied inline one torch copy_ at a time each woke the OpenMP team (~28 us per tensor).
void bind_copy_many(py::module_& m) {
  m.def("copy_many", [](const std::vector<std::uintptr_t>& dsts, const std::vector<std::uintptr_t>& srcs,
                        const std::vector<size_t>& nbytes) {
    if (dsts.size() != srcs.size() || dsts.size() != nbytes.size())
      throw py::value_error("copy_many: dsts, srcs and nbytes must have the same length, got " +
                            std::to_string(dsts.size()) + ", " + std::to_string(srcs.size()) + " and " +
                            std::to_string(nbytes.size()));
    rp::check::OverlapCheck overlaps;
    std::vector<size_t> offsets(nbytes.size() + 1, 0);
    for (size_t k = 0; k < nbytes.size(); ++k) {
      overlaps.add(item("srcs", k), srcs[k], rp::check::span(item("srcs", k), srcs[k], nbytes[k], 1, 1), false);
      overlaps.add(item("dsts", k), dsts[k], rp::check::span(item("dsts", k), dsts[k], nbytes[k], 1, 1), true);
      offsets[k + 1] = rp::check::add("nbytes", offsets[k], nbytes[k]);
    }
    overlaps.check("copy_many needs separate source and destination buffers");
    py::gil_scoped_release release;
    rp::parallel_ranges(offsets.back(), 64, size_t{256} << 10, [&](size_t begin, size_t end) {
      size_t k = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
      while (begin < end) {
        const size_t stop = std::min(end, offsets[k + 1]), at = begin - offsets[k];
        std::memcpy(static_cast<char*>(ptr(dsts[k])) + at, static_cast<const char*>(ptr(srcs[k])) + at, stop - begin);
        begin = stop;
        ++k;
      }
    });
  }, py::arg("dsts"), py::arg("srcs"), py::arg("nbytes"),
     "Copy nbytes[k] bytes from srcs[k] to dsts[k] for every k (addresses), in one parallel pass.");
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
  m.attr("HOST_WAITED_EVENT_FLAGS") = rp::cuda::kHostWaitedEventFlags;
  py::class_<rp::cuda::FakeCuda>(m, "FakeCuda",
                                 "Tests only: a stand-in CUDA runtime recording contexts, calls and event flags "
                                 "(csrc/cuda_loader.h); the one constructed last is live.")
      .def(py::init<int>(), py::arg("device_count"))
      .def_property_readonly("contexts_created", &rp::cuda::FakeCuda::contexts_created,
                             "Devices whose primary context was created, in order.")
      .def_property_readonly("calls", &rp::cuda::FakeCuda::calls, "(entry point, device of its context) per call.")
      .def_property_readonly("event_flags", &rp::cuda::FakeCuda::event_flags, "Flags of every event created.")
      .def("thread_device", &rp::cuda::FakeCuda::thread_device, "cudaGetDevice on the calling thread.")
      .def("thread_context_depth", &rp::cuda::FakeCuda::thread_context_depth,
           "Contexts current (pushed) on the calling thread.")
      .def("set_device", [](rp::cuda::FakeCuda& f, int device) {
        f.api().check(f.api().cudaSetDevice(device), "cudaSetDevice");
      }, py::arg("device"), "cudaSetDevice on the calling thread.");
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
        py::gil_scoped_release release;
        return f.block_for(seconds) != rp::FenceState::Pending;
      }, py::arg("seconds"), "Waits at most `seconds` (0 to 1e9); True when no longer pending.");
  py::class_<rp::CudaEventFence, rp::Fence, std::shared_ptr<rp::CudaEventFence>>(m, "CudaEventFence")
      .def_static("borrow", [](std::uintptr_t event) { return rp::CudaEventFence::borrow(reinterpret_cast<void*>(event)); },
                  py::arg("event"), "Wraps a raw cudaEvent_t; the caller keeps the event alive.")
      // `cuda` is checked here and kept alive by hand: with keep_alive<0, 3>, a wrong argument
      // (device=NaN, cuda=1.5) crashed pybind11's overload-failure path (found by the fuzzer).
      .def_static("record", [](std::uintptr_t stream, int device, const py::object& cuda) -> py::object {
        const rp::cuda::FakeCuda* fake = nullptr;
        if (!cuda.is_none()) {
          if (!py::isinstance<rp::cuda::FakeCuda>(cuda))
            throw py::type_error("cuda must be a FakeCuda or None, got " +
                                 std::string(py::str(py::type::of(cuda).attr("__name__"))));
          fake = cuda.cast<const rp::cuda::FakeCuda*>();
        }
        py::object fence = py::cast(
            rp::CudaEventFence::record(reinterpret_cast<void*>(stream), device, fake ? &fake->api() : nullptr));
        if (fake != nullptr) py::detail::keep_alive_impl(fence, cuda);   // the fake outlives its event
        return fence;
      }, py::arg("stream"), py::arg("device"), py::arg("cuda") = py::none(),
         "Records a pooled event (owned; back to the pool when the fence dies) on a raw cudaStream_t of `device`; "
         "`cuda`: a FakeCuda to use instead of the loaded runtime (tests).")
      .def_static("pool_stats", &rp::CudaEventFence::pool_stats,
                  "(events created, records served by a pooled event) since start.")
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

// StorageError(errno, what, path): an OSError subclass, so `.errno`, `.strerror` and `.filename` work.
PyObject* storage_error = nullptr;

void translate_io_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const rp::IoError& e) {
    const py::tuple args = py::make_tuple(e.code(), std::string(e.what()), e.path());
    PyErr_SetObject(storage_error, args.ptr());
  }
}

rp::DirectMode parse_direct(const std::string& name) {
  if (name == "auto") return rp::DirectMode::Auto;
  if (name == "on") return rp::DirectMode::On;
  if (name == "off") return rp::DirectMode::Off;
  throw py::value_error("direct='" + name + "' is unknown; expected 'auto', 'on' or 'off'");
}

rp::IoBackend parse_io_backend(const std::string& name) {
  if (name == "auto") return rp::IoBackend::Auto;
  if (name == "io_uring") return rp::IoBackend::Uring;
  if (name == "threads") return rp::IoBackend::Threads;
  throw py::value_error("backend='" + name + "' is unknown; expected 'auto', 'io_uring' or 'threads'");
}

rp::IoKind parse_kind(const std::string& name) {
  if (name == "read") return rp::IoKind::Read;
  if (name == "write") return rp::IoKind::Write;
  throw py::value_error("kind='" + name + "' is unknown; expected 'read' or 'write'");
}

void bind_nvme(py::module_& m) {
  py::exception<rp::IoError> error(m, "StorageError", PyExc_OSError);
  error.doc() = "A file store's I/O failed: errno, what was done at which offset of which region, and the file.";
  storage_error = error.inc_ref().ptr();  // lives as long as the process
  py::register_exception_translator(&translate_io_error);
  py::class_<rp::IoFence, rp::Fence, std::shared_ptr<rp::IoFence>>(
      m, "IoFence", "Completion of one FileStore read or write; a Fence (the arena can defer reuse behind it).")
      .def("wait", &rp::IoFence::wait_io, py::call_guard<py::gil_scoped_release>(),
           "Blocks (GIL released) until complete; StorageError when the I/O failed.")
      .def("done", &rp::IoFence::done_io, "True when complete; StorageError when the I/O failed.");
  py::class_<rp::FileStore>(m, "FileStore",
                            "Regions in preallocated files under a directory, read and written by an io_uring "
                            "or a pool of I/O threads (O_DIRECT where the file system takes it); csrc/nvme_io.h.")
      .def(py::init([](const std::string& directory, int threads, size_t chunk_bytes, const std::string& direct,
                       double delay_s, bool simulate_no_direct, const std::string& backend, bool simulate_no_uring) {
        rp::FileStoreOptions o;
        o.threads = threads;
        o.chunk_bytes = chunk_bytes;
        o.direct = parse_direct(direct);
        o.delay_s = delay_s;
        o.simulate_no_direct = simulate_no_direct;
        o.backend = parse_io_backend(backend);
        o.simulate_no_uring = simulate_no_uring;
        return std::make_unique<rp::FileStore>(directory, o);
      }), py::arg("directory"), py::arg("threads") = 4, py::arg("chunk_bytes") = size_t{8} << 20,
         py::arg("direct") = "auto", py::arg("delay_s") = 0.0, py::arg("simulate_no_direct") = false,
         py::arg("backend") = "auto", py::arg("simulate_no_uring") = false,
         "threads: chunks in flight (I/O threads, or the ring's depth). direct: 'auto' (O_DIRECT when the file "
         "system takes it, else buffered), 'on' (error without it), 'off'. backend: 'auto' (io_uring when "
         "io_uring_setup succeeds, else threads), 'io_uring' (error without it), 'threads'. delay_s (every chunk "
         "sleeps first), simulate_no_direct and simulate_no_uring are test hooks.")
      .def("allocate", &rp::FileStore::allocate, py::arg("name"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(),
           "Creates and preallocates the file of a new region of nbytes; returns the region's index.")
      .def("read", [](rp::FileStore& s, size_t region, size_t offset, std::uintptr_t buffer, size_t nbytes) {
        return s.submit(rp::IoKind::Read, region, offset, ptr(buffer), nbytes);
      }, py::arg("region"), py::arg("offset"), py::arg("buffer"), py::arg("nbytes"),
         "Queues a read of nbytes at offset (a multiple of 4096) of `region` into the 4096-aligned buffer at "
         "address `buffer`; returns its IoFence.  The buffer must stay alive until the fence completes.")
      .def("write", [](rp::FileStore& s, size_t region, size_t offset, std::uintptr_t buffer, size_t nbytes) {
        return s.submit(rp::IoKind::Write, region, offset, ptr(buffer), nbytes);
      }, py::arg("region"), py::arg("offset"), py::arg("buffer"), py::arg("nbytes"),
         "Queues a write of nbytes from the 4096-aligned buffer at address `buffer` to offset of `region`, "
         "ending on a multiple of 4096 or at the region's end; returns its IoFence.")
      .def("synchronize", &rp::FileStore::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Blocks until everything submitted has completed (failures stay with their fences).")
      .def("close", &rp::FileStore::close, py::call_guard<py::gil_scoped_release>(),
           "Waits for all I/O, stops the threads, closes the files (they stay on disk).")
      .def("inject_fault", [](rp::FileStore& s, const std::string& kind, int code, int count) {
        s.inject_fault(parse_kind(kind), code, count);
      }, py::arg("kind"), py::arg("code"), py::arg("count") = 1,
         "Test hook: the next `count` chunks of kind 'read' or 'write' fail with errno `code`.")
      .def("region_path", &rp::FileStore::region_path, py::arg("region"))
      .def("region_bytes", &rp::FileStore::region_bytes, py::arg("region"))
      .def_property_readonly("num_regions", &rp::FileStore::num_regions)
      .def_property_readonly("direct", &rp::FileStore::direct, "Whether the files are opened with O_DIRECT.")
      .def_property_readonly("direct_reason", &rp::FileStore::direct_reason,
                             "'O_DIRECT', or why the store fell back to buffered I/O.")
      .def_property_readonly("backend", [](const rp::FileStore& s) {
        return s.backend() == rp::IoBackend::Uring ? "io_uring" : "threads";
      }, "'io_uring' or 'threads': what moves the chunks.")
      .def_property_readonly("backend_reason", &rp::FileStore::backend_reason,
                             "Why that backend: 'io_uring_setup succeeded', \"backend='threads'\", or why io_uring "
                             "could not be used.")
      .def_property_readonly("directory", &rp::FileStore::directory)
      .def_property_readonly("threads", [](const rp::FileStore& s) { return s.options().threads; })
      .def_property_readonly("chunk_bytes", [](const rp::FileStore& s) { return s.options().chunk_bytes; })
      .def_property_readonly("closed", &rp::FileStore::closed);
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
      .def(py::init([](size_t chunk_bytes, size_t alignment, size_t limit_bytes, const std::string& backend,
                       int home_device, double system_delay_s, const rp::cuda::FakeCuda* cuda) {
        rp::ArenaOptions o;
        o.chunk_bytes = chunk_bytes;
        o.alignment = alignment;
        o.limit_bytes = limit_bytes;
        o.backend = parse_backend(backend);
        o.home_device = home_device;
        o.system_delay_s = system_delay_s;
        return std::make_shared<rp::HostArena>(o, cuda ? &cuda->api() : nullptr);
      }), py::arg("chunk_bytes"), py::arg("alignment"), py::arg("limit_bytes"), py::arg("backend"),
         py::arg("home_device") = -1, py::arg("system_delay_s") = 0.0, py::arg("cuda") = nullptr,
         py::keep_alive<1, 8>(),
         "home_device: the GPU whose context page-locks chunks (-1: the allocating thread's); system_delay_s and "
         "cuda (a FakeCuda) are test hooks.")
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

// py::enum_ also builds values outside the enum (CopyQueue(7)); one would index
// past the four queues.
rp::CopyQueue checked(rp::CopyQueue q) {
  const int v = static_cast<int>(q);
  if (v < 0 || v >= rp::kNumQueues)
    throw py::value_error("queue=" + std::to_string(v) +
                          " is not a copy queue; expected act_up, act_down, param_up or grad_down");
  return q;
}

// (dst, src, nbytes) triples; a copy whose source and destination overlap is
// undefined for memcpy and cudaMemcpyAsync alike, so it is rejected.
std::vector<rp::CopyOp> parse_ops(const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, size_t>>& ops) {
  std::vector<rp::CopyOp> out;
  out.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& [dst, src, n] = ops[i];
    const std::string op = item("ops", i);
    rp::check::OverlapCheck overlaps;
    overlaps.add(op + ".dst", dst, rp::check::span(op + ".dst", dst, n, 1, 1), true);
    overlaps.add(op + ".src", src, rp::check::span(op + ".src", src, n, 1, 1), false);
    overlaps.check("a copy needs separate source and destination bytes");
    out.push_back(rp::CopyOp{ptr(dst), reinterpret_cast<const void*>(src), n});
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
        checked(q);
        auto parsed = parse_ops(ops);
        py::gil_scoped_release release;  // the CUDA backend may wait for host fences
        return e.submit(q, std::move(parsed), std::move(after), tag);
      }, py::arg("queue"), py::arg("ops"), py::arg("after"), py::arg("tag") = -1,
         "Queues (dst, src, nbytes) copies behind the fences in `after`; returns a Fence.")
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
      .def("stream", [](const rp::CudaCopyEngine& e, rp::CopyQueue q) {
        return reinterpret_cast<std::uintptr_t>(e.stream(checked(q)));
      }, py::arg("queue"), "Raw cudaStream_t of a queue (wrap with torch.cuda.ExternalStream).");
}

}  // namespace

namespace rp::bind {
void bind_adam(py::module_& m);
void bind_optimizers(py::module_& m);
}  // namespace rp::bind

PYBIND11_MODULE(_C, m) {
  m.doc() = "roundpipe native core";
  rp::simd_level();  // resolve ROUNDPIPE_SIMD now: a bad value fails the import, not a later call
  bind_cpu(m);
  bind_convert(m);
  bind_copy_many(m);
  bind_fence(m);
  bind_arena(m);
  bind_nvme(m);
  bind_copy_engine(m);
  rp::bind::bind_adam(m);
  rp::bind::bind_optimizers(m);
}
