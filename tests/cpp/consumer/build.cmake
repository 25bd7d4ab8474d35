# Configures and builds the consumer project against an install tree (run with cmake -P).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC} -B ${BIN} -G ${GENERATOR}
                        -DCMAKE_PREFIX_PATH=${PREFIX} -DTorch_DIR=${Torch_DIR}
                COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BIN} COMMAND_ERROR_IS_FATAL ANY)
