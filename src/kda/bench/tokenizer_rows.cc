// `kda bench --only tokenizer`: encoding speed on one thread over generated mixed English/Chinese text,
// with a vocabulary of Kimi's size whose tokens cover the text's words (as a trained one would), and the
// long single-"word" case against normal text of the same size (the BPE merge must not go quadratic).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "kda/bench/rows.h"
#include "kda/tokenizer/base64.h"
#include "kda/tokenizer/tokenizer.h"
#include "kda/tokenizer/utf8.h"

namespace kda::bench {
namespace {

const char* const kWords[] = {
    "the",       "of",          "and",       "to",          "in",         "is",        "that",
    "for",       "it",          "as",        "was",         "with",       "be",        "by",
    "on",        "not",         "he",        "this",        "are",        "or",        "his",
    "from",      "at",          "which",     "but",         "have",       "an",        "had",
    "they",      "you",         "were",      "their",       "one",        "all",       "we",
    "can",       "her",         "has",       "there",       "been",       "if",        "more",
    "when",      "will",        "would",     "who",         "so",         "no",        "model",
    "language",  "attention",   "memory",    "linear",      "state",      "token",     "sequence",
    "layer",     "training",    "data",      "system",      "research",   "results",   "method",
    "network",   "learning",    "inference", "performance", "context",    "length",    "hardware",
    "efficient", "transformer", "recurrent", "gradient",    "parameters", "benchmark", "throughput",
    "latency",   "server",      "request",   "response",    "function",   "variable",  "compute",
    "vector",    "matrix",      "kernel",    "update",      "don't",      "it's",      "we're",
    "they've",   "I'll",        "HTTP",      "JSON",        "API",        "GPU"};

// Common Chinese characters (UTF-8), a few hundred.
const char* const kHan =
    "的一是不了在人有我他这个们中来上大为和国地到以说时要就出会可也你对生能而子那得于着下自之年过发后作里用道"
    "行所然"
    "家种事成方多经么去法学如都同现当没动面起看定天分还进好小部其些主样理心她本前开但因只从想实日军者意无力它"
    "与长把机"
    "十民第公此已工使情明性知全三又关点正业外将两高间由问很最重并物手应战向头文体政美相见被利什二等产或新己制"
    "身果加西"
    "斯月话合回特代内信表化老给世位次度门任常先海通教儿原东声提立及比员解水名真论处走义各入几口认条平系气题活"
    "尔更别打"
    "女变四神总何电数安少报才结反受目太量再感建务做接必场件计管期市直德资命山金指克许统区保至队形社便空决治展"
    "马科司五基"
    "眼书非则听白却界达光放强即像难且权思王象完设式色路记南品住告类求据程北边死张该交规万取拉格望觉术领共确传"
    "师观清今切"
    "院让识候带导争运笑飞风步改收根干造言联持组每济车亲极林服快办议往元英士证近失转夫令准布始怎呢存未远叫台单"
    "影具罗字爱"
    "击流备兵连调深商算质团集百需价花党华城石级整府离况亚请技际约示复病息究线似官火断精满支视消越器容照须九增"
    "研写称企八"
    "功吗包片史委乎查轻易早曾除农找装广显吧阿李标谈吃图念六引历首医局突专费号尽另周较注语仅考落青随选列武红响"
    "虽推势参希"
    "古众构房半节土投某案黑维革划敌致陈律足态护七兴派孩验责营星够章音跟志底站严巴例防族供效续施留讲型料终答紧"
    "黄绝奇察母"
    "京段依批群项故按河米围江织害斗双境客纪采举杀攻父苏密低朝友诉止细愿千值仍男钱破网热助倒育属坐帝限船脸职速"
    "刻乐否刚威"
    "毛状率甚独球般普怕弹校苦创假久错承印晚兰试股拿脑预谁益阳若哪微尼继送急血惊伤素药适波夜省初喜卫源食险待述"
    "陆习置居劳"
    "财环排福纳欢雷警获模充负云停木游龙树疑层冷洲冲射略范竟句室异激汉村哈策演简卡罪判担州静退既衣您宗积余痛检"
    "差富灵协角"
    "占配征修皮挥胜降阶审沉坚善妈刘读啊超免压银买皇养伊怀执副乱抗犯追帮宣佛岁航优怪香著田铁控税左右份穿艺背阵"
    "草脚概恶块"
    "顿敢守酒岛托央户烈洋哥索胡款靠评版宝座释景顾弟登货互付伯慢欧换闻危忙核暗姐介坏讨丽良序升监临亮露永呼味野"
    "架域沙掉括"
    "舰鱼杂误湾吉减编楚肯测败屋跑梦散温困剑渐封救贵枪缺楼县尚毫移娘朋画班智亦耳恩短掌恐遗固席松秘谢鲁遇康虑幸"
    "均销钟诗藏"
    "赶剧票损忽巨炮旧端探湖录叶春乡附吸予礼港雨呀板庭妇归睛饭额含顺输摇招婚脱补谓督毒油疗旅泽材灭逐莫笔亡鲜词"
    "圣择寻厂睡"
    "博勒烟授诺伦岸奥唐卖俄炸载洛健堂旁宫喝借君禁阴园谋宋避抓荣姑孙逃牙束跳顶玉镇雪午练迫爷篇肉嘴馆遍凡础洞卷"
    "坦牛宁纸诸"
    "训私庄祖丝翻暴森塔默握戏隐熟骨访弱蒙歌店鬼软典欲萨伙遭盘爸扩盖弄雄稳忘亿刺拥徒姆杨齐赛趣曲刀床迎冰虚玩析"
    "窗醒妻透购";

std::vector<std::string> han_chars() {
  std::vector<std::string> out;
  const std::string s = kHan;
  for (size_t i = 0; i + 3 <= s.size(); i += 3) out.push_back(s.substr(i, 3));
  return out;
}

// ~bytes of paragraphs alternating English and Chinese sentences, with digits and punctuation.
std::string mixed_text(size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto han = han_chars();
  const size_t nwords = sizeof(kWords) / sizeof(kWords[0]);
  std::string t;
  while (t.size() < bytes) {
    for (int s = 0; s < 4; ++s) {
      if (rng() % 2) {
        const int n = 8 + static_cast<int>(rng() % 14);
        for (int w = 0; w < n; ++w) {
          std::string word = kWords[rng() % nwords];
          if (w == 0 && word[0] >= 'a' && word[0] <= 'z') word[0] = static_cast<char>(word[0] - 32);
          if (w > 0) t += ' ';
          t += word;
          if (rng() % 15 == 0) t += ' ' + std::to_string(rng() % 100000);
          if (rng() % 12 == 0) t += ',';
        }
        t += ". ";
      } else {
        const int n = 8 + static_cast<int>(rng() % 24);
        for (int c = 0; c < n; ++c) {
          t += han[rng() % han.size()];
          if (c + 1 < n && rng() % 10 == 0) t += "，";
        }
        t += rng() % 3 ? "。" : "！";
      }
    }
    t += "\n\n";
  }
  return t;
}

// A vocabulary of Kimi's size (163,584 base tokens): the bytes; the text's words (with and without a
// leading space, capitalized) and Chinese characters and character pairs, each reachable by left-to-right
// merges, as BPE training would give the frequent ones; then the synthetic vocabulary's tokens as filler.
tokenizer::Tokenizer realistic_tokenizer(const std::string& dir) {
  std::vector<std::string> tokens;
  std::unordered_set<std::string> seen;
  auto add = [&](const std::string& t) {
    if (seen.insert(t).second) tokens.push_back(t);
  };
  auto add_by_prefixes = [&](const std::string& w) {
    for (size_t k = 2; k <= w.size(); ++k) add(w.substr(0, k));
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  for (const char* w : kWords) {
    std::string cap = w;
    if (cap[0] >= 'a' && cap[0] <= 'z') cap[0] = static_cast<char>(cap[0] - 32);
    std::string spaced(" "), spaced_cap(" ");
    spaced += w;
    spaced_cap += cap;
    for (const std::string& v : {std::string(w), spaced, cap, spaced_cap}) add_by_prefixes(v);
  }
  const auto han = han_chars();
  for (const auto& c : han) add_by_prefixes(c);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 20000; ++i) add(han[rng() % han.size()] + han[rng() % han.size()]);
  for (const char* p : {"。", "，", "！", ". ", ", ", "\n\n"}) add_by_prefixes(p);
  constexpr int64_t kBase = 163584;
  const auto filler = tokenizer::Tokenizer::synthetic(kBase + 256, 1);
  for (int32_t r = 256; r < kBase && static_cast<int64_t>(tokens.size()) < kBase; ++r)
    add(filler.token_bytes(r));
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/tiktoken.model", std::ios::binary);
    for (size_t r = 0; r < tokens.size(); ++r) f << tokenizer::base64_encode(tokens[r]) << ' ' << r << '\n';
  }
  const int64_t b = static_cast<int64_t>(tokens.size());
  std::ofstream(dir + "/tokenizer_config.json")
      << "{\"added_tokens_decoder\": {\"" << b << "\": {\"content\": \"[BOS]\"}, \"" << b + 1
      << "\": {\"content\": \"[EOS]\"}, \"" << b + 2 << "\": {\"content\": \"<|im_end|>\"}}}\n";
  return tokenizer::Tokenizer::from_dir(dir, b + 256);
}

}  // namespace

void bench_tokenizer(nlohmann::json& j, const Say& say) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kda_bench_tokenizer_" + std::to_string(::getpid())))
          .string();
  const auto tok = realistic_tokenizer(dir);
  std::filesystem::remove_all(dir);
  const std::string text = mixed_text(2 << 20, 1);
  std::vector<int32_t> ids;
  const double t_text = best_seconds([&] { ids = tok.encode(text); }, 3, 1.0);
  const double mbs = static_cast<double>(text.size()) / t_text / 1e6;
  const double bytes_per_token = static_cast<double>(text.size()) / static_cast<double>(ids.size());
  size_t npieces = 0;
  const double t_split = best_seconds([&] { npieces = tok.split(text).size(); }, 3, 0.5);
  std::string back;
  const double t_decode = best_seconds([&] { back = tok.decode(ids); }, 3, 0.5);
  if (back != text) throw std::runtime_error("bench tokenizer: decode(encode(text)) != text");
  say("tokenizer (one thread, vocabulary of %lld ids):\n", static_cast<long long>(tok.vocab_size()));
  say("  encode  %.2f MB of mixed English/Chinese text: %8.2f MB/s  (%.2f bytes/token)\n",
      static_cast<double>(text.size()) / 1e6, mbs, bytes_per_token);
  say("  of which the pre-tokenizer alone (%zu pieces): %8.2f MB/s\n", npieces,
      static_cast<double>(text.size()) / t_split / 1e6);
  say("  decode  %zu tokens:                          %8.2f MB/s\n", ids.size(),
      static_cast<double>(text.size()) / t_decode / 1e6);
  // 100 KB as one pre-tokenizer piece (letters only) against 100 KB of the normal text.
  std::mt19937_64 rng(3);
  std::string word;
  while (word.size() < 100000) word += "abcdefghijklmnopqrstuvwxyz"[rng() % 26];
  std::string normal = text.substr(0, 100000);
  while (tokenizer::utf8_invalid_offset(normal) != std::string::npos) normal.pop_back();  // whole characters
  const auto pieces = tok.split(word).size();
  const auto t = best_interleaved({[&] { tok.encode(word); }, [&] { tok.encode(normal); }}, 5, 1.0);
  say("  100 KB single word (%zu piece): %.2f ms, 100 KB of text: %.2f ms, ratio %.2f\n", pieces, t[0] * 1e3,
      t[1] * 1e3, t[0] / t[1]);
  j["tokenizer"] = {{"encode_mb_per_s", mbs},
                    {"pretokenizer_mb_per_s", static_cast<double>(text.size()) / t_split / 1e6},
                    {"decode_mb_per_s", static_cast<double>(text.size()) / t_decode / 1e6},
                    {"text_bytes", text.size()},
                    {"bytes_per_token", bytes_per_token},
                    {"single_word_100kb_ms", t[0] * 1e3},
                    {"text_100kb_ms", t[1] * 1e3},
                    {"single_word_over_text", t[0] / t[1]}};
}

}  // namespace kda::bench
