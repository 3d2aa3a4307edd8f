-- scripts/roofline.lua: issue 16's roofline ESTIMATE of one Llama 3 8B block (hidden 4096, 32/8 heads
-- of 128, SwiGLU 14336, sequence 8192, micro-batch 1) training on an H100, per recipe, from the CUDA
-- emulator's counters (build with -DNVLUA_CUDA=EMU). Not a measurement: nothing here runs on a GPU.
--
-- Method:
--  1. Counters of one steady-state training step (the last of `steps`: forward_backward, opt:clip_grad_norm,
--     AdamW, zero_grad; sync mode off; the norm is not read back, as a step that logs nothing) of small Llamas on the emulated CUDA backend, for each size s of
--     `sizes`: hidden 64s, SwiGLU 224s (3.5 x hidden, as 8B), sequence 128s (2 x hidden, as 8B), 4 query
--     heads and 2 KV heads (the KV width is hidden/2: fp8/mx GEMMs need it >= 32), vocab 64, with 1 and
--     with 2 blocks. One block's share = the 2-block step minus the 1-block step (embedding, final norm,
--     head and loss cancel).
--  2. GEMMs (cuBLASLt): each GEMM shape of the block at the first size has m, n, k among its distinct
--     dimensions tokens / hidden / KV width / SwiGLU; each is replaced by the 8B block's (8192, 4096,
--     1024, 14336): FLOPs 2 m n k exactly, at gemm_eff of the dense peak of its input type (bf16 989
--     TFLOP/s, fp8 1979; on Hopper nvfp4 and mxfp8 run as bf16 GEMMs after dequantization, which is
--     what the emulator's sm_90 shows).
--  3. Other kernels: global-memory bytes read + written per kernel (the emulator's unique bytes per
--     launch, 4 KiB-page granular, clipped to each allocation) fitted per kernel as a + b s + c s^2
--     over the sizes (2 sizes: b s + c s^2; 1 size: c s^2, for smoke runs) and evaluated at
--     s = 64 (hidden 4096 = 64 x 64; every proportion of the family is the 8B block's except the KV
--     width, 2x the 8B's share, and the head count, fixed: per-head row
--     statistics are under-counted 8x, negligible); time at mem_eff x 3.35 TB/s.
--  4. Attention: FLOPs from the 8B shapes (forward 2 T^2 D Hq for the full square, backward 2.5x
--     forward), priced per route at a stated efficiency of 989 TFLOP/s: nvlua's own tensor-core kernels
--     (kernels/cuda/flash_attn.cu, WMMA) at flash_eff, default 0.04: what the first H200 measurement of
--     2026-11-28 implies (experiments/bench/blocks_h200_2026-11-28.md as of commit 725b3fc, on the flash
--     route: the bf16 block's 73.0 ms less this script's estimate of the rest of the step; a review of
--     their SASS had estimated 5-7%; scripts/bench_attention.lua then measured 44-46 TFLOP/s, 4.5%);
--     cuDNN's fused SDPA at cudnn_eff, default 0.5 (published H100 figures for cuDNN 9 and
--     FlashAttention-3 put bf16 causal forward at 60-75% of peak and backward at 40-55%; 0.5 for
--     both together was the defensible middle; the H200 then measured nvlua's cuDNN route at 623 TFLOP/s
--     forward and 534 backward, experiments/bench/attention_h200_2026-11-28.md). The small family's
--     own attention kernels (head dims 16-48: fp32 CUDA cores, attn_*) are shown at simt_eff of 67
--     TFLOP/s for reference only.
--  5. Launch overhead: launch_us per launch of the block (not overlapped); host syncs: sync_us each.
--  6. MFU: model FLOPs of the block (6 x GEMM parameters x tokens + 12 T^2 D Hq, the full square, as
--     train.flops_per_token) over the estimated time and 989 TFLOP/s. Anchors: torchtitan bf16 H100
--     33-39% MFU (torch.compile) -> torch.compile's block time = model FLOPs / (0.33..0.39 x 989
--     TFLOP/s); Megatron-Bridge FP8 H100 Llama 3 8B 744 TFLOP/s -> model FLOPs / 744 TFLOP/s.
--   build-emu/nvlua scripts/roofline.lua [steps=3] [sizes=1,2,3] [recipes=bf16,fp8_cs,nvfp4,mxfp8]
--     [out=experiments/bench/roofline_h100_estimate.md] [gemm_eff=0.7] [mem_eff=0.8] [flash_eff=0.04]
--     [cudnn_eff=0.5] [simt_eff=0.5] [launch_us=3] [sync_us=20]
-- out="" prints only. Exits 77 outside the emulation build.
local nv = require "nvlua"
local core = require "nvlua.core"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local recipe = require "nvlua.recipe"
local config = require "nvlua.config"

-- attention runs on nvlua's own kernels here (attention=flash): the emulator counts kernels, and cuDNN's fused
-- attention (attention=auto's choice on sm_90) is a library call it does not see as kernels; the 8B route's
-- attention is priced from its FLOPs either way (4. above)
core.attention_route("flash")

local frac = {min = 0.01, max = 1}
local cfg = config.schema({steps = config.int(3, {min = 2}), sizes = config.str("1,2,3", {nonempty = true}),
  recipes = config.str("bf16,fp8_cs,nvfp4,mxfp8", {nonempty = true}),
  out = config.str("experiments/bench/roofline_h100_estimate.md"), gemm_eff = config.num(0.7, frac),
  mem_eff = config.num(0.8, frac), flash_eff = config.num(0.04, frac), cudnn_eff = config.num(0.5, frac),
  simt_eff = config.num(0.5, frac),
  launch_us = config.num(3, {min = 0}), sync_us = config.num(20, {min = 0})}):parse(arg)

if not (core.cuda_emulated and core.cuda_emulated()) then
  io.stderr:write("roofline: needs the CUDA emulation build (-DNVLUA_CUDA=EMU)\n")
  os.exit(77)
end

core.cuda_set_sync(false) -- as in training: no synchronisation after each kernel (it would count as host syncs)

local sizes = {}
for v in cfg.sizes:gmatch("[^,]+") do
  local s = math.tointeger(tonumber(v))
  if not s or s < 1 or s > 8 then error("roofline: sizes must be integers 1..8, got " .. v, 0) end
  sizes[#sizes + 1] = s
end
for i = 2, #sizes do
  if sizes[i] <= sizes[i - 1] then error("roofline: sizes must increase, got " .. cfg.sizes, 0) end
end
-- the fit's basis: 3+ sizes a + b s + c s^2; 2 sizes b s + c s^2; 1 size c s^2 (smoke runs only)
local BASIS = #sizes >= 3 and {0, 1, 2} or #sizes == 2 and {1, 2} or {2}
local BASIS_TEXT = #sizes >= 3 and "a + b s + c s^2" or #sizes == 2 and "b s + c s^2 (2 sizes: rough)" or
  "c s^2 (1 size: a smoke run, not an estimate to quote)"

-- the 8B block and the peaks (dense, H100 SXM)
local B8 = {T = 8192, H = 4096, KV = 8 * 128, F = 14336, Hq = 32, D = 128}
local S_TARGET = B8.H / 64
local PEAK = {bf16 = 989e12, fp8 = 1979e12, fp32 = 67e12}
local HBM = 3.35e12

local function small(s) return {T = 128 * s, H = 64 * s, KV = 32 * s, F = 224 * s} end

-- ---- 1. counters of the last step -------------------------------------------------------------

local function measure(rname, s, layers)
  local d = small(s)
  local mcfg = {vocab_size = 64, hidden_size = d.H, intermediate_size = d.F, num_hidden_layers = layers,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = d.T}
  local model = llama.Llama(mcfg, {seed = 1, recipe = recipe[rname]()}):to("cuda")
  local opt = optim.AdamW(model:named_parameters(), {lr = 1e-3})
  local gen = nv.Generator(5)
  local c, loss
  for step = 1, cfg.steps do
    local x = (nv.rand(1, d.T, {generator = gen}) * 63):to("i64")
    local y = (nv.rand(1, d.T, {generator = gen}) * 63):to("i64")
    if step == cfg.steps then core.cuda_emu_reset_counters() end
    loss = model:forward_backward(x, y, {defer_loss = true}) -- read after the step, as the trainer reads it
    opt:clip_grad_norm(1.0) -- the trainer's (train.lua): the norm on the device, the factor applied by AdamW
    opt:step()
    model:zero_grad()
    x:free(); y:free()
    if step < cfg.steps then llama.loss_value(loss) end
  end
  c = core.cuda_emu_counters()
  llama.loss_value(loss)
  model, opt = nil, nil
  collectgarbage()
  return c
end

local function gemm_key(g) return table.concat({g.a, g.b, g.d, g.scales, g.m, g.n, g.k}, " ") end

-- One block: the 2-block step minus the 1-block step.
local function per_block(c2, c1)
  local k = {}
  for name, v in pairs(c2.kernels) do
    local u = c1.kernels[name] or {launches = 0, bytes_read = 0, bytes_written = 0}
    k[name] = {launches = v.launches - u.launches, bytes = v.bytes_read + v.bytes_written - u.bytes_read -
      u.bytes_written}
  end
  local g1 = {}
  for _, g in ipairs(c1.gemm_shapes) do g1[gemm_key(g)] = g.calls end
  local gemms = {}
  for _, g in ipairs(c2.gemm_shapes) do
    local n = g.calls - (g1[gemm_key(g)] or 0)
    if n > 0 then gemms[#gemms + 1] = {a = g.a, b = g.b, scales = g.scales, m = g.m, n = g.n, k = g.k, calls = n} end
  end
  return {kernels = k, gemms = gemms, launches = c2.launches - c1.launches,
    host_syncs = c2.host_syncs - c1.host_syncs, step_syncs = c2.host_syncs, step_launches = c2.launches}
end

-- ---- 2.-3. scaling --------------------------------------------------------------------------------

-- least squares of v(s) = sum_j c_j s^BASIS[j] over the sizes, evaluated at s = x
local function fit_eval(vals, x)
  local n = #BASIS
  local A, r = {}, {}
  for p = 1, n do A[p], r[p] = {}, 0; for q = 1, n do A[p][q] = 0 end end
  for i, s in ipairs(sizes) do
    for p = 1, n do
      local fp = s ^ BASIS[p]
      r[p] = r[p] + fp * vals[i]
      for q = 1, n do A[p][q] = A[p][q] + fp * s ^ BASIS[q] end
    end
  end
  for p = 1, n do -- Gauss-Jordan (the matrix is SPD for n or more distinct sizes)
    local piv = A[p][p]
    for q = 1, n do A[p][q] = A[p][q] / piv end
    r[p] = r[p] / piv
    for o = 1, n do
      if o ~= p then
        local m = A[o][p]
        for q = 1, n do A[o][q] = A[o][q] - m * A[p][q] end
        r[o] = r[o] - m * r[p]
      end
    end
  end
  local y = 0
  for p = 1, n do y = y + r[p] * x ^ BASIS[p] end
  return y
end

local function is_attention(name) return name:find("attn") ~= nil or name:find("flash") ~= nil end

local function gemm_class(g)
  local fp8 = {e4m3 = true, e5m2 = true}
  if fp8[g.a] and fp8[g.b] then return "fp8" end
  if g.a == "f32" or g.b == "f32" then return "fp32" end
  return "bf16" -- bf16, and e2m1 (no FP4 tensor cores on Hopper: counted at the bf16 rate)
end

local function scale_gemms(gemms, s)
  local d, map = small(s), {}
  for sym, v in pairs(d) do
    if map[v] then error("roofline: size " .. s .. " has two dimensions of " .. v, 0) end
    map[v] = B8[sym]
  end
  local by = {}
  for _, g in ipairs(gemms) do
    local m, n, k = map[g.m], map[g.n], map[g.k]
    if not (m and n and k) then
      error(string.format("roofline: GEMM %d x %d x %d has a dimension that is none of tokens %d, hidden %d, KV %d, " ..
        "SwiGLU %d", g.m, g.n, g.k, d.T, d.H, d.KV, d.F), 0)
    end
    local cl = gemm_class(g)
    local t = by[cl] or {calls = 0, flops = 0, types = {}}
    t.calls, t.flops = t.calls + g.calls, t.flops + 2 * m * n * k * g.calls
    t.types[g.a .. "x" .. g.b] = true
    by[cl] = t
  end
  return by
end

-- ---- 4.-6. one recipe's estimate -------------------------------------------------------------------

local P_BLOCK = B8.H * (2 * B8.H + 2 * B8.KV) + 3 * B8.H * B8.F
local MODEL_FLOPS = 6 * P_BLOCK * B8.T + 12 * B8.T * B8.T * B8.D * B8.Hq
local ATT_FLOPS = 3.5 * 2 * B8.T * B8.T * B8.D * B8.Hq

-- attention routes of the 8B block and the efficiency key of each (header, 4.)
local ROUTES = {{name = "flash", eff = "flash_eff", what = "nvlua's WMMA flash kernels"},
  {name = "cudnn", eff = "cudnn_eff", what = "cuDNN fused SDPA"}}

-- The measured H200 rows (scripts/bench_blocks.lua, 1 block, seq 8192, attention=auto: cuDNN 9.19's route),
-- if that file is there: {["nvlua bf16"] = ms, ["torch compile"] = ms, ...}; and the cuDNN route's measured
-- attention forward + backward at the 8B's shapes (scripts/bench_attention.lua), ms
local MEASURED_FILE = "experiments/bench/blocks_h200_2026-11-28.md"
local ATTN_FILE = "experiments/bench/attention_h200_2026-11-28.md"
local function measured_attention()
  local f = io.open(ATTN_FILE, "r")
  if not f then return nil end
  local ms
  for line in f:lines() do
    local v = line:match("^| nvlua cudnn | [%d.]+ | [%d.]+ | ([%d.]+) |")
    if v then ms = tonumber(v) end
  end
  f:close()
  return ms
end
local function measured_blocks()
  local f = io.open(MEASURED_FILE, "r")
  if not f then return nil end
  local m = {}
  for line in f:lines() do
    local blocks, name, ms = line:match("^| (%d+) | ([^|]-) | ([%d.]+) |")
    if blocks == "1" then m[name] = tonumber(ms) end
  end
  f:close()
  return next(m) and m or nil
end

local function estimate(rname)
  local blocks = {}
  for i, s in ipairs(sizes) do
    blocks[i] = per_block(measure(rname, s, 2), measure(rname, s, 1))
  end
  local names = {}
  for _, b in ipairs(blocks) do -- attention kernels are templated on the head dim (16 s): one name for all
    local k = {}
    for name, v in pairs(b.kernels) do
      local key = is_attention(name) and name:gsub("<%d+>", "<D>") or name
      local u = k[key] or {launches = 0, bytes = 0}
      u.launches, u.bytes = u.launches + v.launches, u.bytes + v.bytes
      k[key] = u
    end
    b.kernels = k
    for name in pairs(k) do names[name] = true end
  end
  local e = {recipe = rname, mem_bytes = 0, kernels = {}, attn = {}, gemm = scale_gemms(blocks[1].gemms, sizes[1])}
  local last = blocks[#blocks]
  for name in pairs(names) do
    local v = {}
    for i, b in ipairs(blocks) do v[i] = b.kernels[name] and b.kernels[name].bytes or 0 end
    local bytes = math.max(0, fit_eval(v, S_TARGET))
    local launches = last.kernels[name] and last.kernels[name].launches or 0
    if is_attention(name) then
      e.attn[#e.attn + 1] = name
    else
      e.mem_bytes = e.mem_bytes + bytes
    end
    e.kernels[#e.kernels + 1] = {name = name, bytes = bytes, launches = launches, attention = is_attention(name)}
  end
  table.sort(e.kernels, function(a, b) return a.bytes > b.bytes end)
  table.sort(e.attn)
  e.launches, e.syncs, e.step_syncs, e.step_launches = last.launches, last.host_syncs, last.step_syncs,
    last.step_launches
  e.gemm_ms = 0
  for cl, t in pairs(e.gemm) do
    t.ms = t.flops / (cfg.gemm_eff * PEAK[cl]) * 1e3
    e.gemm_ms = e.gemm_ms + t.ms
  end
  e.mem_ms = e.mem_bytes / (cfg.mem_eff * HBM) * 1e3
  local flash = #e.attn > 0 and e.attn[1]:find("flash") ~= nil
  e.attn_kind = #e.attn == 0 and "none seen" or flash and "nvlua's tensor-core kernels" or "fp32 CUDA cores"
  e.attn_ms = ATT_FLOPS / (flash and cfg.flash_eff * PEAK.bf16 or cfg.simt_eff * PEAK.fp32) * 1e3
  e.launch_ms = e.launches * cfg.launch_us * 1e-3
  e.sync_ms = e.syncs * cfg.sync_us * 1e-3
  e.rest_ms = e.gemm_ms + e.mem_ms + e.launch_ms + e.sync_ms
  e.step_ms = e.rest_ms + e.attn_ms
  e.mfu = MODEL_FLOPS / (e.step_ms * 1e-3) / PEAK.bf16
  -- the 8B block's routes (head dim 128, bf16): nvlua's flash kernels, or cuDNN's SDPA; the small
  -- family's head dims may take neither (then the step above priced the kernels it ran)
  e.routes = {}
  for _, r in ipairs(ROUTES) do
    local ms = e.rest_ms + ATT_FLOPS / (cfg[r.eff] * PEAK.bf16) * 1e3
    e.routes[r.name] = {attn_ms = ATT_FLOPS / (cfg[r.eff] * PEAK.bf16) * 1e3, ms = ms,
      mfu = MODEL_FLOPS / (ms * 1e-3) / PEAK.bf16}
  end
  return e
end

-- ---- output -------------------------------------------------------------------------------------------

local lines = {}
local function out(fmt, ...) lines[#lines + 1] = select("#", ...) > 0 and string.format(fmt, ...) or fmt end

local function recipe_table(e)
  out("\n### %s\n", e.recipe)
  out("| part | per block | at | est. ms |")
  out("|---|---|---|---:|")
  for _, cl in ipairs({"bf16", "fp8", "fp32"}) do
    local t = e.gemm[cl]
    if t then
      local ty = {}
      for k in pairs(t.types) do ty[#ty + 1] = k end
      table.sort(ty)
      out("| GEMMs %s (%s) | %d calls, %.2f TFLOP | %.0f%% of %.0f TFLOP/s | %.2f |", cl, table.concat(ty, ", "),
        t.calls, t.flops / 1e12, 100 * cfg.gemm_eff, PEAK[cl] / 1e12, t.ms)
    end
  end
  out("| memory-bound kernels | %.2f GB read+written | %.0f%% of 3.35 TB/s | %.2f |", e.mem_bytes / 1e9,
    100 * cfg.mem_eff, e.mem_ms)
  out("| attention the small family ran: %s (%s) | %.2f TFLOP | %s | %.2f |", e.attn_kind, table.concat(e.attn, ", "),
    ATT_FLOPS / 1e12, e.attn_kind:find("tensor") and string.format("%.0f%% of 989 TFLOP/s", 100 * cfg.flash_eff)
    or string.format("%.0f%% of 67 TFLOP/s fp32", 100 * cfg.simt_eff), e.attn_ms)
  out("| kernel launches | %d | %.0f us each, not overlapped | %.2f |", e.launches, cfg.launch_us, e.launch_ms)
  out("| host syncs | %d (whole 2-block step: %d) | %.0f us each | %.2f |", e.syncs, e.step_syncs, cfg.sync_us,
    e.sync_ms)
  out("| **step (one block), the family's attention** | | | **%.2f** |", e.step_ms)
  out("\nThe 8B block (head dim 128) by attention route:")
  for _, r in ipairs(ROUTES) do
    local x = e.routes[r.name]
    out("- %s (%s, %.0f%% of 989 TFLOP/s): attention %.2f ms, step %.2f ms, %.0f tokens/s, MFU %.1f%%", r.name, r.what,
      100 * cfg[r.eff], x.attn_ms, x.ms, B8.T / (x.ms * 1e-3), 100 * x.mfu)
  end
  out("\nLargest memory-bound kernels at the 8B block (bytes per step, launches):")
  for i = 1, math.min(6, #e.kernels) do
    local k = e.kernels[i]
    out("- `%s`: %.3f GB, %d launches%s", k.name, k.bytes / 1e9, k.launches, k.attention and " (attention)" or "")
  end
end

local est, order = {}, {}
for rname in cfg.recipes:gmatch("[^,]+") do
  if not recipe[rname] then error("roofline: unknown recipe " .. rname, 0) end
  order[#order + 1] = rname
  est[rname] = estimate(rname)
end

out("# H100 roofline of one Llama 3 8B block (seq 8192): ESTIMATE\n")
out("ESTIMATE from emulation counters, not a measurement (%s, %s). Generated by `scripts/roofline.lua " ..
  "sizes=%s steps=%d`.\n", os.date("!%Y-%m-%d"), core.cuda_emulated(), cfg.sizes, cfg.steps)
out("Block: hidden 4096, 32/8 heads of 128, SwiGLU 14336, sequence 8192, micro-batch 1: %.2f TFLOP of model " ..
  "FLOPs per training step (6 x %.0fM GEMM parameters x 8192 + 12 T^2 D Hq). Method in the script's header: " ..
  "GEMMs scaled exactly by shape, other kernels' unique bytes fitted over small sizes (a + b s + c s^2) and " ..
  "extrapolated, attention from its FLOPs. Kernel byte fit: %s.", MODEL_FLOPS / 1e12, P_BLOCK / 1e6,
  BASIS_TEXT)
local bf = est.bf16
local torch_ms = {MODEL_FLOPS / (0.39 * PEAK.bf16) * 1e3, MODEL_FLOPS / (0.33 * PEAK.bf16) * 1e3}
local mega_ms = MODEL_FLOPS / 744e12 * 1e3
out("\n## Summary\n")
out("Estimated step of one 8B block per recipe and attention route (H100; attention at the stated efficiency " ..
  "of each route, the rest from the counters):\n")
out("```")
for _, r in ipairs(order) do
  for _, rt in ipairs(ROUTES) do out("%-8s %-6s %6.1f ms", r, rt.name, est[r].routes[rt.name].ms) end
end
out("```\n")
out("| recipe | route | est. ms | tokens/s | MFU | vs bf16 (same route) | host syncs per block (whole 2-block step) |")
out("|---|---|---:|---:|---:|---:|---:|")
for _, r in ipairs(order) do
  local e = est[r]
  for _, rt in ipairs(ROUTES) do
    local x = e.routes[rt.name]
    out("| nvlua %s (estimate) | %s | %.2f | %.0f | %.1f%% | %s | %d (%d) |", r, rt.name, x.ms, B8.T / (x.ms * 1e-3),
      100 * x.mfu, bf and string.format("%.2fx", x.ms / bf.routes[rt.name].ms) or "-", e.syncs, e.step_syncs)
  end
end
out("| torch.compile bf16 (torchtitan anchor, 33-39%% MFU) | | %.2f-%.2f | | 33-39%% | | |", torch_ms[1], torch_ms[2])
out("| Megatron-Bridge FP8 (anchor, 744 TFLOP/s) | | %.2f | | %.1f%% | | |", mega_ms, 100 * 744e12 / PEAK.bf16)
local meas = measured_blocks()
if meas then
  out("\nMeasured on one H200 (%s; 989 TFLOP/s bf16 like the H100, 4.8 TB/s instead of 3.35), one block, " ..
    "seq 8192, nvlua on the cuDNN route (attention=auto, cuDNN 9.19):\n", MEASURED_FILE)
  out("| measured | step ms | model TFLOP/s |")
  out("|---|---:|---:|")
  for _, k in ipairs({"nvlua bf16", "nvlua fp8_cs", "nvlua nvfp4", "torch eager", "torch compile"}) do
    if meas[k] then out("| %s | %.1f | %.0f |", k, meas[k], MODEL_FLOPS / (meas[k] * 1e-3) / 1e12) end
  end
  local att = measured_attention()
  if meas["nvlua bf16"] and bf and att then
    local rest = meas["nvlua bf16"] - att
    out("\nThe bf16 block's measured %.1f ms less cuDNN's measured attention (%.2f ms forward + backward, %s) leaves " ..
      "%.1f ms for the rest of the step, %.2fx this estimate's rest (%.2f ms, priced for the H100's slower memory: " ..
      "on the H200 the gap is larger still): the GEMMs, norms, RoPE, SwiGLU, casts and quantizers outside attention " ..
      "run slower than the roofline's 70%% of peak GEMMs and 80%% of HBM bandwidth.", meas["nvlua bf16"], att, ATTN_FILE,
      rest, rest / bf.rest_ms, bf.rest_ms)
    for _, r in ipairs(order) do
      local k = "nvlua " .. r
      if meas[k] and est[r] then
        out("- %s: estimated %.2f ms (cuDNN route), measured %.1f ms (H200): measured / estimate %.2f", r,
          est[r].routes.cudnn.ms, meas[k], meas[k] / est[r].routes.cudnn.ms)
      end
    end
  end
  if meas["torch compile"] then
    out("torch.compile measured %.1f ms (%.0f%% MFU): far better than the torchtitan anchor above.", meas["torch compile"],
      100 * MODEL_FLOPS / (meas["torch compile"] * 1e-3) / PEAK.bf16)
  end
end
if bf then
  local tc = meas and meas["torch compile"]
  out("\nGoals (issues 16, 29), on these estimates:")
  for _, rt in ipairs(ROUTES) do
    out("- bf16 via %s at least as fast as torch.compile: %.2f ms vs %s: %s", rt.name, bf.routes[rt.name].ms,
      tc and string.format("%.1f ms measured (H200)", tc) or string.format("%.2f-%.2f ms (anchor)", torch_ms[1], torch_ms[2]),
      bf.routes[rt.name].ms <= (tc or torch_ms[2]) and "met" or "not met")
  end
  out("- bf16 <= 30 ms with the cuDNN route (issue 29): %.2f ms: %s", bf.routes.cudnn.ms,
    bf.routes.cudnn.ms <= 30 and "met" or "not met")
  if est.fp8_cs then
    local r = est.fp8_cs.routes.cudnn.ms / bf.routes.cudnn.ms
    out("- fp8_cs <= 0.8x bf16 with the cuDNN route (issue 29): %.2fx: %s", r, r <= 0.8 and "met" or "not met")
  end
  if est.nvfp4 then
    local r = est.nvfp4.routes.cudnn.ms / bf.routes.cudnn.ms
    out("- nvfp4 (emulated on Hopper) <= 1.35x bf16 time (cuDNN route): %.2fx: %s", r, r <= 1.35 and "met" or "not met")
  end
end
out("\n## Per recipe")
for _, r in ipairs(order) do recipe_table(est[r]) end

local text = table.concat(lines, "\n") .. "\n"
io.write(text)
if cfg.out ~= "" then
  local f = assert(io.open(cfg.out, "w"))
  f:write(text)
  f:close()
  io.stderr:write("roofline: wrote " .. cfg.out .. "\n")
end
