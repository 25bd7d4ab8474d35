// Checks of an AOTInductor package (.pt2) before it is loaded. customops::CausalLM and
// customops-run run them on every package they load; a program that loads packages itself can too.
//
//   customops::verify_package("model.pt2");   // throws std::invalid_argument if damaged
//   torch::inductor::AOTIModelPackageLoader loader("model.pt2");
#pragma once

#include <map>
#include <string>

#include "customops/macros.h"

namespace customops {

// Throws std::invalid_argument, naming the file and what is wrong, unless path is a regular file
// holding a zip archive whose every stored member matches the CRC-32 its zip directory records.
// torch's loader checks none of them (its zip reader is built without CRC checks): a package with
// flipped weight bytes loads and computes NaN, one with a damaged model library crashes the
// process (SIGSEGV, SIGILL, SIGTRAP) when it runs. Reads the whole file once (about 1 s a GB).
CUSTOMOPS_API void verify_package(const std::string& path);

// The files a package holds under folder (a path in its archive's top folder, such as
// "extra/customops/tokenizer/" where customops.export.package_causal_lm embeds the model's
// tokenizer), by their names under it: empty where it holds none. Throws std::invalid_argument as
// verify_package does for a file that is not a package or one of these files that is damaged.
CUSTOMOPS_API std::map<std::string, std::string> package_files(const std::string& path, const std::string& folder);

}  // namespace customops
