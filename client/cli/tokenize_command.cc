#include "client/cli/tokenize_command.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/tokenizer.h"

namespace ctxcache::cli {

void TokenizeCommand::Configure(CLI::App* sub) {
  sub->add_option("--model-dir", model_dir_, "Directory of HF model directories")
      ->capture_default_str();
  sub->add_option("--model", model_, "Model name")->capture_default_str();
  sub->add_option("--file", files_, "Text files, tokenized and concatenated (repeatable)");
  sub->add_option("--text", text_, "Text appended after the files");
  sub->add_flag("--bos", bos_, "Prepend the tokenizer's BOS token");
}

int TokenizeCommand::Run(const GlobalOptions&, std::ostream& out, std::ostream& err) {
  const auto path = std::filesystem::path(model_dir_) / model_ / "tokenizer.model";
  auto tok = model::Tokenizer::Load(path.string());
  if (!tok.ok()) {
    err << "ctxcache tokenize: " << tok.status().message() << "\n";
    return kExitUsage;
  }
  std::vector<int32_t> ids;
  if (bos_ && (*tok)->bos_id() >= 0) ids.push_back((*tok)->bos_id());
  std::vector<std::string> texts;
  for (const auto& f : files_) {
    std::ifstream in(f);
    if (!in) {
      err << "ctxcache tokenize: cannot read --file " << f << "\n";
      return kExitUsage;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    texts.push_back(ss.str());
  }
  if (!text_.empty()) texts.push_back(text_);
  for (const auto& t : texts) {
    std::vector<int32_t> part;
    if (Status s = (*tok)->Encode(t, &part); !s.ok()) {
      err << "ctxcache tokenize: " << s.message() << "\n";
      return kExitFailed;
    }
    ids.insert(ids.end(), part.begin(), part.end());
  }
  out << nlohmann::json(ids).dump() << "\n";
  return 0;
}

}  // namespace ctxcache::cli
