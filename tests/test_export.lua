-- test_export.lua: nvlua.deploy's quantized exports (hf.save_pretrained with quantize =), read back by
-- a reader and decoders written here from the formats' definitions, never by nvlua's own:
--   * safetensors read by hand (8-byte length, JSON header, raw bytes); e2m1 from its table (code & 7
--     -> 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), two codes per byte with the even element in the low
--     nibble; e4m3 from its bits (bias 7, subnormal step 2^-9); e8m0 as 2^(e - 127); f32 from its bytes;
--   * the training forward's weight is what the fprop GEMM of a real forward multiplies: its operand,
--     taken with recipe:trace during a forward after the export, dequantized;
--   * on tiny Llamas trained 3 steps under nvfp4, mxfp4, fp8_cs, fp8_delayed and bf16 (the last
--     quantized after training).
-- Exactness: ModelOpt NVFP4 decoded here as the engines' GEMMs apply it, value(code) * value(block scale)
-- * weight_scale_2 rounded once to f32 (the first product exact): 0 differing bits from the training
-- forward's weight. (ModelOpt's own NVFP4QTensor.dequantize rounds fl(block scale * weight_scale_2) first
-- and maps code 8, -0, to +0: the last bit of some elements differs; nvlua.deploy_read decodes that way by
-- default, its decode = "exact" this way, and tests/test_qload.lua checks both.) MXFP4 value * 2^(e-127):
-- 0 bits. compressed-tensors NVFP4 holds the same bytes and s_enc = 2688 / amax (q.scale, bit for bit);
-- decoded its way, value * (block scale / s_enc), it is within 2 ulps of the training's: s_enc and
-- amax / 2688 are each rounded once, and the two decodes round once more each (relative differences
-- of 2^-24 each, below 4 * 2^-24 in all: at most 2 ulps after the last rounding). FP8: the codes are
-- the GEMM's and weight_scale is bit for bit the factor nvlua's GEMM applies (1 / scale, NUMERICS §7);
-- value * weight_scale is within 1 ulp of dequantize()'s value / scale (1 / scale rounded once: a
-- relative 2^-24, then one rounding each).
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local hf = require "nvlua.hf"
local deploy = require "nvlua.deploy"
local cjson = require "cjson"

local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

-- head_dim 16, every in-features a multiple of 32 (MXFP4 blocks) and out-features of 16 (NVFP4 tiles)
local CFG = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 64}

local function ids(g) return (nv.rand({2, 32}, {generator = g}) * 64):to("i64") end

-- a model trained 3 AdamW steps under recipe name (seeded: the same model each time)
local function trained(name, cfg) return T.trained_llama(cfg or CFG, name, ids) end

local function calib(n)
  local g, out = nv.Generator(9), {}
  for i = 1, n or 2 do out[i] = ids(g) end
  return out
end

-- ---- reading and decoding, from the definitions --------------------------------------------------------

local function read_st(path)
  local s = assert(T.read_file(path))
  local n = string.unpack("<I8", s)
  local h = cjson.decode(s:sub(9, 8 + n))
  local out, meta = {}, h.__metadata__
  for name, e in pairs(h) do
    if name ~= "__metadata__" then
      out[name] = {dtype = e.dtype, shape = e.shape, bytes = s:sub(9 + n + e.data_offsets[1], 8 + n + e.data_offsets[2])}
    end
  end
  return out, meta
end

local function read_json(path) return cjson.decode(assert(T.read_file(path))) end

local E2M1 = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
local function e2m1(c) local v = E2M1[(c & 7) + 1]; return (c & 8) ~= 0 and -v or v end
local function e4m3(b)
  local e, m = (b >> 3) & 15, b & 7
  local v = e == 0 and m * 2.0 ^ -9 or (1 + m / 8) * 2.0 ^ (e - 7)
  return (b & 0x80) ~= 0 and -v or v
end
local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end
local function f32_of(bytes) return (string.unpack("<f", bytes)) end

-- the 4-bit code of element k (0-based) of row r of packed codes [N, K/2]
local function nibble(bytes, r, k, K)
  local b = bytes:byte(r * (K // 2) + k // 2 + 1)
  return k % 2 == 0 and (b & 15) or (b >> 4)
end

-- decoded weight [N, K] as f32 bytes, by the rule dec(r, k) -> number (rounded to f32 here)
local function decode(N, K, dec)
  local parts = {}
  for r = 0, N - 1 do
    local row = {}
    for k = 0, K - 1 do row[k + 1] = string.pack("<f", dec(r, k)) end
    parts[#parts + 1] = table.concat(row)
  end
  return table.concat(parts)
end

local function nvfp4_modelopt(t, name, N, K)
  local codes, sc, d = t[name .. ".weight"].bytes, t[name .. ".weight_scale"].bytes, f32_of(t[name .. ".weight_scale_2"].bytes)
  return decode(N, K, function(r, k) return e2m1(nibble(codes, r, k, K)) * e4m3(sc:byte(r * (K // 16) + k // 16 + 1)) * d end)
end

-- compressed-tensors' order: the block scale divided by the global scale first (f32), then the product
local function nvfp4_ct(t, name, N, K)
  local codes, sc, g = t[name .. ".weight_packed"].bytes, t[name .. ".weight_scale"].bytes,
    f32_of(t[name .. ".weight_global_scale"].bytes)
  return decode(N, K, function(r, k) return e2m1(nibble(codes, r, k, K)) * f32(e4m3(sc:byte(r * (K // 16) + k // 16 + 1)) / g) end)
end

local function mxfp4_ct(t, name, N, K)
  local codes, sc = t[name .. ".weight_packed"].bytes, t[name .. ".weight_scale"].bytes
  return decode(N, K, function(r, k) return e2m1(nibble(codes, r, k, K)) * 2.0 ^ (sc:byte(r * (K // 32) + k // 32 + 1) - 127) end)
end

local function fp8(t, name, N, K)
  local codes, s = t[name .. ".weight"].bytes, f32_of(t[name .. ".weight_scale"].bytes)
  return decode(N, K, function(r, k) return e4m3(codes:byte(r * K + k + 1)) * s end)
end

-- units in the last place between two f32 byte strings: max over elements, and the count that differ
local function ulps(a, b)
  assert(#a == #b, "sizes differ")
  local worst, n = 0, 0
  for i = 1, #a, 4 do
    local x, y = string.unpack("<i4", a, i), string.unpack("<i4", b, i)
    if x ~= y then
      n = n + 1
      -- same sign in every case here (the values are far from 0 or equal): the ordered bit patterns' distance
      worst = math.max(worst, math.abs(x - y))
    end
  end
  return worst, n
end

-- The training forward's fprop weight operand of every linear: {name = {deq, data, scales, amax, scale}},
-- from a forward of x (eval) traced with recipe:trace.
local function forward_weights(m, x)
  local got = {}
  local recipes = {}
  for _, l in ipairs(m:linears()) do recipes[l.module.recipe] = true end
  local function hook(e)
    if e.role ~= "fprop" or got[e.ctx.name] then return end
    local b = e.b
    local r = {amax = b.amax, scale = b.scale}
    if b.format then
      local d, c = b:dequantize(), b:data()
      r.deq, r.data = d:bytes(), c:bytes()
      d:free(); c:free()
      if b:format() ~= "e4m3" and b:format() ~= "bf16" then
        local s = b:scale_bytes()
        r.scales = s:bytes()
        s:free()
      end
      r.format = b:format()
    end
    got[e.ctx.name] = r
  end
  for r in pairs(recipes) do r:trace(hook) end
  m:eval()
  nv.scope(function() m:forward(x) end)
  m:train()
  for r in pairs(recipes) do r:trace(nil) end
  return got
end

local function quantized_linears(m)
  local out = {}
  for _, l in ipairs(m:linears()) do
    if not l.high_precision then out[#out + 1] = {name = l.name, N = l.module.out_features, K = l.module.in_features} end
  end
  return out
end

local function requantized_set(report)
  local s = {}
  for _, r in ipairs(report.fused.requantized) do s[r.name] = r end
  return s
end

-- ---- bit-exact with the training forward ---------------------------------------------------------------

T.case("nvfp4 (ModelOpt): every linear not re-quantized for its fused group decodes to the training forward's weight, 0 differing bits", function()
  local m = trained("nvfp4")
  local dir = fresh("nvfp4")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "nvfp4", format = "modelopt", calibration = calib()})
  local fw = forward_weights(m, ids(nv.Generator(5)))
  local t = read_st(dir .. "/model.safetensors")
  local req = requantized_set(rep)
  local exact = 0
  for _, l in ipairs(quantized_linears(m)) do
    local tr = fw[l.name]
    T.eq(tr.format, "nvfp4", l.name)
    if not req[l.name] then
      T.ok(t[l.name .. ".weight"].bytes == tr.data, l.name .. ": codes are the forward's")
      T.ok(t[l.name .. ".weight_scale"].bytes == tr.scales, l.name .. ": block scales are the forward's")
      local worst, n = ulps(nvfp4_modelopt(t, l.name, l.N, l.K), tr.deq)
      T.eq(n, 0, l.name .. ": differing elements (worst " .. worst .. " ulps)")
      T.eq(f32_of(t[l.name .. ".weight_scale_2"].bytes), f32(tr.amax / 2688), l.name .. ": weight_scale_2 = amax / 2688")
      exact = exact + 1
    end
  end
  -- o_proj and down_proj are in no fused group: never re-quantized
  T.ok(exact >= 4, "only " .. exact .. " layers compared bit for bit")
  T.eq(rep.trained, 14)
  T.eq(rep.excluded, 1)
end)

T.case("nvfp4 (ModelOpt): fused q/k/v and gate/up share one weight_scale_2; members re-quantized with the group's amax, the report's errors are the decoded weights'", function()
  local m = trained("nvfp4")
  local dir = fresh("fused")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", format = "modelopt"})
  local fw = forward_weights(m, ids(nv.Generator(5)))
  local t = read_st(dir .. "/model.safetensors")
  local req = requantized_set(rep)
  local groups = {}
  for _, l in ipairs(quantized_linears(m)) do
    local key = l.name:match("^(.*)%.self_attn%.[qkv]_proj$") and l.name:gsub("[qkv]_proj$", "qkv") or
      l.name:match("^(.*)%.mlp%.gate_proj$") and l.name:gsub("gate_proj$", "gu") or
      l.name:match("^(.*)%.mlp%.up_proj$") and l.name:gsub("up_proj$", "gu") or nil
    if key then
      groups[key] = groups[key] or {}
      table.insert(groups[key], l)
    end
  end
  local nreq, ngroups = 0, 0
  for _, g in pairs(groups) do
    ngroups = ngroups + 1
    local top = 0
    for _, l in ipairs(g) do top = math.max(top, fw[l.name].amax) end
    for _, l in ipairs(g) do
      local s2 = f32_of(t[l.name .. ".weight_scale_2"].bytes)
      T.eq(s2, f32(top / 2688), l.name .. ": the group's weight_scale_2")
      local dec = nvfp4_modelopt(t, l.name, l.N, l.K)
      if fw[l.name].amax == top then
        T.ok(req[l.name] == nil, l.name .. " holds the group's amax: not re-quantized")
        T.eq(select(2, ulps(dec, fw[l.name].deq)), 0, l.name)
      else
        nreq = nreq + 1
        local r = req[l.name]
        T.ok(r, l.name .. " must be reported re-quantized")
        T.ok(r.trained, l.name)
        -- the reported error: the decoded export against the training's weight, computed here
        local maxd, s2d, s2w = 0, 0, 0
        for i = 1, #dec, 4 do
          local a, b = string.unpack("<f", dec, i), string.unpack("<f", fw[l.name].deq, i)
          maxd, s2d, s2w = math.max(maxd, math.abs(a - b)), s2d + (a - b) ^ 2, s2w + b * b
        end
        T.near(r.max, maxd, 1e-7 * maxd, l.name .. ": max |dw|")
        T.near(r.rms, math.sqrt(s2d / s2w), 1e-5, l.name .. ": rms dw / rms w")
        -- a re-quantization to the same format: its error is of the format's size (NVFP4's rms error
        -- on these weights is ~0.1, NUMERICS §12), not a wrong decode (which would be ~1)
        T.ok(r.rms > 0 and r.rms < 0.3, l.name .. ": rms " .. r.rms)
      end
    end
  end
  T.eq(ngroups, 4)
  T.eq(#rep.fused.requantized, nreq)
  T.ok(nreq > 0, "separately trained amaxes differ: some members are re-quantized")
  T.eq(rep.fused.groups, 4)
end)

T.case("mxfp4 (compressed-tensors): codes and e8m0 scales are the forward's, decoded value * 2^(e-127): 0 differing bits; no global scale", function()
  local m = trained("mxfp4")
  local dir = fresh("mxfp4")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "mxfp4"})
  T.eq(rep.format, "compressed-tensors")
  T.eq(#rep.fused.requantized, 0)
  local fw = forward_weights(m, ids(nv.Generator(5)))
  local t = read_st(dir .. "/model.safetensors")
  for _, l in ipairs(quantized_linears(m)) do
    T.eq(fw[l.name].format, "mxfp4")
    T.eq(t[l.name .. ".weight_packed"].dtype, "U8")
    T.eq(t[l.name .. ".weight_packed"].shape, {l.N, l.K // 2})
    T.eq(t[l.name .. ".weight_scale"].dtype, "U8")
    T.eq(t[l.name .. ".weight_scale"].shape, {l.N, l.K // 32})
    T.ok(t[l.name .. ".weight_packed"].bytes == fw[l.name].data, l.name)
    T.ok(t[l.name .. ".weight_scale"].bytes == fw[l.name].scales, l.name)
    T.eq(select(2, ulps(mxfp4_ct(t, l.name, l.N, l.K), fw[l.name].deq)), 0, l.name)
    T.ok(t[l.name .. ".weight_global_scale"] == nil and t[l.name .. ".input_global_scale"] == nil, l.name)
  end
end)

for _, name in ipairs({"fp8_cs", "fp8_delayed"}) do
  T.case(name .. " (ModelOpt FP8): the codes are the forward's, weight_scale is its GEMM's 1 / scale bit for bit, decoded within 1 ulp of dequantize()", function()
    local m = trained(name)
    local dir = fresh(name)
    local rec = m:linears()[1].module.recipe
    local before = rec:state()
    local _, rep = hf.save_pretrained(m, dir, {quantize = "fp8", format = "modelopt", calibration = calib()})
    T.ok(T.deep_eq(rec:state(), before), "the recipe's state (delayed-scaling histories) is put back")
    local fw = forward_weights(m, ids(nv.Generator(5)))
    local t = read_st(dir .. "/model.safetensors")
    local req = requantized_set(rep)
    local exact, total = 0, 0
    for _, l in ipairs(quantized_linears(m)) do
      T.eq(fw[l.name].format, "e4m3")
      T.eq(t[l.name .. ".weight"].dtype, "F8_E4M3")
      T.eq(t[l.name .. ".weight"].shape, {l.N, l.K})
      T.eq(t[l.name .. ".weight_scale"].shape, {})
      if not req[l.name] then
        T.ok(t[l.name .. ".weight"].bytes == fw[l.name].data, l.name .. ": the forward's codes")
        T.eq(f32_of(t[l.name .. ".weight_scale"].bytes), f32(1 / fw[l.name].scale), l.name)
        local worst, n = ulps(fp8(t, l.name, l.N, l.K), fw[l.name].deq)
        T.ok(worst <= 1, l.name .. ": " .. worst .. " ulps")
        exact, total = exact + (l.N * l.K - n), total + l.N * l.K
      end
    end
    T.ok(total > 0)
    print(string.format("     %s: %d of %d decoded elements equal dequantize() bit for bit, the rest within 1 ulp", name,
      exact, total))
  end)
end

T.case("nvfp4 (compressed-tensors): the ModelOpt export's bytes, s_enc bit for bit, decoded its way within 2 ulps of the training's", function()
  local m = trained("nvfp4")
  local a, b = fresh("mo"), fresh("ct")
  local cal = calib()
  hf.save_pretrained(m, a, {quantize = "nvfp4", format = "modelopt", calibration = cal})
  hf.save_pretrained(m, b, {quantize = "nvfp4", format = "compressed-tensors", calibration = cal})
  local fw = forward_weights(m, ids(nv.Generator(5)))
  local mo, ct = read_st(a .. "/model.safetensors"), read_st(b .. "/model.safetensors")
  for _, l in ipairs(quantized_linears(m)) do
    T.ok(ct[l.name .. ".weight_packed"].bytes == mo[l.name .. ".weight"].bytes, l.name)
    T.ok(ct[l.name .. ".weight_scale"].bytes == mo[l.name .. ".weight_scale"].bytes, l.name)
    T.eq(ct[l.name .. ".weight_global_scale"].shape, {1})
    T.eq(ct[l.name .. ".input_global_scale"].shape, {1})
    local g = f32_of(ct[l.name .. ".weight_global_scale"].bytes)
    if fw[l.name].data == mo[l.name .. ".weight"].bytes then -- not re-quantized: the forward's own
      T.eq(g, f32(2688 / fw[l.name].amax), l.name .. ": s_enc")
      T.eq(g, fw[l.name].scale, l.name .. ": the forward's q.scale")
      local worst = ulps(nvfp4_ct(ct, l.name, l.N, l.K), fw[l.name].deq)
      T.ok(worst <= 2, l.name .. ": " .. worst .. " ulps")
    end
  end
end)

-- ---- calibration -----------------------------------------------------------------------------------------

T.case("calibration: input_scale = amax / 2688 (ModelOpt NVFP4), input_global_scale = 2688 / amax, FP8 1 / (448 / amax); amax over the batches and the fused group", function()
  local m = trained("nvfp4")
  local cal = calib(3)
  -- each linear's input amax over the batches, from the GEMM's own quantized x (per-tensor current scaling: its amax is max |x|)
  local seen = {}
  local rec = m:linears()[1].module.recipe
  rec:trace(function(e) if e.role == "fprop" then seen[e.ctx.name] = math.max(seen[e.ctx.name] or 0, e.a.amax) end end)
  m:eval()
  for _, x in ipairs(cal) do nv.scope(function() m:forward(x) end) end
  m:train()
  rec:trace(nil)
  local function group_max(seen, name)
    local base, proj = name:match("^(.*)%.([%w_]+)$")
    local members = ({q_proj = {"q_proj", "k_proj", "v_proj"}, k_proj = {"q_proj", "k_proj", "v_proj"},
      v_proj = {"q_proj", "k_proj", "v_proj"}, gate_proj = {"gate_proj", "up_proj"}, up_proj = {"gate_proj", "up_proj"}})[proj]
    local a = 0
    for _, p in ipairs(members or {proj}) do a = math.max(a, seen[base .. "." .. p]) end
    return a
  end
  local a, b = fresh("cal_mo"), fresh("cal_ct")
  local _, rep = hf.save_pretrained(m, a, {quantize = "nvfp4", format = "modelopt", calibration = cal})
  T.eq(rep.calibration_batches, 3)
  hf.save_pretrained(m, b, {quantize = "nvfp4", format = "compressed-tensors", calibration = function()
    return table.remove(cal, 1) -- the function form: the next batch, nil when done
  end})
  local mo, ct = read_st(a .. "/model.safetensors"), read_st(b .. "/model.safetensors")
  for _, l in ipairs(quantized_linears(m)) do
    local A = group_max(seen, l.name)
    T.ok(A > 0)
    T.eq(mo[l.name .. ".input_scale"].dtype, "F32")
    T.eq(mo[l.name .. ".input_scale"].shape, {})
    T.eq(f32_of(mo[l.name .. ".input_scale"].bytes), f32(A / 2688), l.name)
    T.eq(f32_of(ct[l.name .. ".input_global_scale"].bytes), f32(2688 / A), l.name)
  end
  local c = fresh("cal_fp8")
  local f8 = trained("fp8_cs")
  hf.save_pretrained(f8, c, {quantize = "fp8", format = "compressed-tensors", calibration = calib(1)})
  local t = read_st(c .. "/model.safetensors")
  local seen8 = {}
  local r8 = f8:linears()[1].module.recipe
  r8:trace(function(e) if e.role == "fprop" then seen8[e.ctx.name] = e.a.amax end end)
  f8:eval()
  nv.scope(function() f8:forward(calib(1)[1]) end)
  r8:trace(nil)
  for _, l in ipairs(quantized_linears(f8)) do
    T.eq(t[l.name .. ".input_scale"].shape, {1})
    T.eq(f32_of(t[l.name .. ".input_scale"].bytes), f32(1 / f32(448 / group_max(seen8, l.name))), l.name)
  end
end)

-- ---- which layers, the files, the configs -------------------------------------------------------------------

T.case("layers: the recipe's bf16 blocks and the LM head are excluded, listed exactly, stored bf16; embeddings and norms bf16", function()
  local cfg = {}
  for k, v in pairs(CFG) do cfg[k] = v end
  cfg.num_hidden_layers = 4 -- nvfp4 keeps the last floor(8 * 4 / 32) = 1 block in bf16
  local m = trained("nvfp4", cfg)
  local dir = fresh("layers")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "nvfp4_a16"})
  T.eq(rep.format, "modelopt")
  local hq = read_json(dir .. "/hf_quant_config.json")
  local ex = {"model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj",
    "model.layers.3.self_attn.o_proj", "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj",
    "model.layers.3.mlp.down_proj", "lm_head"}
  T.eq(hq, {producer = {name = "nvlua", version = nv.version}, quantization = {quant_algo = "W4A16_NVFP4",
    kv_cache_quant_algo = cjson.null, group_size = 16, exclude_modules = ex}})
  local c = read_json(dir .. "/config.json")
  -- config.json: the flat form ModelOpt writes there (convert_hf_quant_config_format; tests/golden/qload/mo_w4a16)
  T.eq(c.quantization_config, {quant_method = "modelopt", producer = hq.producer, quant_algo = "W4A16_NVFP4", ignore = ex,
    config_groups = {group_0 = {weights = {dynamic = false, num_bits = 4, type = "float", group_size = 16},
      targets = {"Linear"}}}})
  T.eq(c.torch_dtype, "bfloat16")
  local t = read_st(dir .. "/model.safetensors")
  local names = {}
  for n in pairs(t) do names[#names + 1] = n end
  local want = {["model.embed_tokens.weight"] = "BF16", ["model.norm.weight"] = "BF16", ["lm_head.weight"] = "BF16"}
  for i = 0, 3 do
    want["model.layers." .. i .. ".input_layernorm.weight"] = "BF16"
    want["model.layers." .. i .. ".post_attention_layernorm.weight"] = "BF16"
    for _, p in ipairs({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
      "mlp.up_proj", "mlp.down_proj"}) do
      local n = "model.layers." .. i .. "." .. p
      if i == 3 then want[n .. ".weight"] = "BF16"
      else want[n .. ".weight"], want[n .. ".weight_scale"], want[n .. ".weight_scale_2"] = "U8", "F8_E4M3", "F32" end
    end
  end
  local got = {}
  for n, e in pairs(t) do got[n] = e.dtype end
  T.eq(got, want)
  -- a bf16 tensor is the master weight rounded to bf16
  local w = m:state_dict()["model.layers.3.mlp.down_proj.weight"]:to("bf16")
  T.ok(t["model.layers.3.mlp.down_proj.weight"].bytes == w:bytes())
  T.eq(rep.excluded, 8)
  T.eq(rep.trained, 21)
end)

T.case("layers: a bf16-trained model is quantized after training (ptq, said so); an exclude list is followed", function()
  local m = trained("bf16")
  local dir = fresh("ptq")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", format = "compressed-tensors"})
  T.eq(rep.ptq, 14)
  T.eq(rep.trained, 0)
  for _, l in ipairs(rep.layers) do
    if l.name ~= "lm_head" then T.eq({l.status, l.why}, {"ptq", "trained in bf16"}) end
  end
  local c = read_json(dir .. "/config.json").quantization_config
  T.eq(c.ignore, {"lm_head"})
  T.eq(c.format, "nvfp4-pack-quantized")
  T.eq(c.quant_method, "compressed-tensors")
  T.eq(c.config_groups.group_0.input_activations, cjson.null)
  T.eq(c.config_groups.group_0.weights, {num_bits = 4, type = "float", strategy = "tensor_group", group_size = 16,
    symmetric = true, dynamic = false, scale_dtype = "torch.float8_e4m3fn"})
  T.ok(not T.read_file(dir .. "/hf_quant_config.json"), "no hf_quant_config.json in a compressed-tensors export")
  -- the PTQ codes: nv.quantize of the master weight, 1x16 blocks
  local t = read_st(dir .. "/model.safetensors")
  local w = m:state_dict()["model.layers.0.self_attn.o_proj.weight"]
  local q = nv.quantize(w, "nvfp4")
  T.ok(t["model.layers.0.self_attn.o_proj.weight_packed"].bytes == q:data():bytes())
  -- an explicit list
  local d2 = fresh("exclude")
  local ex = {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"}
  local _, r2 = hf.save_pretrained(trained("nvfp4"), d2, {quantize = "nvfp4_a16", format = "compressed-tensors", exclude = ex})
  T.eq(read_json(d2 .. "/config.json").quantization_config.ignore, {ex[1], ex[2], ex[3], "lm_head"})
  T.eq(r2.excluded, 4)
  T.eq(r2.trained, 11)
end)

T.case("a re-export into the same directory gives the same bytes; a plain save_pretrained afterwards removes hf_quant_config.json", function()
  local m = trained("nvfp4")
  local dir = fresh("again")
  local cal = calib()
  hf.save_pretrained(m, dir, {quantize = "nvfp4", calibration = cal})
  local first = T.read_file(dir .. "/model.safetensors")
  hf.save_pretrained(m, dir, {quantize = "nvfp4", calibration = cal})
  T.ok(T.read_file(dir .. "/model.safetensors") == first)
  hf.save_pretrained(m, dir)
  T.ok(not T.read_file(dir .. "/hf_quant_config.json"))
  T.eq(read_json(dir .. "/config.json").quantization_config, nil)
end)

T.case("deploy.FORMATS: the tensors written are the table's, with the dtypes and shapes the formats define", function()
  local want = { -- (the issue's facts, written out here)
    modelopt = {nvfp4 = {weight = "U8", weight_scale = "F8_E4M3", weight_scale_2 = "F32", input_scale = "F32"},
      fp8 = {weight = "F8_E4M3", weight_scale = "F32", input_scale = "F32"}},
    ["compressed-tensors"] = {nvfp4 = {weight_packed = "U8", weight_scale = "F8_E4M3", weight_global_scale = "F32",
      input_global_scale = "F32"}, mxfp4 = {weight_packed = "U8", weight_scale = "U8"}},
  }
  for format, qs in pairs(want) do
    for q, tensors in pairs(qs) do
      local got = {}
      for _, t in ipairs(deploy.FORMATS[format][q].tensors) do got[t.suffix] = t.dtype end
      T.eq(got, tensors, format .. " " .. q)
    end
  end
  T.eq(deploy.shape("N,K/2", 64, 128), {64, 64})
  T.eq(deploy.shape("N,K/16", 64, 128), {64, 8})
  T.eq(deploy.shape("1", 64, 128), {1})
  T.eq(deploy.shape("", 64, 128), {})
end)

-- ---- bad input ------------------------------------------------------------------------------------------------

T.case("bad input: unknown format or quantize, a missing or needless calibration, bad batches, unknown or split exclusions, K not a whole number of blocks", function()
  local m = trained("nvfp4")
  local dir = fresh("bad")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp5"}) end, "quantize must be one of nvfp4, nvfp4_a16, mxfp4, fp8")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", format = "gguf"}) end,
    "format must be one of modelopt, compressed-tensors")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "mxfp4", format = "modelopt"}) end, "format modelopt has no mxfp4 layout")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4"}) end, "give calibration = batches")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", calibration = calib()}) end,
    "calibration does not apply to quantize = nvfp4_a16")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4", calibration = {"text"}}) end,
    "calibration batch 1 is a string")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4", calibration = {}}) end, "calibration holds no batch")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4", calibration = 3}) end, "calibration must be a list")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", exclude = {"model.layers.0.mlp.gate_prj"}}) end,
    "did you mean 'model.layers.0.mlp.gate_proj'")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", exclude = {"model.layers.0.mlp.gate_proj"}}) end,
    "model.layers.0.mlp.up_proj would be quantized but model.layers.0.mlp.gate_proj not")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", exclude = "lm_head"}) end, "exclude must be a list")
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", colour = 1}) end, "colour")
  T.raises(function() hf.save_pretrained(m, dir .. "/nope", {quantize = "nvfp4_a16"}) end, "is not a directory")
  local cfg = {}
  for k, v in pairs(CFG) do cfg[k] = v end
  cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 48, 3, 1 -- K = 48: no whole 1x32 blocks
  T.raises(function() hf.save_pretrained(llama.Llama(cfg, {seed = 1}), dir, {quantize = "mxfp4"}) end,
    "model.layers.0.self_attn.q_proj has 48 input features, not a multiple of mxfp4's block of 32")
  local w = m:state_dict()["model.layers.1.mlp.down_proj.weight"]
  w:set(3, 5, 0 / 0)
  T.raises(function() hf.save_pretrained(m, dir, {quantize = "nvfp4_a16"}) end,
    "model.layers.1.mlp.down_proj's weight holds NaN")
  local lfs = require "lfs"
  local left = {}
  for n in lfs.dir(dir) do if n ~= "." and n ~= ".." then left[#left + 1] = n end end
  T.eq(left, {}, "nothing written by a refused export")
end)

-- ---- scripts/export.lua ---------------------------------------------------------------------------------------

T.case("scripts/export.lua: a run's checkpoint (fp8_delayed) exported with its recipe state: the forward's codes, progress, a summary; --help; bad keys", function()
  local train = require "nvlua.train"
  local config = require "nvlua.config"
  local ckpt = require "nvlua.checkpoint"
  local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
  local script = here .. "/../scripts/export.lua"
  local corpus = T.write_corpus(ROOT .. "/corpus.txt", {seed = 5, lines = 300, words = {"in", "the", "beginning", "was",
    "word", "and", "light", "darkness", "waters", "day"}})
  local c = config.parse(train.defaults, {"data=" .. corpus, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=64", "heads=4",
    "kv_heads=2", "ffn=128", "seq=16", "batch=2", "steps=3", "warmup=1", "eval_every=0", "sample_tokens=0", "plot=false",
    "quiet=true", "recipe=fp8_delayed", "out=" .. ROOT .. "/run"})
  local p = train.build(c)
  p.peak = 1e9
  train.run(c, p)
  local dir = ckpt.latest(ROOT .. "/run")
  local out = ROOT .. "/run_fp8"
  local r = T.run_nvlua(T.shq(script) .. " " .. T.shq(dir) .. " " .. T.shq(out) .. " quantize=fp8 calib_batches=2")
  T.eq(r.code, 0, r.err)
  for _, want in ipairs({"calibration: 2 batches of 2 x 16 tokens", "[1/14] model.layers.0.self_attn.q_proj", "trained",
    "wrote model.safetensors", "modelopt fp8 export", "linears: 14 quantized as trained, 0 quantized after training, " ..
    "1 excluded (bf16)", "excluded: the LM head stays in bf16 (1): lm_head", "fused groups: 4"}) do
    T.ok(r.out:find(want, 1, true), "the output says " .. want .. ":\n" .. r.out)
  end
  -- the checkpoint's forward, with its recipe state: o_proj (in no fused group) holds its codes and scale
  local rec = train.recipe(c)
  local m = hf.from_pretrained(dir, {recipe = rec})
  local tr = ckpt.load(dir, {model = m, recipe = rec})
  m.step = tr.step
  local fw = forward_weights(m, (nv.rand({2, 16}, {generator = nv.Generator(5)}) * 64):to("i64"))
  local t = read_st(out .. "/model.safetensors")
  for _, name in ipairs({"model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"}) do
    T.ok(t[name .. ".weight"].bytes == fw[name].data, name .. ": the codes of the checkpoint's forward")
    T.eq(f32_of(t[name .. ".weight_scale"].bytes), f32(1 / fw[name].scale), name)
  end
  local h = T.run_nvlua(T.shq(script) .. " --help")
  T.eq(h.code, 0)
  for _, k in ipairs({"ckpt", "out", "quantize", "format", "calib_batches", "data", "exclude"}) do
    T.ok(h.out:find("\n  " .. k .. "=", 1, true), "--help lists " .. k)
  end
  local bad = T.run_nvlua(T.shq(script) .. " " .. T.shq(dir) .. " " .. T.shq(out) .. " quantize=nvfp5")
  T.ok(bad.code ~= 0 and bad.err:find("quantize must be one of", 1, true), bad.err)
  bad = T.run_nvlua(T.shq(script) .. " " .. T.shq(ROOT .. "/nowhere") .. " " .. T.shq(out))
  T.ok(bad.code ~= 0 and bad.err:find("is not a directory", 1, true), bad.err)
end)

T.case("cleanup: the scratch directory is removed", function() T.ok(T.rm_tree(ROOT)) end)
