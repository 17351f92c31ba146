// gradavg: plan — the proof of one call's buffers, kept for the training loop's next steps.
//
//   gradavg::plan step;                                   // empty
//   for (...) gradavg::average_gradients_into(step, tower_grads, means, squares, opts);
//
// The first call with a plan runs every check of average_gradients_into (towers, variables,
// shapes, element types, outputs, overlaps) and keeps what it proved. A later call with the same
// plan reads, for every gradient and output, only what a training loop can change between steps
// — whether it is present, its first element, its element count, its contiguity (and its element
// type for run-time typed tensors) — and compares them with the kept proof: if all are equal, the
// checks that depend on nothing else (variables, shapes, overlaps) are not repeated, and the
// kernel reads the pointers from the plan. Anything different (a gradient reallocated or gone,
// another tower count, squares passed or not, a stronger options.check.aliasing than the one proved,
// other tensor or range types) runs every check again, and the plan keeps the new proof once it
// passes. A failed call empties the plan.
//
// The options are checked on every call (weights and scale may change from step to step).
//
// Across processes (gradavg::mpi::average_gradients_into with a plan), the plan also keeps what
// every rank agreed when it was proved: while every rank's plan holds, the agreement on options,
// variables, presence and shapes is not repeated (mpi.hpp).
//
// Not thread-safe: one plan serves one call at a time. Copying gives an independent plan.
// Shared by every instruction-set level of a program (it holds pointers and sizes only).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "detail/layout_proof.hpp"
#include "options.hpp"
#include "tensor.hpp"

namespace gradavg {

namespace shared_detail {

/// One address per call signature (tensor and range types): a plan proved for one signature is
/// never taken for another.
template <class... Types>
inline constexpr char signature_of = 0;

struct plan_access;

}  // namespace shared_detail

class plan {
 public:
  plan() = default;

  /// Whether the plan holds a proof (a call with it has succeeded, and none has failed since).
  [[nodiscard]] bool ready() const noexcept { return ready_; }

  /// How many calls with this plan ran every check (the first one, and each that found the
  /// buffers changed): a training loop whose count keeps rising reallocates its gradients or
  /// outputs every step, and gains nothing from the plan.
  [[nodiscard]] std::uint64_t proofs() const noexcept { return proofs_; }

  /// Forgets the proof (memory is kept for reuse): the next call runs every check.
  void clear() noexcept {
    ready_ = false;
    agreed_.clear();
  }

 private:
  friend struct shared_detail::plan_access;

  shared_detail::layout_proof proof_;  // the proved table of buffers, tower count and squares
  std::vector<unsigned char> present_;  // per variable: whether its gradients are present
  const void* signature_ = nullptr;
  std::size_t variables_ = 0;
  std::size_t averaged_ = 0;  // variables present (the others are skipped)
  std::size_t elements_ = 0;  // of every averaged variable
  element_type gradients_ = element_type::float32;
  element_type outputs_ = element_type::float32;
  alias_check proved_ = alias_check::none;  // the overlap check the proof passed
  bool ready_ = false;
  std::uint64_t proofs_ = 0;
  std::vector<std::uint64_t> agreed_;  // across processes: what the ranks agreed (empty: nothing)
};

namespace shared_detail {

/// The library's access to a plan's members.
struct plan_access {
  static layout_proof& proof(plan& p) noexcept { return p.proof_; }
  static std::vector<unsigned char>& present(plan& p) noexcept { return p.present_; }
  static const void*& signature(plan& p) noexcept { return p.signature_; }
  static std::size_t towers(plan& p) noexcept { return p.proof_.towers; }
  static bool squares(plan& p) noexcept { return p.proof_.squares; }
  static std::size_t& variables(plan& p) noexcept { return p.variables_; }
  static std::size_t& averaged(plan& p) noexcept { return p.averaged_; }
  static std::size_t skipped(plan& p) noexcept { return p.variables_ - p.averaged_; }
  static std::size_t& elements(plan& p) noexcept { return p.elements_; }
  static element_type& gradients(plan& p) noexcept { return p.gradients_; }
  static element_type& outputs(plan& p) noexcept { return p.outputs_; }
  static alias_check& proved(plan& p) noexcept { return p.proved_; }
  static bool& ready(plan& p) noexcept { return p.ready_; }
  static std::uint64_t& proofs(plan& p) noexcept { return p.proofs_; }
  static std::vector<std::uint64_t>& agreed(plan& p) noexcept { return p.agreed_; }
};

}  // namespace shared_detail
}  // namespace gradavg
