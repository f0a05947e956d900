// The message of the c10::Error that f() throws (what_without_backtrace), or "" when it throws none:
// for tests that check an error names its argument.
#pragma once

#include <c10/util/Exception.h>

#include <string>

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}
