// The message of the c10::Error a test provokes, for the tests that check error texts.
#pragma once

#include <functional>
#include <string>

#include <c10/util/Exception.h>

namespace patrickstar::test {

// What `f` throws as c10::Error (without LibTorch's backtrace), or "<no error>" when it returns.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

}  // namespace patrickstar::test
