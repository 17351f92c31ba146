// The wire formats' encoding and decoding (gradavg::compression; detail/processes/codec.hpp)
// against a copy of the same float values, measured by alternation in one run, one thread.
//
// codec/<format>/n:<n>   (bf16, fp16, int8) n floats (a 1 MiB bucket stays in cache, as in a call; 64 MiB does
//   not). Each iteration is one round: copy, encode, decode, each run `calls` times back to
//   back and timed on its own, the round's start rotating. Counters: medians over rounds of
//   nanoseconds per value (ns.copy, ns.encode, ns.decode) and of per-round ratios of the copy's
//   time to each (encode.of.copy, decode.of.copy: 1 is the copy's speed, the target 0.8).
//   copy: memcpy of n floats; encode: n floats into the format's blocks; decode: the blocks back
//   into n floats. Before the rounds, every decoded value is checked against the value encoded
//   (within the format's rounding).
#include <benchmark/benchmark.h>

#include <gradavg/gradavg.hpp>
#include <gradavg/detail/processes/codec.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

namespace processes = gradavg::detail::processes;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

template <class F>
double seconds_of(int calls, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  for (int c = 0; c < calls; ++c) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void codec(benchmark::State& state, gradavg::compression format) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> values(n), copied(n), decoded(n);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  for (float& x : values) x = normal(gen);
  const processes::codec<float> c{format};
  const processes::bucket_parts parts{{n, 0, 0}};
  const std::size_t blocks = parts.blocks();
  std::vector<std::byte> encoded(blocks * c.block_bytes());
  auto encode = [&] {
    for (std::size_t k = 0; k < blocks; ++k) c.encode(values.data(), parts.place(k), encoded.data() + k * c.block_bytes(), static_cast<std::uint32_t>(k));
    benchmark::DoNotOptimize(encoded.data());
  };
  auto decode = [&] {
    for (std::size_t k = 0; k < blocks; ++k) c.decode_into(encoded.data() + k * c.block_bytes(), parts.place(k), decoded.data());
    benchmark::DoNotOptimize(decoded.data());
  };
  auto copy = [&] {
    std::memcpy(copied.data(), values.data(), n * sizeof(float));
    benchmark::DoNotOptimize(copied.data());
  };
  encode();
  decode();
  // Within the format's rounding: bfloat16 of the value, float16 of the block's largest, int8
  // one step (1/127) of the block's largest.
  const float u = format == gradavg::compression::bfloat16 ? 0x1p-8f
                  : format == gradavg::compression::float16 ? 0x1p-11f
                                                             : 1.0f / 127;
  float largest = 0;
  for (float x : values) largest = std::max(largest, std::fabs(x));
  for (std::size_t j = 0; j < n; ++j)
    if (!(std::fabs(decoded[j] - values[j]) <= 1.001f * u * (format == gradavg::compression::bfloat16 ? std::fabs(values[j]) : largest)))
      throw std::runtime_error("bench_codec: a decoded value is off");

  const int calls = std::max(1, static_cast<int>((std::size_t{32} << 20) / (n * sizeof(float))));
  std::vector<double> t_copy, t_encode, t_decode, r_encode, r_decode;
  int round = 0;
  for (auto _ : state) {
    double t[3] = {};
    for (int i = 0; i < 3; ++i) {
      const int which = (i + round) % 3;
      t[which] = which == 0 ? seconds_of(calls, copy) : which == 1 ? seconds_of(calls, encode) : seconds_of(calls, decode);
    }
    ++round;
    const double per_value = 1e9 / (static_cast<double>(calls) * static_cast<double>(n));
    t_copy.push_back(t[0] * per_value);
    t_encode.push_back(t[1] * per_value);
    t_decode.push_back(t[2] * per_value);
    r_encode.push_back(t[0] / t[1]);
    r_decode.push_back(t[0] / t[2]);
  }
  state.counters["ns.copy"] = median(t_copy);
  state.counters["ns.encode"] = median(t_encode);
  state.counters["ns.decode"] = median(t_decode);
  state.counters["encode.of.copy"] = median(r_encode);
  state.counters["decode.of.copy"] = median(r_decode);
}

}  // namespace

BENCHMARK_CAPTURE(codec, bf16, gradavg::compression::bfloat16)->Arg(1 << 18)->Arg(1 << 24)->ArgName("n")->Iterations(15)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(codec, int8, gradavg::compression::int8)->Arg(1 << 18)->Arg(1 << 24)->ArgName("n")->Iterations(15)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(codec, fp16, gradavg::compression::float16)->Arg(1 << 18)->Arg(1 << 24)->ArgName("n")->Iterations(15)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
