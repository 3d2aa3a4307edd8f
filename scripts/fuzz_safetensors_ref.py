#!/usr/bin/env python3
"""scripts/fuzz_safetensors_ref.py: mutated safetensors files with the reference implementation's
verdict, to measure how often nvlua's reader (lua/nvlua/safetensors.lua) agrees with it.

A tool, never needed by the test suite: it needs `pip install safetensors numpy` (checked with
safetensors 0.8.0). It builds small valid files, mutates them (bytes: bit flips, interesting
bytes, truncation, extension, header-length edits, inserted/deleted bytes; JSON: duplicate
fields/entries/keys, swapped or unknown dtypes, huge/negative/float/malformed numbers, deleted and
added fields, wrong types, whitespace, escapes, deep nesting), and asks the reference
(safetensors.deserialize, i.e. the Rust crate's SafeTensors::read_metadata) to accept or reject
each. It also writes the verdict nvlua is expected to give: the reference's, except for the
deliberate differences documented in safetensors.lua, which this script recognises on its own
(from the bytes, with Python's json module), never by running nvlua:
    lead_ws      the header does not begin with '{' (the format's README: it MUST)
    trail_ws     the header is padded with something other than spaces (README: spaces, 0x20)
    dup_key      a key repeats in some object (README: duplicate keys are disallowed)
    entry_list   a tensor entry written as a JSON array (serde's struct-as-sequence)
    dtype        a format dtype nvlua has no tensor type for
    shape_limit  more than 8 dims, a dim above 2^53, or dims whose running product nvlua cannot hold

Output: one line per case, "<ref> <expected> <tag> <hex of the file>", ref and expected A(ccept) or
R(eject), tag one of the above or '-'. Check it with scripts/fuzz.sh --ref FILE (or the test
suite's copy, tests/data/safetensors_ref_corpus.txt, made with --sample).

    python scripts/fuzz_safetensors_ref.py --cases 5000 --seed 1 --out /tmp/corpus.txt
    python scripts/fuzz_safetensors_ref.py --cases 20000 --seed 13 --sample 500 \
        --out tests/data/safetensors_ref_corpus.txt
"""
import argparse
import json
import random
import struct
import sys

from safetensors import deserialize

REF_DTYPES = {  # the reference's Dtype enum: bits per element
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
NV_DTYPES = {"F32": 4, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}
BAD_DTYPES = ["f32", "F33", "", "FLOAT", "F32 ", "bf16", "Q4"]
WEIRD_NUMBERS = ["-1", "1.0", "2.0", "1e3", "8e0", "-0", "00", "01", "+1", "0x10", "NaN", "Infinity", "-Infinity",
                 "9007199254740992", "9007199254740993", "18446744073709551615", "18446744073709551616",
                 "9223372036854775807", "9223372036854775808", "4611686018427387904", "1e400", "1E2", "0.5",
                 "-9223372036854775808", "4294967296", "1" + "0" * 30, "8.", ".8", "1e", "--1", "0"]
ODD_VALUES = ["1.5", "[1,{\"a\":null}]", "true", "false", "null", "\"x\"", "{}", "[]", "1e400", "NaN", "-0",
              "{\"k\":1,\"k\":2}", "\"\\ud800\"", "\"\\u00e9\"", "123456789012345678901234567890"]
INTERESTING_BYTES = [0x00, 0xff, 0x7f, 0x80, 0x20, 0x09, 0x0a, 0x0d, ord('"'), ord('{'), ord('}'), ord('['),
                     ord(']'), ord(','), ord(':'), ord('\\'), ord('-'), ord('.'), ord('e'), ord('0'), ord('1'),
                     ord('9'), 0xc3, 0xed, 0xf4]


class Obj(list):
    """A JSON object as its (key, value) pairs, in order (duplicates allowed)."""


class Raw(str):
    """JSON text emitted as is."""


def emit(v, rng=None):
    ws = (lambda: rng.choice(["", "", "", " ", "\n", "\t", "\r\n "])) if rng and rng.random() < 0.05 else (lambda: "")
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Obj):
        return "{" + ws() + ",".join(emit(k) + ws() + ":" + ws() + emit(x, rng) for k, x in v) + ws() + "}"
    if isinstance(v, list):
        return "[" + ",".join(emit(x, rng) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return json.dumps(v)


def pack(header, data, pad=True):
    if pad:
        header = header + b" " * ((8 - len(header) % 8) % 8)
    return struct.pack("<Q", len(header)) + header + data


def make_seed(rng):
    """A valid file: a few tensors of nvlua's dtypes laid out back to back, optional metadata."""
    n = rng.randint(0, 4)
    entries, data, off = [], b"", 0
    for i in range(n):
        dt = rng.choice(list(NV_DTYPES))
        shape = rng.choice([[], [0], [2], [3], [2, 2], [1, 3], [0, 4], [2, 1, 2], [5]])
        size = NV_DTYPES[dt]
        for d in shape:
            size *= d
        name = rng.choice(["w", "model.layers.%d.weight" % i, "t%d" % i, "é%d" % i, "a\"b%d" % i, "x/%d" % i])
        entries.append((name + str(i), Obj([("dtype", dt), ("shape", shape), ("data_offsets", [off, off + size])])))
        data += bytes(rng.randrange(256) for _ in range(size))
        off += size
    rng.shuffle(entries)
    pairs = list(entries)
    if rng.random() < 0.7:
        meta = Obj([("format", "pt")] + ([("step", str(rng.randint(0, 99)))] if rng.random() < 0.5 else []))
        pairs.insert(rng.randint(0, len(pairs)), ("__metadata__", meta))
    return Obj(pairs), data


def bump(x, d):
    """x + d, at least 0, for a plain integer; anything else (a Raw token) as it is."""
    return max(0, x + d) if type(x) is int else x


def entries_of(hdr):
    return [(i, k, v) for i, (k, v) in enumerate(hdr) if k != "__metadata__" and isinstance(v, Obj)]


def json_mutation(rng, hdr, data):
    """One structural edit of the header (in place); returns the data section, maybe extended."""
    kind = rng.randrange(14)
    if kind < 7:
        edit_entry(rng, hdr, kind)
        return data
    return edit_header(rng, hdr, data, kind)


def edit_entry(rng, hdr, kind):
    """Edits inside tensor entries: fields duplicated, swapped, malformed, deleted, added, retyped."""
    ents = entries_of(hdr)
    if kind == 0 and ents:  # duplicate a field, maybe with another value
        _, _, e = rng.choice(ents)
        if e:
            k, v = rng.choice(list(e))
            if k == "dtype" and rng.random() < 0.7:
                v = rng.choice(list(NV_DTYPES))
            e.insert(rng.randint(0, len(e)), (k, v))
    elif kind == 1 and ents:  # swap the dtype
        _, _, e = rng.choice(ents)
        pool = list(REF_DTYPES) + BAD_DTYPES if rng.random() < 0.5 else list(NV_DTYPES)
        val = rng.choice(pool + [Raw("null"), Raw("1")])
        for j, (k, _) in enumerate(e):
            if k == "dtype":
                e[j] = (k, val)
    elif kind == 2 and ents:  # a weird number in shape or data_offsets
        _, _, e = rng.choice(ents)
        for j, (k, v) in enumerate(e):
            if k in ("shape", "data_offsets") and isinstance(v, list) and v and rng.random() < 0.7:
                v = list(v)
                p = rng.randrange(len(v))
                v[p] = Raw(rng.choice(WEIRD_NUMBERS)) if rng.random() < 0.7 else bump(v[p], rng.choice([-8, -1, 1, 8]))
                e[j] = (k, v)
    elif kind == 3 and hdr:  # delete a field or an entry
        if ents and rng.random() < 0.6:
            _, _, e = rng.choice(ents)
            if e:
                del e[rng.randrange(len(e))]
        else:
            del hdr[rng.randrange(len(hdr))]
    elif kind == 4 and ents:  # an unknown field
        _, _, e = rng.choice(ents)
        val = Raw(rng.choice(ODD_VALUES)) if rng.random() < 0.8 else Raw("[" * rng.randint(118, 130) + "]" * 130)
        e.insert(rng.randint(0, len(e)), (rng.choice(["foo", "offsets", "dtype2", ""]), val))
    elif kind == 5 and ents:  # wrong types
        i, k, e = rng.choice(ents)
        fields = dict(e)
        choice = rng.randrange(6)
        if choice == 0:
            hdr[i] = (k, Raw(rng.choice(["[]", "{}", "null", "1", "\"x\""])))
        elif choice == 1:
            hdr[i] = (k, [fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")])
        else:
            field = rng.choice(["shape", "data_offsets", "dtype"])
            for j, (fk, _) in enumerate(e):
                if fk == field:
                    e[j] = (fk, Raw(rng.choice(["{}", "[]", "[0]", "[0,8,8]", "null", "\"8\"", "[[2]]", "{\"0\":0}"])))
    elif kind == 6 and ents:  # duplicate a whole entry (same name)
        i, k, e = rng.choice(ents)
        copy = Obj(list(e)) if rng.random() < 0.6 else Obj([("dtype", "U8"), ("shape", [0]), ("data_offsets", [0, 0])])
        hdr.insert(rng.randint(0, len(hdr)), (k, copy))


def edit_header(rng, hdr, data, kind):
    """Edits of the header's layout: metadata, escapes, offsets, extra tensors, absurd shapes."""
    ents = entries_of(hdr)
    if kind == 7:  # metadata edits
        val = rng.choice([Raw("null"), Raw("[]"), Obj([("a", "1"), ("a", "2")]), Obj([("a", Raw("1"))]),
                          Obj([("a", "b")]), Raw("{\"x\":null}"), Obj([])])
        key = "__metadata__" if rng.random() < 0.8 else Raw('"\\u005f_metadata__"')
        if rng.random() < 0.5:
            hdr[:] = [(k, v) for k, v in hdr if k != "__metadata__"]
        hdr.insert(rng.randint(0, len(hdr)), (key, val))
    elif kind == 8 and ents:  # escapes in a name
        i, k, e = rng.choice(ents)
        esc = rng.choice(["\\u0041", "\\ud800", "\\udc00", "\\ud83d\\ude00", "\\x", "\t", "\\/", "\\u00", "\\\\",
                          "\\U0041", "\x01", "\x7f"])
        hdr[i] = (Raw('"' + k.replace('"', '\\"') + esc + '"'), e)
    elif kind == 9 and len(ents) >= 2:  # swap the offsets of two tensors
        (_, _, a), (_, _, b) = rng.sample(ents, 2)
        oa = [v for k, v in a if k == "data_offsets"]
        ob = [v for k, v in b if k == "data_offsets"]
        if oa and ob:
            a[:] = [(k, ob[0] if k == "data_offsets" else v) for k, v in a]
            b[:] = [(k, oa[0] if k == "data_offsets" else v) for k, v in b]
    elif kind == 10:  # an extra tensor: empty, overlapping, or appended with its data
        dt = rng.choice(list(NV_DTYPES) + ["F16", "BOOL", "F4"])
        end = len(data)
        if rng.random() < 0.5:
            shape, size = [rng.choice([0, 1, 2]), rng.choice([0, 9007199254740993, 4294967296, 3])], 0
            shape = shape if 0 in shape else [0] + shape
        else:
            shape = [rng.randint(1, 3)]
            size = shape[0] * REF_DTYPES.get(dt, 8) // 8
            data = data + bytes(size)
        shape = shape + [1] * (rng.choice([0, 0, 7, 8]))
        hdr.insert(rng.randint(0, len(hdr)), ("new", Obj([("dtype", dt), ("shape", shape),
                                                          ("data_offsets", [end, end + size])])))
    elif kind == 11 and ents:  # shift an offset
        _, _, e = rng.choice(ents)
        for j, (k, v) in enumerate(e):
            if k == "data_offsets" and isinstance(v, list) and len(v) == 2:
                d = rng.choice([-4, -1, 1, 2, 4, 8])
                e[j] = (k, [bump(v[0], d), bump(v[1], d)] if rng.random() < 0.5 else [v[0], bump(v[1], d)])
    elif kind == 12 and ents:  # a big but overflow-free shape of an empty tensor
        _, _, e = rng.choice(ents)
        shape = rng.choice([[0, 2 ** 53], [2 ** 53 + 1, 0], [2 ** 32, 2 ** 31, 0], [0, 2 ** 40, 2 ** 40],
                            [2 ** 40, 2 ** 40, 0], [2 ** 60, 0], [1] * 9 + [0], [2 ** 62, 4, 0]])
        for j, (k, v) in enumerate(e):
            if k == "shape":
                e[j] = (k, [Raw(str(d)) for d in shape])
            elif k == "data_offsets" and isinstance(v, list) and len(v) == 2:
                e[j] = (k, [v[0], v[0]])
    return data


def byte_mutation(rng, b):
    n = struct.unpack("<Q", b[:8])[0] if len(b) >= 8 else 0
    hdr_end = min(len(b), 8 + n)
    kind = rng.randrange(7)
    pos = rng.randrange(8, hdr_end) if hdr_end > 8 and rng.random() < 0.7 else rng.randrange(max(1, len(b)))
    if kind == 0 and b:
        b = bytearray(b)
        b[pos % len(b)] ^= 1 << rng.randrange(8)
    elif kind == 1 and b:
        b = bytearray(b)
        b[pos % len(b)] = rng.choice(INTERESTING_BYTES)
    elif kind == 2:
        b = b[:rng.randrange(len(b) + 1)]
    elif kind == 3:
        b = b + (bytes(rng.randint(1, 16)) if rng.random() < 0.5 else b" " * rng.randint(1, 9))
    elif kind == 4 and len(b) >= 8:
        new = rng.choice([n + 1, n - 1, n + 8, n - 8, 0, rng.randrange(len(b) + 16), 2 ** 63, 2 ** 64 - 1,
                          100000001, n | (0x80 << 56), len(b) - 8])
        b = struct.pack("<Q", new % 2 ** 64) + b[8:]
    elif kind == 5:
        b = b[:pos] + bytes([rng.choice(INTERESTING_BYTES)]) + b[pos:]
    elif kind == 6 and b:
        b = b[:pos] + b[pos + 1:]
    return bytes(b)


def mutate(rng):
    hdr, data = make_seed(rng)
    nj = rng.choice([0, 1, 1, 1, 2, 3])
    for _ in range(nj):
        data = json_mutation(rng, hdr, data)
    text = emit(hdr, rng).encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:
        text = rng.choice([b" ", b"\n", b"\t"]) + text
    trail = rng.choice([b"", b"", b"", b"\n", b"\t", b"\r", b"  \n"]) if rng.random() < 0.1 else b""
    b = pack(text + trail, data, pad=rng.random() < 0.9)
    nb = rng.choice([0, 0, 0, 1, 2]) if nj else rng.choice([1, 1, 2, 3])
    for _ in range(nb):
        b = byte_mutation(rng, b)
    return b


def reference_verdict(b):
    try:
        deserialize(b)
        return "A"
    except Exception:  # the binding raises SafetensorError (and others) for every malformed file
        return "R"


def nvlua_difference(b):
    """For a file the reference accepts: the tag of a documented difference nvlua refuses, or None."""
    n = struct.unpack("<Q", b[:8])[0]
    text = b[8:8 + n].decode("utf-8")
    if not text.startswith("{"):
        return "lead_ws"
    _, end = json.JSONDecoder().raw_decode(text)
    if text[end:].strip(" "):
        return "trail_ws"
    dup = []

    def pairs_hook(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            dup.append(True)
        return dict(pairs)

    hdr = json.loads(text, object_pairs_hook=pairs_hook)
    if dup:
        return "dup_key"
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        if isinstance(e, list):
            return "entry_list"
        if e["dtype"] not in NV_DTYPES:
            return "dtype"
        shape = e["shape"]
        if len(shape) > 8:
            return "shape_limit"
        p = 1  # nvlua's size rule: the dims, a 0 counted as 1, multiply to at most (2^63 - 1) // 16
        for d in shape:
            d1 = d if d > 0 else 1
            if d > 2 ** 53 or p > (2 ** 63 - 1) // 16 // d1:
                return "shape_limit"
            p *= d1
    return None


def probes():
    """Hand-written cases: each rule and each documented difference at least once."""
    d8 = b"\0" * 8
    a = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    cases = [
        ("{%s}" % a, d8), (" {%s}" % a, d8), ("{%s}\n" % a, d8), ("{%s}\t " % a, d8), ("{%s}\0" % a, d8),
        ('{"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}}', d8),
        ("{%s,%s}" % (a, a), d8), ('{"__metadata__":{"x":"1","x":"2"},%s}' % a, d8),
        ('{"__metadata__":{},"__metadata__":{},%s}' % a, d8), ('{"__metadata__":null,%s}' % a, d8),
        ('{"__metadata__":[],%s}' % a, d8), ('{"__metadata__":{"x":null},%s}' % a, d8),
        ('{"\\u005f_metadata__":{"x":"y"},%s}' % a, d8), ('{"a":["F32",[2],[0,8]]}', d8), ('{"a":[]}', d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"foo":[1,{"x":null}]}}', d8),
        ('{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', d8),
        ('{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', b""),
        ('{"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}}', d8),
        ('{"a":{"dtype":"F32","shape":[+2],"data_offsets":[0,8]}}', d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', d8),
        ('{"a":{"dtype":"F32","shape":{},"data_offsets":[0,4]}}', d8[:4]),
        ('{"a":{"dtype":"F32","shape":[18446744073709551615,0],"data_offsets":[0,0]}}', b""),
        ('{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b""),
        ('{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}', b""),
        ('{"a":{"dtype":"F32","shape":[0,9007199254740992],"data_offsets":[0,0]}}', b""),
        ('{"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}', d8),
        ('{"a":{"dtype":"F\\u0033\\u0032","shape":[2],"data_offsets":[0,8]}}', d8),
        ('{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8),
        ('{"\\ud83d\\ude00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8),
        ('{"\\ud800\\u0041":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8),
        ('{"a\\x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8),
        ('{"a\tb":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8),
        ('{"a\x7f":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8),
        ("{}", b""), ("{}", d8), ("", b""), ("[]", b""), ("{%s}   x" % a, d8),
        ('{"a" : {"dtype" :"F32" ,\n"shape":[ 2 ],\r"data_offsets":[0,\t8]}}', d8),
        ('{"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,8]}}', d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e400}}', d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1.7976931348623157e308}}', d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}' % ("[" * 125 + "]" * 125), d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}' % ("[" * 126 + "]" * 126), d8),
        ('{"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}}', d8),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[0],"data_offsets":[8,8]}}',
         d8),
    ]
    out = [pack(h.encode("utf-8", "surrogatepass"), d, pad=False) for h, d in cases]
    out.append(pack(b'{"\xed\xa0\x80":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', d8, pad=False))
    out.append(pack(b'\xef\xbb\xbf{}', b"", pad=False))
    out.append(struct.pack("<Q", 100000001) + b"{}")
    out.append(b"\x02\0\0\0\0\0\0")
    return out


def classify(b):
    ref = reference_verdict(b)
    tag = nvlua_difference(b) if ref == "A" else None
    return ref, ("R" if tag else ref), tag or "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sample", type=int, default=0,
                    help="keep the probes, up to 30 cases of each documented difference, and this many others "
                         "(half accepted), for a small committed corpus")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = [(b,) + classify(b) for b in probes()]
    nprobe = len(rows)
    seen = set()
    for _ in range(args.cases):
        b = mutate(rng)
        if b in seen:
            continue
        seen.add(b)
        rows.append((b,) + classify(b))
    if args.sample:
        fuzzed = rows[nprobe:]
        keep, per_tag = [], {}
        for r in fuzzed:
            if r[1] != r[2] and per_tag.get(r[3], 0) < 30:
                per_tag[r[3]] = per_tag.get(r[3], 0) + 1
                keep.append(r)
        acc = [r for r in fuzzed if r[1] == r[2] == "A"]
        rej = [r for r in fuzzed if r[1] == r[2] == "R"]
        keep += acc[:args.sample // 2] + rej[:args.sample - min(len(acc), args.sample // 2)]
        rows = rows[:nprobe] + keep
    with open(args.out, "w") as f:
        f.write("# made by scripts/fuzz_safetensors_ref.py --cases %d --seed %d%s (safetensors reference verdicts)\n"
                % (args.cases, args.seed, " --sample %d" % args.sample if args.sample else ""))
        for b, ref, exp, tag in rows:
            f.write("%s %s %s %s\n" % (ref, exp, tag, b.hex()))
    counts = {}
    for _, ref, exp, tag in rows:
        counts[(ref, exp, tag)] = counts.get((ref, exp, tag), 0) + 1
    print("%d cases (%d probes) -> %s" % (len(rows), nprobe, args.out))
    for k in sorted(counts):
        print("  ref %s expected %s %-12s %d" % (k[0], k[1], k[2], counts[k]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
