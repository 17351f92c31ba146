// gradavg::logger: what the calls chose, in words, for the people who wonder (NCCL_DEBUG's role).
// Off unless the caller passes one: options.run.log is a pointer, and a call with none makes one
// test of it.
//
//   auto log = gradavg::logger::from_environment();  // GRADAVG_LOG=info|debug, or null
//   opts.run.log = log.get();
//
// info: a line when a plan is proved (its first call, or the first after its buffers changed):
// the variables, elements and towers, the element types, the kernel's instruction-set level, the
// threads and stores; across processes the rank, the buckets, the exchange, the wire format and
// the output. debug: the same line for every call. Lines go to stderr, or to the sink given.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "errors.hpp"

namespace gradavg {

/// How much a logger writes.
enum class log_level : unsigned char {
  off,    ///< nothing
  info,   ///< a line per plan proved (what it chose)
  debug,  ///< a line per call
};

/// Where a logger's lines go: called with the sink's context, the line's level and the line (no
/// newline), on the calling thread.
using log_sink = void (*)(void* context, log_level level, std::string_view line);

/// A level and a sink (stderr by default). Not owned by the calls: options.run.log points at it.
class logger {
 public:
  explicit logger(log_level level, log_sink sink = nullptr, void* context = nullptr) noexcept
      : level_(level), sink_(sink), context_(context) {}

  /// A logger at GRADAVG_LOG's level ("info" or "debug") to stderr, or null where it is unset,
  /// empty or "off"; another value is an option_error naming it. Reads the environment when
  /// called, never otherwise.
  [[nodiscard]] static std::unique_ptr<logger> from_environment() {
    const char* value = std::getenv("GRADAVG_LOG");
    if (value == nullptr) return nullptr;
    const std::string_view v = value;
    if (v.empty() || v == "off") return nullptr;
    if (v == "info") return std::make_unique<logger>(log_level::info);
    if (v == "debug") return std::make_unique<logger>(log_level::debug);
    throw option_error("gradavg: GRADAVG_LOG is \"" + std::string(v) + "\"; it must be off, info or debug");
  }

  [[nodiscard]] log_level level() const noexcept { return level_; }
  /// Whether a line at `at` is written.
  [[nodiscard]] bool enabled(log_level at) const noexcept { return at != log_level::off && at <= level_; }

  /// Writes `line` at `at` when enabled: to the sink, or to stderr followed by a newline.
  void write(log_level at, std::string_view line) const {
    if (!enabled(at)) return;
    if (sink_ != nullptr) {
      sink_(context_, at, line);
      return;
    }
    std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
  }

 private:
  log_level level_;
  log_sink sink_;
  void* context_;
};

}  // namespace gradavg
