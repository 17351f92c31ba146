// The kernel's paths — register groups and the accumulator block (more than 16 towers), packet
// steps and scalar tails, streaming stores with unaligned outputs — agree with the reference
// and, bit for bit, with each other.
#include <gradavg/gradavg.hpp>

#include <span>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"

TEMPLATE_TEST_CASE("every kernel path gives the same bits, within tolerance of the reference", "", float, double) {
  using S = TestType;
  const std::size_t tower_count = GENERATE(1, 2, 3, 15, 16, 17, 32, 33, 40);
  const std::size_t n = GENERATE(0, 1, 15, 16, 17, 1023, 1025, 4099);
  INFO("towers " << tower_count << ", n " << n);

  // Inputs at a different misalignment per tower.
  std::vector<std::vector<S>> storage;
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
  std::vector<const S*> ptrs;
  for (std::size_t k = 0; k < tower_count; ++k) {
    storage.push_back(gradavg_test::random_values<S>(n + 3, static_cast<std::uint32_t>(7 * k + n)));
    const S* start = storage.back().data() + k % 4;
    tg[k].push_back({std::span<const S>(start, n), 0});
    ptrs.push_back(start);
  }
  const gradavg_test::reference<S> want(ptrs, n);

  std::vector<S> base_mean(n), base_square(n);
  {
    std::vector<std::span<S>> m{std::span<S>(base_mean)}, q{std::span<S>(base_square)};
    gradavg::average_gradients_into(tg, m, q);
  }
  CHECK(gradavg_test::first_mismatch(base_mean.data(), want.mean, gradavg_test::magnitude<S>(ptrs, n, false),
                                     tower_count) == n);
  CHECK(gradavg_test::first_mismatch(base_square.data(), want.square, gradavg_test::magnitude<S>(ptrs, n, true),
                                     tower_count) == n);

  for (const bool streaming : {false, true})
    for (std::size_t offset = 0; offset < 4; ++offset) {
      INFO("streaming " << streaming << ", output offset " << offset);
      std::vector<S> mean_storage(n + 4, S(-1)), square_storage(n + 4, S(-1));
      std::vector<std::span<S>> m{std::span<S>(mean_storage.data() + offset, n)};
      std::vector<std::span<S>> q{std::span<S>(square_storage.data() + (offset + 1) % 4, n)};
      gradavg::average_gradients_into(tg, m, q, {.streaming_stores = streaming});
      CHECK(gradavg_test::same_bits(m[0].data(), base_mean.data(), n));
      CHECK(gradavg_test::same_bits(q[0].data(), base_square.data(), n));
      CHECK(mean_storage[offset + n] == S(-1));  // nothing written past the end
      if (offset > 0) CHECK(mean_storage[offset - 1] == S(-1));
    }
}

TEST_CASE("mean alone equals the mean computed alongside squares") {
  const std::size_t tower_count = 20, n = 3001;
  std::vector<std::vector<float>> data;
  std::vector<std::vector<std::pair<const std::vector<float>*, int>>> tg(tower_count);
  for (std::size_t k = 0; k < tower_count; ++k) data.push_back(gradavg_test::random_values<float>(n, 50 + k));
  for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({&data[k], 0});
  std::vector<std::vector<float>> alone{std::vector<float>(n)}, with{std::vector<float>(n)}, sq{std::vector<float>(n)};
  gradavg::average_gradients_into(tg, alone);
  gradavg::average_gradients_into(tg, with, sq);
  CHECK(alone[0] == with[0]);
}
