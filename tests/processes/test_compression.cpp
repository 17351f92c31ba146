// The compressed exchange (gradavg::compression) over the transport of threads: the codec's
// roundings against Eigen's scalar bfloat16 and half conversions, then whole calls against a
// reference written here from the documented format alone (each rank's sums and squares' sums
// rounded block by block, summed in rank order, rounded again, divided), bit for bit on every
// rank for every bucket size; the accuracy against the exact double mean; non-finite inputs
// reported through compression and never made by the float16 scale; the agreement on the format.
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "compression_reference.hpp"
#include "support.hpp"
#include "thread_transport.hpp"

namespace {

using namespace gradavg_test;
using gradavg::compression;

/// The means and means of squares of one tower per rank (towers[r]: rank r's flat values), as a
/// compressed call computes them with buckets of bucket_elements elements.
template <class Buf>
std::pair<std::vector<Buf>, std::vector<Buf>> compressed_reference(const std::vector<std::vector<Buf>>& towers,
                                                                   std::size_t bucket_elements, compression format) {
  const std::size_t total = towers[0].size();
  std::vector<Buf> means, squares;
  for (std::size_t begin = 0; begin < total; begin += bucket_elements) {
    const std::size_t end = std::min(total, begin + bucket_elements);
    std::vector<Buf> sum(end - begin, Buf(0)), sum_sq(end - begin, Buf(0));
    for (std::size_t r = 0; r < towers.size(); ++r) {
      std::vector<Buf> x(towers[r].begin() + begin, towers[r].begin() + end), q(x.size());
      for (std::size_t j = 0; j < x.size(); ++j) q[j] = x[j] * x[j];
      const auto dx = round_part(x, format), dq = round_part(q, format);
      for (std::size_t j = 0; j < x.size(); ++j) {
        sum[j] = r == 0 ? dx[j] : sum[j] + dx[j];
        sum_sq[j] = r == 0 ? dq[j] : sum_sq[j] + dq[j];
      }
    }
    const auto rs = round_part(sum, format), rq = round_part(sum_sq, format);
    const Buf n = static_cast<Buf>(towers.size());
    for (std::size_t j = 0; j < rs.size(); ++j) {
      means.push_back(rs[j] / n);
      squares.push_back(rq[j] / n);
    }
  }
  return {means, squares};
}

/// One tower per rank of random values times `magnitude` (seeded by rank and variable).
template <class S>
std::vector<towers_of<S>> one_tower_per_rank(int ranks, S magnitude) {
  return gradavg_test::one_tower_per_rank<S>(ranks, 7000, [magnitude](Eigen::Index, S x) { return x * magnitude; });
}

template <class S>
bool same_bits_as(const std::vector<S>& got, const std::vector<S>& want) {
  return got.size() == want.size() && same_bits(got.data(), want.data(), got.size());
}

}  // namespace

TEST_CASE("compression codec: bfloat16 and half roundings are Eigen's scalar ones, decoding is exact") {
  namespace p = gradavg::detail::processes;
  std::mt19937 gen(20261207u);
  std::vector<std::uint32_t> patterns = {0u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x00000001u,
                                         0x38800000u, 0x387fffffu, 0x33800000u, 0x33000000u, 0x477fe000u,
                                         0x477ff000u, 0x477fefffu, 0x3f808000u, 0x3f818000u, 0x3f80c000u};
  for (int i = 0; i < (1 << 20); ++i) patterns.push_back(static_cast<std::uint32_t>(gen()));
  for (std::uint32_t u : patterns) {
    const float x = std::bit_cast<float>(u);
    INFO("float bits " << u);
    const std::uint16_t b = p::bfloat16_bits(x), h = p::half_bits(x);
    if (std::isnan(x)) {
      CHECK(std::isnan(p::from_bfloat16_bits(b)));
      CHECK(std::isnan(p::from_half_bits(h)));
      continue;
    }
    CHECK(b == std::bit_cast<std::uint16_t>(Eigen::bfloat16(x)));
    CHECK(h == std::bit_cast<std::uint16_t>(Eigen::half(x)));
  }
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float want = static_cast<float>(std::bit_cast<Eigen::half>(bits));
    const float got = p::from_half_bits(bits);
    INFO("half bits " << h);
    if (std::isnan(want)) CHECK(std::isnan(got)); else CHECK(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want));
  }
  // The block exponent brings the largest finite magnitude into [2^14, 2^15).
  for (float m : {1.0f, 3.0f, 1e-8f, 1e30f, std::numeric_limits<float>::max(), std::ldexp(1.0f, -112),
                  65504.0f, 16384.0f, 32767.99f}) {
    const float scaled = std::ldexp(m, p::float16_block_exponent(m));
    CHECK(scaled >= 16384.0f);
    CHECK(scaled < 32768.0f);
  }
  CHECK(p::float16_block_exponent(0.0f) == 0);
  CHECK(p::float16_block_exponent(std::numeric_limits<float>::infinity()) == 0);
  // Below 2^-112 the exponent stops at 127 (2^k stays a float): the block keeps half's precision.
  CHECK(p::float16_block_exponent(std::numeric_limits<float>::min()) == 127);
  CHECK(p::float16_block_exponent(std::numeric_limits<float>::denorm_min()) == 127);
}

TEMPLATE_TEST_CASE("compressed exchange: the documented format's bits on every rank, for every bucket size", "",
                   float, double) {
  using S = TestType;
  for (compression format : {compression::bfloat16, compression::float16})
    for (int ranks : {2, 3, 4})
      for (std::size_t bucket : {std::size_t{0}, std::size_t{375}, std::size_t{40}}) {
        INFO("format " << static_cast<int>(format) << ", ranks " << ranks << ", bucket elements " << bucket);
        const auto towers = one_tower_per_rank<S>(ranks, S(1));
        const auto values = flat_values(towers);
        const std::size_t total = values[0].size();
        const auto [want_means, want_squares] = compressed_reference<S>(values, bucket == 0 ? total : bucket, format);
        const auto results = average_on_ranks<S>(towers, sentinel_outputs<S>(), [&](int) {
          thread_options o;
          o.exchange.compression = format;
          o.exchange.fusion_bytes = bucket * 2 * sizeof(S);  // means and squares: 2 values an element
          return o;
        });
        for (const auto& r : results) {
          REQUIRE_FALSE(r.failure);
          CHECK(same_bits_as(flat(r.means), want_means));
          CHECK(same_bits_as(flat(r.squares), want_squares));
          CHECK(r.report.averaged == sizes.size());
        }
        // Accuracy: every mean within the two roundings of the exact one (unit roundoff u of the
        // format at the value, float16: at its block's largest value, bounded by the largest).
        const double u = format == compression::bfloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
        double largest = 0;
        for (const auto& v : values)
          for (S x : v) largest = std::max(largest, std::fabs(double(x)));
        const auto got = flat(results[0].means);
        for (std::size_t j = 0; j < total; ++j) {
          double exact = 0, magnitude = 0;
          for (const auto& v : values) {
            exact += double(v[j]);
            magnitude += std::fabs(double(v[j]));
          }
          const double scale = format == compression::bfloat16 ? magnitude : ranks * largest;
          CHECK(std::fabs(double(got[j]) - exact / ranks) <= 2.1 * u * scale / ranks);
        }
      }
}

TEST_CASE("compressed exchange: float16's block scale keeps gradients far below half's smallest value") {
  // Values near 1e-9: half alone flushes them to zero (its smallest subnormal is 6e-8).
  const auto towers = one_tower_per_rank<float>(2, 1e-9f);
  const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [](int) {
    thread_options o;
    o.exchange.compression = compression::float16;
    return o;
  });
  for (const auto& r : results) REQUIRE_FALSE(r.failure);
  const auto got = flat(results[0].means);
  const auto values = flat_values(towers);
  const auto& a = values[0];
  const auto& b = values[1];
  double largest = 0;
  std::size_t nonzero = 0;
  for (std::size_t j = 0; j < got.size(); ++j) largest = std::max({largest, std::fabs(double(a[j])), std::fabs(double(b[j]))});
  for (std::size_t j = 0; j < got.size(); ++j) {
    const double exact = (double(a[j]) + double(b[j])) / 2;
    CHECK(std::fabs(double(got[j]) - exact) <= std::ldexp(1.0, -10) * largest);
    nonzero += got[j] != 0.0f ? 1 : 0;
  }
  CHECK(nonzero > got.size() * 9 / 10);
}

TEST_CASE("compressed exchange: a non-finite input is reported through compression, huge finite values stay "
          "finite") {
  for (compression format : {compression::bfloat16, compression::float16})
    for (auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
      INFO("format " << static_cast<int>(format) << ", policy " << static_cast<int>(policy));
      auto towers = one_tower_per_rank<float>(3, 1.0f);
      towers[1][0][1].first[3] = std::numeric_limits<float>::infinity();  // w1 on rank 1
      towers[0][0][3].first *= 1e30f;  // w3 on rank 0: beside the flags, in no block of theirs
      std::vector<std::vector<gradavg::variable_statistics>> reports(3, std::vector<gradavg::variable_statistics>(sizes.size()));
      const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
        thread_options o;
        o.exchange.compression = format;
        o.compute.on_nonfinite = policy;
        o.compute.per_variable = reports[static_cast<std::size_t>(r)];
        return o;
      });
      for (std::size_t r = 0; r < 3; ++r) {
        REQUIRE_FALSE(results[r].failure);
        CHECK(results[r].report.nonfinite_variables == 1);
        for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(reports[r][i].nonfinite == (i == 1));
        CHECK(results[r].means[3].allFinite());
        if (policy == gradavg::nonfinite_policy::zero) CHECK(results[r].means[1].isZero());
        else CHECK(std::isinf(results[r].means[1][3]));
        CHECK(same_bits_as(flat(results[r].means), flat(results[0].means)));
      }
      // w3's means: within the format's rounding of the exact ones (dominated by rank 0's).
      for (Eigen::Index j = 0; j < results[0].means[3].size(); ++j) {
        double exact = 0;
        for (const auto& rank : towers) exact += double(rank[0][3].first[j]);
        CHECK(std::fabs(double(results[0].means[3][j]) - exact / 3) <= 1e30 * std::ldexp(1.0, -6));
      }
    }
}

TEST_CASE("compressed exchange: every rank passes the same format, a named one") {
  const auto towers = one_tower_per_rank<float>(3, 1.0f);
  const auto differ = average_on_ranks<float>(towers, sentinel_outputs<float>(), [](int r) {
    thread_options o;
    o.exchange.compression = r == 1 ? compression::bfloat16 : compression::none;
    return o;
  });
  for (const auto& r : differ) {
    const std::string message = failure_of<gradavg::option_error>(r);
    CHECK(contains(message, "gradavg::threads: rank 1 passes a different options.exchange.compression than ranks 0 and 2"));
    CHECK(r.means[0][0] == sentinel<float>);
  }
  const auto unnamed = average_on_ranks<float>(towers, sentinel_outputs<float>(), [](int) {
    thread_options o;
    o.exchange.compression = static_cast<compression>(9);
    return o;
  });
  for (const auto& r : unnamed) {
    const std::string message = failure_of<gradavg::option_error>(r);
    CHECK(contains(message, "options.exchange.compression holds 9"));
  }
}

TEST_CASE("int8 codec: each value within one step of its block's largest, the rounding unbiased") {
  namespace p = gradavg::detail::processes;
  const p::codec<float> c{compression::int8};
  REQUIRE(c.block_bytes() == 260);
  float x[256];
  for (int j = 0; j < 256; ++j) x[j] = std::ldexp(static_cast<float>((j * 37) % 256) - 127.5f, -12);
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  const float step = m / 127;
  std::vector<double> mean(256, 0.0);
  std::vector<std::byte> block(c.block_bytes());
  const int seeds = 4096;
  for (int key = 0; key < seeds; ++key) {
    c.encode(x, {0, 256, 0, 0}, block.data(), static_cast<std::uint32_t>(key));
    float y[256];
    c.decode(block.data(), y);
    for (int j = 0; j < 256; ++j) {
      REQUIRE(std::fabs(y[j] - x[j]) <= step * 1.0001f);
      mean[static_cast<std::size_t>(j)] += y[j] / seeds;
    }
  }
  // Unbiased: over 4096 roundings the mean is the value within 1/32 of a step (the rounding's
  // standard deviation is at most half a step: 1/128 of one over 4096 draws; 4 of those).
  for (int j = 0; j < 256; ++j) CHECK(std::fabs(mean[static_cast<std::size_t>(j)] - x[j]) <= step / 32);
  // A block of subnormal values (127 / m would overflow): each within a step, zeros stay zeros.
  float tiny[256];
  for (int j = 0; j < 256; ++j) tiny[j] = j % 3 == 0 ? 0.0f : std::numeric_limits<float>::denorm_min() * static_cast<float>(j);
  c.encode(tiny, {0, 256, 0, 0}, block.data(), 3);
  {
    float y[256];
    c.decode(block.data(), y);
    for (int j = 0; j < 256; ++j) {
      CHECK(std::fabs(y[j] - tiny[j]) <= tiny[255] / 127 * 1.01f + 2 * std::numeric_limits<float>::denorm_min());
      if (tiny[j] == 0.0f) CHECK(y[j] == 0.0f);
    }
  }
  // A block holding an infinity decodes as NaN.
  x[7] = std::numeric_limits<float>::infinity();
  c.encode(x, {0, 256, 0, 0}, block.data(), 1);
  float y[256];
  c.decode(block.data(), y);
  CHECK(std::isnan(y[0]));
  CHECK(std::isnan(y[255]));
}

TEST_CASE("int8 exchange: ranks bitwise equal, the same seed the same bits, every mean within the two roundings") {
  for (int ranks : {2, 3, 4}) {
    INFO("ranks " << ranks);
    const auto towers = one_tower_per_rank<float>(ranks, 1.0f);
    auto run = [&](std::uint64_t seed) {
      return average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int) {
        thread_options o;
        o.exchange.compression = compression::int8;
        o.exchange.seed = seed;
        o.exchange.fusion_bytes = 3000;
        return o;
      });
    };
    const auto first = run(5), again = run(5), other = run(6);
    for (std::size_t r = 0; r < first.size(); ++r) {
      REQUIRE_FALSE(first[r].failure);
      CHECK(same_bits_as(flat(first[r].means), flat(first[0].means)));
      CHECK(same_bits_as(flat(first[r].squares), flat(first[0].squares)));
      CHECK(same_bits_as(flat(again[r].means), flat(first[0].means)));
    }
    CHECK_FALSE(same_bits_as(flat(other[0].means), flat(first[0].means)));
    // Each rank's contribution within one step (1/127) of its block's largest value, the sum's
    // encoding within one step of the sum's: bounded by the largest magnitudes over everything.
    const auto values = flat_values(towers);
    double bound = 0;
    for (const auto& v : values) {
      double largest = 0;
      for (float x : v) largest = std::max(largest, std::fabs(double(x)));
      bound += 2 * largest / 127;
    }
    const auto got = flat(first[0].means);
    for (std::size_t j = 0; j < got.size(); ++j) {
      double exact = 0;
      for (const auto& v : values) exact += double(v[j]);
      CHECK(std::fabs(double(got[j]) - exact / ranks) <= bound / ranks * 1.001);
    }
  }
}

TEST_CASE("error feedback: the means of many steps converge to the exact mean, as without it they do not") {
  // The same gradients every step: with error feedback what each encoding drops is sent later,
  // so the sum over K steps of the means is K times the exact mean up to the residuals (within
  // a few roundings in all); bfloat16 without it repeats the same rounding every step.
  const int ranks = 3, steps = 64;
  const auto towers = one_tower_per_rank<float>(ranks, 1.0f);
  const auto values = flat_values(towers);
  const std::size_t total = values[0].size();
  for (compression format : {compression::bfloat16, compression::float16, compression::int8}) {
    INFO("format " << static_cast<int>(format));
    for (bool feedback : {true, false}) {
      std::vector<std::vector<float>> residual(ranks, std::vector<float>(total, 0.0f));
      std::vector<double> sum(total, 0.0);
      for (int k = 0; k < steps; ++k) {
        const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
          thread_options o;
          o.exchange.compression = format;
          o.exchange.seed = static_cast<std::uint64_t>(k);
          o.exchange.fusion_bytes = 3000;
          if (feedback) o.exchange.residual = residual[static_cast<std::size_t>(r)];
          return o;
        });
        REQUIRE_FALSE(results[0].failure);
        const auto m = flat(results[0].means);
        for (std::size_t j = 0; j < total; ++j) sum[j] += m[j];
      }
      double worst = 0, largest = 0;
      for (std::size_t j = 0; j < total; ++j) {
        double exact = 0;
        for (const auto& v : values) {
          exact += double(v[j]);
          largest = std::max(largest, std::fabs(double(v[j])));
        }
        worst = std::max(worst, std::fabs(sum[j] / steps - exact / ranks));
      }
      // With feedback: the residuals (a rounding of each contribution and of the owner's sum) over
      // K steps, plus float's own; the step is int8's (1/127 of the largest), the largest there is.
      const double step = largest / 127;
      if (feedback) CHECK(worst <= 4 * step / steps + 1e-5);
      if (!feedback && format == compression::bfloat16) CHECK(worst > 4 * step / steps + 1e-5);
    }
  }
}

TEST_CASE("error feedback: a residual of the wrong size, or without a lossy format, is an option_error") {
  const auto towers = one_tower_per_rank<float>(2, 1.0f);
  std::vector<std::vector<float>> residual = {std::vector<float>(4502), std::vector<float>(4501)};
  for (compression format : {compression::int8, compression::none}) {
    const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
      thread_options o;
      o.exchange.compression = format;
      o.exchange.residual = residual[static_cast<std::size_t>(format == compression::none ? 0 : r)];
      return o;
    });
    for (const auto& r : results) {
      const std::string message = failure_of<gradavg::error>(r);
      if (format == compression::none) CHECK(contains(message, "options.exchange.compression is none"));
      else CHECK((contains(message, "options.exchange.residual holds 4501 floats") || contains(message, "rank 1 failed")));
      CHECK(r.means[0][0] == sentinel<float>);
    }
  }
}
