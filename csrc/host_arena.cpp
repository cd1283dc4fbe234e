#include "host_arena.h"

#include <cassert>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <thread>

#include "checks.h"

namespace rp {
namespace {

constexpr size_t kPage = 4096;
// Largest request: the largest page multiple a buffer can have, so rounding a
// request up to a page (or to the alignment, at most a page) cannot wrap.
constexpr size_t kMaxRequest = check::kMaxBytes / kPage * kPage;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::string human(size_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s (%zu bytes)", v, units[u], n);
  return buf;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<uintptr_t>(p));
  return buf;
}

// Removes the fences that have completed (order is not kept).
void drop_completed(std::vector<FencePtr>& fs) {
  for (size_t i = 0; i < fs.size();) {
    if (fs[i]->poll() != FenceState::Pending) {
      fs[i] = fs.back();
      fs.pop_back();
    } else {
      ++i;
    }
  }
}

}  // namespace

HostArena::HostArena(const ArenaOptions& options, const cuda::Api* api) : options_(options) {
  const size_t a = options.alignment;
  if (a < 8 || a > kPage || (a & (a - 1)) != 0)
    throw std::invalid_argument("alignment=" + std::to_string(a) + " must be a power of two in [8, 4096]");
  if (options.chunk_bytes < kPage)
    throw std::invalid_argument("chunk_bytes=" + std::to_string(options.chunk_bytes) + " must be >= 4096");
  check::at_most("chunk_bytes", options.chunk_bytes, kMaxRequest, "the largest possible allocation");
  const double delay = options.system_delay_s;
  if (!(delay >= 0 && delay <= ArenaOptions::kMaxSystemDelay))
    throw std::invalid_argument("system_delay_s=" + check::num(delay) + " must be a number of seconds in [0, 60]");
  if (options.backend != ArenaBackend::Host) cuda_ = api ? api : cuda::api();
  if (options.backend == ArenaBackend::Cuda && !cuda_)
    throw std::runtime_error("backend='cuda' needs CUDA to page-lock memory, which is unavailable: " + cuda::status());
  const int home = options.home_device;
  if (home < -1 || (cuda_ && home >= cuda_->device_count))
    throw std::invalid_argument("home_device=" + std::to_string(home) + " must be -1 (the allocating thread's device) or " +
                                "a CUDA device index below " + std::to_string(cuda_ ? cuda_->device_count : 0));
  pinned_ = cuda_ != nullptr;
  backend_name_ = pinned_ ? "cuda" : "host";
}

HostArena::~HostArena() {
  // A copy may still be reading or writing a block: wait for every fence first.
  for (auto& [addr, seg] : segs_)
    for (auto& f : seg.fences) f->block();
  for (auto& [id, chunk] : chunks_) free_system(reinterpret_cast<void*>(chunk.base));
}

void* HostArena::alloc_system(size_t nbytes) {
  if (options_.system_delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(options_.system_delay_s));
  if (pinned_) {
    try {
      return cuda_->host_alloc(nbytes, options_.home_device);
    } catch (const std::runtime_error& e) {
      throw ArenaExhausted("HostArena: the system could not page-lock " + human(nbytes) + ": " + e.what());
    }
  }
  void* p = nullptr;
  if (posix_memalign(&p, kPage, nbytes) != 0)
    throw ArenaExhausted("HostArena: the system could not provide " + human(nbytes) + " of host memory");
  return p;
}

void HostArena::free_system(void* p) {
  if (options_.system_delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(options_.system_delay_s));
  if (pinned_) {
    cuda_->host_free(p, options_.home_device);
  } else {
    std::free(p);
  }
}

uintptr_t HostArena::grow_unlocked(std::unique_lock<std::mutex>& lock, size_t nbytes) {
  in_flight_ += nbytes;  // counts against the limit until the chunk is in (or failed)
  lock.unlock();
  void* p = nullptr;
  try {
    p = alloc_system(nbytes);
  } catch (...) {
    lock.lock();
    in_flight_ -= nbytes;
    settled_.notify_all();
    throw;
  }
  lock.lock();
  in_flight_ -= nbytes;
  settled_.notify_all();
  return reinterpret_cast<uintptr_t>(p);
}

void HostArena::free_chunks_unlocked(std::unique_lock<std::mutex>& lock, const std::vector<Chunk>& chunks) {
  lock.unlock();
  for (const Chunk& c : chunks) free_system(reinterpret_cast<void*>(c.base));
  lock.lock();
  for (const Chunk& c : chunks) in_flight_ -= c.size;
  settled_.notify_all();
}

void HostArena::add_chunk_locked(uintptr_t base, size_t nbytes) {
  const uint32_t id = next_chunk_++;
  chunks_[id] = Chunk{base, nbytes};
  Segment seg;
  seg.size = nbytes;
  seg.chunk = id;
  segs_.emplace(base, std::move(seg));
  free_.insert({nbytes, base});
  reserved_ += nbytes;
  if (reserved_ > peak_reserved_) peak_reserved_ = reserved_;
}

bool HostArena::try_place_locked(size_t size, size_t requested, uintptr_t* out) {
  auto best = free_.lower_bound({size, 0});
  if (best == free_.end()) return false;
  const uintptr_t addr = best->second;
  free_.erase(best);
  Segment& seg = segs_.at(addr);
  if (seg.size > size) {  // split: the remainder stays free in the same chunk
    Segment rest;
    rest.size = seg.size - size;
    rest.chunk = seg.chunk;
    segs_.emplace(addr + size, std::move(rest));
    free_.insert({seg.size - size, addr + size});
    seg.size = size;
  }
  seg.state = State::Used;
  seg.requested = requested;
  in_use_ += size;
  requested_ += requested;
  if (in_use_ > peak_in_use_) peak_in_use_ = in_use_;
  ++allocations_;
  *out = addr;
  return true;
}

void* HostArena::allocate(size_t nbytes) {
  check::at_most("nbytes", nbytes, kMaxRequest, "the largest possible allocation");
  const size_t size = round_up(nbytes ? nbytes : 1, options_.alignment);
  std::unique_lock<std::mutex> lock(mu_);
  collect_locked();
  while (true) {
    uintptr_t addr = 0;
    if (try_place_locked(size, nbytes, &addr)) return reinterpret_cast<void*>(addr);
    size_t chunk = size > options_.chunk_bytes / 2 ? round_up(size, kPage) : options_.chunk_bytes;
    if (!fits_limit_locked(chunk)) chunk = round_up(size, kPage);
    if (fits_limit_locked(chunk)) {
      // Page-locked unlocked; inserted and carved in one hold of the lock, so no other
      // request can take the new chunk first and this one cannot fail to fit.
      add_chunk_locked(grow_unlocked(lock, chunk), chunk);
      const bool placed = try_place_locked(size, nbytes, &addr);
      assert(placed);
      (void)placed;
      return reinterpret_cast<void*>(addr);
    }
    // Over the limit: make room by returning idle chunks, then by waiting for growth
    // or unlocking in flight on other threads, then for blocks whose copies are still
    // in flight; give up only when none of these helps.
    if (std::vector<Chunk> idle = take_unused_locked(); !idle.empty()) {
      free_chunks_unlocked(lock, idle);
      continue;
    }
    if (in_flight_ > 0) {
      settled_.wait(lock);
      collect_locked();
      continue;
    }
    if (pending_.empty()) throw_exhausted_locked(nbytes);
    std::vector<FencePtr> fences = pending_fences_locked();
    lock.unlock();
    for (auto& f : fences) f->block();
    lock.lock();
    collect_locked();
  }
}

bool HostArena::fits_limit_locked(size_t chunk) const {
  const size_t limit = options_.limit_bytes;  // reserved_ + in_flight_ <= limit whenever there is one
  const size_t taken = reserved_ + in_flight_;
  return !limit || (taken <= limit && chunk <= limit - taken);
}

void HostArena::throw_exhausted_locked(size_t nbytes) const {
  const size_t largest = free_.empty() ? 0 : free_.rbegin()->first;
  throw ArenaExhausted("HostArena: cannot allocate " + human(nbytes) + ": limit_bytes is " +
                       human(options_.limit_bytes) + " and " + human(reserved_) + " is reserved, " +
                       human(in_use_) + " in use, largest free block " + human(largest) +
                       "; raise limit_bytes or release tensors allocated from this arena");
}

void HostArena::make_free_locked(SegIt it) {
  Segment& seg = it->second;
  in_use_ -= seg.size;
  seg.state = State::Free;
  seg.requested = 0;
  seg.fences.clear();
  auto next = std::next(it);
  if (next != segs_.end() && next->second.state == State::Free && next->second.chunk == seg.chunk &&
      it->first + seg.size == next->first) {
    free_.erase({next->second.size, next->first});
    seg.size += next->second.size;
    segs_.erase(next);
  }
  if (it != segs_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.state == State::Free && prev->second.chunk == seg.chunk &&
        prev->first + prev->second.size == it->first) {
      free_.erase({prev->second.size, prev->first});
      prev->second.size += seg.size;
      segs_.erase(it);
      it = prev;
    }
  }
  free_.insert({it->second.size, it->first});
}

void HostArena::free(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = segs_.find(reinterpret_cast<uintptr_t>(p));
  if (it == segs_.end() || it->second.state != State::Used)
    throw std::invalid_argument("p=" + hex(p) + " is not the start of a live block of this arena");
  Segment& seg = it->second;
  requested_ -= seg.requested;
  seg.requested = 0;
  auto& fs = seg.fences;
  drop_completed(fs);
  if (fs.empty()) {
    make_free_locked(it);
  } else {
    seg.state = State::Pending;
    pending_.insert(it->first);
    pending_bytes_ += seg.size;
  }
}

HostArena::SegIt HostArena::find_live_locked(const void* p, const char* what) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = segs_.upper_bound(a);
  if (it != segs_.begin()) {
    --it;
    if (a < it->first + it->second.size && it->second.state == State::Used) return it;
  }
  throw std::invalid_argument(std::string(what) + ": address " + hex(p) + " is not inside a live block of this arena");
}

void HostArena::record(const void* p, FencePtr fence) {
  if (!fence) throw std::invalid_argument("fence is None");
  std::lock_guard<std::mutex> lock(mu_);
  auto& fs = find_live_locked(p, "record")->second.fences;
  // Long-lived blocks see a fence per copy: drop completed ones as they pile up.
  if (fs.size() >= 8) drop_completed(fs);
  fs.push_back(std::move(fence));
}

size_t HostArena::collect_locked() {
  size_t n = 0;
  for (auto p = pending_.begin(); p != pending_.end();) {
    auto it = segs_.find(*p);
    auto& fs = it->second.fences;
    bool all_done = true;
    for (auto& f : fs) all_done = all_done && f->poll() != FenceState::Pending;
    if (!all_done) {
      ++p;
      continue;
    }
    pending_bytes_ -= it->second.size;
    p = pending_.erase(p);
    make_free_locked(it);
    ++n;
  }
  return n;
}

size_t HostArena::collect() {
  std::lock_guard<std::mutex> lock(mu_);
  return collect_locked();
}

std::vector<FencePtr> HostArena::pending_fences_locked() const {
  std::vector<FencePtr> out;
  for (uintptr_t a : pending_)
    for (auto& f : segs_.at(a).fences) out.push_back(f);
  return out;
}

void HostArena::synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!pending_.empty()) {
    std::vector<FencePtr> fences = pending_fences_locked();
    lock.unlock();
    for (auto& f : fences) f->block();
    lock.lock();
    collect_locked();
  }
}

void HostArena::reserve(size_t nbytes) {
  if (nbytes == 0) throw std::invalid_argument("nbytes=0 must be > 0");
  check::at_most("nbytes", nbytes, kMaxRequest, "the largest possible allocation");
  const size_t size = round_up(nbytes, kPage);
  std::unique_lock<std::mutex> lock(mu_);
  while (!fits_limit_locked(size)) {  // growth in flight elsewhere may fail and give its bytes back
    if (in_flight_ == 0) throw_exhausted_locked(nbytes);
    settled_.wait(lock);
  }
  add_chunk_locked(grow_unlocked(lock, size), size);
}

std::vector<HostArena::Chunk> HostArena::take_unused_locked() {
  std::vector<Chunk> taken;
  for (auto c = chunks_.begin(); c != chunks_.end();) {
    auto it = segs_.find(c->second.base);
    if (it == segs_.end() || it->second.state != State::Free || it->second.size != c->second.size) {
      ++c;
      continue;
    }
    free_.erase({it->second.size, it->first});
    segs_.erase(it);
    reserved_ -= c->second.size;
    in_flight_ += c->second.size;  // still the process's until unlocked: counts against the limit
    taken.push_back(c->second);
    c = chunks_.erase(c);
  }
  return taken;
}

size_t HostArena::release_unused() {
  std::unique_lock<std::mutex> lock(mu_);
  collect_locked();
  const std::vector<Chunk> idle = take_unused_locked();
  size_t released = 0;
  for (const Chunk& c : idle) released += c.size;
  if (!idle.empty()) free_chunks_unlocked(lock, idle);
  return released;
}

std::pair<uintptr_t, size_t> HostArena::block_of(const void* p) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = segs_.upper_bound(a);
  if (it == segs_.begin()) return {0, 0};
  --it;
  if (a >= it->first + it->second.size || it->second.state != State::Used) return {0, 0};
  return {it->first, it->second.size};
}

ArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats s;
  s.reserved_bytes = reserved_;
  s.in_use_bytes = in_use_;
  s.requested_bytes = requested_;
  s.pending_bytes = pending_bytes_;
  s.free_bytes = reserved_ - in_use_;
  s.largest_free_block = free_.empty() ? 0 : free_.rbegin()->first;
  s.peak_in_use_bytes = peak_in_use_;
  s.peak_reserved_bytes = peak_reserved_;
  s.limit_bytes = options_.limit_bytes;
  s.num_chunks = chunks_.size();
  s.num_pending = pending_.size();
  s.num_blocks = segs_.size() - free_.size() - pending_.size();
  s.num_free_segments = free_.size();
  s.num_allocations = allocations_;
  s.fragmentation = s.free_bytes ? 1.0 - static_cast<double>(s.largest_free_block) / s.free_bytes : 0.0;
  return s;
}

}  // namespace rp
