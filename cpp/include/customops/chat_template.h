// Chat prompts without Python (customops/chat_template.h): a Hugging Face chat template (the
// chat_template of a tokenizer_config.json, a Jinja2 template) rendered as transformers'
// tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...) renders it, in
// its Jinja2 environment (trim_blocks, lstrip_blocks, raise_exception, strftime_now, tojson).
// Exact for the templates of Llama-3.x, Mistral (7B v0.3, Nemo), Qwen2.5 and Qwen3 on conversations
// of plain-text turns; a template using Jinja it does not implement is refused, never approximated.
//
//   customops::ChatTemplate chat(config["chat_template"], "<|begin_of_text|>", "<|eot_id|>");
//   std::string prompt = chat.render({{"system", "Be brief."}, {"user", "Hi!"}}, true);
//   std::vector<int64_t> ids = tokenizer.encode(prompt);   // the template wrote bos itself
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "customops/macros.h"

namespace customops {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", or another role the template knows
  std::string content;
};

class CUSTOMOPS_API ChatTemplate {
 public:
  // Parses a template (the chat_template string of a tokenizer_config.json). bos_token/eos_token are
  // the template's variables of those names. Throws std::invalid_argument (one sentence naming the
  // construct and its line) for syntax it does not implement (macro, call, include, raw, break,
  // float literals, filters and tests outside its set...) and for malformed templates.
  ChatTemplate(const std::string& source, std::string bos_token, std::string eos_token);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // The prompt text, as transformers' apply_chat_template(messages, tokenize=False,
  // add_generation_prompt=..., **extra) renders it (tools and documents are none). extra holds
  // further template variables, such as Qwen3's enable_thinking: "true" and "false" are passed as
  // those booleans, anything else as a string. Throws std::invalid_argument where the template
  // raises (raise_exception("...") gives its message), for an empty conversation, and where
  // evaluation meets something it does not implement (a string method outside its set, printing a
  // list...).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                     const std::map<std::string, std::string>& extra = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace customops
