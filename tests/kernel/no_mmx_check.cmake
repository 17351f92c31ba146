# Fails when PROGRAM's code names an MMX register (%mm0 to %mm7), listing each such instruction
# under the function it is in:
#   cmake -DOBJDUMP=<objdump> -DAWK=<awk> -DPROGRAM=<program> -P no_mmx_check.cmake
# x86-64 only (tests/CMakeLists.txt). The MMX registers are the x87 registers: an MMX instruction
# marks the whole x87 stack in use until emms, and the caller's next long double load gives NaN.
foreach(var OBJDUMP AWK PROGRAM)
  if("${${var}}" STREQUAL "")
    message(FATAL_ERROR "no_mmx_check.cmake: -D${var}=... is required")
  endif()
endforeach()

execute_process(
  COMMAND "${OBJDUMP}" -d -C --no-show-raw-insn "${PROGRAM}"
  COMMAND "${AWK}" "/^[0-9a-f]+ </ { function_line = $0 } \
                   /%mm[0-7]/ { if (function_line != shown) print function_line; shown = function_line; print }"
  RESULTS_VARIABLE results
  OUTPUT_VARIABLE hits
  ERROR_VARIABLE errors)
foreach(result IN LISTS results)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "no_mmx_check.cmake: ${OBJDUMP} | ${AWK} failed on ${PROGRAM} (${results}):\n${errors}")
  endif()
endforeach()

if(NOT hits STREQUAL "")
  string(REGEX MATCHALL "\n" lines "${hits}")
  list(LENGTH lines count)
  message("${hits}")
  message(FATAL_ERROR "MMX registers used by ${PROGRAM}: the function and instruction lines above (${count} lines)")
endif()
message(STATUS "no MMX register in ${PROGRAM}")
