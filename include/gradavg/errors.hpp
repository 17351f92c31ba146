// gradavg: the exceptions the library throws. All derive from gradavg::error, so one catch
// clause handles every validation failure. Every one is thrown before anything is written:
// after an error the caller's outputs are unchanged (strong guarantee).
#pragma once

#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>

namespace gradavg {

/// Base of every gradavg exception. variable_index() is the position of the variable at fault
/// in the towers' variable order, or npos when the error is not about one variable.
class error : public std::invalid_argument {
 public:
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  explicit error(const std::string& what, std::size_t variable_index = npos)
      : std::invalid_argument(what), variable_index_(variable_index) {}

  [[nodiscard]] std::size_t variable_index() const noexcept { return variable_index_; }

 private:
  std::size_t variable_index_;
};

/// Zero towers, or towers holding different numbers of variables.
class tower_error : public error {
  using error::error;
};

/// A variable's gradient has different shapes on different towers, or is not contiguous.
class shape_error : public error {
  using error::error;
};

/// Gradients of one call with different element types (run-time element types, tensor.hpp), or
/// a tensor whose element type gradavg does not read (an adapter's error, e.g. an int tensor).
class element_type_error : public error {
  using error::error;
};

/// A tensor that its adapter cannot read as a gradient: on another device, sparse, or in another
/// layout (thrown by an adapter's tensor_traits, re-raised naming the variable and the tower).
class unsupported_tensor_error : public error {
  using error::error;
};

/// A row-sparse gradient's index (sparse_types.hpp) that names no row of its dense shape: negative,
/// or not below the dense shape's first dimension.
class index_error : public error {
  using error::error;
};

/// A variable's gradient is absent on some towers but present on others.
class missing_gradient_error : public error {
  using error::error;
};

/// The variable at one position differs between towers.
class variable_mismatch_error : public error {
  using error::error;
};

/// An output is missing, of the wrong count or shape, not contiguous, or not requested consistently.
class output_error : public error {
  using error::error;
};

/// An output overlaps a gradient or another output in a way the library does not allow.
class aliasing_error : public error {
  using error::error;
};

/// An option is invalid: scale not finite, a range with begin > end, per_variable of the wrong
/// size.
class option_error : public error {
  using error::error;
};

/// options.compute.weights: not one per tower, a weight negative or not finite (the message names
/// the tower), or a sum that is not positive and finite.
class weight_error : public option_error {
  using option_error::option_error;
};

/// A summary's derived statistic (global_norm, clip_coefficient, noise) asked of a call that did
/// not compute the statistics (options.compute.statistics false), or clip_coefficient's max_norm not
/// finite and positive.
class statistics_error : public error {
  using error::error;
};

/// Across processes: another rank's own validation failed, or its kernel threw (that rank throws
/// the detailed error); variable_index() is the variable it named, or npos.
class remote_error : public error {
  using error::error;
};

}  // namespace gradavg
