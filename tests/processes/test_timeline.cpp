// gradavg::timeline (timeline.hpp): the events a call records and its profile across processes,
// over the transport of threads (support/thread_transport.hpp). Checked against counts derived
// here from the layout (buckets, bytes on the wire, bytes read and written), against the file's
// text, and against the same call without a timeline (the same bits).
#include <gradavg/gradavg.hpp>

#include <Eigen/Dense>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <latch>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "support.hpp"
#include "thread_transport.hpp"

namespace {

using namespace gradavg_test;

/// A timeline's events by name, read back from its file (the writer's one-line-per-event form:
/// each complete event's "name" and "tid").
struct read_back {
  std::map<std::string, std::size_t> count;  // complete events by name
  std::map<unsigned, std::size_t> rows;      // complete events by row (tid)
  std::size_t complete = 0;
  std::string text;
};

read_back read_file(const std::string& path) {
  std::ifstream in(path);
  read_back r;
  r.text.assign(std::istreambuf_iterator<char>(in), {});
  std::size_t at = 0;
  while ((at = r.text.find("\"ph\":\"X\"", at)) != std::string::npos) {
    const std::size_t line = r.text.rfind('\n', at) + 1;
    const std::size_t name = r.text.find("\"name\":\"", line) + 8;
    r.count[r.text.substr(name, r.text.find('"', name) - name)] += 1;
    const std::size_t tid = r.text.find("\"tid\":", at) + 6;
    r.rows[static_cast<unsigned>(std::stoul(r.text.substr(tid)))] += 1;
    ++r.complete;
    ++at;
  }
  return r;
}

/// A scratch directory for the files of one test case.
struct scratch_dir {
  std::filesystem::path path;
  explicit scratch_dir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / ("gradavg_timeline_" + name)) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~scratch_dir() { std::filesystem::remove_all(path); }
};

/// n floats per rank (one tower, one variable), on `ranks` threads, means and squares, buckets of
/// `bucket` elements (a mean's and a square's sum each), each rank with its timeline when `lines`
/// holds them.
std::vector<rank_result<float>> run(int ranks, std::size_t n, std::size_t bucket, gradavg::compression c,
                                    std::vector<std::unique_ptr<gradavg::timeline>>* lines) {
  std::vector<towers_of<float>> towers(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    vector_of<float> g(static_cast<Eigen::Index>(n));
    for (std::size_t j = 0; j < n; ++j) g[static_cast<Eigen::Index>(j)] = static_cast<float>((j * 7 + r * 3) % 17) - 8.0f;
    towers[static_cast<std::size_t>(r)] = {{{g, "w"}}};
  }
  return average_on_ranks<float>(towers, {vector_of<float>::Zero(static_cast<Eigen::Index>(n))}, [&](int r) {
    thread_options opts;
    opts.exchange.fusion_bytes = bucket * 2 * sizeof(float);
    opts.exchange.compression = c;
    if (lines != nullptr) opts.run.timeline = (*lines)[static_cast<std::size_t>(r)].get();
    return opts;
  });
}

}  // namespace

TEST_CASE("timeline: a call across processes records its phases, each bucket's pieces and its time on the wire") {
  for (int ranks : {2, 3}) {
    INFO("ranks " << ranks);
    const scratch_dir dir("phases_" + std::to_string(ranks));
    // 10 buckets of 300 elements, 600 sums: every slice 600 / ranks sums, whole.
    const std::size_t n = 3000, bucket = 300, buckets = n / bucket;
    std::vector<std::unique_ptr<gradavg::timeline>> lines;
    for (int r = 0; r < ranks; ++r) lines.push_back(std::make_unique<gradavg::timeline>((dir.path / "t.%r.json").string()));
    const auto traced = run(ranks, n, bucket, gradavg::compression::none, &lines);
    const auto plain = run(ranks, n, bucket, gradavg::compression::none, nullptr);
    for (int r = 0; r < ranks; ++r) {
      const auto& mine = traced[static_cast<std::size_t>(r)];
      REQUIRE_FALSE(mine.failure);
      CHECK(same_outputs(mine.means, plain[static_cast<std::size_t>(r)].means));  // the same bits
      gradavg::timeline& line = *lines[static_cast<std::size_t>(r)];
      CHECK(line.process() == r);
      CHECK(line.dropped() == 0);

      const gradavg::call_profile& p = line.last_call();
      CHECK(p.buckets == buckets);
      // Each bucket: the slices of the other ranks sent to them, this rank's slice from each of
      // them; then this rank's sum to each of them, theirs from each.
      const std::uint64_t slice = 2 * bucket / static_cast<std::size_t>(ranks) * sizeof(float);
      const std::uint64_t moved = buckets * 2 * static_cast<std::uint64_t>(ranks - 1) * slice;
      CHECK(p.sent_bytes == moved);
      CHECK(p.received_bytes == moved);
      CHECK(p.local_bytes == n * sizeof(float) * 3);  // one tower read, the means and squares written
      CHECK(p.seconds > 0);
      CHECK(p.local_seconds > 0);
      CHECK(p.local_seconds + p.wait_seconds <= p.seconds);
      CHECK(p.overlapped_seconds <= p.local_seconds);
      CHECK(p.overlap() >= 0);
      CHECK(p.overlap() <= 1);

      line.write();
      CHECK(line.file() == (dir.path / ("t." + std::to_string(r) + ".json")).string());
      const read_back back = read_file(line.file());
      CHECK(back.complete == line.size());
      CHECK(back.count.at("checks") == 1);
      CHECK(back.count.at("agreement") == 1);
      CHECK(back.count.at("fill") == buckets);
      CHECK(back.count.at("sum") == buckets);
      CHECK(back.count.at("unpack") == buckets);
      CHECK(back.count.at("bucket") == buckets);
      CHECK(back.count.at("wait") == 2 * buckets);  // the contributions', then the sums'
      CHECK(back.count.at("outcome") == 1);
      // The wire's rows: three sets in turn.
      CHECK(back.rows.at(1) + back.rows.at(2) + back.rows.at(3) == buckets);
      CHECK(back.rows.at(1) == (buckets + 2) / 3);
      CHECK(back.text.find("\"pid\":" + std::to_string(r) + ",") != std::string::npos);
      CHECK(back.text.find("\"name\":\"gradavg rank " + std::to_string(r) + "\"") != std::string::npos);
    }
  }
}

TEST_CASE("timeline: a compressed exchange's profile counts the encoded bytes") {
  const int ranks = 2;
  const std::size_t n = 1 << 14, bucket = 1 << 12;
  std::vector<std::unique_ptr<gradavg::timeline>> plain_lines, bf16_lines;
  for (int r = 0; r < ranks; ++r) {
    plain_lines.push_back(std::make_unique<gradavg::timeline>("unused"));
    bf16_lines.push_back(std::make_unique<gradavg::timeline>("unused"));
  }
  const auto plain = run(ranks, n, bucket, gradavg::compression::none, &plain_lines);
  const auto bf16 = run(ranks, n, bucket, gradavg::compression::bfloat16, &bf16_lines);
  for (int r = 0; r < ranks; ++r) {
    REQUIRE_FALSE(plain[static_cast<std::size_t>(r)].failure);
    REQUIRE_FALSE(bf16[static_cast<std::size_t>(r)].failure);
    const auto& a = plain_lines[static_cast<std::size_t>(r)]->last_call();
    const auto& b = bf16_lines[static_cast<std::size_t>(r)]->last_call();
    CHECK(a.sent_bytes == 2 * n * sizeof(float));  // half the sums out, half the results out
    // bf16: two bytes a value, and a block's few bytes of header at most.
    CHECK(b.sent_bytes >= a.sent_bytes / 2);
    CHECK(b.sent_bytes < a.sent_bytes * 0.52);
    CHECK(b.received_bytes == b.sent_bytes);
    plain_lines[static_cast<std::size_t>(r)]->clear();  // nothing to write
    bf16_lines[static_cast<std::size_t>(r)]->clear();
  }
}

TEST_CASE("timeline: a call in one process records its checks and its pass") {
  const scratch_dir dir("one_process");
  gradavg::timeline line((dir.path / "one.json").string());
  std::vector<std::vector<std::pair<Eigen::VectorXf, std::string>>> towers(3, {{Eigen::VectorXf::Constant(100, 2.0f), "w"}});
  towers[1][0].first.setConstant(4.0f);
  std::vector<Eigen::VectorXf> means{Eigen::VectorXf::Zero(100)};
  gradavg::options opts;
  opts.run.timeline = &line;
  gradavg::average_gradients_into(towers, means, opts);
  CHECK(means[0].isConstant(8.0f / 3.0f));  // (2 + 4 + 2) / 3
  gradavg::plan p;
  for (int step = 0; step < 3; ++step) gradavg::average_gradients_into(p, towers, means, opts);
  line.write();
  const read_back back = read_file(line.file());
  CHECK(back.count.at("checks") == 2);  // the plan's first call checks, the next ones reuse its proof
  CHECK(back.count.at("pass") == 4);
  CHECK(back.rows.at(0) == 6);
}

TEST_CASE("timeline: events past the capacity are dropped and counted, and the file names its process") {
  const scratch_dir dir("capacity");
  gradavg::timeline line((dir.path / "cap.%r.%r.json").string(), 4);
  for (int i = 0; i < 10; ++i) line.record(gradavg::lane::other, "mine \"quoted\"", 100, 200 + static_cast<std::uint64_t>(i));
  CHECK(line.size() == 4);
  CHECK(line.dropped() == 6);
  line.process(7);
  CHECK(line.file() == (dir.path / "cap.7.7.json").string());
  line.write();
  const read_back back = read_file(line.file());
  CHECK(back.complete == 4);
  CHECK(back.rows.at(200) == 4);  // lane::other's first thread
  CHECK(back.text.find("\"dropped\":6") != std::string::npos);
  CHECK(back.text.find("mine \\\"quoted\\\"") != std::string::npos);
  line.clear();
  CHECK(line.size() == 0);
  CHECK(line.dropped() == 0);
}

TEST_CASE("timeline: each thread that records has a row of its own") {
  const scratch_dir dir("threads");
  gradavg::timeline line((dir.path / "threads.json").string());
  line.record(gradavg::lane::call, "here", 10, 20);
  // Both alive at once (a thread's id may be reused once it has ended), the second recording
  // after the first.
  std::latch first_recorded(1), both_recorded(2);
  std::thread there([&] {
    line.record(gradavg::lane::call, "there", 12, 30);
    line.record(gradavg::lane::other, "there", 12, 30);
    first_recorded.count_down();
    both_recorded.arrive_and_wait();
  });
  std::thread elsewhere([&] {
    first_recorded.wait();
    line.record(gradavg::lane::call, "elsewhere", 14, 40);
    both_recorded.arrive_and_wait();
  });
  there.join();
  elsewhere.join();
  line.record(gradavg::lane::call, "here", 30, 40);
  line.write();
  const read_back back = read_file(line.file());
  CHECK(back.rows.at(0) == 2);    // the first thread's call row
  CHECK(back.rows.at(101) == 1);  // the second's
  CHECK(back.rows.at(102) == 1);  // the third's
  CHECK(back.rows.at(200) == 1);  // the second thread's first other event
  CHECK(back.text.find("\"tid\":101,\"args\":{\"name\":\"call, thread 1\"}") != std::string::npos);
  CHECK(back.text.find("\"tid\":0,\"args\":{\"name\":\"call\"}") != std::string::npos);
}

TEST_CASE("timeline: an unwritable file is a timeline_error naming it") {
  gradavg::timeline line("/nonexistent-dir/trace.json");
  line.record(gradavg::lane::call, "x", 1, 2);
  const std::string message = message_of<gradavg::timeline_error>([&] { line.write(); });
  CHECK(message.find("/nonexistent-dir/trace.json") != std::string::npos);
  line.clear();
}

TEST_CASE("timeline: from_environment reads GRADAVG_TIMELINE when called") {
  ::unsetenv("GRADAVG_TIMELINE");
  CHECK(gradavg::timeline::from_environment() == nullptr);
  ::setenv("GRADAVG_TIMELINE", "", 1);
  CHECK(gradavg::timeline::from_environment() == nullptr);
  ::setenv("GRADAVG_TIMELINE", "/tmp/x.%r.json", 1);
  const auto line = gradavg::timeline::from_environment(16);
  REQUIRE(line != nullptr);
  CHECK(line->capacity() == 16);
  CHECK(line->file() == "/tmp/x.0.json");
  ::unsetenv("GRADAVG_TIMELINE");
}

namespace {

/// A sink that keeps the lines.
struct kept_lines {
  std::vector<std::pair<gradavg::log_level, std::string>> lines;
  static void sink(void* context, gradavg::log_level level, std::string_view line) {
    static_cast<kept_lines*>(context)->lines.emplace_back(level, std::string(line));
  }
  std::size_t count(gradavg::log_level level) const {
    std::size_t n = 0;
    for (const auto& [l, _] : lines) n += l == level ? 1 : 0;
    return n;
  }
};

}  // namespace

TEST_CASE("logger: a line when a plan is proved at info, one per call at debug, in one process") {
  std::vector<std::vector<std::pair<Eigen::VectorXf, std::string>>> towers(
      2, {{Eigen::VectorXf::Constant(100, 1.0f), "a"}, {Eigen::VectorXf::Constant(28, 3.0f), "b"}});
  std::vector<Eigen::VectorXf> means{Eigen::VectorXf::Zero(100), Eigen::VectorXf::Zero(28)};
  for (auto level : {gradavg::log_level::info, gradavg::log_level::debug}) {
    kept_lines kept;
    gradavg::logger log(level, &kept_lines::sink, &kept);
    gradavg::options opts;
    opts.run.log = &log;
    gradavg::plan p;
    for (int step = 0; step < 3; ++step) gradavg::average_gradients_into(p, towers, means, opts);
    gradavg::average_gradients_into(towers, means, opts);  // no plan
    CHECK(means[1].isConstant(3.0f));
    REQUIRE(kept.count(gradavg::log_level::info) == 1);
    const std::string& proved = kept.lines[0].second;
    CHECK(contains(proved, "gradavg: plan proved: 2 variables (2 averaged, 0 skipped), 128 elements, 2 towers, "
                           "float32 into float32, means, kernel "));
    CHECK(contains(proved, std::string(gradavg::to_string(gradavg::simd_level_in_use()))));
    CHECK(contains(proved, "1 thread, ordinary stores"));
    // debug: the two calls over the plan that holds, and the call without one.
    CHECK(kept.count(gradavg::log_level::debug) == (level == gradavg::log_level::debug ? 3 : 0));
    if (level == gradavg::log_level::debug) {
      CHECK(contains(kept.lines[1].second, "gradavg: call (plan holds): 2 variables"));
      CHECK(contains(kept.lines[3].second, "gradavg: call: 2 variables"));
    }
  }
}

TEST_CASE("logger: across processes, each rank's line names its rank, buckets and wire format") {
  const int ranks = 2;
  std::vector<kept_lines> kept(ranks);
  std::vector<std::unique_ptr<gradavg::logger>> logs;
  for (int r = 0; r < ranks; ++r)
    logs.push_back(std::make_unique<gradavg::logger>(gradavg::log_level::info, &kept_lines::sink, &kept[static_cast<std::size_t>(r)]));
  std::vector<towers_of<float>> towers(ranks, towers_of<float>{{{vector_of<float>::Constant(3000, 1.0f), "w"}}});
  std::vector<gradavg::plan> plans(ranks);
  // The same outputs at every step: the plan holds from the second on (it compares addresses).
  std::vector<std::vector<vector_of<float>>> means(ranks, {vector_of<float>::Zero(3000)});
  for (int step = 0; step < 2; ++step) {
    const auto results = run_ranks<float>(ranks, std::vector<rank_result<float>>(ranks), [&](int r, auto& wire, auto& work, auto&) {
      thread_options opts;
      opts.exchange.fusion_bytes = 300 * sizeof(float);
      opts.exchange.compression = gradavg::compression::bfloat16;
      opts.run.log = logs[static_cast<std::size_t>(r)].get();
      return processes::average_into(wire, work, towers[static_cast<std::size_t>(r)], means[static_cast<std::size_t>(r)],
                                     gradavg::detail::no_squares, opts, nullptr, &plans[static_cast<std::size_t>(r)]);
    });
    for (const auto& r : results) REQUIRE_FALSE(r.failure);
  }
  for (int r = 0; r < ranks; ++r) {
    const auto& lines = kept[static_cast<std::size_t>(r)].lines;
    REQUIRE(lines.size() == 1);  // info: the plan's first call only
    const std::string& line = lines[0].second;
    INFO(line);
    CHECK(contains(line, ": rank " + std::to_string(r) + " of 2: plan proved: 1 variables (1 averaged, 0 skipped), "
                         "3000 elements, 1 tower, float32 into float32, means, kernel "));
    CHECK(contains(line, ", 2 towers in all; "));
    CHECK(contains(line, "wire format bfloat16, output replicated"));
  }
}

TEST_CASE("logger: from_environment reads GRADAVG_LOG when called, and refuses an unknown level") {
  ::unsetenv("GRADAVG_LOG");
  CHECK(gradavg::logger::from_environment() == nullptr);
  ::setenv("GRADAVG_LOG", "off", 1);
  CHECK(gradavg::logger::from_environment() == nullptr);
  ::setenv("GRADAVG_LOG", "debug", 1);
  const auto log = gradavg::logger::from_environment();
  REQUIRE(log != nullptr);
  CHECK(log->level() == gradavg::log_level::debug);
  CHECK(log->enabled(gradavg::log_level::info));
  CHECK_FALSE(log->enabled(gradavg::log_level::off));
  ::setenv("GRADAVG_LOG", "verbose", 1);
  const std::string message = message_of<gradavg::option_error>([] { (void)gradavg::logger::from_environment(); });
  CHECK(contains(message, "\"verbose\""));
  ::unsetenv("GRADAVG_LOG");
}
