-- tests/qgather_cases.lua: the cases of the quantized all-gather (nv.quant.all_gather_quantized,
-- core/qgather.c) shared by test_qgather.lua (CPU ranks) and test_cuda_qgather.lua (emulated CUDA
-- ranks). Not a test file: loaded with dofile, run inside each rank of an mpirun job.
--
-- Every rank builds the same weight W from a fixed seed, takes its rows by dist.shard_rows, gathers,
-- and compares against W quantized whole on this rank's CPU (nv.quantize: the unsharded quantization),
-- byte for byte: codes (the blocked layout's bytes), block scales, the amax and scale as fp32 bits,
-- format, layout, shape and blocked axis; and the dgrad copy against the quantization of W^T (16x16,
-- per-tensor and plain formats: what q:t() must equal) or of W along its rows (mx, nvfp4 1x16). Then
-- GEMMs through the gathered weight against the same GEMMs through the unsharded one, bit for bit
-- (fprop X W^T, dgrad dY W), and the bytes dist.bytes() counted against the ring formula of
-- core/dist.h over the padded chunks.
local M = {}

local nv = require "nvlua"
local dist = require "nvlua.dist"

-- W (rows, K) f32: N(0, 1) from a fixed generator; variant "outliers" adds large and tiny entries
-- (|x| up to 3e3 in a few places, a row of 1e-6, an all-zero 16x16 tile when the shape has one, a
-- value at the e4m3 subnormal edge relative to the amax), "zeros" is all zeros (amax 0: scale 1).
function M.weight(rows, K, variant, seed)
  local W = nv.randn(rows, K, {generator = nv.Generator(seed or 7)})
  if variant == "zeros" then return W:fill_(0) end
  if variant == "outliers" and rows > 0 then
    local function set(r, k, v) W:narrow(1, r, 1):narrow(2, k, 1):fill_(v) end
    set(1, 1, 3000)
    set(rows, K, -2500)
    set((rows + 1) // 2, 2, 1e-30)
    W:narrow(1, math.max(1, rows - 1), 1):mul_(1e-6)
    if rows >= 32 and K >= 32 then W:narrow(1, 17, 16):narrow(2, 17, 16):fill_(0) end
    set(math.min(rows, 3), math.min(K, 5), 3000 * 2 ^ -17)
  end
  return W
end

-- {name, spec, copies, rows, K, variant}: odd sizes (rows not divisible by the world size or by 16 x
-- world), a rank with no rows (32 rows of 16x16 tiles on 3 ranks: 16, 16, 0), and the formats of
-- NUMERICS: nvfp4 16x16 and 1x16, fp8 e4m3 / e5m2 per tensor, mxfp8 / mxfp4 (both scale rules), bf16.
M.CASES = {
  {"nvfp4 2d 112x64", {format = "nvfp4", block = "2d"}, "both", 112, 64, "random"},
  {"nvfp4 2d 112x64 outliers", {format = "nvfp4", block = "2d"}, "both", 112, 64, "outliers"},
  {"nvfp4 2d 160x48", {format = "nvfp4", block = "2d"}, "both", 160, 48, "random"},
  {"nvfp4 2d 32x64 (a rank may hold no rows)", {format = "nvfp4", block = "2d"}, "both", 32, 64, "outliers"},
  {"nvfp4 2d 64x32 zeros", {format = "nvfp4", block = "2d"}, "fprop", 64, 32, "zeros"},
  {"nvfp4 1x16 160x48", "nvfp4", "both", 160, 48, "outliers"},
  {"e4m3 113x48", "e4m3", "both", 113, 48, "outliers"},
  {"e5m2 112x64", "e5m2", "both", 112, 64, "outliers"},
  {"e4m3 2x16 (a rank may hold no rows)", "e4m3", "fprop", 2, 16, "random"},
  {"mxfp8_e4m3 160x64", "mxfp8_e4m3", "both", 160, 64, "outliers"},
  {"mxfp4 160x64 floor", {format = "mxfp4", scale_rule = "floor"}, "both", 160, 64, "outliers"},
  {"mxfp8_e5m2 96x32 dgrad only", "mxfp8_e5m2", "dgrad", 96, 32, "random"},
  {"bf16 112x48", "bf16", "both", 112, 48, "outliers"},
}

local function spec_table(spec) return type(spec) == "string" and {format = spec} or spec end

-- the whole weight's quantization with spec's options along the 1-based blocked dim axis
local function quantize_whole(W, spec, axis)
  local s = spec_table(spec)
  return nv.quantize(W, s.format, {axis = axis, block = s.block, scale_rule = s.scale_rule})
end

local function transposable(spec)
  local s = spec_table(spec)
  local scale = nv.formats[s.format].scale
  return scale == "none" or scale == "fp32" or s.block == "2d"
end

local function f32bits(x) return string.pack("<f", x) end

-- q's block scales in its blocked layout (scale_bytes presents them in q's logical shape)
local function blocked_scales(q)
  local s = q:scale_bytes()
  if q:axis() ~= q:dim() then s = s:transpose(q:axis(), q:dim()):contiguous() end
  return s:bytes()
end

-- "" if a (host QTensor) equals b in every byte and field, else what differs. blocked: compare the
-- blocked layouts only (W^T blocked along its last dim and W along its first are one layout).
function M.diff(a, b, blocked)
  local d = {}
  if a:format() ~= b:format() then d[#d + 1] = "format " .. a:format() .. " vs " .. b:format() end
  if a:layout() ~= b:layout() then d[#d + 1] = "layout " .. a:layout() .. " vs " .. b:layout() end
  if not blocked and (table.concat(a:size(), "x") ~= table.concat(b:size(), "x") or a:axis() ~= b:axis()) then
    d[#d + 1] = string.format("shape %s/%d vs %s/%d", table.concat(a:size(), "x"), a:axis(), table.concat(b:size(), "x"),
      b:axis())
  end
  if a:data():bytes() ~= b:data():bytes() then d[#d + 1] = "codes" end
  if b.block > 0 and blocked_scales(a) ~= blocked_scales(b) then d[#d + 1] = "block scales" end
  if nv.formats[a:format()].global_amax then
    if f32bits(a.amax) ~= f32bits(b.amax) then d[#d + 1] = string.format("amax %.9g vs %.9g", a.amax, b.amax) end
    if f32bits(a.scale) ~= f32bits(b.scale) then d[#d + 1] = string.format("scale %.9g vs %.9g", a.scale, b.scale) end
  end
  return table.concat(d, ", ")
end

-- the activation operand a GEMM pairs with a weight copy of format fmt (its 1-D form, along the
-- same reduction dim; e4m3 beside e5m2, which cuBLASLt does not pair with itself)
local function act_operand(t, fmt) return nv.quantize(t, fmt == "e5m2" and "e4m3" or fmt, {}) end

-- bytes the all-gathers of one case send from this rank (core/dist.h): (N - 1) chunks of codes and
-- scales per gathered copy, the chunks padded to dist.shard_rows' chunk
function M.expected_bytes(spec, copies, rows, K, world)
  local s = spec_table(spec)
  local ft = nv.formats[s.format]
  local align = nv.quant.gather_align(spec, copies)
  local chunk = dist.shard_rows(rows, world, align).chunk
  local function code_bytes(n) return n * ft.elem_bits // 8 end
  local function scale_bytes(n) return ft.block > 0 and n // ft.block or 0 end
  local b = 0
  local fprop = copies ~= "dgrad" or transposable(spec)
  if fprop then b = b + (world - 1) * chunk * (code_bytes(K) + scale_bytes(K)) end
  if copies ~= "fprop" and not transposable(spec) then
    b = b + (world - 1) * K * (code_bytes(chunk) + scale_bytes(chunk))
  end
  return b
end

-- Run every case on this rank; device "cpu" or "cuda" (the shard and the GEMM operands there).
-- -> a list of lines "ok <name>" / "FAIL <name>: <what>".
function M.run(device)
  local rank, world = dist.rank(), dist.world_size()
  local lines = {}
  for i, c in ipairs(M.CASES) do
    local name, spec, copies, rows, K, variant = table.unpack(c)
    local ok, err = pcall(function()
      local W = M.weight(rows, K, variant, 100 + i)
      local sr = dist.shard_rows(rows, world, nv.quant.gather_align(spec, copies))[rank + 1]
      local shard = W:narrow(1, sr.row0 + 1, sr.rows):contiguous()
      if device == "cuda" then shard = shard:cuda() end
      dist.reset_bytes()
      local q, qt
      if copies == "both" then q, qt = nv.quant.all_gather_quantized(shard, spec, {rows = rows, copies = "both"})
      elseif copies == "dgrad" then qt = nv.quant.all_gather_quantized(shard, spec, {rows = rows, copies = "dgrad"})
      else q = nv.quant.all_gather_quantized(shard, spec, rows) end
      local sent = dist.bytes().all_gather
      local bad = {}
      local want = M.expected_bytes(spec, copies, rows, K, world)
      if sent ~= want then bad[#bad + 1] = string.format("all_gather bytes %d, expected %d", sent, want) end
      local fmt = spec_table(spec).format
      local X = nv.randn(32, K, {generator = nv.Generator(200 + i)})
      local DY = nv.randn(32, rows, {generator = nv.Generator(300 + i)})
      if q then
        local ref = quantize_whole(W, spec, 2)
        local e = M.diff(q:cpu(), ref)
        if e ~= "" then bad[#bad + 1] = "fprop copy: " .. e end
        -- fprop X W^T through the gathered copy and through the unsharded one, on the device of the
        -- shard (the unsharded one quantized there from the whole weight)
        local refd = device == "cuda" and quantize_whole(W:cuda(), spec, 2) or ref
        local xin = device == "cuda" and X:cuda() or X
        local qx = act_operand(xin, fmt)
        if nv.qmatmul(qx, q):cpu():bytes() ~= nv.qmatmul(qx, refd):cpu():bytes() then bad[#bad + 1] = "fprop GEMM" end
      end
      if qt then
        local reft = transposable(spec) and quantize_whole(W:transpose():contiguous(), spec, 2) or quantize_whole(W, spec, 1)
        local e = M.diff(qt:cpu(), reft)
        if e ~= "" then bad[#bad + 1] = "dgrad copy: " .. e end
        local refd = reft
        if device == "cuda" then
          refd = transposable(spec) and quantize_whole(W:transpose():contiguous():cuda(), spec, 2)
            or quantize_whole(W:cuda(), spec, 1)
        end
        local dyin = device == "cuda" and DY:cuda() or DY
        local qdy = act_operand(dyin, fmt)
        -- (cuBLASLt's fp8 GEMMs need the reduction dim a multiple of 16: the CPU ranks run that one)
        if not (device == "cuda" and nv.formats[fmt].scale == "fp32" and rows % 16 ~= 0) and
           nv.qmatmul(qdy, qt):cpu():bytes() ~= nv.qmatmul(qdy, refd):cpu():bytes() then
          bad[#bad + 1] = "dgrad GEMM"
        end
        if device == "cuda" and refd:swizzled_scales() then -- the native GEMMs' scales (sm_100)
          local sw = qt:swizzled_scales()
          if not sw or sw:bytes() ~= refd:swizzled_scales():bytes() then bad[#bad + 1] = "dgrad copy: swizzled scales" end
        end
      end
      if device == "cuda" and q then
        local refd = quantize_whole(W:cuda(), spec, 2)
        if refd:swizzled_scales() then
          local sw = q:swizzled_scales()
          if not sw or sw:bytes() ~= refd:swizzled_scales():bytes() then bad[#bad + 1] = "fprop copy: swizzled scales" end
        end
      end
      if #bad > 0 then error(table.concat(bad, "; "), 0) end
    end)
    lines[#lines + 1] = ok and ("ok " .. name) or ("FAIL " .. name .. ": " .. tostring(err))
  end
  return lines
end

-- Prefetching: gathers started with async = true for several weights at once, other work (a GEMM, a
-- blocking all-reduce) between, waited for in reverse order; a handle dropped without a wait. Each result
-- must equal the unsharded quantization. -> lines as M.run's.
function M.run_async(device)
  local rank, world = dist.rank(), dist.world_size()
  local lines = {}
  local ok, err = pcall(function()
    local specs = {{format = "nvfp4", block = "2d"}, "e4m3", "mxfp8_e4m3", "nvfp4"}
    local W, handles = {}, {}
    for i, spec in ipairs(specs) do
      W[i] = M.weight(96, 64, "outliers", 400 + i)
      local sr = dist.shard_rows(96, world, nv.quant.gather_align(spec, "both"))[rank + 1]
      local shard = W[i]:narrow(1, sr.row0 + 1, sr.rows):contiguous()
      if device == "cuda" then shard = shard:cuda() end
      handles[i] = nv.quant.all_gather_quantized(shard, spec, {rows = 96, copies = "both", async = true})
      if not handles[i]:pending() then error("a started gather is pending until waited for", 0) end
    end
    local dropped = nv.quant.all_gather_quantized(device == "cuda" and W[1]:narrow(1, 1, 0):cuda() or W[1]:narrow(1, 1, 0),
      "e4m3", {rows = 0, async = true}) -- 0 rows: every rank's shard is empty
    local x = nv.randn(64, 64, {generator = nv.Generator(9)})
    if device == "cuda" then x = x:cuda() end
    local y = x:matmul(x) -- work between the start and the wait
    local t = nv.full({4}, rank + 1)
    dist.all_reduce(t, "sum") -- a blocking collective while the gathers are in flight
    dropped = nil
    collectgarbage() -- a dropped handle completes its collectives (every rank drops it)
    for i = #specs, 1, -1 do
      local q, qt = handles[i]:wait()
      local s = spec_table(specs[i])
      local ref = quantize_whole(W[i], specs[i], 2)
      local reft = transposable(specs[i]) and quantize_whole(W[i]:transpose():contiguous(), specs[i], 2)
        or quantize_whole(W[i], specs[i], 1)
      local e = M.diff(q:cpu(), ref) .. M.diff(qt:cpu(), reft)
      lines[#lines + 1] = (e == "" and "ok async " or "FAIL async ") .. s.format .. (s.block or "") .. " " .. e
      if handles[i]:pending() then error("waited for, no longer pending", 0) end
    end
    -- dist's own nonblocking all-gather (a bf16 or f32 weight's prefetch), in place, beside the others
    local full = nv.zeros(world * 3, 5)
    full:narrow(1, 3 * rank + 1, 3):fill_(rank + 0.5)
    if device == "cuda" then full = full:cuda() end
    local ticket = dist.all_gather_start(full, full:narrow(1, 3 * rank + 1, 3))
    dist.all_gather_wait(ticket)
    local fc = full:cpu()
    for r = 0, world - 1 do
      if fc:narrow(1, 3 * r + 1, 3):eq(r + 0.5):sum() ~= 15 then error("dist.all_gather_start: rank " .. r .. "'s rows", 0) end
    end
    if pcall(dist.all_gather_wait, ticket) and world > 1 then error("a second all_gather_wait must raise", 0) end
    local again = pcall(handles[1].wait, handles[1])
    if again then error("a second wait must raise", 0) end
    if y:cpu():sum() ~= y:cpu():sum() or t:cpu():get(1) ~= world * (world + 1) // 2 then error("the work between", 0) end
  end)
  if not ok then lines[#lines + 1] = "FAIL async: " .. tostring(err) end
  return lines
end

return M
