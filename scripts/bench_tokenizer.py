#!/usr/bin/env python3
"""scripts/bench_tokenizer.py: Hugging Face `tokenizers` encode throughput, single-threaded, on one text.

    TOKENIZERS_PARALLELISM=false python3 scripts/bench_tokenizer.py TEXT_FILE TOKENIZER.json... [--seconds S] [--json]

The other half of scripts/bench_tokenizer.lua (which runs this and prints both with their ratio): each
tokenizer encodes the text two ways, each as many times as fit in S seconds (at least once): "text",
the whole text in one call (Tokenizer.encode, add_special_tokens=False), and "lines", its lines (each
with its "\n") in one encode_batch call, which with TOKENIZERS_PARALLELISM=false runs on one thread.
Prints MB/s (10^6 bytes of UTF-8 text per second, the best of the repeats) and the ids' count and a
checksum of them, or with --json one JSON object {file: {"text": {"mb_s":, "ids":, "sum":}, "lines":
{...}}} for the Lua script.
"""
import argparse
import json
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402


def checksum(ids):
    """sum of (i + 1) * id mod 2^61 - 1, the same in scripts/bench_tokenizer.lua"""
    m, s = (1 << 61) - 1, 0
    for i, v in enumerate(ids):
        s = (s + (i + 1) * v) % m
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text")
    ap.add_argument("tokenizers", nargs="+")
    ap.add_argument("--seconds", type=float, default=3.0, help="time per tokenizer (default 3)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with open(a.text, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    lines = text.splitlines(keepends=True)
    out = {}
    for path in a.tokenizers:
        tok = Tokenizer.from_file(path)
        out[path] = {}
        for mode in ("text", "lines"):
            best, spent, ids = float("inf"), 0.0, None
            while ids is None or spent < a.seconds:
                t0 = time.perf_counter()
                if mode == "text":
                    ids = tok.encode(text, add_special_tokens=False).ids
                else:
                    ids = [i for e in tok.encode_batch(lines, add_special_tokens=False) for i in e.ids]
                dt = time.perf_counter() - t0
                best, spent = min(best, dt), spent + dt
            out[path][mode] = {"mb_s": len(raw) / best / 1e6, "ids": len(ids), "sum": checksum(ids)}
    if a.json:
        json.dump(out, sys.stdout)
        print()
    else:
        print("%-40s %6s %10s %10s" % ("tokenizer", "mode", "MB/s", "ids"))
        for p, r in out.items():
            for mode, m in r.items():
                print("%-40s %6s %10.2f %10d" % (p, mode, m["mb_s"], m["ids"]))


if __name__ == "__main__":
    main()
