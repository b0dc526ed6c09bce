# A negative check of the vendor ABI conformance test, run by CTest as `cmake -D... -P expect_rejected.cmake`:
# copies our ABI header HEADER (csrc/RELPATH) with FROM replaced by TO into a scratch include folder that
# shadows csrc, compiles the conformance SOURCE against it and the vendor headers in VENDOR_INCLUDE, and
# passes only if the compiler rejects it with an error matching EXPECT. DEFINES: comma-separated -D values.
foreach(var COMPILER SOURCE CSRC RELPATH VENDOR_INCLUDE WORKDIR FROM TO EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "expect_rejected.cmake needs -D${var}=...")
  endif()
endforeach()

file(READ "${CSRC}/${RELPATH}" text)
if(NOT FROM STREQUAL "")
  string(FIND "${text}" "${FROM}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "'${FROM}' is no longer in ${CSRC}/${RELPATH}: update this negative check")
  endif()
  string(REPLACE "${FROM}" "${TO}" text "${text}")
endif()
file(REMOVE_RECURSE "${WORKDIR}")
file(WRITE "${WORKDIR}/${RELPATH}" "${text}")

set(defines "")
if(DEFINED DEFINES)
  string(REPLACE "," ";" DEFINES "${DEFINES}")
  foreach(define ${DEFINES})
    list(APPEND defines "-D${define}")
  endforeach()
endif()
execute_process(
  COMMAND "${COMPILER}" -std=c++17 -fsyntax-only -I "${WORKDIR}" -I "${CSRC}" -isystem "${VENDOR_INCLUDE}" ${defines}
          "${SOURCE}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "the conformance test compiled although ${RELPATH} had '${FROM}' replaced by '${TO}'")
endif()
string(REGEX MATCH "[^\n]*${EXPECT}[^\n]*" line "${out}")
if(line STREQUAL "")
  message(FATAL_ERROR "the conformance test failed to compile, but not with '${EXPECT}':\n${out}")
endif()
message(STATUS "rejected as expected: ${line}")
