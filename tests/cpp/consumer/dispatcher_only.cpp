// Consumer check: with no customops symbol referenced, the ops must still be registered.
#include <ATen/core/dispatch/Dispatcher.h>

#include <iostream>

int main() {
  auto schema = c10::Dispatcher::singleton().findSchema({"customops::muladd", ""});
  if (!schema.has_value()) {
    std::cerr << "customops::muladd is not registered: libcustomops.so was not loaded\n";
    return 1;
  }
  std::cout << "ok: customops::muladd is registered\n";
  return 0;
}
