#!/usr/bin/env python3
"""scripts/train_tokenizer.py: train a small byte-level BPE tokenizer (Hugging Face `tokenizers`).

    python3 scripts/train_tokenizer.py OUT_DIR [--vocab 512] [FILES...]

Without FILES it trains on the King James Bible as nvlua's data.kjv prepares it (Debian's
bible-kjv: `bible -f gen1:1-rev22:21`, verse references stripped). Writes OUT_DIR/tokenizer.json
and OUT_DIR/tokenizer_config.json (bos <|begin_of_text|>, eos <|end_of_text|>, ids 0 and 1; the
256 byte tokens next, then the merges), the tokenizer that tests/data/kjv_bpe/ holds:

    python3 scripts/train_tokenizer.py tests/data/kjv_bpe --vocab 512

Byte-level (GPT-2 / Llama 3 style): every text encodes, decode gives the text back exactly.
Deterministic for the same text and vocabulary size. A tool for preparing data, not needed by nvlua.
"""
import argparse
import json
import os
import re
import subprocess
import sys

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def kjv_text():
    """The KJV as nvlua's data.kjv makes it: one verse per line, references stripped."""
    try:
        raw = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit("train_tokenizer: no `bible` program (Debian bible-kjv) and no FILES given: %s" % e)
    lines = [re.sub(rb"^\S+\d+:\d+ ", b"", ln) for ln in raw.split(b"\n") if ln]
    return (b"\n".join(lines) + b"\n").decode("utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("files", nargs="*", help="text files (default: the KJV from bible-kjv)")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size, special tokens included (default 512)")
    ap.add_argument("--min-frequency", type=int, default=2)
    a = ap.parse_args()
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("train_tokenizer: needs the `tokenizers` package (pip install tokenizers)")
    if a.vocab < 258 + 1:
        sys.exit("train_tokenizer: --vocab must exceed 258 (2 special tokens + 256 bytes)")

    texts = []
    for f in a.files:
        with open(f, encoding="utf-8") as h:
            texts.append(h.read())
    if not texts:
        texts = [kjv_text()]
    lines = [ln for t in texts for ln in t.split("\n")]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, min_frequency=a.min_frequency, show_progress=False,
                                  special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))

    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
           "clean_up_tokenization_spaces": False}
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as h:
        json.dump(cfg, h, indent=2, sort_keys=True)
        h.write("\n")
    sample = texts[0][:2000]
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample, "byte-level BPE must decode to the text"
    print("train_tokenizer: %d tokens (bos %d, eos %d) -> %s; %.2f bytes per token on the first 2000 characters"
          % (tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS), a.out,
             len(sample.encode()) / len(ids)))


if __name__ == "__main__":
    main()
