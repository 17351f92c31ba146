// Runs a test program built for an x86-64 instruction-set level when this machine has every
// feature of that level, else exits with skip_exit_code (ctest's SKIP_RETURN_CODE) without
// starting it: the program's own startup code may already use the level's instructions.
// Built for the baseline instruction set (no -march), so it runs on every x86-64 machine.
//
//   gradavg_isa_launcher LEVEL PROGRAM [ARGS...]
//
// LEVEL: x86-64 (SSE2), x86-64-v2, x86-64-v3 (AVX2, FMA), x86-64-v4 (AVX-512), x86-64-v4-bf16
// (x86-64-v4 and AVX-512 BF16: built with -march=x86-64-v4 -mavx512bf16).
// GRADAVG_ISA_MISSING (comma-separated feature names, e.g. "avx512f") makes the launcher treat
// those features as absent, so that the skip can be tested on any machine.
// Exit status: PROGRAM's, skip_exit_code when skipped, 2 for a usage error, 127 when PROGRAM
// cannot be started.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr int skip_exit_code = 77;

struct feature {
  const char* name;
  bool (*supported)();
};

// __builtin_cpu_supports needs a string literal; it also checks that the OS saves the AVX and
// AVX-512 registers. Clang 14 knows fewer names than GCC: the rest of each level is checked with
// GCC only (no x86-64 CPU has AVX2 without them).
#define GRADAVG_FEATURE(name) feature{name, [] { return __builtin_cpu_supports(name) != 0; }}

const std::vector<feature> baseline = {GRADAVG_FEATURE("sse"), GRADAVG_FEATURE("sse2")};
const std::vector<feature> v2 = {
    GRADAVG_FEATURE("sse3"),   GRADAVG_FEATURE("ssse3"),  GRADAVG_FEATURE("sse4.1"),
    GRADAVG_FEATURE("sse4.2"), GRADAVG_FEATURE("popcnt"),
#if !defined(__clang__)
    GRADAVG_FEATURE("cmpxchg16b"), GRADAVG_FEATURE("lahf_lm"),
#endif
};
const std::vector<feature> v3 = {
    GRADAVG_FEATURE("avx"), GRADAVG_FEATURE("avx2"), GRADAVG_FEATURE("bmi"), GRADAVG_FEATURE("bmi2"),
    GRADAVG_FEATURE("fma"),
#if !defined(__clang__)
    GRADAVG_FEATURE("f16c"), GRADAVG_FEATURE("lzcnt"), GRADAVG_FEATURE("movbe"), GRADAVG_FEATURE("xsave"),
#endif
};
const std::vector<feature> v4 = {GRADAVG_FEATURE("avx512f"), GRADAVG_FEATURE("avx512bw"),
                                 GRADAVG_FEATURE("avx512cd"), GRADAVG_FEATURE("avx512dq"),
                                 GRADAVG_FEATURE("avx512vl")};
const std::vector<feature> v4_bf16 = {GRADAVG_FEATURE("avx512bf16")};

#undef GRADAVG_FEATURE

// The features of a level: its own and those of the levels below it. Empty for an unknown level.
std::vector<feature> features_of(std::string_view level) {
  std::vector<const std::vector<feature>*> parts;
  if (level == "x86-64") {
    parts = {&baseline};
  } else if (level == "x86-64-v2") {
    parts = {&baseline, &v2};
  } else if (level == "x86-64-v3") {
    parts = {&baseline, &v2, &v3};
  } else if (level == "x86-64-v4") {
    parts = {&baseline, &v2, &v3, &v4};
  } else if (level == "x86-64-v4-bf16") {
    parts = {&baseline, &v2, &v3, &v4, &v4_bf16};
  }
  std::vector<feature> all;
  for (const auto* part : parts) all.insert(all.end(), part->begin(), part->end());
  return all;
}

bool hidden_by_environment(std::string_view name) {
  const char* hidden = std::getenv("GRADAVG_ISA_MISSING");
  if (hidden == nullptr) return false;
  std::string_view rest(hidden);
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    if (rest.substr(0, comma) == name) return true;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return false;
}

}  // namespace

int main(int argc, char* argv[]) {
  __builtin_cpu_init();
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s LEVEL PROGRAM [ARGS...]\n", argv[0]);
    return 2;
  }
  const std::string_view level = argv[1];
  const auto features = features_of(level);
  if (features.empty()) {
    std::fprintf(stderr, "%s: unknown instruction-set level '%s' (x86-64, x86-64-v2, x86-64-v3, x86-64-v4, x86-64-v4-bf16)\n",
                 argv[0], argv[1]);
    return 2;
  }

  std::string missing;
  for (const auto& f : features) {
    if (!f.supported() || hidden_by_environment(f.name)) missing += std::string(missing.empty() ? "" : " ") + f.name;
  }
  if (!missing.empty()) {
    std::printf("skipped: this machine lacks %s of %s, needed to run %s\n", missing.c_str(), argv[1], argv[2]);
    return skip_exit_code;
  }

  std::fflush(stdout);
  execv(argv[2], argv + 2);
  std::fprintf(stderr, "%s: cannot start %s: %s\n", argv[0], argv[2], std::strerror(errno));
  return 127;
}
