// The host-env step without Python: an XLA FFI handler (CPU) that makes one step of a
// WorkerGroup's envs the way WorkerGroup.step does, but on XLA's own thread, never taking the
// interpreter lock.
//
// Built by _fast.py at first use; the Python side (_group.py, _host.py) stays the reference and
// takes over for anything that is not the plain case: this handler only ever does
//   actions -> shared memory, one 16-byte STEP header per worker, one 16-byte OK header back
//   from each, results <- shared memory,
// and otherwise returns a status saying where it stopped:
//   OK        the step is done, the outputs are written;
//   NOT_SENT  nothing was sent (the group is not armed, the state is not the live session or
//             not the step due, a forked process, or answers to a step handed to Python are
//             still owed: an interrupt cut it short): Python makes the whole step;
//   PENDING   the step went out but not every worker answered it with a plain OK (it raised,
//             died, or took longer than ctl[WAIT_NS]): Python collects the answers still owed
//             by the workers in ctl[PENDING] (a bit per worker) and finishes the step.
// A message that is not a plain OK is only peeked, never consumed, so Python reads it whole.
//
// The group's state lives in its `ctl` block of int64s (a NumPy array Python owns and never
// frees), shared by both sides under ctl[LOCK]. See the C_* constants in _fast.py.

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Ctl {
  LOCK = 0, ARMED, OWNER, SESSION, T, SEQ, PENDING, FAST_STEPS, NWORKERS, WAIT_NS, START_NS,
  ACTION, ACTION_BYTES, OBS, OBS_BYTES, REWARD, TERM, TRUNC, FINAL, ROWS, FDS = 32,
};
constexpr int kMaxWorkers = 63;  // PENDING is a bit mask
constexpr int kSlots = 1 << 16;  // groups bound in one process (a block each, never freed)
enum Status { OK = 0, NOT_SENT = 1, SENT_PENDING = 2 };
constexpr uint8_t kStep = 4, kOk = 5;  // _worker.STEP, _worker.OK
constexpr uint8_t kTerm = 1, kTrunc = 2, kGoesOn = 8;  // _host._TERM, _TRUNC, _GOES_ON

int64_t* g_slots[kSlots];  // ctl blocks, by slot

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// ctl[LOCK]: 0 free, 1 held by the handler, 2 held by Python (hostenv_trylock), so that Python
// can tell after an interrupt whether it got the lock.
bool try_lock(int64_t* ctl, int64_t holder) {
  int64_t free = 0;
  return __atomic_compare_exchange_n(&ctl[LOCK], &free, holder, false, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED);
}

void lock(int64_t* ctl) {
  for (int spins = 0; !try_lock(ctl, 1); ++spins) {
    if (spins < 100) {
      sched_yield();
    } else {
      timespec pause{0, 100000};  // held across a whole step elsewhere: don't burn a core
      nanosleep(&pause, nullptr);
    }
  }
}

void unlock(int64_t* ctl) { __atomic_store_n(&ctl[LOCK], 0, __ATOMIC_RELEASE); }

struct Header {  // _worker._HEADER: "<BxxxIq"
  uint8_t kind;
  uint8_t pad[3];
  uint32_t size;
  int64_t seq;
};
static_assert(sizeof(Header) == 16, "the wire header is 16 bytes");

// All of `n` bytes, as Python's sendall (the sockets are non-blocking: Python set a timeout).
bool send_exactly(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t k = send(fd, data, n, MSG_NOSIGNAL);
    if (k > 0) {
      data += k, n -= size_t(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 200) < 0 && errno != EINTR) return false;
    } else {
      return false;
    }
  }
  return true;
}

// Sends the step to every worker; false if a socket refused it (its worker is dead: Python
// reports it with its exit code).
bool send_all(const int64_t* ctl, int64_t seq) {
  Header h{kStep, {0, 0, 0}, 0, seq};
  bool ok = true;
  for (int i = 0; i < ctl[NWORKERS]; ++i) {
    if (!send_exactly(int(ctl[FDS + i]), reinterpret_cast<const char*>(&h), sizeof h)) ok = false;
  }
  return ok;
}

// Consumes each pending worker's answer if it is a plain OK of `seq`; returns the workers
// still owing one ctl[WAIT_NS] after the step's start (or at the first answer that is anything
// else). An answer found after that is left for Python, which holds it to the step's timeout.
uint64_t receive_all(const int64_t* ctl, int64_t seq) {
  const int n = int(ctl[NWORKERS]);
  uint64_t pending = (1ull << n) - 1;
  const int64_t deadline = ctl[START_NS] + ctl[WAIT_NS];
  pollfd fds[kMaxWorkers];
  while (pending) {
    int k = 0, who[kMaxWorkers];
    for (int i = 0; i < n; ++i) {
      if (pending >> i & 1) fds[k] = {int(ctl[FDS + i]), POLLIN, 0}, who[k++] = i;
    }
    const int64_t left_ns = deadline - now_ns();
    if (left_ns < 0) return pending;
    const int ready = poll(fds, k, int((left_ns + 999999) / 1000000));
    if (ready < 0 || now_ns() > deadline) return pending;  // interrupted, or too late
    for (int j = 0; j < k; ++j) {
      if (!fds[j].revents) continue;
      Header h;
      const ssize_t got = recv(fds[j].fd, &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
      if (got != ssize_t(sizeof h) || h.kind != kOk || h.size != 0 || h.seq != seq) {
        return pending;  // an error, a death, a part-way message: Python's to read
      }
      recv(fds[j].fd, &h, sizeof h, MSG_DONTWAIT);
      pending &= ~(1ull << who[j]);
    }
  }
  return 0;
}

template <typename T>
bool all_equal(const T* x, size_t n) {
  for (size_t i = 1; i < n; ++i) {
    if (x[i] != x[0]) return false;
  }
  return true;
}

void copy_results(const int64_t* ctl, void* obs, float* reward, uint8_t* flags, void* final_obs) {
  const size_t rows = size_t(ctl[ROWS]);
  std::memcpy(obs, reinterpret_cast<const void*>(ctl[OBS]), size_t(ctl[OBS_BYTES]));
  std::memcpy(final_obs, reinterpret_cast<const void*>(ctl[FINAL]), size_t(ctl[OBS_BYTES]));
  const double* r = reinterpret_cast<const double*>(ctl[REWARD]);
  // terminated: bit 0 the episode ended, bit 1 the game goes on (_worker.TERMINATED, GOES_ON)
  const uint8_t* te = reinterpret_cast<const uint8_t*>(ctl[TERM]);
  const bool* tr = reinterpret_cast<const bool*>(ctl[TRUNC]);
  for (size_t i = 0; i < rows; ++i) {
    reward[i] = float(r[i]);
    flags[i] = uint8_t((te[i] & 1 ? kTerm : 0) | (te[i] & 2 ? kGoesOn : 0) | (tr[i] ? kTrunc : 0));
  }
}

// The step itself, under the lock; `status` says how far it got (see the top of the file).
int32_t step_locked(int64_t* ctl, const uint32_t* session, const int32_t* t, size_t rows,
                    const ffi::AnyBuffer& action, void* obs, float* reward, uint8_t* flags,
                    void* final_obs) {
  if (!ctl[ARMED] || ctl[OWNER] != getpid() || size_t(ctl[ROWS]) != rows ||
      size_t(ctl[ACTION_BYTES]) != action.size_bytes() || !all_equal(session, rows) ||
      !all_equal(t, rows) || int64_t(session[0]) != ctl[SESSION] ||
      t[0] != int32_t(uint32_t(ctl[T])) ||  // the device's int32 counter wraps; ctl[T] does not
      ctl[PENDING] != 0) {  // Python clears it once it has the answers it was handed
    return NOT_SENT;
  }
  std::memcpy(reinterpret_cast<void*>(ctl[ACTION]), action.untyped_data(), action.size_bytes());
  const int64_t seq = ctl[SEQ]++;
  ctl[START_NS] = now_ns();
  ctl[PENDING] = (int64_t(1) << ctl[NWORKERS]) - 1;
  if (!send_all(ctl, seq)) return SENT_PENDING;
  const uint64_t pending = receive_all(ctl, seq);
  ctl[PENDING] = int64_t(pending);
  if (pending) return SENT_PENDING;
  copy_results(ctl, obs, reward, flags, final_obs);
  ctl[T] += 1;
  ctl[FAST_STEPS] += 1;
  return OK;
}

ffi::Error Step(ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::PRED> lead,
                ffi::Buffer<ffi::U32> session, ffi::Buffer<ffi::S32> t, ffi::AnyBuffer action,
                ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::Result<ffi::Buffer<ffi::U32>> session_out,
                ffi::Result<ffi::AnyBuffer> obs, ffi::Result<ffi::Buffer<ffi::F32>> reward,
                ffi::Result<ffi::Buffer<ffi::U8>> flags, ffi::Result<ffi::AnyBuffer> final_obs,
                int64_t slot) {
  const size_t rows = session.element_count();
  std::memcpy(session_out->typed_data(), session.typed_data(), rows * sizeof(uint32_t));
  int32_t* out = status->typed_data();
  const int64_t s = slot + group.typed_data()[0];
  if (!lead.typed_data()[0]) {  // a replica of a member spanning devices: only its leader steps
    std::memset(obs->untyped_data(), 0, obs->size_bytes());
    std::memset(final_obs->untyped_data(), 0, final_obs->size_bytes());
    std::memset(reward->typed_data(), 0, rows * sizeof(float));
    std::memset(flags->typed_data(), 0, rows);
    *out = OK;
    return ffi::Error::Success();
  }
  int64_t* ctl = (s >= 0 && s < kSlots) ? __atomic_load_n(&g_slots[s], __ATOMIC_ACQUIRE) : nullptr;
  if (ctl == nullptr) {
    *out = NOT_SENT;
    return ffi::Error::Success();
  }
  lock(ctl);
  *out = step_locked(ctl, session.typed_data(), t.typed_data(), rows, action, obs->untyped_data(),
                     reward->typed_data(), flags->typed_data(), final_obs->untyped_data());
  unlock(ctl);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostenvStep, Step,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slot"));

extern "C" {
// ctypes entry points (ctypes releases the interpreter lock while they run).
int hostenv_abi() { return 1; }
int hostenv_register(int64_t slot, int64_t* ctl) {
  if (slot < 0 || slot >= kSlots) return -1;
  __atomic_store_n(&g_slots[slot], ctl, __ATOMIC_RELEASE);
  return 0;
}
void hostenv_lock(int64_t* ctl) { lock(ctl); }
int hostenv_trylock(int64_t* ctl) { return try_lock(ctl, 2); }
void hostenv_unlock(int64_t* ctl) { unlock(ctl); }
}
