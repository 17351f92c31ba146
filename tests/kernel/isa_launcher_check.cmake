# Checks gradavg_isa_launcher (cmake -DLAUNCHER=... -P isa_launcher_check.cmake):
#   - a level whose feature is missing (hidden with GRADAVG_ISA_MISSING) exits 77 without
#     starting the program,
#   - the baseline level, which every x86-64 machine has, starts the program and returns its
#     exit status (0 and 1 both passed on),
#   - an unknown level is an error (2), not a skip.
function(run_launcher out_rc out_text)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${out_rc} "${rc}" PARENT_SCOPE)
  set(${out_text} "${out}${err}" PARENT_SCOPE)
endfunction()

function(expect what rc text expected_rc)
  if(NOT rc STREQUAL "${expected_rc}")
    message(FATAL_ERROR "${what}: exit status ${rc}, expected ${expected_rc}; output:\n${text}")
  endif()
endfunction()

set(program ${CMAKE_COMMAND} -E echo program-started)

foreach(level x86-64-v3 x86-64-v4 x86-64-v4-bf16)
  run_launcher(rc text ${CMAKE_COMMAND} -E env GRADAVG_ISA_MISSING=sse4.1,avx2 ${LAUNCHER} ${level} ${program})
  expect("${level} without avx2" "${rc}" "${text}" 77)
  if(text MATCHES "program-started" OR NOT text MATCHES "lacks .*avx2")
    message(FATAL_ERROR "${level} without avx2: expected a skip naming avx2, got:\n${text}")
  endif()
endforeach()

run_launcher(rc text ${LAUNCHER} x86-64 ${program})
expect("x86-64" "${rc}" "${text}" 0)
if(NOT text MATCHES "program-started")
  message(FATAL_ERROR "x86-64: the program did not run:\n${text}")
endif()

run_launcher(rc text ${LAUNCHER} x86-64 ${CMAKE_COMMAND} -E false)
expect("x86-64, failing program" "${rc}" "${text}" 1)

run_launcher(rc text ${LAUNCHER} x86-64-v9 ${program})
expect("unknown level" "${rc}" "${text}" 2)
