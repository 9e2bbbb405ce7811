# Installs the patrickstar build in BUILD_DIR into WORK_DIR/prefix, then configures, builds and runs the
# consumer project in SOURCE_DIR against it, as a user's own trainer would (find_package only).
file(REMOVE_RECURSE "${WORK_DIR}")
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (exit ${rc}):\n${out}")
  endif()
  message(STATUS "consumer test: ${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()
step("install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# DEPENDENCIES: "CMAKE_PREFIX_PATH=a,b|absl_DIR=...|hwy_DIR=...|nlohmann_json_DIR=..." from the build,
# for the installed package's find_dependency calls: this build's prefixes follow the scratch prefix.
set(prefixes "${WORK_DIR}/prefix")
set(expected "")
string(REPLACE "|" ";" entries "${DEPENDENCIES}")
foreach(entry IN LISTS entries)
  if(entry MATCHES "^CMAKE_PREFIX_PATH=(.*)$")
    string(REPLACE "," ";" more "${CMAKE_MATCH_1}")
    list(APPEND prefixes ${more})
  elseif(entry MATCHES "^([A-Za-z_]+_DIR)=(.+)$")
    # The package folder's parent as a prefix (find_package looks in <prefix>/<name>*/), and the
    # folder itself to check below.
    cmake_path(GET CMAKE_MATCH_2 PARENT_PATH parent)
    list(APPEND prefixes "${parent}")
    list(APPEND expected "${CMAKE_MATCH_1}=${CMAKE_MATCH_2}")
  endif()
endforeach()
# In the environment, ":"-separated: a ";" list would be split into several arguments on its way
# through step()'s ARGN.
string(JOIN ":" prefix_path ${prefixes})
step("configure" ${CMAKE_COMMAND} -E env "CMAKE_PREFIX_PATH=${prefix_path}"
     ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
     "-DTorch_DIR=${Torch_DIR}" -DCMAKE_BUILD_TYPE=Release)
# Each dependency found where the build found it (not a system copy that happens to exist too).
file(READ "${WORK_DIR}/build/CMakeCache.txt" cache)
foreach(pair IN LISTS expected)
  string(REGEX REPLACE "=.*$" "" key "${pair}")
  string(REGEX REPLACE "^[^=]*=" "" want "${pair}")
  if(NOT cache MATCHES "\n${key}:PATH=([^\n]*)")
    message(FATAL_ERROR "consumer test: the consumer found no ${key}")
  endif()
  if(NOT CMAKE_MATCH_1 STREQUAL want)
    message(FATAL_ERROR "consumer test: ${key} is ${CMAKE_MATCH_1} for the consumer, ${want} for the build")
  endif()
endforeach()
step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
step("run" "${WORK_DIR}/build/consumer")
message(STATUS "consumer printed: ${last_output}")
if(NOT last_output MATCHES "patrickstar [0-9]+\\.[0-9]+\\.[0-9]+")
  message(FATAL_ERROR "consumer test: the consumer did not print the library version: ${last_output}")
endif()
