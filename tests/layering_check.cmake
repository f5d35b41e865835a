# Compiles `#include "HEADER"` with the include path of the daemon layer LAYER and succeeds only
# if the compiler cannot find the header: the build keeps a layer from including one above it.
# cmake -DCOMPILER=... -DINCLUDES=dir;dir -DLAYER=name -DHEADER=daemon/x/y.h -P layering_check.cmake
set(source ${CMAKE_CURRENT_BINARY_DIR}/layering_${LAYER}.cc)
file(WRITE ${source} "#include \"${HEADER}\"\n")
set(flags)
foreach(dir IN LISTS INCLUDES)
  list(APPEND flags -I${dir})
endforeach()
execute_process(COMMAND ${COMPILER} -std=c++20 -fsyntax-only ${flags} ${source}
  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(rc EQUAL 0)
  message(FATAL_ERROR "the ${LAYER} layer can include ${HEADER}, a header of a layer above it")
endif()
if(NOT err MATCHES "No such file|file not found")  # GCC, clang
  message(FATAL_ERROR "compiling an include of ${HEADER} failed for another reason:\n${err}")
endif()
message(STATUS "the ${LAYER} layer cannot include ${HEADER}")
