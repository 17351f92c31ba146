# The bench_smoke test (cmake -P): runs the grid binary briefly on a filter and fails unless
#   - it exits with status 0,
#   - it ran at least one benchmark and none reported an error (a peer whose reference check
#     fails calls SkipWithError; Google Benchmark 1.7 still exits 0 then, printing
#     "ERROR OCCURRED: '...'" and "error_occurred": true in the JSON),
#   - every implementation in IMPLS ran at every thread count that any benchmark ran at.
# A paired benchmark (paired/..., paired_model/..., fused/..., fused16/...) counts as the
# implementation named by its family: it runs all its contenders and checks each against the
# reference before timing.
#
# Variables: BENCH (a benchmark executable), FILTER, MIN_TIME (seconds), JSON (where the
# results go), IMPLS (comma-separated implementation names that must appear), optional ARGS
# (comma-separated extra arguments for BENCH).
cmake_minimum_required(VERSION 3.21)  # string(JSON), IN_LIST

foreach(var BENCH FILTER MIN_TIME JSON IMPLS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "smoke_test.cmake: -D${var}=... is required")
  endif()
endforeach()

string(REPLACE "," ";" IMPLS "${IMPLS}")
string(REPLACE "," ";" ARGS "${ARGS}")
file(REMOVE "${JSON}")
execute_process(
  COMMAND "${BENCH}" ${ARGS} "--benchmark_filter=${FILTER}" "--benchmark_min_time=${MIN_TIME}"
          "--benchmark_out=${JSON}" --benchmark_out_format=json
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench_smoke: ${BENCH} exited with ${rc}")
endif()
if(NOT EXISTS "${JSON}")
  message(FATAL_ERROR "bench_smoke: no JSON written to ${JSON}")
endif()

file(READ "${JSON}" json)
if(json STREQUAL "")  # Google Benchmark writes an empty file when the filter matches nothing
  message(FATAL_ERROR "bench_smoke: no benchmark matched the filter '${FILTER}'")
endif()
string(JSON count LENGTH "${json}" benchmarks)
if(count EQUAL 0)
  message(FATAL_ERROR "bench_smoke: no benchmark matched the filter '${FILTER}'")
endif()

set(errors "")
set(threads_seen "")
set(seen "")  # "<impl>@<threads>" for every benchmark that ran
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${json}" benchmarks ${i} name)
  string(JSON failed ERROR_VARIABLE no_error_member GET "${json}" benchmarks ${i} error_occurred)
  if(NOT no_error_member AND failed)
    string(JSON why ERROR_VARIABLE ignored GET "${json}" benchmarks ${i} error_message)
    string(APPEND errors "\n  ${name}: ${why}")
    continue()
  endif()
  # <family>/<type>/<impl>/.../threads:<n>[/real_time]
  string(REPLACE "/" ";" parts "${name}")
  list(GET parts 0 family)
  if(family MATCHES "^(paired|fused)")
    set(impl "${family}")
  else()
    list(GET parts 2 impl)
  endif()
  if(NOT name MATCHES "/threads:([0-9]+)")
    string(APPEND errors "\n  ${name}: no threads:<n> in the name")
    continue()
  endif()
  list(APPEND threads_seen "${CMAKE_MATCH_1}")
  list(APPEND seen "${impl}@${CMAKE_MATCH_1}")
endforeach()
if(errors)
  message(FATAL_ERROR "bench_smoke: benchmarks reported errors:${errors}")
endif()

list(REMOVE_DUPLICATES threads_seen)
set(missing "")
foreach(impl IN LISTS IMPLS)
  foreach(n IN LISTS threads_seen)
    if(NOT "${impl}@${n}" IN_LIST seen)
      list(APPEND missing "${impl} at ${n} thread(s)")
    endif()
  endforeach()
endforeach()
if(missing)
  list(JOIN missing ", " missing)
  message(FATAL_ERROR "bench_smoke: did not run: ${missing}")
endif()
message(STATUS "bench_smoke: ${count} benchmarks ran without error, threads {${threads_seen}}")
