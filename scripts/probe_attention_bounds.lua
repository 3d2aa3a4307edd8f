-- scripts/probe_attention_bounds.lua: how close the GPU's fused attention kernels come to the error bounds
-- of tests/flash_bounds.lua (derived from FlashAttention's numerics: fp32 scores, softmax and sums; P and dS
-- rounded to bf16 before their products; outputs rounded once). For each shape and seed, each pairing of a
-- forward and a backward (cudnn/cudnn, flash/flash, flash forward then cudnn backward, cudnn then flash, and
-- cudnn's backward fed the reference's own out and lse), the largest |got - want| / bound over dq, dk and dv
-- (1.0 = at the bound) and the largest |lse - lse_ref| / (the bound's ep + ea). A pairing whose ratio
-- approaches 1 where the others stay well below says which rounding the bound does not model.
--   build-gpu/nvlua scripts/probe_attention_bounds.lua [seeds=20]
-- Exits 77 without a GPU or without cuDNN's route.
local nv = require "nvlua"
local core = nv.core
local config = require "nvlua.config"

local cfg = config.schema({ seeds = config.int(20, { min = 1 }) }):parse(arg)
if not nv.cuda.available() then
  io.stderr:write("probe_attention_bounds: no GPU (" .. tostring(nv.info().cuda_unavailable_reason) .. ")\n")
  os.exit(77)
end
local FB = dofile("tests/flash_bounds.lua")
local bounds, randb = FB.bounds, FB.randb

local function flat(t) return t:cpu():to("f32"):contiguous():reshape(-1):totable() end
local function ref(fn, ...)
  local prev = nv.use_reference(true)
  local r = table.pack(pcall(fn, ...))
  nv.use_reference(prev)
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

-- largest |got - want| / ((2^-8 + 2^-23) |want| + bound) (tests/flash_bounds.lua's within), and where
local function ratio(got, want, bound)
  local g, w, e = flat(got), flat(want), flat(bound)
  local maxr, at = 0, 0
  for i = 1, #w do
    local lim = (2 ^ -8 + 2 ^ -23) * math.abs(w[i]) + e[i]
    local r = math.abs(g[i] - w[i]) / lim
    if r > maxr then maxr, at = r, i end
  end
  return maxr, at
end
local function lse_ratio(got, want, e)
  local g, w, m = flat(got), flat(want), 0
  for i = 1, #w do m = math.max(m, math.abs(g[i] - w[i]) / e) end
  return m
end

local dev = nv.cuda.devices()[1]
print(string.format("# Fused attention against tests/flash_bounds.lua's bounds on %s (compute capability %s), %s\n",
  dev.name, dev.capability, os.date("!%Y-%m-%d %H:%M UTC")))
print("Largest error / bound over the seeds (1.00 = at the bound); causal, bf16 q, k, v, dout drawn from randn.\n")
print("dk, dv (group): against the bound with group_round (each query head's share rounded to bf16 before the")
print("group's sum, tests/flash_bounds.lua), the bound test_cuda_cudnn.lua holds cuDNN's backward to.\n")
print("| shape (B, T, Hq, Hkv, D) | forward -> backward | lse / (ep + ea) | dq | dk | dv | dk (group) | dv (group) |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
local shapes = { { 1, 69, 4, 2, 64 }, { 1, 69, 4, 4, 64 }, { 1, 130, 8, 2, 128 }, { 1, 64, 8, 1, 64 } }
for _, sh in ipairs(shapes) do
  local B, Tn, Hq, Hkv, D = table.unpack(sh)
  local scale = 1 / math.sqrt(D)
  local worst = {}
  local order = {}
  local function note(name, ...)
    if not worst[name] then worst[name] = { 0, 0, 0, 0, 0, 0 }; order[#order + 1] = name end
    local w, r = worst[name], { ... }
    for i = 1, 6 do w[i] = math.max(w[i], r[i]) end
  end
  for seed = 1, cfg.seeds do
    nv.manual_seed(1000 + seed)
    local x = { q = randb(B, Tn, Hq, D), k = randb(B, Tn, Hkv, D), v = randb(B, Tn, Hkv, D), dout = randb(B, Tn, Hq, D) }
    local d = {}
    for name, t in pairs(x) do d[name] = t:to("bf16"):cuda() end
    local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
    local dq, dk, dv = ref(core.attention_backward, x.dout, x.q, x.k, x.v, out, lse, scale)
    x.lse, x.out = lse, out
    local _, bq, bk, bv, e_lse = bounds(x, scale, true, true)
    local _, _, gbk, gbv = bounds(x, scale, true, true, 1, true)
    local fwd = {
      cudnn = function() return core.cuda_cudnn_attention(d.q, d.k, d.v, scale) end,
      flash = function() return core.cuda_flash_attention(d.q, d.k, d.v, scale) end,
      reference = function() return out:to("bf16"):cuda(), lse:cuda() end,
    }
    local bwd = {
      cudnn = function(o, l) return core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale) end,
      flash = function(o, l) return core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale) end,
    }
    for _, pr in ipairs({ { "cudnn", "cudnn" }, { "flash", "flash" }, { "flash", "cudnn" }, { "cudnn", "flash" },
      { "reference", "cudnn" }, { "reference", "flash" } }) do
      local o, l = fwd[pr[1]]()
      local gq, gk, gv = bwd[pr[2]](o, l)
      note(pr[1] .. " -> " .. pr[2], lse_ratio(l, lse, e_lse), ratio(gq, dq, bq), ratio(gk, dk, bk), ratio(gv, dv, bv),
        ratio(gk, dk, gbk), ratio(gv, dv, gbv))
    end
  end
  for _, name in ipairs(order) do
    local w = worst[name]
    print(string.format("| %d, %d, %d, %d, %d | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |", B, Tn, Hq, Hkv, D, name,
      table.unpack(w)))
  end
  io.stdout:flush()
end
