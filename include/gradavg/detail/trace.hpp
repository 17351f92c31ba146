// gradavg internals: how the calls record into a timeline (timeline.hpp) — a span on the calling
// thread, and a call across processes' profile as its buckets move. With no timeline every
// member is one test of a null pointer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../timeline.hpp"

namespace gradavg::shared_detail {

/// An event on the calling thread's lane from construction to destruction (exceptions included);
/// nothing without a timeline.
class traced_span {
 public:
  /// arg: the bucket, or -1.
  traced_span(timeline* line, const char* name, std::int64_t arg = -1) noexcept
      : line_(line), name_(name), arg_(arg), begin_(line != nullptr ? timeline::now() : 0) {}
  traced_span(const traced_span&) = delete;
  traced_span& operator=(const traced_span&) = delete;
  ~traced_span() {
    if (line_ != nullptr) line_->record(lane::call, name_, begin_, timeline::now(), arg_);
  }

 private:
  timeline* line_;
  const char* name_;
  std::int64_t arg_;
  std::uint64_t begin_;
};

/// A call across processes as it runs (processes/data_path.hpp): its events and its profile.
/// The data path marks each piece of local work and each bucket's departure and arrival; the
/// exchange strategy its waits and the bytes it moves. One thread: the calling one.
struct call_trace {
  timeline* line = nullptr;
  call_profile profile{};
  std::uint64_t call_begin = 0;
  unsigned in_flight = 0;          // buckets on the wire
  std::uint64_t left[3] = {};      // per set: when its bucket's contributions left
  std::uint64_t waited_inside = 0; // waits inside the local piece being timed (its time less them)

  [[nodiscard]] bool on() const noexcept { return line != nullptr; }
  [[nodiscard]] std::uint64_t start() const noexcept { return line != nullptr ? timeline::now() : 0; }

  /// The call begins: its events are rank `rank`'s.
  void begin_call(timeline* to, int rank) noexcept {
    line = to;
    if (line == nullptr) return;
    line->process(rank);
    profile = {};
    in_flight = 0;
    waited_inside = 0;
    call_begin = timeline::now();
  }

  /// A phase of the call from `begin` to now (checks, agreement), not local work.
  void phase(const char* name, std::uint64_t begin) noexcept {
    if (line != nullptr) line->record(lane::call, name, begin, timeline::now());
  }

  /// Local work of bucket `bucket` from `begin` to now, less the waits inside it; overlapped when
  /// some bucket other than `own` (`own`: 1 when the bucket itself is on the wire) was in flight.
  void local(const char* name, std::uint64_t begin, std::size_t bucket, unsigned own = 0) noexcept {
    if (line == nullptr) return;
    const std::uint64_t end = timeline::now();
    line->record(lane::call, name, begin, end, static_cast<std::int64_t>(bucket));
    const std::uint64_t spent = end - begin > waited_inside ? end - begin - waited_inside : 0;
    waited_inside = 0;
    profile.local_seconds += static_cast<double>(spent) * 1e-9;
    if (in_flight > own) profile.overlapped_seconds += static_cast<double>(spent) * 1e-9;
  }

  /// A wait on the wire from `begin` to now (inside the local piece being timed).
  void waited(std::uint64_t begin, std::size_t set) noexcept {
    if (line == nullptr) return;
    const std::uint64_t end = timeline::now();
    line->record(lane::call, "wait", begin, end, -1, static_cast<unsigned>(set));
    waited_inside += end - begin;
    profile.wait_seconds += static_cast<double>(end - begin) * 1e-9;
  }

  /// Bytes a bucket's move sends to and receives from the other ranks.
  void moved(std::uint64_t sent, std::uint64_t received) noexcept {
    profile.sent_bytes += sent;
    profile.received_bytes += received;
  }

  /// Bucket `bucket` (in set `set`) leaves, and arrives: its time on the wire.
  void departed(std::size_t set) noexcept {
    if (line == nullptr) return;
    left[set % 3] = timeline::now();
    ++in_flight;
    ++profile.buckets;
  }
  void arrived(std::size_t bucket, std::size_t set) noexcept {
    if (line == nullptr) return;
    line->record(lane::wire, "bucket", left[set % 3], timeline::now(), static_cast<std::int64_t>(bucket),
                 static_cast<unsigned>(set % 3));
    --in_flight;
  }

  /// The call ends (its last collective done): its profile kept in the timeline.
  void end_call(std::uint64_t local_bytes) noexcept {
    if (line == nullptr) return;
    profile.local_bytes = local_bytes;
    profile.seconds = static_cast<double>(timeline::now() - call_begin) * 1e-9;
    line->last_call(profile);
  }
};

}  // namespace gradavg::shared_detail
