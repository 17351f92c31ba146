// gradavg::c10d over a gloo process group, run as separate processes by support/launch_ranks.sh
// (RANK, WORLD_SIZE, and a FileStore's path or MASTER_ADDR and MASTER_PORT). Checked: the means,
// squares and statistics against the independent double reference and bit for bit against the
// one-process call over every rank's towers; the compressed, sharded and gathered results bit for
// bit against the same call over the transport of threads (support/thread_transport.hpp), rank by
// rank; a plan; errors on one rank reaching every rank with nothing written; the torchrun
// variables' errors. The cases tagged [fault] each end a rank (it dies before or inside the call,
// or stops calling): every other rank must throw c10d_error, not hang; ctest runs each alone.
// The cases tagged [launch] run in one process (its threads as the ranks): launches that are
// wrong end in c10d_error naming the variable or the rank.
#include <gradavg/c10d.hpp>
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "c10d_world.hpp"
#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"
#include "thread_transport.hpp"

namespace {

using namespace gradavg_test;
using gradavg::compression;
using gradavg::output_mode;

/// The group the cases share (support/c10d_world.hpp).
::c10d::ProcessGroup& group() { return world(); }

int rank() { return group().getRank(); }
int ranks() { return group().getSize(); }

gradavg::c10d::options c10d_options_of(const thread_options& t) {
  gradavg::c10d::options o;
  o.compute = t.compute;
  o.run = t.run;
  o.check = t.check;
  o.exchange.fusion_bytes = t.exchange.fusion_bytes;
  o.exchange.compression = t.exchange.compression;
  o.exchange.output = t.exchange.output;
  o.exchange.residual = t.exchange.residual;
  o.exchange.seed = t.exchange.seed;
  return o;
}

/// Every rank's results with options_of(rank) over the transport of threads (one process), and
/// this rank's over the group: the same bits, means and squares, rank by rank.
template <class S, class OptionsOf>
void check_against_threads(const std::vector<towers_of<S>>& towers, const OptionsOf& options_of) {
  const auto want = average_on_ranks<S>(towers, sentinel_outputs<S>(), options_of);
  const thread_options o = options_of(rank());
  const auto& mine = want[static_cast<std::size_t>(rank())];
  REQUIRE_FALSE(mine.failure);
  auto means = sentinel_outputs<S>(), squares = sentinel_outputs<S>();
  const gradavg::summary got = gradavg::c10d::average_gradients_into(group(), towers[static_cast<std::size_t>(rank())],
                                                                     means, squares, c10d_options_of(o));
  CHECK(same_outputs(means, mine.means));
  CHECK(same_outputs(squares, mine.squares));
  CHECK(got.shard.begin == mine.report.shard.begin);
  CHECK(got.shard.end == mine.report.shard.end);
  CHECK(got.towers == mine.report.towers);
}

}  // namespace

TEMPLATE_TEST_CASE("c10d: one process's bits, the statistics too, against the reference, for every bucket size", "",
                   float, double) {
  using S = TestType;
  for (std::size_t on_rank_0 : {std::size_t{1}, std::size_t{3}}) {
    const auto towers = random_ranks<S>(ranks(), [&](int r) { return r == 0 ? on_rank_0 : std::size_t{1}; });
    towers_of<S> flat_towers;
    for (const auto& r : towers) flat_towers.insert(flat_towers.end(), r.begin(), r.end());
    gradavg::options local;
    local.compute.statistics = true;
    auto one_means = sentinel_outputs<S>(), one_squares = sentinel_outputs<S>();
    const gradavg::summary one = gradavg::average_gradients_into(flat_towers, one_means, one_squares, local);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<const S*> gs;
      for (const auto& tower : flat_towers) gs.push_back(tower[i].first.data());
      const expectation<S> e(gs, sizes[i]);
      require_matches(one_means[i].data(), e, flat_towers.size(), false, "w" + std::to_string(i));
      require_matches(one_squares[i].data(), e, flat_towers.size(), true, "w" + std::to_string(i));
    }
    for (std::size_t fusion : {2 * sizeof(S) * 4, std::size_t{3000}, std::size_t{0}}) {
      INFO("towers on rank 0 " << on_rank_0 << ", fusion_bytes " << fusion);
      gradavg::c10d::options o;
      o.compute.statistics = true;
      o.exchange.fusion_bytes = fusion;
      auto means = sentinel_outputs<S>(), squares = sentinel_outputs<S>();
      const gradavg::summary got = gradavg::c10d::average_gradients_into(
          group(), towers[static_cast<std::size_t>(rank())], means, squares, o);
      CHECK(same_outputs(means, one_means));
      CHECK(same_outputs(squares, one_squares));
      CHECK(got.towers == flat_towers.size());
      CHECK(got.averaged == sizes.size());
      CHECK(got.sum_mean_squared == one.sum_mean_squared);
      CHECK(got.sum_mean_of_squares == one.sum_mean_of_squares);
    }
  }
}

TEST_CASE("c10d: the compressed formats, weights, sharded output and the gather: the transport of threads' bits") {
  const auto towers = one_tower_per_rank<float>(ranks(), 77, [](Eigen::Index j, float x) {
    return std::ldexp(x, static_cast<int>((j / 50) % 9) * 3 - 12);
  });
  for (compression format : {compression::none, compression::bfloat16, compression::float16, compression::int8})
    for (output_mode output : {output_mode::replicated, output_mode::sharded})
      for (std::size_t fusion : {std::size_t{0}, std::size_t{1000}}) {
        INFO("format " << static_cast<int>(format) << ", sharded " << (output == output_mode::sharded)
                       << ", fusion_bytes " << fusion);
        thread_options o;
        o.exchange.compression = format;
        o.exchange.output = output;
        o.exchange.fusion_bytes = fusion;
        o.exchange.seed = 5;
        check_against_threads(towers, [&](int) { return o; });
      }
  // Weights, rank 1's summing to zero; scale.
  INFO("weights and scale");
  std::vector<std::vector<double>> weights(static_cast<std::size_t>(ranks()), std::vector<double>{1.5});
  weights[1][0] = 0.0;
  check_against_threads(towers, [&](int r) {
    thread_options o;
    o.compute.weights = weights[static_cast<std::size_t>(r)];
    o.compute.scale = 0.25;
    return o;
  });
}

TEST_CASE("c10d: gather_shards leaves every rank with every shard, the thread transport's bits") {
  std::size_t n = 0;
  for (std::size_t s : sizes) n += s;
  const float* updated = random_slice<float>(n, 4243u);
  // Rank r's parameters: its shard (shard_of) holds the update, the rest stale values of its own.
  const auto parameters_of = [&](int r) {
    const gradavg::element_range shard = gradavg::shard_of({0, n}, ranks(), r);
    std::vector<vector_of<float>> out;
    std::size_t at = 0;
    for (std::size_t size : sizes) {
      vector_of<float> v(static_cast<Eigen::Index>(size));
      for (Eigen::Index j = 0; j < v.size(); ++j, ++at)
        v[j] = at >= shard.begin && at < shard.end ? updated[at] : float(-1000 - r);
      out.push_back(v);
    }
    return out;
  };
  for (compression format : {compression::none, compression::bfloat16, compression::int8}) {
    INFO("format " << static_cast<int>(format));
    thread_options o;
    o.exchange.compression = format;
    o.exchange.fusion_bytes = 4000;
    std::vector<rank_result<float>> start(static_cast<std::size_t>(ranks()));
    for (int r = 0; r < ranks(); ++r) start[static_cast<std::size_t>(r)].means = parameters_of(r);
    const auto want = run_ranks<float>(ranks(), std::move(start), [&](int, auto& wire, auto& work, auto& mine) {
      gradavg::detail::processes::gather_shards(wire, work, mine.means, o);
      return gradavg::summary{};
    });
    auto mine = parameters_of(rank());
    gradavg::c10d::gather_shards(group(), mine, c10d_options_of(o));
    CHECK(same_outputs(mine, want[static_cast<std::size_t>(rank())].means));
    if (format == compression::none) CHECK(same_bits(flat(mine).data(), updated, n));
  }
}

TEST_CASE("c10d: a plan keeps the agreement and gives the bits of the call without one") {
  const auto towers = random_ranks<double>(ranks(), [](int) { return std::size_t{2}; });
  gradavg::plan p;
  auto plain = sentinel_outputs<double>();
  gradavg::c10d::average_gradients_into(group(), towers[static_cast<std::size_t>(rank())], plain);
  for (int step = 0; step < 3; ++step) {
    auto planned = sentinel_outputs<double>();
    gradavg::c10d::average_gradients_into(p, group(), towers[static_cast<std::size_t>(rank())], planned);
    CHECK(same_outputs(planned, plain));
  }
}

TEST_CASE("c10d: one rank's bad output is its error there, remote_error elsewhere, nothing written anywhere") {
  const auto towers = random_ranks<float>(ranks(), [](int) { return std::size_t{1}; });
  auto means = sentinel_outputs<float>();
  const int bad = ranks() - 1;
  if (rank() == bad) means[2] = vector_of<float>::Constant(5, sentinel<float>);
  const auto call = [&] { gradavg::c10d::average_gradients_into(group(), towers[static_cast<std::size_t>(rank())], means); };
  if (rank() == bad) {
    CHECK_THROWS_AS(call(), gradavg::output_error);
  } else {
    const std::string message = message_of<gradavg::remote_error>(call);
    CHECK_THAT(message, Catch::Matchers::Contains("gradavg::c10d") &&
                            Catch::Matchers::Contains("rank " + std::to_string(bad)));
  }
  for (const auto& m : means)
    for (Eigen::Index j = 0; j < m.size(); ++j) REQUIRE(m[j] == sentinel<float>);
  // A different variable count on the last rank: tower_error on every rank.
  auto fewer = towers[static_cast<std::size_t>(rank())];
  if (rank() == bad) fewer[0].pop_back();
  auto out = sentinel_outputs<float>();
  if (rank() == bad) out.pop_back();
  CHECK_THROWS_AS(gradavg::c10d::average_gradients_into(group(), fewer, out), gradavg::tower_error);
}

TEST_CASE("c10d: the torchrun variables, each missing or malformed, named in the error") {
  struct saved {
    std::string name;
    std::string value;
    bool set;
  };
  std::vector<saved> keep;
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) {
    const char* v = std::getenv(name);
    keep.push_back({name, v ? v : "", v != nullptr});
  }
  const auto put = [](const char* name, const char* value) {
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  };
  const auto failure = [] {
    return message_of<gradavg::c10d_error>([] { (void)gradavg::c10d::launch_from_environment(); });
  };
  put("RANK", "1"), put("WORLD_SIZE", "2"), put("MASTER_ADDR", "127.0.0.1"), put("MASTER_PORT", "29500");
  put("LOCAL_RANK", nullptr), put("LOCAL_WORLD_SIZE", nullptr);
  const gradavg::c10d::launch l = gradavg::c10d::launch_from_environment();
  CHECK(l.rank == 1);
  CHECK(l.world_size == 2);
  CHECK(l.local_rank == 1);
  CHECK(l.local_world_size == 2);
  CHECK(l.master_addr == "127.0.0.1");
  CHECK(l.master_port == 29500);
  put("RANK", nullptr);
  CHECK_THAT(failure(), Catch::Matchers::Contains("RANK is not set"));
  put("RANK", "2");
  CHECK_THAT(failure(), Catch::Matchers::Contains("RANK is \"2\"") && Catch::Matchers::Contains("from 0 to 1"));
  put("RANK", "one");
  CHECK_THAT(failure(), Catch::Matchers::Contains("RANK is \"one\""));
  put("RANK", "0"), put("WORLD_SIZE", nullptr);
  CHECK_THAT(failure(), Catch::Matchers::Contains("WORLD_SIZE is not set"));
  put("WORLD_SIZE", "2"), put("MASTER_ADDR", nullptr);
  CHECK_THAT(failure(), Catch::Matchers::Contains("MASTER_ADDR is not set"));
  put("MASTER_ADDR", "127.0.0.1"), put("MASTER_PORT", "70000");
  CHECK_THAT(failure(), Catch::Matchers::Contains("MASTER_PORT is \"70000\""));
  put("MASTER_PORT", "29500"), put("LOCAL_RANK", "5");
  CHECK_THAT(failure(), Catch::Matchers::Contains("LOCAL_RANK is \"5\""));
  for (const auto& s : keep) put(s.name.c_str(), s.set ? s.value.c_str() : nullptr);
}

namespace {

/// A fault case's own group (a FileStore beside the launcher's), short timeout: 3 s.
c10::intrusive_ptr<::c10d::ProcessGroup> fault_group(const char* name) {
  return environment_group(std::string(".") + name, std::chrono::seconds(3));
}

/// The surviving ranks' call: a c10d_error that names the library, not a hang. One variable of
/// 8 Mi floats: with 4 MiB buckets, two threads share each bucket's kernel (chunks of 1 MiB).
void call_survives(::c10d::ProcessGroup& g, gradavg::c10d::options o = {}) {
  towers_of<float> towers(1);
  towers[0].emplace_back(vector_of<float>::Constant(std::size_t{8} << 20, 0.5f), "w");
  std::vector<vector_of<float>> means(1, vector_of<float>(std::size_t{8} << 20));
  o.exchange.fusion_bytes = std::size_t{4} << 20;
  const std::string message =
      message_of<gradavg::c10d_error>([&] { gradavg::c10d::average_gradients_into(g, towers, means, o); });
  CHECK_THAT(message, Catch::Matchers::StartsWith("gradavg::c10d: "));
}

/// An executor that runs the tasks inline and ends the process at its second call (the kernel of
/// the second bucket: the first bucket's moves are under way).
struct dying_executor final : gradavg::executor {
  int calls = 0;
  std::size_t concurrency() const noexcept override { return 1; }
  void parallel_for(std::size_t n, gradavg::task_ref task) override {
    if (++calls == 2) std::_Exit(0);
    for (std::size_t i = 0; i < n; ++i) task(i);
  }
};

}  // namespace

TEST_CASE("c10d fault: a rank that dies before the call: c10d_error on every other rank", "[fault][dies_before]") {
  const auto g = fault_group("dies_before");
  if (g->getRank() == g->getSize() - 1) std::_Exit(0);
  call_survives(*g);
}

TEST_CASE("c10d fault: a rank that dies inside the call, its moves under way: c10d_error on every other rank",
          "[fault][dies_inside]") {
  const auto g = fault_group("dies_inside");
  dying_executor dying;
  gradavg::c10d::options o;
  if (g->getRank() == g->getSize() - 1) o.run.pool = &dying, o.run.threads = 2;
  call_survives(*g, o);
}

TEST_CASE("c10d fault: a rank that stops calling: c10d_error on every other rank within the timeout",
          "[fault][stops_calling]") {
  const auto g = fault_group("stops_calling");
  if (g->getRank() == g->getSize() - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(9));
    std::_Exit(0);
  }
  call_survives(*g);
}

namespace {

/// A port on 127.0.0.1 that nothing listens on (bound, then closed).
std::uint16_t closed_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof a;
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &length);
  ::close(s);
  return ntohs(a.sin_port);
}

/// A FileStore path of this process's own, the file removed.
std::string store_path(const char* name) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("gradavg_launch_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove(path);
  return path.string();
}

/// Each launch's group made on a thread of its own: the message of its c10d_error, or "" if the
/// group was made.
std::vector<std::string> make_groups(const std::vector<std::function<void()>>& makers) {
  std::vector<std::string> messages(makers.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < makers.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        makers[i]();
      } catch (const gradavg::c10d_error& e) {
        messages[i] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return messages;
}

}  // namespace

TEST_CASE("c10d launch: a store nobody serves is an error naming MASTER_ADDR:MASTER_PORT after the timeout",
          "[launch]") {
  gradavg::c10d::launch l;
  l.rank = 1;
  l.world_size = 2;
  l.master_addr = "127.0.0.1";
  l.master_port = closed_port();
  const std::string message = message_of<gradavg::c10d_error>(
      [&] { (void)gradavg::c10d::process_group(l, std::chrono::seconds(1)); });
  CHECK_THAT(message, Catch::Matchers::Contains("reaching the store at MASTER_ADDR:MASTER_PORT = 127.0.0.1:" +
                                                std::to_string(l.master_port)));
}

TEST_CASE("c10d launch: a world size unlike rank 0's, two processes with one rank, a rank that never comes",
          "[launch]") {
  using gradavg::c10d::process_group_over_file;
  const auto timeout = std::chrono::seconds(2);
  {
    INFO("world sizes 2 and 3");
    const std::string path = store_path("world");
    const auto m = make_groups({[&] { process_group_over_file(path, 0, 2, timeout); },
                                [&] { process_group_over_file(path, 1, 3, timeout); }});
    CHECK_THAT(m[1], Catch::Matchers::Contains("rank 1: WORLD_SIZE is 3 here but 2 on rank 0"));
    CHECK_THAT(m[0], Catch::Matchers::StartsWith("gradavg::c10d: "));  // rank 1 never joins its group
    std::filesystem::remove(path);
  }
  {
    INFO("two processes with RANK=1");
    const std::string path = store_path("twice");
    std::vector<c10::intrusive_ptr<::c10d::ProcessGroup>> made(3);
    const auto m = make_groups({[&] { made[0] = process_group_over_file(path, 0, 2, timeout); },
                                [&] { made[1] = process_group_over_file(path, 1, 2, timeout); },
                                [&] {
                                  std::this_thread::sleep_for(std::chrono::milliseconds(200));
                                  made[2] = process_group_over_file(path, 1, 2, timeout);
                                }});
    CHECK(m[0].empty());
    CHECK(m[1].empty());
    CHECK_THAT(m[2], Catch::Matchers::Contains("another process has claimed this rank already (two processes with "
                                               "RANK=1)"));
    made.clear();
    std::filesystem::remove(path);
  }
  {
    INFO("rank 2 of 3 never comes");
    const std::string path = store_path("absent");
    const auto m = make_groups({[&] { process_group_over_file(path, 0, 3, timeout); },
                                [&] { process_group_over_file(path, 1, 3, timeout); }});
    for (const auto& message : m) CHECK_THAT(message, Catch::Matchers::Contains("never came: rank 2"));
    std::filesystem::remove(path);
  }
}

TEST_CASE("c10d launch: under torchrun's agent store every rank is a client, and each restart meets under keys of "
          "its own",
          "[launch]") {
  // The agent: a TCPStore server at a free port, as torchrun's agent serves one.
  const std::uint16_t port = closed_port();
  ::c10d::TCPStoreOptions serving;
  serving.port = port;
  serving.isServer = true;
  serving.waitWorkers = false;
  const auto agent = c10::make_intrusive<::c10d::TCPStore>("127.0.0.1", serving);
  for (int attempt : {0, 1}) {
    INFO("attempt " << attempt);
    std::vector<c10::intrusive_ptr<::c10d::ProcessGroup>> made(2);
    std::vector<std::function<void()>> makers;
    for (int r = 0; r < 2; ++r)
      makers.push_back([&, r] {
        gradavg::c10d::launch l;
        l.rank = r;
        l.world_size = 2;
        l.master_addr = "127.0.0.1";
        l.master_port = port;
        l.agent_store = true;
        l.attempt = attempt;
        made[static_cast<std::size_t>(r)] = gradavg::c10d::process_group(l, std::chrono::seconds(10));
      });
    const auto m = make_groups(makers);
    CHECK(m[0].empty());
    CHECK(m[1].empty());
    // The two ranks reduce over the group they made.
    std::vector<std::uint64_t> sums(2);
    std::vector<std::thread> ranks_threads;
    for (int r = 0; r < 2 && m[0].empty() && m[1].empty(); ++r)
      ranks_threads.emplace_back([&, r] {
        std::uint64_t word = static_cast<std::uint64_t>(r) + 5;
        gradavg::c10d::detail::reduce_words(*made[static_cast<std::size_t>(r)], &word, 1, ::c10d::ReduceOp::MAX);
        sums[static_cast<std::size_t>(r)] = word;
      });
    for (auto& t : ranks_threads) t.join();
    if (m[0].empty() && m[1].empty()) CHECK((sums[0] == 6 && sums[1] == 6));
  }
}

TEST_CASE("c10d launch: TORCHELASTIC_USE_AGENT_STORE and TORCHELASTIC_RESTART_COUNT are read", "[launch]") {
  setenv("RANK", "0", 1), setenv("WORLD_SIZE", "2", 1), setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  unsetenv("TORCHELASTIC_USE_AGENT_STORE"), unsetenv("TORCHELASTIC_RESTART_COUNT");
  gradavg::c10d::launch l = gradavg::c10d::launch_from_environment();
  CHECK_FALSE(l.agent_store);
  CHECK(l.attempt == 0);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1), setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  l = gradavg::c10d::launch_from_environment();
  CHECK(l.agent_store);
  CHECK(l.attempt == 3);
  setenv("TORCHELASTIC_RESTART_COUNT", "x", 1);
  CHECK_THAT(message_of<gradavg::c10d_error>([] { (void)gradavg::c10d::launch_from_environment(); }),
             Catch::Matchers::Contains("TORCHELASTIC_RESTART_COUNT is \"x\""));
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                           "TORCHELASTIC_RESTART_COUNT"})
    unsetenv(name);
}
