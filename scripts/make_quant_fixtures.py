#!/usr/bin/env python3
"""scripts/make_quant_fixtures.py: the third-party quantized checkpoints of tests/test_qload.lua,
written by the libraries that define their formats.

One tiny Llama (vocab 32, hidden 32, intermediate 32, 1 layer, 4 query heads, 2 KV heads; seed 0,
bfloat16, as released models are) quantized per case and saved under tests/golden/qload/<case>/:

  mo_nvfp4     NVIDIA ModelOpt (nvidia-modelopt) NVFP4_DEFAULT_CFG (W4A4) with o_proj left out,
               calibrated on 2 batches and written by modelopt.torch.export.export_hf_checkpoint:
               hf_quant_config.json, config.json's quantization_config (quant_method modelopt)
  mo_w4a16     ModelOpt W4A16_NVFP4_CFG (weight-only NVFP4: no input_scale)
  mo_fp8       ModelOpt FP8_DEFAULT_CFG (per-tensor e4m3 weights and static input scales)
  mo_mxfp4     ModelOpt MXFP4_DEFAULT_CFG (e2m1 in 1x32 blocks, e8m0 scales)
  ct_nvfp4     compressed-tensors nvfp4-pack-quantized, its NVFP4 preset (W4A4: input_global_scale),
               ignore ["lm_head", "re:.*o_proj$"]
  ct_nvfp4a16  compressed-tensors NVFP4A16 (weight-only)
  ct_mxfp4     compressed-tensors mxfp4-pack-quantized, its MXFP4 preset (dynamic activations)
  ct_fp8       compressed-tensors float-quantized, its FP8 preset (per-tensor weight scale, static
               input_scale)
  ct_fp8_dyn   compressed-tensors float-quantized, FP8_DYNAMIC (per-channel weight scales [N, 1])

compressed-tensors has no calibration of its own (llm-compressor drives it): this script computes
each scale with the library's own functions, as llm-compressor's min-max observers call them
(generate_gparam for a global scale, calculate_qparams for the block / tensor / channel scales,
input scales from the max |input| over the calibration batches), then compresses with
ModelCompressor.compress_model and saves with transformers' save_pretrained + update_config.

Beside each checkpoint, reference.safetensors holds, per quantized linear <m>, <m>.ref_f32 (F32): the
dense weight as the library decodes it in float32 (compressed-tensors: its unpack + dequantize called
with dtype float32; ModelOpt: NVFP4QTensor / FP8QTensor / MXFP4QTensor.dequantize(dtype=float32)).
The library's own decompressor, run in the dtype it returns by default (compressed-tensors'
compressor.decompress(): bfloat16 for the fp4 formats, the scale's dtype for fp8; ModelOpt's fp4
dequantize(dtype=bfloat16)), is checked here to give ref_f32 rounded once to that dtype, so the
references need not store it (ModelOpt's fp8 dequantize(bfloat16) rounds the scale to bfloat16
before the product instead: not compared). tests/test_qload.lua asserts nvlua's decoded weights
equal ref_f32 bit for bit.

Run (needs torch, transformers, compressed-tensors, nvidia-modelopt, safetensors; CPU only):
  python3 scripts/make_quant_fixtures.py [tests/golden/qload]
Made with torch 2.15.0, transformers 5.24.0, compressed-tensors 0.20.1, nvidia-modelopt 0.47.0.
"""
import copy
import json
import os
import shutil
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj"]


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    # a few larger weights, so that block scales spread over more of e4m3's range
    with torch.no_grad():
        for i, name in enumerate(LINEARS):
            w = model.get_submodule("model.layers.0." + name).weight
            w.mul_(torch.logspace(-2, 1, w.shape[0]).unsqueeze(1) * (1 + i))
    return model.to(torch.bfloat16).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (2, 16), generator=g) for _ in range(2)]


def tensors_of(path):
    out = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def once(m, lib, f32):
    """the library's decompressor gave f32 rounded once to its own dtype"""
    if not torch.equal(lib.view(torch.int16 if lib.element_size() == 2 else torch.int32),
                       f32.to(lib.dtype).view(torch.int16 if lib.element_size() == 2 else torch.int32)):
        raise SystemExit(m + ": the library's decompressor is not its float32 decode rounded once")


# ---- ModelOpt ------------------------------------------------------------------------------------

def modelopt_case(out, cfg_name, exclude_o_proj):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, NVFP4QTensor

    model = tiny_model()
    cfg = copy.deepcopy(getattr(mtq, cfg_name))
    if exclude_o_proj:
        cfg["quant_cfg"].append({"quantizer_name": "*o_proj*", "enable": False})

    def loop(m):
        with torch.no_grad():
            for ids in batches():
                m(ids)

    model = mtq.quantize(model, cfg, loop)
    export_hf_checkpoint(model, export_dir=out)
    algo = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]["quant_algo"].upper()
    sd = tensors_of(os.path.join(out, "model.safetensors"))
    ref = {}
    for name in LINEARS:
        m = "model.layers.0." + name
        w = sd[m + ".weight"]
        if w.dtype == torch.bfloat16:
            continue  # excluded
        shape = (w.shape[0], w.shape[1] * 2) if w.dtype == torch.uint8 else tuple(w.shape)
        if algo in ("NVFP4", "W4A16_NVFP4"):
            q = NVFP4QTensor(torch.Size(shape), torch.bfloat16, w)
            kw = dict(scale=sd[m + ".weight_scale"], double_scale=sd[m + ".weight_scale_2"], block_sizes={-1: 16})
        elif algo == "MXFP4":
            q = MXFP4QTensor(torch.Size(shape), torch.bfloat16, w)
            kw = dict(scale=sd[m + ".weight_scale"], block_sizes={-1: 32})
        elif algo == "FP8":
            q = FP8QTensor(torch.Size(shape), torch.bfloat16, w)
            kw = dict(scale=sd[m + ".weight_scale"])
        else:
            raise SystemExit("unexpected quant_algo " + algo)
        ref[m + ".ref_f32"] = f32 = q.dequantize(dtype=torch.float32, **kw).contiguous()
        if algo != "FP8":
            once(m, q.dequantize(dtype=torch.bfloat16, **kw), f32)
    return ref


# ---- compressed-tensors --------------------------------------------------------------------------

def ct_case(out, preset, ignore):
    from compressed_tensors import ModelCompressor
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    model = tiny_model()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    apply_quantization_config(model, qcfg)

    # the inputs' max |x| per quantized linear over the calibration batches (static input scales)
    act = {}
    hooks = []
    for name, mod in model.named_modules():
        if getattr(mod, "quantization_scheme", None) is not None:
            def hook(mod, args, name=name):
                x = args[0].detach().float()
                lo, hi = act.get(name, (torch.tensor(0.0), torch.tensor(0.0)))
                act[name] = (torch.minimum(lo, x.min()), torch.maximum(hi, x.max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    # calibrate with the quantization itself switched off (what an observer pass sees)
    for _, mod in model.named_modules():
        if hasattr(mod, "quantization_enabled"):
            mod.quantization_enabled = False
    with torch.no_grad():
        for ids in batches():
            model(ids)
    for h in hooks:
        h.remove()

    for name, mod in model.named_modules():
        sch = getattr(mod, "quantization_scheme", None)
        if sch is None:
            continue
        w, args = mod.weight.detach().float(), sch.weights
        N, K = w.shape
        gs = None
        if args.strategy == "tensor_group":
            gs = generate_gparam(w.min(), w.max())
            mod.weight_global_scale.data.copy_(gs)
        if args.strategy in ("tensor_group", "group"):
            g = w.reshape(N, K // args.group_size, args.group_size)
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
        elif args.strategy == "channel":
            scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        else:
            scale, _ = calculate_qparams(w.min().reshape(1), w.max().reshape(1), args)
        mod.weight_scale.data.copy_(scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape))
        ia = sch.input_activations
        if ia is not None and ia.dynamic is not True:
            lo, hi = act[name]
            if ia.strategy == "tensor_group":
                mod.input_global_scale.data.copy_(generate_gparam(lo, hi))
            else:
                s, _ = calculate_qparams(lo.reshape(1), hi.reshape(1), ia)
                mod.input_scale.data.copy_(s.to(mod.input_scale.dtype).reshape(mod.input_scale.shape))
        mod.quantization_status = QuantizationStatus.FROZEN
    for _, mod in model.named_modules():
        if hasattr(mod, "quantization_enabled"):
            mod.quantization_enabled = True

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    compressor.update_config(out)

    # the references, from the saved file
    fmt = json.load(open(os.path.join(out, "config.json")))["quantization_config"]["format"]
    comp = BaseCompressor.get_value_from_registry(fmt)
    sd = tensors_of(os.path.join(out, "model.safetensors"))
    ref = {}
    for name in LINEARS:
        m = "model.layers.0." + name
        if (m + ".weight") in sd and sd[m + ".weight"].dtype == torch.bfloat16:
            continue  # ignored
        part = {k[len(m) + 1:]: v for k, v in sd.items() if k.startswith(m + ".")}
        lib = comp.decompress(dict(part), scheme)["weight"]
        if "weight_packed" in part:
            p = part["weight_packed"]
            codes = unpack_fp4_from_uint8(p, p.shape[0], p.shape[1] * 2, dtype=torch.float32)
            s = part["weight_scale"]
            s = decompress_mx_scale(s).to(torch.float32) if fmt.startswith("mxfp4") else s.to(torch.float32)
            f32 = dequantize(x_q=codes, scale=s, args=scheme.weights, global_scale=part.get("weight_global_scale"),
                             dtype=torch.float32)
        else:
            f32 = dequantize(x_q=part["weight"], scale=part["weight_scale"].to(torch.float32), args=scheme.weights,
                             dtype=torch.float32)
        ref[m + ".ref_f32"] = f32.contiguous()
        once(m, lib, f32)
    return ref


CASES = {
    "mo_nvfp4": lambda out: modelopt_case(out, "NVFP4_DEFAULT_CFG", True),
    "mo_w4a16": lambda out: modelopt_case(out, "W4A16_NVFP4_CFG", False),
    "mo_fp8": lambda out: modelopt_case(out, "FP8_DEFAULT_CFG", False),
    "mo_mxfp4": lambda out: modelopt_case(out, "MXFP4_DEFAULT_CFG", False),
    "ct_nvfp4": lambda out: ct_case(out, "NVFP4", ["lm_head", "re:.*o_proj$"]),
    "ct_nvfp4a16": lambda out: ct_case(out, "NVFP4A16", ["lm_head"]),
    "ct_mxfp4": lambda out: ct_case(out, "MXFP4", ["lm_head"]),
    "ct_fp8": lambda out: ct_case(out, "FP8", ["lm_head"]),
    "ct_fp8_dyn": lambda out: ct_case(out, "FP8_DYNAMIC", ["lm_head"]),
}


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "qload")
    only = sys.argv[2:] or list(CASES)
    for case in only:
        out = os.path.join(root, case)
        shutil.rmtree(out, ignore_errors=True)
        ref = CASES[case](out)
        for junk in ("generation_config.json",):
            if os.path.exists(os.path.join(out, junk)):
                os.remove(os.path.join(out, junk))
        save_file(ref, os.path.join(out, "reference.safetensors"), metadata={"format": "pt"})
        print(case, sorted(os.listdir(out)), len(ref), "quantized linears")


if __name__ == "__main__":
    main()
