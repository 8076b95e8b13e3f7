"""kda's tokenizer against the real tiktoken library: the same tiktoken.model ranks, Kimi's pattern (as
tokenization_kimi.py writes it, with && class intersections) and special tokens (numbered as Kimi numbers
them) must give the same ids on fixed and generated texts; kda detokenize round trips; kda tokenize --chat
renders the spec's format, which the Jinja template tests/data/chat_template/kimi_builtin.jinja renders too.
Texts with runs of over 25,000 characters, or over 400,000 characters in all, are compared with tiktoken
called on the pieces tokenization_kimi.py cuts them into, as Kimi's tokenizer calls it.

Characters are drawn from those Python's unicodedata (Unicode 14, as PCRE2 10.42's tables) knows: code
points assigned later may be classified differently by the regex crate tiktoken uses."""

import base64
import collections
import json
import pathlib
import random
import re
import subprocess
import unicodedata

import pytest

import kda_paths

tiktoken = pytest.importorskip("tiktoken")

REPO = pathlib.Path(__file__).resolve().parents[2]

# tokenization_kimi.py's pat_str, verbatim.
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Kimi's tokenizer_config.json names, by offset from the first special id.
KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
              17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. It's a truth universally acknowledged that a single man "
    "in possession of a good fortune must be in want of a wife. We'll see; they've said they'd come. "
    "In 2024 there were 123456 events, or 3.14159 per second!\n\n"
    "def encode(self, text: str) -> list[int]:\n    return [ord(c) for c in text]\n"
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。"
    "自然语言处理是人工智能的重要方向。我们今天去北京，明天去上海。"
    "Café naïve résumé Zürich façade. Привет, мир! Γειά σου κόσμε. こんにちは世界。안녕하세요 세계. "
    "🙂🚀✨ emoji and symbols: ±×÷≠≈ → ← ↑ ↓ «quotes» “curly” ‘single’\r\n\t  indented    spaces\n"
) * 3


def train_bpe(text, merges):
    """A plain byte-level BPE trainer: the most frequent adjacent pair within whitespace-led chunks."""
    chunks = collections.Counter()
    for word in text.replace("\n", " \n ").split(" "):
        chunks[(" " + word).encode()] += 1
    words = {w: [bytes([b]) for b in w] for w in chunks}
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    for _ in range(merges):
        pairs = collections.Counter()
        for w, parts in words.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += chunks[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        new = a + b
        if new not in seen:
            seen.add(new)
            vocab.append(new)
        for w, parts in words.items():
            i, out = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            words[w] = out
    return vocab


def write_vocab(folder, tokens):
    with open(folder / "tiktoken.model", "w") as f:
        for rank, t in enumerate(tokens):
            f.write(f"{base64.b64encode(t).decode()} {rank}\n")
    base = len(tokens)
    decoder = {str(base + k): {"content": v, "special": True} for k, v in KIMI_NAMED.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))


def kimi_encoding(folder):
    """tiktoken.Encoding as tokenization_kimi.py builds it: ranks from tiktoken.model, 256 + 2 specials."""
    ranks = {}
    for line in (folder / "tiktoken.model").read_text().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    named = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    base = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256 + 2)}
    return tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)


def kimi_encode(enc, text, allow_special=True, split_specials_first=True):
    """Kimi's tokenizer: tokenization_kimi.py's encode cuts its text into 400,000-character chunks, each cut
    so that no run of whitespace or of non-whitespace (str.isspace) is longer than 25,000 characters, and
    calls tiktoken on each piece. split_specials_first: as Hugging Face's tokenizer call (vLLM's way to
    encode a prompt), the special tokens split the text first and each part goes to that encode."""

    def split_runs(s, max_len):
        cur_len, cur_space, start = 0, s[0].isspace() if s else False, 0
        for i, ch in enumerate(s):
            now = ch.isspace()
            if cur_space ^ now:
                cur_len, cur_space = 1, now
            else:
                cur_len += 1
                if cur_len > max_len:
                    yield s[start:i]
                    start, cur_len = i, 1
        yield s[start:]

    def encode(part):
        ids = []
        for i in range(0, len(part), 400_000):
            for sub in split_runs(part[i:i + 400_000], 25_000):
                ids += (enc.encode(sub, allowed_special="all") if allow_special
                        else enc.encode(sub, disallowed_special=()))
        return ids

    if not (allow_special and split_specials_first):
        return encode(text)
    # Kimi's usable specials (the last two ids have no embedding row), longest first at a position.
    usable = [t for t in enc.special_tokens_set if enc.encode_single_token(t) < enc.n_vocab - 2]
    ids = []
    for k, part in enumerate(re.split("(" + "|".join(map(re.escape, sorted(usable, key=len, reverse=True))) + ")",
                                      text)):
        ids += [enc.encode_single_token(part)] if k % 2 else encode(part)
    return ids


def pair_run_token(folder):
    """Two different lowercase ASCII letters x, y that the vocabulary merges into one token "xy": in a run of
    "xy" pairs, a cut between x and y of one pair changes the ids."""
    for line in (folder / "tiktoken.model").read_text().splitlines():
        t = base64.b64decode(line.split()[0])
        if len(t) == 2 and t.isalpha() and t.islower() and t[0] != t[1]:
            return t.decode()
    raise AssertionError("no two-letter token in the vocabulary")


def kda(*args, stdin=b""):
    assert kda_paths.BINARY.exists(), f"no kda binary at {kda_paths.BINARY} (build it, or set KDA_BINARY)"
    return subprocess.run([str(kda_paths.BINARY), *args], input=stdin, capture_output=True, timeout=120)


def kda_ids(folder, text, *extra):
    r = kda("tokenize", "--model", str(folder), *extra, stdin=text.encode())
    assert r.returncode == 0, r.stderr.decode()
    return [int(x) for x in r.stdout.split()]


@pytest.fixture(scope="module", params=["trained", "synthetic"])
def vocab_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "trained":
        write_vocab(folder, train_bpe(TRAINING_TEXT, 400))
    else:
        r = kda("tokenize", "--synthetic-vocab", "4096", "--seed", "3", "--save", str(folder))
        assert r.returncode == 0, r.stderr.decode()
    return folder


FIXED_TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; I'LL say don't, we've, they'd.",
    "HTTPServer XMLHttpRequest camelCaseWord snake_case_word CONSTANT_VALUE",
    "人工智能是计算机科学的一个分支，它企图了解智能的实质。",
    "你好、世界。「引用」々〇一中文English混合",
    "Mixed: café naïve résumé — Привет мир, Γειά σου, こんにちは, 안녕하세요, مرحبا بالعالم, שלום",
    "Digits: 1 12 123 1234 12345 3.14159 1,000,000 ٣٤٥ ௧௨௩",
    "Emoji: 🙂🚀✨ 👩‍💻 🇺🇸 👍🏽 family 👨‍👩‍👧‍👦",
    "Whitespace:" + " " * 50 + "x\t\t\ty\n\n\n\nz\r\n\r\nw   \n   \n" + " " * 30,
    "line one\nline two\r\nline three\r\r\n  \n",
    "it'ſ IT'S It's it'S — ǅemal ﬁne Ⅻ ⅻ",
    "x\u00a0y\u3000z\u0085w\u2028v\u2029u\u200bt\u180es\ufeffr",
    "combining: a\u0301e\u0308o\u0302 \u0915\u094d\u0937 \u0e01\u0e34",
    "code: for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // done\n\treturn 0;",
    "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS] and [PAD][UNK] <|im_system|>tool<|im_middle|>{\"a\": 1}<|im_end|>",
    "half <|im_end| and <|im_end|><|im_end|> doubled",
]


def random_text(rng, n):
    ranges = [(0x61, 0x7A), (0x41, 0x5A), (0x30, 0x39), (0x20, 0x20), (0x20, 0x20), (0x0A, 0x0A), (0x0D, 0x0D),
              (0x09, 0x09), (0x21, 0x2F), (0x4E00, 0x9FFF), (0x3000, 0x303F), (0x0300, 0x036F), (0x00C0, 0x024F),
              (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0590, 0x06FF), (0x0E00, 0x0E7F), (0xAC00, 0xD7A3),
              (0x3040, 0x30FF), (0x1F300, 0x1F64F), (0x2000, 0x206F), (0x00A0, 0x00BF), (0x20000, 0x2A6DF),
              (0x0080, 0x00A0), (0x27, 0x27), (0x10000, 0x1FFFF), (0xFF00, 0xFFEF), (0x1D400, 0x1D7FF)]
    out = []
    while len(out) < n:
        lo, hi = rng.choice(ranges)
        c = chr(rng.randint(lo, hi))
        if 0xD800 <= ord(c) <= 0xDFFF or unicodedata.category(c) in ("Cn", "Cs"):
            continue
        out.append(c)
    return "".join(out)


def test_ids_equal_tiktokens_on_fixed_texts(vocab_dir):
    enc = kimi_encoding(vocab_dir)
    for text in FIXED_TEXTS:
        assert kda_ids(vocab_dir, text) == enc.encode(text, allowed_special="all"), repr(text)
        assert kda_ids(vocab_dir, text, "--no-special") == enc.encode_ordinary(text), repr(text)


def test_ids_equal_tiktokens_on_generated_texts(vocab_dir):
    enc = kimi_encoding(vocab_dir)
    rng = random.Random(7)
    texts = [random_text(rng, rng.randint(1, 300)) for _ in range(40)]
    # Words from the training text shuffled with punctuation and spaces: many merges per piece.
    words = TRAINING_TEXT.split(" ")
    texts += [" ".join(rng.choice(words) for _ in range(200)) for _ in range(5)]
    # A long single "word" and a long whitespace run (the BPE's long-piece path).
    texts += ["".join(rng.choice("abcdefghij") for _ in range(20000)), " " * 5000 + "x", "人" * 3000]
    for text in texts:
        assert kda_ids(vocab_dir, text) == enc.encode(text, allowed_special="all"), repr(text[:80])


def test_detokenize_round_trips(vocab_dir):
    rng = random.Random(11)
    for text in FIXED_TEXTS + [random_text(rng, 200) for _ in range(10)]:
        ids = kda_ids(vocab_dir, text)
        r = kda("detokenize", "--model", str(vocab_dir), stdin=" ".join(map(str, ids)).encode())
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout.decode() == text


def test_invalid_utf8_is_an_error_naming_the_offset(vocab_dir):
    r = kda("tokenize", "--model", str(vocab_dir), stdin=b"abc\xff def")
    assert r.returncode != 0
    assert b"byte offset 3" in r.stderr


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "天气怎么样？\n详细说说。"},
     {"role": "assistant", "content": "call", "name": "planner"},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "  spaced  ", "name": "bob"}],
]


def spec_format(messages):
    heads = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
             "tool": "<|im_system|>"}
    out = "".join(f"{heads[m['role']]}{m.get('name') or m['role']}<|im_middle|>{m['content']}<|im_end|>"
                  for m in messages)
    return out + "<|im_assistant|>assistant<|im_middle|>"


def test_chat_renders_the_spec_format(vocab_dir):
    enc = kimi_encoding(vocab_dir)
    for messages in CONVERSATIONS:
        payload = json.dumps(messages).encode()
        r = kda("tokenize", "--model", str(vocab_dir), "--chat", "--text", stdin=payload)
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout.decode() == spec_format(messages)
        r = kda("tokenize", "--model", str(vocab_dir), "--chat", stdin=payload)
        assert r.returncode == 0, r.stderr.decode()
        assert [int(x) for x in r.stdout.split()] == enc.encode(spec_format(messages), allowed_special="all")
    r = kda("tokenize", "--model", str(vocab_dir), "--chat", stdin=b'[{"role": "robot", "content": "x"}]')
    assert r.returncode != 0 and b"messages[0].role" in r.stderr


def test_builtin_jinja_template_renders_the_same(vocab_dir, tmp_path):
    jinja2 = pytest.importorskip("jinja2")
    source = (REPO / "tests" / "data" / "chat_template" / "kimi_builtin.jinja").read_text()

    def raise_exception(msg):
        raise ValueError(msg)

    template = jinja2.Environment().from_string(source)
    for messages in CONVERSATIONS:
        rendered = template.render(messages=messages, add_generation_prompt=True, raise_exception=raise_exception)
        assert rendered == spec_format(messages)
        assert template.render(messages=messages, add_generation_prompt=False,
                               raise_exception=raise_exception) == spec_format(messages)[:-len(
                                   "<|im_assistant|>assistant<|im_middle|>")]
    # A checkpoint folder carrying this template is accepted (its digest is in the known list); any other
    # template is refused with a message naming the file and --chat-template builtin.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (folder / name).write_bytes((vocab_dir / name).read_bytes())
    (folder / "chat_template.jinja").write_text(source.replace("\n", "\r\n") + "\n\n")
    payload = json.dumps(CONVERSATIONS[0]).encode()
    r = kda("tokenize", "--model", str(folder), "--chat", "--text", stdin=payload)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == spec_format(CONVERSATIONS[0])
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    r = kda("tokenize", "--model", str(folder), "--chat", "--text", stdin=payload)
    assert r.returncode != 0
    assert b"chat_template.jinja" in r.stderr and b"--chat-template builtin" in r.stderr
    r = kda("tokenize", "--model", str(folder), "--chat", "--text", "--chat-template", "builtin", stdin=payload)
    assert r.returncode == 0 and r.stdout.decode() == spec_format(CONVERSATIONS[0])


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def long_texts(rng, xy):
    """Texts up to about 100 KB with runs of one kind of character around and far beyond 25,000 characters.
    xy: a two-letter token (pair_run_token)."""
    words = TRAINING_TEXT.split(" ")
    prose = " ".join(rng.choice(words) for _ in range(12000))[:100_000]
    return {
        "letters": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(60_000)),
        "pair-run": xy * 40_000,
        "pair-run-odd": xy[1] + xy * 30_000,
        "the-repeated": "the" * 33_334,
        "Capitalised": ("Xyz" * 10_000) + ("abc" * 10_000),
        "digits": "".join(rng.choice("0123456789") for _ in range(100_000)),
        "digits-after-a-letter": "a" + "7" * 50_001,
        "spaces": " " * 100_000,
        "spaces-then-word": " " * 25_001 + "word" + " " * 49_999 + "x",
        "newlines": "\n" * 30_000 + "a" + "\r\n" * 20_000,
        "mixed-whitespace": "".join(rng.choice(" \t\n\u3000\u00a0\u2003\x1c\x85") for _ in range(80_000)),
        "punctuation": "".join(rng.choice("!@#$%^&*()-_=+[]{};:,.<>/?|~`") for _ in range(70_000)),
        "cjk": "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(33_000)),
        "cjk-punct": "。、「」" * 8_000,
        "emoji": "🙂🚀✨👩‍💻" * 4_500,
        "prose": prose,
        "mixed-run": "".join(rng.choice(["ab", "中文", "12", ".,", "é", "x'", "🙂"]) for _ in range(40_000)),
        # A run's count starts again after a special token (the specials split the text first).
        "pair-run-after-special": "<|im_middle|>" + xy[1] + xy * 12_600,
        "special-inside-a-run": "z" * 24_995 + "<|im_end|>" + xy * 12_600 + "<|im_end|>",
        "random": random_text(rng, 30_000).replace(" ", "") * 2,
    }


def test_long_runs_equal_kimis_tokenizer(vocab_dir):
    """Runs of letters, digits, whitespace, punctuation, CJK and mixed text up to about 100 KB: the ids of
    Kimi's tokenizer (the real tiktoken, called on the pieces tokenization_kimi.py cuts)."""
    enc = kimi_encoding(vocab_dir)
    rng = random.Random(17)
    cut_matters = []
    for name, text in long_texts(rng, pair_run_token(vocab_dir)).items():
        want = kimi_encode(enc, text)
        got = kda_ids(vocab_dir, text)
        assert got == want, f"{name}: first difference at id {first_difference(got, want)}"
        assert kda_ids(vocab_dir, text, "--no-special") == kimi_encode(enc, text, allow_special=False), name
        if enc.encode(text, allowed_special="all") != want:
            cut_matters.append(name)
        if name == "pair-run-after-special":  # tokenization_kimi.py's encode on the whole text cuts elsewhere
            assert kimi_encode(enc, text, split_specials_first=False) != want
    # The cuts change ids (else this test could not tell a tokenizer that ignores them).
    assert {"pair-run-odd", "pair-run-after-special"} <= set(cut_matters), cut_matters


def test_whitespace_for_the_cuts_is_pythons_isspace(vocab_dir):
    """Each candidate character c before a run of 25,001 letters x y x y ... x: where c is whitespace the
    run is cut before its last x (between two pairs); where it is not, c counts, and the cut falls inside
    the pair before."""
    enc = kimi_encoding(vocab_dir)
    xy = pair_run_token(vocab_dir)
    run = xy * 12_500 + xy[0]
    spaces = [c for c in map(chr, range(0x110000)) if c.isspace()]
    near = ["\x00", "\x08", "\x0e", "\x1b", "\x7f", "\x84", "\x86", "\u180e", "\u200b", "\u200c",
            "\u2060", "\ufeff", "\u3001", "!", "z"]
    assert kimi_encode(enc, " " + run)[-4:] != kimi_encode(enc, "\u200b" + run)[-4:]
    text = "".join(c + run + "\n" for c in spaces + near)
    want = kimi_encode(enc, text)
    got = kda_ids(vocab_dir, text)
    assert got == want, f"first difference at id {first_difference(got, want)}"


def test_text_over_a_400000_character_chunk(vocab_dir):
    """Kimi's tokenizer encodes 400,000 characters at a time: a piece across that end is cut."""
    enc = kimi_encoding(vocab_dir)
    rng = random.Random(23)
    words = TRAINING_TEXT.split(" ")
    head = " ".join(rng.choice(words) for _ in range(80_000))[:399_950] + " "
    text = head + pair_run_token(vocab_dir) * 50  # character 400,000 is the second letter of a pair
    want = kimi_encode(enc, text)
    assert want != enc.encode(text, allowed_special="all")
    got = kda_ids(vocab_dir, text)
    assert got == want, f"first difference at id {first_difference(got, want)}"
