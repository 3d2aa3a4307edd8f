#!/usr/bin/env python3
"""scripts/check_hf_e2e.py: can a Hugging Face user use nvlua's exports end to end?

    python3 scripts/check_hf_e2e.py                  # trains two tiny models with build/nvlua, checks both
    python3 scripts/check_hf_e2e.py STEP_OR_MODEL_DIR...   # checks exports you have

Without arguments it trains (build/nvlua, a few seconds each, CPU) a tiny Llama on
  1. byte data: tests/data/kjv_bpe/genesis.txt as a text file (the byte tokenizer, vocab 256), and
  2. tests/data/kjv_bpe/ shards (the 512-token KJV BPE, bos/eos, prepared by scripts/prepare_data.py),
with max_positions=128, and checks each checkpoint's model/ directory:
  * transformers.AutoTokenizer loads it; its bos/eos ids are config.json's;
  * the tokenizer encodes text to the ids nvlua trains on: the byte export maps UTF-8 text to its
    bytes (and any bytes, valid UTF-8 or not, come back from the tokens exactly through the
    byte-level table; decode() gives Python's lossy UTF-8 decoding of them); the BPE export
    encodes each Genesis verse to the ids of the committed shards, and decode gives the text back;
  * LlamaForCausalLM.from_pretrained loads it with nothing missing, unexpected or mis-shaped, and
    scripts/check_hf_export.py finds its logits equal to nvlua's;
  * generate() and pipeline("text-generation") run and give text that starts with the prompt.
Exits 0 when everything holds, 1 when something does not, 77 (skipped) when transformers or
torch cannot be imported (CI's .ci/run installs them from PyPI when it can).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from prepare_data import bytes_to_unicode  # noqa: E402  GPT-2's byte-level table (scripts/prepare_data.py)
KJV = os.path.join(REPO, "tests", "data", "kjv_bpe")

TRAIN = r"""
local train = require "nvlua.train"
local config = require "nvlua.config"
local c = config.parse(train.defaults, arg)
local p = train.build(c)
p.peak = 1e9
local s = train.run(c, p)
print("checkpoint: " .. s.checkpoint)
"""
TINY = ["layers=2", "hidden=64", "heads=4", "kv_heads=2", "ffn=128", "seq=32", "batch=4", "steps=20", "lr=1e-2",
        "eval_every=0", "sample_tokens=0", "plot=false", "quiet=true", "recipe=bf16", "max_positions=128"]

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)
    return cond


def train_export(nvlua, tmp, name, data_args):
    drv = os.path.join(tmp, "train.lua")
    with open(drv, "w") as f:
        f.write(TRAIN)
    r = subprocess.run([nvlua, drv] + data_args + TINY + ["out=" + os.path.join(tmp, name)], cwd=REPO,
                       capture_output=True, text=True)
    if r.returncode != 0:
        print("check_hf_e2e: nvlua failed (exit %d):\n%s%s" % (r.returncode, r.stdout, r.stderr), file=sys.stderr)
        sys.exit(1)
    return r.stdout.split("checkpoint: ")[-1].strip()


def read_shard(path):
    import numpy as np
    with open(path, "rb") as f:
        head = f.read(24)
        width = int.from_bytes(head[12:16], "little")
        return np.frombuffer(f.read(), dtype="<u2" if width == 2 else "<u4").tolist()


def check_byte_tokenizer(tok, where):
    rng = random.Random(0)
    texts = ["In the beginning God created the heaven and the earth.\n", " leading  spaces\tand\ttabs ",
             "naïve café — 日本語 😀 \x00\x7f", "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(160, 0x3000)]))
                                                     for _ in range(300))]
    for s in texts:
        ids = tok(s, add_special_tokens=True)["input_ids"]
        check(ids == list(s.encode("utf-8")), "%s: encode(%r...) is the UTF-8 bytes" % (where, s[:12]))
        check(tok.decode(ids) == s, "%s: decode(encode(%r...)) gives the text back" % (where, s[:12]))
    table = {c: b for b, c in bytes_to_unicode().items()}  # character -> byte
    raw = bytes(rng.randrange(256) for _ in range(2000)) + bytes(range(256))
    ids = list(raw)
    back = bytes(table[c] for t in tok.convert_ids_to_tokens(ids) for c in t)
    check(back == raw, "%s: any bytes (not UTF-8 too) come back exactly from the tokens" % where)
    check(tok.decode(ids) == raw.decode("utf-8", "replace"), "%s: decode of non-UTF-8 bytes is Python's lossy "
          "decoding" % where)


def check_bpe_tokenizer(tok, where):
    from tokenizers import Tokenizer
    with open(os.path.join(KJV, "genesis.txt"), encoding="utf-8") as f:
        verses = [v for v in f.read().split("\n") if v]
    with open(os.path.join(KJV, "manifest.json")) as f:
        man = json.load(f)
    stream = read_shard(os.path.join(KJV, "train_000.bin")) + read_shard(os.path.join(KJV, "val_000.bin"))
    bos, eos = man["bos_token_id"], man["eos_token_id"]
    want = []
    for v in verses:
        want += [bos] + tok(v, add_special_tokens=False)["input_ids"] + [eos]
    check(want == stream, "%s: every verse encodes to the ids of the committed shards (bos, verse, eos)" % where)
    ref = Tokenizer.from_file(os.path.join(KJV, "tokenizer.json"))
    same = all(tok(v, add_special_tokens=False)["input_ids"] == ref.encode(v, add_special_tokens=False).ids
               for v in verses)
    check(same, "%s: AutoTokenizer encodes as the data's tokenizer.json does" % where)
    text = "\n".join(verses[:5])
    check(tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text, "%s: decode(encode(text)) == text"
          % where)


def check_export(path, kind):
    import torch
    import transformers
    mdir = os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path
    where = os.path.relpath(mdir)
    with open(os.path.join(mdir, "config.json")) as f:
        cfg = json.load(f)
    check(not os.path.exists(os.path.join(mdir, "trainer.safetensors")), "%s: no optimizer state in the model "
          "directory" % where)
    tok = transformers.AutoTokenizer.from_pretrained(mdir)
    check(tok.bos_token_id == cfg.get("bos_token_id") and tok.eos_token_id == cfg.get("eos_token_id"),
          "%s: tokenizer bos/eos %s/%s = config.json's %s/%s" % (where, tok.bos_token_id, tok.eos_token_id,
                                                                 cfg.get("bos_token_id"), cfg.get("eos_token_id")))
    check(tok.model_max_length == cfg["max_position_embeddings"], "%s: model_max_length %s = max_position_embeddings"
          % (where, tok.model_max_length))
    if kind == "bytes" or (kind is None and cfg["vocab_size"] == 256):
        check_byte_tokenizer(tok, where)
    elif kind == "bpe":
        check_bpe_tokenizer(tok, where)
    model, info = transformers.LlamaForCausalLM.from_pretrained(mdir, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    check(not problems, "%s: LlamaForCausalLM loads it (%s)" % (where, problems or "nothing missing or unexpected"))
    r = subprocess.run([sys.executable, os.path.join(HERE, "check_hf_export.py"), path], capture_output=True,
                       text=True)
    check(r.returncode == 0, "%s: check_hf_export.py: transformers' logits are nvlua's (%s)"
          % (where, (r.stdout.strip().splitlines() or ["?"])[-2 if r.returncode == 0 else -1]))
    if r.returncode != 0:
        print(r.stdout + r.stderr)
    model.eval()
    prompt = "And God said"
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    new = out.shape[1] - enc["input_ids"].shape[1]
    text = tok.decode(out[0], skip_special_tokens=True)
    check(1 <= new <= 16 and text.startswith(prompt), "%s: generate(): %d new tokens: %r" % (where, new, text))
    pipe = transformers.pipeline("text-generation", model=mdir, dtype=torch.float32)
    gen = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    check(gen.startswith(prompt), "%s: pipeline('text-generation'): %r" % (where, gen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("exports", nargs="*", help="checkpoint or model directories (default: train two here)")
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"))
    ap.add_argument("--keep", help="train into this directory and keep it")
    a = ap.parse_args()
    try:
        import torch  # noqa: F401
        import transformers
        import tokenizers  # noqa: F401
    except ImportError as e:
        print("check_hf_e2e: SKIPPED: needs transformers, tokenizers and torch (pip install transformers torch): %s"
              % e)
        sys.exit(77)
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.exports:
        for p in a.exports:
            check_export(p, None)
    else:
        if not os.access(a.nvlua, os.X_OK):
            print("check_hf_e2e: no nvlua binary at %s (build it, or pass --nvlua)" % a.nvlua, file=sys.stderr)
            sys.exit(1)
        tmp_ctx = None if a.keep else tempfile.TemporaryDirectory()
        tmp = a.keep or tmp_ctx.name
        os.makedirs(tmp, exist_ok=True)
        try:
            b = train_export(a.nvlua, tmp, "bytes", ["data=" + os.path.join(KJV, "genesis.txt"),
                                                     "cache=" + os.path.join(tmp, "cache")])
            check_export(b, "bytes")
            s = train_export(a.nvlua, tmp, "bpe", ["data=shards:" + KJV])
            check_export(s, "bpe")
        finally:
            if tmp_ctx:
                tmp_ctx.cleanup()
    print("check_hf_e2e: %s" % ("OK" if not failures else "%d FAILED: %s" % (len(failures), "; ".join(failures))))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
