// Standard types: containers as tensors, the kinds of entry and gradient slot, the kinds of
// tower and output ranges, and variable types.
#include <gradavg/gradavg.hpp>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "catch.hpp"

namespace {
using grads = std::vector<float>;
}

TEST_CASE("gradient slots: values, pointers, smart pointers, optionals, reference_wrappers") {
  const grads g0{1, 2}, g1{3, 6};
  const grads want{2, 4};

  SECTION("tensor values") {
    const std::vector<std::vector<std::pair<grads, int>>> tg{{{g0, 0}}, {{g1, 0}}};
    CHECK(gradavg::average_gradients(tg).gradients[0].first == want);
  }
  SECTION("shared_ptr, null for a skipped variable") {
    using slot = std::shared_ptr<const grads>;
    const std::vector<std::vector<std::pair<slot, int>>> tg{
        {{std::make_shared<const grads>(g0), 0}, {nullptr, 1}},
        {{std::make_shared<const grads>(g1), 0}, {nullptr, 1}}};
    const auto r = gradavg::average_gradients(tg);
    CHECK(r.gradients[0].first == want);
    REQUIRE(r.skipped.size() == 1);
    CHECK(r.skipped[0].variable == 1);
  }
  SECTION("unique_ptr") {
    std::vector<std::vector<std::pair<std::unique_ptr<grads>, int>>> tg(2);
    tg[0].emplace_back(std::make_unique<grads>(g0), 0);
    tg[1].emplace_back(std::make_unique<grads>(g1), 0);
    CHECK(gradavg::average_gradients(tg).gradients[0].first == want);
  }
  SECTION("std::optional, nullopt for a skipped variable") {
    using slot = std::optional<grads>;
    const std::vector<std::vector<std::pair<slot, std::string>>> tg{{{g0, "a"}, {std::nullopt, "b"}},
                                                                    {{g1, "a"}, {std::nullopt, "b"}}};
    const auto r = gradavg::average_gradients(tg);
    CHECK(r.gradients[0].first == want);
    CHECK(r.skipped[0].variable == "b");
  }
  SECTION("reference_wrapper and optional<reference_wrapper>") {
    using ref = std::reference_wrapper<const grads>;
    const std::vector<std::vector<std::pair<ref, int>>> tg{{{std::cref(g0), 0}}, {{std::cref(g1), 0}}};
    CHECK(gradavg::average_gradients(tg).gradients[0].first == want);
    const std::vector<std::vector<std::pair<std::optional<ref>, int>>> tg2{{{std::cref(g0), 0}}, {{std::nullopt, 0}}};
    CHECK_THROWS_AS(gradavg::average_gradients(tg2), gradavg::missing_gradient_error);
  }
}

TEST_CASE("entries: std::pair, std::tuple, gradavg::grad_and_var") {
  const grads g0{1}, g1{5};
  SECTION("tuple") {
    const std::vector<std::vector<std::tuple<const grads*, std::string>>> tg{{{&g0, "w"}}, {{&g1, "w"}}};
    const auto r = gradavg::average_gradients(tg);
    CHECK(r.gradients[0].first == grads{3});
    CHECK(r.gradients[0].second == "w");
  }
  SECTION("grad_and_var") {
    using e = gradavg::grad_and_var<const grads*, const char*>;
    const std::vector<std::vector<e>> tg{{e{&g0, "w"}}, {e{&g1, "w"}}};
    const auto r = gradavg::average_gradients(tg);
    CHECK(r.gradients[0].first == grads{3});
  }
}

TEST_CASE("tensors: std::span and std::array") {
  SECTION("span results are std::vector") {
    const std::array<double, 3> a0{1, 2, 3}, a1{3, 2, 1};
    const std::vector<std::vector<std::pair<std::span<const double>, int>>> tg{{{a0, 0}}, {{a1, 0}}};
    const auto r = gradavg::average_gradients(tg);
    STATIC_REQUIRE(std::is_same_v<decltype(r.gradients[0].first), std::vector<double>>);
    CHECK(r.gradients[0].first == std::vector<double>{2, 2, 2});
  }
  SECTION("array results are std::array") {
    using a3 = std::array<float, 3>;
    const std::vector<std::vector<std::pair<a3, int>>> tg{{{a3{1, 2, 3}, 0}}, {{a3{5, 6, 7}, 0}}};
    const auto r = gradavg::average_gradients(tg, gradavg::include_square);
    CHECK(r.gradients[0].first == a3{3, 4, 5});
    CHECK(r.squares[0].first == a3{13, 20, 29});
  }
}

TEST_CASE("tower ranges: std::array of vectors, vector of spans") {
  const grads g0{2}, g1{4};
  using entry = std::pair<const grads*, int>;
  const std::array<std::vector<entry>, 2> tg{std::vector<entry>{{&g0, 0}}, std::vector<entry>{{&g1, 0}}};
  CHECK(gradavg::average_gradients(tg).gradients[0].first == grads{3});

  const std::vector<entry> t0{{&g0, 0}}, t1{{&g1, 0}};
  const std::vector<std::span<const entry>> spans{t0, t1};
  CHECK(gradavg::average_gradients(spans).gradients[0].first == grads{3});
}

TEST_CASE("_into outputs: tensors, spans, pointers, skipped outputs untouched, summary") {
  const grads a0{1, 1}, a1{3, 3}, c0{0}, c1{2};
  using entry = std::pair<const grads*, std::string>;
  const std::vector<std::vector<entry>> tg{{{&a0, "a"}, {nullptr, "b"}, {&c0, "c"}},
                                           {{&a1, "a"}, {nullptr, "b"}, {&c1, "c"}}};
  SECTION("vector of tensors") {
    std::vector<grads> means{grads(2), grads{-7, -7, -7}, grads(1)};
    const auto s = gradavg::average_gradients_into(tg, means);
    CHECK(s.averaged == 2);
    CHECK(s.skipped == 1);
    CHECK(means[0] == grads{2, 2});
    CHECK(means[1] == grads{-7, -7, -7});  // skipped: untouched, any shape
    CHECK(means[2] == grads{1});
  }
  SECTION("pointers, null where skipped") {
    grads ma(2), mc(1), sa(2), sc(1);
    std::vector<grads*> means{&ma, nullptr, &mc}, squares{&sa, nullptr, &sc};
    gradavg::average_gradients_into(tg, means, squares);
    CHECK(ma == grads{2, 2});
    CHECK(sa == grads{5, 5});
    CHECK(sc == grads{2});
  }
  SECTION("spans into one flat buffer") {
    grads flat(3, -1);
    std::vector<std::span<float>> means{std::span<float>(flat.data(), 2), {}, std::span<float>(flat.data() + 2, 1)};
    gradavg::average_gradients_into(tg, means, {.check = {.aliasing = gradavg::alias_check::all}});
    CHECK(flat == grads{2, 2, 1});
  }
}

TEST_CASE("variables: C strings compare by content, pointers by identity") {
  const grads g0{1}, g1{3};
  std::string n0 = "layer/w", n1 = "layer/w";  // distinct buffers, same text
  const std::vector<std::vector<std::pair<const grads*, const char*>>> tg{{{&g0, n0.c_str()}}, {{&g1, n1.c_str()}}};
  CHECK(gradavg::average_gradients(tg).gradients[0].first == grads{2});

  int v0 = 0, v1 = 0;
  const std::vector<std::vector<std::pair<const grads*, int*>>> tp{{{&g0, &v0}}, {{&g1, &v1}}};
  CHECK_THROWS_AS(gradavg::average_gradients(tp), gradavg::variable_mismatch_error);
}

TEST_CASE("variables without operator== are not compared") {
  struct handle {
    int id;
  };
  const grads g0{1}, g1{3};
  const std::vector<std::vector<std::pair<const grads*, handle>>> tg{{{&g0, {1}}}, {{&g1, {2}}}};
  const auto r = gradavg::average_gradients(tg);
  CHECK(r.gradients[0].second.id == 1);  // tower 0's
}
