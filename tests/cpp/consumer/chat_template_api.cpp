// Consumer check: customops::ChatTemplate driven from the command line, for the chat template tests
// (tests/python/test_chat_template.py), which compare it with transformers' apply_chat_template.
//
//   chat_template_api TEMPLATE_FILE BOS EOS CASES_FILE
//
// A case is a line: "G" (add_generation_prompt) or "-", then tab-separated fields, each a message
// "HEX(role):HEX(content)" or an extra template variable "@HEX(name):HEX(value)". Out, a line a case:
// "ok HEX(prompt)" or "error MESSAGE"; a template the constructor refuses gives one line,
// "refused MESSAGE", and exit status 0.
#include <customops/chat_template.h>

#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "hex.h"

namespace {

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: chat_template_api TEMPLATE_FILE BOS EOS CASES_FILE\n";
    return 2;
  }
  std::ifstream tf(argv[1], std::ios::binary);
  if (!tf) {
    std::cerr << "cannot read " << argv[1] << "\n";
    return 2;
  }
  std::stringstream source;
  source << tf.rdbuf();
  std::unique_ptr<customops::ChatTemplate> chat;
  try {
    chat = std::make_unique<customops::ChatTemplate>(source.str(), argv[2], argv[3]);
  } catch (const std::invalid_argument& e) {
    std::cout << "refused " << one_line(e.what()) << "\n";
    return 0;
  }
  std::ifstream cases(argv[4]);
  for (std::string line; std::getline(cases, line);) {
    std::istringstream fields(line);
    std::string field, flag;
    std::getline(fields, flag, '\t');
    std::vector<customops::ChatMessage> messages;
    std::map<std::string, std::string> extra;
    while (std::getline(fields, field, '\t')) {
      const bool var = !field.empty() && field[0] == '@';
      const size_t colon = field.find(':');
      const std::string key = unhex(field.substr(var, colon - var)), value = unhex(field.substr(colon + 1));
      if (var) extra[key] = value;
      else messages.push_back({key, value});
    }
    try {
      const std::string prompt = chat->render(messages, flag == "G", extra);
      std::cout << "ok " << hex(prompt) << "\n";
    } catch (const std::invalid_argument& e) {
      std::cout << "error " << one_line(e.what()) << "\n";
    }
  }
  return 0;
}
