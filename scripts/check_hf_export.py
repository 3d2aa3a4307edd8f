#!/usr/bin/env python3
"""scripts/check_hf_export.py: does Hugging Face transformers load an nvlua checkpoint and compute
the same logits? A manual check (CI has no PyTorch); tests/test_checkpoint.lua covers the rest.

    python3 scripts/check_hf_export.py runs/run/checkpoints/step-000300
    python3 scripts/check_hf_export.py CKPT --ids ids.txt        # one sequence per line, ids by spaces
    python3 scripts/check_hf_export.py CKPT --batch 2 --seq 32 --seed 0   # random ids (the default)

1. transformers.LlamaForCausalLM.from_pretrained(CKPT) in float32 with eager attention; the
   loading report must show no missing, unexpected or mis-shaped tensors;
2. nvlua (build/nvlua, or --nvlua) runs a small Lua driver: checkpoint.from_pretrained(CKPT) under
   the f32 recipe, forward on the same ids, logits saved with nvlua.safetensors;
3. the logits [B*T, V] are compared: max |diff| must be <= rtol * max|logit| + atol (by default
   tests/test_llama_golden.lua's 1e-5 and 1e-6: the same fp32 arithmetic in another order).
Prints the numbers; exits 0 when they agree, 1 when not, 2 when something is missing.

The directory may be sharded (model.safetensors.index.json); scripts/check_hf_roundtrip.py checks
every RoPE type both ways (nvlua -> transformers -> nvlua).

Not checked here: the training state (trainer.*), low-precision recipes (an exported checkpoint
holds the fp32 master weights; HF runs them in fp32, and so does nvlua here).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

LUA_DRIVER = r"""
local ckpt = require "nvlua.checkpoint"
local st = require "nvlua.safetensors"
local recipe = require "nvlua.recipe"
local dir, ids_path, out_path = arg[1], arg[2], arg[3]
local model = ckpt.from_pretrained(dir, {recipe = recipe.f32()})
model:eval()
local t = assert(st.load(ids_path))
local logits = model:forward(t.input_ids)            -- (B*T, V) f32
assert(st.save(out_path, {logits = logits}))
print(string.format("nvlua: %s, %d parameters", model:extra_repr(), model:num_parameters()))
"""


def die(msg, code=2):
    print("check_hf_export: " + msg, file=sys.stderr)
    sys.exit(code)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="a checkpoint directory (its model/), or a model directory (config.json + "
                    "model.safetensors, or sharded)")
    ap.add_argument("--ids", help="token ids: a text file, one sequence per line (equal lengths)")
    ap.add_argument("--batch", type=int, default=2, help="random ids: sequences (default 2)")
    ap.add_argument("--seq", type=int, default=0, help="random ids: length (default min(32, max positions))")
    ap.add_argument("--seed", type=int, default=0, help="random ids: torch seed (default 0)")
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"), help="the nvlua binary")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--atol", type=float, default=1e-6)
    a = ap.parse_args()

    try:
        import torch
        import transformers
        from safetensors.torch import load_file, save_file
    except ImportError as e:
        die("needs PyTorch, transformers and safetensors (pip install torch transformers safetensors): %s" % e)

    if os.path.isdir(os.path.join(a.ckpt, "model")):  # a checkpoint: the model directory inside
        a.ckpt = os.path.join(a.ckpt, "model")
    if not os.path.isfile(os.path.join(a.ckpt, "config.json")):
        die("%s has no config.json: not a checkpoint directory" % a.ckpt)
    if not any(os.path.isfile(os.path.join(a.ckpt, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
        die("%s has no model.safetensors or model.safetensors.index.json: not a checkpoint directory" % a.ckpt)
    if not os.access(a.nvlua, os.X_OK):
        die("no nvlua binary at %s (build it, or pass --nvlua)" % a.nvlua)
    with open(os.path.join(a.ckpt, "config.json")) as f:
        cfg = json.load(f)

    if a.ids:
        with open(a.ids) as f:
            rows = [[int(x) for x in line.split()] for line in f if line.strip()]
        if not rows or len({len(r) for r in rows}) != 1:
            die("%s: need one or more sequences of equal length" % a.ids)
        ids = torch.tensor(rows, dtype=torch.int64)
    else:
        seq = a.seq or min(32, cfg["max_position_embeddings"])
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, cfg["vocab_size"], (a.batch, seq), generator=g, dtype=torch.int64)
    if int(ids.max()) >= cfg["vocab_size"] or int(ids.min()) < 0:
        die("ids must be in [0, %d)" % cfg["vocab_size"])

    # Hugging Face
    kw = dict(output_loading_info=True, attn_implementation="eager")
    try:
        model, info = transformers.LlamaForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32, **kw)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model, info = transformers.LlamaForCausalLM.from_pretrained(a.ckpt, torch_dtype=torch.float32, **kw)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits.reshape(-1, cfg["vocab_size"]).float()
    print("transformers %s, torch %s: %s, %d parameters" % (transformers.__version__, torch.__version__,
          type(model).__name__, sum(p.numel() for p in model.parameters())))

    # nvlua
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path, drv = (os.path.join(tmp, n) for n in ("ids.safetensors", "logits.safetensors", "drv.lua"))
        save_file({"input_ids": ids.contiguous()}, ids_path, metadata={"format": "pt"})
        with open(drv, "w") as f:
            f.write(LUA_DRIVER)
        r = subprocess.run([a.nvlua, drv, a.ckpt, ids_path, out_path], cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            die("nvlua failed (exit %d):\n%s%s" % (r.returncode, r.stdout, r.stderr))
        print(r.stdout.strip())
        got = load_file(out_path)["logits"]

    if tuple(got.shape) != tuple(ref.shape):
        die("logits shapes differ: nvlua %s, transformers %s" % (tuple(got.shape), tuple(ref.shape)), 1)
    diff = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    tol = a.rtol * scale + a.atol
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print("ids %s; logits %s" % (tuple(ids.shape), tuple(ref.shape)))
    print("max |logit| %.6g, max |nvlua - transformers| %.3g (relative %.3g), tolerance %.3g; argmax agrees on %.1f%%"
          % (scale, diff, diff / max(scale, 1e-30), tol, 100 * agree))
    if problems:
        print("loading report: %s" % problems)
    ok = diff <= tol and not problems
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
