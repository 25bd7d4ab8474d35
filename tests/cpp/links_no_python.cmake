# Fails when BINARY (or a library it loads) links libpython or libtorch_python (run with cmake -P):
# customops-run must start in a process that has no Python.
execute_process(COMMAND ldd ${BINARY} OUTPUT_VARIABLE _ldd RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "ldd ${BINARY} failed")
endif()
if(_ldd MATCHES "libpython|libtorch_python")
  message(FATAL_ERROR "${BINARY} links Python:\n${_ldd}")
endif()
if(NOT _ldd MATCHES "libcustomops")
  message(FATAL_ERROR "${BINARY} does not link libcustomops:\n${_ldd}")
endif()
message(STATUS "${BINARY} links libcustomops and libtorch, no libpython")
