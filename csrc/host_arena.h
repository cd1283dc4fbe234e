// Host arena: page-locked host memory reserved in large chunks and handed out
// as exactly-sized blocks.
//
// Why not torch's pinned allocator: it rounds every request up to a power of
// two and caches by size, so a model whose tensors are 24 MiB or 593 MiB holds
// 32 MiB and 1 GiB of page-locked RAM for them (up to 2x).  Here a request is
// rounded only to `alignment` (256 B by default) and placed best-fit (smallest
// free segment that fits, lowest address on ties) in a chunk; freeing
// coalesces with free neighbours of the same chunk.
//
// Chunks: a request above chunk_bytes/2 gets a chunk of its own size (rounded
// to a 4 KiB page), smaller ones share chunk_bytes chunks, so the only waste is
// the unused tail of the newest shared chunk.  Chunks are page-locked through
// the CUDA runtime or driver loaded at run time (portable cudaHostAlloc), or,
// without CUDA, are ordinary page-aligned memory with the same bookkeeping.
//
// Stream-ordered reuse: fences (copy events) recorded against a block keep a
// freed block out of the free list until all of them completed, so a copy
// still reading or writing it is never overwritten.  Pending blocks are
// collected on every allocation; when the limit is reached, the allocation
// waits for pending fences before giving up with ArenaExhausted.
//
// Thread-safe: one mutex guards the bookkeeping; fence waits happen unlocked,
// and so does page-locking.  cudaHostAlloc of a 64 MiB chunk takes milliseconds
// (the pages are faulted in and pinned), during which every other allocating
// thread (copy completions, the G-copy, the caller) used to stall on the mutex
// even when free space was there for it.  Growth is reserved under the lock
// (the bytes count against limit_bytes while in flight), the chunk is
// page-locked unlocked, then inserted and carved under the lock; idle chunks are
// unlinked under the lock and unlocked after it.  A request that finds the limit
// taken by growth in flight waits for it rather than failing.
//
// Home device: page-locking needs a CUDA context, and a thread with none current
// (a completion or G-copy thread) would get one created on GPU 0 (0.3-0.5 GB of
// device memory per process, on the same GPU for every rank of a node).  With
// home_device >= 0 the chunks are page-locked and freed with that device's
// primary context pushed, the thread's own context restored after
// (cuda::Api::host_alloc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "fence.h"

namespace rp {

enum class ArenaBackend { Auto, Host, Cuda };

struct ArenaOptions {
  size_t chunk_bytes = size_t{64} << 20;
  size_t alignment = 256;
  size_t limit_bytes = 0;  // 0: no limit
  ArenaBackend backend = ArenaBackend::Auto;
  int home_device = -1;         // device whose context page-locks chunks; -1: the calling thread's
  double system_delay_s = 0.0;  // test hook: every page-lock and unlock sleeps this long first
  static constexpr double kMaxSystemDelay = 60.0;
};

struct ArenaStats {
  size_t reserved_bytes = 0;    // sum of chunk sizes
  size_t in_use_bytes = 0;      // live + pending blocks, after alignment
  size_t requested_bytes = 0;   // what callers asked for, live blocks only
  size_t pending_bytes = 0;     // freed but waiting for fences
  size_t free_bytes = 0;
  size_t largest_free_block = 0;
  size_t peak_in_use_bytes = 0;
  size_t peak_reserved_bytes = 0;
  size_t limit_bytes = 0;
  size_t num_chunks = 0;
  size_t num_blocks = 0;        // live
  size_t num_pending = 0;
  size_t num_free_segments = 0;
  uint64_t num_allocations = 0; // over the arena's lifetime
  double fragmentation = 0.0;   // 1 - largest_free_block / free_bytes (0 when nothing is free)
};

// Raised when a request cannot be met within limit_bytes (maps to MemoryError).
class ArenaExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class HostArena {
 public:
  // `api` replaces the loaded CUDA API (tests pass a cuda::FakeCuda's); nullptr: cuda::api().
  explicit HostArena(const ArenaOptions& options, const cuda::Api* api = nullptr);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Address of a new block of at least nbytes (nbytes 0 takes one alignment unit).
  // nbytes above the largest possible allocation (PTRDIFF_MAX rounded down to a
  // page) is std::invalid_argument; one the system cannot provide is ArenaExhausted.
  void* allocate(size_t nbytes);
  // Returns the block at `p` (its start); deferred while recorded fences are pending.
  void free(void* p);
  // Records `fence` against the live block containing address `p`.
  void record(const void* p, FencePtr fence);
  // Moves blocks whose fences all completed to the free list; returns how many.
  size_t collect();
  // Waits for every pending block's fences, then collects.
  void synchronize();
  // Adds one chunk of exactly nbytes (page-rounded), e.g. the whole model up front.
  void reserve(size_t nbytes);
  // Returns wholly free chunks to the system; returns the bytes released.
  size_t release_unused();

  ArenaStats stats() const;
  bool pinned() const { return pinned_; }
  const std::string& backend_name() const { return backend_name_; }
  const ArenaOptions& options() const { return options_; }
  // Start and size of the live block containing p, or {0, 0}.
  std::pair<uintptr_t, size_t> block_of(const void* p) const;

 private:
  enum class State : uint8_t { Free, Used, Pending };
  struct Segment {
    size_t size = 0;
    size_t requested = 0;
    uint32_t chunk = 0;
    State state = State::Free;
    std::vector<FencePtr> fences;
  };
  struct Chunk {
    uintptr_t base = 0;
    size_t size = 0;
  };

  using SegIt = std::map<uintptr_t, Segment>::iterator;
  void* alloc_system(size_t nbytes);
  void free_system(void* p);
  // Page-locks nbytes with mu_ released (lock is held on entry and on return, also on throw).
  uintptr_t grow_unlocked(std::unique_lock<std::mutex>& lock, size_t nbytes);
  void add_chunk_locked(uintptr_t base, size_t nbytes);
  // Frees chunks taken out of the bookkeeping, with mu_ released.
  void free_chunks_unlocked(std::unique_lock<std::mutex>& lock, const std::vector<Chunk>& chunks);
  bool try_place_locked(size_t size, size_t requested, uintptr_t* out);
  bool fits_limit_locked(size_t chunk) const;
  void make_free_locked(SegIt it);
  size_t collect_locked();
  std::vector<Chunk> take_unused_locked();
  SegIt find_live_locked(const void* p, const char* what);
  std::vector<FencePtr> pending_fences_locked() const;
  [[noreturn]] void throw_exhausted_locked(size_t nbytes) const;

  const ArenaOptions options_;
  bool pinned_ = false;
  std::string backend_name_;
  const cuda::Api* cuda_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable settled_;                 // an in-flight page-lock or unlock finished
  std::map<uintptr_t, Segment> segs_;               // every segment, by address
  std::set<std::pair<size_t, uintptr_t>> free_;     // free segments by (size, address)
  std::set<uintptr_t> pending_;                     // addresses of pending segments
  std::map<uint32_t, Chunk> chunks_;
  uint32_t next_chunk_ = 0;
  size_t reserved_ = 0, in_use_ = 0, requested_ = 0, pending_bytes_ = 0;
  size_t in_flight_ = 0;                            // being page-locked or unlocked, mu_ released
  size_t peak_in_use_ = 0, peak_reserved_ = 0;
  uint64_t allocations_ = 0;
};

// A block owned by its holder: returned to the arena (deferred by its fences)
// when destroyed.  Holds the arena alive.  Python sees it as a writable buffer.
class ArenaBlock {
 public:
  ArenaBlock(std::shared_ptr<HostArena> arena, size_t nbytes)
      : arena_(std::move(arena)), ptr_(arena_->allocate(nbytes)), nbytes_(nbytes) {}
  ~ArenaBlock() { arena_->free(ptr_); }
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;
  void* data() const { return ptr_; }
  size_t nbytes() const { return nbytes_; }

 private:
  std::shared_ptr<HostArena> arena_;
  void* ptr_;
  size_t nbytes_;
};

}  // namespace rp
