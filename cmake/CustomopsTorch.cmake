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
