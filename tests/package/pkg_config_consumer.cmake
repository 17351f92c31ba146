# cmake -P script: compiles and runs SOURCE against the installed gradavg with pkg-config's flags
# only (PKG_CONFIG_PATH names the prefix). Needs PKG_CONFIG, CXX, SOURCE, BINARY, EXPECTED_VERSION;
# EXPECTED_EIGEN_VERSION, when set, is the Eigen version eigen3.pc must report.
function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

run("pkg-config --modversion gradavg" ${PKG_CONFIG} --modversion gradavg)
if(NOT out STREQUAL EXPECTED_VERSION)
  message(FATAL_ERROR "gradavg.pc says version '${out}', want ${EXPECTED_VERSION}")
endif()
if(EXPECTED_EIGEN_VERSION)
  run("pkg-config --modversion eigen3" ${PKG_CONFIG} --modversion eigen3)
  if(NOT out STREQUAL EXPECTED_EIGEN_VERSION)
    message(FATAL_ERROR "eigen3.pc says version '${out}', this build uses Eigen ${EXPECTED_EIGEN_VERSION}")
  endif()
endif()

run("pkg-config --cflags gradavg" ${PKG_CONFIG} --cflags gradavg)
message(STATUS "pkg-config --cflags gradavg: ${out}")
separate_arguments(cflags UNIX_COMMAND "${out}")
get_filename_component(binary_dir "${BINARY}" DIRECTORY)
file(MAKE_DIRECTORY "${binary_dir}")
run("compile" ${CXX} -std=c++20 ${cflags} "-DEXPECTED_VERSION=\"${EXPECTED_VERSION}\"" "${SOURCE}" -o "${BINARY}")
run("the consumer" "${BINARY}")
message(STATUS "${out}")
if(NOT out MATCHES "consumed: ok")
  message(FATAL_ERROR "the consumer printed '${out}'")
endif()
