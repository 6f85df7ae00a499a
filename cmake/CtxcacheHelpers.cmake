# Shared CMake helpers for ctxcache targets.

# Warnings applied to project code only (not generated proto code).
set(CTXCACHE_WARNINGS -Wall -Wextra -Werror)

# ctxcache_library(NAME SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
function(ctxcache_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  # Internal headers are included by repo path ("storage/page_codec.h");
  # installed ones live under include/ctxcache/internal with the same paths.
  target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
                                            $<INSTALL_INTERFACE:include/ctxcache/internal>)
  target_compile_options(${name} PRIVATE ${CTXCACHE_WARNINGS})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# ctxcache_test(NAME SOURCES ... [LIBS ...] [LABELS ...] [TIMEOUT s])
# Labels: unit (fast, runs under sanitizers too), integration, crash, bench, golden.
function(ctxcache_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_compile_options(${name} PRIVATE ${CTXCACHE_WARNINGS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  if("unit" IN_LIST ARG_LABELS)
    set_property(GLOBAL APPEND PROPERTY CTXCACHE_UNIT_TESTS ${name})
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    ENVIRONMENT "CTXCACHE_BIN_DIR=${CMAKE_BINARY_DIR}/bin;CTXCACHE_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endfunction()
