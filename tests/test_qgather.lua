-- tests/test_qgather.lua: the quantized all-gather (nv.quant.all_gather_quantized, core/qgather.c;
-- core/NUMERICS.md "The gathered quantized weight") and the row split it shares with every sharded
-- feature (dist.shard_rows), on CPU ranks:
--   * dist.shard_rows: the rule on hand-worked splits, and its properties over a sweep (contiguous,
--     covering, aligned, no shard above chunk, chunk the smallest maximum an aligned split allows);
--     bad arguments named.
--   * a world of one: the gathered tensor is nv.quantize's, no bytes counted; bad input (a wrong spec,
--     a shard that is not this rank's rows, the 16-row rule of 16x16 tiles, the mx dgrad copy's 32-row
--     rule, an amax for a format without a per-tensor scale, an align that is not a multiple of the
--     copy's) is a clear error naming the argument, before any collective.
--   * 2 and 3 ranks under mpirun: every case of tests/qgather_cases.lua (nvfp4 16x16 and 1x16, fp8
--     e4m3 / e5m2, mxfp8, mxfp4, bf16; weights of 112, 113, 160, 32 and 2 rows, so chunks are padded
--     and some ranks hold no rows; random, outlier and all-zero weights) equals the unsharded
--     quantization byte for byte — codes, block scales, amax and scale bits — for the fprop copy and
--     the dgrad copy, the GEMMs through them equal the unsharded ones bit for bit, and the all-gather
--     bytes counted equal the ring formula. A control shows the comparison sees a wrong amax: a rank
--     quantizing its shard with its own amax gets other codes. The nvfp4 16x16 gather of a 96 x 64
--     weight (no padding on 2 or 3 ranks) sends 0.28125 of the bf16 gather's bytes (4.5 / 16 bits),
--     within the issue's 0.3. Mismatches across ranks (K, format) are the same error on every rank;
--     shards that are not dist.shard_rows' (cut on 1-row boundaries where 16x16 tiles need 16) are
--     refused on every rank. Prefetching: gathers started together (async), other work and a
--     blocking collective between, waited for in reverse order, one dropped unwaited, and
--     dist.all_gather_start / all_gather_wait, give the same bytes.
-- The emulated CUDA ranks (NCCL, no host synchronisation) are tests/test_cuda_qgather.lua's.
local T = require "nvlua.test"
local nv = require "nvlua"
local dist = require "nvlua.dist"
local lfs = require "lfs"

local NVLUA = arg and arg[-1] or "nvlua"
do
  local i = -1
  while arg and arg[i - 1] do i = i - 1 end
  NVLUA = arg and arg[i] or NVLUA
  if NVLUA:sub(1, 1) ~= "/" and NVLUA:find("/", 1, true) then NVLUA = lfs.currentdir() .. "/" .. NVLUA end
end

local MPIRUN = (function()
  local p = io.popen("command -v mpirun 2>/dev/null")
  local path = p and p:read("l")
  if p then p:close() end
  return path ~= "" and path or nil
end)()

-- Run script_text on n CPU ranks; -> output, exit code (skips without mpirun or MPI).
local function mpirun(n, script_text)
  if not MPIRUN then T.skip("mpirun not found") end
  if not dist.info().mpi then T.skip("nvlua built without MPI") end
  local dir = T.tmpdir()
  local script = dir .. "/script.lua"
  T.write_file(script, script_text)
  local p = assert(io.popen(string.format("env OMP_NUM_THREADS=1 timeout 120 %s --allow-run-as-root --oversubscribe "
    .. "--bind-to none -np %d %s %s 2>&1", MPIRUN, n, NVLUA, script)))
  local out = p:read("a")
  local _, _, code = p:close()
  T.rm_tree(dir)
  return out, code
end

-- ---- dist.shard_rows ------------------------------------------------------------------------------

local function split(t)
  local s = {}
  for i, e in ipairs(t) do s[i] = {e.row0, e.rows} end
  return s
end

T.case("dist.shard_rows: front-loaded chunks of align rows, padding after the last row", function()
  -- 112 rows in 16-row units on 3 ranks: 7 units, 3 per rank: 48, 48, 16 (chunk 48)
  T.eq(split(dist.shard_rows(112, 3, 16)), {{0, 48}, {48, 48}, {96, 16}})
  T.eq(dist.shard_rows(112, 3, 16).chunk, 48)
  T.eq(split(dist.shard_rows(160, 3, 16)), {{0, 64}, {64, 64}, {128, 32}})
  -- 5 units on 4 ranks: 2, 2, 1, 0 (the largest shard is 2 units whatever the split)
  T.eq(split(dist.shard_rows(80, 4, 16)), {{0, 32}, {32, 32}, {64, 16}, {80, 0}})
  -- the last shard need not be a whole unit: 113 rows, align 1, 3 ranks: 38, 38, 37
  T.eq(split(dist.shard_rows(113, 3)), {{0, 38}, {38, 38}, {76, 37}})
  T.eq(split(dist.shard_rows(100, 3, 32)), {{0, 64}, {64, 36}, {100, 0}})
  T.eq(split(dist.shard_rows(2, 3)), {{0, 1}, {1, 1}, {2, 0}})
  T.eq(split(dist.shard_rows(0, 2, 16)), {{0, 0}, {0, 0}})
  T.eq(split(dist.shard_rows(7, 1, 16)), {{0, 7}})
  T.eq(#dist.shard_rows(5), 1, "world defaults to dist.world_size()")
  -- the properties, over a sweep
  for world = 1, 9 do
    for _, align in ipairs({1, 2, 16, 32}) do
      for rows = 0, 200, 7 do
        local s = dist.shard_rows(rows, world, align)
        local units = (rows + align - 1) // align
        local want_chunk = (units + world - 1) // world * align
        T.eq(s.chunk, want_chunk, "chunk")
        local next0, biggest = 0, 0
        for r = 1, world do
          local e = s[r]
          T.eq(e.row0, next0, "contiguous")
          T.ok(e.rows >= 0 and e.rows <= s.chunk, "no shard above chunk")
          T.ok(e.rows % align == 0 or e.row0 + e.rows == rows, "aligned except the one ending at rows")
          next0 = e.row0 + e.rows
          biggest = math.max(biggest, e.rows)
        end
        T.eq(next0, rows, "covers the rows")
        -- front-loaded: the first rank holds a whole chunk (or every row); no split into align-row
        -- units has a largest shard below ceil(units / world) units, so chunk is the least maximum
        T.eq(biggest, math.min(rows, s.chunk), "the largest shard")
        T.eq(s[1].rows, math.min(rows, s.chunk), "front-loaded")
      end
    end
  end
  T.raises(function() dist.shard_rows(-1, 2) end, "rows must be >= 0")
  T.raises(function() dist.shard_rows(10, 0) end, "world must be a rank count")
  T.raises(function() dist.shard_rows(10, 2, 0) end, "align must be >= 1")
  T.raises(function() dist.shard_rows(1.5, 2) end, "number has no integer representation")
end)

-- ---- a world of one ---------------------------------------------------------------------------------

T.case("a world of one: the gathered weight is the quantization of the shard, no bytes counted", function()
  dist.init()
  local C = dofile("tests/qgather_cases.lua")
  local W = C.weight(64, 64, "outliers", 3)
  dist.reset_bytes()
  for _, spec in ipairs({{format = "nvfp4", block = "2d"}, "e4m3", "mxfp8_e4m3", "bf16"}) do
    local fmt = type(spec) == "string" and spec or spec.format
    local q, qt = nv.quant.all_gather_quantized(W, spec, {rows = 64, copies = "both"})
    T.eq(C.diff(q, nv.quantize(W, fmt, {block = type(spec) == "table" and spec.block or nil})), "", fmt .. " fprop")
    T.ok(qt ~= nil, fmt .. ": the dgrad copy")
  end
  T.eq(dist.bytes(), {all_gather = 0, reduce_scatter = 0, all_reduce = 0, broadcast = 0}, "nothing sent")
  -- the recipe's dgrad copy of a gathered weight (no full-precision w on the rank): its transpose
  local recipe = require "nvlua.recipe"
  for _, spec in ipairs({{format = "nvfp4", block = "2d"}, {format = "e4m3"}}) do
    local q = nv.quant.all_gather_quantized(W, spec, 64)
    T.eq(C.diff(recipe._transposed(q, nil, spec), nv.quantize(W:transpose():contiguous(), spec.format,
      {block = spec.block})), "", spec.format .. ": recipe's dgrad copy from the gathered weight")
  end
  T.eq(nv.quant.gather_align({format = "nvfp4", block = "2d"}), 16)
  T.eq(nv.quant.gather_align({format = "nvfp4", block = "2d"}, "both"), 16, "the transpose serves dgrad")
  T.eq(nv.quant.gather_align("nvfp4", "both"), 16, "1x16 blocks down the rows")
  T.eq(nv.quant.gather_align("mxfp4", "fprop"), 1)
  T.eq(nv.quant.gather_align("mxfp8_e4m3", "both"), 32)
  T.eq(nv.quant.gather_align("e4m3", "both"), 1)
end)

T.case("bad input: a clear error naming the argument, before any collective", function()
  dist.init()
  local W = nv.randn(64, 48, {generator = nv.Generator(1)})
  local g = nv.quant.all_gather_quantized
  T.raises(function() g(W, "nvfp5", 64) end, "all_gather_quantized: unknown format 'nvfp5'")
  T.raises(function() g(W, 7, 64) end, "spec must be a format name or a spec table")
  T.raises(function() g(W, {block = "2d"}, 64) end, "spec has no format")
  T.raises(function() g(W, {format = "e4m3", block = "2d"}, 64) end, "2d (16x16) blocks are an nvfp4 layout, not e4m3")
  T.raises(function() g(W, {format = "nvfp4", rht = true}, 64) end, "without the RHT")
  T.raises(function() g(W, {format = "nvfp4", sr = true}, 64) end, "not stochastic rounding")
  T.raises(function() g(W, "nvfp4") end, "give the weight's row count")
  T.raises(function() g(W, "nvfp4", {rows = -1}) end, "rows (the whole weight's row count) must be a non-negative integer")
  T.raises(function() g(W, "nvfp4", {rows = 64, copies = "wgrad"}) end, "copies must be \"fprop\", \"dgrad\" or \"both\"")
  T.raises(function() g(W, "nvfp4", {rows = 64, axis = 1}) end, "all_gather_quantized: unknown option 'axis'")
  T.raises(function() g(W:narrow(1, 1, 32), "nvfp4", 64) end,
    "rank 0 of 1 holds rows [0, 64) of the 64-row weight (dist.shard_rows(64, 1, 1)), so its shard has 64 rows; got")
  T.raises(function() g(nv.randn(4, 4, 4), "e4m3", 4) end, "expects this rank's rows of a 2-D f32 or bf16 weight")
  T.raises(function() g(W:narrow(1, 1, 56), {format = "nvfp4", block = "2d"}, 56) end,
    "16x16 blocks need both dims of the weight to be multiples of 16, got 56 x 48")
  T.raises(function() g(W, {format = "nvfp4", block = "2d"}, {rows = 64, align = 8}) end,
    "align must be a positive multiple of 16")
  T.raises(function() g(nv.randn(48, 64), "mxfp8_e4m3", {rows = 48, copies = "both"}) end,
    "mxfp8_e4m3 blocks 32 elements along the weight's rows, whose length 48 is not a multiple of 32")
  T.raises(function() g(nv.randn(64, 64), "mxfp8_e4m3", {rows = 64, amax = 3}) end, "amax applies to formats with a per-tensor scale")
  T.raises(function() g(W, "e4m3", {rows = 64, amax = -1}) end, "amax must be a non-negative number")
  T.raises(function() nv.quant.gather_align("mxfp4", "all") end, "gather_align: copies must be")
  -- a given amax (delayed scaling's) is used as given
  local q = g(W, "e4m3", {rows = 64, amax = 100})
  T.eq(q.amax, 100)
  T.eq(q:data():bytes(), nv.quantize(W, "e4m3", {amax = 100}):data():bytes(), "the given amax's codes")
end)

-- ---- MPI ranks ----------------------------------------------------------------------------------------

local WORKER = [[
local nv = require "nvlua"
local dist = require "nvlua.dist"
local r, world = dist.init()
local C = dofile("tests/qgather_cases.lua")
local function say(s) print(string.format("rank %d: %s", r, s)) end
for _, l in ipairs(C.run("cpu")) do say(l) end
for _, l in ipairs(C.run_async("cpu")) do say(l) end

-- control: the outlier weight's shards quantized each with its own amax are not the whole tensor's
-- rows on a rank whose shard does not hold the largest value
do
  local W = C.weight(112, 64, "outliers", 2)
  local sr = dist.shard_rows(112, world, 16)[r + 1]
  if sr.rows > 0 then
    local shard = W:narrow(1, sr.row0 + 1, sr.rows):contiguous()
    local own = nv.quantize(shard, "nvfp4", {block = "2d"})
    local whole = nv.quantize(W, "nvfp4", {block = "2d"}):data():narrow(1, sr.row0 + 1, sr.rows):contiguous()
    local holds_max = shard:abs():max() == W:abs():max()
    say(string.format("control holds_max=%s same=%s", tostring(holds_max), tostring(own:data():bytes() == whole:bytes())))
  end
end

-- bytes: nvfp4 16x16 against bf16, a 96 x 64 weight (no padding on 2 or 3 ranks)
do
  local W = C.weight(96, 64, "random", 5)
  local function sent(spec)
    local sr = dist.shard_rows(96, world, nv.quant.gather_align(spec))[r + 1]
    dist.reset_bytes()
    nv.quant.all_gather_quantized(W:narrow(1, sr.row0 + 1, sr.rows):contiguous(), spec, 96):free()
    return dist.bytes().all_gather
  end
  local b4, b16 = sent({format = "nvfp4", block = "2d"}), sent("bf16")
  say(string.format("bytes nvfp4 %d bf16 %d ratio %.6f", b4, b16, b4 / b16))
end

-- mismatches across ranks: the same error on every rank, and the job goes on
local function err(name, fn)
  local ok, e = pcall(fn)
  say(string.format("error %s: %s", name, ok and "none" or tostring(e)))
end
local W = C.weight(48, 64, "random", 9)
local sr = dist.shard_rows(48, world, 16)[r + 1]
local shard = W:narrow(1, sr.row0 + 1, sr.rows):contiguous()
err("K", function() nv.quant.all_gather_quantized(r == 0 and shard or shard:narrow(2, 1, 32):contiguous(), "e4m3",
  {rows = 48, align = 16}) end)
err("format", function() nv.quant.all_gather_quantized(shard, r == 0 and "e4m3" or "e5m2", {rows = 48, align = 16}) end)
err("rows", function() nv.quant.all_gather_quantized(W, "e4m3", 48) end)
-- shards cut on 1-row boundaries where 16x16 tiles need 16: no rank's shard is the one it must hold
local W112 = C.weight(112, 64, "random", 9)
local sr1 = dist.shard_rows(112, world, 1)[r + 1]
err("16-row rule", function() nv.quant.all_gather_quantized(W112:narrow(1, sr1.row0 + 1, sr1.rows), {format = "nvfp4",
  block = "2d"}, 112) end)
local q = nv.quant.all_gather_quantized(shard, {format = "nvfp4", block = "2d"}, 48)
say("after the errors: " .. (q:data():bytes() == nv.quantize(W, "nvfp4", {block = "2d"}):data():bytes() and "same" or "differs"))
]]

local function run_ranks(n)
  local out, code = mpirun(n, WORKER)
  T.eq(code, 0, "mpirun -np " .. n .. " exit status; output:\n" .. out)
  local C = dofile("tests/qgather_cases.lua")
  for rank = 0, n - 1 do
    for _, c in ipairs(C.CASES) do
      T.ok(out:find(string.format("rank %d: ok %s\n", rank, c[1]), 1, true) ~= nil,
        string.format("rank %d, case %s; output:\n%s", rank, c[1], out))
    end
    local asyncs = select(2, out:gsub(string.format("rank %d: ok async ", rank), ""))
    T.eq(asyncs, 4, string.format("rank %d: the prefetched gathers; output:\n%s", rank, out))
    local holds, same = out:match(string.format("rank %d: control holds_max=(%%a+) same=(%%a+)", rank))
    if holds then
      T.eq(same, holds, string.format("rank %d: its own amax gives the whole tensor's codes only where it is the global one", rank))
    end
    local b4, b16, ratio = out:match(string.format("rank %d: bytes nvfp4 (%%d+) bf16 (%%d+) ratio ([%%d.]+)", rank))
    T.ok(b4 ~= nil, "bytes line; output:\n" .. out)
    -- (N - 1) chunks of 96 / N rows: nvfp4 32 code + 4 scale bytes per row, bf16 128
    T.eq(tonumber(b4), (n - 1) * (96 // n) * 36, "nvfp4 gather bytes")
    T.eq(tonumber(b16), (n - 1) * (96 // n) * 128, "bf16 gather bytes")
    T.ok(tonumber(ratio) <= 0.3, "nvfp4 gather bytes <= 0.3 x bf16's")
    T.ok(out:find(string.format("rank %d: error K: [^\n]*the ranks disagree on K %%(the weight's columns%%) %%(from 32 to 64%%)",
      rank)) ~= nil, "K mismatch; output:\n" .. out)
    T.ok(out:find(string.format("rank %d: error format: [^\n]*the ranks disagree on the format", rank)) ~= nil,
      "format mismatch; output:\n" .. out)
    T.ok(out:find(string.format("rank %d: error rows: [^\n]*so its shard has", rank)) ~= nil, "shard rows; output:\n" .. out)
    local s16 = require("nvlua.dist").shard_rows(112, n, 16)[rank + 1]
    T.ok(out:find(string.format("rank %d: error 16%%-row rule: [^\n]*holds rows %%[%d, %d%%) of the 112%%-row weight " ..
      "%%(dist.shard_rows%%(112, %d, 16%%)%%), so its shard has %d rows; got", rank, s16.row0, s16.row0 + s16.rows, n,
      s16.rows)) ~= nil, "16-row rule; output:\n" .. out)
    T.ok(out:find(string.format("rank %d: after the errors: same", rank), 1, true) ~= nil, "the job goes on; output:\n" .. out)
  end
  local controls = select(2, out:gsub("control holds_max=false same=false", ""))
  T.ok(controls >= 1, "the control ran on a rank without the largest value; output:\n" .. out)
end

T.case("2 ranks: the gathered weight and its dgrad copy are the unsharded quantization, byte for byte", function()
  run_ranks(2)
end)

T.case("3 ranks (odd world, uneven and empty shards): byte for byte, GEMMs bit for bit, bytes counted", function()
  run_ranks(3)
end)
