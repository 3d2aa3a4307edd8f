#!/usr/bin/env python3
"""scripts/check_deploy.py: nvlua's quantized exports (nvlua.deploy) read by the libraries engines use.
A check for a machine with PyTorch, compressed-tensors and transformers (CI runs it; the Lua suite
needs none of them; nvidia-modelopt is used where it installs).

    python3 scripts/check_deploy.py [--nvlua build/nvlua] [--keep DIR]

nvlua trains tiny Llamas 3 steps under nvfp4, mxfp4 and fp8_cs and exports them (ModelOpt and
compressed-tensors NVFP4 with calibration, compressed-tensors MXFP4, both FP8 layouts); it also writes
its own decoding of each exported weight (deploy.quantize's QTensors, dequantized: f32) and its logits
(recipe f32) for the model holding those weights rounded to bf16 and every other parameter as exported
(bf16). Then:
1. safetensors: each file, loaded with safetensors.torch and saved again (metadata {"format": "pt"}),
   is byte for byte nvlua's (the dtype order of the F8_E4M3 tensors included).
2. config: compressed-tensors parses config.json's quantization_config (QuantizationConfig); ModelOpt's
   hf_quant_config.json has producer, quant_algo, kv_cache_quant_algo, group_size (NVFP4) and
   exclude_modules, and config.json holds the same in the flat form ModelOpt writes there (quant_algo,
   ignore, producer, config_groups with NVFP4's group_size: what vLLM's flat-format parsing reads). The
   ignore / exclude_modules lists are exactly the linears stored as plain bf16 weights.
3. compressed-tensors' decompressors (NVFP4PackedCompressor, MXFP4PackedCompressor, the float-quantized
   one) turn each compressed-tensors export into dense weights equal to nvlua's decoded ones. NVFP4 and
   MXFP4 come out in bf16 (the library rounds to bf16): compared with nvlua's f32 values rounded to bf16
   (RNE), NVFP4 may differ by 1 bf16 ulp where the library's f32 value (code * (scale / s_enc), two
   roundings) and nvlua's (code * scale * (amax / 2688), one) fall on two sides of a bf16 rounding
   boundary; MXFP4 (a power-of-two scale) must match exactly. FP8 comes out in f32: within 1 f32 ulp
   (nvlua divides by scale; the library multiplies by the stored 1 / scale).
4. compressed-tensors' ModelOpt NVFP4 converter accepts nvlua's ModelOpt export; decompressed, the same
   dense weights as the compressed-tensors export, up to 1 bf16 ulp (its weight_global_scale is
   1 / weight_scale_2, which can differ from nvlua's s_enc = 2688 / amax in the last bit).
5. nvidia-modelopt's NVFP4QTensor.dequantize (pure torch) decodes the ModelOpt export to nvlua's values
   within 1 f32 ulp (it rounds scale * weight_scale_2 first, then the product). Skipped, with the reason,
   where nvidia-modelopt does not import.
6. transformers (AutoModelForCausalLM, CPU) loads the compressed-tensors exports; after its decompression
   (a first forward, loaded in bf16) the activations' fake quantization is turned off and the model cast
   to f32: its logits equal nvlua's within 1e-5 * max|logit| + 1e-6 (check_hf_export.py's bound: the same
   f32 weights, summed in another order) when the weights it holds are nvlua's bf16 values exactly, which
   the script checks first.
Exits 0 when every check holds, 1 when one does not, 2 when the nvlua binary is missing, 77 (skipped)
when PyTorch, compressed-tensors, transformers or safetensors cannot be imported.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

LUA_DRIVER = r"""
-- check_deploy.py's nvlua side: train, export, decode, forward. arg[1] = the output directory.
local nv = require "nvlua"
local llama = require "nvlua.llama"
local hf = require "nvlua.hf"
local st = require "nvlua.safetensors"
local deploy = require "nvlua.deploy"
local out = arg[1]
local CFG = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 64, rms_norm_eps = 1e-5}
local function ids(g) return (nv.rand({2, 32}, {generator = g}) * 64):to("i64") end
local function trained(name) return require("nvlua.test").trained_llama(CFG, name, ids) end
local cal = {ids(nv.Generator(9)), ids(nv.Generator(10))}
local x = ids(nv.Generator(11))
local EXPORTS = {
  {"nvfp4", "nvfp4_modelopt", {quantize = "nvfp4", format = "modelopt", calibration = cal}},
  {"nvfp4", "nvfp4_ct", {quantize = "nvfp4", format = "compressed-tensors", calibration = cal}},
  {"mxfp4", "mxfp4_ct", {quantize = "mxfp4", format = "compressed-tensors"}},
  {"fp8_cs", "fp8_modelopt", {quantize = "fp8", format = "modelopt", calibration = cal}},
  {"fp8_cs", "fp8_ct", {quantize = "fp8", format = "compressed-tensors", calibration = cal}},
}
local models = {}
for _, e in ipairs(EXPORTS) do
  local m = models[e[1]] or trained(e[1])
  models[e[1]] = m
  local dir = out .. "/" .. e[2]
  os.execute("mkdir -p '" .. dir .. "'")
  local files, rep = hf.save_pretrained(m, dir, e[3])
  -- nvlua's decoding of what was written, and the logits of a model holding it (bf16) in f32
  local rows = deploy.quantize(m, e[3])
  local dec, sd = {}, {}
  for name, t in pairs(m:state_dict()) do sd[name] = t:to("bf16"):to("f32") end
  for _, row in ipairs(rows) do
    if row.q then
      local d = row.q:dequantize()
      dec["decoded." .. row.name] = d
      sd[row.name .. ".weight"] = d:to("bf16"):to("f32")
    end
  end
  deploy.free(rows)
  local f32 = llama.Llama(CFG, {recipe = nv.recipe.f32(), seed = 1})
  f32:load_state_dict(sd)
  f32:eval()
  dec.logits = f32:forward(x)
  dec.input_ids = x
  assert(st.save(out .. "/" .. e[2] .. ".nvlua.safetensors", dec))
  print(string.format("%s: %d trained, %d post-training, %d excluded, %d re-quantized for fused groups", e[2], rep.trained,
    rep.ptq, rep.excluded, #rep.fused.requantized))
end
"""


def die(msg, code):
    print("check_deploy: " + msg, file=sys.stderr)
    sys.exit(code)


def ulp_diff(torch, a, b):
    """per element, the distance in f32 units in the last place between two f32 tensors"""
    ia = a.contiguous().view(torch.int32).to(torch.int64)
    ib = b.contiguous().view(torch.int32).to(torch.int64)
    # order the bit patterns so that adjacent floats are adjacent integers (negative ones mirrored)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs()


def bf16_ulp_diff(torch, a, b):
    """per element, the distance in bf16 units in the last place between two bf16 tensors"""
    return ulp_diff(torch, a.float(), b.float()) >> 16


class Checks:
    def __init__(self):
        self.failed = []

    def ok(self, cond, what):
        print("  %-4s %s" % ("ok" if cond else "FAIL", what))
        if not cond:
            self.failed.append(what)


def module_tensors(tensors):
    """{module: {param: tensor}} of a flat state dict"""
    mods = {}
    for name, t in tensors.items():
        mod, _, param = name.rpartition(".")
        mods.setdefault(mod, {})[param] = t
    return mods


def linear_names(tensors):
    return sorted(m for m in module_tensors(tensors) if m.endswith("_proj") or m == "lm_head")


def check_file_bytes(c, torch, st, path):
    with open(path, "rb") as f:
        mine = f.read()
    again = path + ".resaved"
    st.save_file(st.load_file(path), again, metadata={"format": "pt"})
    with open(again, "rb") as f:
        theirs = f.read()
    os.remove(again)
    c.ok(mine == theirs, "%s: safetensors.torch re-saves it byte for byte" % os.path.basename(os.path.dirname(path)))


def check_ct(c, mods, d, name, ref):
    """checks 2, 3 on a compressed-tensors export -> its dense weights {module: tensor}"""
    torch, st, ct = mods["torch"], mods["st"], mods["ct"]
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    with open(os.path.join(d, "config.json")) as f:
        qc_json = json.load(f)["quantization_config"]
    qc = QuantizationConfig.model_validate({k: v for k, v in qc_json.items()
                                            if k not in ("version", "sparsity_config", "transform_config")})
    scheme = qc.config_groups["group_0"]
    tensors = st.load_file(os.path.join(d, "model.safetensors"))
    per = module_tensors(tensors)
    linears = linear_names(tensors)
    plain = [m for m in linears if set(per[m]) == {"weight"} and per[m]["weight"].dtype == torch.bfloat16]
    c.ok(sorted(qc.ignore) == sorted(plain), "%s: ignore %s = the linears stored as bf16" % (name, qc.ignore))
    comp = BaseCompressor.get_value_from_registry(qc.format)
    # what vLLM's compressed-tensors schemes register: the compressor's parameters, plus the static scale
    # of the activations where they are quantized with one (NVFP4 input_global_scale, FP8 input_scale)
    want = set(comp.compression_param_names(scheme))
    act = scheme.input_activations
    if act is not None and act.dynamic is not True:
        want.add("input_global_scale" if act.strategy == "tensor_group" else "input_scale")
    quantized = [m for m in linears if m not in plain]
    held = [m for m in quantized if set(per[m]) == want]
    c.ok(len(held) == len(quantized), "%s: each of the %d quantized linears holds %s" % (name, len(quantized), sorted(want)))
    dense, worst, differing, total = {}, 0, 0, 0
    for m in quantized:
        out = comp.decompress(dict(per[m]), scheme)["weight"]
        dense[m] = out
        mine = ref["decoded." + m]
        if out.dtype == torch.bfloat16:
            diff = bf16_ulp_diff(torch, out, mine.to(torch.bfloat16))
        else:
            diff = ulp_diff(torch, out.float(), mine)
        worst, differing, total = max(worst, int(diff.max())), differing + int((diff > 0).sum()), total + diff.numel()
    unit = "bf16" if next(iter(dense.values())).dtype == torch.bfloat16 else "f32"
    bound = 0 if qc.format == "mxfp4-pack-quantized" else 1
    c.ok(worst <= bound, "%s: %s's decompressor = nvlua's decoded weights (%s): %d of %d elements differ, by at most %d %s "
         "ulp (bound %d)" % (name, comp.__name__, unit, differing, total, worst, unit, bound))
    return dense, qc


def check_modelopt(c, mods, d, name, ref, ct_dense):
    torch, st = mods["torch"], mods["st"]
    with open(os.path.join(d, "hf_quant_config.json")) as f:
        hq = json.load(f)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)["quantization_config"]
    q = hq.get("quantization", {})
    need = ["quant_algo", "kv_cache_quant_algo", "exclude_modules"] + (["group_size"] if q.get("quant_algo") != "FP8" else [])
    c.ok(all(k in q for k in need) and "producer" in hq, "%s: hf_quant_config.json has producer and %s" % (name, need))
    groups = cfg.get("config_groups", {})
    gs = [g.get("weights", {}).get("group_size") for g in groups.values()]
    c.ok(cfg.get("quant_method") == "modelopt" and cfg.get("quant_algo") == q.get("quant_algo")
         and cfg.get("ignore") == q.get("exclude_modules") and cfg.get("producer") == hq.get("producer")
         and gs == ([q["group_size"]] if "group_size" in q else [None]),
         "%s: config.json's quantization_config is hf_quant_config.json's in ModelOpt's flat form" % name)
    tensors = st.load_file(os.path.join(d, "model.safetensors"))
    per = module_tensors(tensors)
    plain = [m for m in linear_names(tensors) if set(per[m]) == {"weight"} and per[m]["weight"].dtype == torch.bfloat16]
    c.ok(sorted(q["exclude_modules"]) == sorted(plain), "%s: exclude_modules = the linears stored as bf16" % name)
    if q["quant_algo"] != "NVFP4":
        return
    # 4: compressed-tensors' converter
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4
    conv = ModelOptNvfp4Converter(ignore=q["exclude_modules"], targets=["Linear"])
    converted = module_tensors(conv.validate(dict(tensors)))
    comp = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    worst, differing, total = 0, 0, 0
    for m, dense in ct_dense.items():
        out = comp.decompress(dict(converted[m]), scheme)["weight"]
        diff = bf16_ulp_diff(torch, out, dense)
        worst, differing, total = max(worst, int(diff.max())), differing + int((diff > 0).sum()), total + diff.numel()
    c.ok(worst <= 1, "%s: compressed-tensors' ModelOpt converter accepts it; decompressed = the compressed-tensors "
         "export's: %d of %d differ, by at most %d bf16 ulp (bound 1)" % (name, differing, total, worst))
    # 5: nvidia-modelopt's NVFP4 tensor class
    try:
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    except Exception as e:  # not installed, or it does not import without a GPU
        print("  skip %s: nvidia-modelopt's NVFP4QTensor cannot be imported (%s: %s)" % (name, type(e).__name__, e))
        return
    worst, differing, total = 0, 0, 0
    for m in ct_dense:
        t = per[m]
        N, K2 = t["weight"].shape
        qt = NVFP4QTensor(torch.Size([N, 2 * K2]), torch.float32, t["weight"])
        out = qt.dequantize(dtype=torch.float32, scale=t["weight_scale"], double_scale=t["weight_scale_2"],
                            block_sizes={-1: 16})
        diff = ulp_diff(torch, out, ref["decoded." + m])
        worst, differing, total = max(worst, int(diff.max())), differing + int((diff > 0).sum()), total + diff.numel()
    c.ok(worst <= 1, "%s: nvidia-modelopt's NVFP4QTensor.dequantize = nvlua's decoded weights (f32): %d of %d differ, by "
         "at most %d ulp (bound 1)" % (name, differing, total, worst))


def check_transformers(c, mods, d, name, ref, ct_dense):
    torch, transformers = mods["torch"], mods["transformers"]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    ids = ref["input_ids"]
    with torch.no_grad():
        model(input_ids=ids[:, :1])  # compressed-tensors decompresses on the first forward
    for mod in model.modules():
        if hasattr(mod, "quantization_scheme"):
            mod.quantization_enabled = False  # no fake quantization of the activations: weights alone
    torch.nn.Module.float(model)  # (transformers refuses .float() on a quantized model)
    held = dict(model.named_parameters())
    same = all(torch.equal(held[m + ".weight"], w.float()) for m, w in ct_dense.items())
    exact = all(torch.equal(held[m + ".weight"].to(torch.bfloat16), ref["decoded." + m].to(torch.bfloat16))
                for m in ct_dense)
    c.ok(same, "%s: transformers holds the decompressor's weights" % name)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.reshape(ids.numel(), -1).double()
    mine = ref["logits"].double()
    scale = mine.abs().max().item()
    tol = 1e-5 * scale + 1e-6
    diff = (logits - mine).abs().max().item()
    if not exact:
        print("  note %s: some weights differ from nvlua's bf16 values by 1 bf16 ulp (check 3): the logits' bound does "
              "not apply; compared for the record" % name)
        print("       max |transformers - nvlua| %.3g (max|logit| %.3g)" % (diff, scale))
        return
    c.ok(diff <= tol, "%s: transformers' logits = nvlua's: max |difference| %.3g <= %.3g (1e-5 * max|logit| + 1e-6)"
         % (name, diff, tol))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"), help="the nvlua binary")
    ap.add_argument("--keep", help="a directory to keep the exports in (default: a temporary one)")
    a = ap.parse_args()
    try:
        import torch
        import transformers
        import compressed_tensors as ct
        import safetensors.torch as st
    except ImportError as e:
        print("check_deploy: SKIPPED: needs torch, transformers, compressed-tensors and safetensors (pip install torch "
              "transformers compressed-tensors safetensors): %s" % e)
        sys.exit(77)
    if not os.access(a.nvlua, os.X_OK):
        die("no nvlua binary at %s (build it, or pass --nvlua)" % a.nvlua, 2)
    print("torch %s, transformers %s, compressed-tensors %s" % (torch.__version__, transformers.__version__,
                                                                ct.__version__))
    mods = dict(torch=torch, transformers=transformers, ct=ct, st=st)
    tmp = a.keep or tempfile.mkdtemp(prefix="check_deploy.")
    if a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    c = Checks()
    try:
        drv = os.path.join(tmp, "drv.lua")
        with open(drv, "w") as f:
            f.write(LUA_DRIVER)
        r = subprocess.run([a.nvlua, drv, tmp], cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            die("nvlua failed (exit %d):\n%s%s" % (r.returncode, r.stdout, r.stderr), 1)
        print(r.stdout.rstrip())
        dense = {}
        for name in ("nvfp4_ct", "mxfp4_ct", "fp8_ct", "nvfp4_modelopt", "fp8_modelopt"):
            d = os.path.join(tmp, name)
            ref = st.load_file(d + ".nvlua.safetensors")
            print(name)
            check_file_bytes(c, torch, st, os.path.join(d, "model.safetensors"))
            if name.endswith("_ct"):
                dense[name], _ = check_ct(c, mods, d, name, ref)
                if name != "fp8_ct":
                    check_transformers(c, mods, d, name, ref, dense[name])
            else:
                check_modelopt(c, mods, d, name, ref, dense.get(name.replace("_modelopt", "_ct"), {}))
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if c.failed:
        print("FAILED: %d check(s)" % len(c.failed))
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
