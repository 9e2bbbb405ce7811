# A compiler cache (ccache) that a fresh clone in another folder can hit: paths are rewritten relative
# to the source tree (base_dir), the build folder is not hashed (hash_dir false), and the precompiled
# headers are cacheable (pch_defines, time_macros). A fresh clone's build, or a second build folder
# of the same sources, then compiles only what changed. PATRICKSTAR_CCACHE: AUTO (when ccache is on
# the path; scripts/setup installs it), ON (a missing ccache is an error), OFF. The cache itself is
# ccache's own (CCACHE_DIR, default ~/.cache/ccache), capped at PATRICKSTAR_CCACHE_SIZE.
# A precompiled header is not byte-reproducible, and ccache keys a translation unit by the one it
# uses; it keys the header's own compile by the .gch already beside it, if any. So a fresh build
# folder (a clone, CI) hits the entries an earlier fresh build folder of the same sources stored,
# while a precompiled header rebuilt over an older one (flags changed in place) misses, and so does
# everything compiled with it.
set(PATRICKSTAR_CCACHE AUTO CACHE STRING "Compile through ccache: AUTO, ON, OFF")
set_property(CACHE PATRICKSTAR_CCACHE PROPERTY STRINGS AUTO ON OFF)
set(PATRICKSTAR_CCACHE_SIZE 25G CACHE STRING "ccache's max_size for the builds of this project")

if(NOT PATRICKSTAR_CCACHE STREQUAL "OFF" AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(PATRICKSTAR_CCACHE_PROGRAM ccache)
  if(PATRICKSTAR_CCACHE_PROGRAM)
    set(_ps_ccache ${CMAKE_COMMAND} -E env
        CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=1
        CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
        CCACHE_MAXSIZE=${PATRICKSTAR_CCACHE_SIZE} ${PATRICKSTAR_CCACHE_PROGRAM})
    set(CMAKE_CXX_COMPILER_LAUNCHER ${_ps_ccache})
    # clang writes the mtimes of its inputs into a precompiled header and refuses one whose inputs
    # have other mtimes (a fresh clone's): ccache's documentation asks for this flag. (GCC's
    # precompiled headers carry no mtimes.)
    if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      add_compile_options("SHELL:-Xclang -fno-pch-timestamp")
    endif()
    set(CMAKE_CUDA_COMPILER_LAUNCHER ${_ps_ccache})
    message(STATUS "patrickstar: compiling through ccache (${PATRICKSTAR_CCACHE_PROGRAM}, base ${PROJECT_SOURCE_DIR})")
  elseif(PATRICKSTAR_CCACHE STREQUAL "ON")
    message(FATAL_ERROR "PATRICKSTAR_CCACHE=ON but no ccache on the path (Debian: apt-get install ccache)")
  else()
    message(STATUS "patrickstar: no ccache on the path: every build compiles everything (scripts/setup installs it)")
  endif()
endif()
