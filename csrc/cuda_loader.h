// The CUDA runtime (or, for page-locking only, the driver) loaded at run time.
//
// roundpipe builds without a CUDA toolkit and imports on machines without a GPU,
// so nothing here links against CUDA: the first call to `cuda::api()` dlopens
// libcudart (the copy the process already has, e.g. the one torch loaded, is
// found by its soname first) and resolves the handful of entry points the arena
// and the copy engine use.  When no runtime is found it falls back to the
// driver, libcuda.so.1, which is enough to page-lock memory and query events
// but not to issue copies.  The reason for a failure is kept for error messages.
//
// Handles are the raw CUDA types as opaque pointers: a cudaStream_t from
// torch.cuda.Stream.cuda_stream or a cudaEvent_t from torch.cuda.Event.cuda_event
// can be passed straight in.
//
// Contexts: a runtime call that needs a context on a thread with none current
// creates the primary context of the thread's device, device 0 unless set, and
// since CUDA 12 cudaSetDevice itself creates the context of the device it sets,
// so a guard that restores "device 0" on a fresh thread creates GPU 0's context
// too.  Work on a given device therefore pushes that device's primary context
// (retained once through the driver, which the runtime has loaded) and pops it
// after: the thread's own context, or its having none, is restored exactly and
// no other device is touched (DeviceGuard, Api::host_alloc).
//
// FakeCuda is a stand-in for tests on machines without a GPU (see below).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace rp::cuda {

using Stream = void*;
using Event = void*;

constexpr int kSuccess = 0;
constexpr int kNotReady = 600;  // cudaErrorNotReady and CUDA_ERROR_NOT_READY share the value
// Events the host waits on (cudaEventSynchronize): cudaEventBlockingSync (1) makes the waiting
// thread sleep instead of spinning a core, which the OpenMP optimizer step needs;
// cudaEventDisableTiming (2) makes record and query cheaper.
constexpr unsigned kHostWaitedEventFlags = 1u | 2u;

enum class Flavor { None, Runtime, Driver };

struct PrimaryContexts;  // per-device primary contexts, retained on first use

class Api {
 public:
  Flavor flavor = Flavor::None;
  std::string library;  // path or soname that was loaded
  int device_count = 0;

  // Page-locked host memory, portable across devices (either flavor), with `device`'s
  // primary context current for the call (-1: the calling thread's own context; under
  // the driver flavor, device 0's).  Frees take the device the memory was locked with.
  void* host_alloc(size_t nbytes, int device) const;
  void host_free(void* p, int device) const;
  // `device`'s primary context (retained on first use); std::invalid_argument naming an
  // out-of-range device.  nullptr when the driver entry points are missing.
  void* primary_context(int device) const;
  // 0 = complete, kNotReady = pending, anything else = an error code.
  int event_query(Event e) const;
  int event_synchronize(Event e) const;
  std::string error_string(int code) const;
  // Throws std::runtime_error naming `what` when `code` is not success.
  void check(int code, const char* what) const;

  // Runtime only (nullptr under the driver flavor).
  int (*cudaSetDevice)(int) = nullptr;
  int (*cudaGetDevice)(int*) = nullptr;
  int (*cudaEventCreateWithFlags)(Event*, unsigned) = nullptr;
  int (*cudaEventDestroy)(Event) = nullptr;
  int (*cudaEventRecord)(Event, Stream) = nullptr;
  int (*cudaStreamCreateWithPriority)(Stream*, unsigned, int) = nullptr;
  int (*cudaStreamDestroy)(Stream) = nullptr;
  int (*cudaStreamSynchronize)(Stream) = nullptr;
  int (*cudaStreamWaitEvent)(Stream, Event, unsigned) = nullptr;
  int (*cudaDeviceGetStreamPriorityRange)(int*, int*) = nullptr;
  int (*cudaMemcpyAsync)(void*, const void*, size_t, int, Stream) = nullptr;

  // Resolved internally; callers use the member functions above.
  int (*rt_host_alloc)(void**, size_t, unsigned) = nullptr;
  int (*rt_free_host)(void*) = nullptr;
  int (*rt_event_query)(Event) = nullptr;
  int (*rt_event_sync)(Event) = nullptr;
  const char* (*rt_error_string)(int) = nullptr;
  int (*drv_mem_host_alloc)(void**, size_t, unsigned) = nullptr;
  int (*drv_mem_free_host)(void*) = nullptr;
  int (*drv_event_query)(Event) = nullptr;
  int (*drv_event_sync)(Event) = nullptr;
  int (*drv_error_string)(int, const char**) = nullptr;
  // Driver entry points for contexts, under either flavor (a runtime loads the driver).
  int (*drv_device_get)(int*, int) = nullptr;
  int (*drv_primary_retain)(void**, int) = nullptr;
  int (*drv_ctx_push)(void*) = nullptr;
  int (*drv_ctx_pop)(void**) = nullptr;
  std::shared_ptr<PrimaryContexts> contexts;
};

// The loaded API, or nullptr when neither a runtime nor a driver with a device
// is present.  Loaded once, thread-safe.  ROUNDPIPE_CUDART names a runtime
// library to try first.
const Api* api();
// "runtime libcudart.so.12 (2 devices)", "driver libcuda.so.1 (1 device)" or
// the reason nothing loaded.
std::string status();
// api() with the runtime flavor, or std::runtime_error naming `what` and status().
const Api& require_runtime(const char* what);

// Makes `device` current on the calling thread for the lifetime of the guard: its primary
// context pushed, popped at the end (the thread's previous context, or none, is back exactly).
// Without the driver's context entry points: cudaSetDevice, the previous device set back.
class DeviceGuard {
 public:
  DeviceGuard(const Api& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const Api& api_;
  bool pushed_ = false;
  int previous_ = -1;
};

// A stand-in CUDA runtime for tests without a GPU.  Its api() models what the arena and the
// fences depend on: a context stack and a current device per thread (device 0 until set),
// primary contexts created on first use (a context-needing call with no context current creates
// the current device's; cudaSetDevice and cuDevicePrimaryCtxRetain create the device's, as since
// CUDA 12), page-locking served by malloc, events that are always complete.  Each call records
// the device whose context served it.  The entry points are plain functions, so they reach the
// live FakeCuda, the one constructed last (a test that failed holding one does not block the next).
class FakeCuda {
 public:
  static constexpr int kMaxDevices = 64;
  explicit FakeCuda(int device_count);
  ~FakeCuda();
  FakeCuda(const FakeCuda&) = delete;
  FakeCuda& operator=(const FakeCuda&) = delete;

  const Api& api() const { return api_; }
  std::vector<int> contexts_created() const;                  // devices, in creation order
  std::vector<std::pair<std::string, int>> calls() const;     // (entry point, its context's device)
  std::vector<unsigned> event_flags() const;                  // flags of every event created
  int thread_device() const;                                  // cudaGetDevice on the calling thread
  size_t thread_context_depth() const;                        // contexts pushed on the calling thread

  // The model, used by the entry points (cuda_loader.cpp).
  struct Thread {
    std::vector<int> stack;  // devices of the pushed contexts, top last
    int device = 0;          // the runtime's device when no context is current
  };
  static FakeCuda& live();
  Thread& thread_locked();
  int context_device_locked(const char* call);  // the current context's device, created if none
  void create_locked(int device);
  mutable std::mutex mu;
  std::map<std::thread::id, Thread> threads;
  std::vector<int> created;
  std::vector<std::pair<std::string, int>> log;
  std::vector<unsigned> flags;

 private:
  Api api_;
};

}  // namespace rp::cuda
