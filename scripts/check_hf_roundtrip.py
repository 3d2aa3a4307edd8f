#!/usr/bin/env python3
"""scripts/check_hf_roundtrip.py: nvlua -> transformers -> nvlua, for every RoPE nvlua computes.
A check for a machine with PyTorch and transformers (CI can run it; the Lua suite needs neither).

    python3 scripts/check_hf_roundtrip.py [--nvlua build/nvlua] [--max-shard-size 20KB] [--keep DIR]

For each case (RoPE default with theta 1e4 and 5e5, llama3 scaling, tied + llama3, linear, dynamic,
head_dim != hidden / heads, a model width-pruned by nvlua.prune):
1. nvlua makes a tiny Llama (initializer_range 0.5, so that attention is far from uniform),
   computes its logits on fixed ids and hf.save_pretrained's it with max_shard_size (sharded:
   model-0000k-of-0000N.safetensors + model.safetensors.index.json);
2. transformers.LlamaForCausalLM.from_pretrained loads that directory (float32, eager): the loading
   report must show no missing, unexpected or mis-shaped tensor, its RoPE parameters must be the
   case's, and its logits must agree with nvlua's within rtol * max|logit| + atol (by default
   check_hf_export.py's 1e-5 and 1e-6); a model with the RoPE nvlua read before issue 12 (theta
   1e4, no scaling) must disagree by far more than that, or the comparison would prove nothing;
3. transformers save_pretrained's it again, and nvlua (hf.from_pretrained) reads that: the same
   rope_theta and rope_scaling, and the logits of step 1 bit for bit.
Prints one line per case; exits 0 when every case passes, 1 when one does not, 2 when something is
missing (PyTorch, transformers, the nvlua binary). Run it under transformers 5 and under 4.x.
"""
import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.5)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
CASES = {
    "default_1e4": dict(rope_theta=10000.0, num_key_value_heads=2),
    "default_5e5": dict(rope_theta=500000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling=LLAMA3),
    "tied_llama3": dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3, factor=32.0), tie_word_embeddings=True),
    "linear": dict(rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=4.0)),
    "dynamic": dict(rope_theta=10000.0, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    "head_dim": dict(rope_theta=500000.0, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # nvlua.prune.width's output: 32 -> 24 channels, 4 -> 2 heads in 1 KV group, 64 -> 40 neurons
    "pruned": dict(rope_theta=500000.0, num_attention_heads=4, num_key_value_heads=2,
                   _prune=dict(ffn=40, heads=2, kv_heads=1, hidden=24)),
}

LUA_DRIVER = r"""
-- check_hf_roundtrip.py's nvlua side. make: a model from a config, its logits, save_pretrained;
-- load: hf.from_pretrained, its logits. Both print the RoPE of the model's config as JSON.
local hf = require "nvlua.hf"
local st = require "nvlua.safetensors"
local llama = require "nvlua.llama"
local cjson = require "cjson"
local mode, dir, ids_path, out_path = arg[1], arg[2], arg[3], arg[4]
local model
if mode == "make" then
  local cfg = cjson.decode(arg[5])
  local pr = cfg._prune -- a width-pruned model (nvlua.prune), importance from the case's ids
  cfg._prune = nil
  model = llama.Llama(cfg, {seed = tonumber(arg[6])})
  if pr then
    local prune = require "nvlua.prune"
    model = prune.width(model, prune.importance(model, assert(st.load(ids_path)).input_ids), pr)
  end
else
  model = hf.from_pretrained(dir)
end
model:eval()
assert(st.save(out_path, {logits = model:forward(assert(st.load(ids_path)).input_ids)}))
if mode == "make" then hf.save_pretrained(model, dir, {max_shard_size = arg[7]}) end
print(cjson.encode({rope_theta = model.config.rope_theta, rope_scaling = model.config.rope_scaling or cjson.null}))
"""


def die(msg, code=2):
    print("check_hf_roundtrip: " + msg, file=sys.stderr)
    sys.exit(code)


def nvlua(binary, drv, *args):
    r = subprocess.run([binary, drv] + [str(a) for a in args], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("nvlua failed (exit %d):\n%s%s" % (r.returncode, r.stdout, r.stderr))
    return json.loads(r.stdout.strip().splitlines()[-1])


def load_hf(transformers, torch, path):
    kw = dict(output_loading_info=True, attn_implementation="eager")
    try:
        model, info = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model, info = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kw)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return model.eval(), problems


def hf_rope(transformers, config):
    """(theta, scaling) of a transformers config, scaling without rope_theta (None: none). 4.x reads
    rope_theta and rope_scaling ("type" or "rope_type"), 5.x rope_parameters."""
    if transformers.__version__.split(".")[0] == "4":
        rs = dict(config.rope_scaling) if config.rope_scaling else None
        if rs:
            rs["rope_type"] = rs.pop("rope_type", None) or rs.pop("type")
            rs.pop("type", None)
        return config.rope_theta, (rs if rs and rs["rope_type"] != "default" else None)
    rp = dict(config.rope_parameters)
    theta = rp.pop("rope_theta")
    return theta, (rp if rp["rope_type"] != "default" else None)


def wrong_rope(transformers, model):
    """a copy of model with the RoPE nvlua read before issue 12: theta 1e4, no scaling"""
    cfg = copy.deepcopy(model.config)
    if transformers.__version__.split(".")[0] == "4":
        cfg.rope_theta, cfg.rope_scaling = 10000.0, None
    else:
        cfg.rope_parameters = dict(rope_type="default", rope_theta=10000.0)
    wrong = copy.deepcopy(model)
    wrong.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    return wrong.eval()


def run_case(name, extra, seed, a, mods, tmp, drv, ids_path):
    torch, transformers, load_file = mods
    cfg = dict(BASE, **extra)
    d1, d2 = os.path.join(tmp, name + "_nvlua"), os.path.join(tmp, name + "_transformers")
    os.makedirs(d1)
    l1_path, l2_path = os.path.join(tmp, name + "_1.safetensors"), os.path.join(tmp, name + "_2.safetensors")
    rope1 = nvlua(a.nvlua, drv, "make", d1, ids_path, l1_path, json.dumps(cfg), seed, a.max_shard_size)
    problems = []
    if not os.path.isfile(os.path.join(d1, "model.safetensors.index.json")):
        problems.append("nvlua's save is not sharded (lower --max-shard-size)")
    l1 = load_file(l1_path)["logits"].double()
    model, report = load_hf(transformers, torch, d1)
    if report:
        problems.append("transformers' loading report: %s" % report)
    want_scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    theta, scaling = hf_rope(transformers, model.config)
    if theta != cfg["rope_theta"] or scaling != want_scaling:
        problems.append("transformers reads RoPE theta %s scaling %s, expected %s %s"
                        % (theta, scaling, cfg["rope_theta"], want_scaling))
    ids = load_file(ids_path)["input_ids"]
    with torch.no_grad():
        ref = model(input_ids=ids).logits.reshape(ids.numel(), -1).double()
    scale = ref.abs().max().item()
    tol = a.rtol * scale + a.atol
    diff = (l1 - ref).abs().max().item()
    if diff > tol:
        problems.append("logits: max |nvlua - transformers| %.3g > tolerance %.3g" % (diff, tol))
    moved = None
    if name not in ("default_1e4", "dynamic"):  # those are plain RoPE with theta 1e4 up to max_position_embeddings
        with torch.no_grad():
            lw = wrong_rope(transformers, model)(input_ids=ids).logits.reshape(ids.numel(), -1).double()
        moved = (lw - ref).abs().max().item()
        if moved < 100 * tol:
            problems.append("a wrong RoPE moves the logits by only %.3g: the comparison proves nothing" % moved)
    model.save_pretrained(d2)
    rope2 = nvlua(a.nvlua, drv, "load", d2, ids_path, l2_path)
    if rope2 != rope1:
        problems.append("nvlua reads transformers' save as %s, it wrote %s" % (rope2, rope1))
    if not torch.equal(load_file(l1_path)["logits"], load_file(l2_path)["logits"]):
        problems.append("nvlua's logits from transformers' save differ from the original's")
    print("%-12s max|logit| %7.3f  max|nvlua - transformers| %.3g (tolerance %.3g)  wrong RoPE moves %s  %s" % (
        name, scale, diff, tol, "%.3g" % moved if moved is not None else "-", "OK" if not problems else "FAIL"))
    for p in problems:
        print("    " + p)
    return not problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"), help="the nvlua binary")
    ap.add_argument("--max-shard-size", default="20KB", help="nvlua's save_pretrained max_shard_size (default 20KB)")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--keep", help="a directory to keep the models in (default: a temporary one)")
    a = ap.parse_args()
    try:
        import torch
        import transformers
        from safetensors.torch import load_file, save_file
    except ImportError as e:
        die("needs PyTorch, transformers and safetensors (pip install torch transformers safetensors): %s" % e)
    if not os.access(a.nvlua, os.X_OK):
        die("no nvlua binary at %s (build it, or pass --nvlua)" % a.nvlua)
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    tmp = a.keep or tempfile.mkdtemp(prefix="check_hf_roundtrip.")
    if a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    try:
        drv, ids_path = os.path.join(tmp, "drv.lua"), os.path.join(tmp, "ids.safetensors")
        with open(drv, "w") as f:
            f.write(LUA_DRIVER)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, BASE["vocab_size"], (2, 32), generator=g, dtype=torch.int64)
        save_file({"input_ids": ids}, ids_path, metadata={"format": "pt"})
        ok = True
        for k, (name, extra) in enumerate(CASES.items()):
            try:
                ok = run_case(name, extra, k + 1, a, (torch, transformers, load_file), tmp, drv, ids_path) and ok
            except RuntimeError as e:
                print("%-12s FAIL\n    %s" % (name, e))
                ok = False
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
