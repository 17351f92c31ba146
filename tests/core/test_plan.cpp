// gradavg::plan: a call with a plan gives the results of the same call without one, against the
// independent reference; the plan is reused only over the buffers it proved, and every check a
// changed buffer needs still runs, with nothing written when it fails.
#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"
#include "workload.hpp"

namespace {

using gradavg_test::bitwise_equal;
using gradavg_test::contains;
using gradavg_test::grads;
using gradavg_test::message_of;
using span_entry = std::pair<std::span<const float>, int>;
using span_towers = std::vector<std::vector<span_entry>>;

/// Checks means / squares of workload w (every variable present) against the reference.
void check_against_reference(const gradavg_test::workload& w, const std::vector<grads>& means,
                             const std::vector<grads>& squares) {
  const std::size_t towers = w.data.size();
  for (std::size_t i = 0; i < w.data[0].size(); ++i) {
    INFO("variable " << i);
    std::vector<const float*> ptrs;
    for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(w.data[k][i].data());
    const std::size_t n = w.data[0][i].size();
    const gradavg_test::reference<float> want(ptrs, n);
    CHECK(gradavg_test::first_mismatch(means[i].data(), want.mean, gradavg_test::magnitude(ptrs, n, false), towers) ==
          n);
    CHECK(gradavg_test::first_mismatch(squares[i].data(), want.square, gradavg_test::magnitude(ptrs, n, true),
                                       towers) == n);
  }
}

/// Two towers of two 8-float variables as spans, and their means outputs.
struct two_variables {
  std::vector<float> a0 = std::vector<float>(8, 1.0f), a1 = std::vector<float>(8, 3.0f);
  std::vector<float> b0 = std::vector<float>(8, 5.0f), b1 = std::vector<float>(8, 7.0f);
  std::vector<float> ma = std::vector<float>(8, -1.0f), mb = std::vector<float>(8, -1.0f);
  span_towers tg{{{std::span<const float>(a0), 0}, {std::span<const float>(b0), 1}},
                 {{std::span<const float>(a1), 0}, {std::span<const float>(b1), 1}}};
  std::vector<std::span<float>> means{std::span<float>(ma), std::span<float>(mb)};
};

}  // namespace

TEST_CASE("a plan gives the bits of the same call without one, step after step") {
  gradavg_test::workload w(3, {1, 100, 7, 4096, 0, 33, 20000});
  std::vector<gradavg::variable_statistics> per_variable(w.data[0].size()), per_variable_plain(w.data[0].size());
  auto kept_means = w.outputs(), kept_squares = w.outputs();
  gradavg::plan step;
  const double weights[2][3] = {{1, 2, 0.5}, {3, 0, 1}};
  for (int s = 0; s < 6; ++s) {
    INFO("step " << s);
    // New gradient values in the same buffers, as a training loop's backward pass writes them.
    for (std::size_t k = 0; k < w.data.size(); ++k)
      for (std::size_t i = 0; i < w.data[k].size(); ++i) {
        const auto seed = static_cast<std::uint32_t>(97 * s + 13 * k + i);
        const grads fresh = gradavg_test::random_values<float>(w.data[k][i].size(), seed);
        std::copy(fresh.begin(), fresh.end(), w.data[k][i].begin());
      }
    gradavg::options opts;
    if (s >= 2) {  // the fused step, with options that change from step to step
      opts.compute.weights = weights[s % 2];
      opts.compute.scale = s % 2 == 0 ? 0.5 : 2.0;
      opts.compute.statistics = true;
      opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
      opts.run.threads = static_cast<std::size_t>(s % 3 + 1);
    }
    if (s == 5) opts.compute.range = {50, 9000};
    std::vector<grads> means = w.outputs(), squares = w.outputs();
    for (auto* outputs : {&kept_means, &kept_squares})
      for (auto& o : *outputs) std::fill(o.begin(), o.end(), -1.0f);  // the same buffers, every step
    gradavg::options planned = opts, plain = opts;
    planned.compute.per_variable = per_variable;
    plain.compute.per_variable = per_variable_plain;
    const gradavg::summary with_plan = gradavg::average_gradients_into(step, w.tg, kept_means, kept_squares, planned);
    const gradavg::summary without = gradavg::average_gradients_into(w.tg, means, squares, plain);
    CHECK(bitwise_equal(kept_means, means));
    CHECK(bitwise_equal(kept_squares, squares));
    CHECK(with_plan.averaged == without.averaged);
    CHECK(with_plan.skipped == without.skipped);
    if (opts.compute.statistics) {
      CHECK(std::memcmp(&with_plan.sum_mean_squared, &without.sum_mean_squared, sizeof(double)) == 0);
      CHECK(std::memcmp(&with_plan.sum_mean_of_squares, &without.sum_mean_of_squares, sizeof(double)) == 0);
      for (std::size_t i = 0; i < per_variable.size(); ++i)
        CHECK(std::memcmp(&per_variable[i].sum_mean_squared, &per_variable_plain[i].sum_mean_squared,
                          sizeof(double)) == 0);
    }
    if (s < 2) check_against_reference(w, kept_means, kept_squares);
  }
  CHECK(step.proofs() == 1);  // options change from step to step; the buffers do not
}

TEST_CASE("a plan over unchanged buffers proves once and checks each step") {
  gradavg_test::workload w(4, {1, 100, 7, 4096, 0, 33});
  auto means = w.outputs(), squares = w.outputs();
  gradavg::plan step;
  CHECK_FALSE(step.ready());
  for (int s = 0; s < 5; ++s) {
    for (std::size_t k = 0; k < w.data.size(); ++k)
      for (auto& g : w.data[k])
        for (float& x : g) x = x * 0.5f + static_cast<float>(s);
    const gradavg::summary r = gradavg::average_gradients_into(step, w.tg, means, squares);
    CHECK(r.averaged == 6);  // the empty variable's gradients are present
    CHECK(r.skipped == 0);
    check_against_reference(w, means, squares);
  }
  CHECK(step.ready());
  CHECK(step.proofs() == 1);

  SECTION("a reallocated gradient is proved again and read from its new place") {
    w.data[2][3] = gradavg_test::random_values<float>(4096, 4242u);
    w.tg[2][3].first = &w.data[2][3];
    gradavg::average_gradients_into(step, w.tg, means, squares);
    CHECK(step.proofs() == 2);
    check_against_reference(w, means, squares);
    gradavg::average_gradients_into(step, w.tg, means, squares);
    CHECK(step.proofs() == 2);
  }
  SECTION("means without squares, or another tower count, is another proof") {
    gradavg::average_gradients_into(step, w.tg, means);
    CHECK(step.proofs() == 2);
    gradavg::average_gradients_into(step, w.tg, means, squares);
    CHECK(step.proofs() == 3);
    auto three = w.tg;
    three.pop_back();
    gradavg::average_gradients_into(step, three, means, squares);
    CHECK(step.proofs() == 4);
  }
  SECTION("a stronger overlap check than the one proved is run") {
    gradavg::plan weak;
    gradavg::average_gradients_into(weak, w.tg, means, squares, {.check = {.aliasing = gradavg::alias_check::none}});
    gradavg::average_gradients_into(weak, w.tg, means, squares, {.check = {.aliasing = gradavg::alias_check::none}});
    CHECK(weak.proofs() == 1);
    gradavg::average_gradients_into(weak, w.tg, means, squares);
    CHECK(weak.proofs() == 2);
    // A full proof covers the partial checks.
    gradavg::average_gradients_into(weak, w.tg, means, squares, {.check = {.aliasing = gradavg::alias_check::same_variable}});
    CHECK(weak.proofs() == 2);
  }
  SECTION("clear() forgets the proof") {
    step.clear();
    CHECK_FALSE(step.ready());
    gradavg::average_gradients_into(step, w.tg, means, squares);
    CHECK(step.proofs() == 2);
  }
}

TEST_CASE("a changed buffer meets every check with a plan, nothing is written, and the plan is emptied") {
  two_variables v;
  gradavg::plan step;
  for (int s = 0; s < 2; ++s) gradavg::average_gradients_into(step, v.tg, v.means);
  CHECK(v.ma == std::vector<float>(8, 2.0f));
  CHECK(v.mb == std::vector<float>(8, 6.0f));
  v.ma.assign(8, -1.0f);
  v.mb.assign(8, -1.0f);
  auto untouched = [&] {
    CHECK(v.ma == std::vector<float>(8, -1.0f));
    CHECK(v.mb == std::vector<float>(8, -1.0f));
    CHECK(v.a1 == std::vector<float>(8, 3.0f));
    CHECK_FALSE(step.ready());
  };

  SECTION("an output moved onto another variable's gradient") {
    v.means[1] = std::span<float>(v.a1);
    const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(step, v.tg, v.means); });
    CHECK(contains(msg, "variable #1 '1': the means output overlaps the gradient on tower 1 of variable #0 '0'"));
    v.means[1] = std::span<float>(v.mb);
    untouched();
  }
  SECTION("a gradient absent on one tower") {
    v.tg[1][0].first = std::span<const float>();
    // An empty span is present with 0 elements: a shape mismatch, not a missing gradient.
    const auto msg = message_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(step, v.tg, v.means); });
    CHECK(contains(msg, "variable #0 '0'"));
    CHECK(contains(msg, "tower 1"));
    untouched();
    v.tg[1][0].first = std::span<const float>(v.a1);
  }
  SECTION("a gradient grown by one element") {
    std::vector<float> longer(9, 3.0f);
    v.tg[1][1].first = std::span<const float>(longer);
    const auto msg = message_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(step, v.tg, v.means); });
    CHECK(contains(msg, "variable #1 '1'"));
    untouched();
    v.tg[1][1].first = std::span<const float>(v.b1);
  }
  SECTION("a variable that differs on one tower") {
    v.tg[1][1].second = 7;
    // Same buffers: the plan does not compare variables again (plan.hpp); a new proof does.
    gradavg::average_gradients_into(step, v.tg, v.means);
    CHECK(step.proofs() == 1);
    v.ma.assign(8, -1.0f);
    v.mb.assign(8, -1.0f);
    step.clear();
    const auto msg =
        message_of<gradavg::variable_mismatch_error>([&] { gradavg::average_gradients_into(step, v.tg, v.means); });
    CHECK(contains(msg, "variable #1"));
    untouched();
    v.tg[1][1].second = 1;
  }
  SECTION("options that fail their checks") {
    const double weights[] = {1, -1};
    CHECK_THROWS_AS(gradavg::average_gradients_into(step, v.tg, v.means, {.compute = {.weights = weights}}), gradavg::weight_error);
    untouched();
  }
  // After any failure, a valid call proves again and averages.
  gradavg::average_gradients_into(step, v.tg, v.means);
  CHECK(step.ready());
  CHECK(v.ma == std::vector<float>(8, 2.0f));
}

namespace {

/// Steps of a plan over T towers of three variables held in Tower (a range of span entries):
/// the proof is reused over unchanged buffers, a gradient moved on the last tower or an output
/// moved onto a gradient is noticed, and every step's means and squares match the reference.
template <class Tower>
void plan_over_towers(std::size_t towers) {
  const std::vector<std::size_t> sizes{5, 64, 1};
  std::vector<std::vector<std::vector<float>>> data(towers);
  std::vector<Tower> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      data[k].push_back(gradavg_test::random_values<float>(sizes[i], static_cast<std::uint32_t>(100 * k + i + 1)));
      tg[k].push_back({std::span<const float>(data[k][i]), static_cast<int>(i)});
    }
  std::vector<std::vector<float>> m, q;
  for (std::size_t n : sizes) {
    m.emplace_back(n, -1.0f);
    q.emplace_back(n, -1.0f);
  }
  std::vector<std::span<float>> means(m.begin(), m.end()), squares(q.begin(), q.end());
  const auto check = [&] {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      INFO("variable " << i);
      std::vector<const float*> ptrs;
      for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(tg[k][i].first.data());
      const gradavg_test::reference<float> want(ptrs, sizes[i]);
      CHECK(gradavg_test::first_mismatch(m[i].data(), want.mean, gradavg_test::magnitude(ptrs, sizes[i], false),
                                         towers) == sizes[i]);
      CHECK(gradavg_test::first_mismatch(q[i].data(), want.square, gradavg_test::magnitude(ptrs, sizes[i], true),
                                         towers) == sizes[i]);
    }
  };
  gradavg::plan step;
  for (int s = 0; s < 3; ++s) {
    gradavg::average_gradients_into(step, tg, means, squares);
    check();
  }
  CHECK(step.proofs() == 1);

  std::vector<float> moved = gradavg_test::random_values<float>(64, 999u);
  tg[towers - 1][1].first = std::span<const float>(moved);
  gradavg::average_gradients_into(step, tg, means, squares);
  CHECK(step.proofs() == 2);
  check();

  squares[2] = std::span<float>(data[0][2]);
  m[0].assign(5, -1.0f);
  CHECK_THROWS_AS(gradavg::average_gradients_into(step, tg, means, squares), gradavg::aliasing_error);
  CHECK(m[0] == std::vector<float>(5, -1.0f));
  CHECK_FALSE(step.ready());
}

}  // namespace

TEST_CASE("a plan checks each buffer whatever range holds the towers") {
  using span_entry = std::pair<std::span<const float>, int>;
  SECTION("contiguous towers: 2, 4 and 8 (compared with a constant count), 3 and 16") {
    for (const std::size_t towers : {2, 4, 8, 3, 16}) {
      INFO(towers << " towers");
      plan_over_towers<std::vector<span_entry>>(towers);
    }
  }
  SECTION("contiguous towers, more than 16") { plan_over_towers<std::vector<span_entry>>(17); }
  SECTION("towers that are not contiguous") { plan_over_towers<std::deque<span_entry>>(3); }
}

TEST_CASE("a plan compares presence, not only bytes: an absent gradient and an empty one differ") {
  std::vector<float> a{1, 2}, b{3, 4}, m(2, -1.0f), empty_out;
  std::vector<float> e0, e1;  // zero elements, present
  using entry = std::pair<const std::vector<float>*, int>;
  std::vector<std::vector<entry>> tg{{{&a, 0}, {&e0, 1}}, {{&b, 0}, {&e1, 1}}};
  std::vector<std::vector<float>*> means{&m, &empty_out};
  gradavg::plan step;
  CHECK(gradavg::average_gradients_into(step, tg, means).averaged == 2);
  tg[0][1].first = nullptr;
  tg[1][1].first = nullptr;
  const gradavg::summary r = gradavg::average_gradients_into(step, tg, means);
  CHECK(r.averaged == 1);
  CHECK(r.skipped == 1);
  CHECK(step.proofs() == 2);
  // Absent on one tower only: the error of the seed.
  tg[1][1].first = &e1;
  m.assign(2, -1.0f);
  CHECK_THROWS_AS(gradavg::average_gradients_into(step, tg, means), gradavg::missing_gradient_error);
  CHECK(m == std::vector<float>(2, -1.0f));
}

TEST_CASE("one plan over calls of different types is never taken for the other") {
  std::vector<float> a{1, 2}, b{3, 4}, m(2);
  std::vector<double> ad{1, 2}, bd{3, 4}, md(2);
  const std::vector<std::vector<std::pair<const std::vector<float>*, int>>> tf{{{&a, 0}}, {{&b, 0}}};
  const std::vector<std::vector<std::pair<const std::vector<double>*, int>>> td{{{&ad, 0}}, {{&bd, 0}}};
  std::vector<std::vector<float>*> mf{&m};
  std::vector<std::vector<double>*> mdv{&md};
  gradavg::plan step;
  for (int s = 0; s < 2; ++s) {
    gradavg::average_gradients_into(step, tf, mf);
    gradavg::average_gradients_into(step, td, mdv);
  }
  CHECK(step.proofs() == 4);
  CHECK(m == std::vector<float>{2, 3});
  CHECK(md == std::vector<double>{2, 3});
}

TEST_CASE("Eigen gradients and in-place averaging with a plan") {
  Eigen::MatrixXf g0 = Eigen::MatrixXf::Random(5, 3), g1 = Eigen::MatrixXf::Random(5, 3);
  Eigen::VectorXf h0 = Eigen::VectorXf::Random(17), h1 = Eigen::VectorXf::Random(17);
  const Eigen::MatrixXf want_g = (g0 + g1) / 2;
  const Eigen::VectorXf want_h = (h0 + h1) / 2;
  Eigen::VectorXf out_h(17);
  using entry = std::pair<Eigen::Ref<Eigen::MatrixXf>, int>;
  std::vector<std::vector<entry>> tg(2);
  tg[0] = {{g0, 0}, {h0, 1}};
  tg[1] = {{g1, 0}, {h1, 1}};
  std::vector<Eigen::Ref<Eigen::MatrixXf>> means{g0, out_h};  // variable 0 in place
  gradavg::plan step;
  gradavg::average_gradients_into(step, tg, means);
  CHECK(g0.isApprox(want_g, 1e-6f));
  CHECK(out_h.isApprox(want_h, 1e-6f));
  // A second step over the same buffers: g0 now holds the mean, which is averaged with g1 again.
  gradavg::average_gradients_into(step, tg, means);
  CHECK(g0.isApprox((want_g + g1) / 2, 1e-6f));
  CHECK(step.proofs() == 1);
}
