// One body for both units of the mixed-instruction-set test; each includes it once.
#pragma once

#include <gradavg/gradavg.hpp>

#include <array>
#include <span>
#include <utility>

#include "level.hpp"

namespace mixed_isa {
namespace {  // one copy per unit: an inline function would be merged across the units by the linker

level_result average_here(const float* const* tower_data, float* mean, float* square) {
  using entry = std::pair<std::span<const float>, int>;
  using tower = std::array<entry, 1>;
  std::array<tower, towers> tower_grads;
  for (std::size_t k = 0; k < towers; ++k) tower_grads[k][0] = {std::span<const float>(tower_data[k], elements), 0};
  std::array<std::span<float>, 1> means{std::span<float>(mean, elements)};
  std::array<std::span<float>, 1> squares{std::span<float>(square, elements)};
  auto* call = &gradavg::average_gradients_into<std::array<tower, towers>, std::array<std::span<float>, 1>&,
                                                std::array<std::span<float>, 1>&>;
  call(tower_grads, means, squares, {});
  return {gradavg::isa_namespace, reinterpret_cast<const void*>(call)};
}

}  // namespace
}  // namespace mixed_isa
