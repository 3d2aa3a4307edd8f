#!/usr/bin/env python3
"""scripts/make_hf_golden.py: the Hugging Face golden set of tests/test_hf.lua, made by transformers.

Tiny Llama models (vocab 64, hidden 32, 2 layers), one per case that nvlua.hf must read right:

  llama2    Llama-2-like: rope_theta 1e4, multi-head attention, untied
  llama3    Llama-3-like: rope_theta 5e5, grouped-query attention (2 query heads, 1 KV head)
  llama31   Llama-3.1-like: rope_type llama3, factor 8 (low 1, high 4, original 64 of 128 positions),
            saved sharded by transformers (max_shard_size "20KB": model-0000k-of-0000N + index)
  llama32   Llama-3.2-like: tied embeddings, rope_type llama3, factor 32
  headdim   head_dim 16 with hidden 32 and 4 heads (not hidden / heads = 8), GQA
  linear    rope_type linear, factor 4
  dynamic   rope_type dynamic (NTK), factor 2: transformers computes it for the longest sequence
            seen, never shorter than max_position_embeddings, so up to that length it is RoPE with
            theta * (factor * M / M - (factor - 1))^(D / (D - 2))
  llama2_f16, llama32_bf16   llama2 and llama32 saved in float16 / bfloat16

Each model directory under tests/data/hf/<case>/ is what transformers 5's save_pretrained wrote
(config.json with rope_parameters, model.safetensors or the shards, generation_config.json), plus:

  golden.safetensors  input_ids [2, 32] i64 (the same for every case); logits_f32 [64, 64]: the
                      logits (B*T, V) of transformers in float32 (eager attention); logits_f64_hi
                      and logits_f64_lo [64, 64] f32: the logits in float64, hi + lo (hi = the f32
                      rounding, lo = the rest), so that nvlua (no f64 dtype) reads them to ~1e-14.
                      The float64 run is transformers' model in float64 with the three places
                      that compute in float32 whatever the model's dtype computing in float64:
                      the RoPE tables (inv_freq from this script's float64 formulas, checked
                      against transformers' own float32 inv_freq), RMSNorm and the eager softmax.
                      |logits_f32 - logits_f64| is transformers' own float32 noise: the test
                      derives its tolerance from it.
  forms/v4.json       config.json as transformers 4.x (--py4) writes it: rope_theta and
                      rope_scaling, no rope_parameters
  forms/old.json      as transformers before 4.33 wrote it, by hand from v4.json: rope_scaling with
                      "type" (not "rope_type"), no head_dim, no rope_theta when it is 1e4, no
                      attention_bias/mlp_bias/attention_dropout, torch_dtype float16
  forms/t5_resave.json, forms/t4_resave.json   the round trip nvlua -> transformers -> nvlua:
                      nvlua (build/nvlua) loads the case and save_pretrained's it (sharded,
                      max_shard_size "20KB"); transformers 5 (and 4.x) from_pretrained that
                      directory, their logits are checked equal to logits_f32, and they
                      save_pretrained it again: the config.json they wrote.

Checked while generating (the script stops when one fails): every config form gives the same
logits in transformers 5 and 4.x; transformers 5 and 4.x load nvlua's sharded save with no
missing or unexpected tensor and compute logits_f32 from it bit for bit; nvlua's sharded save of
llama31 is byte for byte the one transformers wrote (index and shards); nvlua's logits are within
the tolerance tests/test_hf.lua uses. tests/data/hf/MANIFEST.json records the versions and the
numbers measured (the spread of each case, nvlua's error, how much a wrong RoPE moves the logits).

    python3 scripts/make_hf_golden.py [--out tests/data/hf] [--py4 /tmp/venv4/bin/python] [--nvlua build/nvlua]

Needs torch, transformers 5 and safetensors; --py4: a Python with transformers 4.x
(python3 -m venv --system-site-packages /tmp/venv4 && /tmp/venv4/bin/pip install "transformers<5").
Without --py4 the v4 forms are not made (the old ones are made from the v5 config) and nothing is
checked against 4.x. Weights: torch.manual_seed per case, normal(0, 1/sqrt(fan_in)) matrices, an
N(0, 1) embedding and 1 + 0.1 N(0, 1) norms, so that attention is far from uniform and a wrong
RoPE moves the logits by far more than the tolerance.
"""
import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
CASES = {
    "llama2": dict(num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, theta=10000.0),
    "llama3": dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, theta=500000.0),
    "llama31": dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, theta=500000.0,
                    scaling=LLAMA3_SCALING, shard="20KB"),
    "llama32": dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, theta=500000.0,
                    scaling=dict(LLAMA3_SCALING, factor=32.0), tie_word_embeddings=True),
    "headdim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                    theta=500000.0),
    "linear": dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, theta=10000.0,
                   scaling=dict(rope_type="linear", factor=4.0)),
    "dynamic": dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, theta=10000.0,
                    scaling=dict(rope_type="dynamic", factor=2.0)),
}
LOW_PRECISION = {"llama2_f16": ("llama2", "float16"), "llama32_bf16": ("llama32", "bfloat16")}
B, T = 2, 32
SHARD = "20KB"  # nvlua's sharded saves in the round trip

LUA_DRIVER = r"""
-- make_hf_golden.py: nvlua loads a case, computes its logits and save_pretrained's it (sharded)
local hf = require "nvlua.hf"
local st = require "nvlua.safetensors"
local lfs = require "lfs"
local src, dst, ids_path, out_path, shard = arg[1], arg[2], arg[3], arg[4], arg[5]
local model = hf.from_pretrained(src)
model:eval()
local logits = model:forward(assert(st.load(ids_path)).input_ids)      -- (B*T, V) f32
assert(st.save(out_path, {logits = logits}))
assert(lfs.mkdir(dst))
hf.save_pretrained(model, dst, {max_shard_size = shard})
"""


def die(msg):
    print("make_hf_golden: " + msg, file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        die(msg)


def config_kwargs(case, legacy):
    """LlamaConfig keyword arguments of a case: rope_parameters (transformers 5) or, legacy, the
    rope_theta and rope_scaling of transformers 4.x."""
    c = dict(CASES[case])
    theta, scaling = c.pop("theta"), c.pop("scaling", None)
    c.pop("shard", None)
    kw = dict(COMMON, **c)
    if legacy:
        kw["rope_theta"] = theta
        kw["rope_scaling"] = dict(scaling) if scaling else None
    else:
        kw["rope_parameters"] = dict(scaling or dict(rope_type="default"), rope_theta=theta)
    return kw


# ---- the worker: run under the Python given by --py4 (transformers 4.x) ------------------------------

def worker(task_path):
    """Run the tasks in a JSON file: save_config, logits, resave. Prints one JSON result line."""
    import torch
    import transformers
    from safetensors.torch import save_file
    with open(task_path) as f:
        tasks = json.load(f)
    out = {"transformers": transformers.__version__}
    for t in tasks:
        if t["op"] == "save_config":
            transformers.LlamaConfig(**t["kwargs"]).save_pretrained(t["dir"])
        elif t["op"] == "logits":
            model = load_hf(transformers, torch, t["dir"])
            ids = torch.tensor(t["ids"], dtype=torch.int64)
            with torch.no_grad():
                logits = model(input_ids=ids).logits.reshape(ids.numel(), -1).float().contiguous()
            save_file({"logits": logits}, t["out"])
        elif t["op"] == "resave":
            load_hf(transformers, torch, t["dir"]).save_pretrained(t["out"])
    print(json.dumps(out))


def load_hf(transformers, torch, path):
    """LlamaForCausalLM.from_pretrained(path) in float32, eager; fails on missing/unexpected tensors."""
    kw = dict(output_loading_info=True, attn_implementation="eager")
    try:
        model, info = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except TypeError:
        model, info = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit("make_hf_golden: %s: transformers %s loading report: %s"
                         % (path, transformers.__version__, bad))
    model.eval()
    return model


def run_py4(py4, tasks):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(tasks, f)
    r = subprocess.run([py4, os.path.abspath(__file__), "--worker", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    if r.returncode != 0:
        die("the transformers 4.x worker failed:\n" + r.stdout + r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- float64 reference ------------------------------------------------------------------------------

def inv_freq64(cfg):
    """inv_freq in float64 by the formulas of transformers' modeling_rope_utils (this case's types)."""
    import numpy as np
    p = cfg.rope_parameters
    D = cfg.head_dim
    theta, kind = p["rope_theta"], p["rope_type"]
    if kind == "dynamic":
        M, f = cfg.max_position_embeddings, p["factor"]
        theta = theta * ((f * M / M) - (f - 1)) ** (D / (D - 2))
    inv = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    if kind == "linear":
        inv = inv / p["factor"]
    if kind == "llama3":
        f, lo, hi, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv


def logits_f64(model, ids):
    """The model's logits in float64 (see the header): a copy in float64 whose RoPE tables, RMSNorm
    and attention softmax compute in float64."""
    import torch
    from transformers.models.llama import modeling_llama as ml
    m = copy.deepcopy(model).double()
    inv = torch.tensor(inv_freq64(m.config), dtype=torch.float64)
    hf_inv = model.model.rotary_emb.inv_freq.double()
    rel = ((hf_inv - inv).abs() / inv).max().item()
    check(rel < 1e-6, "inv_freq: the float64 formulas differ from transformers' float32 by %.3g" % rel)

    def rope(x, position_ids):
        freqs = position_ids[..., None].double() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        check(attention_mask is not None, "float64 run: no attention mask reached eager attention")
        w = torch.softmax(w + attention_mask[:, :, :, : k.shape[-2]], dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    m.model.rotary_emb.forward = rope
    saved = ml.LlamaRMSNorm.forward, ml.eager_attention_forward
    ml.LlamaRMSNorm.forward, ml.eager_attention_forward = rms, eager
    try:
        with torch.no_grad():
            out = m(input_ids=ids).logits
    finally:
        ml.LlamaRMSNorm.forward, ml.eager_attention_forward = saved
    check(out.dtype == torch.float64, "float64 run: logits are %s" % out.dtype)
    return out.reshape(ids.numel(), -1)


# ---- making the cases --------------------------------------------------------------------------------

def init_weights(model, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def golden(model, ids, path):
    """golden.safetensors of a model: input_ids, logits_f32, logits_f64_hi/lo. -> (l32, l64)"""
    import torch
    from safetensors.torch import save_file
    with torch.no_grad():
        l32 = model(input_ids=ids).logits.reshape(ids.numel(), -1).float()
    l64 = logits_f64(model, ids)
    hi = l64.float()
    lo = (l64 - hi.double()).float()
    save_file({"input_ids": ids, "logits_f32": l32.contiguous(), "logits_f64_hi": hi.contiguous(),
               "logits_f64_lo": lo.contiguous()}, path, metadata={"format": "pt"})
    return l32.double(), l64


def spread(a, ref):
    """max |a - ref| relative to max |ref|"""
    return ((a - ref).abs().max() / ref.abs().max()).item()


def old_form(v4, kw):
    """config.json as transformers before 4.33 wrote it (see the header), from the v4 form."""
    c = dict(v4)
    for k in ("attention_bias", "attention_dropout", "mlp_bias", "dtype", "head_dim"):
        if k != "head_dim" or kw.get("head_dim") is None:
            c.pop(k, None)
    if c.get("rope_theta") == 10000.0:
        del c["rope_theta"]
    if c.get("rope_scaling"):
        rs = dict(c["rope_scaling"])
        rs["type"] = rs.pop("rope_type")
        c["rope_scaling"] = rs
    c["torch_dtype"] = "float16"
    c["transformers_version"] = "4.31.0"
    return c


def write_json(path, obj):
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_case(transformers, torch, out, case, seed, ids, py4):
    kw = config_kwargs(case, legacy=False)
    cfg = transformers.LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    init_weights(model, seed)
    d = os.path.join(out, case)
    shutil.rmtree(d, ignore_errors=True)
    shard = CASES[case].get("shard")
    model.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    l32, l64 = golden(model, ids, os.path.join(d, "golden.safetensors"))
    forms = os.path.join(d, "forms")
    os.makedirs(forms)
    info = {"spread": spread(l32, l64), "max_abs_logit": l64.abs().max().item()}
    # how far a wrong RoPE (theta 1e4, no scaling: what nvlua read before) moves the logits
    wrong = copy.deepcopy(model)
    wrong.model.rotary_emb = type(model.model.rotary_emb)(transformers.LlamaConfig(
        **dict(kw, rope_parameters=dict(rope_type="default", rope_theta=10000.0))))
    with torch.no_grad():
        lw = wrong(input_ids=ids).logits.reshape(ids.numel(), -1).double()
    info["wrong_rope_moves"] = spread(lw, l64)
    if py4:
        run_py4(py4, [{"op": "save_config", "kwargs": config_kwargs(case, legacy=True), "dir": forms}])
        os.rename(os.path.join(forms, "config.json"), os.path.join(forms, "v4.json"))
        with open(os.path.join(forms, "v4.json")) as f:
            v4 = json.load(f)
    else:
        v4 = dict(json.load(open(os.path.join(d, "config.json"))))
        rp = v4.pop("rope_parameters")
        v4["rope_theta"] = rp.pop("rope_theta")
        v4["rope_scaling"] = rp if rp["rope_type"] != "default" else None
    write_json(os.path.join(forms, "old.json"), old_form(v4, kw))
    return model, l32, l64, info


def with_config(src, config_path, dst):
    """dst: a copy of the model directory src whose config.json is config_path."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("forms"))
    shutil.copyfile(config_path, os.path.join(dst, "config.json"))


def hf_logits(transformers, torch, path, ids):
    model = load_hf(transformers, torch, path)
    with torch.no_grad():
        return model(input_ids=ids).logits.reshape(ids.numel(), -1).float()


def check_forms(transformers, torch, out, case, ids, l32, py4, tmp):
    """Every config form of the case gives logits_f32 in transformers 5 and 4.x."""
    from safetensors.torch import load_file
    d = os.path.join(out, case)
    forms = ["old.json"] + (["v4.json"] if py4 else [])
    tasks = []
    for form in forms:
        dd = os.path.join(tmp, case + "_" + form)
        with_config(d, os.path.join(d, "forms", form), dd)
        got = hf_logits(transformers, torch, dd, ids)
        check(torch.equal(got, l32.float()), "%s: transformers 5 reads forms/%s to other logits" % (case, form))
        tasks.append({"op": "logits", "dir": dd, "ids": ids.tolist(), "out": dd + ".t4.safetensors"})
    if py4:
        tasks.append({"op": "logits", "dir": d, "ids": ids.tolist(),
                      "out": os.path.join(tmp, case + ".v5.t4.safetensors")})
        run_py4(py4, tasks)
        for t in tasks[:-1]:
            check(torch.equal(load_file(t["out"])["logits"], l32.float()),
                  "%s: transformers 4.x reads %s to other logits" % (case, t["dir"]))


def round_trip(transformers, torch, out, case, ids, l32, l64, py4, nvlua, tmp, info):
    """nvlua -> transformers (5, 4.x) -> their save -> forms/t5_resave.json, t4_resave.json."""
    from safetensors.torch import load_file, save_file
    d = os.path.join(out, case)
    ids_path = os.path.join(tmp, "ids.safetensors")
    save_file({"input_ids": ids}, ids_path, metadata={"format": "pt"})
    nv_dir, nv_out = os.path.join(tmp, case + "_nv"), os.path.join(tmp, case + "_nv.safetensors")
    drv = os.path.join(tmp, "drv.lua")
    with open(drv, "w") as f:
        f.write(LUA_DRIVER)
    r = subprocess.run([nvlua, drv, d, nv_dir, ids_path, nv_out, SHARD], cwd=REPO, capture_output=True, text=True)
    check(r.returncode == 0, "%s: nvlua failed:\n%s%s" % (case, r.stdout, r.stderr))
    nv = load_file(nv_out)["logits"].double()
    info["nvlua_error"] = spread(nv, l64)
    info["nvlua_vs_f32"] = spread(nv, l32)
    check(os.path.isfile(os.path.join(nv_dir, "model.safetensors.index.json")),
          "%s: nvlua's save is not sharded" % case)
    got = hf_logits(transformers, torch, nv_dir, ids)
    check(torch.equal(got, l32.float()), "%s: transformers 5 computes other logits from nvlua's save" % case)
    t5 = os.path.join(tmp, case + "_t5")
    load_hf(transformers, torch, nv_dir).save_pretrained(t5)
    shutil.copyfile(os.path.join(t5, "config.json"), os.path.join(d, "forms", "t5_resave.json"))
    if py4:
        t4 = os.path.join(tmp, case + "_t4")
        run_py4(py4, [{"op": "logits", "dir": nv_dir, "ids": ids.tolist(), "out": nv_dir + ".t4.safetensors"},
                      {"op": "resave", "dir": nv_dir, "out": t4}])
        check(torch.equal(load_file(nv_dir + ".t4.safetensors")["logits"], l32.float()),
              "%s: transformers 4.x computes other logits from nvlua's save" % case)
        shutil.copyfile(os.path.join(t4, "config.json"), os.path.join(d, "forms", "t4_resave.json"))
    return nv_dir


def same_files(a, b, names):
    for n in names:
        with open(os.path.join(a, n), "rb") as f, open(os.path.join(b, n), "rb") as g:
            if f.read() != g.read():
                return n
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "hf"))
    ap.add_argument("--py4", help="a Python with transformers 4.x (legacy forms and checks)")
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"), help="the nvlua binary (round trip)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)

    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    check(transformers.__version__.split(".")[0] == "5", "needs transformers 5.x, found %s" % transformers.__version__)
    check(os.access(a.nvlua, os.X_OK), "no nvlua binary at %s (build it, or pass --nvlua)" % a.nvlua)
    torch.set_num_threads(1)  # one summation order
    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, COMMON["vocab_size"], (B, T), generator=g, dtype=torch.int64)
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__, "B": B, "T": T, "cases": {}}
    if a.py4:
        manifest["transformers_4"] = run_py4(a.py4, [])["transformers"]
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, case in enumerate(CASES):
            model, l32, l64, info = make_case(transformers, torch, a.out, case, 100 + k, ids, a.py4)
            models[case] = model
            check_forms(transformers, torch, a.out, case, ids, l32, a.py4, tmp)
            nv_dir = round_trip(transformers, torch, a.out, case, ids, l32, l64, a.py4, a.nvlua, tmp, info)
            if CASES[case].get("shard"):  # nvlua's sharded save is transformers' byte for byte
                with open(os.path.join(a.out, case, "model.safetensors.index.json")) as f:
                    names = sorted(set(json.load(f)["weight_map"].values())) + ["model.safetensors.index.json"]
                diff = same_files(os.path.join(a.out, case), nv_dir, names)
                check(diff is None, "%s: nvlua's sharded save differs from transformers' in %s" % (case, diff))
                info["nvlua_shards_identical"] = names
            manifest["cases"][case] = info
        for case, (src, dtype) in LOW_PRECISION.items():
            d = os.path.join(a.out, case)
            shutil.rmtree(d, ignore_errors=True)
            low = copy.deepcopy(models[src]).to(getattr(torch, dtype))
            low.save_pretrained(d)
            up = load_hf(transformers, torch, d)  # the low-precision weights, widened exactly to float32
            l32, l64 = golden(up, ids, os.path.join(d, "golden.safetensors"))
            manifest["cases"][case] = {"spread": spread(l32, l64), "max_abs_logit": l64.abs().max().item(),
                                       "weights": dtype}
    for case, info in manifest["cases"].items():
        print("%-13s spread %.3g  max|logit| %.3g  wrong RoPE moves %s  nvlua error %s" % (
            case, info["spread"], info["max_abs_logit"], "%.3g" % info["wrong_rope_moves"] if "wrong_rope_moves" in info
            else "-", "%.3g" % info["nvlua_error"] if "nvlua_error" in info else "-"))
    write_json(os.path.join(a.out, "MANIFEST.json"), manifest)


if __name__ == "__main__":
    main()
