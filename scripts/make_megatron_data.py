#!/usr/bin/env python3
"""scripts/make_megatron_data.py: write a Megatron-LM indexed dataset (<prefix>.bin + <prefix>.idx)
as Megatron-LM's tools/preprocess_data.py does, for nvlua's tests and for users without Megatron.

    python3 scripts/make_megatron_data.py PREFIX TEXT_FILE --tokenizer tokenizer.json \
        [--docs-per 5] [--split-sentences] [--append-eod] [--dtype auto|uint8|uint16|int32|int64] [--expect FILE]

The layout follows megatron/core/datasets/indexed_dataset.py (IndexedDatasetBuilder, _IndexWriter),
written here from its description, with struct and numpy (no Megatron code):
  .bin  every sequence's ids back to back, in the dtype
  .idx  b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code (uint8 1, int8 2, int16 3, int32 4,
        int64 5, float64 6, float32 7, uint16 8), u64 sequence count S, u64 document-index
        count D, i32 lengths[S], i64 byte pointers[S] (running sum of length * itemsize from 0),
        i64 document indices[D] (0, then the sequence count at the end of each document).
dtype auto is preprocess_data's choice: uint16 for a vocabulary under 65500, else int32.
Documents: every --docs-per non-empty lines of TEXT_FILE; with --split-sentences each sentence
(split after ". ", "; ", ": ") is a sequence of its own, as preprocess_data's --split-sentences
makes one per sentence; --append-eod appends the eos token to a document's last sequence.
--expect writes the documents' sequences of ids as JSON ({"dtype", "vocab_size", "documents":
[[[ids], ...], ...]}), which tests/test_megatron.lua compares the reader with.
"""
import argparse
import json
import re
import struct
import sys

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def write_dataset(prefix, documents, dtype):
    """documents: a list of documents, each a list of sequences (lists of ids)."""
    import numpy as np
    itemsize = np.dtype(dtype).itemsize
    lengths, pointers, doc_index, ptr = [], [], [0], 0
    with open(prefix + ".bin", "wb") as b:
        for doc in documents:
            for seq in doc:
                b.write(np.asarray(seq, dtype="<" + np.dtype(dtype).str[1:]).tobytes())
                lengths.append(len(seq))
                pointers.append(ptr)
                ptr += len(seq) * itemsize
            doc_index.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(doc_index, dtype="<i8").tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prefix")
    ap.add_argument("text")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    ap.add_argument("--docs-per", type=int, default=5, help="lines per document (default 5)")
    ap.add_argument("--split-sentences", action="store_true")
    ap.add_argument("--append-eod", action="store_true")
    ap.add_argument("--eod-token", default="<|end_of_text|>")
    ap.add_argument("--dtype", default="auto", choices=["auto", "uint8", "uint16", "int32", "int64"])
    ap.add_argument("--expect", help="write the documents' ids as JSON here")
    a = ap.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("make_megatron_data: needs the tokenizers package")
    tok = Tokenizer.from_file(a.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = a.dtype if a.dtype != "auto" else ("uint16" if vocab < 65500 else "int32")
    eod = tok.token_to_id(a.eod_token)
    if a.append_eod and eod is None:
        sys.exit("make_megatron_data: %r is not in the tokenizer" % a.eod_token)
    with open(a.text, encoding="utf-8") as h:
        lines = [ln for ln in h.read().split("\n") if ln.strip()]
    documents = []
    for i in range(0, len(lines), a.docs_per):
        text = "\n".join(lines[i:i + a.docs_per]) + "\n"
        parts = re.split(r"(?<=[.;:] )", text) if a.split_sentences else [text]
        seqs = [tok.encode(p, add_special_tokens=False).ids for p in parts if p]
        if a.append_eod:
            seqs[-1] = seqs[-1] + [eod]
        documents.append(seqs)
    write_dataset(a.prefix, documents, dtype)
    if a.expect:
        with open(a.expect, "w") as h:
            json.dump({"dtype": dtype, "vocab_size": vocab, "documents": documents}, h, separators=(",", ":"))
            h.write("\n")
    n = sum(len(s) for d in documents for s in d)
    print("make_megatron_data: %d documents, %d sequences, %d tokens (%s) -> %s.bin, %s.idx"
          % (len(documents), sum(len(d) for d in documents), n, dtype, a.prefix, a.prefix))


if __name__ == "__main__":
    main()
