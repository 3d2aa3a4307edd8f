#!/usr/bin/env python3
"""scripts/check_tensorboard.py: does TensorBoard's own reader read nvlua's event files as metrics.jsonl?

    python3 scripts/check_tensorboard.py               # trains a tiny run with build/nvlua (and resumes it), checks it
    python3 scripts/check_tensorboard.py RUN_DIR...    # checks runs you have (out= directories)

Without arguments it trains (build/nvlua, a few seconds, CPU) a tiny Llama under recipe=mor for 6 steps with an
eval every 3 and a checkpoint every 2, removes the checkpoints of steps 4 and 6 (a run that died after step 2's) and
resumes it with resume=auto: its out/tb then holds two events files, the first cut back to step 2. For each run
directory, with the tensorboard package (nvlua never imports it):
  * every file in <run>/tb is named events.out.tfevents.<10-digit unix time>.<host>.<pid>.<n>, and its records
    read with TensorBoard's RawEventFileLoader (which checks the masked CRC-32Cs) are Event protos, the first
    holding only file_version "brain.Event:2";
  * across the files, each scalar (tag, step) is written once, as simple_value, and the scalars are exactly
    metrics.jsonl's numbers rounded to float32: each step record's finite numeric fields under train/, perf/
    (ms, tokens_per_s, mfu, sync and gather fields) or mor/ (mor_<x>: mor/<x>), train/skipped_steps the count of
    skipped records so far, each eval record's val_loss and val_ppl under eval/;
  * EventAccumulator (TensorBoard's loader for the scalar and text dashboards) lists the same scalars;
  * the config, a text-plugin tensor at step 0, is config.json's text indented as a markdown code block (only the
    resume key may differ: config.json is rewritten by a resumed run).
Exits 0 when everything holds, 1 when something does not, 77 (skipped) when tensorboard cannot be imported
(CI's .ci/run installs it into a virtualenv from PyPI when it can).
"""
import argparse
import glob
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

TRAIN = r"""
local train = require "nvlua.train"
local config = require "nvlua.config"
local c = config.parse(train.defaults, arg)
local p = train.build(c)
p.peak = 1e9
train.run(c, p)
"""
TINY = ["data=" + os.path.join(REPO, "tests", "data", "kjv_bpe", "genesis.txt"), "layers=2", "hidden=64", "heads=4",
        "kv_heads=2", "ffn=128", "seq=32", "batch=4", "steps=6", "lr=1e-2", "eval_every=3", "eval_batches=2",
        "ckpt_every=2", "keep=0", "sample_tokens=0", "plot=false", "quiet=true", "recipe=mor"]
PERF = {"ms", "tokens_per_s", "mfu", "sync_ms", "sync_wait_ms", "gather_bytes", "qgather_bytes",
        "qgather_bf16_bytes"}
NAME = re.compile(r"^events\.out\.tfevents\.\d{10}\.[^/]+\.\d+\.\d+$")

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)
    return cond


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def finite_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def expected_scalars(run):
    """{(tag, step): value} that metrics.jsonl says the events files hold"""
    want, skipped = {}, 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            step = rec["step"]
            if "val_loss" in rec:
                want[("eval/val_loss", step)] = rec["val_loss"]
                want[("eval/val_ppl", step)] = rec["val_ppl"]
                continue
            if "loss" not in rec:  # ckpt_every=auto's records
                continue
            skipped += 1 if rec.get("skipped") else 0
            want[("train/skipped_steps", step)] = skipped
            for k, v in rec.items():
                if k == "step" or not finite_number(v):
                    continue
                tag = "mor/" + k[4:] if k.startswith("mor_") else ("perf/" if k in PERF else "train/") + k
                want[(tag, step)] = v
    return want


def check_run(run):
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    tbdir = os.path.join(run, "tb")
    files = sorted(glob.glob(os.path.join(tbdir, "*")))
    check(len(files) > 0, "%s: events files in tb/ (%d)" % (run, len(files)))
    got, texts = {}, []
    for path in files:
        name = os.path.basename(path)
        check(NAME.match(name) is not None, "%s: named events.out.tfevents.<time>.<host>.<pid>.<n>" % name)
        records = list(RawEventFileLoader(path).Load())
        events = [event_pb2.Event.FromString(r) for r in records]
        size = sum(len(r) + 16 for r in records)  # + the length, its CRC and the data's CRC
        check(size == os.path.getsize(path), "%s: every byte read as a record (%d events)" % (name, len(events)))
        check(len(events) > 0 and events[0].file_version == "brain.Event:2" and not events[0].HasField("summary"),
              "%s: the first event is the file version brain.Event:2" % name)
        for e in events[1:]:
            for v in e.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    got.setdefault((v.tag, e.step), []).append(v.simple_value)
                elif v.metadata.plugin_data.plugin_name == "text":
                    texts.append((v.tag, e.step, tensor_util.make_ndarray(v.tensor)))
                else:
                    check(False, "%s: an unexpected value %s at step %d" % (name, v.tag, e.step))
    want = expected_scalars(run)
    dup = [k for k, vs in got.items() if len(vs) != 1]
    check(not dup, "%s: each (tag, step) written once%s" % (run, " (again: %s)" % dup[:5] if dup else ""))
    check(set(got) == set(want), "%s: the scalars are metrics.jsonl's (%d): missing %s, extra %s" % (
        run, len(want), sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5]))
    bad = [(k, want[k], got[k][0]) for k in want if k in got and got[k][0] != f32(want[k])]
    check(not bad, "%s: every value is metrics.jsonl's rounded to float32%s" % (run, (": %s" % bad[:5]) if bad else ""))
    tags = {k[0] for k in want}
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    musts = ["train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu"]
    musts += ["eval/val_loss"] if config.get("eval_every") else []
    musts += ["mor/low"] if str(config.get("recipe")).startswith("mor") else []
    for must in musts:
        check(must in tags, "%s: %s logged" % (run, must))

    acc = ea.EventAccumulator(tbdir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    seen = {(t, s.step): s.value for t in acc.Tags()["scalars"] for s in acc.Scalars(t)}
    check(seen == {k: f32(v) for k, v in want.items()}, "%s: EventAccumulator's scalars are the same" % run)

    check(len(texts) == 1 and texts[0][:2] == ("config", 0), "%s: one config text, at step 0" % run)
    if texts:
        text = texts[0][2].item().decode()
        lines = text.splitlines()
        check(all(l.startswith("    ") for l in lines), "%s: the config is a markdown code block" % run)
        shown = json.loads("\n".join(l[4:] for l in lines))
        for c in (shown, config):
            c.pop("resume", None)
        check(shown == config, "%s: the config text is config.json's" % run)
    check("config" in acc.Tags()["tensors"] and
          acc.SummaryMetadata("config").plugin_data.plugin_name == "text", "%s: the text plugin's config" % run)


def train_run(nvlua, tmp):
    drv = os.path.join(tmp, "train.lua")
    with open(drv, "w") as f:
        f.write(TRAIN)
    run = os.path.join(tmp, "run")
    base = TINY + ["cache=" + os.path.join(tmp, "cache"), "out=" + run]
    for extra in ([], ["resume=auto"]):
        r = subprocess.run([nvlua, drv] + base + extra, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            print("check_tensorboard: nvlua failed (exit %d):\n%s%s" % (r.returncode, r.stdout, r.stderr),
                  file=sys.stderr)
            sys.exit(1)
        if not extra:  # a run that died after its checkpoint of step 2: steps 3..6 run again
            for step in (4, 6):
                shutil.rmtree(os.path.join(run, "checkpoints", "step-%06d" % step))
    check(len(os.listdir(os.path.join(run, "tb"))) == 2, "the resumed run wrote a second events file")
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="run (out=) directories (default: train one here)")
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"))
    a = ap.parse_args()
    try:
        import tensorboard  # noqa: F401
    except ImportError as e:
        print("check_tensorboard: SKIPPED: needs the tensorboard package (pip install tensorboard): %s" % e)
        sys.exit(77)
    if a.runs:
        for run in a.runs:
            check_run(run)
    else:
        if not os.access(a.nvlua, os.X_OK):
            print("check_tensorboard: no nvlua binary at %s (build it, or pass --nvlua)" % a.nvlua, file=sys.stderr)
            sys.exit(1)
        with tempfile.TemporaryDirectory() as tmp:
            check_run(train_run(a.nvlua, tmp))
    print("check_tensorboard: %s" % ("OK" if not failures else "%d FAILED: %s" % (len(failures), "; ".join(failures))))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
