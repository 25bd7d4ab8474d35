# customops_add_cpu_kernels(target src...): compiles each CPU kernel source once per instruction
# set (DEFAULT, and AVX2 and AVX512 on x86-64), the way ATen does, so one binary runs on any x86-64
# CPU and still uses the widest vectors the CPU has (ATen's own kernels do, and so does Inductor). Each copy defines CPU_CAPABILITY, which puts
# its at::vec and customops kernels in a namespace of that name; cpp/cpu/dispatch.h picks one at
# run time from at::get_cpu_capability() (so ATEN_CPU_CAPABILITY=default forces DEFAULT).
# Example:
#   customops_add_cpu_kernels(customops cpp/cpu/muladd.cpp)
function(customops_add_cpu_kernels target)
  set(_caps DEFAULT)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
    list(APPEND _caps AVX2 AVX512)
  endif()
  foreach(_cap IN LISTS _caps)
    foreach(_src IN LISTS ARGN)
      get_filename_component(_name "${_src}" NAME_WE)
      set(_copy "${CMAKE_CURRENT_BINARY_DIR}/cpu_kernels/${_name}.${_cap}.cpp")
      file(WRITE "${_copy}.in" "#include \"${CMAKE_CURRENT_SOURCE_DIR}/${_src}\"\n")
      configure_file("${_copy}.in" "${_copy}" COPYONLY)
      target_sources(${target} PRIVATE "${_copy}")
      set(_defs CPU_CAPABILITY=${_cap} CPU_CAPABILITY_${_cap})
      set(_flags "")
      if(_cap STREQUAL "AVX2")
        set(_flags -mavx2 -mfma -mf16c -mbmi2)
      elseif(_cap STREQUAL "AVX512")
        set(_flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mbmi2)
      endif()
      set_source_files_properties("${_copy}" PROPERTIES
        COMPILE_DEFINITIONS "${_defs}" COMPILE_OPTIONS "${_flags}")
    endforeach()
  endforeach()
  if("AVX2" IN_LIST _caps)
    target_compile_definitions(${target} PRIVATE CUSTOMOPS_HAVE_AVX2 CUSTOMOPS_HAVE_AVX512)
  endif()
  message(STATUS "customops: CPU kernels built for: ${_caps}")
endfunction()
