# Shared CMake helpers for ctxcache targets.

# Warnings applied to project code only (not generated proto code).
set(CTXCACHE_WARNINGS -Wall -Wextra -Werror)

# ---- Module dependency rules -> include views -------------------------------
# cmake/module-rules.txt is the one table of what each module may include (the
# include_rules ctest reads it too). Project headers are included by repo path
# ("storage/page_codec.h"), but no module target sees the repo root: each gets
# a PRIVATE "include view", ${CMAKE_BINARY_DIR}/include-views/<module>/, whose
# entries are symlinks to the project folders it may include, so
# `#include "storage/keys.h"` in index/ does not compile. Views are not
# inherited: a dependent compiles against its own view, never a dependency's.
# Tests and bench keep the repo root.
set(CTXCACHE_MODULE_RULES_FILE ${CMAKE_CURRENT_LIST_DIR}/module-rules.txt)
set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             ${CTXCACHE_MODULE_RULES_FILE})
set(CTXCACHE_INCLUDE_VIEWS_DIR ${CMAKE_BINARY_DIR}/include-views)
file(REMOVE_RECURSE ${CTXCACHE_INCLUDE_VIEWS_DIR})  # rebuilt from the rules on every configure
set(CTXCACHE_RULE_MODULES "")
file(STRINGS ${CTXCACHE_MODULE_RULES_FILE} _ctxcache_rule_lines)
foreach(_line IN LISTS _ctxcache_rule_lines)
  string(REGEX REPLACE "#.*$" "" _line "${_line}")
  string(STRIP "${_line}" _line)
  if(_line STREQUAL "")
    continue()
  elseif(_line MATCHES "^allow[ \t]+([^ \t:]+)[ \t]*:(.*)$")
    set(_key ${CMAKE_MATCH_1})
    separate_arguments(_folders UNIX_COMMAND "${CMAKE_MATCH_2}")
    list(APPEND CTXCACHE_RULE_MODULES ${_key})
    set(CTXCACHE_RULE_ALLOW_${_key} ${_folders})
  elseif(_line MATCHES "^exception[ \t]+([^ \t:]+)[ \t]*:[ \t]*([^ \t]+)$")
    # A known violation: grant the include's folder to the file's module view.
    list(APPEND _ctxcache_rule_exceptions "${CMAKE_MATCH_1}|${CMAKE_MATCH_2}")
  elseif(NOT _line MATCHES "^(forbid|alias)[ \t]+[^ \t:]+[ \t]*:")
    message(FATAL_ERROR "${CTXCACHE_MODULE_RULES_FILE}: cannot parse '${_line}'")
  endif()
endforeach()

# _ctxcache_rule_key(<repo-relative path> <out var>): the longest module with
# an allow line that contains the path ("" when none does).
function(_ctxcache_rule_key path out)
  set(best "")
  foreach(key IN LISTS CTXCACHE_RULE_MODULES)
    string(LENGTH "${key}" len)
    string(LENGTH "${best}" best_len)
    string(FIND "${path}/" "${key}/" pos)
    if(pos EQUAL 0 AND len GREATER best_len)
      set(best ${key})
    endif()
  endforeach()
  set(${out} "${best}" PARENT_SCOPE)
endfunction()

foreach(_exception IN LISTS _ctxcache_rule_exceptions)
  string(REPLACE "|" ";" _exception "${_exception}")
  list(GET _exception 0 _file)
  list(GET _exception 1 _include)
  _ctxcache_rule_key(${_file} _key)
  string(REGEX REPLACE "/.*$" "" _folder "${_include}")
  if(_key AND IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${_folder})
    list(APPEND CTXCACHE_RULE_ALLOW_${_key} ${_folder})
    list(APPEND CTXCACHE_RULE_EXCEPTION_NOTES "${_file} -> ${_include}")
  endif()
endforeach()
if(CTXCACHE_RULE_EXCEPTION_NOTES)
  list(LENGTH CTXCACHE_RULE_EXCEPTION_NOTES _n)
  message(STATUS "Module rules: ${_n} allow-listed violation(s) in cmake/module-rules.txt")
endif()

# ctxcache_include_view(TARGET): gives TARGET the include view of the module
# its sources belong to (all of them must belong to the same one).
function(ctxcache_include_view target)
  get_target_property(sources ${target} SOURCES)
  get_target_property(source_dir ${target} SOURCE_DIR)
  set(keys "")
  foreach(src IN LISTS sources)
    if(src MATCHES "^\\$<")
      continue()
    endif()
    cmake_path(ABSOLUTE_PATH src BASE_DIRECTORY ${source_dir} NORMALIZE OUTPUT_VARIABLE abs)
    cmake_path(IS_PREFIX PROJECT_SOURCE_DIR "${abs}" NORMALIZE in_tree)
    cmake_path(IS_PREFIX CMAKE_BINARY_DIR "${abs}" NORMALIZE generated)
    if(NOT in_tree OR generated)
      continue()
    endif()
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${abs})
    _ctxcache_rule_key(${rel} key)
    if(NOT key)
      message(FATAL_ERROR "${target}: ${rel} belongs to no module in cmake/module-rules.txt")
    endif()
    list(APPEND keys ${key})
  endforeach()
  list(REMOVE_DUPLICATES keys)
  list(LENGTH keys nkeys)
  if(NOT nkeys EQUAL 1)
    message(FATAL_ERROR "${target}: sources must belong to exactly one module of "
                        "cmake/module-rules.txt, found '${keys}'")
  endif()
  set_target_properties(${target} PROPERTIES CTXCACHE_MODULE ${keys})
  if("*" IN_LIST CTXCACHE_RULE_ALLOW_${keys})
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR})
    return()
  endif()
  string(REPLACE "/" "-" view_name ${keys})
  set(view ${CTXCACHE_INCLUDE_VIEWS_DIR}/${view_name})
  if(NOT IS_DIRECTORY ${view})
    file(MAKE_DIRECTORY ${view})
    foreach(folder IN LISTS CTXCACHE_RULE_ALLOW_${keys})
      if(IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${folder} AND NOT EXISTS ${view}/${folder})
        file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${view}/${folder} SYMBOLIC)
      endif()
    endforeach()
  endif()
  target_include_directories(${target} PRIVATE $<BUILD_INTERFACE:${view}>)
endfunction()

# Executables and plugins declared next to a module library (ctxcached,
# ctxcache, libctxcache_spm.so) get their module's view too: run once at the
# end of each directory that calls ctxcache_library.
function(_ctxcache_include_views_for_directory)
  get_property(targets DIRECTORY PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    get_target_property(module ${t} CTXCACHE_MODULE)
    if(NOT module AND type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$")
      ctxcache_include_view(${t})
    endif()
  endforeach()
endfunction()

# ctxcache_library(NAME SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
function(ctxcache_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  # Internal headers are included by repo path ("storage/page_codec.h"): in the
  # build through the module's include view (above); installed ones live under
  # include/ctxcache/internal with the same paths.
  target_include_directories(${name} PUBLIC $<INSTALL_INTERFACE:include/ctxcache/internal>)
  ctxcache_include_view(${name})
  get_property(deferred DIRECTORY PROPERTY CTXCACHE_INCLUDE_VIEWS_DEFERRED)
  if(NOT deferred)
    set_property(DIRECTORY PROPERTY CTXCACHE_INCLUDE_VIEWS_DEFERRED ON)
    cmake_language(DEFER CALL _ctxcache_include_views_for_directory)
  endif()
  target_compile_options(${name} PRIVATE ${CTXCACHE_WARNINGS})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# ctxcache_test(NAME SOURCES ... [LIBS ...] [LABELS ...] [TIMEOUT s])
# Labels: unit (fast, runs under sanitizers too), integration, crash, bench, golden;
# fuzz/CMakeLists.txt adds `fuzz` (its tests are not ctxcache_test binaries).
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
