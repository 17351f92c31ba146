// gradavg internals: the line a call writes to options.run.log (log.hpp) — what it chose. Built
// only when the logger takes the line's level.
#pragma once

#include <cstddef>
#include <string>

#include "isa.hpp"
#include "parallel.hpp"
#include "types.hpp"
#include "../log.hpp"
#include "../options.hpp"
#include "../simd.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// What a call over `elements` elements of `variables` variables (averaged, skipped) and
/// `towers` towers chose, from gradients of S into outputs of O: "161 variables (161 averaged,
/// 0 skipped), 25557032 elements, 2 towers, float into float, means and squares, kernel avx512,
/// 1 thread, streaming stores". bytes: what the local pass reads and writes (the stores' choice).
template <class S, class O>
std::string choices_line(const options& opts, std::size_t variables, std::size_t averaged, std::size_t skipped,
                         std::size_t elements, std::size_t towers, bool with_squares, std::size_t bytes) {
  std::string line = std::to_string(variables) + " variables (" + std::to_string(averaged) + " averaged, " +
                     std::to_string(skipped) + " skipped), " + std::to_string(elements) + " elements, " +
                     std::to_string(towers) + (towers == 1 ? " tower, " : " towers, ");
  line.append(element_name(element_traits<S>::code)).append(" into ").append(element_name(element_traits<O>::code));
  line.append(with_squares ? ", means and squares" : ", means");
  line.append(", kernel ").append(to_string(simd_level_in_use()));
  const std::size_t threads = requested_threads(opts);
  line.append(", ").append(std::to_string(threads)).append(threads == 1 ? " thread, " : " threads, ");
  line.append(streams(opts, bytes) ? "streaming stores" : "ordinary stores");
  return line;
}

/// Writes `what` and choices_line's words to options.run.log at `at`, where it takes that level.
template <class S, class O>
void log_choices(const options& opts, log_level at, const char* what, std::size_t variables, std::size_t averaged,
                 std::size_t skipped, std::size_t elements, std::size_t towers, bool with_squares) {
  if (opts.run.log == nullptr || !opts.run.log->enabled(at)) return;
  const std::size_t bytes = elements * (towers * sizeof(S) + (with_squares ? 2 : 1) * sizeof(O));
  opts.run.log->write(at, std::string("gradavg: ") + what + ": " +
                              choices_line<S, O>(opts, variables, averaged, skipped, elements, towers, with_squares,
                                                 bytes));
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
