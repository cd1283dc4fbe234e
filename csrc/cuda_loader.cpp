#include "cuda_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace rp::cuda {
namespace {

constexpr unsigned kHostAllocPortable = 1;  // cudaHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE

struct Loaded {
  Api api;
  std::string status;
  bool ok = false;
};

template <class F>
bool resolve(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

// Newest first: a process that already holds one of these (torch does) gets
// that one back from dlopen without a second copy being loaded.
std::vector<std::string> runtime_candidates() {
  std::vector<std::string> names;
  if (const char* env = std::getenv("ROUNDPIPE_CUDART"); env && *env) names.emplace_back(env);
  for (const char* n : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"})
    names.emplace_back(n);
  return names;
}

bool bind_runtime(void* lib, Api& a, std::string& why) {
  int (*get_count)(int*) = nullptr;
  bool ok = resolve(lib, "cudaGetDeviceCount", get_count) && resolve(lib, "cudaSetDevice", a.cudaSetDevice) &&
            resolve(lib, "cudaGetDevice", a.cudaGetDevice) && resolve(lib, "cudaHostAlloc", a.rt_host_alloc) &&
            resolve(lib, "cudaFreeHost", a.rt_free_host) && resolve(lib, "cudaEventQuery", a.rt_event_query) &&
            resolve(lib, "cudaEventSynchronize", a.rt_event_sync) &&
            resolve(lib, "cudaGetErrorString", a.rt_error_string) &&
            resolve(lib, "cudaEventCreateWithFlags", a.cudaEventCreateWithFlags) &&
            resolve(lib, "cudaEventDestroy", a.cudaEventDestroy) && resolve(lib, "cudaEventRecord", a.cudaEventRecord) &&
            resolve(lib, "cudaStreamCreateWithPriority", a.cudaStreamCreateWithPriority) &&
            resolve(lib, "cudaStreamDestroy", a.cudaStreamDestroy) &&
            resolve(lib, "cudaStreamSynchronize", a.cudaStreamSynchronize) &&
            resolve(lib, "cudaStreamWaitEvent", a.cudaStreamWaitEvent) &&
            resolve(lib, "cudaDeviceGetStreamPriorityRange", a.cudaDeviceGetStreamPriorityRange) &&
            resolve(lib, "cudaMemcpyAsync", a.cudaMemcpyAsync);
  if (!ok) {
    why = a.library + " lacks a required symbol";
    return false;
  }
  int count = 0;
  const int err = get_count(&count);
  if (err != kSuccess || count == 0) {
    why = a.library + " loaded but sees no device (cudaGetDeviceCount -> error " + std::to_string(err) +
          ", count " + std::to_string(count) + ")";
    return false;
  }
  a.device_count = count;
  a.flavor = Flavor::Runtime;
  return true;
}

// A runtime already in the process (torch's) is preferred over loading one:
// a newer libcudart than the driver supports would otherwise shadow a working
// older one.  Each candidate that fails is unloaded and the next one tried.
bool load_runtime(Api& a, std::string& why) {
  std::string reasons;
  for (int flags : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const std::string& name : runtime_candidates()) {
      void* lib = dlopen(name.c_str(), flags);
      if (!lib) continue;
      a = Api{};
      a.library = name;
      std::string reason;
      if (bind_runtime(lib, a, reason)) return true;
      reasons += (reasons.empty() ? "" : "; ") + reason;
      dlclose(lib);
    }
  }
  a = Api{};
  why = reasons.empty() ? "no CUDA runtime (tried libcudart.so.13/.12/.11.0; set ROUNDPIPE_CUDART to a path)" : reasons;
  return false;
}

bool load_driver(Api& a, std::string& why) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    why = "no CUDA driver (libcuda.so.1)";
    return false;
  }
  int (*init)(unsigned) = nullptr;
  int (*get_count)(int*) = nullptr;
  int (*get_device)(int*, int) = nullptr;
  int (*retain)(void**, int) = nullptr;
  bool ok = resolve(lib, "cuInit", init) && resolve(lib, "cuDeviceGetCount", get_count) &&
            resolve(lib, "cuDeviceGet", get_device) && resolve(lib, "cuDevicePrimaryCtxRetain", retain) &&
            resolve(lib, "cuCtxPushCurrent_v2", a.drv_ctx_push) && resolve(lib, "cuCtxPopCurrent_v2", a.drv_ctx_pop) &&
            resolve(lib, "cuMemHostAlloc", a.drv_mem_host_alloc) && resolve(lib, "cuMemFreeHost", a.drv_mem_free_host) &&
            resolve(lib, "cuEventQuery", a.drv_event_query) && resolve(lib, "cuEventSynchronize", a.drv_event_sync) &&
            resolve(lib, "cuGetErrorString", a.drv_error_string);
  if (!ok) {
    why = "libcuda.so.1 lacks a required symbol";
    return false;
  }
  int count = 0, dev = 0;
  if (init(0) != kSuccess || get_count(&count) != kSuccess || count == 0 || get_device(&dev, 0) != kSuccess ||
      retain(&a.drv_primary_ctx, dev) != kSuccess) {
    why = "libcuda.so.1 loaded but cuInit/primary context failed or no device";
    return false;
  }
  a.library = "libcuda.so.1";
  a.device_count = count;
  a.flavor = Flavor::Driver;
  return true;
}

Loaded& loaded() {
  static Loaded state;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string why_rt, why_drv;
    if (load_runtime(state.api, why_rt)) {
      state.ok = true;
    } else {
      state.api = Api{};
      state.ok = load_driver(state.api, why_drv);
      if (!state.ok) state.api = Api{};
    }
    const Api& a = state.api;
    if (state.ok) {
      state.status = std::string(a.flavor == Flavor::Runtime ? "runtime " : "driver ") + a.library + " (" +
                     std::to_string(a.device_count) + (a.device_count == 1 ? " device)" : " devices)");
      if (a.flavor == Flavor::Driver) state.status += "; runtime unavailable: " + why_rt;
    } else {
      state.status = why_rt + "; " + why_drv;
    }
  });
  return state;
}

}  // namespace

void* Api::host_alloc(size_t nbytes) const {
  void* p = nullptr;
  if (flavor == Flavor::Runtime) {
    check(rt_host_alloc(&p, nbytes, kHostAllocPortable), "cudaHostAlloc");
  } else {
    check(drv_ctx_push(drv_primary_ctx), "cuCtxPushCurrent");
    const int err = drv_mem_host_alloc(&p, nbytes, kHostAllocPortable);
    void* popped = nullptr;
    drv_ctx_pop(&popped);
    check(err, "cuMemHostAlloc");
  }
  return p;
}

void Api::host_free(void* p) const {
  // Errors at shutdown (the runtime already unloading) are expected and harmless.
  if (flavor == Flavor::Runtime) {
    rt_free_host(p);
  } else {
    drv_mem_free_host(p);
  }
}

int Api::event_query(Event e) const { return flavor == Flavor::Runtime ? rt_event_query(e) : drv_event_query(e); }

int Api::event_synchronize(Event e) const {
  return flavor == Flavor::Runtime ? rt_event_sync(e) : drv_event_sync(e);
}

std::string Api::error_string(int code) const {
  const char* s = nullptr;
  if (flavor == Flavor::Runtime) {
    s = rt_error_string(code);
  } else if (drv_error_string) {
    drv_error_string(code, &s);
  }
  return std::string(s ? s : "unknown error") + " (code " + std::to_string(code) + ")";
}

void Api::check(int code, const char* what) const {
  if (code != kSuccess) throw std::runtime_error(std::string(what) + " failed: " + error_string(code));
}

const Api* api() {
  Loaded& l = loaded();
  return l.ok ? &l.api : nullptr;
}

std::string status() { return loaded().status; }

const Api& require_runtime(const char* what) {
  const Api* a = api();
  if (!a || a->flavor != Flavor::Runtime)
    throw std::runtime_error(std::string(what) + " needs the CUDA runtime, which is unavailable: " + status());
  return *a;
}

DeviceGuard::DeviceGuard(const Api& api, int device) : api_(api) {
  api_.check(api_.cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) api_.check(api_.cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (api_.cudaGetDevice(&now) == kSuccess && now != previous_) api_.cudaSetDevice(previous_);
}

}  // namespace rp::cuda
