// File store: training state in preallocated files, read and written as whole
// regions by a small pool of I/O threads, with a fence per request.
//
// Layout: one file per region, `<directory>/<name>`, preallocated (fallocate)
// to the region's size rounded up to kAlign = 4096 bytes, so a full disk shows
// up when the region is allocated, not in the middle of a step.
//
// I/O path: O_DIRECT (the page cache would double the host memory the tier
// exists to save, and evicting it costs CPU).  A request is cut into
// chunk_bytes pieces started in submission order, `threads` chunks at a time,
// so one 64 MiB region keeps that many requests in the drive's queue.  Two
// backends move the chunks, picked at construction (backend() and why in
// backend_reason()):
//
//   io_uring  one thread owns a ring (csrc/uring.h: raw syscalls, no liburing)
//             and keeps `threads` chunks in it as IORING_OP_READ/WRITE; it
//             starts chunks, reaps completions and finishes requests, and
//             sleeps in io_uring_enter, woken by a completion or by an eventfd
//             read in the ring that submit() and close() write to.
//   threads   `threads` threads, each doing pread/pwrite of one chunk at a time.
//
// IoBackend::Auto takes io_uring when io_uring_setup succeeds and the kernel
// has the opcodes (Linux 5.6+, not disabled by io_uring_disabled or seccomp),
// else the threads.  Both run the same scheduler (pick_locked, the ordering
// and poisoning below) and the same checks before a chunk, so they differ
// only in who waits for the disk.  Measured (roundpipe bench nvme, 3 runs on
// the 2-core VM's virtio disk, 1 GiB sequential and 16 x 64 MiB per layer, 8 MiB
// chunks, 4 in flight; docs/benchmarks.md): both beat the plain single-threaded
// O_DIRECT probe.  Sequential writes: io_uring 116-136% of the probe, threads
// 121-151%; reads 114-121% against 116-129%; the per-layer loop 91-131%
// against 86-127%.  The threads were ahead on every sequential case, the ring
// on the per-layer loop in 2 of 3 runs; falling back to the threads costs
// nothing measured here.
//
// Buffers: the body of a transfer goes straight between the caller's buffer
// and the file, so the buffer must be 4096-aligned (the arena with
// alignment=4096 serves such blocks); a tail shorter than 4096 bytes goes
// through a per-thread bounce block.  A write must end on a 4096 boundary or
// at the region's end (its last block is written whole, zero-padded).
//
// Ordering: requests on overlapping bytes of a region with at least one write
// among them run in submission order (a read submitted after a write sees it;
// a write submitted after a read does not overwrite the bytes under it); all
// others run concurrently.  That is what read-ahead of layer i+1 while layer i
// is written behind needs, with no waits in the caller.  After a write to a
// region failed, reads of that region fail too (its bytes on disk are not what
// was meant) until a write of the whole region succeeds.
//
// File systems without O_DIRECT (tmpfs before Linux 6.6, some FUSE and network
// file systems): with DirectMode::Auto a probe at construction finds out and
// the store uses buffered pread/pwrite instead (direct() false, reason in
// direct_reason(); the Python wrapper warns once).
//
// Errors: every failure of a request (ENOSPC, EIO, EFBIG, a short read, a file
// truncated or removed underneath, checked with fstat before each chunk) is
// an IoError naming the file, the offset, the byte count and the errno text,
// kept by the request's fence and thrown by IoFence::wait_io() to whoever
// waits; nothing is printed.  With io_uring a chunk's body and its tail block
// run at once: when both fail, the body's error is the one reported, as with
// the threads (which stop at the body).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fence.h"
#include "uring.h"

namespace rp {

// A failed file operation: errno, the file's path, and what was being done where.
class IoError : public std::runtime_error {
 public:
  IoError(int code, std::string path, const std::string& what)
      : std::runtime_error(what), code_(code), path_(std::move(path)) {}
  int code() const { return code_; }
  const std::string& path() const { return path_; }

 private:
  int code_;
  std::string path_;
};

// Completion of one read or write request of a FileStore.
class IoFence : public Fence {
 public:
  FenceState poll() override;
  FenceState block() override;
  std::string error() const override;
  const char* kind() const override { return "io"; }
  // Blocks until complete; the request's IoError when it failed.
  void wait_io();
  // True when complete, false while pending; the IoError when it failed.
  bool done_io();
  // Completes the fence (failed when `error` is set); wakes waiters.
  void finish(std::shared_ptr<const IoError> error);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  FenceState state_ = FenceState::Pending;
  std::shared_ptr<const IoError> error_;
};

enum class DirectMode { Auto, On, Off };
enum class IoBackend { Auto, Uring, Threads };
enum class IoKind { Read, Write };

struct FileStoreOptions {
  int threads = 4;  // chunks in flight: I/O threads, or the io_uring's depth
  IoBackend backend = IoBackend::Auto;
  size_t chunk_bytes = size_t{8} << 20;  // a multiple of 4096
  DirectMode direct = DirectMode::Auto;
  // Test hooks: every chunk sleeps a random time in [0, delay_s) before its
  // I/O (reorders chunks: exposes missing ordering); the O_DIRECT probe
  // behaves as on a file system without it; io_uring_setup behaves as refused.
  double delay_s = 0.0;
  bool simulate_no_direct = false;
  bool simulate_no_uring = false;
  static constexpr double kMaxDelay = 10.0;
};

class FileStore {
 public:
  static constexpr size_t kAlign = 4096;
  // The directory must exist; the store creates its files there.
  FileStore(std::string directory, const FileStoreOptions& options);
  ~FileStore();
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  // Creates and preallocates the file of a new region; returns its index.
  // An existing name (in the store or on disk) is std::invalid_argument; a
  // failed preallocation (ENOSPC, EFBIG) an IoError, with the file removed.
  size_t allocate(const std::string& name, size_t nbytes);
  // Queues a transfer between bytes [offset, offset + nbytes) of `region` and
  // the buffer at `buf`; the fence completes when it is done.
  std::shared_ptr<IoFence> submit(IoKind kind, size_t region, size_t offset, void* buf, size_t nbytes);
  // Blocks until every request submitted so far has completed (never throws).
  void synchronize();
  // Waits for all requests, stops the threads and closes the files (idempotent).
  void close();
  // Test hook: the next `count` chunks of `kind` fail with errno `code` instead of their I/O.
  void inject_fault(IoKind kind, int code, int count);

  bool direct() const { return direct_; }
  const std::string& direct_reason() const { return direct_reason_; }
  // IoBackend::Uring or IoBackend::Threads, and why ("io_uring_setup: Operation not permitted ...").
  IoBackend backend() const { return backend_; }
  const std::string& backend_reason() const { return backend_reason_; }
  const std::string& directory() const { return directory_; }
  const FileStoreOptions& options() const { return options_; }
  size_t num_regions() const;
  std::string region_path(size_t region) const;
  size_t region_bytes(size_t region) const;
  bool closed() const;

 private:
  struct Region {
    std::string name, path;
    int fd = -1;
    size_t nbytes = 0, file_bytes = 0;
    std::shared_ptr<const IoError> poisoned;  // the last failed write, until a whole-region write succeeds (mu_)
  };
  struct Request {
    IoKind kind;
    Region* reg;  // regions_ is a deque: stable; name, path, fd and sizes are read by the threads without mu_
    size_t region, offset, nbytes;
    char* buf;
    size_t chunks, next = 0, remaining;
    std::vector<std::shared_ptr<Request>> after;
    std::shared_ptr<IoFence> fence;
    std::shared_ptr<const IoError> error;  // of the lowest failed chunk: the same message however threads ran
    size_t error_chunk = 0;
    bool finished = false;
  };
  struct Chunk {
    std::shared_ptr<Request> request;
    size_t index;
  };

  struct Span {  // a chunk's bytes: [off, off + len) of the file from buf; body whole blocks, then a tail
    char* buf;
    size_t off, len, body, tail;
  };
  struct RingSlot;

  void probe_direct();
  void pick_backend();
  bool pick_locked(Chunk* out);
  int take_fault_locked(IoKind kind);
  void finish_chunk_locked(const Chunk& c, std::shared_ptr<const IoError> error);
  void complete_locked(Request& r, std::shared_ptr<const IoError> error);
  void wake();
  Span span(const Chunk& c) const;
  IoError chunk_error(const Chunk& c, int code, const std::string& text) const;
  IoError chunk_errno(const Chunk& c, int code) const;  // chunk_error with the errno's text
  IoError short_read(const Chunk& c, size_t done) const;
  void check_chunk(const Chunk& c, int fault) const;  // throws the IoError of an injected fault or a changed file
  // threads backend (nvme_io.cpp)
  void worker();
  void run_chunk(const Chunk& c, int fault, char* bounce);
  // io_uring backend (nvme_uring.cpp)
  void ring_worker();
  void ring_start_locked(RingSlot& s, double delay_s);
  void ring_issue_locked(RingSlot& s);
  void ring_submit(RingSlot& s, int part);
  void ring_complete_locked(RingSlot& s, int part, int res);
  void ring_finish_locked(RingSlot& s, std::shared_ptr<const IoError> error);
  const Region& region_locked(size_t region, const char* arg) const;

  const std::string directory_;
  const FileStoreOptions options_;
  bool direct_ = false;
  std::string direct_reason_, backend_reason_;
  IoBackend backend_ = IoBackend::Threads;
  std::unique_ptr<Uring> ring_;  // the io_uring backend's ring (closed by close())
  int wake_fd_ = -1;             // eventfd the ring thread keeps a read on
  uint64_t wake_buf_ = 0;

  mutable std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<Region> regions_;                                    // stable addresses
  std::vector<std::vector<std::shared_ptr<Request>>> in_flight_;  // per region, unfinished requests
  std::deque<std::shared_ptr<Request>> queue_;                    // requests with chunks not yet started
  size_t outstanding_ = 0;                                        // unfinished requests
  int fault_code_[2] = {0, 0}, fault_count_[2] = {0, 0};
  bool stopping_ = false, closed_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace rp
