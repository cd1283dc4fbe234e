#include "nvme_io.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>

#include "checks.h"

namespace rp {
namespace {

constexpr size_t kAlign = FileStore::kAlign;

std::string errno_text(int code) {
  char buf[256];
  // GNU strerror_r returns the message (possibly not in buf).
  return std::string(strerror_r(code, buf, sizeof buf));
}

const char* verb(IoKind k) { return k == IoKind::Read ? "reading" : "writing"; }

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A 4096-aligned heap block (the bounce buffer of a thread).
struct AlignedBlock {
  explicit AlignedBlock(size_t n) {
    if (posix_memalign(&p, kAlign, n) != 0) throw std::bad_alloc();
  }
  ~AlignedBlock() { std::free(p); }
  void* p = nullptr;
};

// pread/pwrite of exactly n bytes at off, looping over partial transfers and EINTR.
// Returns 0, or the errno; *done gets the bytes transferred (a read at end of file
// returns 0 with *done < n).
int transfer(IoKind kind, int fd, char* buf, size_t n, size_t off, size_t* done) {
  *done = 0;
  while (*done < n) {
    const ssize_t r = kind == IoKind::Read ? ::pread(fd, buf + *done, n - *done, static_cast<off_t>(off + *done))
                                           : ::pwrite(fd, buf + *done, n - *done, static_cast<off_t>(off + *done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return kind == IoKind::Read ? 0 : EIO;  // pwrite never returns 0 for n > 0
    *done += static_cast<size_t>(r);
  }
  return 0;
}

}  // namespace

// ---- IoFence -----------------------------------------------------------------------------------

FenceState IoFence::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

FenceState IoFence::block() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return state_ != FenceState::Pending; });
  return state_;
}

std::string IoFence::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_ ? error_->what() + std::string(": ") + error_->path() : std::string();
}

void IoFence::wait_io() {
  block();
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) throw *error_;
}

bool IoFence::done_io() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) throw *error_;
  return state_ == FenceState::Done;
}

void IoFence::finish(std::shared_ptr<const IoError> error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != FenceState::Pending) return;
    error_ = std::move(error);
    state_ = error_ ? FenceState::Failed : FenceState::Done;
  }
  cv_.notify_all();
}

// ---- FileStore ---------------------------------------------------------------------------------

FileStore::FileStore(std::string directory, const FileStoreOptions& options)
    : directory_(std::move(directory)), options_(options) {
  check::threads("threads", options.threads);
  if (options.chunk_bytes < kAlign || options.chunk_bytes % kAlign || options.chunk_bytes > (size_t{1} << 30))
    throw std::invalid_argument("chunk_bytes=" + std::to_string(options.chunk_bytes) +
                                " must be a multiple of 4096 between 4096 and 1 GiB");
  if (!(options.delay_s >= 0 && options.delay_s <= FileStoreOptions::kMaxDelay))
    throw std::invalid_argument("delay_s=" + check::num(options.delay_s) + " must be in [0, 10]");
  if (directory_.empty() || directory_.find('\0') != std::string::npos)
    throw std::invalid_argument("directory='" + directory_ + "' must be a non-empty path");
  struct stat st;
  if (::stat(directory_.c_str(), &st) != 0) {
    const int e = errno;
    throw IoError(e, directory_, errno_text(e) + " (the store's directory)");
  }
  if (!S_ISDIR(st.st_mode)) throw IoError(ENOTDIR, directory_, errno_text(ENOTDIR) + " (the store's directory)");
  probe_direct();
  pick_backend();
  if (ring_) {
    threads_.emplace_back([this] { ring_worker(); });
    return;
  }
  threads_.reserve(options.threads);
  for (int t = 0; t < options.threads; ++t) threads_.emplace_back([this] { worker(); });
}

FileStore::~FileStore() { close(); }

// Whether files here take O_DIRECT: open a probe file with it and write one block.
void FileStore::probe_direct() {
  if (options_.direct == DirectMode::Off) {
    direct_reason_ = "direct='off'";
    return;
  }
  const std::string path = directory_ + "/.roundpipe-direct-probe";
  std::string why;
  if (options_.simulate_no_direct) {
    why = "open with O_DIRECT: " + errno_text(EINVAL) + " (simulated)";
  } else {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
      const int e = errno;
      if (e != EINVAL) throw IoError(e, path, errno_text(e) + " while creating the O_DIRECT probe file");
      why = "open with O_DIRECT: " + errno_text(e);
    } else {
      AlignedBlock block(kAlign);
      std::memset(block.p, 0, kAlign);
      size_t done = 0;
      const int e = transfer(IoKind::Write, fd, static_cast<char*>(block.p), kAlign, 0, &done);
      ::close(fd);
      if (e == EINVAL) why = "an aligned O_DIRECT write: " + errno_text(e);
      else if (e) {
        ::unlink(path.c_str());
        throw IoError(e, path, errno_text(e) + " while writing the O_DIRECT probe file");
      }
    }
    ::unlink(path.c_str());
  }
  if (why.empty()) {
    direct_ = true;
    direct_reason_ = "O_DIRECT";
    return;
  }
  if (options_.direct == DirectMode::On)
    throw std::invalid_argument("direct='on' but the file system of " + directory_ + " does not take O_DIRECT (" +
                                why + "); pass direct='auto' for buffered I/O");
  direct_reason_ = why;
}

// io_uring when the kernel gives a ring with the opcodes (and an eventfd to wake it), else the threads.
void FileStore::pick_backend() {
  if (options_.backend == IoBackend::Threads) {
    backend_reason_ = "backend='threads'";
    return;
  }
  std::string why;
  if (options_.simulate_no_uring) {
    why = "io_uring_setup: " + errno_text(EPERM) + " (simulated)";
  } else if ((ring_ = Uring::open(2 * static_cast<unsigned>(options_.threads) + 2, &why))) {
    // Each chunk in flight holds at most two entries (body and tail, or its delay), plus the wake read.
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      why = "eventfd: " + errno_text(errno);
      ring_.reset();
    }
  }
  if (ring_) {
    backend_ = IoBackend::Uring;
    backend_reason_ = options_.backend == IoBackend::Uring ? "backend='io_uring'" : "io_uring_setup succeeded";
    return;
  }
  if (options_.backend == IoBackend::Uring)
    throw std::invalid_argument("backend='io_uring' but this process cannot use io_uring (" + why +
                                "); pass backend='auto' to fall back to the thread pool");
  backend_reason_ = why;
}

size_t FileStore::allocate(const std::string& name, size_t nbytes) {
  if (name.empty() || name == "." || name == ".." || name.size() > 200 ||
      name.find_first_of(std::string("/\0", 2)) != std::string::npos || name[0] == '.')
    throw std::invalid_argument("name='" + name + "' must be a file name: 1-200 characters, no '/' or NUL, "
                                "not starting with '.'");
  check::at_most("nbytes", nbytes, check::kMaxBytes / kAlign * kAlign, "the largest possible file region");
  const std::string path = directory_ + "/" + name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw std::runtime_error("the file store is closed");
    for (const Region& r : regions_)
      if (r.name == name) throw std::invalid_argument("name='" + name + "' is already a region of this store");
  }
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) {
    const int e = errno;
    if (e == EEXIST) throw std::invalid_argument("name='" + name + "': the file " + path + " already exists");
    throw IoError(e, path, errno_text(e) + " while creating the file of region '" + name + "'");
  }
  const size_t file_bytes = round_up(nbytes);
  if (file_bytes > 0 && ::fallocate(fd, 0, 0, static_cast<off_t>(file_bytes)) != 0) {
    int e = errno;
    // No fallocate on this file system: a sparse file of the right size (space not reserved).
    if ((e == EOPNOTSUPP || e == ENOSYS) && ::ftruncate(fd, static_cast<off_t>(file_bytes)) == 0) e = 0;
    if (e) {
      ::close(fd);
      ::unlink(path.c_str());
      throw IoError(e, path, errno_text(e) + " while preallocating " + std::to_string(file_bytes) +
                                 " bytes for region '" + name + "'");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {  // closed while preallocating
    ::close(fd);
    throw std::runtime_error("the file store is closed");
  }
  regions_.push_back(Region{name, path, fd, nbytes, file_bytes});
  in_flight_.emplace_back();
  return regions_.size() - 1;
}

const FileStore::Region& FileStore::region_locked(size_t region, const char* arg) const {
  if (region >= regions_.size())
    throw std::invalid_argument(std::string(arg) + "=" + std::to_string(region) + " is not a region of this store (" +
                                std::to_string(regions_.size()) + " allocated)");
  return regions_[region];
}

std::shared_ptr<IoFence> FileStore::submit(IoKind kind, size_t region, size_t offset, void* buf, size_t nbytes) {
  const auto addr = reinterpret_cast<std::uintptr_t>(buf);
  check::span("buffer", addr, nbytes, 1, 1);
  if (nbytes && addr % kAlign)
    throw std::invalid_argument("buffer=" + check::hex(addr) + " is not aligned to 4096 bytes (O_DIRECT)");
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || stopping_) throw std::runtime_error("the file store is closed");
  const Region& reg = region_locked(region, "region");
  if (offset % kAlign || offset > reg.nbytes)
    throw std::invalid_argument("offset=" + std::to_string(offset) + " must be a multiple of 4096 within region '" +
                                reg.name + "' (" + std::to_string(reg.nbytes) + " bytes)");
  if (nbytes > reg.nbytes - offset)
    throw std::invalid_argument("nbytes=" + std::to_string(nbytes) + " at offset=" + std::to_string(offset) +
                                " runs past the end of region '" + reg.name + "' (" + std::to_string(reg.nbytes) +
                                " bytes)");
  if (kind == IoKind::Write && (offset + nbytes) % kAlign && offset + nbytes != reg.nbytes)
    throw std::invalid_argument("a write must end at a multiple of 4096 or at the region's end: offset=" +
                                std::to_string(offset) + " + nbytes=" + std::to_string(nbytes) + " in region '" +
                                reg.name + "' (" + std::to_string(reg.nbytes) + " bytes)");
  auto r = std::make_shared<Request>();
  r->kind = kind, r->reg = &regions_[region], r->region = region, r->offset = offset, r->nbytes = nbytes, r->buf = static_cast<char*>(buf);
  r->chunks = r->remaining = (nbytes + options_.chunk_bytes - 1) / options_.chunk_bytes;
  r->fence = std::make_shared<IoFence>();
  // Conflicts in whole blocks: a write's last block is written whole.
  const size_t begin = offset, end = round_up(offset + nbytes);
  auto& flight = in_flight_[region];
  flight.erase(std::remove_if(flight.begin(), flight.end(), [](const auto& q) { return q->finished; }), flight.end());
  for (const auto& q : flight)
    if ((kind == IoKind::Write || q->kind == IoKind::Write) && q->offset < end && begin < round_up(q->offset + q->nbytes))
      r->after.push_back(q);
  if (r->chunks == 0) {  // nothing to transfer: done at once, or once the requests it orders after are
    if (r->after.empty()) {
      r->finished = true;
      r->fence->finish(nullptr);
      return r->fence;
    }
    r->chunks = r->remaining = 1;  // one empty chunk keeps the order
  }
  flight.push_back(r);
  queue_.push_back(r);
  ++outstanding_;
  work_cv_.notify_all();
  wake();
  return r->fence;
}

// The next chunk whose request's predecessors finished, in submission order.
// A read of a region whose last write failed fails without running.
bool FileStore::pick_locked(Chunk* out) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    Request& r = **it;
    const bool ready = std::all_of(r.after.begin(), r.after.end(), [](const auto& q) { return q->finished; });
    if (!ready) {
      ++it;
      continue;
    }
    const Region& reg = *r.reg;
    if (r.next == 0 && r.kind == IoKind::Read && reg.poisoned) {
      auto self = *it;  // keeps r alive past the erase
      it = queue_.erase(it);
      complete_locked(r, std::make_shared<IoError>(
                             reg.poisoned->code(), reg.path,
                             "reading " + std::to_string(r.nbytes) + " bytes at offset " + std::to_string(r.offset) +
                                 " of region '" + reg.name + "' after a failed write to it (" +
                                 reg.poisoned->what() + "); write the whole region again to use it"));
      continue;
    }
    *out = Chunk{*it, r.next++};
    if (r.next == r.chunks) queue_.erase(it);
    return true;
  }
  return false;
}

// The errno a chunk of `kind` should fail with instead of its I/O (inject_fault), or 0.
int FileStore::take_fault_locked(IoKind kind) {
  const int k = static_cast<int>(kind);
  if (fault_count_[k] == 0) return 0;
  --fault_count_[k];
  return fault_code_[k];
}

// A chunk ended (failed when `error` is set); the request completes with its last chunk.
void FileStore::finish_chunk_locked(const Chunk& c, std::shared_ptr<const IoError> error) {
  Request& r = *c.request;
  if (error && (!r.error || c.index < r.error_chunk)) r.error = std::move(error), r.error_chunk = c.index;
  if (--r.remaining == 0) complete_locked(r, r.error);
}

void FileStore::complete_locked(Request& r, std::shared_ptr<const IoError> error) {
  if (r.kind == IoKind::Write && error) r.reg->poisoned = error;
  else if (r.kind == IoKind::Write && r.offset == 0 && r.nbytes == r.reg->nbytes) r.reg->poisoned = nullptr;
  r.finished = true;
  r.error = error;
  r.fence->finish(std::move(error));
  --outstanding_;
  work_cv_.notify_all();  // requests ordered after this one may run now
  if (outstanding_ == 0) idle_cv_.notify_all();
}

void FileStore::worker() {
  AlignedBlock bounce(kAlign);
  std::minstd_rand rng(static_cast<unsigned>(std::hash<std::thread::id>()(std::this_thread::get_id())));
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    Chunk c;
    work_cv_.wait(lock, [&] { return pick_locked(&c) || (stopping_ && queue_.empty()); });
    if (!c.request) return;
    std::shared_ptr<const IoError> error;
    if (!c.request->error) {  // else an earlier chunk failed: this one is skipped
      const int fault = take_fault_locked(c.request->kind);
      lock.unlock();
      try {
        if (options_.delay_s > 0)
          std::this_thread::sleep_for(std::chrono::duration<double>(options_.delay_s * (rng() % 1000) / 1000.0));
        run_chunk(c, fault, static_cast<char*>(bounce.p));
      } catch (const IoError& e) {
        error = std::make_shared<IoError>(e);
      }
      lock.lock();
    }
    finish_chunk_locked(c, std::move(error));
  }
}

FileStore::Span FileStore::span(const Chunk& c) const {
  const Request& r = *c.request;
  const size_t start = c.index * options_.chunk_bytes;
  const size_t len = std::min(options_.chunk_bytes, r.nbytes - std::min(start, r.nbytes));
  return Span{r.buf + start, r.offset + start, len, len / kAlign * kAlign, len % kAlign};
}

IoError FileStore::chunk_error(const Chunk& c, int code, const std::string& text) const {
  const Request& r = *c.request;
  const Span sp = span(c);
  return IoError(code, r.reg->path, text + " while " + verb(r.kind) + " " + std::to_string(sp.len) +
                                        " bytes at offset " + std::to_string(sp.off) + " of region '" + r.reg->name + "'");
}

IoError FileStore::chunk_errno(const Chunk& c, int code) const { return chunk_error(c, code, errno_text(code)); }

IoError FileStore::short_read(const Chunk& c, size_t done) const {
  return chunk_error(c, ENODATA, "short read (" + std::to_string(done) + " bytes: end of file)");
}

void FileStore::check_chunk(const Chunk& c, int fault) const {
  if (fault) throw chunk_error(c, fault, errno_text(fault) + " (injected)");
  // Truncated or removed underneath: a write would silently re-extend or land in an unlinked inode.
  const Region& reg = *c.request->reg;
  struct stat st;
  if (::fstat(reg.fd, &st) != 0) {
    throw chunk_errno(c, errno);
  }
  if (st.st_nlink == 0) throw chunk_error(c, ENOENT, errno_text(ENOENT) + ": the file was removed underneath");
  if (static_cast<size_t>(st.st_size) < reg.file_bytes)
    throw chunk_error(c, ENODATA, "the file was truncated underneath to " + std::to_string(st.st_size) + " of " +
                                      std::to_string(reg.file_bytes) + " bytes");
}

// One chunk's I/O on a pool thread, mu_ not held (`fault`: an injected errno instead).  Throws IoError.
void FileStore::run_chunk(const Chunk& c, int fault, char* bounce) {
  check_chunk(c, fault);
  const IoKind kind = c.request->kind;
  const int fd = c.request->reg->fd;
  const Span sp = span(c);
  if (sp.len == 0) return;
  size_t done = 0;
  int e = transfer(kind, fd, sp.buf, sp.body, sp.off, &done);
  if (e) throw chunk_errno(c, e);
  if (done < sp.body) throw short_read(c, done);
  if (!sp.tail) return;
  // The last partial block through the bounce block: written whole, zero-padded; read whole.
  if (kind == IoKind::Write) {
    std::memcpy(bounce, sp.buf + sp.body, sp.tail);
    std::memset(bounce + sp.tail, 0, kAlign - sp.tail);
  }
  e = transfer(kind, fd, bounce, kAlign, sp.off + sp.body, &done);
  if (e) throw chunk_errno(c, e);
  if (done < sp.tail) throw short_read(c, sp.body + done);
  if (kind == IoKind::Read) std::memcpy(sp.buf + sp.body, bounce, sp.tail);
}

void FileStore::synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
}

void FileStore::close() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    stopping_ = true;
    idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
    work_cv_.notify_all();
    wake();
  }
  for (auto& t : threads_) t.join();
  ring_.reset();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
  std::lock_guard<std::mutex> lock(mu_);
  for (Region& r : regions_) {
    if (r.fd >= 0) ::close(r.fd);
    r.fd = -1;
  }
  closed_ = true;
}

void FileStore::inject_fault(IoKind kind, int code, int count) {
  if (code <= 0 || code > 4095) throw std::invalid_argument("code=" + std::to_string(code) + " must be an errno (1-4095)");
  if (count < 0) throw std::invalid_argument("count=" + std::to_string(count) + " must be >= 0");
  std::lock_guard<std::mutex> lock(mu_);
  fault_code_[static_cast<int>(kind)] = code;
  fault_count_[static_cast<int>(kind)] = count;
}

size_t FileStore::num_regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

std::string FileStore::region_path(size_t region) const {
  std::lock_guard<std::mutex> lock(mu_);
  return region_locked(region, "region").path;
}

size_t FileStore::region_bytes(size_t region) const {
  std::lock_guard<std::mutex> lock(mu_);
  return region_locked(region, "region").nbytes;
}

bool FileStore::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

}  // namespace rp
