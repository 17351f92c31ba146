// gradavg::mpi with a failure injected on one rank at every point of a call: the n-th
// tensor_traits call, the n-th allocation (operator new, replaced here), the n-th executor call,
// for every n until a call completes without one. ctest runs it under mpiexec with 2, 3 and 4
// ranks and a timeout: a rank left waiting in MPI fails the test. After each injected failure:
// that rank throws what was injected, every other rank remote_error naming it, no rank hangs;
// outputs are untouched on every rank when the failure came before any data moved (every
// tensor_traits call and allocation), and are partly written when the executor failed.
// Also: what MPI cannot take (a null or inter-communicator) and the statistics' independence of
// the bucket size.
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "mpi_support.hpp"
#include "replaced_new.hpp"
#include "support.hpp"

namespace {

/// The failure a countdown injects (not a gradavg::error: user code's own exception).
struct injected : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Counts events while armed and fires once, at the n-th.
struct countdown {
  std::atomic<bool> armed{false};
  std::atomic<long> left{0};
  std::atomic<long> seen{0};
  std::atomic<bool> fired{false};
  void arm(long n) {
    left = n;
    seen = 0;
    fired = false;
    armed = true;
  }
  void disarm() { armed = false; }
  /// True exactly once: at the n-th event while armed.
  bool tick() {
    if (!armed.load()) return false;
    ++seen;
    if (left.fetch_sub(1) == 1) {
      fired = true;
      return true;
    }
    return false;
  }
};

countdown traits_failure, allocation_failure, executor_failure;

}  // namespace

void gradavg_test::on_allocation() {
  if (allocation_failure.tick()) throw std::bad_alloc();
}

namespace user {

/// A view of a float buffer whose every tensor_traits call may be the one that fails.
struct flaky {
  std::vector<float>* values = nullptr;
};

}  // namespace user

template <>
struct gradavg::tensor_traits<user::flaky> {
  using value_type = float;
  static constexpr bool view = true;
  static void maybe_fail(const char* what) {
    if (traits_failure.tick()) throw injected(std::string("injected failure in tensor_traits::") + what);
  }
  static bool present(const user::flaky& t) {
    maybe_fail("present");
    return t.values != nullptr;
  }
  static const float* data(const user::flaky& t) {
    maybe_fail("data");
    return t.values->data();
  }
  static float* mutable_data(user::flaky& t) {
    maybe_fail("mutable_data");
    return t.values->data();
  }
  static gradavg::shape shape(const user::flaky& t) {
    maybe_fail("shape");
    return gradavg::shape::vector(t.values->size());
  }
};

namespace {

using gradavg_test::contains;

using gradavg_test::world_rank;
using gradavg_test::world_size;
using gradavg_test::hash_of;

const gradavg_test::mpi_session session;

bool on_any_rank(bool mine) {
  int x = mine ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return x != 0;
}


/// This rank's towers: rank r holds 1 + r % 2 towers of one gradient per size in `sizes`, each
/// element a small integer from the rank, the tower and its position.
struct layout {
  std::vector<std::size_t> sizes;
  std::vector<std::vector<std::vector<float>>> data;  // [local tower][variable]
  explicit layout(std::vector<std::size_t> sizes_) : sizes(std::move(sizes_)) {
    const std::size_t towers = 1 + static_cast<std::size_t>(world_rank()) % 2;
    data.resize(towers);
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        std::vector<float> v(sizes[i]);
        for (std::size_t j = 0; j < v.size(); ++j)
          v[j] = static_cast<float>((world_rank() * 7 + static_cast<int>(k) * 3 + static_cast<int>(i + j)) % 11) - 5;
        data[k].push_back(std::move(v));
      }
  }
  std::vector<std::vector<float>> outputs() const {
    std::vector<std::vector<float>> out;
    for (std::size_t n : sizes) out.emplace_back(n, -1234.5f);
    return out;
  }
  /// (gradient, name) towers over data.
  std::vector<std::vector<std::pair<const std::vector<float>*, std::string>>> towers() const {
    std::vector<std::vector<std::pair<const std::vector<float>*, std::string>>> tg(data.size());
    for (std::size_t k = 0; k < data.size(); ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) tg[k].push_back({&data[k][i], "v" + std::to_string(i)});
    return tg;
  }
};

using flaky_towers = std::vector<std::vector<std::pair<user::flaky, std::string>>>;

flaky_towers towers_of(layout& l) {
  flaky_towers tg(l.data.size());
  for (std::size_t k = 0; k < l.data.size(); ++k)
    for (std::size_t i = 0; i < l.sizes.size(); ++i)
      tg[k].push_back({user::flaky{&l.data[k][i]}, "v" + std::to_string(i)});
  return tg;
}

/// Flaky views of out[first, first + count).
std::vector<user::flaky> outputs_of(std::vector<std::vector<float>>& out, std::size_t first, std::size_t count) {
  std::vector<user::flaky> o;
  for (std::size_t i = first; i < first + count; ++i) o.push_back({&out[i]});
  return o;
}

/// What one rank saw of one call.
struct outcome {
  bool threw = false;
  bool injected_here = false;  // the exception was the injected one (or std::bad_alloc)
  bool remote = false;         // gradavg::remote_error
  std::string message;
};

template <class F>
outcome run_call(F&& call) {
  outcome o;
  try {
    call();
  } catch (const gradavg::remote_error& e) {
    o.threw = o.remote = true;
    o.message = e.what();
  } catch (const injected& e) {
    o.threw = o.injected_here = true;
    o.message = e.what();
  } catch (const std::bad_alloc&) {
    o.threw = o.injected_here = true;
    o.message = "std::bad_alloc";
  } catch (const std::exception& e) {
    o.threw = true;
    o.message = e.what();
  }
  return o;
}

/// Runs `failure` armed at event n on rank `failing` only around gradavg's call: call(out,
/// before, guarded) fills out (the outputs) and before (their hash), then runs the gradavg call
/// as guarded(f). For n = 1, 2, ... until a call completes without the failure firing; checks
/// every rank's outcome each time; untouched: whether every rank's outputs must be as before after
/// a failure. Returns the number of injection points found.
template <class Call>
long inject_everywhere(countdown& failure, int failing, bool untouched, Call&& call) {
  const bool me = world_rank() == failing;
  for (long n = 1;; ++n) {
    INFO("failure at event " << n << " on rank " << failing);
    std::vector<std::vector<float>> out;
    std::uint64_t before = 0;
    auto guarded = [&](auto&& f) {
      if (me) failure.arm(n);
      try {
        f();
      } catch (...) {
        failure.disarm();
        throw;
      }
      failure.disarm();
    };
    const outcome o = run_call([&] { call(out, before, guarded); });
    const bool fired = on_any_rank(me && failure.fired.load());
    if (!fired) {
      CHECK_FALSE(o.threw);
      UNSCOPED_INFO(o.message);
      return n - 1;
    }
    if (me) {
      CHECK(o.injected_here);
      if (!o.injected_here) UNSCOPED_INFO("rank " << failing << " threw: " << o.message);
    } else {
      CHECK(o.remote);
      CHECK(contains(o.message, "rank " + std::to_string(failing)));
      if (!o.remote) UNSCOPED_INFO("threw: " << o.message);
    }
    if (untouched) CHECK(hash_of(out) == before);
    if (n > 100000) {
      FAIL("no end to the injection points");
      return n;
    }
  }
}

/// An executor that runs the tasks inline and may fail: before any task, or after the first.
struct failing_executor final : gradavg::executor {
  bool after_first_task = false;
  std::size_t concurrency() const noexcept override { return 2; }
  void parallel_for(std::size_t n, gradavg::task_ref task) override {
    if (!after_first_task && executor_failure.tick()) throw injected("injected failure in parallel_for");
    for (std::size_t i = 0; i < n; ++i) {
      task(i);
      if (after_first_task && i == 0 && executor_failure.tick()) throw injected("injected failure after a task");
    }
  }
};

}  // namespace

TEST_CASE("a tensor_traits call that fails at any point on one rank: its error there, remote_error elsewhere, "
          "nothing written, no hang") {
  layout l({5, 300, 7});
  for (const int failing : {0, world_size() - 1}) {
    for (const bool squares : {false, true}) {
      INFO((squares ? "means and squares" : "means") << ", failing rank " << failing);
      gradavg::mpi::workspace work;
      auto call = [&](std::vector<std::vector<float>>& out, std::uint64_t& before, auto&& guarded) {
        const std::size_t v = l.sizes.size();
        out = l.outputs();  // the means, then the squares
        const auto more = l.outputs();
        out.insert(out.end(), more.begin(), more.end());
        before = hash_of(out);
        const flaky_towers tg = towers_of(l);
        auto means = outputs_of(out, 0, v);
        auto squares_out = outputs_of(out, v, v);
        gradavg::mpi::options opts;
        opts.exchange.fusion_bytes = 4 * 64;  // several buckets
        opts.exchange.work = &work;
        opts.compute.statistics = true;
        opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
        guarded([&] {
          if (squares)
            gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, means, squares_out, opts);
          else
            gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, means, opts);
        });
      };
      const long points = inject_everywhere(traits_failure, failing, true, call);
      CHECK(points > 10);  // every traits call of validation and preparation
    }
  }
}

TEST_CASE("an allocation that fails at any point on one rank: std::bad_alloc there, remote_error elsewhere, "
          "nothing written, no hang") {
  layout l({5, 300, 7});
  for (const int failing : {0, world_size() - 1}) {
    for (const bool with_workspace : {false, true}) {
      // With a workspace, both exchanges (their buffers differ).
      const auto how = with_workspace ? gradavg::mpi::exchange_method::collectives
                                      : gradavg::mpi::exchange_method::point_to_point;
      INFO((with_workspace ? "a workspace kept between calls, collectives" : "no workspace")
           << ", failing rank " << failing);
      gradavg::mpi::workspace work;
      auto call = [&](std::vector<std::vector<float>>& out, std::uint64_t& before, auto&& guarded) {
        out = l.outputs();
        before = hash_of(out);
        gradavg::mpi::options opts;
        opts.exchange.fusion_bytes = 4 * 64;
        opts.compute.statistics = true;
        opts.exchange.method = how;
        if (with_workspace) opts.exchange.work = &work;
        const auto tg = l.towers();
        guarded([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, out, opts); });
      };
      // The workspace holds its buffers after a first call: later calls allocate less.
      const long points = inject_everywhere(allocation_failure, failing, true, call);
      CHECK(points > 0);
    }
    INFO("the allocating API, failing rank " << failing);
    auto allocating = [&](std::vector<std::vector<float>>& out, std::uint64_t& before, auto&& guarded) {
      out.clear();
      before = hash_of(out);
      const auto tg = l.towers();
      gradavg::mpi::options opts;
      opts.exchange.fusion_bytes = 4 * 64;
      std::size_t averaged = 0;
      guarded([&] {
        averaged = gradavg::mpi::average_gradients(MPI_COMM_WORLD, tg, gradavg::include_square, opts).gradients.size();
      });
      CHECK(averaged == 3);
    };
    CHECK(inject_everywhere(allocation_failure, failing, true, allocating) > 3);
  }
}

TEST_CASE("sharded output and the gather of shards: a tensor_traits call or an allocation that fails at any point on "
          "one rank: its error there, remote_error elsewhere, nothing written, no hang") {
  layout l({5, 300, 7});
  for (const int failing : {0, world_size() - 1})
    for (const auto format : {gradavg::compression::none, gradavg::compression::float16}) {
      INFO("failing rank " << failing << ", compression " << static_cast<int>(format));
      gradavg::mpi::workspace work;
      gradavg::mpi::options opts;
      opts.exchange.fusion_bytes = 4 * 64;  // several buckets
      opts.exchange.work = &work;
      opts.exchange.compression = format;
      opts.exchange.output = gradavg::output_mode::sharded;
      opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
      auto sharded = [&](std::vector<std::vector<float>>& out, std::uint64_t& before, auto&& guarded) {
        out = l.outputs();
        before = hash_of(out);
        const flaky_towers tg = towers_of(l);
        auto means = outputs_of(out, 0, l.sizes.size());
        guarded([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, means, opts); });
      };
      CHECK(inject_everywhere(traits_failure, failing, true, sharded) > 10);
      opts.exchange.work = nullptr;  // the allocations: each call's own buffers
      CHECK(inject_everywhere(allocation_failure, failing, true, sharded) > 0);
      // The gather: its parameters' reads, its tables and buffers (a workspace of its own).
      gradavg::mpi::workspace gather_work;
      opts.exchange.work = &gather_work;
      auto gather = [&](std::vector<std::vector<float>>& out, std::uint64_t& before, auto&& guarded) {
        out = l.outputs();
        for (std::size_t i = 0; i < out.size(); ++i) out[i][0] = static_cast<float>(world_rank() + 1);
        before = hash_of(out);
        auto parameters = outputs_of(out, 0, l.sizes.size());
        guarded([&] { gradavg::mpi::gather_shards(MPI_COMM_WORLD, parameters, opts); });
      };
      CHECK(inject_everywhere(traits_failure, failing, true, gather) >= 3);
      opts.exchange.work = nullptr;
      CHECK(inject_everywhere(allocation_failure, failing, true, gather) > 0);
    }
}

TEST_CASE("an executor that fails at any call on one rank, before or after a task: its error there, "
          "remote_error elsewhere, no hang") {
  // A variable of 1.5 M floats in buckets of 2 MiB: three buckets, each bucket's kernel through
  // the executor (two chunks).
  layout l({5, 1500000, 7});
  for (const int failing : {0, world_size() - 1}) {
    for (const bool after_first_task : {false, true}) {
      // After the first task, the buckets move by the collectives.
      const auto how = after_first_task ? gradavg::mpi::exchange_method::collectives
                                        : gradavg::mpi::exchange_method::point_to_point;
      INFO((after_first_task ? "after the first task, collectives" : "before any task") << ", failing rank "
                                                                                         << failing);
      failing_executor pool;
      pool.after_first_task = after_first_task;
      gradavg::mpi::workspace work;
      auto call = [&](std::vector<std::vector<float>>& out, std::uint64_t& before, auto&& guarded) {
        out = l.outputs();
        before = hash_of(out);
        const auto tg = l.towers();
        gradavg::mpi::options opts;
        opts.exchange.fusion_bytes = std::size_t{2} << 20;
        opts.exchange.work = &work;
        opts.run.threads = 2;
        opts.run.pool = &pool;
        opts.exchange.method = how;
        guarded([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, out, opts); });
      };
      // Outputs are then partly written (the data had started to move): not compared.
      CHECK(inject_everywhere(executor_failure, failing, false, call) >= 2);
    }
  }
}

TEST_CASE("a rank with no towers: tower_error there, remote_error elsewhere, nothing written") {
  layout l({5, 7});
  const int last = world_size() - 1;
  auto tg = l.towers();
  if (world_rank() == last) tg.clear();
  auto out = l.outputs();
  const std::uint64_t before = hash_of(out);
  const outcome o = run_call([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, out); });
  CHECK(o.threw);
  if (world_rank() == last)
    CHECK(contains(o.message, "holds no towers"));
  else
    CHECK((o.remote && contains(o.message, "rank " + std::to_string(last))));
  CHECK(hash_of(out) == before);
}

TEST_CASE("a null or an inter-communicator is an mpi_error on every rank") {
  layout l({5, 7});
  const auto tg = l.towers();
  auto out = l.outputs();
  const std::uint64_t before = hash_of(out);
  const auto null = gradavg_test::message_of<gradavg::mpi_error>(
      [&] { gradavg::mpi::average_gradients_into(MPI_COMM_NULL, tg, out); });
  CHECK(contains(null, "MPI_COMM_NULL"));

  // Two halves of the world joined by an inter-communicator.
  const int half = world_rank() < world_size() / 2 ? 0 : 1;
  MPI_Comm local = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, half, world_rank(), &local);
  const int remote_leader = half == 0 ? world_size() / 2 : 0;
  MPI_Intercomm_create(local, 0, MPI_COMM_WORLD, remote_leader, 77, &inter);
  const auto message = gradavg_test::message_of<gradavg::mpi_error>(
      [&] { gradavg::mpi::average_gradients_into(inter, tg, out); });
  CHECK(contains(message, "inter-communicator"));
  MPI_Comm_free(&inter);
  MPI_Comm_free(&local);
  CHECK(hash_of(out) == before);
}

TEST_CASE("the statistics do not depend on the bucket size: the same bits for every fusion_bytes") {
  layout l({1, 1000, 37, 4099, 3});
  const auto tg = l.towers();
  auto run = [&](std::size_t fusion_bytes, std::vector<gradavg::variable_statistics>& per) {
    auto out = l.outputs();
    auto sq = l.outputs();
    gradavg::mpi::options opts;
    opts.exchange.fusion_bytes = fusion_bytes;
    opts.compute.statistics = true;
    opts.compute.scale = 0.3;
    opts.compute.per_variable = per;
    return gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, out, sq, opts);
  };
  std::vector<gradavg::variable_statistics> first_per(l.sizes.size());
  const gradavg::summary first = run(0, first_per);
  REQUIRE(first.statistics);
  for (std::size_t fusion_bytes : {std::size_t{8 * 3}, std::size_t{8 * 97}, std::size_t{8 * 1024}, std::size_t{1} << 24}) {
    INFO("fusion_bytes " << fusion_bytes);
    std::vector<gradavg::variable_statistics> per(l.sizes.size());
    const gradavg::summary s = run(fusion_bytes, per);
    CHECK(std::bit_cast<std::uint64_t>(s.sum_mean_squared) == std::bit_cast<std::uint64_t>(first.sum_mean_squared));
    CHECK(std::bit_cast<std::uint64_t>(s.sum_mean_of_squares) ==
          std::bit_cast<std::uint64_t>(first.sum_mean_of_squares));
    for (std::size_t i = 0; i < per.size(); ++i) {
      CHECK(std::bit_cast<std::uint64_t>(per[i].sum_mean_squared) ==
            std::bit_cast<std::uint64_t>(first_per[i].sum_mean_squared));
      CHECK(std::bit_cast<std::uint64_t>(per[i].sum_mean_of_squares) ==
            std::bit_cast<std::uint64_t>(first_per[i].sum_mean_of_squares));
    }
  }
}
