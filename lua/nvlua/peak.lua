-- nvlua.peak: the peak rate a run's MFU is against (FLOP/s per device: one GPU, or the CPU of one
-- process), and a line saying what it is, so that an MFU column means the same in every run.
--   GPUs: the dense (no 2:4 sparsity) peaks of NVIDIA's datasheets, per input format, of the parts
--     in peak.GPUS, found by the device's name and compute capability; a device with fewer SMs than
--     its part (a MIG slice) gets the peak scaled to its SMs. Another GPU: its cuBLASLt bf16 GEMM rate
--     measured at start-up, and the line says so.
--   The CPU: the rate of the units its GEMMs run on (oneDNN's bf16 GEMM where the CPU has bf16 units,
--     else OpenBLAS sgemm), measured once per machine (calibrated: the best of many repetitions) and
--     cached in <cache>/peak.json (<cache>: data.default_cache, $NVLUA_CACHE or ~/.cache/nvlua) under
--     the CPU model, its CPU count and the BLAS and oneDNN builds; later runs read it and never
--     measure again, so a run started on a loaded machine is held to the same figure as any other.
--     NVLUA_RECALIBRATE=1 (or `nvlua -e 'require"nvlua.peak".calibrate()'`) measures again; a
--     damaged cache file is measured again, not an error.
-- Which format's peak (train's key mfu_peak): bf16, the default — MFU as torchtitan and Megatron
-- report it, against the dense bf16 peak whatever the recipe, so runs and machines compare; recipe —
-- the peak of the units most of the recipe's GEMMs run on (nvfp4 on Blackwell: its fp4 peak; on
-- Hopper, which emulates nvfp4 GEMMs on bf16: the bf16 peak); fp8 | fp4 | tf32 | fp32 — that column of
-- the datasheet; or a number: FLOP/s per device, used as given.
-- Not here: the FLOPs a step does (train.flops_per_token).
local nv = require "nvlua"
local core = require "nvlua.core"
local cjson = require "cjson"
local util = require "nvlua.util"
local data = require "nvlua.data"
local formats = require "nvlua.formats"

local user_error = util.user_error

local M = {}

-- ---- the datasheets ---------------------------------------------------------------------------

-- Dense peaks in FLOP/s per GPU by the class of a GEMM's inputs: bf16 (= fp16), fp8 (e4m3/e5m2, mxfp8),
-- fp4 (e2m1: nvfp4, mxfp4), tf32 (tensor cores), fp32 (CUDA cores: nvlua's f32 GEMMs are
-- CUBLAS_COMPUTE_32F, no TF32). NVIDIA prints the tensor-core figures with sparsity (marked * below); the
-- dense peak is half of it. match: fragments of the lower-cased CUDA device name, tried in this
-- table's order (GH200 before H200 before H100, GB200 before B200); cc: the compute capability the part
-- has; sms: its SM count where NVIDIA documents it (a device with fewer is scaled; nil: never scaled).
M.GPUS = {
  -- NVIDIA GH200 Grace Hopper Superchip datasheet: FP32 67, TF32 989*, BF16 1,979*, FP8 3,958* TFLOPS: the
  -- H100 SXM's figures (the dense ones as the H100 whitepaper gives them, below)
  {name = "GH200", match = {"gh200"}, cc = "9.0", sms = 132,
    fp32 = 66.9e12, tf32 = 494.7e12, bf16 = 989.4e12, fp8 = 1978.9e12},
  -- NVIDIA H200 datasheet, H200 NVL column: FP32 60, TF32 835*, BF16 1,671*, FP8 3,341* TFLOPS
  {name = "H200 NVL", match = {"h200 nvl"}, cc = "9.0", sms = 132,
    fp32 = 60e12, tf32 = 417.5e12, bf16 = 835.5e12, fp8 = 1670.5e12},
  -- NVIDIA H200 datasheet, H200 SXM column: FP32 67, TF32 989*, BF16 1,979*, FP8 3,958* TFLOPS (the H100
  -- SXM's silicon and clocks: the whitepaper's dense figures)
  {name = "H200 SXM", match = {"h200"}, cc = "9.0", sms = 132,
    fp32 = 66.9e12, tf32 = 494.7e12, bf16 = 989.4e12, fp8 = 1978.9e12},
  -- NVIDIA H100 datasheet, H100 NVL column: FP32 60, TF32 835*, BF16 1,671*, FP8 3,341* TFLOPS
  {name = "H100 NVL", match = {"h100 nvl"}, cc = "9.0", sms = 132,
    fp32 = 60e12, tf32 = 417.5e12, bf16 = 835.5e12, fp8 = 1670.5e12},
  -- NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 PCIe: FP32 51.2, TF32 378 / 756*, BF16 756 /
  -- 1,513*, FP8 1,513 / 3,026* TFLOPS (dense / sparse); 114 SMs
  {name = "H100 PCIe", match = {"h100 pcie"}, cc = "9.0", sms = 114,
    fp32 = 51.2e12, tf32 = 378e12, bf16 = 756e12, fp8 = 1513e12},
  -- the same whitepaper, H100 SXM5: FP32 66.9, TF32 494.7 / 989.4*, BF16 989.4 / 1,978.9*, FP8 1,978.9 /
  -- 3,957.8* TFLOPS; 132 SMs (the datasheet rounds: 67, 989*, 1,979*, 3,958*). CUDA calls it "NVIDIA H100
  -- 80GB HBM3"
  {name = "H100 SXM", match = {"h100"}, cc = "9.0", sms = 132,
    fp32 = 66.9e12, tf32 = 494.7e12, bf16 = 989.4e12, fp8 = 1978.9e12},
  -- NVIDIA GB200 NVL72 page, the rack of 72 GPUs: FP4 1,440*, FP8/FP6 720*, FP16/BF16 360*, TF32 180* PFLOPS,
  -- FP32 5,760 TFLOPS; per GPU dense: /72/2. SMs: as B200 (148, what CUDA reports for B200)
  {name = "GB200", match = {"gb200"}, cc = "10.0", sms = 148,
    fp32 = 80e12, tf32 = 1.25e15, bf16 = 2.5e15, fp8 = 5e15, fp4 = 10e15},
  -- NVIDIA HGX page, HGX B200 column (8 GPUs): FP4 144* | 72 PFLOPS (sparse | dense), FP8/FP6 72*, FP16/BF16
  -- 36*, TF32 18* PFLOPS, FP32 600 TFLOPS; per GPU dense: /8 (/2 for the sparse ones)
  {name = "B200", match = {"b200"}, cc = "10.0", sms = 148,
    fp32 = 75e12, tf32 = 1.125e15, bf16 = 2.25e15, fp8 = 4.5e15, fp4 = 9e15},
  -- NVIDIA GB300 NVL72 page (72 GPUs): FP4 1,440* | 1,080 PFLOPS, FP8/FP6 720*, FP16/BF16 360*, TF32 180*
  -- PFLOPS. Uncertain: FP32 (80 TFLOPS per GPU as in GB200; the page's rack figure was not found) and
  -- the SM count (not documented: never scaled)
  {name = "GB300", match = {"gb300"}, cc = "10.3",
    fp32 = 80e12, tf32 = 1.25e15, bf16 = 2.5e15, fp8 = 5e15, fp4 = 15e15},
  -- NVIDIA HGX page, HGX B300 column (8 GPUs): FP4 144* | 108 PFLOPS, FP8/FP6 72*, FP16/BF16 36*, TF32 18*
  -- PFLOPS, FP32 600 TFLOPS. Uncertain: dense FP4 (13.5 PFLOPS from 108 / 8; secondary sources quote 14
  -- and 15) and the SM count (not documented: never scaled). CUDA calls it "NVIDIA B300 SXM6 AC"
  {name = "B300", match = {"b300"}, cc = "10.3",
    fp32 = 75e12, tf32 = 1.125e15, bf16 = 2.25e15, fp8 = 4.5e15, fp4 = 13.5e15},
}

-- the classes of the table, in the order messages list them
M.CLASSES = {"bf16", "fp8", "fp4", "tf32", "fp32"}
local IS_CLASS = {}
for _, k in ipairs(M.CLASSES) do IS_CLASS[k] = true end

--- peak.gpu_part(props) -> the peak.GPUS row of a device, or nil when nvlua has no datasheet for it.
-- props: one of nv.cuda.devices() ({name, capability = "9.0", multiprocessors, ...}).
function M.gpu_part(props)
  local name = tostring(props.name or ""):lower()
  for _, g in ipairs(M.GPUS) do
    if g.cc == props.capability then
      for _, m in ipairs(g.match) do
        if name:find(m, 1, true) then return g end
      end
    end
  end
  return nil
end

--- peak.class_of(format) -> the datasheet class ("bf16", "fp8", "fp4", "fp32") of a format's GEMM inputs
function M.class_of(fmt)
  if fmt == "f32" then return "fp32" end
  if fmt == "bf16" then return "bf16" end
  local e = formats.get(fmt, "peak.class_of").elem
  return e == "e2m1" and "fp4" or "fp8"
end

--- peak.rate(flops) -> "989.4 TFLOP/s", "428 GFLOP/s"
function M.rate(x)
  if x >= 1e12 then return string.format("%.5g TFLOP/s", x / 1e12) end
  return string.format("%.4g GFLOP/s", x / 1e9)
end

-- ---- mfu_peak ---------------------------------------------------------------------------------

-- mfu_peak's number: FLOP/s per device written in decimal (989e12, 4.28e11), else nil
local function given_number(v)
  if type(v) ~= "string" or not v:match("^%d*%.?%d*[eE]?[-+]?%d*$") then return nil end
  local n = tonumber(v)
  return n and n == n and n < math.huge and n or nil
end

--- peak.check_mfu_peak(v) -> nil when v is a valid mfu_peak, else what is wrong (the config key's check)
function M.check_mfu_peak(v)
  if v == "recipe" or IS_CLASS[v] then return nil end
  local n = given_number(v)
  if not n then
    return string.format("must be bf16, recipe, %s, or a peak in FLOP/s (such as 989e12), got '%s'",
      table.concat(M.CLASSES, ", ", 2), tostring(v))
  end
  -- a peak under 1 MFLOP/s is a slip of units (989 meant as TFLOP/s), not a device
  if n < 1e6 then return string.format("a peak is in FLOP/s per device (989e12 for 989 TFLOP/s), got %s", v) end
  return nil
end

-- The pair of formats most of the recipe's GEMMs take (its plan: every linear of the model x fprop,
-- dgrad, wgrad; a tie goes to the first pair in sorted order) -> format a, format b, count, total
local OPERANDS = {fprop = {"x", "w"}, dgrad = {"dy", "w"}, wgrad = {"dy", "x"}}
function M.recipe_pair(rec, model)
  local counts, total = {}, 0
  for _, row in ipairs(rec:plan(model, {quiet = true})) do
    for role, ops in pairs(OPERANDS) do
      local a, b = row[role][ops[1]], row[role][ops[2]]
      local key = a.format .. " " .. b.format
      counts[key] = (counts[key] or 0) + 1
      total = total + 1
    end
  end
  local best
  for k, n in pairs(counts) do
    if not best or n > counts[best] or (n == counts[best] and k < best) then best = k end
  end
  local fa, fb = best:match("^(%S+) (%S+)$")
  return fa, fb, counts[best], total
end

-- ---- measuring --------------------------------------------------------------------------------

-- The best rate (FLOP/s) of reps timed GEMMs of n^3 after one untimed warm-up; gemm() runs one
-- (inside its own scope, so each product is freed before the next reuses its buffer); sync() waits
-- for the device where there is one. Second result: the CPU time the process used during the best
-- GEMM over its wall time (os.clock counts every thread): about the number of GEMM threads on cores
-- of their own, less when another process shared them.
local function best_rate(n, reps, gemm, sync)
  local best, wall, cpu = math.huge, 0, 0
  for i = 0, reps do
    nv.scope(function()
      if sync then sync() end
      local c0, t0 = os.clock(), nv.clock()
      gemm()
      if sync then sync() end
      local dt, dc = nv.clock() - t0, os.clock() - c0
      if i > 0 then
        best, wall, cpu = math.min(best, dt), wall + dt, cpu + dc
      end
    end)
  end
  -- the cores the threads had: the process's CPU time over the timed reps' wall time, all reps together
  -- (one rep of a few ms is within a scheduler tick of other threads' lazily accounted run time: a
  -- single rep has read 2.36 cores for 2 threads)
  return 2 * n ^ 3 / best, cpu / wall
end

--- peak.cpu_threads() -> the threads the CPU GEMMs run on (the BLAS line's "N threads"; else 1)
function M.cpu_threads()
  return tonumber((nv.info().blas or ""):match("(%d+) threads")) or 1
end

-- A CPU rate measured while other processes held part of the cores: the GEMM threads got less than
-- LOADED_SHARE of their cores (an idle machine measures 0.95-1.0 here; two jobs on the same cores 0.5)
local LOADED_SHARE = 0.8

-- the operands: n x n, normal, seeded
local function operands(n)
  return nv.randn(n, n, {generator = nv.Generator(7)}), nv.randn(n, n, {generator = nv.Generator(8)})
end

--- peak.sgemm_rate([reps = 10]) -> this machine's fp32 GEMM rate (FLOP/s, OpenBLAS): best of reps 1024^3,
-- and the cores the GEMM threads had (best_rate's second result)
function M.sgemm_rate(reps)
  return nv.scope(function()
    local a, b = operands(1024)
    return best_rate(1024, reps or 10, function() a:matmul(b) end)
  end)
end

--- peak.cpu_bf16_ready() -> true when the CPU's bf16 GEMM units run the low-precision GEMMs (oneDNN)
function M.cpu_bf16_ready()
  local _, ready = core.gemm_bf16()
  return ready and true or false
end

--- peak.cpu_bf16_rate([reps = 10]) -> the CPU's bf16 GEMM rate (FLOP/s, oneDNN): best of reps bf16
-- qmatmuls of 1024^3, and the cores the threads had; nil where the bf16 units cannot run (the GEMMs then
-- run on sgemm)
function M.cpu_bf16_rate(reps)
  if not M.cpu_bf16_ready() then return nil end
  return nv.scope(function()
    local qa, qb = nv.scope(function()
      local a, b = operands(1024)
      return nv.quantize(a, "bf16"), nv.quantize(b, "bf16")
    end)
    return best_rate(1024, reps or 10, function() nv.qmatmul(qa, qb) end)
  end)
end

--- peak.gpu_bf16_rate([reps = 5]) -> cuda:0's dense bf16 GEMM rate (FLOP/s, cuBLASLt): best of reps
-- GEMMs of 4096^3, timed with a device synchronisation
function M.gpu_bf16_rate(reps)
  local n = 4096
  return nv.scope(function()
    local qa, qb = nv.scope(function() -- the f32 operands, host and device, die once quantized
      local a, b = operands(n)
      return nv.quantize(a:cuda(), "bf16"), nv.quantize(b:cuda(), "bf16")
    end)
    return best_rate(n, reps or 5, function() nv.qmatmul(qa, qb, {out = "bf16"}) end, nv.cuda.synchronize)
  end)
end

-- ---- the CPU's calibrated figure ----------------------------------------------------------------

local CACHE_FORMAT, CACHE_VERSION = "nvlua-peak", 1

--- peak.cache_path() -> <cache>/peak.json (data.default_cache: $NVLUA_CACHE or ~/.cache/nvlua)
function M.cache_path() return data.default_cache() .. "/peak.json" end

--- peak.machine_key() -> what a calibrated figure is valid for: the CPU model, the CPUs this system
-- has, and the BLAS and oneDNN builds (the BLAS line names the threads it runs)
function M.machine_key()
  local model, ncpu = nil, 0
  local f = io.open("/proc/cpuinfo", "r")
  if f then
    for line in f:lines() do
      model = model or line:match("^model name%s*:%s*(.-)%s*$") or line:match("^Model%s*:%s*(.-)%s*$")
      if line:match("^processor%s*:") then ncpu = ncpu + 1 end
    end
    f:close()
  end
  local info = nv.info()
  return string.format("%s; %d CPUs; %s; %s", model or "unknown CPU", ncpu, info.blas, info.dnnl)
end

local function positive(x) return type(x) == "number" and x > 0 and x < math.huge end

-- The cache file's table, or a new one (a missing, unreadable or damaged file: measured again)
local function read_cache(path)
  local fresh = {format = CACHE_FORMAT, version = CACHE_VERSION, machines = {}}
  local f = io.open(path, "r")
  if not f then return fresh end
  local text = f:read("a")
  f:close()
  local ok, t = pcall(cjson.decode, text or "")
  if not ok or type(t) ~= "table" or t.format ~= CACHE_FORMAT or t.version ~= CACHE_VERSION or
      type(t.machines) ~= "table" then
    return fresh
  end
  return t
end

-- a cached entry {flops, date} when sound, else nil
local function cached(t, key, kind)
  local m = t.machines[key]
  local e = type(m) == "table" and m[kind]
  if type(e) == "table" and positive(e.flops) and type(e.date) == "string" then return e end
  return nil
end

-- Writes t to path atomically -> nil, or why it could not (the figure then holds for this run only)
local function write_cache(path, t)
  local dir = path:match("^(.*)/[^/]*$")
  if dir then
    local ok, err = pcall(data.mkdir_p, dir)
    if not ok then return tostring(err) end
  end
  local ok, err = util.atomic_write(path, cjson.encode(t) .. "\n")
  if not ok then return err end
  return nil
end

local MEASURE = {bf16 = function() return M.cpu_bf16_rate() end, f32 = function() return M.sgemm_rate() end}

--- peak.cpu_rate(kind [, {path =, key =, measure = fn(kind) -> flops[, cores], threads =, recalibrate =,
-- may_measure = true, keep = true}])
-- -> flops, note | nil: the CPU's calibrated GEMM rate, kind "bf16" (oneDNN) or "f32" (sgemm), read from
-- the cache file (default peak.cache_path()) under key (default peak.machine_key()), else measured
-- with measure (default: sgemm_rate / cpu_bf16_rate, 10 repetitions) and written there. note says
-- where the figure comes from ("calibrated 2026-11-28, cached in ..."). recalibrate (default
-- NVLUA_RECALIBRATE=1) measures even when cached; may_measure = false returns nil instead of measuring;
-- keep = false measures without caching (a figure taken while other processes of the job share the
-- machine: an MPI rank waiting in a collective keeps a core busy). Nor is a figure cached when the
-- GEMM's threads (threads, default peak.cpu_threads()) had under 0.8 of their cores (measure's second
-- result: CPU time over wall time): a machine loaded by other work, whose rate would stand forever.
function M.cpu_rate(kind, o)
  o = o or {}
  local path, key = o.path or M.cache_path(), o.key or M.machine_key()
  local recal = o.recalibrate
  if recal == nil then
    local env = os.getenv("NVLUA_RECALIBRATE")
    if env and env ~= "" and env ~= "0" and env ~= "1" then
      user_error("NVLUA_RECALIBRATE must be 0 or 1, got '" .. env .. "'", 0)
    end
    recal = env == "1"
  end
  local t = read_cache(path)
  local e = not recal and cached(t, key, kind)
  if e then return e.flops, string.format("calibrated %s, cached in %s", e.date, path) end
  if o.may_measure == false then return nil end
  local flops, cores = (o.measure or MEASURE[kind])(kind)
  if not positive(flops) then
    error(string.format("peak: measuring the CPU's %s GEMM rate gave %s", kind, tostring(flops)), 0)
  end
  local threads = o.threads or M.cpu_threads()
  if cores and cores < LOADED_SHARE * threads then -- other processes held the cores: not this machine's peak
    return flops, string.format("measured now under load, not cached: the GEMM's %d threads had %.2f cores; " ..
      "calibrate on a quiet machine with nvlua -e 'require\"nvlua.peak\".calibrate()'", threads, cores)
  end
  if o.keep == false then
    return flops, "measured now, not cached: other ranks of this job share the machine; calibrate it alone with " ..
      "nvlua -e 'require\"nvlua.peak\".calibrate()'"
  end
  local m = type(t.machines[key]) == "table" and t.machines[key] or {}
  t.machines[key] = m
  m[kind] = {flops = flops, date = os.date("%Y-%m-%d")}
  local err = write_cache(path, t)
  if err then return flops, string.format("calibrated now; not cached: %s: %s", path, err) end
  return flops, string.format("calibrated now, cached in %s", path)
end

--- peak.calibrate([{path =, key =}]) -> {f32 = flops, bf16 = flops or nil}: measures this machine's
-- CPU GEMM rates again and writes them to the cache (a run on a machine that was loaded when it was
-- first calibrated, or after a BLAS change the key does not see); prints them.
function M.calibrate(o)
  o = o or {}
  local r = {}
  for _, kind in ipairs({"f32", "bf16"}) do
    if kind == "f32" or M.cpu_bf16_ready() then
      local flops, note = M.cpu_rate(kind, {path = o.path, key = o.key, recalibrate = true})
      r[kind] = flops
      print(string.format("%s GEMM rate of this CPU: %s (%s)", kind, M.rate(flops), note))
    end
  end
  return r
end

-- ---- a run's peak -----------------------------------------------------------------------------

-- The datasheet peak of class on a GPU (props, row) -> flops, what
local function datasheet(props, row, class, why)
  local v = row[class]
  if not v then
    local have = {}
    for _, k in ipairs(M.CLASSES) do if row[k] then have[#have + 1] = k end end
    user_error(string.format("mfu_peak=%s: the %s has no %s units (its datasheet gives %s; or give a number)", class,
      row.name, class, table.concat(have, ", ")), 0)
  end
  local what = string.format("%s dense %s %s (datasheet", row.name, class, M.rate(v))
  local sms = props.multiprocessors
  if row.sms and math.type(sms) == "integer" and sms > 0 and sms < row.sms then
    v = v * sms / row.sms
    what = string.format("%s, scaled to this device's %d of %d SMs: %s", what, sms, row.sms, M.rate(v))
  end
  if why then what = what .. "; " .. why end
  if props.emulated then what = what .. "; CUDA emulated on the CPU: not that GPU's speed" end
  return v, what .. ")"
end

-- The class a recipe's GEMMs run in on the GPU: its most common format pair's, where the pair runs
-- natively; bf16 where it is emulated (exactly, on bf16 GEMMs). -> class, why (nil, or a note)
local function recipe_class_gpu(fa, fb, gemm_path)
  local path = gemm_path(fa, fb)
  if path == "native" then return M.class_of(fa), nil end
  return "bf16", string.format("the recipe's %s x %s GEMMs run emulated on bf16 here", fa, fb)
end

--- peak.for_run(c, {given =, recipe =, model =, device = props, gemm_path = fn(fa, fb), may_measure = true,
-- alone = true, cpu = {bf16_ready =, ...peak.cpu_rate's options}}) -> flops, what; nil when may_measure is
-- false and only measuring would tell. c: the run's config (device, mfu_peak). given: a peak the caller fixed (parts.peak).
-- alone = false: other processes of the job run on this machine; the CPU's figure, if it must be
-- measured, is not cached (peak.cpu_rate's keep).
-- device: cuda:0's properties (default nv.cuda.devices()[1]); gemm_path: the path a format pair takes
-- there (default nv.cuda.gemm_path). what: where the peak comes from, for the log line ("MFU is
-- against <what>").
function M.for_run(c, o)
  o = o or {}
  if o.given then return o.given, "the given peak (parts.peak), " .. M.rate(o.given) end
  local want = c.mfu_peak or "bf16"
  local n = given_number(want)
  if n then return n, string.format("mfu_peak=%s, %s", want, M.rate(n)) end
  local fa, fb
  if want == "recipe" then fa, fb = M.recipe_pair(o.recipe, o.model) end
  if c.device == "cuda" then
    local props = o.device or nv.cuda.devices()[1]
    if not o.device and nv.cuda.emulated() then props.emulated = true end
    local row = M.gpu_part(props)
    if row then
      local class, why = want, nil
      if want == "recipe" then class, why = recipe_class_gpu(fa, fb, o.gemm_path or nv.cuda.gemm_path) end
      return datasheet(props, row, class, why)
    end
    if o.may_measure == false then return nil end
    local v = M.gpu_bf16_rate()
    return v, string.format("the dense bf16 cuBLASLt GEMM rate of this GPU measured now, %s (%s, compute capability " ..
      "%s, is not in nvlua's table of datasheets: mfu_peak=<FLOP/s> sets its peak)", M.rate(v), tostring(props.name),
      tostring(props.capability))
  end
  -- the CPU: f32 GEMMs run on sgemm; every other format on the bf16 units where it has them (exact
  -- emulation), else on sgemm too
  local f32 = want == "fp32" or want == "tf32" or (want == "recipe" and fa == "f32" and fb == "f32")
  local bf16_ready = o.cpu and o.cpu.bf16_ready
  if bf16_ready == nil then bf16_ready = M.cpu_bf16_ready() end
  local kind = (f32 or not bf16_ready) and "f32" or "bf16"
  local co = {}
  for k, v in pairs(o.cpu or {}) do if k ~= "bf16_ready" then co[k] = v end end
  co.may_measure = o.may_measure
  if o.alone == false then co.keep = false end
  local v, note = M.cpu_rate(kind, co)
  if not v then return nil end
  local unit = kind == "bf16" and "the bf16 GEMM rate of this CPU (oneDNN)" or "the f32 GEMM rate of this CPU (OpenBLAS sgemm)"
  local extra = ""
  if kind == "f32" and not f32 then extra = "; it has no bf16 GEMM units nvlua uses, so its GEMMs run on sgemm" end
  if kind == "bf16" and want ~= "bf16" and want ~= "recipe" then extra = "; its " .. want .. " GEMMs run emulated on them" end
  return v, string.format("%s, %s (%s%s)", unit, M.rate(v), note, extra)
end

return M
