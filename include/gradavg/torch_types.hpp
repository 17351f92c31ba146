// gradavg: the options and the report of the libtorch module helpers (<gradavg/torch.hpp>).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "statistics.hpp"

namespace gradavg::libtorch {

/// Which replicas' .grad() tensors the module helpers write the means into.
enum class mean_target : std::uint8_t {
  /// Every replica's: each replica's own optimizer then takes the same step.
  every_replica,
  /// Replica 0's only, saving the K-1 copies: the other replicas keep the gradients their backward
  /// produced. For one optimizer over replica 0's parameters, whose step broadcast_parameters then
  /// copies into the other replicas.
  first_replica,
};

/// How the module helpers treat parameters, besides gradavg::options.
struct module_options {
  /// A parameter with a gradient on some replicas only (on the others grad() is undefined or
  /// requires_grad is false). false (the default): missing_gradient_error. true: as
  /// DistributedDataParallel does, the missing gradients count as zeros (the mean is the sum of
  /// the present ones over the replica count, or over the weight sum), every replica receives the
  /// mean, and a replica without a gradient gets a new one, laid out as the parameter
  /// (at::zeros_like), attached only once the call has succeeded. Listed in
  /// module_report::zero_filled. A parameter without a gradient on every replica is skipped either
  /// way. With mean_target::first_replica only replica 0 receives a new gradient.
  bool absent_as_zeros = false;
  /// Where the means go (mean_target).
  mean_target means_to = mean_target::every_replica;
  /// Also return the mean over replicas of each parameter's squared gradient
  /// (module_report::squares; the seed's include_square=True).
  bool include_square = false;
};

/// What average_module_gradients did.
struct module_report {
  /// Counts and fused statistics of the call (average.hpp). report.towers is the replica count.
  gradavg::summary report;
  /// Parameters left alone because no replica has a gradient for them: requires_grad false (frozen)
  /// or grad() undefined (took no part in the loss) on every replica. In named_parameters() order.
  std::vector<std::string> skipped;
  /// Parameters averaged with zeros in place of the gradients some replicas lack
  /// (module_options::absent_as_zeros). In named_parameters() order.
  std::vector<std::string> zero_filled;
  /// With module_options::include_square: the mean over replicas of each parameter's squared
  /// gradient, one new tensor per parameter in named_parameters() order (undefined for a skipped
  /// one), of its gradient's dtype and memory order. Empty without include_square.
  std::vector<at::Tensor> squares;
};

}  // namespace gradavg::libtorch
