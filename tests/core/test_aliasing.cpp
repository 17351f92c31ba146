// Overlap checks of average_gradients_into: the default full check against a brute-force model
// over random layouts, a reused plan (and a stale one), variables formatted only for
// messages, and no allocation on the hot path.
#include <gradavg/gradavg.hpp>

#include <cstddef>
#include <cstdlib>
#include <new>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

// Counts the allocations of this program (for "allocates nothing"), except under AddressSanitizer,
// which replaces the allocation functions itself (that test case is then left out). GCC takes the
// replaced operators' malloc/free for a mismatch with the operator new it sees in the standard
// library.
#if defined(__SANITIZE_ADDRESS__)
#define GRADAVG_TEST_COUNT_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GRADAVG_TEST_COUNT_ALLOCATIONS 0
#endif
#endif
#ifndef GRADAVG_TEST_COUNT_ALLOCATIONS
#define GRADAVG_TEST_COUNT_ALLOCATIONS 1
#endif

#if GRADAVG_TEST_COUNT_ALLOCATIONS
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
namespace {
std::size_t allocations = 0;
}  // namespace

void* operator new(std::size_t n) {
  ++allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace {

using gradavg_test::contains;
using gradavg_test::message_of;
using span_entry = std::pair<std::span<const float>, int>;
using span_towers = std::vector<std::vector<span_entry>>;

/// A layout of gradients and outputs at element offsets into one arena.
struct layout {
  std::size_t towers = 0;
  bool with_squares = false;
  std::vector<std::size_t> sizes;                   // [variable]
  std::vector<std::vector<std::size_t>> gradients;  // [tower][variable] offsets
  std::vector<std::size_t> means, squares;          // [variable] offsets
};

/// Whether the layout breaks the aliasing rule, pair by pair: an output overlapping any other
/// buffer, except means[i] at exactly tower 0's gradient i.
bool forbidden(const layout& l) {
  struct buf {
    std::size_t first, size, variable;
    int kind;  // -1 means, -2 squares, k >= 0 gradient of tower k
  };
  std::vector<buf> all;
  for (std::size_t i = 0; i < l.sizes.size(); ++i) {
    for (std::size_t k = 0; k < l.towers; ++k) all.push_back({l.gradients[k][i], l.sizes[i], i, static_cast<int>(k)});
    all.push_back({l.means[i], l.sizes[i], i, -1});
    if (l.with_squares) all.push_back({l.squares[i], l.sizes[i], i, -2});
  }
  for (std::size_t a = 0; a < all.size(); ++a)
    for (std::size_t b = 0; b < all.size(); ++b) {
      const buf &x = all[a], &y = all[b];
      if (a == b || x.kind >= 0 || x.size == 0 || y.size == 0) continue;  // x is an output
      const bool overlap = x.first < y.first + y.size && y.first < x.first + x.size;
      const bool in_place = x.kind == -1 && y.kind == 0 && x.variable == y.variable && x.first == y.first;
      if (overlap && !in_place) return true;
    }
  return false;
}

layout random_layout(std::mt19937& gen, std::size_t arena) {
  auto pick = [&gen](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(gen); };
  layout l;
  l.towers = 1 + pick(3);
  l.with_squares = pick(2) == 1;
  const std::size_t variables = 1 + pick(5);
  for (std::size_t i = 0; i < variables; ++i) l.sizes.push_back(pick(6));
  auto place = [&](std::size_t size) { return pick(arena - size + 1); };
  l.gradients.resize(l.towers);
  for (std::size_t k = 0; k < l.towers; ++k)
    for (std::size_t i = 0; i < variables; ++i) l.gradients[k].push_back(place(l.sizes[i]));
  for (std::size_t i = 0; i < variables; ++i) {
    l.means.push_back(pick(3) == 0 ? l.gradients[0][i] : place(l.sizes[i]));
    l.squares.push_back(place(l.sizes[i]));
  }
  return l;
}

/// Runs average_gradients_into on the layout (with plan p when given); returns whether it threw
/// aliasing_error, and requires the arena unchanged when it did.
bool rejected(const layout& l, std::vector<float>& arena, const gradavg::options& opts, gradavg::plan* p = nullptr) {
  span_towers tg(l.towers);
  for (std::size_t k = 0; k < l.towers; ++k)
    for (std::size_t i = 0; i < l.sizes.size(); ++i)
      tg[k].push_back({std::span<const float>(arena.data() + l.gradients[k][i], l.sizes[i]), static_cast<int>(i)});
  std::vector<std::span<float>> means, squares;
  for (std::size_t i = 0; i < l.sizes.size(); ++i) {
    means.emplace_back(arena.data() + l.means[i], l.sizes[i]);
    squares.emplace_back(arena.data() + l.squares[i], l.sizes[i]);
  }
  const auto before = arena;
  try {
    if (p != nullptr && l.with_squares)
      gradavg::average_gradients_into(*p, tg, means, squares, opts);
    else if (p != nullptr)
      gradavg::average_gradients_into(*p, tg, means, opts);
    else if (l.with_squares)
      gradavg::average_gradients_into(tg, means, squares, opts);
    else
      gradavg::average_gradients_into(tg, means, opts);
  } catch (const gradavg::aliasing_error&) {
    CHECK(arena == before);
    return true;
  }
  return false;
}

/// A variable whose operator<< counts its calls, and throws when told to.
struct counted_var {
  int id;
  static inline std::size_t printed = 0;
  static inline bool throws = false;
  bool operator==(const counted_var&) const = default;
  friend std::ostream& operator<<(std::ostream& os, const counted_var& v) {
    ++printed;
    if (throws) throw std::runtime_error("cannot print");
    return os << "var" << v.id;
  }
};

}  // namespace

TEST_CASE("the default check rejects the outputs of two variables swapped in place") {
  // means[0] in place into tower 0's gradient 1 and means[1] into gradient 0: each output is
  // some tower-0 gradient exactly, but of the other variable.
  std::vector<float> g00(4, 1.0f), g01(4, 2.0f), g10(4, 3.0f), g11(4, 4.0f);
  const span_towers tg{{{std::span<const float>(g00), 0}, {std::span<const float>(g01), 1}},
                       {{std::span<const float>(g10), 0}, {std::span<const float>(g11), 1}}};
  std::vector<std::span<float>> means{std::span<float>(g01), std::span<float>(g00)};
  const auto before = std::vector{g00, g01, g10, g11};
  const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(tg, means); });
  // Either output may be found first: they start at the same addresses as the gradients.
  CHECK((contains(msg, "variable #0 '0': the means output overlaps the gradient on tower 0 of variable #1 '1'") ||
         contains(msg, "variable #1 '1': the means output overlaps the gradient on tower 0 of variable #0 '0'")));
  CHECK(std::vector{g00, g01, g10, g11} == before);

  // The partial check, asked for by name, is documented to miss it.
  gradavg::average_gradients_into(tg, means, {.check = {.aliasing = gradavg::alias_check::same_variable}});
}

TEST_CASE("an in-place means output may not overlap the same variable's gradient on another tower") {
  std::vector<float> shared(4, 1.0f);
  const span_towers tg{{{std::span<const float>(shared), 0}}, {{std::span<const float>(shared), 0}}};
  std::vector<std::span<float>> means{std::span<float>(shared)};
  const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(tg, means); });
  CHECK(contains(msg, "variable #0 '0': the means output overlaps its gradient on tower 1"));
  CHECK(shared == std::vector<float>(4, 1.0f));

  // Gradients may share memory with each other: they are only read.
  std::vector<float> out(4, -1.0f);
  std::vector<std::span<float>> separate{std::span<float>(out)};
  gradavg::average_gradients_into(tg, separate);
  CHECK(out == std::vector<float>(4, 1.0f));
}

TEST_CASE("the full check agrees with a brute-force model on random layouts, with and without a plan") {
  std::mt19937 gen(20261130u);
  constexpr std::size_t arena_size = 48;
  gradavg::plan plan;
  std::size_t forbidden_count = 0, cache_flips = 0;
  bool previous_forbidden = false;
  for (int round = 0; round < 3000; ++round) {
    const layout l = random_layout(gen, arena_size);
    std::vector<float> arena = gradavg_test::random_values<float>(arena_size, static_cast<std::uint32_t>(round));
    const bool want = forbidden(l);
    forbidden_count += want ? 1 : 0;
    INFO("round " << round);
    CHECK(rejected(l, arena, {}) == want);
    // The same through one plan: proved by the first call where the layout is allowed, kept by
    // the second; every new layout is proved again.
    CHECK(rejected(l, arena, {}, &plan) == want);
    CHECK(rejected(l, arena, {}, &plan) == want);
    CHECK(plan.ready() == !want);
    cache_flips += want != previous_forbidden ? 1 : 0;
    previous_forbidden = want;
  }
  // Both verdicts are common, and the plan sees valid layouts followed by invalid ones.
  CHECK(forbidden_count > 300);
  CHECK(forbidden_count < 2700);
  CHECK(cache_flips > 300);
}

TEST_CASE("a plan detects a layout changed in one pointer") {
  std::vector<float> a0(8, 1.0f), a1(8, 3.0f), b0(8, 5.0f), b1(8, 7.0f), ma(8), mb(8);
  span_towers tg{{{std::span<const float>(a0), 0}, {std::span<const float>(b0), 1}},
                 {{std::span<const float>(a1), 0}, {std::span<const float>(b1), 1}}};
  std::vector<std::span<float>> means{std::span<float>(ma), std::span<float>(mb)};
  gradavg::plan plan;
  for (int call = 0; call < 3; ++call) gradavg::average_gradients_into(plan, tg, means);
  CHECK(plan.proofs() == 1);
  CHECK(ma == std::vector<float>(8, 2.0f));
  CHECK(mb == std::vector<float>(8, 6.0f));

  SECTION("an output moved onto another variable's gradient") {
    means[1] = std::span<float>(a1);
    const auto msg =
        message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(plan, tg, means); });
    CHECK(contains(msg, "variable #1 '1': the means output overlaps the gradient on tower 1 of variable #0 '0'"));
    CHECK(a1 == std::vector<float>(8, 3.0f));
  }
  SECTION("a gradient moved onto an output, same size") {
    tg[1][1].first = std::span<const float>(ma);
    const auto msg =
        message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(plan, tg, means); });
    CHECK(contains(msg, "variable #0 '0': the means output overlaps the gradient on tower 1 of variable #1 '1'"));
  }
  SECTION("an output grown by one element into the next buffer") {
    std::vector<float> joint(17, 0.0f);
    std::vector<float> small(7, 0.0f);
    tg[0][0].first = std::span<const float>(joint.data() + 8, 8);  // joint[8, 16)
    tg[1][0].first = std::span<const float>(joint.data() + 8, 8);
    means[0] = std::span<float>(joint.data(), 8);  // joint[0, 8): touching, allowed
    gradavg::average_gradients_into(plan, tg, means);
    means[0] = std::span<float>(joint.data() + 1, 8);  // joint[1, 9): overlaps
    CHECK_THROWS_AS(gradavg::average_gradients_into(plan, tg, means), gradavg::aliasing_error);
  }
  SECTION("a failed call forgets the layout") {
    means[1] = std::span<float>(a1);
    CHECK_THROWS_AS(gradavg::average_gradients_into(plan, tg, means), gradavg::aliasing_error);
    CHECK_FALSE(plan.ready());
    CHECK_THROWS_AS(gradavg::average_gradients_into(plan, tg, means), gradavg::aliasing_error);
  }
}

TEST_CASE("a layout proved by a partial check is not reused by the full one") {
  std::vector<float> g00(4, 1.0f), g01(4, 2.0f), g10(4, 3.0f), g11(4, 4.0f);
  const span_towers tg{{{std::span<const float>(g00), 0}, {std::span<const float>(g01), 1}},
                       {{std::span<const float>(g10), 0}, {std::span<const float>(g11), 1}}};
  std::vector<std::span<float>> swapped{std::span<float>(g01), std::span<float>(g00)};
  gradavg::plan plan;
  gradavg::average_gradients_into(plan, tg, swapped, {.check = {.aliasing = gradavg::alias_check::same_variable}});
  g00 = std::vector<float>(4, 1.0f);
  g01 = std::vector<float>(4, 2.0f);
  CHECK_THROWS_AS(gradavg::average_gradients_into(plan, tg, swapped), gradavg::aliasing_error);
}

TEST_CASE("variables are formatted only to build an error message") {
  constexpr std::size_t variables = 50, towers = 3;
  std::vector<std::vector<float>> data(towers * variables, std::vector<float>(2, 1.0f));
  std::vector<std::vector<float>> outs(variables, std::vector<float>(2, 0.0f));
  std::vector<std::vector<std::pair<std::vector<float>*, counted_var>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i) tg[k].push_back({&data[k * variables + i], {static_cast<int>(i)}});
  std::vector<std::vector<float>*> means;
  for (auto& o : outs) means.push_back(&o);
  counted_var::printed = 0;
  counted_var::throws = true;  // a valid call must not even try
  for (auto mode : {gradavg::alias_check::all, gradavg::alias_check::same_variable, gradavg::alias_check::none})
    CHECK(gradavg::average_gradients_into(tg, means, {.check = {.aliasing = mode}}).averaged == variables);
  gradavg::average_gradients(tg, gradavg::include_square);
  CHECK(counted_var::printed == 0);
  counted_var::throws = false;

  // A message prints the variables it names, and only those.
  means[7] = means[3];
  const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(tg, means); });
  CHECK(contains(msg, "variable #3 'var3': the means output overlaps the means output of variable #7 'var7'"));
  CHECK(counted_var::printed == 2);
}

TEST_CASE("an operator<< that throws while a message is built leaves the position") {
  std::vector<float> a{1, 2}, b{1, 2, 3}, out(2);
  const std::vector<std::vector<std::pair<std::vector<float>*, counted_var>>> tg{{{&a, {5}}}, {{&b, {5}}}};
  counted_var::throws = true;
  const auto msg = message_of<gradavg::shape_error>([&] { gradavg::average_gradients(tg); });
  CHECK(contains(msg, "variable #0: gradient on tower 1 has shape [3]"));
  std::vector<std::vector<float>*> means{&out};
  CHECK_THROWS_AS(gradavg::average_gradients_into(tg, means), gradavg::shape_error);

  std::vector<float> c{1, 2};
  const std::vector<std::vector<std::pair<std::vector<float>*, counted_var>>> mismatched{{{&a, {5}}}, {{&c, {6}}}};
  const auto mismatch = message_of<gradavg::variable_mismatch_error>([&] { gradavg::average_gradients(mismatched); });
  CHECK(contains(mismatch, "variable #0: tower 1 has variable (unprintable) at this position but tower 0 has "
                           "(unprintable)"));
  counted_var::throws = false;
}

#if GRADAVG_TEST_COUNT_ALLOCATIONS
TEST_CASE("average_gradients_into allocates nothing: small layouts on the stack, large ones in a plan") {
  // 64 variables x 4 towers x (means + squares) = 384 ranges: more than the stack holds.
  constexpr std::size_t towers = 4;
  for (const std::size_t variables : {std::size_t{8}, std::size_t{64}}) {
    std::vector<std::vector<float>> data(towers * variables, std::vector<float>(16, 0.5f));
    std::vector<std::vector<float>> m(variables, std::vector<float>(16)), q(variables, std::vector<float>(16));
    span_towers tg(towers);
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < variables; ++i)
        tg[k].push_back({std::span<const float>(data[k * variables + i]), static_cast<int>(i)});
    std::vector<std::span<float>> means, squares;
    for (std::size_t i = 0; i < variables; ++i) {
      means.emplace_back(m[i]);
      squares.emplace_back(q[i]);
    }
    gradavg::plan plan;
    gradavg::average_gradients_into(plan, tg, means, squares);  // sizes the plan
    INFO(variables << " variables");
    allocations = 0;
    gradavg::average_gradients_into(plan, tg, means, squares);
    means[0] = std::span<float>(m[0]).first(16);  // same layout, new span objects
    gradavg::average_gradients_into(plan, tg, means, squares);
    std::swap(means[0], means[1]);  // a new layout: every check again, in the plan's room
    gradavg::average_gradients_into(plan, tg, means, squares);
    CHECK(plan.proofs() == 2);
    std::swap(means[0], means[1]);
    CHECK(allocations == 0);
    // Without a plan, a table of more than 256 buffers is the call's one allocation, whatever
    // the check.
    for (const auto check : {gradavg::alias_check::none, gradavg::alias_check::same_variable}) {
      allocations = 0;
      gradavg::average_gradients_into(tg, means, squares, {.check = {.aliasing = check}});
      CHECK(allocations == (variables == 8 ? 0u : 1u));
    }
    allocations = 0;
    gradavg::average_gradients_into(tg, means, squares);
    CHECK(allocations == (variables == 8 ? 0u : 2u));  // the documented scratch of large layouts
    CHECK(q[variables - 1] == std::vector<float>(16, 0.25f));
  }
}
#endif
