#!/usr/bin/env python3
"""scripts/check_tiktoken_offline.py: scripts/prepare_data.py --tiktoken FILE, the offline route, on a
small synthetic cl100k_base.tiktoken (the 256 bytes as ranks 0-255, then the merges "th", "the", " c",
" ca"), with TIKTOKEN_CACHE_DIR pointed at an empty directory:
  * the shards hold the ids worked out by hand from those merges under cl100k_base's pattern, each
    document ended by cl100k_base's <|endoftext|> (100257); the manifest's vocabulary is 100277
    (its last special token, <|endofprompt|>, is 100276), so ids are u32;
  * the tokenizer.json written encodes as tiktoken does (the tokenizers library);
  * the file is not the published one: a note on stderr says so; nothing was downloaded (the proxy is a
    closed port) and nothing was written to TIKTOKEN_CACHE_DIR;
  * --tiktoken-encoding names the encoding of a file named otherwise; a missing file, an unknown name,
    a malformed file and a file whose size the encoding fixes otherwise (r50k_base) are refused, naming
    the file.
Exit 0: passed; 1: failed; 77: skipped (tiktoken, tokenizers or numpy missing: pip install tiktoken
tokenizers numpy). Run by .ci/run and by tests/test_tokenizer.lua when python3 has them.
"""
import base64
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PREPARE = os.path.join(HERE, "prepare_data.py")

try:
    import numpy  # noqa: F401  (prepare_data.py writes the shards with it)
    import tiktoken  # noqa: F401
    import tokenizers
except ImportError as e:
    print("check_tiktoken_offline: skipped: %s (pip install tiktoken tokenizers numpy)" % e)
    sys.exit(77)

MERGES = [b"th", b"the", b" c", b" ca"]  # ranks 256, 257, 258, 259
DOCS = ["the cat", "the hat", "the the", "a cat"]
EOT = 100257
# by hand: cl100k_base's pattern splits "the cat" into "the", " cat"; "the" merges t+h (256) then th+e
# (257); " cat" merges " "+c (258), then " c"+a (259), and " ca"+t is no merge: 259, "t" (116). " hat" has
# no merge: its bytes. " the" is " " (32) and "the" (257). The last document is the validation split.
TRAIN = [257, 259, 116, EOT, 257, 32, 104, 97, 116, EOT, 257, 32, 257, EOT]
VAL = [97, 259, 116, EOT]

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL " + what)


def write_tiktoken(path, lines=None):
    if lines is None:
        ranks = [bytes([b]) for b in range(256)] + MERGES
        lines = ["%s %d" % (base64.b64encode(t).decode(), r) for r, t in enumerate(ranks)]
    with open(path, "w") as h:
        h.write("\n".join(lines) + "\n")
    return path


def prepare(out, docs, *args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([sys.executable, PREPARE, out, docs, "--split", "line", "--val-fraction", "0.25"] + list(args),
                       capture_output=True, text=True, env=e)
    return r.returncode, r.stdout, r.stderr


def read_shard(path):
    with open(path, "rb") as h:
        raw = h.read()
    magic, (version, width, count) = raw[:8], struct.unpack("<IIQ", raw[8:24])
    assert magic == b"NVLTOK\0\0" and version == 1, path
    fmt = {2: "<%dH", 4: "<%dI"}[width] % count
    return width, list(struct.unpack(fmt, raw[24:24 + width * count]))


def main():
    tmp = tempfile.mkdtemp(prefix="nvlua-tiktoken-")
    docs = os.path.join(tmp, "docs.txt")
    with open(docs, "w") as h:
        h.write("\n".join(DOCS) + "\n")
    cache = os.path.join(tmp, "tiktoken-cache")
    os.mkdir(cache)
    # a download would fail at once: the proxy is a closed port
    env = {"TIKTOKEN_CACHE_DIR": cache, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": "", "no_proxy": ""}
    enc_file = write_tiktoken(os.path.join(tmp, "cl100k_base.tiktoken"))

    out = os.path.join(tmp, "out")
    code, _, err = prepare(out, docs, "--tiktoken", enc_file, env=env)
    check(code == 0, "prepare_data --tiktoken FILE exits 0 (stderr: %s)" % err)
    if code == 0:
        width, train = read_shard(os.path.join(out, "train_000.bin"))
        check(width == 4, "u32 ids for a vocabulary of 100277 (got width %d)" % width)
        check(train == TRAIN, "train ids %s, expected %s" % (train, TRAIN))
        _, val = read_shard(os.path.join(out, "val_000.bin"))
        check(val == VAL, "validation ids %s, expected %s" % (val, VAL))
        with open(os.path.join(out, "manifest.json")) as h:
            m = json.load(h)
        check(m["vocab_size"] == 100277, "manifest vocab_size %s" % m["vocab_size"])
        check((m["eos_token"], m["eos_token_id"]) == ("<|endoftext|>", EOT), "manifest eos %s" % m["eos_token"])
        tk = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        ids = tk.encode("the cat the hat", add_special_tokens=False).ids
        check(ids == [257, 259, 116, 32, 257, 32, 104, 97, 116], "tokenizer.json encodes 'the cat the hat' as %s" % ids)
        check("is not the published cl100k_base file" in err, "a note says the file is not the published one: " + err)
        check(os.listdir(cache) == [], "nothing written to TIKTOKEN_CACHE_DIR: %s" % os.listdir(cache))

    # a file named otherwise, with --tiktoken-encoding
    other = write_tiktoken(os.path.join(tmp, "ranks.txt"))
    code, _, err = prepare(os.path.join(tmp, "out2"), docs, "--tiktoken", other, "--tiktoken-encoding", "cl100k_base",
                           env=env)
    check(code == 0, "--tiktoken-encoding cl100k_base with ranks.txt: exit 0 (%s)" % err)
    if code == 0:
        check(read_shard(os.path.join(tmp, "out2", "train_000.bin"))[1] == TRAIN, "--tiktoken-encoding: the same ids")

    os.mkdir(os.path.join(tmp, "bad"))
    bad_lines = write_tiktoken(os.path.join(tmp, "bad", "cl100k_base.tiktoken"), ["dGg= 256", "oops"])
    r50k = write_tiktoken(os.path.join(tmp, "r50k_base.tiktoken"))
    for args, message in [
            (["--tiktoken", os.path.join(tmp, "none.tiktoken")], "none.tiktoken: no such file"),
            (["--tiktoken", other], "no known encoding is named 'ranks.txt'"),
            (["--tiktoken", enc_file, "--tiktoken-encoding", "gpt2"], "no known encoding is named 'gpt2'"),
            (["--tiktoken", bad_lines], "not a .tiktoken file"),
            (["--tiktoken", r50k], "r50k_base.tiktoken: not a r50k_base encoding"),
            (["--tiktoken", "cl100k_base", "--tiktoken-encoding", "cl100k_base"], "--tiktoken gives none")]:
        code, _, err = prepare(os.path.join(tmp, "refused"), docs, *args, env=env)
        check(code == 2 and message in err and "Traceback" not in err,
              "%s: refused with %r (exit %d, stderr %r)" % (" ".join(args), message, code, err))
    check(not os.path.exists(os.path.join(tmp, "refused")), "a refused run writes nothing")

    if failures:
        print("check_tiktoken_offline: %d failed (scratch kept in %s)" % (len(failures), tmp))
        return 1
    subprocess.run(["rm", "-rf", tmp])
    print("check_tiktoken_offline: passed (tiktoken %s, tokenizers %s)" % (tiktoken.__version__, tokenizers.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
