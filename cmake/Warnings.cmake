# Warnings, sanitizers and the shared precompiled header.

add_library(ps_warnings INTERFACE)
target_compile_options(ps_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${PATRICKSTAR_WERROR}>>:-Werror>)

if(PATRICKSTAR_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=undefined>)
  add_link_options(-fsanitize=address,undefined)
endif()

if(PATRICKSTAR_TSAN)
  if(PATRICKSTAR_SANITIZE)
    message(FATAL_ERROR "PATRICKSTAR_TSAN and PATRICKSTAR_SANITIZE cannot be combined (use two build folders)")
  endif()
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread> $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=thread)
endif()

# One precompiled header of the LibTorch pieces nearly every translation unit uses; targets reuse it.
add_library(ps_pch STATIC cmake/pch.cpp)
ps_link_torch(ps_pch)
target_link_libraries(ps_pch PRIVATE ps_warnings)
target_precompile_headers(ps_pch PRIVATE
  <ATen/core/Tensor.h> <ATen/ops/empty.h> <c10/util/Exception.h> <vector> <string> <memory>)

# Executables compile as PIE, libraries as PIC: GCC will not mix the two in one precompiled header.
add_executable(ps_pch_exe cmake/pch_main.cpp)
ps_link_torch(ps_pch_exe)
target_link_libraries(ps_pch_exe PRIVATE ps_warnings)
target_precompile_headers(ps_pch_exe PRIVATE
  <ATen/core/Tensor.h> <ATen/ops/empty.h> <c10/util/Exception.h> <vector> <string> <memory>)

# Line tables only (-g1) for the executables (benchmarks, examples; tests: tests/CMakeLists.txt) in
# the default RelWithDebInfo build: their full debug information was about a quarter of each one's
# compile time, while the libraries a user debugs keep -g. Backtraces keep file and line.
set(PS_EXE_DEBUG_FLAGS $<$<AND:$<CONFIG:RelWithDebInfo>,$<COMPILE_LANGUAGE:CXX>>:-g1>)
target_compile_options(ps_pch_exe PRIVATE ${PS_EXE_DEBUG_FLAGS})

# ps_target_exe_defaults(target): the same for an executable.
function(ps_target_exe_defaults target)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:ps_warnings>)
  target_compile_options(${target} PRIVATE ${PS_EXE_DEBUG_FLAGS})
  target_precompile_headers(${target} REUSE_FROM ps_pch_exe)
endfunction()

# ps_target_defaults(target): warnings and the shared precompiled header.
function(ps_target_defaults target)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:ps_warnings>)
  target_precompile_headers(${target} REUSE_FROM ps_pch)
endfunction()

# ps_add_library(<name>): the library of folder <name>: sources <name>/src/*.cpp, public headers in
# <name>/include/patrickstar/<name>/ (installed), test-only headers in <name>/testing/ (not installed),
# target ps_<name>, exported as patrickstar::<name>.
function(ps_add_library name)
  file(GLOB sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/*.cpp)
  if(NOT sources AND NOT ARGN)
    set(sources ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)  # a folder whose first sources have not landed yet
  endif()
  add_library(ps_${name} STATIC ${sources} ${ARGN})
  add_library(patrickstar::${name} ALIAS ps_${name})
  # Consumers get the standard the public headers need (std::span), even from a C++17 project.
  target_compile_features(ps_${name} PUBLIC cxx_std_20)
  target_include_directories(ps_${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>)
  # Test-only headers (<name>/testing/patrickstar/<name>/: introspection, fault injection): seen by
  # this build tree's tests and benchmarks, neither installed nor exported.
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/testing)
    target_include_directories(ps_${name} PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/testing>)
  endif()
  ps_link_torch(ps_${name})
  ps_target_defaults(ps_${name})
  set_target_properties(ps_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME patrickstar_${name})
  set_property(GLOBAL APPEND PROPERTY PS_EXPORTED_TARGETS ps_${name})
endfunction()

# ps_unity_library(<name>): compile ps_<name>'s sources six to a translation unit (CMake's unity
# build). The engine's files each instantiate the same LibTorch and engine templates: four of them
# took 24 s together here against 75 s apart. A library's files therefore keep distinct names in
# their anonymous namespaces. PATRICKSTAR_UNITY=OFF compiles each file on its own.
option(PATRICKSTAR_UNITY "Unity builds of the engine, the model zoo, ps_bench and the tests" ON)
function(ps_unity_library name)
  set_target_properties(ps_${name} PROPERTIES UNITY_BUILD ${PATRICKSTAR_UNITY} UNITY_BUILD_BATCH_SIZE 6)
endfunction()
