// gradavg::timeline: where a call's time goes, as events in the Chrome trace event format
// (chrome://tracing, https://ui.perfetto.dev), one file per process, and each call's profile
// across processes (bytes on the wire, time in the local pass and waiting on the wire, the
// overlap). Off unless the caller passes one: options.run.timeline is a pointer, and a call with
// none makes one test of it.
//
//   auto line = gradavg::timeline::from_environment();  // GRADAVG_TIMELINE=trace.%r.json, or null
//   opts.run.timeline = line.get();
//   ... calls ...
//   line->write();  // or at its end
//
// What the calls record (docs/timeline.md lists every event): the checks and the pass of a call
// in one process; across processes the checks, the agreement, each bucket's fill, sum and unpack
// on the calling thread with the waits inside them, each bucket's time on the wire (from its
// contributions' departure to its last sum's arrival) on a lane per bucket in flight, and the
// last collective.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include "errors.hpp"

namespace gradavg {

/// A timeline's file cannot be written.
class timeline_error : public error {
  using error::error;
};

/// Which row of a process's timeline an event sits on (the trace's "tid").
enum class lane : unsigned char {
  /// A call's own work: checks, agreement, the local pass, a bucket's fill, sum and unpack; a row
  /// per thread that calls ("call", then "call, thread 1", ...).
  call,
  /// A bucket on the wire, from its contributions' departure to the arrival of its last sum;
  /// one row per bucket in flight (the event's index: its set, 0 to 2).
  wire,
  /// Anything else (user code's own events); a row per thread, as for call.
  other,
};

/// One call's profile across processes (timeline::last_call()): what this process moved and
/// where its time went, from its own clock. Bytes count the buckets' messages, not the agreement's
/// few words.
struct call_profile {
  std::size_t buckets = 0;
  std::uint64_t local_bytes = 0;     ///< gradients read and outputs written on this process
  std::uint64_t sent_bytes = 0;      ///< the buckets' bytes sent to the other processes
  std::uint64_t received_bytes = 0;  ///< and received from them
  double seconds = 0;                ///< the call, from its checks to its last collective
  double local_seconds = 0;          ///< the local pass: fills, owners' sums, unpacks (waits excluded)
  double wait_seconds = 0;           ///< blocked on the wire: the buckets' waits
  /// The local pass's time while some bucket was on the wire (sent, its sums not yet received).
  double overlapped_seconds = 0;

  /// The share of the local pass that ran while buckets were on the wire: 1 when every bucket
  /// but the first's fill and the last's unpack hid behind the exchange; 0 without local time.
  [[nodiscard]] double overlap() const noexcept { return local_seconds > 0 ? overlapped_seconds / local_seconds : 0; }
};

/// A process's events, kept in memory (a fixed capacity, allocated once) and written as one
/// Chrome trace file. Recording is thread-safe and allocates nothing; write() and clear() must
/// not run beside a call that records. Not copyable or movable: calls hold its address.
class timeline {
 public:
  /// Events kept by default: 65,536 (48 bytes each), about 100 calls over ResNet-50's layout
  /// across processes.
  static constexpr std::size_t default_capacity = std::size_t{1} << 16;

  /// Events go to `path` when written, each "%r" in it replaced by the process (the rank of the
  /// last call across processes that recorded, 0 before any): "trace.%r.json" gives a file per
  /// rank. Events past `capacity` are dropped and counted (dropped()).
  explicit timeline(std::string path, std::size_t capacity = default_capacity)
      : path_(std::move(path)), capacity_(capacity), events_(new event[capacity == 0 ? 1 : capacity]) {}

  /// A timeline to GRADAVG_TIMELINE's path, or null where it is unset or empty. Reads the
  /// environment when called, never otherwise.
  [[nodiscard]] static std::unique_ptr<timeline> from_environment(std::size_t capacity = default_capacity) {
    const char* path = std::getenv("GRADAVG_TIMELINE");
    if (path == nullptr || *path == '\0') return nullptr;
    return std::make_unique<timeline>(path, capacity);
  }

  timeline(const timeline&) = delete;
  timeline& operator=(const timeline&) = delete;

  /// Writes the events recorded since the last write, if any; an error here is dropped (call
  /// write() to see it).
  ~timeline() {
    if (written_ == size()) return;
    try {
      write();
    } catch (...) {
    }
  }

  /// Nanoseconds on the clock of every event: steady_clock, which on Linux is CLOCK_MONOTONIC,
  /// the same for every process of a machine.
  [[nodiscard]] static std::uint64_t now() noexcept {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }

  /// Records an event from `begin` to `end` (now() values) on `where`, row `index` of it.
  /// `name`: a string that outlives the timeline (a literal). `arg`: the bucket, or -1.
  void record(lane where, const char* name, std::uint64_t begin, std::uint64_t end, std::int64_t arg = -1,
              unsigned index = 0) noexcept {
    const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= capacity_) return;
    events_[i] = {name,  begin, end < begin ? begin : end, arg, std::hash<std::thread::id>{}(std::this_thread::get_id()),
                  static_cast<std::uint32_t>(where), index};
  }

  /// The process the events belong to (the trace's "pid"): set by every call across processes
  /// to its rank.
  void process(int id) noexcept { process_.store(id, std::memory_order_relaxed); }
  [[nodiscard]] int process() const noexcept { return process_.load(std::memory_order_relaxed); }

  /// Events held, and dropped for want of capacity, since the last clear().
  [[nodiscard]] std::size_t size() const noexcept {
    const std::size_t n = next_.load(std::memory_order_relaxed);
    return n < capacity_ ? n : capacity_;
  }
  [[nodiscard]] std::size_t dropped() const noexcept {
    const std::size_t n = next_.load(std::memory_order_relaxed);
    return n > capacity_ ? n - capacity_ : 0;
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// Forgets every event (the file keeps what was written).
  void clear() noexcept {
    next_.store(0, std::memory_order_relaxed);
    written_ = 0;
  }

  /// The file write() writes: the path, each "%r" replaced by process().
  [[nodiscard]] std::string file() const {
    std::string out;
    const std::string id = std::to_string(process());
    for (std::size_t i = 0; i < path_.size(); ++i) {
      if (path_[i] == '%' && i + 1 < path_.size() && path_[i + 1] == 'r') {
        out += id;
        ++i;
      } else {
        out += path_[i];
      }
    }
    return out;
  }

  /// Writes every event held, in the trace event format's object form (replacing the file):
  /// complete events ("ph": "X", microseconds), the rows' names, and in "otherData" the dropped
  /// count and the machine's name (host). Throws timeline_error when the file cannot be written.
  void write() {
    const std::string name = file();
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(name.c_str(), "w"), &std::fclose);
    if (!f) throw timeline_error("gradavg::timeline: cannot open " + name + " for writing");
    const int pid = process();
    const std::size_t n = size();
    bool ok = std::fprintf(f.get(), "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"dropped\":%zu,\"clock\":\"steady_clock\","
                                    "\"host\":\"",
                           dropped()) > 0 &&
              put_escaped(f.get(), host().c_str()) && std::fputs("\"},\n\"traceEvents\":[\n", f.get()) >= 0;
    ok = ok && std::fprintf(f.get(), "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"gradavg rank %d\"}}",
                            pid, pid) > 0;
    // The rows: call and other a row per thread, in the order the threads first recorded.
    std::vector<std::pair<std::uint64_t, unsigned>> threads[2];  // (thread, its rank) per lane
    std::vector<unsigned> row(n);
    for (std::size_t i = 0; i < n; ++i) {
      const event& e = events_[i];
      if (e.where == static_cast<std::uint32_t>(lane::wire)) {
        row[i] = 1 + e.index % 3;
        continue;
      }
      auto& seen = threads[e.where == static_cast<std::uint32_t>(lane::call) ? 0 : 1];
      unsigned k = 0;
      while (k < seen.size() && seen[k].first != e.thread) ++k;
      if (k == seen.size()) seen.emplace_back(e.thread, k);
      row[i] = thread_row(e.where == static_cast<std::uint32_t>(lane::call), k);
    }
    for (unsigned t = 1; t <= 3; ++t)
      ok = ok && std::fprintf(f.get(),
                              ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%u,\"args\":{\"name\":\"wire %u\"}}",
                              pid, t, t - 1) > 0;
    for (int l = 0; l < 2; ++l)
      for (std::size_t k = 0; k < threads[l].size(); ++k)
        ok = ok && std::fprintf(f.get(),
                                ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%u,\"args\":{\"name\":\"%s%s%.0zu\"}}",
                                pid, thread_row(l == 0, static_cast<unsigned>(k)), l == 0 ? "call" : "other",
                                k == 0 ? "" : ", thread ", k) > 0;
    for (std::size_t i = 0; i < n && ok; ++i) {
      const event& e = events_[i];
      ok = std::fputs(",\n{\"name\":\"", f.get()) >= 0 && put_escaped(f.get(), e.name) &&
           std::fprintf(f.get(), "\",\"cat\":\"gradavg\",\"ph\":\"X\",\"pid\":%d,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f", pid,
                        row[i], static_cast<double>(e.begin) / 1e3, static_cast<double>(e.end - e.begin) / 1e3) > 0;
      if (ok && e.arg >= 0) ok = std::fprintf(f.get(), ",\"args\":{\"bucket\":%lld}", static_cast<long long>(e.arg)) > 0;
      ok = ok && std::fputs("}", f.get()) >= 0;
    }
    ok = ok && std::fputs("\n]}\n", f.get()) >= 0;
    ok = std::fflush(f.get()) == 0 && ok;
    if (!ok) throw timeline_error("gradavg::timeline: cannot write " + name);
    written_ = n;
  }

  /// The profile of the last call across processes that recorded here (one call at a time).
  [[nodiscard]] const call_profile& last_call() const noexcept { return last_; }
  /// Set by the calls across processes when they end.
  void last_call(const call_profile& p) noexcept { last_ = p; }

 private:
  struct event {
    const char* name;
    std::uint64_t begin, end;
    std::int64_t arg;
    std::uint64_t thread;  // the recording thread's id, hashed
    std::uint32_t where, index;
  };
  // Rows (tid): call's first thread 0 (its k-th thread after it 100 + k), the wire 1 to 3 (a
  // bucket set each), other's k-th thread 200 + k.
  static unsigned thread_row(bool call, unsigned k) noexcept { return call ? (k == 0 ? 0 : 100 + k) : 200 + k; }
  /// The machine's name (the clock is one per machine), or "" where it is unknown.
  static std::string host() {
#if __has_include(<unistd.h>)
    char name[256] = {};
    if (gethostname(name, sizeof name - 1) == 0) return name;
#endif
    return {};
  }
  static bool put_escaped(std::FILE* f, const char* s) {
    for (; *s != '\0'; ++s) {
      const auto c = static_cast<unsigned char>(*s);
      if (c == '"' || c == '\\') {
        if (std::fputc('\\', f) == EOF || std::fputc(c, f) == EOF) return false;
      } else if (c < 0x20) {
        if (std::fprintf(f, "\\u%04x", c) < 0) return false;
      } else if (std::fputc(c, f) == EOF) {
        return false;
      }
    }
    return true;
  }

  std::string path_;
  std::size_t capacity_;
  std::unique_ptr<event[]> events_;
  std::atomic<std::size_t> next_{0};
  std::atomic<int> process_{0};
  std::size_t written_ = 0;
  call_profile last_{};
};

}  // namespace gradavg
