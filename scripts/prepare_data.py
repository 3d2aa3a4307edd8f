#!/usr/bin/env python3
"""scripts/prepare_data.py: tokenize text into nvlua shards with a real tokenizer.

    python3 scripts/prepare_data.py OUT_DIR INPUT... --tokenizer path/to/tokenizer.json  (or an HF model dir)
    python3 scripts/prepare_data.py OUT_DIR INPUT... --tiktoken cl100k_base
    python3 scripts/prepare_data.py OUT_DIR INPUT... --tiktoken path/to/cl100k_base.tiktoken  (offline)
    python3 scripts/prepare_data.py OUT_DIR INPUT... --tokenizer bytes                   (id = byte, vocab 256)
    build/nvlua experiments/tiny_llama_nvfp4.lua data=shards:OUT_DIR                      (vocab from the manifest)

INPUT: text files, directories of them (walked in sorted order), or JSONL files (*.jsonl, one
JSON object per line, its --text-field, default "text", is a document). A text file is one
document (--split line: each non-empty line is one; --split paragraph: blank-line separated).

Each document is tokenized without the tokenizer's own special-token template; the eos token is
appended after every document when the tokenizer has one (--no-eos: not), the bos token put
before it with --bos. Train/validation: the last --val-fraction of the documents (at least one,
rounded up) when there are at least 2, else the last --val-fraction of the tokens.

OUT_DIR receives (the NVLTOK shard format of lua/nvlua/data.lua: a 24-byte header, then u16 ids
when the vocabulary fits in 65536, else u32):
  train_000.bin, train_001.bin, ... (--shard-tokens per shard), val_000.bin
  tokenizer.json   the tokenizer (a --tiktoken encoding converted to a byte-level BPE tokenizer.json
                   that encodes the same; checked on the data); absent for bytes
  manifest.json    {"format": "nvlua-data", "version": 1, "tokenizer", "vocab_size", "bos_token",
                   "bos_token_id", "eos_token", "eos_token_id", "prompt": {"text", "ids"} (the
                   end-of-run sample's prompt, --prompt, tokenized here with bos when --bos),
                   "width", "tokens": {"train", "val"}, "documents": {"train", "val"}, "sources"}
bos/eos: --bos-token/--eos-token, else the tokenizer_config.json beside the tokenizer.json, else
well-known special tokens (<|begin_of_text|>, <s>, <|endoftext|>, ...), as nvlua.tokenizer finds them.

--tiktoken NAME has tiktoken download the encoding's BPE file (once: it keeps a copy in
$TIKTOKEN_CACHE_DIR, default <tmp>/data-gym-cache, under the SHA-1 of its URL; a machine without the
network can be given that directory). Offline, --tiktoken FILE takes a local .tiktoken file (lines of
"base64(token) rank", as OpenAI publishes them) with the pattern and special tokens
of the encoding the file's name says (cl100k_base.tiktoken; or --tiktoken-encoding NAME): r50k_base,
p50k_base, p50k_edit, cl100k_base, o200k_base, o200k_harmony (tiktoken's own list: gpt2 is not one, its
ranks are r50k_base's). A file that is not the published one (its SHA-256 differs) is used with a note.
A tool for preparing data: nvlua never needs Python.
"""
import argparse
import json
import math
import os
import struct
import sys

MAGIC = b"NVLTOK\0\0"
BOS_NAMES = ["<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "<|endoftext|>"]
EOS_NAMES = ["<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|endoftext|>"]


def die(msg):
    print("prepare_data: " + msg, file=sys.stderr)
    sys.exit(2)


class Progress:
    """tqdm when it is installed, else a line on stderr every few percent."""

    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.shown = total, desc, 0, -1
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True)
        except ImportError:
            self.bar = None

    def update(self, k):
        self.n += k
        if self.bar is not None:
            self.bar.update(k)
            return
        pct = int(100 * self.n / max(self.total, 1))
        if pct // 5 != self.shown // 5 or self.n >= self.total:
            self.shown = pct
            print("\r%s: %3d%% (%d of %d bytes)" % (self.desc, pct, self.n, self.total), end="", file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


# ---- documents ---------------------------------------------------------------------------------

def input_files(paths):
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs.sort()
                out.extend(os.path.join(root, f) for f in sorted(files))
        elif os.path.isfile(p):
            out.append(p)
        else:
            die("no such file or directory: %s" % p)
    return out


def documents(files, split, field):
    """Yield (document text, bytes of input it came from)."""
    for f in files:
        if f.endswith(".jsonl"):
            with open(f, "rb") as h:
                for n, line in enumerate(h, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        die("%s:%d: not JSON: %s" % (f, n, e))
                    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                        die("%s:%d: no string field %r" % (f, n, field))
                    yield obj[field], len(line)
            continue
        with open(f, "rb") as h:
            raw = h.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            die("%s: not UTF-8 (%s); --tokenizer bytes takes any bytes" % (f, e))
        if split == "file":
            yield text, len(raw)
        else:
            parts = text.split("\n") if split == "line" else text.split("\n\n")
            for i, p in enumerate(parts):
                if p.strip():
                    yield p, len(p.encode()) + (1 if i < len(parts) - 1 else 0)


# ---- tokenizers --------------------------------------------------------------------------------

class Tok:
    """encode(text) -> ids; vocab_size; bos/eos (name, id) or None; json: tokenizer.json text or None."""


def byte_tokenizer():
    t = Tok()
    t.encode_batch = lambda texts: [list(s.encode("utf-8")) for s in texts]
    t.vocab_size, t.bos, t.eos, t.json, t.name = 256, None, None, None, "bytes"
    return t


def pick_special(vocab, added, given, config_value, names):
    if given:
        if given not in vocab:
            die("the special token %r is not in the tokenizer's vocabulary" % given)
        return given, vocab[given]
    if isinstance(config_value, dict):
        config_value = config_value.get("content")
    if isinstance(config_value, str) and config_value in vocab:
        return config_value, vocab[config_value]
    for n in names:
        if n in added:
            return n, vocab[n]
    return None


def read_json_file(path, what):
    """The text and the parsed JSON object of the file at path; dies naming the file (what: the option)."""
    try:
        with open(path, encoding="utf-8") as h:
            text = h.read()
    except (OSError, UnicodeDecodeError) as e:
        die("%s %s: cannot read it: %s" % (what, path, e.strerror if isinstance(e, OSError) else e))
    try:
        obj = json.loads(text)
    except ValueError as e:
        die("%s %s: not valid JSON: %s" % (what, path, e))
    if not isinstance(obj, dict):
        die("%s %s: expected a JSON object, got a %s" % (what, path, type(obj).__name__))
    return text, obj


def tokenizer_path(path):
    """--tokenizer's file (a tokenizer.json, or the one in a directory), checked to exist and be readable."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        die("--tokenizer %s: no such file (give a tokenizer.json, a directory holding one, or 'bytes')" % path)
    if not os.path.isfile(path):
        die("--tokenizer %s: not a file" % path)
    return path


def hf_tokenizer(path, bos_token, eos_token):
    text, _ = read_json_file(path, "--tokenizer")
    from tokenizers import Tokenizer
    try:
        tk = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises its own exception type for a malformed file
        die("--tokenizer %s: the tokenizers library cannot read it: %s" % (path, e))
    vocab = tk.get_vocab(with_added_tokens=True)
    if not vocab:
        die("--tokenizer %s: the vocabulary is empty" % path)
    added = {a.content for a in tk.get_added_tokens_decoder().values()}
    cfg = {}
    cpath = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if os.path.isfile(cpath):
        _, cfg = read_json_file(cpath, "the tokenizer's config")
    t = Tok()
    t.encode_batch = lambda texts: [e.ids for e in tk.encode_batch(texts, add_special_tokens=False)]
    t.vocab_size = max(vocab.values()) + 1
    t.bos = pick_special(vocab, added, bos_token, cfg.get("bos_token"), BOS_NAMES)
    t.eos = pick_special(vocab, added, eos_token, cfg.get("eos_token"), EOS_NAMES)
    t.json, t.name, t.hf = text, "tokenizer.json", tk
    return t


def bytes_to_unicode():
    """GPT-2's table: the byte -> printable character map of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiktoken_json(enc):
    """A tokenizer.json (byte-level BPE) that encodes as the tiktoken Encoding enc does: the ranks
    as ids, the merges recovered from the ranks (each token of length > 1 is the merge of the pair
    that BPE over lower ranks leaves), enc's split regex as a Split pre-tokenizer."""
    ranks = enc._mergeable_ranks
    b2u = bytes_to_unicode()
    name = lambda bs: "".join(b2u[b] for b in bs)

    def bpe_pair(token, max_rank):
        parts = [bytes([b]) for b in token]
        while True:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < max_rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
        return parts

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = bpe_pair(token, rank)
            if len(parts) != 2:
                die("tiktoken %s: token rank %d is not a merge of two lower-ranked tokens" % (enc.name, rank))
            merges.append([name(parts[0]), name(parts[1])])
    # the special tokens are in the model's vocabulary too (as the tokenizers library's trainers put
    # them), else the library gives their ids to the model's last tokens
    vocab = {name(t): r for t, r in ranks.items()}
    vocab.update(enc._special_tokens)
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for s, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1])]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
          "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                    "vocab": vocab, "merges": merges}}
    return json.dumps(tj, ensure_ascii=False)


def tiktoken_tokenizer(enc, bos_token, eos_token):
    from tokenizers import Tokenizer
    text = tiktoken_json(enc)
    tk = Tokenizer.from_str(text)
    t = Tok()
    t.encode_batch = lambda texts: enc.encode_ordinary_batch(texts)
    vocab = tk.get_vocab(with_added_tokens=True)
    specials = set(enc._special_tokens)
    t.vocab_size = max(vocab.values()) + 1
    t.bos = pick_special(vocab, specials, bos_token, None, BOS_NAMES)
    t.eos = pick_special(vocab, specials, eos_token, None, EOS_NAMES)
    t.json, t.name, t.hf = text, "tokenizer.json", tk
    return t


# ---- shards ------------------------------------------------------------------------------------

def write_shard(path, src, start, count, width):
    """An NVLTOK shard of tokens [start, start + count) of the raw token file src (width-byte ids)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as h, open(src, "rb") as f:
        h.write(MAGIC + struct.pack("<IIQ", 1, width, count))
        f.seek(start * width)
        left = count * width
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            h.write(chunk)
            left -= len(chunk)
        h.flush()
        os.fsync(h.fileno())
    os.replace(tmp, path)


def tokenize(tok, files, a, raw_path, width):
    """Tokenize every document into raw_path (ids back to back, little-endian). -> document lengths"""
    import numpy as np
    dtype = "<u2" if width == 2 else "<u4"
    eos = None if a.no_eos else tok.eos
    lengths, batch, nbytes = [], [], []
    bar = Progress(sum(os.path.getsize(f) for f in files), "prepare_data")
    with open(raw_path, "wb") as out:
        def flush():
            for ids in tok.encode_batch(batch):
                d = ([tok.bos[1]] if a.bos else []) + list(ids) + ([eos[1]] if eos else [])
                out.write(np.asarray(d, dtype=dtype).tobytes())
                lengths.append(len(d))
            bar.update(sum(nbytes))
            batch.clear()
            nbytes.clear()

        for text, size in documents(files, a.split, a.text_field):
            batch.append(text)
            nbytes.append(size)
            if len(batch) >= a.batch:
                flush()
        flush()
    bar.close()
    return lengths


def check_tiktoken(tok, enc_name, files, a):
    """The converted tokenizer.json must encode the first documents as tiktoken does."""
    sample = []
    for text, _ in documents(files, a.split, a.text_field):
        sample.append(text[:20000])
        if len(sample) == 200:
            break
    mine = [e.ids for e in tok.hf.encode_batch(sample, add_special_tokens=False)]
    if mine != [list(x) for x in tok.encode_batch(sample)]:
        die("the tokenizer.json converted from tiktoken %s encodes the data differently" % enc_name)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("out", help="output directory")
    ap.add_argument("inputs", nargs="+", help="text files, directories, or *.jsonl files")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokenizer", help="a tokenizer.json, a directory holding one, or 'bytes'")
    g.add_argument("--tiktoken", help="a tiktoken encoding name (cl100k_base, o200k_base, ...), or a local "
                   ".tiktoken file (offline: path/to/cl100k_base.tiktoken)")
    ap.add_argument("--tiktoken-encoding", help="the encoding a --tiktoken file holds (default: its file name)")
    ap.add_argument("--split", choices=["file", "line", "paragraph"], default="file",
                    help="documents of a text file (default: the whole file)")
    ap.add_argument("--text-field", default="text", help="the JSONL field holding a document (default text)")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--bos", action="store_true", help="put the bos token before every document")
    ap.add_argument("--no-eos", action="store_true", help="no eos token after every document")
    ap.add_argument("--bos-token", help="the bos token's text (default: as the tokenizer says)")
    ap.add_argument("--eos-token", help="the eos token's text (default: as the tokenizer says)")
    ap.add_argument("--prompt", default="And ", help="the text of the end-of-run sample's prompt (default 'And ')")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per train shard")
    ap.add_argument("--batch", type=int, default=1000, help="documents tokenized at a time")
    ap.add_argument("--overwrite", action="store_true", help="replace the shards OUT_DIR holds")
    a = ap.parse_args()
    if not 0 < a.val_fraction < 1:
        die("--val-fraction must be a number in (0, 1), got %r" % a.val_fraction)
    if a.shard_tokens < 1:
        die("--shard-tokens must be an integer >= 1, got %d" % a.shard_tokens)
    if a.batch < 1:
        die("--batch must be an integer >= 1 (documents tokenized at a time), got %d" % a.batch)
    if a.tokenizer is not None and a.tokenizer != "bytes":
        a.tokenizer = tokenizer_path(a.tokenizer)
    a.tiktoken_file = None
    if a.tiktoken is not None and (os.sep in a.tiktoken or a.tiktoken.endswith(".tiktoken")):
        if not os.path.isfile(a.tiktoken):
            die("--tiktoken %s: no such file (give an encoding name or a .tiktoken file)" % a.tiktoken)
        a.tiktoken_file = a.tiktoken
    if a.tiktoken_encoding is not None and a.tiktoken_file is None:
        die("--tiktoken-encoding names the encoding of a --tiktoken file; --tiktoken gives none")
    return a


def local_tiktoken(path, name):
    """The tiktoken Encoding `name` with the ranks of the local .tiktoken file at path: name's constructor
    (tiktoken_ext.openai_public) run with its BPE file read from path, so nothing is downloaded."""
    import hashlib
    from unittest import mock
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext import openai_public
    ctors = openai_public.ENCODING_CONSTRUCTORS
    if name is None:
        base = os.path.basename(path)
        name = base[:-len(".tiktoken")] if base.endswith(".tiktoken") else base
    if name not in ctors or name == "gpt2":
        die("--tiktoken %s: no known encoding is named '%s' (the file's name, or --tiktoken-encoding; known: %s)" %
            (path, name, ", ".join(sorted(n for n in ctors if n != "gpt2"))))
    published = []

    def read_local(url, expected_hash=None):
        published.append(expected_hash)
        try:
            # TIKTOKEN_CACHE_DIR="": tiktoken reads the file without keeping a copy in its cache
            with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):
                return load_tiktoken_bpe(path)
        except (ValueError, IndexError) as e:  # a line that is not "base64 rank"
            die("--tiktoken %s: not a .tiktoken file (lines of base64(token) and rank): %s" % (path, e))

    def no_download(*args, **kwargs):
        die("--tiktoken %s: encoding %s is not made from one .tiktoken file" % (path, name))

    with mock.patch.object(openai_public, "load_tiktoken_bpe", read_local), \
            mock.patch.object(openai_public, "data_gym_to_mergeable_bpe_ranks", no_download):
        params = ctors[name]()
    with open(path, "rb") as h:
        digest = hashlib.sha256(h.read()).hexdigest()
    if published and published[0] and digest != published[0]:
        print("prepare_data: note: %s is not the published %s file (SHA-256 %s): its ranks are used with %s's "
              "pattern and special tokens" % (path, name, digest, name), file=sys.stderr)
    try:
        return tiktoken.Encoding(**params)
    except (ValueError, AssertionError) as e:  # e.g. a vocabulary size the encoding fixes
        die("--tiktoken %s: not a %s encoding: %s" % (path, name, e or "its vocabulary size differs"))


def make_tokenizer(a):
    if a.tiktoken:
        try:
            import tiktoken
        except ImportError:
            die("--tiktoken needs the tiktoken package (pip install tiktoken)")
        if a.tiktoken_file:
            enc = local_tiktoken(a.tiktoken_file, a.tiktoken_encoding)
        else:
            try:
                enc = tiktoken.get_encoding(a.tiktoken)
            except ValueError as e:
                die("--tiktoken %s: %s" % (a.tiktoken, e))
            except Exception as e:  # the download failed (requests' and urllib's errors)
                die("--tiktoken %s: cannot get the encoding's BPE file (%s: %s); offline, give a local file "
                    "(--tiktoken path/to/%s.tiktoken) or TIKTOKEN_CACHE_DIR (--help)" %
                    (a.tiktoken, type(e).__name__, e, a.tiktoken))
        tok = tiktoken_tokenizer(enc, a.bos_token, a.eos_token)
    elif a.tokenizer == "bytes":
        tok = byte_tokenizer()
    else:
        try:
            tok = hf_tokenizer(a.tokenizer, a.bos_token, a.eos_token)
        except ImportError:
            die("--tokenizer needs the tokenizers package (pip install tokenizers)")
    if a.bos and not tok.bos:
        die("--bos: the tokenizer has no bos token (give --bos-token)")
    return tok


def main():
    a = parse_args()
    tok = make_tokenizer(a)
    width = 2 if tok.vocab_size <= 65536 else 4

    files = input_files(a.inputs)
    if not files:
        die("no input files")
    if a.tiktoken:
        check_tiktoken(tok, a.tiktoken, files, a)
    os.makedirs(a.out, exist_ok=True)
    old = sorted(f for f in os.listdir(a.out) if f.endswith(".bin") and f.startswith(("train", "val")))
    if old and not a.overwrite:
        die("%s already holds shards (%s); --overwrite replaces them" % (a.out, ", ".join(old[:3])))
    for f in old:
        os.remove(os.path.join(a.out, f))
    raw = os.path.join(a.out, "tokens.raw.tmp")
    try:
        lengths = tokenize(tok, files, a, raw, width)
        total = sum(lengths)
        if len(lengths) >= 2: # the last documents, at least one, rounded up
            n_val = min(len(lengths) - 1, max(1, math.ceil(len(lengths) * a.val_fraction - 1e-9)))
            cut = sum(lengths[:len(lengths) - n_val])
            ndocs = {"train": len(lengths) - n_val, "val": n_val}
        else:
            cut = int(total * (1 - a.val_fraction))
            ndocs = {"train": len(lengths), "val": 0}
        if cut == 0 or cut == total:
            die("too little data: %d train and %d validation tokens" % (cut, total - cut))
        nshards = 0
        for start in range(0, cut, a.shard_tokens):
            write_shard(os.path.join(a.out, "train_%03d.bin" % nshards), raw, start, min(a.shard_tokens, cut - start),
                        width)
            nshards += 1
        write_shard(os.path.join(a.out, "val_000.bin"), raw, cut, total - cut, width)
    finally:
        if os.path.exists(raw):
            os.remove(raw)
    if tok.json is not None:
        with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as h:
            h.write(tok.json)
    prompt_ids = ([tok.bos[1]] if a.bos else []) + list(tok.encode_batch([a.prompt])[0])
    eos = None if a.no_eos else tok.eos
    manifest = {"format": "nvlua-data", "version": 1, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
                "bos_token": tok.bos and tok.bos[0], "bos_token_id": tok.bos and tok.bos[1],
                "eos_token": tok.eos and tok.eos[0], "eos_token_id": tok.eos and tok.eos[1],
                "prompt": {"text": a.prompt, "ids": prompt_ids}, "width": width,
                "tokens": {"train": cut, "val": total - cut}, "documents": ndocs,
                "bos_per_document": a.bos, "eos_per_document": eos is not None,
                "sources": [os.path.relpath(f, a.out) for f in files]}
    with open(os.path.join(a.out, "manifest.json"), "w", encoding="utf-8") as h:
        json.dump(manifest, h, indent=1, sort_keys=True, ensure_ascii=False)
        h.write("\n")
    print("prepare_data: %d documents -> %d train tokens in %d shard(s), %d validation tokens; vocabulary %d "
          "(width %d), bos %s, eos %s -> %s" % (len(lengths), cut, nshards, total - cut, tok.vocab_size, width,
                                                tok.bos, tok.eos, a.out))


if __name__ == "__main__":
    main()
