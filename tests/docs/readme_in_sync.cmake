# Checks that README.md's first C++ block is examples/readme_main.cpp verbatim and, when PROGRAM
# is given, that the block after "It prints:" is what that program prints (run through EMULATOR,
# comma-separated, when cross compiling).
#   cmake -DREADME=... -DSOURCE=... [-DPROGRAM=... [-DEMULATOR=...]] -P readme_in_sync.cmake
file(READ "${README}" readme)
file(READ "${SOURCE}" source)

# Sets out_var to the text between the first `opening` in README.md and the next ```.
function(readme_block opening out_var)
  string(FIND "${readme}" "${opening}" start)
  if(start EQUAL -1)
    message(FATAL_ERROR "README.md has no block opening with: ${opening}")
  endif()
  string(LENGTH "${opening}" skip)
  math(EXPR start "${start} + ${skip}")
  string(SUBSTRING "${readme}" ${start} -1 rest)
  string(FIND "${rest}" "```" stop)
  string(SUBSTRING "${rest}" 0 ${stop} block)
  set(${out_var} "${block}" PARENT_SCOPE)
endfunction()

readme_block("```cpp\n" shown_source)
if(NOT shown_source STREQUAL source)
  message(FATAL_ERROR "README.md's first C++ block differs from ${SOURCE}; paste the file into the README")
endif()

if(PROGRAM)
  readme_block("It prints:\n\n```\n" shown_output)
  string(REPLACE "," ";" EMULATOR "${EMULATOR}")
  execute_process(COMMAND ${EMULATOR} "${PROGRAM}" OUTPUT_VARIABLE printed RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${PROGRAM} exited with ${rc}")
  endif()
  if(NOT printed STREQUAL shown_output)
    message(FATAL_ERROR "README.md says the program prints:\n${shown_output}\nbut it printed:\n${printed}")
  endif()
endif()
