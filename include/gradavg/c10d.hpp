// gradavg::c10d: the same averaging across processes over a PyTorch c10d::ProcessGroup (gloo,
// from libtorch; target gradavg::c10d), and the process group made the way torchrun launches.
//
// The calls are gradavg::mpi's (mpi.hpp's file comment: the phases, the error contract, the data
// path, the bits) with a process group in place of a communicator: every rank of the group calls
// with the same options; the agreement runs as the group's allreduce and allgather of 64-bit
// words, and a bucket's slices move as the group's send / recv (raw bytes, no reduction by the
// engine: owners sum in rank order), so the results are bitwise the same on every rank, from run
// to run, and the same as gradavg::mpi's for the same towers and options. Every operation is
// made on the calling thread; the engine completes them on its own threads. A peer that dies or
// stops calling makes every other rank throw c10d_error within the group's timeout, never hang.
#pragma once

// ProcessGroupGloo.hpp declares its class only under USE_C10D_GLOO (Torch's CMake target defines
// it too; a libtorch built without gloo has no such header).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <utility>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "average.hpp"
#include "c10d_options.hpp"
#include "detail/c10d/transport.hpp"
#include "detail/processes/average.hpp"
#include "detail/processes/gather.hpp"
#include "detail/processes/sparse.hpp"
#include "sparse.hpp"

namespace gradavg {
namespace c10d {

/// The process group's timeout when none is given: every operation (and the making of the
/// group) that waits longer for a peer throws c10d_error.
inline constexpr std::chrono::milliseconds default_timeout = std::chrono::minutes(5);

/// Where this process sits in a job launched the torchrun way (torchrun --nproc_per_node=N
/// --no_python ./train, or a shell loop that sets the same variables).
struct launch {
  int rank = 0;              ///< RANK: 0 to world_size - 1
  int world_size = 1;        ///< WORLD_SIZE
  int local_rank = 0;        ///< LOCAL_RANK (default: rank)
  int local_world_size = 1;  ///< LOCAL_WORLD_SIZE (default: world_size)
  std::string master_addr;   ///< MASTER_ADDR: the host of rank 0's store
  std::uint16_t master_port = 0;  ///< MASTER_PORT
  /// TORCHELASTIC_USE_AGENT_STORE=True (torchrun): torchrun's agent serves the store at
  /// MASTER_ADDR:MASTER_PORT and every rank, rank 0 too, is its client; else rank 0 serves it.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT (torchrun's restarts of the job): each attempt meets under keys
  /// of its own in the store, which outlives them.
  int attempt = 0;
};

namespace shared_detail {

/// An environment variable as an integer in [low, high]; c10d_error naming it otherwise (absent
/// and no fallback, not a number, out of range).
inline long environment_integer(const char* name, long low, long high, const long* fallback = nullptr) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    if (fallback != nullptr) return *fallback;
    throw c10d_error(std::string("gradavg::c10d: the environment variable ") + name +
                     " is not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a shell launch must "
                     "set them)");
  }
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < low || value > high) {
    std::string message = "gradavg::c10d: the environment variable ";
    message.append(name).append(" is \"").append(text).append("\"; it must be an integer from ");
    message.append(std::to_string(low)).append(" to ").append(std::to_string(high));
    throw c10d_error(message);
  }
  return value;
}

/// The group's gloo devices: one per interface of GLOO_SOCKET_IFNAME (comma-separated), as
/// PyTorch does, else the one of this host's name.
inline void add_devices(::c10d::ProcessGroupGloo::Options& how) {
  const char* names = std::getenv("GLOO_SOCKET_IFNAME");
  if (names == nullptr || *names == '\0') {
    how.devices.push_back(::c10d::ProcessGroupGloo::createDefaultDevice());
    return;
  }
  std::string_view rest(names);
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string name(rest.substr(0, comma));
    if (!name.empty())
      how.devices.push_back(::c10d::ProcessGroupGloo::createDeviceForInterface(name));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
}

/// A gloo group over store, after checking that every rank came with rank 0's world size and
/// that no two processes claim one rank; if the group is not made within timeout, the message
/// names the ranks that never came.
inline c10::intrusive_ptr<::c10d::ProcessGroup> gloo_group(const c10::intrusive_ptr<::c10d::Store>& store, int rank,
                                                           int world_size, std::chrono::milliseconds timeout) {
  const std::string here = "gradavg::c10d: rank " + std::to_string(rank) + ": ";
  const std::string world = std::to_string(world_size);
  std::int64_t claims = 0;
  std::string rank_0_world;
  guarded("meeting in the store", [&] {
    claims = store->add("gradavg/rank/" + std::to_string(rank), 1);
    if (rank == 0) store->set("gradavg/world_size", std::vector<std::uint8_t>(world.begin(), world.end()));
    store->wait({"gradavg/world_size"}, timeout);
    const std::vector<std::uint8_t> text = store->get("gradavg/world_size");
    rank_0_world.assign(text.begin(), text.end());
  });
  if (claims > 1)
    throw c10d_error(here + "another process has claimed this rank already (two processes with RANK=" +
                     std::to_string(rank) + ")");
  if (rank_0_world != world)
    throw c10d_error(here + "WORLD_SIZE is " + world + " here but " + rank_0_world + " on rank 0");
  auto how = ::c10d::ProcessGroupGloo::Options::create(timeout);
  guarded("making the gloo devices (GLOO_SOCKET_IFNAME)", [&] { add_devices(*how); });
  try {
    return c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, world_size, how);
  } catch (...) {
    const std::exception_ptr failure = std::current_exception();
    std::string what = "making the gloo group";
    try {
      std::string absent;
      for (int r = 0; r < world_size; ++r)
        if (!store->check({"gradavg/rank/" + std::to_string(r)}))
          absent.append(absent.empty() ? "" : ", ").append(std::to_string(r));
      if (!absent.empty()) what.append(" (never came: rank ").append(absent).append(")");
    } catch (...) {
      // The store is gone too: the group's own words say the rest.
    }
    rethrow_as_c10d_error(what, failure);
  }
}

}  // namespace shared_detail

/// The torchrun variables of this process: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (required),
/// LOCAL_RANK, LOCAL_WORLD_SIZE. c10d_error naming the variable that is absent or malformed.
inline launch launch_from_environment() {
  launch l;
  l.world_size = static_cast<int>(shared_detail::environment_integer("WORLD_SIZE", 1, 1 << 20));
  l.rank = static_cast<int>(shared_detail::environment_integer("RANK", 0, l.world_size - 1));
  const long rank = l.rank, world = l.world_size;
  l.local_world_size = static_cast<int>(shared_detail::environment_integer("LOCAL_WORLD_SIZE", 1, world, &world));
  l.local_rank = static_cast<int>(shared_detail::environment_integer("LOCAL_RANK", 0, l.local_world_size - 1, &rank));
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    throw c10d_error("gradavg::c10d: the environment variable MASTER_ADDR is not set (the host of rank 0)");
  l.master_addr = addr;
  l.master_port = static_cast<std::uint16_t>(shared_detail::environment_integer("MASTER_PORT", 1, 65535));
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  l.agent_store = agent != nullptr && std::string_view(agent) == "True";
  const long first = 0;
  l.attempt = static_cast<int>(shared_detail::environment_integer("TORCHELASTIC_RESTART_COUNT", 0, 1 << 20, &first));
  return l;
}

/// A gloo process group for the job l: rank 0 (or torchrun's agent: l.agent_store) serves a
/// TCPStore at l.master_port, every rank meets there, under keys of l.attempt's own (c10d_error
/// naming MASTER_ADDR:MASTER_PORT if it cannot within timeout), then the
/// group (c10d_error if a world size differs from rank 0's, two processes claim one rank, or a
/// rank does not come within timeout, naming them). GLOO_SOCKET_IFNAME picks the interfaces.
inline c10::intrusive_ptr<::c10d::ProcessGroup> process_group(const launch& l,
                                                              std::chrono::milliseconds timeout = default_timeout) {
  ::c10d::TCPStoreOptions how;
  how.port = l.master_port;
  const bool serves = l.rank == 0 && !l.agent_store;
  how.isServer = serves;
  how.numWorkers = static_cast<std::size_t>(l.world_size);
  how.waitWorkers = false;
  how.timeout = timeout;
  c10::intrusive_ptr<::c10d::Store> store;
  try {
    store = c10::make_intrusive<::c10d::TCPStore>(l.master_addr, how);
  } catch (...) {
    shared_detail::rethrow_as_c10d_error((serves ? "serving the store at MASTER_ADDR:MASTER_PORT = "
                                                 : "reaching the store at MASTER_ADDR:MASTER_PORT = ") +
                                             l.master_addr + ":" + std::to_string(l.master_port),
                                         std::current_exception());
  }
  const auto attempt = c10::make_intrusive<::c10d::PrefixStore>("gradavg/attempt_" + std::to_string(l.attempt),
                                                                 std::move(store));
  return shared_detail::gloo_group(attempt, l.rank, l.world_size, timeout);
}

/// process_group(launch_from_environment(), timeout): the torchrun way in one call.
inline c10::intrusive_ptr<::c10d::ProcessGroup> process_group_from_environment(
    std::chrono::milliseconds timeout = default_timeout) {
  return process_group(launch_from_environment(), timeout);
}

/// A gloo process group whose ranks meet in a FileStore at path (a file every rank reaches, on a
/// shared or local file system; removed by the store when the group is gone): tests and jobs on
/// one host without a port.
inline c10::intrusive_ptr<::c10d::ProcessGroup> process_group_over_file(const std::string& path, int rank,
                                                                        int world_size,
                                                                        std::chrono::milliseconds timeout =
                                                                            default_timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw c10d_error("gradavg::c10d: rank " + std::to_string(rank) + " of a world of " + std::to_string(world_size) +
                     " processes: the rank must be from 0 to the world size - 1");
  c10::intrusive_ptr<::c10d::Store> store = shared_detail::guarded("opening the FileStore at " + path, [&] {
    return c10::intrusive_ptr<::c10d::Store>(c10::make_intrusive<::c10d::FileStore>(path, world_size));
  });
  store->setTimeout(timeout);
  return shared_detail::gloo_group(store, rank, world_size, timeout);
}

GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// f(transport, buffers): the transport over group, with the workspace opts.exchange.work or one
/// of the call's own.
template <class F>
decltype(auto) over_group(::c10d::ProcessGroup& group, const c10d::options& opts, F&& f) {
  workspace own;
  shared_detail::buffers& work = shared_detail::access::of(opts.exchange.work ? *opts.exchange.work : own);
  transport wire(group, work);
  return std::forward<F>(f)(wire, work);
}

/// gradavg::c10d's calls over group. prior, planned, SameElements: see processes::average_into.
template <bool SameElements = false, class TG, class Means, class Squares>
summary average_into(::c10d::ProcessGroup& group, const TG& tg, Means& means, Squares* squares,
                     const c10d::options& opts, std::exception_ptr prior = nullptr, plan* planned = nullptr) {
  return over_group(group, opts, [&](transport& wire, shared_detail::buffers& work) {
    return processes::average_into<SameElements>(wire, work, tg, means, squares, opts, prior, planned);
  });
}

}  // namespace detail

/// gradavg::mpi::average_gradients_into over a process group (see the file comment): the mean
/// over the towers of every rank of group. Collective: every rank of group calls it.
template <tower_gradients TG, class Means>
  requires gradavg::detail::output_range<Means&>
summary average_gradients_into(::c10d::ProcessGroup& group, const TG& tower_grads, Means&& means,
                               const c10d::options& opts = {}) {
  return detail::average_into(group, tower_grads, means, gradavg::detail::no_squares, opts);
}

/// As above, and squares[i] receives the mean over all towers of all ranks of the squared gradient.
template <tower_gradients TG, class Means, class Squares>
  requires gradavg::detail::output_range<Means&> && gradavg::detail::output_range<Squares&>
summary average_gradients_into(::c10d::ProcessGroup& group, const TG& tower_grads, Means&& means, Squares&& squares,
                               const c10d::options& opts = {}) {
  return detail::average_into(group, tower_grads, means, &squares, opts);
}

/// Row-sparse gradients (sparse.hpp) across the ranks of group: gradavg::mpi's row-sparse call
/// (every rank's listed rows, or the sums as a dense tensor, to every rank, added in rank order;
/// plain mean and squares).
template <sparse_tower_gradients TG, class Means>
  requires gradavg::detail::sparse_output_range<Means&>
summary average_gradients_into(::c10d::ProcessGroup& group, const TG& tower_grads, Means&& means,
                               const c10d::options& opts = {}) {
  return detail::over_group(group, opts, [&](detail::transport& wire, shared_detail::buffers&) {
    return gradavg::detail::processes::average_sparse_across(wire, tower_grads, means, gradavg::detail::no_squares,
                                                             opts, nullptr);
  });
}

/// As above, and the means of squares.
template <sparse_tower_gradients TG, class Means, class Squares>
  requires gradavg::detail::sparse_output_range<Means&> && gradavg::detail::sparse_output_range<Squares&>
summary average_gradients_into(::c10d::ProcessGroup& group, const TG& tower_grads, Means&& means, Squares&& squares,
                               const c10d::options& opts = {}) {
  return detail::over_group(group, opts, [&](detail::transport& wire, shared_detail::buffers&) {
    return gradavg::detail::processes::average_sparse_across(wire, tower_grads, means, &squares, opts, nullptr);
  });
}

/// As above, keeping in p this rank's proof and what every rank agreed (gradavg::mpi's plan
/// overloads: while every rank's plan holds, the agreement on variables is not repeated).
template <std::same_as<plan> P, tower_gradients TG, class Means>
  requires gradavg::detail::output_range<Means&>
summary average_gradients_into(P& p, ::c10d::ProcessGroup& group, const TG& tower_grads, Means&& means,
                               const c10d::options& opts = {}) {
  return detail::average_into(group, tower_grads, means, gradavg::detail::no_squares, opts, nullptr, &p);
}

/// As above, with squares.
template <std::same_as<plan> P, tower_gradients TG, class Means, class Squares>
  requires gradavg::detail::output_range<Means&> && gradavg::detail::output_range<Squares&>
summary average_gradients_into(P& p, ::c10d::ProcessGroup& group, const TG& tower_grads, Means&& means,
                               Squares&& squares, const c10d::options& opts = {}) {
  return detail::average_into(group, tower_grads, means, &squares, opts, nullptr, &p);
}

/// The allocating form: gradavg::average_gradients over every rank's towers.
template <tower_gradients TG>
auto average_gradients(::c10d::ProcessGroup& group, const TG& tower_grads, const c10d::options& opts = {}) {
  return gradavg::detail::average_allocating_across(tower_grads, false, opts.local(),
                                                     [&](auto& means, auto* squares, std::exception_ptr prior) {
                                                       return detail::average_into(group, tower_grads, means, squares,
                                                                                   opts, prior);
                                                     });
}

/// As above, with the means of squares (gradavg::include_square).
template <tower_gradients TG>
auto average_gradients(::c10d::ProcessGroup& group, const TG& tower_grads, include_square_t,
                       const c10d::options& opts = {}) {
  return gradavg::detail::average_allocating_across(tower_grads, true, opts.local(),
                                                     [&](auto& means, auto* squares, std::exception_ptr prior) {
                                                       return detail::average_into(group, tower_grads, means, squares,
                                                                                   opts, prior);
                                                     });
}

/// gradavg::mpi::gather_shards over a process group: after sharded averaging and an update of
/// each rank's shard, every rank's shard of parameters sent to every other rank.
template <class Params>
  requires gradavg::detail::output_range<Params&>
void gather_shards(::c10d::ProcessGroup& group, Params&& parameters, const c10d::options& opts = {}) {
  detail::over_group(group, opts, [&](detail::transport& wire, shared_detail::buffers& work) {
    gradavg::detail::processes::gather_shards(wire, work, parameters, opts);
  });
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace c10d
}  // namespace gradavg
