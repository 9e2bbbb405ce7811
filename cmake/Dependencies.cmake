# Finds LibTorch (from the torch wheel in .venv unless Torch_DIR / CMAKE_PREFIX_PATH already point at one),
# the Debian libraries, OpenMP and, per PATRICKSTAR_CUDA, the CUDA toolkit with cuBLAS and NCCL.

set(PATRICKSTAR_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH
    "Python whose torch wheel provides LibTorch (scripts/setup creates it)")
if(NOT Torch_DIR)
  if(NOT EXISTS "${PATRICKSTAR_PYTHON}")
    message(FATAL_ERROR "patrickstar: no LibTorch: ${PATRICKSTAR_PYTHON} does not exist. "
                        "Run scripts/setup, or pass -DTorch_DIR=<libtorch>/share/cmake/Torch.")
  endif()
  execute_process(
    COMMAND "${PATRICKSTAR_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _ps_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_VARIABLE _ps_torch_err RESULT_VARIABLE _ps_torch_rc)
  if(NOT _ps_torch_rc EQUAL 0)
    message(FATAL_ERROR "patrickstar: '${PATRICKSTAR_PYTHON} -c import torch' failed: ${_ps_torch_err}. "
                        "Run scripts/setup.")
  endif()
  set(Torch_DIR "${_ps_torch_prefix}/Torch" CACHE PATH "LibTorch CMake package folder" FORCE)
endif()

# The CUDA build of LibTorch looks for the toolkit itself. Naming the architectures keeps it from
# compiling and running a GPU-detection program (there may be no GPU, and CMake 3.25 cannot drive
# that probe with nvcc 13).
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
find_package(Torch REQUIRED)
message(STATUS "patrickstar: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
# TORCH_LIBRARIES carries the include dirs and the ABI define; TORCH_CXX_FLAGS repeats the ABI define.
string(REPLACE " " ";" _ps_torch_cxx_flags "${TORCH_CXX_FLAGS}")

find_package(nlohmann_json 3 REQUIRED)
find_package(absl REQUIRED)
find_package(hwy REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)

# CUDA: AUTO enables it when nvcc is found, ON requires it, OFF skips it.
set(PATRICKSTAR_HAVE_CUDA OFF)
if(NOT PATRICKSTAR_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The shared CUDA runtime, the one LibTorch loads (libcudart.so): with CMake's default (static)
    # every executable would also link cudart_static, a second runtime with its own state.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_library(PATRICKSTAR_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
    if(NOT CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "52")
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(PATRICKSTAR_HAVE_CUDA ON)
    message(STATUS "patrickstar: CUDA ${CUDAToolkit_VERSION} found; CUDA sources compile (they run only on a GPU). "
                   "NCCL: ${PATRICKSTAR_NCCL_LIBRARY}")
  elseif(PATRICKSTAR_CUDA STREQUAL "ON")
    message(FATAL_ERROR "patrickstar: PATRICKSTAR_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "patrickstar: no CUDA toolkit; building the CPU and emulated-device parts only")
  endif()
endif()

# MPI (the CPU collectives of data parallelism): AUTO uses it when found, ON requires it, OFF skips it.
set(PATRICKSTAR_MPI AUTO CACHE STRING "Build the MPI backend of comm/: AUTO (when found), ON, OFF")
set_property(CACHE PATRICKSTAR_MPI PROPERTY STRINGS AUTO ON OFF)
set(PATRICKSTAR_HAVE_MPI OFF)
if(NOT PATRICKSTAR_MPI STREQUAL "OFF")
  set(MPI_CXX_SKIP_MPICXX ON)  # the C API only, no deprecated C++ bindings
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(PATRICKSTAR_HAVE_MPI ON)
    # The multi-process tests pass Open MPI's launcher flags: they run with Open MPI's own mpirun.
    set(PATRICKSTAR_MPIEXEC "")
    if(MPIEXEC_EXECUTABLE)
      execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _ps_mpiexec_version
                      ERROR_QUIET RESULT_VARIABLE _ps_mpiexec_rc)
      if(_ps_mpiexec_rc EQUAL 0 AND _ps_mpiexec_version MATCHES "Open MPI|OpenRTE|open-mpi")
        set(PATRICKSTAR_MPIEXEC ${MPIEXEC_EXECUTABLE})
      endif()
    endif()
    if(PATRICKSTAR_MPIEXEC)
      message(STATUS "patrickstar: MPI ${MPI_CXX_VERSION} found; multi-process tests run with ${PATRICKSTAR_MPIEXEC}")
    else()
      message(STATUS "patrickstar: MPI ${MPI_CXX_VERSION} found, but no Open MPI launcher: the "
                     "multi-process tests are not registered")
    endif()
  elseif(PATRICKSTAR_MPI STREQUAL "ON")
    message(FATAL_ERROR "patrickstar: PATRICKSTAR_MPI=ON but MPI was not found (apt-get install libopenmpi-dev openmpi-bin)")
  else()
    message(STATUS "patrickstar: no MPI; data parallelism across processes is not built (scripts/setup installs Open MPI)")
  endif()
endif()

# ps_link_torch(target): LibTorch with its flags, PUBLIC so consumers of our targets get them too.
function(ps_link_torch target)
  target_link_libraries(${target} PUBLIC ${TORCH_LIBRARIES})
  target_compile_options(${target} PUBLIC $<$<COMPILE_LANGUAGE:CXX>:${_ps_torch_cxx_flags}>)
endfunction()
