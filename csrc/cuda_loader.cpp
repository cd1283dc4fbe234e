#include "cuda_loader.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace rp::cuda {

struct PrimaryContexts {
  std::mutex mu;
  std::vector<void*> ctx;  // by device index, nullptr until retained
};

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
  // The context entry points come from the driver the runtime loaded (found without loading
  // another copy); without them DeviceGuard falls back to cudaSetDevice.
  void* drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!drv) drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!drv || !(resolve(drv, "cuDeviceGet", a.drv_device_get) &&
                resolve(drv, "cuDevicePrimaryCtxRetain", a.drv_primary_retain) &&
                resolve(drv, "cuCtxPushCurrent_v2", a.drv_ctx_push) && resolve(drv, "cuCtxPopCurrent_v2", a.drv_ctx_pop))) {
    a.drv_device_get = nullptr;
    a.drv_primary_retain = nullptr;
    a.drv_ctx_push = nullptr;
    a.drv_ctx_pop = nullptr;
  }
  a.contexts = std::make_shared<PrimaryContexts>();
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
  bool ok = resolve(lib, "cuInit", init) && resolve(lib, "cuDeviceGetCount", get_count) &&
            resolve(lib, "cuDeviceGet", a.drv_device_get) &&
            resolve(lib, "cuDevicePrimaryCtxRetain", a.drv_primary_retain) &&
            resolve(lib, "cuCtxPushCurrent_v2", a.drv_ctx_push) && resolve(lib, "cuCtxPopCurrent_v2", a.drv_ctx_pop) &&
            resolve(lib, "cuMemHostAlloc", a.drv_mem_host_alloc) && resolve(lib, "cuMemFreeHost", a.drv_mem_free_host) &&
            resolve(lib, "cuEventQuery", a.drv_event_query) && resolve(lib, "cuEventSynchronize", a.drv_event_sync) &&
            resolve(lib, "cuGetErrorString", a.drv_error_string);
  if (!ok) {
    why = "libcuda.so.1 lacks a required symbol";
    return false;
  }
  // No primary context is retained here: that would create one on GPU 0 in every process
  // that loads the driver, whether it page-locks anything on GPU 0 or not.
  int count = 0;
  if (init(0) != kSuccess || get_count(&count) != kSuccess || count == 0) {
    why = "libcuda.so.1 loaded but cuInit failed or it sees no device";
    return false;
  }
  a.library = "libcuda.so.1";
  a.device_count = count;
  a.flavor = Flavor::Driver;
  a.contexts = std::make_shared<PrimaryContexts>();
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

void* Api::primary_context(int device) const {
  if (device < 0 || device >= device_count)
    throw std::invalid_argument("device=" + std::to_string(device) + " is out of range; " +
                                std::to_string(device_count) + " CUDA devices are visible");
  if (!drv_primary_retain || !drv_device_get || !contexts) return nullptr;
  std::lock_guard<std::mutex> lock(contexts->mu);
  if (contexts->ctx.size() < static_cast<size_t>(device_count)) contexts->ctx.resize(device_count, nullptr);
  void*& ctx = contexts->ctx[device];
  if (!ctx) {
    int handle = 0;
    check(drv_device_get(&handle, device), "cuDeviceGet");
    check(drv_primary_retain(&ctx, handle), "cuDevicePrimaryCtxRetain");
  }
  return ctx;
}

void* Api::host_alloc(size_t nbytes, int device) const {
  void* p = nullptr;
  if (flavor == Flavor::Runtime) {
    if (device < 0) {
      check(rt_host_alloc(&p, nbytes, kHostAllocPortable), "cudaHostAlloc");
    } else {
      DeviceGuard guard(*this, device);
      check(rt_host_alloc(&p, nbytes, kHostAllocPortable), "cudaHostAlloc");
    }
  } else {
    DeviceGuard guard(*this, device < 0 ? 0 : device);  // the driver has no context of its own here
    check(drv_mem_host_alloc(&p, nbytes, kHostAllocPortable), "cuMemHostAlloc");
  }
  return p;
}

void Api::host_free(void* p, int device) const {
  // Errors at shutdown (the runtime already unloading) are expected and harmless.
  try {
    if (flavor == Flavor::Runtime) {
      if (device < 0) {
        rt_free_host(p);
      } else {
        DeviceGuard guard(*this, device);
        rt_free_host(p);
      }
    } else {
      DeviceGuard guard(*this, device < 0 ? 0 : device);
      drv_mem_free_host(p);
    }
  } catch (const std::exception&) {
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
  if (void* ctx = api_.drv_ctx_push && api_.drv_ctx_pop ? api_.primary_context(device) : nullptr) {
    api_.check(api_.drv_ctx_push(ctx), "cuCtxPushCurrent");
    pushed_ = true;
    return;
  }
  if (!api_.cudaGetDevice || !api_.cudaSetDevice)
    throw std::runtime_error("selecting CUDA device " + std::to_string(device) + " needs the driver's context "
                             "entry points or the runtime's cudaSetDevice; " + status());
  api_.check(api_.cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) api_.check(api_.cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  if (pushed_) {
    void* popped = nullptr;
    api_.drv_ctx_pop(&popped);
    return;
  }
  int now = -1;
  if (api_.cudaGetDevice(&now) == kSuccess && now != previous_) api_.cudaSetDevice(previous_);
}

// ---- FakeCuda: entry points over the one live instance

namespace {

std::atomic<FakeCuda*> live_fake{nullptr};
constexpr int kFakeInvalidDevice = 101;   // cudaErrorInvalidDevice
constexpr int kFakeInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT

template <class F>
int fake_call(F&& f) {
  FakeCuda& fake = FakeCuda::live();
  std::lock_guard<std::mutex> lock(fake.mu);
  return f(fake);
}

int fake_device_index(FakeCuda& f, int device) {
  return device >= 0 && device < f.api().device_count ? device : -1;
}

int fake_set_device(int device) {
  return fake_call([&](FakeCuda& f) {
    if (fake_device_index(f, device) < 0) return kFakeInvalidDevice;
    FakeCuda::Thread& t = f.thread_locked();
    t.device = device;
    if (t.stack.empty()) t.stack.push_back(device); else t.stack.back() = device;  // cuCtxSetCurrent
    f.create_locked(device);
    f.log.emplace_back("cudaSetDevice", device);
    return kSuccess;
  });
}

int fake_get_device(int* device) {
  return fake_call([&](FakeCuda& f) {
    const FakeCuda::Thread& t = f.thread_locked();
    *device = t.stack.empty() ? t.device : t.stack.back();
    return kSuccess;
  });
}

int fake_host_alloc(void** p, size_t nbytes, unsigned) {
  return fake_call([&](FakeCuda& f) {
    f.context_device_locked("cudaHostAlloc");
    *p = std::malloc(nbytes ? nbytes : 1);
    return *p ? kSuccess : 2;  // cudaErrorMemoryAllocation
  });
}

int fake_free_host(void* p) {
  return fake_call([&](FakeCuda& f) {
    f.context_device_locked("cudaFreeHost");
    std::free(p);
    return kSuccess;
  });
}

int fake_event_create(Event* e, unsigned flags) {
  return fake_call([&](FakeCuda& f) {
    f.context_device_locked("cudaEventCreateWithFlags");
    f.flags.push_back(flags);
    *e = new int(0);
    return kSuccess;
  });
}

int fake_event_destroy(Event e) {
  delete static_cast<int*>(e);
  return kSuccess;
}

int fake_event_record(Event e, Stream) {
  return fake_call([&](FakeCuda& f) {
    f.context_device_locked("cudaEventRecord");
    ++*static_cast<int*>(e);
    return kSuccess;
  });
}

int fake_event_done(Event) { return kSuccess; }

int fake_stream_wait(Stream, Event, unsigned) { return kSuccess; }

const char* fake_error_string(int) { return "fake CUDA error"; }

int fake_device_get(int* handle, int ordinal) {
  return fake_call([&](FakeCuda& f) {
    if (fake_device_index(f, ordinal) < 0) return kFakeInvalidDevice;
    *handle = ordinal;
    return kSuccess;
  });
}

int fake_primary_retain(void** ctx, int device) {
  return fake_call([&](FakeCuda& f) {
    if (fake_device_index(f, device) < 0) return kFakeInvalidDevice;
    f.create_locked(device);
    *ctx = reinterpret_cast<void*>(static_cast<uintptr_t>(device) + 1);  // never null
    return kSuccess;
  });
}

int fake_ctx_push(void* ctx) {
  return fake_call([&](FakeCuda& f) {
    const int device = static_cast<int>(reinterpret_cast<uintptr_t>(ctx)) - 1;
    if (fake_device_index(f, device) < 0) return kFakeInvalidContext;
    f.thread_locked().stack.push_back(device);
    return kSuccess;
  });
}

int fake_ctx_pop(void** ctx) {
  return fake_call([&](FakeCuda& f) {
    FakeCuda::Thread& t = f.thread_locked();
    if (t.stack.empty()) return kFakeInvalidContext;
    if (ctx) *ctx = reinterpret_cast<void*>(static_cast<uintptr_t>(t.stack.back()) + 1);
    t.stack.pop_back();
    return kSuccess;
  });
}

}  // namespace

FakeCuda::FakeCuda(int device_count) {
  if (device_count < 1 || device_count > kMaxDevices)
    throw std::invalid_argument("device_count=" + std::to_string(device_count) + " must be in [1, " +
                                std::to_string(kMaxDevices) + "]");
  Api& a = api_;
  a.flavor = Flavor::Runtime;
  a.library = "fake";
  a.device_count = device_count;
  a.cudaSetDevice = fake_set_device;
  a.cudaGetDevice = fake_get_device;
  a.cudaEventCreateWithFlags = fake_event_create;
  a.cudaEventDestroy = fake_event_destroy;
  a.cudaEventRecord = fake_event_record;
  a.cudaStreamWaitEvent = fake_stream_wait;
  a.rt_host_alloc = fake_host_alloc;
  a.rt_free_host = fake_free_host;
  a.rt_event_query = fake_event_done;
  a.rt_event_sync = fake_event_done;
  a.rt_error_string = fake_error_string;
  a.drv_device_get = fake_device_get;
  a.drv_primary_retain = fake_primary_retain;
  a.drv_ctx_push = fake_ctx_push;
  a.drv_ctx_pop = fake_ctx_pop;
  a.contexts = std::make_shared<PrimaryContexts>();
  live_fake.store(this);
}

FakeCuda::~FakeCuda() {
  FakeCuda* self = this;
  live_fake.compare_exchange_strong(self, nullptr);
}

FakeCuda& FakeCuda::live() {
  FakeCuda* f = live_fake.load();
  if (!f) throw std::logic_error("a fake CUDA entry point was called with no FakeCuda live");
  return *f;
}

FakeCuda::Thread& FakeCuda::thread_locked() { return threads[std::this_thread::get_id()]; }

void FakeCuda::create_locked(int device) {
  for (int d : created)
    if (d == device) return;
  created.push_back(device);
}

int FakeCuda::context_device_locked(const char* call) {
  Thread& t = thread_locked();
  const int device = t.stack.empty() ? t.device : t.stack.back();
  if (t.stack.empty()) {  // the runtime makes the device's primary context current, creating it
    create_locked(device);
    t.stack.push_back(device);
  }
  log.emplace_back(call, device);
  return device;
}

std::vector<int> FakeCuda::contexts_created() const {
  std::lock_guard<std::mutex> lock(mu);
  return created;
}

std::vector<std::pair<std::string, int>> FakeCuda::calls() const {
  std::lock_guard<std::mutex> lock(mu);
  return log;
}

std::vector<unsigned> FakeCuda::event_flags() const {
  std::lock_guard<std::mutex> lock(mu);
  return flags;
}

int FakeCuda::thread_device() const {
  std::lock_guard<std::mutex> lock(mu);
  auto it = threads.find(std::this_thread::get_id());
  if (it == threads.end()) return 0;
  return it->second.stack.empty() ? it->second.device : it->second.stack.back();
}

size_t FakeCuda::thread_context_depth() const {
  std::lock_guard<std::mutex> lock(mu);
  auto it = threads.find(std::this_thread::get_id());
  return it == threads.end() ? 0 : it->second.stack.size();
}

}  // namespace rp::cuda
