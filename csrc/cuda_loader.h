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
#pragma once

#include <cstddef>
#include <string>

namespace rp::cuda {

using Stream = void*;
using Event = void*;

constexpr int kSuccess = 0;
constexpr int kNotReady = 600;  // cudaErrorNotReady and CUDA_ERROR_NOT_READY share the value

enum class Flavor { None, Runtime, Driver };

class Api {
 public:
  Flavor flavor = Flavor::None;
  std::string library;  // path or soname that was loaded
  int device_count = 0;

  // Page-locked host memory, portable across devices (either flavor).
  void* host_alloc(size_t nbytes) const;
  void host_free(void* p) const;
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
  int (*drv_ctx_push)(void*) = nullptr;
  int (*drv_ctx_pop)(void**) = nullptr;
  void* drv_primary_ctx = nullptr;
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

// Sets the calling thread's current device for the lifetime of the guard.
class DeviceGuard {
 public:
  DeviceGuard(const Api& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const Api& api_;
  int previous_ = -1;
};

}  // namespace rp::cuda
