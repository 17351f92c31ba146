// The tests' main(), built from source with the tests' own compiler and target, so that the suite
// builds wherever Catch2's headers are (Debian's prebuilt Catch2WithMain is for the host only,
// useless when cross compiling). Catch2 v3 links its compiled library, v2.13 is header-only.
#if __has_include(<catch2/catch_session.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
