// customops::ChatTemplate (customops/chat_template.h): the subset of Jinja2 that Hugging Face chat
// templates use, lexed, parsed into a tree and evaluated as Jinja2 3.1 does in transformers'
// environment (trim_blocks, lstrip_blocks, no trailing newline, Python semantics for strings,
// integers, truthiness and undefined values). What it does not implement it refuses: at parse time
// for syntax, filters and tests, at render time for values (a float, a list printed as text).
#include "customops/chat_template.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <ctime>
#include <stdexcept>
#include <utility>

#include "generate/utf8.h"

namespace customops {
namespace {

[[noreturn]] void fail_at(int line, const std::string& what) {
  throw std::invalid_argument("chat template line " + std::to_string(line) + ": " + what);
}

// ---- UTF-8: Python's strings are code points, so lengths, slices and whitespace are counted in them.

size_t cp_size(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return i + n <= s.size() ? n : 1;
}

uint32_t cp_at(const std::string& s, size_t i) {
  const size_t n = cp_size(s, i);
  uint32_t c = static_cast<unsigned char>(s[i]);
  if (n == 1) return c;
  c &= 0x7f >> n;
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return c;
}

// Python's str.isspace(), which is also what str.strip(), str.split() and re's \s use.
bool is_space(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Byte offsets of the code points of s, and s.size() last.
std::vector<size_t> cp_offsets(const std::string& s) {
  std::vector<size_t> at;
  for (size_t i = 0; i < s.size(); i += cp_size(s, i)) at.push_back(i);
  at.push_back(s.size());
  return at;
}

// Python's str.strip/lstrip/rstrip: whitespace, or the code points of chars.
std::string strip(const std::string& s, const std::string* chars, bool left, bool right) {
  const std::vector<size_t> at = cp_offsets(s);
  auto strippable = [&](size_t k) {
    const uint32_t c = cp_at(s, at[k]);
    if (!chars) return is_space(c);
    for (size_t i = 0; i < chars->size(); i += cp_size(*chars, i))
      if (cp_at(*chars, i) == c) return true;
    return false;
  };
  size_t b = 0, e = at.size() - 1;
  while (left && b < e && strippable(b)) ++b;
  while (right && e > b && strippable(e - 1)) --e;
  return s.substr(at[b], at[e] - at[b]);
}

// ---- Values, as Python and Jinja2 see them.

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order, as Python's dict

struct Value {
  enum Kind { Undefined, None, Bool, Int, Str, ListK, DictK, Namespace, Func } kind = Undefined;
  int64_t i = 0;                 // Bool, Int
  std::string s;                 // Str; Func's name; Undefined's name, for errors
  std::shared_ptr<List> list;    // ListK
  std::shared_ptr<Dict> dict;    // DictK, Namespace (shared and mutable, as Python objects are)
  std::shared_ptr<Value> self;   // the object of a bound method

  static Value undefined(std::string name) { Value v; v.s = std::move(name); return v; }
  static Value none() { Value v; v.kind = None; return v; }
  static Value boolean(bool b) { Value v; v.kind = Bool; v.i = b; return v; }
  static Value integer(int64_t n) { Value v; v.kind = Int; v.i = n; return v; }
  static Value str(std::string text) { Value v; v.kind = Str; v.s = std::move(text); return v; }
  static Value of(List items) { Value v; v.kind = ListK; v.list = std::make_shared<List>(std::move(items)); return v; }
  static Value of(Dict items, Kind kind = DictK) {
    Value v;
    v.kind = kind;
    v.dict = std::make_shared<Dict>(std::move(items));
    return v;
  }
  static Value func(std::string name, const Value* self = nullptr) {
    Value v;
    v.kind = Func;
    v.s = std::move(name);
    if (self) v.self = std::make_shared<Value>(*self);
    return v;
  }
  bool number() const { return kind == Bool || kind == Int; }
};

const char* type_name(const Value& v) {
  static const char* names[] = {"undefined", "none", "bool", "int", "str", "list", "dict", "namespace", "function"};
  return names[v.kind];
}

const Value* find(const Dict& d, const std::string& key) {
  for (const auto& [k, v] : d)
    if (k == key) return &v;
  return nullptr;
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Undefined: case Value::None: return false;
    case Value::Bool: case Value::Int: return v.i != 0;
    case Value::Str: return !v.s.empty();
    case Value::ListK: return !v.list->empty();
    case Value::DictK: return !v.dict->empty();
    default: return true;
  }
}

// str(v), as Jinja2 prints values; Python's repr of containers is not implemented.
std::string text(const Value& v, int line) {
  switch (v.kind) {
    case Value::Undefined: return "";
    case Value::None: return "None";
    case Value::Bool: return v.i ? "True" : "False";
    case Value::Int: return std::to_string(v.i);
    case Value::Str: return v.s;
    default: fail_at(line, std::string("printing a ") + type_name(v) + " as text is not supported");
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.number() && b.number()) return a.i == b.i;
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Undefined: case Value::None: return true;
    case Value::Str: return a.s == b.s;
    case Value::ListK:
      return a.list->size() == b.list->size() && std::equal(a.list->begin(), a.list->end(), b.list->begin(), equal);
    case Value::DictK:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* w = find(*b.dict, k);
        if (!w || !equal(v, *w)) return false;
      }
      return true;
    case Value::Namespace: return a.dict == b.dict;
    default: return a.s == b.s && a.self == b.self;
  }
}

// Python's ordering: -1, 0 or 1 (UTF-8 byte order is code point order).
int order(const Value& a, const Value& b, int line) {
  if (a.number() && b.number()) return (a.i > b.i) - (a.i < b.i);
  if (a.kind == Value::Str && b.kind == Value::Str) return a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
  if (a.kind == Value::ListK && b.kind == Value::ListK) {
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k)
      if (!equal((*a.list)[k], (*b.list)[k])) return order((*a.list)[k], (*b.list)[k], line);
    return (a.list->size() > b.list->size()) - (a.list->size() < b.list->size());
  }
  fail_at(line, std::string("cannot order a ") + type_name(a) + " and a " + type_name(b));
}

// Python's slice of n items: the indices taken.
std::vector<int64_t> slice_indices(int64_t n, const Value& start, const Value& stop, const Value& step, int line) {
  auto given = [&](const Value& v) {
    if (v.kind == Value::Undefined || v.kind == Value::None) return false;
    if (!v.number()) fail_at(line, std::string("a slice index must be an integer, not a ") + type_name(v));
    return true;
  };
  const int64_t st = given(step) ? step.i : 1;
  if (st == 0) fail_at(line, "a slice step cannot be zero");
  auto adjust = [&](const Value& v, int64_t dflt) {
    if (!given(v)) return dflt;
    int64_t x = v.i;
    if (x < 0) x = std::max<int64_t>(x + n, st < 0 ? -1 : 0);
    return std::min<int64_t>(x, st < 0 ? n - 1 : n);
  };
  const int64_t b = adjust(start, st < 0 ? n - 1 : 0), e = adjust(stop, st < 0 ? -1 : n);
  std::vector<int64_t> out;
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) out.push_back(k);
  return out;
}

// The items a for loop (or list, join...) goes through: a list's, a string's characters, a dict's keys.
List iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::Undefined: return {};
    case Value::ListK: return *v.list;
    case Value::Str: {
      List out;
      for (size_t i = 0; i < v.s.size(); i += cp_size(v.s, i)) out.push_back(Value::str(v.s.substr(i, cp_size(v.s, i))));
      return out;
    }
    case Value::DictK: {
      List out;
      for (const auto& kv : *v.dict) out.push_back(Value::str(kv.first));
      return out;
    }
    default: fail_at(line, std::string("a ") + type_name(v) + " is not iterable");
  }
}

// json.dumps(v, ensure_ascii=False, indent=indent), transformers' tojson.
void to_json(const Value& v, int indent, int depth, std::string& out, int line) {
  auto newline = [&](int d) {
    if (indent >= 0) out += '\n' + std::string(static_cast<size_t>(indent * d), ' ');
  };
  auto quote = [&](const std::string& s) {
    static const char* hex = "0123456789abcdef";
    out += '"';
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c == '"' || c == '\\') out += std::string("\\") + ch;
      else if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out += "\\t";
      else if (c == '\b') out += "\\b";
      else if (c == '\f') out += "\\f";
      else if (c < 0x20) out += std::string("\\u00") + hex[c >> 4] + hex[c & 15];
      else out += ch;
    }
    out += '"';
  };
  switch (v.kind) {
    case Value::None: out += "null"; return;
    case Value::Bool: out += v.i ? "true" : "false"; return;
    case Value::Int: out += std::to_string(v.i); return;
    case Value::Str: quote(v.s); return;
    case Value::ListK: case Value::DictK: {
      const bool is_list = v.kind == Value::ListK;
      const size_t n = is_list ? v.list->size() : v.dict->size();
      out += is_list ? '[' : '{';
      for (size_t k = 0; k < n; ++k) {
        out += k ? (indent >= 0 ? "," : ", ") : "";
        newline(depth + 1);
        if (!is_list) {
          quote((*v.dict)[k].first);
          out += ": ";
        }
        to_json(is_list ? (*v.list)[k] : (*v.dict)[k].second, indent, depth + 1, out, line);
      }
      if (n) newline(depth);
      out += is_list ? ']' : '}';
      return;
    }
    default: fail_at(line, std::string("a ") + type_name(v) + " is not JSON serializable");
  }
}

// ---- Lexer: Jinja2's, with transformers' trim_blocks and lstrip_blocks.

struct Token {
  enum Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, Int, Str, Op, Eof } type;
  std::string v;
  int line;
};

size_t space_at(const std::string& s, size_t i) {
  return i < s.size() && is_space(cp_at(s, i)) ? cp_size(s, i) : 0;
}

bool all_space(const std::string& s, size_t from) {
  for (size_t n; from < s.size(); from += n)
    if (!(n = space_at(s, from))) return false;
  return true;
}

// A string literal's value: Jinja2 decodes Python's escapes (\n, \t, \xhh, \uhhhh...), keeps unknown ones.
std::string unescape(const std::string& body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char c = body[++i];
    static const std::string simple = "\\'\"abfnrtv", plain = "\\'\"\a\b\f\n\r\t\v";
    if (simple.find(c) != std::string::npos) {
      out += plain[simple.find(c)];
    } else if (c == '\n') {
    } else if (c >= '0' && c <= '7') {
      uint32_t code = 0;
      for (int k = 0; k < 3 && i < body.size() && body[i] >= '0' && body[i] <= '7'; ++k) code = code * 8 + (body[i++] - '0');
      --i;
      out += utf8_of(code);
    } else if (c == 'x' || c == 'u' || c == 'U') {
      const size_t n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
      const std::string digits = body.substr(i + 1, n);
      if (digits.size() != n || digits.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
        fail_at(line, std::string("malformed \\") + c + " escape in a string literal");
      const auto code = static_cast<uint32_t>(std::stoul(digits, nullptr, 16));
      if (code > 0x10ffff || (code >= 0xd800 && code < 0xe000)) fail_at(line, "a string literal escapes an invalid code point");
      out += utf8_of(code);
      i += n;
    } else if (c == 'N') {
      fail_at(line, "\\N{...} escapes in string literals are not supported");
    } else {
      out += '\\';
      out += c;
    }
  }
  return out;
}

std::vector<Token> lex(std::string src) {
  // Jinja2 reads \r\n and \r as \n and drops one trailing newline (keep_trailing_newline=False).
  std::string s;
  for (size_t i = 0; i < src.size(); ++i) {
    s += src[i] == '\r' ? '\n' : src[i];
    if (src[i] == '\r' && i + 1 < src.size() && src[i + 1] == '\n') ++i;
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();

  std::vector<Token> out;
  int line = 1;
  bool line_starting = true;  // whether the last match ended with a newline (lstrip_blocks's condition)
  size_t pos = 0;
  auto count_lines = [&](size_t from, size_t to) { line += static_cast<int>(std::count(s.begin() + from, s.begin() + to, '\n')); };
  while (pos < s.size()) {
    size_t t = pos;
    while ((t = s.find('{', t)) != std::string::npos && (t + 1 >= s.size() || std::string("{%#").find(s[t + 1]) == std::string::npos)) ++t;
    std::string data = s.substr(pos, t == std::string::npos ? std::string::npos : t - pos);
    if (t == std::string::npos) {
      out.push_back({Token::Text, data, line});
      break;
    }
    const char kind = s[t + 1];
    const char sign = t + 2 < s.size() && (s[t + 2] == '-' || s[t + 2] == '+') ? s[t + 2] : 0;
    if (sign == '-') {
      data = strip(data, nullptr, false, true);
    } else if (sign != '+' && kind != '{') {
      const size_t l_pos = data.rfind('\n') + 1;  // npos + 1 == 0
      if ((l_pos > 0 || line_starting) && l_pos < data.size() && all_space(data, l_pos)) data.resize(l_pos);
    }
    if (!data.empty()) out.push_back({Token::Text, data, line});
    count_lines(pos, t);
    pos = t + 2 + (sign ? 1 : 0);
    const int tag_line = line;

    if (kind == '#') {
      size_t p = pos, end = std::string::npos;
      for (; p < s.size() && end == std::string::npos; ++p) {
        if ((s[p] == '+' || s[p] == '-') && s.compare(p + 1, 2, "#}") == 0) {
          end = p + 3;
          if (s[p] == '-')
            while (size_t n = space_at(s, end)) end += n;
        } else if (s.compare(p, 2, "#}") == 0) {
          end = p + 2 + (p + 2 < s.size() && s[p + 2] == '\n');
        }
      }
      if (end == std::string::npos) fail_at(tag_line, "a comment is not closed");
      count_lines(pos, end);
      line_starting = s[end - 1] == '\n';
      pos = end;
      continue;
    }

    const bool block = kind == '%';
    out.push_back({block ? Token::BlockBegin : Token::VarBegin, "", line});
    std::vector<char> brackets;
    for (;;) {
      if (pos >= s.size()) fail_at(tag_line, std::string("a '{") + kind + "' tag is not closed");
      if (brackets.empty()) {
        size_t end = std::string::npos;
        const char* close = block ? "%}" : "}}";
        if (block && s[pos] == '+' && s.compare(pos + 1, 2, close) == 0) {
          end = pos + 3;
        } else if (s[pos] == '-' && s.compare(pos + 1, 2, close) == 0) {
          end = pos + 3;
          while (size_t n = space_at(s, end)) end += n;
        } else if (s.compare(pos, 2, close) == 0) {
          end = pos + 2 + (block && pos + 2 < s.size() && s[pos + 2] == '\n');
        }
        if (end != std::string::npos) {
          out.push_back({block ? Token::BlockEnd : Token::VarEnd, "", line});
          count_lines(pos, end);
          line_starting = s[end - 1] == '\n';
          pos = end;
          break;
        }
      }
      const char c = s[pos];
      if (size_t n = space_at(s, pos)) {
        count_lines(pos, pos + n);
        pos += n;
      } else if (isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos;
        while (e < s.size() && (isdigit(static_cast<unsigned char>(s[e])) || (s[e] == '_' && e + 1 < s.size() && isdigit(static_cast<unsigned char>(s[e + 1]))))) ++e;
        if (e < s.size() && (s[e] == 'e' || s[e] == 'E' || (s[e] == '.' && e + 1 < s.size() && isdigit(static_cast<unsigned char>(s[e + 1])))))
          fail_at(line, "float literals are not supported");
        std::string digits = s.substr(pos, e - pos);
        if ((c == '0' && digits.find_first_not_of("0_") != std::string::npos) || (e < s.size() && isalpha(static_cast<unsigned char>(s[e]))))
          fail_at(line, "integer literal " + s.substr(pos, e - pos + 1) + "... is not supported");  // Jinja2's 0x, 0o, 0b, 01
        digits.erase(std::remove(digits.begin(), digits.end(), '_'), digits.end());
        if (digits.size() > 18) fail_at(line, "integer literal " + digits + " is too large");
        out.push_back({Token::Int, digits, line});
        pos = e;
      } else if (isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos;
        while (e < s.size() && (isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
        out.push_back({Token::Name, s.substr(pos, e - pos), line});
        pos = e;
      } else if (c == '\'' || c == '"') {
        size_t e = pos + 1;
        while (e < s.size() && s[e] != c) e += s[e] == '\\' ? 2 : 1;
        if (e >= s.size()) fail_at(line, "a string literal is not closed");
        out.push_back({Token::Str, unescape(s.substr(pos + 1, e - pos - 1), line), line});
        count_lines(pos, e);
        pos = e + 1;
      } else {
        static const char* two[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* o : two)
          if (s.compare(pos, 2, o) == 0) op = o;
        if (op.size() == 1 && std::string("+-/*%~[](){}<>=.:|,;").find(c) == std::string::npos)
          fail_at(line, std::string("unexpected character '") + c + "' in a tag");
        if (c == '(' || c == '[' || c == '{') {
          brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
        } else if (c == ')' || c == ']' || c == '}') {
          if (brackets.empty() || brackets.back() != c) fail_at(line, std::string("unexpected '") + c + "'");
          brackets.pop_back();
        }
        out.push_back({Token::Op, op, line});
        pos += op.size();
      }
    }
  }
  out.push_back({Token::Eof, "", line});
  return out;
}

// ---- Syntax tree.

struct Expr;
using ExprP = std::unique_ptr<Expr>;
struct Expr {
  enum Kind { Const, Name, Attr, Item, Slice, Call, Filter, Test, Not, Neg, Binary, And, Or, Compare, Cond, ListLit, DictLit, Concat };
  Kind kind;
  int line;
  Value value;                // Const
  std::string name;           // Name, Attr, Filter, Test, Neg's and Binary's operator
  std::vector<ExprP> args;    // operands; Slice: object, start, stop, step; Call: callee first; Cond: then, if, else
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // Compare's operators
  bool negated = false;          // Test: "is not"
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;
struct Stmt {
  enum Kind { Text, Output, If, For, Set } kind;
  int line;
  std::string text;
  ExprP expr;                          // Output's value, For's iterable, Set's value
  ExprP filter;                        // For's "if"
  std::vector<std::string> targets;    // For's loop variables; Set: a name, or a namespace and its attribute
  std::vector<std::pair<ExprP, Body>> branches;  // If: conditions and bodies, a null condition for else
  Body body, else_body;                // For
};

const std::vector<std::string> kFilters = {"trim", "length", "count", "string", "first", "last", "default", "d",
                                           "tojson", "items", "join", "list", "selectattr", "rejectattr", "select",
                                           "reject", "map", "upper", "lower", "replace"};
const std::vector<std::string> kTests = {"defined", "undefined", "none", "boolean", "true", "false", "integer",
                                         "number", "string", "mapping", "iterable", "sequence", "callable",
                                         "equalto", "eq", "==", "ne", "!=", "lt", "<", "le", "<=", "gt", ">",
                                         "ge", ">=", "in", "odd", "even", "divisibleby"};
const std::vector<std::string> kFunctions = {"raise_exception", "strftime_now", "namespace", "range"};
bool known(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body parse_template() {
    std::string end;
    return parse_body({}, end);
  }

 private:
  std::vector<Token> t_;
  size_t p_ = 0;

  const Token& cur() const { return t_[p_]; }
  bool is_op(const char* op) const { return cur().type == Token::Op && cur().v == op; }
  bool is_name(const char* name) const { return cur().type == Token::Name && cur().v == name; }
  [[noreturn]] void unexpected(const std::string& wanted) const {
    const Token& k = cur();
    const std::string got = k.type == Token::Eof ? "the end of the template"
                            : k.type == Token::BlockEnd ? "'%}'" : k.type == Token::VarEnd ? "'}}'"
                            : "'" + k.v + "'";
    fail_at(k.line, "expected " + wanted + " but found " + got);
  }
  void expect_op(const char* op) {
    if (!is_op(op)) unexpected(std::string("'") + op + "'");
    ++p_;
  }
  std::string expect_name() {
    if (cur().type != Token::Name) unexpected("a name");
    return t_[p_++].v;
  }
  void expect(Token::Type type, const char* what) {
    if (cur().type != type) unexpected(what);
    ++p_;
  }
  static ExprP node(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // Statements until one of ends' tags (whose name is returned in end, the tag's name consumed).
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
    Body body;
    for (;;) {
      const Token& k = cur();
      if (k.type == Token::Eof) {
        if (!ends.empty()) fail_at(k.line, "the template ends inside a block: '{% " + ends.back() + " %}' is missing");
        return body;
      }
      if (k.type == Token::Text) {
        auto st = std::make_unique<Stmt>();
        st->kind = Stmt::Text;
        st->line = k.line;
        st->text = k.v;
        body.push_back(std::move(st));
        ++p_;
      } else if (k.type == Token::VarBegin) {
        ++p_;
        auto st = std::make_unique<Stmt>();
        st->kind = Stmt::Output;
        st->line = k.line;
        st->expr = parse_tuple(true);
        expect(Token::VarEnd, "'}}'");
        body.push_back(std::move(st));
      } else {
        ++p_;
        if (cur().type != Token::Name) unexpected("a tag name");
        const std::string tag = cur().v;
        if (known(ends, tag)) {
          ++p_;
          end = tag;
          return body;
        }
        body.push_back(parse_statement());
      }
    }
  }

  std::unique_ptr<Stmt> parse_statement() {
    const int line = cur().line;
    const std::string tag = t_[p_++].v;
    auto st = std::make_unique<Stmt>();
    st->line = line;
    std::string end;
    if (tag == "if") {
      st->kind = Stmt::If;
      ExprP cond = parse_tuple(false);
      for (;;) {
        expect(Token::BlockEnd, "'%}'");
        Body b = parse_body({"elif", "else", "endif"}, end);
        st->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "endif") break;
        if (end == "else") {
          expect(Token::BlockEnd, "'%}'");
          st->branches.emplace_back(nullptr, parse_body({"endif"}, end));
          break;
        }
        cond = parse_tuple(false);
      }
    } else if (tag == "for") {
      st->kind = Stmt::For;
      do st->targets.push_back(expect_name());
      while (is_op(",") && ++p_);
      if (!is_name("in")) unexpected("'in'");
      ++p_;
      st->expr = parse_tuple(false);
      if (is_name("if")) {
        ++p_;
        st->filter = parse_tuple(true);
      }
      if (is_name("recursive")) fail_at(line, "recursive for loops are not supported");
      expect(Token::BlockEnd, "'%}'");
      st->body = parse_body({"else", "endfor"}, end);
      if (end == "else") {
        expect(Token::BlockEnd, "'%}'");
        st->else_body = parse_body({"endfor"}, end);
      }
    } else if (tag == "set") {
      st->kind = Stmt::Set;
      st->targets.push_back(expect_name());
      if (is_op(".")) {
        ++p_;
        st->targets.push_back(expect_name());
      }
      if (is_op(",")) fail_at(line, "'{% set %}' of several names is not supported");
      if (!is_op("=")) fail_at(line, "'{% set %}' blocks (without '=') are not supported");
      ++p_;
      st->expr = parse_tuple(true);
    } else if (tag == "generation") {
      // transformers' tag marking the assistant's text: it renders its body as it is.
      expect(Token::BlockEnd, "'%}'");
      st->kind = Stmt::If;
      st->branches.emplace_back(nullptr, parse_body({"endgeneration"}, end));
    } else if (tag.compare(0, 3, "end") == 0 || tag == "elif" || tag == "else") {
      fail_at(line, "'{% " + tag + " %}' has no block to end or continue");
    } else {
      fail_at(line, "'{% " + tag + " %}' is not supported");
    }
    expect(Token::BlockEnd, "'%}'");
    return st;
  }

  // An expression; a comma (a tuple) is refused.
  ExprP parse_tuple(bool condexpr) {
    ExprP e = condexpr ? parse_condexpr() : parse_or();
    if (is_op(",")) fail_at(cur().line, "tuples are not supported");
    return e;
  }

  ExprP parse_condexpr() {
    ExprP e = parse_or();
    while (is_name("if")) {
      auto c = node(Expr::Cond, cur().line);
      ++p_;
      ExprP cond = parse_or();
      ExprP other;
      if (is_name("else")) {
        ++p_;
        other = parse_condexpr();
      }
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprP binary(Expr::Kind kind, const char* name, ExprP left, ExprP right, int line) {
    auto e = node(kind, line);
    e->name = name;
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      const int line = t_[p_++].line;
      e = binary(Expr::Or, "or", std::move(e), parse_and(), line);
    }
    return e;
  }

  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      const int line = t_[p_++].line;
      e = binary(Expr::And, "and", std::move(e), parse_not(), line);
    }
    return e;
  }

  ExprP parse_not() {
    if (!is_name("not")) return parse_compare();
    auto e = node(Expr::Not, t_[p_++].line);
    e->args.push_back(parse_not());
    return e;
  }

  ExprP parse_compare() {
    ExprP first = parse_math1();
    auto e = node(Expr::Compare, cur().line);
    for (;;) {
      static const std::vector<std::string> ops = {"==", "!=", "<", "<=", ">", ">="};
      if (cur().type == Token::Op && known(ops, cur().v)) {
        e->ops.push_back(t_[p_++].v);
      } else if (is_name("in")) {
        ++p_;
        e->ops.push_back("in");
      } else if (is_name("not") && t_[p_ + 1].type == Token::Name && t_[p_ + 1].v == "in") {
        p_ += 2;
        e->ops.push_back("not in");
      } else {
        break;
      }
      e->args.push_back(parse_math1());
    }
    if (e->ops.empty()) return first;
    e->args.insert(e->args.begin(), std::move(first));
    return e;
  }

  ExprP parse_math1() {
    ExprP e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& k = t_[p_++];
      e = binary(Expr::Binary, k.v == "+" ? "+" : "-", std::move(e), parse_concat(), k.line);
    }
    return e;
  }

  ExprP parse_concat() {
    ExprP e = parse_math2();
    if (!is_op("~")) return e;
    auto c = node(Expr::Concat, cur().line);
    c->args.push_back(std::move(e));
    while (is_op("~")) {
      ++p_;
      c->args.push_back(parse_math2());
    }
    return c;
  }

  ExprP parse_math2() {
    ExprP e = parse_unary(true);
    for (;;) {
      if (is_op("/") || is_op("**")) fail_at(cur().line, "the operator '" + cur().v + "' is not supported");
      if (!is_op("*") && !is_op("//") && !is_op("%")) return e;
      const Token& k = t_[p_++];
      const char* op = k.v == "*" ? "*" : k.v == "//" ? "//" : "%";
      e = binary(Expr::Binary, op, std::move(e), parse_unary(true), k.line);
    }
  }

  ExprP parse_unary(bool with_filter) {
    ExprP e;
    if (is_op("-") || is_op("+")) {
      const Token& k = t_[p_++];
      e = node(Expr::Neg, k.line);
      e->name = k.v;
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    return with_filter ? parse_filters(std::move(e)) : std::move(e);
  }

  ExprP parse_primary() {
    const Token& k = cur();
    if (k.type == Token::Name) {
      ++p_;
      if (k.v == "true" || k.v == "True" || k.v == "false" || k.v == "False") {
        auto e = node(Expr::Const, k.line);
        e->value = Value::boolean(k.v[0] == 't' || k.v[0] == 'T');
        return e;
      }
      if (k.v == "none" || k.v == "None") {
        auto e = node(Expr::Const, k.line);
        e->value = Value::none();
        return e;
      }
      if (k.v == "dict" || k.v == "lipsum" || k.v == "cycler" || k.v == "joiner")
        fail_at(k.line, "the Jinja function '" + k.v + "' is not supported");
      auto e = node(Expr::Name, k.line);
      e->name = k.v;
      return e;
    }
    if (k.type == Token::Str) {
      auto e = node(Expr::Const, k.line);
      std::string joined;
      while (cur().type == Token::Str) joined += t_[p_++].v;  // adjacent literals join, as in Python
      e->value = Value::str(joined);
      return e;
    }
    if (k.type == Token::Int) {
      auto e = node(Expr::Const, k.line);
      e->value = Value::integer(std::stoll(k.v));
      ++p_;
      return e;
    }
    if (is_op("(")) {
      ++p_;
      if (is_op(")")) fail_at(k.line, "tuples are not supported");
      ExprP e = parse_tuple(true);
      expect_op(")");
      return e;
    }
    if (is_op("[") || is_op("{")) {
      const bool list = is_op("[");
      auto e = node(list ? Expr::ListLit : Expr::DictLit, k.line);
      ++p_;
      while (!is_op(list ? "]" : "}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op(list ? "]" : "}")) break;
        e->args.push_back(parse_condexpr());
        if (!list) {
          expect_op(":");
          e->args.push_back(parse_condexpr());
        }
      }
      ++p_;
      return e;
    }
    unexpected("an expression");
  }

  ExprP parse_postfix(ExprP e) {
    for (;;) {
      const int line = cur().line;
      if (is_op(".")) {
        ++p_;
        if (cur().type == Token::Int) {
          auto item = node(Expr::Item, line);
          auto index = node(Expr::Const, line);
          index->value = Value::integer(std::stoll(t_[p_++].v));
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(index));
          e = std::move(item);
        } else {
          auto attr = node(Expr::Attr, line);
          attr->name = expect_name();
          attr->args.push_back(std::move(e));
          e = std::move(attr);
        }
      } else if (is_op("[")) {
        ++p_;
        e = parse_subscript(std::move(e), line);
        expect_op("]");
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_subscript(ExprP obj, int line) {
    ExprP parts[3];
    if (!is_op(":")) {
      parts[0] = parse_condexpr();
      if (!is_op(":")) {
        if (is_op(",")) fail_at(line, "tuples are not supported");
        auto item = node(Expr::Item, line);
        item->args.push_back(std::move(obj));
        item->args.push_back(std::move(parts[0]));
        return item;
      }
    }
    ++p_;  // the first ':'
    if (!is_op(":") && !is_op("]")) parts[1] = parse_condexpr();
    if (is_op(":")) {
      ++p_;
      if (!is_op("]")) parts[2] = parse_condexpr();
    }
    auto slice = node(Expr::Slice, line);
    slice->args.push_back(std::move(obj));
    for (auto& part : parts) slice->args.push_back(std::move(part));
    return slice;
  }

  // (args, name=kwargs), appended to e's.
  void parse_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (!e.args.empty() && e.args.size() + e.kwargs.size() > 1) expect_op(",");
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail_at(cur().line, "'*' and '**' arguments are not supported");
      if (cur().type == Token::Name && t_[p_ + 1].type == Token::Op && t_[p_ + 1].v == "=") {
        const std::string name = t_[p_].v;
        p_ += 2;
        e.kwargs.emplace_back(name, parse_condexpr());
      } else {
        if (!e.kwargs.empty()) fail_at(cur().line, "a positional argument follows a keyword argument");
        e.args.push_back(parse_condexpr());
      }
    }
    ++p_;
  }

  ExprP parse_call(ExprP callee) {
    auto call = node(Expr::Call, cur().line);
    call->args.push_back(std::move(callee));
    parse_args(*call);
    return call;
  }

  ExprP parse_filters(ExprP e) {
    for (;;) {
      const int line = cur().line;
      if (is_op("|")) {
        ++p_;
        auto f = node(Expr::Filter, line);
        f->name = expect_name();
        if (is_op(".") || !known(kFilters, f->name)) fail_at(line, "the filter '" + f->name + "' is not supported");
        f->args.push_back(std::move(e));
        if (is_op("(")) parse_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        ++p_;
        auto t = node(Expr::Test, line);
        if (is_name("not")) {
          ++p_;
          t->negated = true;
        }
        t->name = expect_name();
        if (!known(kTests, t->name)) fail_at(line, "the test '" + t->name + "' is not supported");
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          parse_args(*t);
        } else if ((cur().type == Token::Name && !is_name("else") && !is_name("or") && !is_name("and")) ||
                   cur().type == Token::Str || cur().type == Token::Int || is_op("[") || is_op("{")) {
          if (is_name("is")) fail_at(line, "tests cannot be chained with 'is'");
          t->args.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }
};

// ---- Evaluation.

class Renderer {
 public:
  std::string prompt;
  std::vector<std::map<std::string, Value>> scopes;  // innermost last; the first holds the template's variables

  void run(const Body& body) {
    for (const auto& st : body) exec(*st);
  }

 private:
  void exec(const Stmt& st) {
    switch (st.kind) {
      case Stmt::Text: prompt += st.text; return;
      case Stmt::Output: prompt += text(eval(*st.expr), st.line); return;
      case Stmt::If:
        for (const auto& [cond, body] : st.branches)
          if (!cond || truthy(eval(*cond))) return run(body);
        return;
      case Stmt::Set: {
        Value v = eval(*st.expr);
        if (st.targets.size() == 1) {
          scopes.back()[st.targets[0]] = std::move(v);
          return;
        }
        const Value ns = lookup(st.targets[0]);
        if (ns.kind != Value::Namespace) fail_at(st.line, "cannot set an attribute of a " + std::string(type_name(ns)) + ", only of a namespace()");
        for (auto& kv : *ns.dict)
          if (kv.first == st.targets[1]) return void(kv.second = std::move(v));
        ns.dict->emplace_back(st.targets[1], std::move(v));
        return;
      }
      case Stmt::For: return exec_for(st);
    }
  }

  // Each iteration runs in a fresh scope, as Jinja2's loop bodies do: what it sets is gone after.
  void exec_for(const Stmt& st) {
    const List all = iterate(eval(*st.expr), st.line);
    List items;
    for (const Value& item : all) {
      scopes.emplace_back();
      bind(st, item);
      const bool keep = !st.filter || truthy(eval(*st.filter));
      scopes.pop_back();
      if (keep) items.push_back(item);
    }
    if (items.empty()) {
      scopes.emplace_back();
      run(st.else_body);
      scopes.pop_back();
      return;
    }
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      scopes.emplace_back();
      bind(st, items[k]);
      Dict loop = {{"index0", Value::integer(k)}, {"index", Value::integer(k + 1)},
                   {"revindex0", Value::integer(n - k - 1)}, {"revindex", Value::integer(n - k)},
                   {"first", Value::boolean(k == 0)}, {"last", Value::boolean(k == n - 1)},
                   {"length", Value::integer(n)}};
      if (k > 0) loop.emplace_back("previtem", items[k - 1]);
      if (k < n - 1) loop.emplace_back("nextitem", items[k + 1]);
      scopes.back()["loop"] = Value::of(std::move(loop));
      run(st.body);
      scopes.pop_back();
    }
  }

  void bind(const Stmt& st, const Value& item) {
    if (st.targets.size() == 1) {
      scopes.back()[st.targets[0]] = item;
      return;
    }
    if (item.kind != Value::ListK || item.list->size() != st.targets.size())
      fail_at(st.line, "cannot unpack a " + std::string(type_name(item)) + " into " + std::to_string(st.targets.size()) + " loop variables");
    for (size_t k = 0; k < st.targets.size(); ++k) scopes.back()[st.targets[k]] = (*item.list)[k];
  }

  Value lookup(const std::string& name) const {
    for (auto s = scopes.rbegin(); s != scopes.rend(); ++s) {
      auto it = s->find(name);
      if (it != s->end()) return it->second;
    }
    if (known(kFunctions, name)) return Value::func(name);
    return Value::undefined("'" + name + "' is undefined");
  }

  static void check_defined(const Value& v, int line) {
    if (v.kind == Value::Undefined) fail_at(line, v.s);
  }

  static Value attribute(const Value& obj, const std::string& name, int line) {
    check_defined(obj, line);
    static const std::vector<std::string> str_methods = {"startswith", "endswith", "split", "strip", "lstrip",
                                                         "rstrip", "replace", "upper", "lower"};
    static const std::vector<std::string> dict_methods = {"items", "keys", "values", "get"};
    switch (obj.kind) {
      case Value::Str:
        if (!known(str_methods, name)) fail_at(line, "the string attribute '" + name + "' is not supported");
        return Value::func("str." + name, &obj);
      case Value::DictK:
        if (known(dict_methods, name)) return Value::func("dict." + name, &obj);
        [[fallthrough]];
      case Value::Namespace:
        if (const Value* v = find(*obj.dict, name)) return *v;
        return Value::undefined("'" + std::string(type_name(obj)) + " object' has no attribute '" + name + "'");
      case Value::None:
        return Value::undefined("'NoneType object' has no attribute '" + name + "'");
      default:
        fail_at(line, "the attribute '" + name + "' of a " + type_name(obj) + " is not supported");
    }
  }

  static Value item(const Value& obj, const Value& key, int line) {
    check_defined(obj, line);
    if (key.number() && (obj.kind == Value::ListK || obj.kind == Value::Str)) {
      const std::vector<size_t> at = obj.kind == Value::Str ? cp_offsets(obj.s) : std::vector<size_t>();
      const int64_t n = obj.kind == Value::Str ? static_cast<int64_t>(at.size()) - 1 : static_cast<int64_t>(obj.list->size());
      const int64_t k = key.i < 0 ? key.i + n : key.i;
      if (k < 0 || k >= n) return Value::undefined("index " + std::to_string(key.i) + " is out of range");
      if (obj.kind == Value::ListK) return (*obj.list)[k];
      return Value::str(obj.s.substr(at[k], at[k + 1] - at[k]));
    }
    if (key.kind == Value::Str && (obj.kind == Value::DictK || obj.kind == Value::Namespace)) {
      if (const Value* v = find(*obj.dict, key.s)) return *v;
      return attribute(obj, key.s, line);
    }
    return Value::undefined("a " + std::string(type_name(obj)) + " has no such item");
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Const: return e.value;
      case Expr::Name: return lookup(e.name);
      case Expr::Attr: return attribute(eval(*e.args[0]), e.name, e.line);
      case Expr::Item: {
        const Value obj = eval(*e.args[0]);
        return item(obj, eval(*e.args[1]), e.line);
      }
      case Expr::Slice: {
        const Value obj = eval(*e.args[0]);
        Value part[3];
        for (int k = 0; k < 3; ++k)
          if (e.args[k + 1]) part[k] = eval(*e.args[k + 1]);
        check_defined(obj, e.line);
        if (obj.kind == Value::ListK) {
          List out;
          for (int64_t k : slice_indices(static_cast<int64_t>(obj.list->size()), part[0], part[1], part[2], e.line)) out.push_back((*obj.list)[k]);
          return Value::of(std::move(out));
        }
        if (obj.kind == Value::Str) {
          const std::vector<size_t> at = cp_offsets(obj.s);
          std::string out;
          for (int64_t k : slice_indices(static_cast<int64_t>(at.size()) - 1, part[0], part[1], part[2], e.line)) out += obj.s.substr(at[k], at[k + 1] - at[k]);
          return Value::str(out);
        }
        fail_at(e.line, std::string("a ") + type_name(obj) + " cannot be sliced");
      }
      case Expr::Call: return call(e);
      case Expr::Filter: return filter(e);
      case Expr::Test: {
        const bool r = test(e.name, eval(*e.args[0]), args_of(e, 1), e.line);
        return Value::boolean(r != e.negated);
      }
      case Expr::Not: return Value::boolean(!truthy(eval(*e.args[0])));
      case Expr::Neg: {
        const Value v = eval(*e.args[0]);
        check_defined(v, e.line);
        if (!v.number() || v.i == INT64_MIN) fail_at(e.line, "unary " + e.name + " of a " + type_name(v) + " is not supported");
        return Value::integer(e.name == "-" ? -v.i : v.i);
      }
      case Expr::And: {
        Value l = eval(*e.args[0]);
        return truthy(l) ? eval(*e.args[1]) : l;
      }
      case Expr::Or: {
        Value l = eval(*e.args[0]);
        return truthy(l) ? l : eval(*e.args[1]);
      }
      case Expr::Binary: {
        const Value l = eval(*e.args[0]);
        return arith(e.name, l, eval(*e.args[1]), e.line);
      }
      case Expr::Concat: {
        std::string s;
        for (const auto& a : e.args) s += text(eval(*a), e.line);
        return Value::str(s);
      }
      case Expr::Compare: {
        Value l = eval(*e.args[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value r = eval(*e.args[k + 1]);
          if (!compare(e.ops[k], l, r, e.line)) return Value::boolean(false);
          l = std::move(r);
        }
        return Value::boolean(true);
      }
      case Expr::Cond:
        if (truthy(eval(*e.args[1]))) return eval(*e.args[0]);
        return e.args[2] ? eval(*e.args[2]) : Value::undefined("the inline if's condition was false and it has no else");
      case Expr::ListLit: return Value::of(args_of(e, 0));
      case Expr::DictLit: {
        Dict d;
        for (size_t k = 0; k < e.args.size(); k += 2) {
          const Value key = eval(*e.args[k]);
          if (key.kind != Value::Str) fail_at(e.line, "dict keys other than strings are not supported");
          Value v = eval(*e.args[k + 1]);
          auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == key.s; });
          if (it != d.end()) it->second = std::move(v);
          else d.emplace_back(key.s, std::move(v));
        }
        return Value::of(std::move(d));
      }
    }
    fail_at(e.line, "unknown expression");
  }

  List args_of(const Expr& e, size_t from) {
    List out;
    for (size_t k = from; k < e.args.size(); ++k) out.push_back(eval(*e.args[k]));
    return out;
  }

  static Value arith(const std::string& op, const Value& l, const Value& r, int line) {
    check_defined(l, line);
    check_defined(r, line);
    int64_t v = 0;
    if (l.number() && r.number()) {
      if (op == "+" && !__builtin_add_overflow(l.i, r.i, &v)) return Value::integer(v);
      if (op == "-" && !__builtin_sub_overflow(l.i, r.i, &v)) return Value::integer(v);
      if (op == "*" && !__builtin_mul_overflow(l.i, r.i, &v)) return Value::integer(v);
      if (op == "//" || op == "%") {
        if (r.i == 0) fail_at(line, "integer division or modulo by zero");
        if (l.i == INT64_MIN && r.i == -1) fail_at(line, "integer overflow");
        int64_t q = l.i / r.i, m = l.i % r.i;
        if (m != 0 && ((m < 0) != (r.i < 0))) --q, m += r.i;  // Python floors
        return Value::integer(op == "//" ? q : m);
      }
      fail_at(line, "integer overflow");
    }
    if (op == "+" && l.kind == Value::Str && r.kind == Value::Str) return Value::str(l.s + r.s);
    if (op == "+" && l.kind == Value::ListK && r.kind == Value::ListK) {
      List out = *l.list;
      out.insert(out.end(), r.list->begin(), r.list->end());
      return Value::of(std::move(out));
    }
    if (op == "*" && l.kind == Value::Str && r.number()) {
      std::string out;
      for (int64_t k = 0; k < r.i && out.size() < (1u << 24); ++k) out += l.s;
      return Value::str(out);
    }
    fail_at(line, "'" + op + "' of a " + type_name(l) + " and a " + type_name(r) + " is not supported");
  }

  static bool contains(const Value& container, const Value& x, int line) {
    switch (container.kind) {
      case Value::Undefined: return false;
      case Value::Str:
        if (x.kind != Value::Str) fail_at(line, std::string("'in <string>' needs a string, not a ") + type_name(x));
        return container.s.find(x.s) != std::string::npos;
      case Value::ListK:
        return std::any_of(container.list->begin(), container.list->end(), [&](const Value& v) { return equal(v, x); });
      case Value::DictK: return x.kind == Value::Str && find(*container.dict, x.s);
      default: fail_at(line, std::string("'in' a ") + type_name(container) + " is not supported");
    }
  }

  static bool compare(const std::string& op, const Value& l, const Value& r, int line) {
    if (op == "==") return equal(l, r);
    if (op == "!=") return !equal(l, r);
    if (op == "in") return contains(r, l, line);
    if (op == "not in") return !contains(r, l, line);
    check_defined(l, line);
    check_defined(r, line);
    const int c = order(l, r, line);
    return op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
  }

  static bool test(const std::string& name, const Value& v, const List& args, int line) {
    auto arg = [&]() -> const Value& {
      if (args.size() != 1) fail_at(line, "the test '" + name + "' takes one argument");
      return args[0];
    };
    static const std::vector<std::string> with_arg = {"in", "divisibleby", "equalto", "eq", "==", "ne", "!=", "lt",
                                                      "<", "le", "<=", "gt", ">", "ge", ">="};
    if (!known(with_arg, name) && !args.empty()) fail_at(line, "the test '" + name + "' takes no argument");
    if (name == "defined") return v.kind != Value::Undefined;
    if (name == "undefined") return v.kind == Value::Undefined;
    if (name == "none") return v.kind == Value::None;
    if (name == "boolean") return v.kind == Value::Bool;
    if (name == "true") return v.kind == Value::Bool && v.i;
    if (name == "false") return v.kind == Value::Bool && !v.i;
    if (name == "integer") return v.kind == Value::Int;
    if (name == "number") return v.number();
    if (name == "string") return v.kind == Value::Str;
    if (name == "mapping") return v.kind == Value::DictK;
    if (name == "iterable") return v.kind == Value::Str || v.kind == Value::ListK || v.kind == Value::DictK || v.kind == Value::Undefined;
    if (name == "sequence") return v.kind == Value::Str || v.kind == Value::ListK || v.kind == Value::DictK || v.kind == Value::Undefined;
    if (name == "callable") return v.kind == Value::Func;
    if (name == "in") return contains(arg(), v, line);
    if (name == "odd" || name == "even" || name == "divisibleby") {
      check_defined(v, line);
      if (!v.number()) fail_at(line, "the test '" + name + "' needs an integer, not a " + type_name(v));
      const int64_t d = name == "divisibleby" ? arith("%", v, arg(), line).i : v.i % 2;
      return name == "odd" ? d != 0 : d == 0;
    }
    static const std::vector<std::pair<std::string, std::string>> ops = {
        {"equalto", "=="}, {"eq", "=="}, {"==", "=="}, {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"<", "<"},
        {"le", "<="}, {"<=", "<="}, {"gt", ">"}, {">", ">"}, {"ge", ">="}, {">=", ">="}};
    for (const auto& [test_name, op] : ops)
      if (name == test_name) return compare(op, v, arg(), line);
    fail_at(line, "the test '" + name + "' is not supported");
  }

  // Arguments by position or name, for filters and methods: the names in order, and defaults.
  static List bind_args(const Expr& e, List pos, std::vector<std::pair<std::string, Value>> kw,
                        const std::vector<std::pair<std::string, Value>>& params, const std::string& what) {
    if (pos.size() > params.size()) fail_at(e.line, what + " takes at most " + std::to_string(params.size()) + " arguments");
    List out;
    for (size_t k = 0; k < params.size(); ++k) out.push_back(k < pos.size() ? pos[k] : params[k].second);
    for (auto& [name, v] : kw) {
      size_t k = 0;
      while (k < params.size() && params[k].first != name) ++k;
      if (k == params.size()) fail_at(e.line, what + " has no argument '" + name + "'");
      out[k] = std::move(v);
    }
    return out;
  }

  std::vector<std::pair<std::string, Value>> kwargs_of(const Expr& e) {
    std::vector<std::pair<std::string, Value>> out;
    for (const auto& [name, x] : e.kwargs) out.emplace_back(name, eval(*x));
    return out;
  }

  static const std::string& need_str(const Value& v, const std::string& what, int line) {
    if (v.kind != Value::Str) fail_at(line, what + " needs a string, not a " + type_name(v));
    return v.s;
  }

  static std::string case_of(const std::string& s, bool upper, int line) {
    std::string out = s;
    for (char& c : out) {
      if (static_cast<unsigned char>(c) >= 0x80) fail_at(line, "upper() and lower() of non-ASCII text are not supported");
      c = static_cast<char>(upper ? toupper(c) : tolower(c));
    }
    return out;
  }

  static std::string replace(const std::string& s, const std::string& old, const std::string& with, int64_t count, int line) {
    if (old.empty()) fail_at(line, "replace() of an empty string is not supported");
    std::string out;
    size_t at = 0;
    for (size_t hit; count != 0 && (hit = s.find(old, at)) != std::string::npos; --count) {
      out += s.substr(at, hit - at) + with;
      at = hit + old.size();
    }
    return out + s.substr(at);
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    List pos = args_of(e, 1);
    auto kw = kwargs_of(e);
    const std::string& f = e.name;
    const std::string what = "the filter '" + f + "'";
    auto bound = [&](const std::vector<std::pair<std::string, Value>>& params) { return bind_args(e, pos, kw, params, what); };
    if (f == "trim") {
      List a = bound({{"chars", Value::none()}});
      return Value::str(strip(text(v, e.line), a[0].kind == Value::None ? nullptr : &need_str(a[0], what, e.line), true, true));
    }
    if (f == "length" || f == "count") {
      bound({});
      if (v.kind == Value::Str) return Value::integer(static_cast<int64_t>(cp_offsets(v.s).size()) - 1);
      if (v.kind == Value::Undefined) return Value::integer(0);
      if (v.kind == Value::ListK) return Value::integer(static_cast<int64_t>(v.list->size()));
      if (v.kind == Value::DictK) return Value::integer(static_cast<int64_t>(v.dict->size()));
      fail_at(e.line, std::string("a ") + type_name(v) + " has no length");
    }
    if (f == "string") return bound({}), Value::str(text(v, e.line));
    if (f == "upper" || f == "lower") return bound({}), Value::str(case_of(text(v, e.line), f == "upper", e.line));
    if (f == "first" || f == "last") {
      bound({});
      const List items = iterate(v, e.line);  // Jinja2 gives undefined for an undefined sequence
      if (items.empty()) return Value::undefined("no " + f + " item, the sequence was empty");
      return f == "first" ? items.front() : items.back();
    }
    if (f == "default" || f == "d") {
      List a = bound({{"default_value", Value::str("")}, {"boolean", Value::boolean(false)}});
      return v.kind == Value::Undefined || (truthy(a[1]) && !truthy(v)) ? a[0] : v;
    }
    if (f == "tojson") {
      List a = bound({{"indent", Value::none()}});
      if (a[0].kind != Value::None && a[0].kind != Value::Int) fail_at(e.line, "tojson's indent must be an integer");
      std::string out;
      to_json(v, a[0].kind == Value::Int ? static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(a[0].i, 64))) : -1, 0, out, e.line);
      return Value::str(out);
    }
    if (f == "items") {
      bound({});
      if (v.kind == Value::Undefined) return Value::of(List());
      if (v.kind != Value::DictK) fail_at(e.line, std::string("items() of a ") + type_name(v) + " is not supported");
      List out;
      for (const auto& [k, x] : *v.dict) out.push_back(Value::of(List{Value::str(k), x}));
      return Value::of(std::move(out));
    }
    if (f == "list") return bound({}), Value::of(iterate(v, e.line));
    if (f == "replace") {
      List a = bound({{"old", Value::none()}, {"new", Value::none()}, {"count", Value::none()}});
      const int64_t count = a[2].kind == Value::Int ? a[2].i : -1;
      return Value::str(replace(text(v, e.line), need_str(a[0], what, e.line), need_str(a[1], what, e.line), count, e.line));
    }
    if (f == "join") {
      List a = bound({{"d", Value::str("")}, {"attribute", Value::none()}});
      std::string out;
      bool first = true;
      for (const Value& x : iterate(v, e.line)) {
        out += (first ? "" : text(a[0], e.line)) + text(a[1].kind == Value::None ? x : item(x, a[1], e.line), e.line);
        first = false;
      }
      return Value::str(out);
    }
    if (f == "map") {
      if (!pos.empty() || kw.size() != 1 || kw[0].first != "attribute") fail_at(e.line, "map() is supported only as map(attribute=...)");
      List out;
      for (const Value& x : iterate(v, e.line)) out.push_back(item(x, kw[0].second, e.line));
      return Value::of(std::move(out));
    }
    // select, reject, selectattr, rejectattr: the items passing a test (or true), or failing it.
    if (!kw.empty()) fail_at(e.line, what + " takes no keyword arguments");
    const bool by_attr = f == "selectattr" || f == "rejectattr", keep = f == "select" || f == "selectattr";
    if (by_attr && pos.empty()) fail_at(e.line, what + " needs an attribute name");
    const size_t t = by_attr ? 1 : 0;
    List out;
    for (const Value& x : iterate(v, e.line)) {
      const Value subject = by_attr ? item(x, pos[0], e.line) : x;
      const bool pass = pos.size() > t ? test(need_str(pos[t], what, e.line), subject, List(pos.begin() + t + 1, pos.end()), e.line) : truthy(subject);
      if (pass == keep) out.push_back(x);
    }
    return Value::of(std::move(out));
  }

  Value call(const Expr& e) {
    const Value fn = eval(*e.args[0]);
    List pos = args_of(e, 1);
    auto kw = kwargs_of(e);
    check_defined(fn, e.line);
    if (fn.kind != Value::Func) fail_at(e.line, std::string("a ") + type_name(fn) + " is not callable");
    const std::string& f = fn.s;
    const std::string what = f + "()";
    auto bound = [&](const std::vector<std::pair<std::string, Value>>& params) { return bind_args(e, pos, kw, params, what); };
    if (f == "raise_exception") throw std::invalid_argument(text(bound({{"message", Value::str("")}})[0], e.line));
    if (f == "strftime_now") {
      const std::string format = need_str(bound({{"format", Value::none()}})[0], what, e.line);
      // Python's strftime differs from C's for these (naive datetimes have no zone; %f is Python's).
      for (size_t k = 0; k + 1 < format.size(); ++k)
        if (format[k] == '%' && std::string("fzZ:").find(format[++k]) != std::string::npos)
          fail_at(e.line, "strftime_now's %" + std::string(1, format[k]) + " is not supported");
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buf[512];
      const size_t n = std::strftime(buf, sizeof buf, format.c_str(), &local);
      if (n == 0 && !format.empty()) fail_at(e.line, "strftime_now's format gives no text or too much");
      return Value::str(std::string(buf, n));
    }
    if (f == "namespace") {
      if (pos.size() > 1 || (pos.size() == 1 && pos[0].kind != Value::DictK)) fail_at(e.line, "namespace() takes a dict and keyword arguments");
      Dict attrs = pos.empty() ? Dict() : *pos[0].dict;
      for (auto& [name, v] : kw) attrs.emplace_back(name, std::move(v));
      return Value::of(std::move(attrs), Value::Namespace);
    }
    if (f == "range") {
      if (!kw.empty() || pos.empty() || pos.size() > 3) fail_at(e.line, "range() takes one to three integers");
      for (const Value& a : pos)
        if (!a.number()) fail_at(e.line, std::string("range() needs integers, not a ") + type_name(a));
      const int64_t start = pos.size() == 1 ? 0 : pos[0].i, stop = pos.size() == 1 ? pos[0].i : pos[1].i;
      const int64_t step = pos.size() == 3 ? pos[2].i : 1;
      if (step == 0) fail_at(e.line, "range()'s step cannot be zero");
      List out;
      for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
        if (out.size() >= 100000) fail_at(e.line, "range() is limited to 100000 items");  // as Jinja2's sandbox
        out.push_back(Value::integer(k));
        if (__builtin_add_overflow(k, step, &k)) break;
      }
      return Value::of(std::move(out));
    }
    const Value& self = *fn.self;
    if (f == "dict.items" || f == "dict.keys" || f == "dict.values") {
      bound({});
      List out;
      for (const auto& [k, x] : *self.dict)
        out.push_back(f == "dict.items" ? Value::of(List{Value::str(k), x}) : f == "dict.keys" ? Value::str(k) : x);
      return Value::of(std::move(out));
    }
    if (f == "dict.get") {
      List a = bound({{"key", Value::none()}, {"default", Value::none()}});
      const Value* x = a[0].kind == Value::Str ? find(*self.dict, a[0].s) : nullptr;
      return x ? *x : a[1];
    }
    const std::string& s = self.s;
    if (f == "str.startswith" || f == "str.endswith") {
      const std::string x = need_str(bound({{"prefix", Value::none()}})[0], what, e.line);
      return Value::boolean(x.size() <= s.size() && s.compare(f == "str.startswith" ? 0 : s.size() - x.size(), x.size(), x) == 0);
    }
    if (f == "str.strip" || f == "str.lstrip" || f == "str.rstrip") {
      const Value chars = bound({{"chars", Value::none()}})[0];
      const std::string* set = chars.kind == Value::None ? nullptr : &need_str(chars, what, e.line);
      return Value::str(strip(s, set, f != "str.rstrip", f != "str.lstrip"));
    }
    if (f == "str.upper" || f == "str.lower") return bound({}), Value::str(case_of(s, f == "str.upper", e.line));
    if (f == "str.replace") {
      List a = bound({{"old", Value::none()}, {"new", Value::none()}, {"count", Value::integer(-1)}});
      if (!a[2].number()) fail_at(e.line, "replace()'s count must be an integer");
      return Value::str(replace(s, need_str(a[0], what, e.line), need_str(a[1], what, e.line), a[2].i, e.line));
    }
    if (f == "str.split") {
      List a = bound({{"sep", Value::none()}, {"maxsplit", Value::integer(-1)}});
      if (!a[1].number()) fail_at(e.line, "split()'s maxsplit must be an integer");
      int64_t left = a[1].i;
      List out;
      if (a[0].kind == Value::None) {  // runs of whitespace, no empty pieces
        size_t i = 0;
        for (;;) {
          while (size_t n = space_at(s, i)) i += n;
          if (i >= s.size()) break;
          if (left == 0) {
            out.push_back(Value::str(s.substr(i)));
            break;
          }
          size_t j = i;
          while (j < s.size() && !space_at(s, j)) j += cp_size(s, j);
          out.push_back(Value::str(s.substr(i, j - i)));
          i = j;
          --left;
        }
      } else {
        const std::string& sep = need_str(a[0], what, e.line);
        if (sep.empty()) fail_at(e.line, "split() needs a separator that is not empty");
        size_t at = 0;
        for (size_t hit; left != 0 && (hit = s.find(sep, at)) != std::string::npos; --left) {
          out.push_back(Value::str(s.substr(at, hit - at)));
          at = hit + sep.size();
        }
        out.push_back(Value::str(s.substr(at)));
      }
      return Value::of(std::move(out));
    }
    fail_at(e.line, what + " is not supported");
  }
};

}  // namespace

struct ChatTemplate::Impl {
  Body body;
  std::string bos, eos;
};

ChatTemplate::ChatTemplate(const std::string& source, std::string bos_token, std::string eos_token)
    : impl_(std::make_unique<Impl>()) {
  impl_->body = Parser(lex(source)).parse_template();
  impl_->bos = std::move(bos_token);
  impl_->eos = std::move(eos_token);
}

ChatTemplate::~ChatTemplate() = default;

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                 const std::map<std::string, std::string>& extra) const {
  if (messages.empty()) throw std::invalid_argument("cannot render a chat template for an empty conversation");
  List list;
  for (const ChatMessage& m : messages)
    list.push_back(Value::of(Dict{{"role", Value::str(m.role)}, {"content", Value::str(m.content)}}));
  std::map<std::string, Value> vars = {
      {"bos_token", Value::str(impl_->bos)}, {"eos_token", Value::str(impl_->eos)},
      {"tools", Value::none()}, {"documents", Value::none()}};  // transformers passes them, as None
  for (const auto& [name, v] : extra)
    vars[name] = v == "true" || v == "false" ? Value::boolean(v == "true") : Value::str(v);
  vars["messages"] = Value::of(std::move(list));
  vars["add_generation_prompt"] = Value::boolean(add_generation_prompt);
  Renderer r;
  r.scopes.push_back(std::move(vars));
  r.run(impl_->body);
  return r.prompt;
}

}  // namespace customops
