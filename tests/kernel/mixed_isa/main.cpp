// Two translation units built for different SIMD levels (x86-64 and x86-64-v3) call the same
// gradavg function in one program. Each must run its own level's code: distinct instantiations
// (the inline namespace per level keeps the linker from merging them), and both give the same
// bits: squares rounded before they are added (no fused multiply-add, though the v3 unit has
// FMA), bit for bit against a reference computed here; and the vocabulary (gradavg::shape) is one
// type for both. Exit 77 (skipped) where the host lacks AVX2 or FMA.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "level.hpp"

namespace {

int failures = 0;
int passes = 0;

void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  (ok ? passes : failures)++;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

int main() {
  using namespace mixed_isa;
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("skipped: the host lacks AVX2 or FMA\n");
    return 77;
  }

  // Values whose squares round differently with and without fusion.
  std::vector<std::vector<float>> data(towers, std::vector<float>(elements));
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t j = 0; j < elements; ++j)
      data[k][j] = 1.0f + static_cast<float>((j * 7 + k * 13) % 31) * 0x1.0p-12f + static_cast<float>(k) * 0x1.0p-20f;
  const float* ptrs[towers] = {data[0].data(), data[1].data(), data[2].data()};

  // References: the tower-order float sum, and squares summed unfused (x*x rounded, then added)
  // or fused (std::fma, exact product).
  std::vector<float> mean(elements), unfused(elements), fused(elements);
  for (std::size_t j = 0; j < elements; ++j) {
    // This unit is built without FMA instructions, so nothing here can be contracted.
    const float first = data[0][j] * data[0][j];
    float sum = data[0][j], plain = first, fma_sum = first;
    for (std::size_t k = 1; k < towers; ++k) {
      sum += data[k][j];
      plain += data[k][j] * data[k][j];
      fma_sum = std::fma(data[k][j], data[k][j], fma_sum);
    }
    mean[j] = sum / static_cast<float>(towers);
    unfused[j] = plain / static_cast<float>(towers);
    fused[j] = fma_sum / static_cast<float>(towers);
  }
  check(!same_bits(unfused, fused), "the data tells fused from unfused squares apart");

  std::vector<float> mean_a(elements), square_a(elements), mean_b(elements), square_b(elements);
  const level_result a = average_baseline(ptrs, mean_a.data(), square_a.data());
  const level_result b = average_v3(ptrs, mean_b.data(), square_b.data());
  std::printf("baseline unit: %s, v3 unit: %s\n", a.isa_namespace, b.isa_namespace);

  check(std::strcmp(a.isa_namespace, "packet128") == 0, "the baseline unit uses gradavg::packet128");
  check(std::strcmp(b.isa_namespace, "packet256_fma") == 0, "the v3 unit uses gradavg::packet256_fma");
  check(a.entry_point != b.entry_point, "the two units call distinct instantiations");
  check(same_bits(mean_a, mean) && same_bits(mean_b, mean), "both means equal the tower-order sum / T");
  check(same_bits(square_a, unfused), "the baseline unit's squares are rounded before they are added");
  check(same_bits(square_b, unfused), "the v3 unit's squares too: the same bits as the baseline unit's");

  const gradavg::shape s = matrix_shape_v3(3, 5);
  check(s.rank == 2 && s.dims[0] == 3 && s.dims[1] == 5 && s.order == gradavg::storage_order::col_major,
        "a shape made in the v3 unit reaches the baseline unit: one vocabulary type for every level");

  std::printf("%d passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
