# customops_find_torch(): finds libtorch, asking Python's torch for its CMake prefix when the
# caller did not point CMAKE_PREFIX_PATH/Torch_DIR at one. Sets:
#   CUSTOMOPS_TORCH_VERSION     version libtorch reports, e.g. 2.13.0 (checked by customopsConfig)
#   CUSTOMOPS_TORCH_PY_VERSION  torch.__version__ of the Python torch, e.g. 2.13.0+cpu (or empty)
#   TORCH_LIBRARY_DIR           folder holding libtorch.so
#   CUSTOMOPS_TORCH_RPATH       run path for installed binaries: torch's lib folder in a wheel
#                               layout (relative) and as built (absolute)
# Example:
#   include(CustomopsTorch)
#   customops_find_torch()
#   target_link_libraries(mylib PUBLIC ${TORCH_LIBRARIES})
macro(customops_find_torch)
  if(NOT Python_EXECUTABLE)
    find_package(Python 3.9 COMPONENTS Interpreter)
  endif()
  set(CUSTOMOPS_TORCH_PY_VERSION "")
  if(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "import torch; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
      OUTPUT_VARIABLE _customops_torch_out OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _customops_torch_rc ERROR_QUIET)
    if(_customops_torch_rc EQUAL 0)
      string(REPLACE "\n" ";" _customops_torch_out "${_customops_torch_out}")
      list(GET _customops_torch_out 0 _customops_torch_prefix)
      list(GET _customops_torch_out 1 CUSTOMOPS_TORCH_PY_VERSION)
      list(APPEND CMAKE_PREFIX_PATH "${_customops_torch_prefix}")
    endif()
  endif()
  find_package(Torch REQUIRED)
  set(CUSTOMOPS_TORCH_VERSION "${Torch_VERSION}")
  get_filename_component(TORCH_LIBRARY_DIR "${TORCH_LIBRARY}" DIRECTORY)
  # In a wheel the package sits in site-packages/customops/lib, beside site-packages/torch/lib.
  set(CUSTOMOPS_TORCH_RPATH "$ORIGIN;$ORIGIN/../../torch/lib;$ORIGIN/../torch/lib;${TORCH_LIBRARY_DIR}")
  message(STATUS "customops: building against torch ${CUSTOMOPS_TORCH_VERSION} (${TORCH_LIBRARY_DIR})")
endmacro()

# customops_use_torch_threads(target): makes at::parallel_for in target's C++ sources run on
# torch's intra-op threads. With torch's OpenMP backend (ATen/Config.h: AT_PARALLEL_OPENMP)
# at::parallel_for is an inline template that is parallel only where the code is compiled with
# OpenMP; without -fopenmp it silently runs on one thread. So: compile with -fopenmp and link the
# libgomp that torch itself loads (torch/lib/libgomp.so.1 in the wheels, else GCC's when torch
# needs that one), so the process holds one OpenMP runtime and torch.set_num_threads applies to
# customops too; with any other runtime the kernels build serially, with a warning. Sets
# CUSTOMOPS_CPU_THREADS.
# Example:
#   customops_use_torch_threads(customops)
function(customops_use_torch_threads target)
  find_file(_config_h ATen/Config.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH NO_CACHE)
  set(_openmp OFF)
  if(_config_h)
    file(STRINGS "${_config_h}" _line REGEX "^#define AT_PARALLEL_OPENMP 1")
    if(_line)
      set(_openmp ON)
    endif()
  endif()
  if(NOT _openmp)
    set(CUSTOMOPS_CPU_THREADS "torch's native thread pool" PARENT_SCOPE)
    message(STATUS "customops: CPU kernels use torch's native thread pool")
    return()
  endif()
  file(GLOB _torch_gomp "${TORCH_LIBRARY_DIR}/libgomp.so*" "${TORCH_LIBRARY_DIR}/libgomp-*.so*")
  if(_torch_gomp)
    list(GET _torch_gomp 0 _torch_gomp)
    # clang's plain -fopenmp would call its own runtime (libomp), which torch's libgomp is not.
    target_compile_options(${target} PRIVATE $<IF:$<COMPILE_LANG_AND_ID:CXX,Clang>,-fopenmp=libgomp,$<$<COMPILE_LANGUAGE:CXX>:-fopenmp>>)
    target_link_libraries(${target} PRIVATE "${_torch_gomp}")
    get_filename_component(_name "${_torch_gomp}" NAME)
    set(_how "OpenMP (torch's ${_name})")
  else()
    # torch was linked against a libgomp outside its folder (a distribution's or conda's build):
    # GCC's own libgomp is then the same runtime. Any other OpenMP runtime (clang's libomp, Intel's
    # libiomp5) would give the process two thread pools, so the kernels run serially instead.
    set(_same_runtime OFF)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      find_package(OpenMP COMPONENTS CXX)
      file(STRINGS "${TORCH_LIBRARY_DIR}/libtorch_cpu.so" _needs_gomp REGEX "^libgomp\\.so\\.1$" LIMIT_COUNT 1)
      if(OpenMP_CXX_FOUND AND _needs_gomp)
        set(_same_runtime ON)
      endif()
    endif()
    if(NOT _same_runtime)
      # The kernels' headers refuse to build serially by accident (cpp/cpu/dispatch.h).
      target_compile_definitions(${target} PRIVATE CUSTOMOPS_SERIAL_CPU)
      set(CUSTOMOPS_CPU_THREADS "one thread (no OpenMP runtime shared with torch)" PARENT_SCOPE)
      message(WARNING "customops: torch uses OpenMP, but this compiler's runtime is not known to be torch's: "
                      "CPU kernels run on one thread (build with GCC for threaded CPU kernels)")
      return()
    endif()
    target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
    set(_how "OpenMP (GCC's libgomp, as torch's)")
  endif()
  set(CUSTOMOPS_CPU_THREADS "${_how}" PARENT_SCOPE)
  message(STATUS "customops: CPU kernels use torch's threads through ${_how}")
endfunction()
