-- tests/test_mfu.lua: the peak MFU is against (lua/nvlua/peak.lua, train's key mfu_peak):
--   * the GPU table: devices (their properties mocked as nv.cuda.devices() gives them) found by name
--     and compute capability; each row's dense peaks against NVIDIA's printed figures (the sparse
--     ones halved), within the printed rounding; a MIG slice scaled to its SMs; an unknown GPU or a
--     known name with another capability is not looked up in the table.
--   * mfu_peak=recipe: the format pair most of the recipe's GEMMs take, and the units it runs on
--     (the GEMM path stubbed: nvfp4 emulated on Hopper -> bf16, native on Blackwell -> fp4);
--     mfu_peak=fp4 on a GPU without fp4 units is refused by name.
--   * the CPU's calibrated figure: the first call measures (a stub that counts) and writes the cache,
--     the second reads it without measuring; a damaged or foreign cache file is measured again; other
--     machines' entries are kept; an unwritable cache still gives the figure and says it is not cached;
--     NVLUA_RECALIBRATE=1 (a child process) measures again, a bad value is refused.
--   * mfu_peak=<number> is used as given (a tiny training run's metrics: mfu = FLOP/s / that number);
--     values that are not a peak are refused by the config, naming the key.
-- Nothing here times anything: measurements are stubs.
local T = require "nvlua.test"
local peak = require "nvlua.peak"
local train = require "nvlua.train"
local config = require "nvlua.config"
local cjson = require "cjson"

local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

local function dev(name, cc, sms) return {name = name, capability = cc, multiprocessors = sms} end

-- the run config for_run reads
local function gpu_cfg(mfu_peak) return {device = "cuda", mfu_peak = mfu_peak or "bf16"} end

-- ---- the GPU table -----------------------------------------------------------------------------

-- name, capability, SMs -> the row, and NVIDIA's printed peaks in TFLOPS with the rounding they are
-- printed to: sparse = true marks a figure printed with 2:4 sparsity (the dense peak is half of it)
local DATASHEETS = {
  {dev("NVIDIA H100 80GB HBM3", "9.0", 132), "H100 SXM", round = 0.5,
    bf16 = {1979, sparse = true}, fp8 = {3958, sparse = true}, tf32 = {989, sparse = true}, fp32 = {67}},
  {dev("NVIDIA H100 PCIe", "9.0", 114), "H100 PCIe", round = 0.5,
    bf16 = {1513, sparse = true}, fp8 = {3026, sparse = true}, tf32 = {756, sparse = true}, fp32 = {51}},
  {dev("NVIDIA H100 NVL", "9.0", 132), "H100 NVL", round = 0.5,
    bf16 = {1671, sparse = true}, fp8 = {3341, sparse = true}, tf32 = {835, sparse = true}, fp32 = {60}},
  {dev("NVIDIA H200", "9.0", 132), "H200 SXM", round = 0.5,
    bf16 = {1979, sparse = true}, fp8 = {3958, sparse = true}, tf32 = {989, sparse = true}, fp32 = {67}},
  {dev("NVIDIA H200 NVL", "9.0", 132), "H200 NVL", round = 0.5,
    bf16 = {1671, sparse = true}, fp8 = {3341, sparse = true}, tf32 = {835, sparse = true}, fp32 = {60}},
  {dev("NVIDIA GH200 480GB", "9.0", 132), "GH200", round = 0.5,
    bf16 = {1979, sparse = true}, fp8 = {3958, sparse = true}, tf32 = {989, sparse = true}, fp32 = {67}},
  -- HGX B200: 8 GPUs, PFLOPS; FP4 also printed dense (72)
  {dev("NVIDIA B200", "10.0", 148), "B200", round = 0,
    bf16 = {36000 / 8, sparse = true}, fp8 = {72000 / 8, sparse = true}, tf32 = {18000 / 8, sparse = true},
    fp4 = {72000 / 8}, fp32 = {600 / 8}},
  -- HGX B300: FP4 dense 108 PFLOPS for 8
  {dev("NVIDIA B300 SXM6 AC", "10.3", 148), "B300", round = 0,
    bf16 = {36000 / 8, sparse = true}, fp8 = {72000 / 8, sparse = true}, tf32 = {18000 / 8, sparse = true},
    fp4 = {108000 / 8}, fp32 = {600 / 8}},
  -- GB200 NVL72 / GB300 NVL72: 72 GPUs, PFLOPS
  {dev("NVIDIA GB200", "10.0", 148), "GB200", round = 0,
    bf16 = {360000 / 72, sparse = true}, fp8 = {720000 / 72, sparse = true}, tf32 = {180000 / 72, sparse = true},
    fp4 = {1440000 / 72, sparse = true}, fp32 = {5760 / 72}},
  {dev("NVIDIA GB300", "10.3", 160), "GB300", round = 0,
    bf16 = {360000 / 72, sparse = true}, fp8 = {720000 / 72, sparse = true}, tf32 = {180000 / 72, sparse = true},
    fp4 = {1080000 / 72}},
}

T.case("GPU table: each device found by name and capability, its dense peaks = the datasheet's (sparse halved)", function()
  for _, d in ipairs(DATASHEETS) do
    local props, name = d[1], d[2]
    local row = peak.gpu_part(props)
    T.ok(row, props.name .. ": found")
    T.eq(row.name, name, props.name)
    for _, class in ipairs(peak.CLASSES) do
      local printed = d[class]
      if printed then
        local dense = printed.sparse and printed[1] / 2 or printed[1]
        -- a dense figure derived from one printed to 1 TFLOPS is good to 0.5 (0.25 halved): 0.5 bounds both
        T.near(row[class] / 1e12, dense, d.round + 1e-9, name .. " " .. class)
        local v, what = peak.for_run(gpu_cfg(class), {device = props})
        T.eq(v, row[class], name .. " " .. class .. " through for_run")
        T.eq(what, string.format("%s dense %s %s (datasheet)", name, class, peak.rate(row[class])))
      end
    end
    if not d.fp4 then T.eq(row.fp4, nil, name .. ": no fp4 units") end
  end
  local _, what = peak.for_run(gpu_cfg(), {device = dev("NVIDIA H100 80GB HBM3", "9.0", 132)})
  T.eq(what, "H100 SXM dense bf16 989.4 TFLOP/s (datasheet)", "the log line's words")
end)

T.case("GPU table: a MIG slice is scaled to its SMs; an unknown GPU or capability is not in the table", function()
  local v, what = peak.for_run(gpu_cfg(), {device = dev("NVIDIA H100 80GB HBM3", "9.0", 66)})
  T.eq(v, 989.4e12 * 66 / 132)
  T.ok(what:find("scaled to this device's 66 of 132 SMs: 494.7 TFLOP/s", 1, true), what)
  -- more SMs than the datasheet part's (or an undocumented count): the datasheet figure as it is
  T.eq(peak.for_run(gpu_cfg(), {device = dev("NVIDIA B300 SXM6 AC", "10.3", 120)}), 2.25e15)
  T.eq(peak.gpu_part(dev("NVIDIA A100-SXM4-80GB", "8.0", 108)), nil, "an A100 is not in the table")
  T.eq(peak.gpu_part(dev("NVIDIA H100 80GB HBM3", "8.0", 132)), nil, "the name of an H100 with another capability")
  -- an unknown GPU is measured, and only where the caller may measure (ranks but 0 may not)
  T.eq(peak.for_run(gpu_cfg(), {device = dev("NVIDIA A100-SXM4-80GB", "8.0", 108), may_measure = false}), nil)
end)

T.case("mfu_peak=recipe: the units most of the recipe's GEMMs run on; fp4 on a GPU without fp4 units is refused", function()
  local llama = require "nvlua.llama"
  local recipe = require "nvlua.recipe"
  local mcfg = {vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 4,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16}
  local function parts(name)
    local rec = recipe.make(name)
    return rec, llama.Llama(mcfg, {recipe = rec})
  end
  -- nvfp4 on 4 blocks: blocks 0-2 in nvfp4 (7 linears x 3 GEMMs each), block 3 (bf16_last = 1) and the LM
  -- head in bf16: 63 of 87
  local rec, model = parts("nvfp4")
  T.eq({peak.recipe_pair(rec, model)}, {"nvfp4", "nvfp4", 63, 87})
  local calls = {}
  local function path_on(kind)
    return function(fa, fb)
      calls[#calls + 1] = fa .. " " .. fb
      return kind
    end
  end
  local h100, b200 = dev("NVIDIA H100 80GB HBM3", "9.0", 132), dev("NVIDIA B200", "10.0", 148)
  local v, what = peak.for_run(gpu_cfg("recipe"), {device = h100, recipe = rec, model = model, gemm_path = path_on("emulated")})
  T.eq(v, 989.4e12, "Hopper emulates nvfp4 on bf16")
  T.eq(what, "H100 SXM dense bf16 989.4 TFLOP/s (datasheet; the recipe's nvfp4 x nvfp4 GEMMs run emulated on bf16 here)")
  T.eq(calls, {"nvfp4 nvfp4"}, "the GEMM path asked for the recipe's pair")
  v = peak.for_run(gpu_cfg("recipe"), {device = b200, recipe = rec, model = model, gemm_path = path_on("native")})
  T.eq(v, 9e15, "Blackwell's fp4 units")
  -- fp8_cs: e5m2 (dy) x e4m3 in dgrad and wgrad is the most common pair; native on Hopper: fp8
  rec, model = parts("fp8_cs")
  T.eq({peak.recipe_pair(rec, model)}, {"e5m2", "e4m3", 56, 87})
  T.eq(peak.for_run(gpu_cfg("recipe"), {device = h100, recipe = rec, model = model, gemm_path = path_on("native")}), 1978.9e12)
  rec, model = parts("f32")
  T.eq(peak.for_run(gpu_cfg("recipe"), {device = h100, recipe = rec, model = model, gemm_path = path_on("native")}), 66.9e12,
    "f32 GEMMs on the CUDA cores (no TF32)")
  T.raises(function() peak.for_run(gpu_cfg("fp4"), {device = h100}) end,
    "mfu_peak=fp4: the H100 SXM has no fp4 units (its datasheet gives bf16, fp8, tf32, fp32; or give a number)")
end)

-- ---- the CPU's calibrated figure ---------------------------------------------------------------

-- a measure stub: counts its calls per kind, returns a fixed rate per kind
local function stub()
  local s = {n = {f32 = 0, bf16 = 0}}
  s.fn = function(kind)
    s.n[kind] = s.n[kind] + 1
    return kind == "bf16" and 4.28e11 or 1.5e11
  end
  return s
end

local KEY = "Test CPU; 2 CPUs; OpenBLAS test; oneDNN test"

T.case("CPU: the first call measures and writes the cache, the second reads it and measures nothing", function()
  local path = fresh("cache") .. "/nvlua/peak.json" -- its directory made on the way
  local s = stub()
  local o = {path = path, key = KEY, measure = s.fn, recalibrate = false}
  local v, note = peak.cpu_rate("bf16", o)
  T.eq(v, 4.28e11)
  T.eq(s.n.bf16, 1, "measured once")
  T.eq(note, "calibrated now, cached in " .. path)
  local t = cjson.decode(assert(T.read_file(path)))
  T.eq(t.format, "nvlua-peak")
  T.eq(t.machines[KEY].bf16.flops, 4.28e11)
  T.ok(t.machines[KEY].bf16.date:match("^%d%d%d%d%-%d%d%-%d%d$"), "a date: " .. t.machines[KEY].bf16.date)
  v, note = peak.cpu_rate("bf16", o)
  T.eq(v, 4.28e11)
  T.eq(s.n.bf16, 1, "read from the cache, not measured")
  T.eq(note, string.format("calibrated %s, cached in %s", t.machines[KEY].bf16.date, path))
  -- the f32 rate is its own entry, measured once too; bf16's stays
  T.eq(peak.cpu_rate("f32", o), 1.5e11)
  T.eq(peak.cpu_rate("f32", o), 1.5e11)
  T.eq(s.n, {f32 = 1, bf16 = 1})
  -- through for_run, as a run asks: bf16 by default, sgemm for fp32 or where the CPU has no bf16 units
  local run_o = function(ready) return {cpu = {path = path, key = KEY, measure = s.fn, recalibrate = false, bf16_ready = ready}} end
  local w, what = peak.for_run({device = "cpu", mfu_peak = "bf16"}, run_o(true))
  T.eq(w, 4.28e11)
  T.eq(what, string.format("the bf16 GEMM rate of this CPU (oneDNN), 428 GFLOP/s (calibrated %s, cached in %s)",
    t.machines[KEY].bf16.date, path))
  T.eq(peak.for_run({device = "cpu", mfu_peak = "fp32"}, run_o(true)), 1.5e11)
  w, what = peak.for_run({device = "cpu", mfu_peak = "bf16"}, run_o(false))
  T.eq(w, 1.5e11)
  T.ok(what:find("it has no bf16 GEMM units nvlua uses", 1, true), what)
  T.eq(s.n, {f32 = 1, bf16 = 1}, "nothing measured again")
  -- recalibrate measures again and replaces the figure
  peak.cpu_rate("bf16", {path = path, key = KEY, measure = function() return 5e11 end, recalibrate = true})
  T.eq(peak.cpu_rate("bf16", o), 5e11)
  T.eq(s.n.bf16, 1)
end)

T.case("CPU: a damaged or foreign cache file is measured again and rewritten; other machines' entries are kept", function()
  local dir = fresh("damaged")
  local path = dir .. "/peak.json"
  for _, text in ipairs({"{not json", "", "[1, 2]", '{"format": "nvlua-peak", "version": 1, "machines": "x"}',
      '{"format": "other", "version": 1, "machines": {}}',
      cjson.encode({format = "nvlua-peak", version = 1, machines = {[KEY] = {bf16 = {flops = -1, date = "2026-01-01"}}}}),
      cjson.encode({format = "nvlua-peak", version = 1, machines = {[KEY] = {bf16 = {flops = "many", date = "x"}}}})}) do
    T.write_file(path, text)
    local s = stub()
    T.eq(peak.cpu_rate("bf16", {path = path, key = KEY, measure = s.fn, recalibrate = false}), 4.28e11, text)
    T.eq(s.n.bf16, 1, "measured again: " .. text)
    T.eq(cjson.decode(assert(T.read_file(path))).machines[KEY].bf16.flops, 4.28e11, "rewritten: " .. text)
  end
  local other = {f32 = {flops = 1e10, date = "2026-01-02"}}
  T.write_file(path, cjson.encode({format = "nvlua-peak", version = 1, machines = {["Other CPU"] = other}}))
  peak.cpu_rate("f32", {path = path, key = KEY, measure = stub().fn, recalibrate = false})
  local t = cjson.decode(assert(T.read_file(path)))
  T.eq(t.machines["Other CPU"], other, "another machine's entry kept")
  T.eq(t.machines[KEY].f32.flops, 1.5e11)
  -- measured but not cached where other ranks of the job share the machine
  local s = stub()
  local v, note = peak.cpu_rate("f32", {path = dir .. "/shared.json", key = KEY, measure = s.fn, recalibrate = false,
    keep = false})
  T.eq({v, s.n.f32}, {1.5e11, 1})
  T.ok(note:find("measured now, not cached: other ranks of this job share the machine", 1, true), note)
  T.eq(T.read_file(dir .. "/shared.json"), nil, "no cache file")
  -- measured but not cached where the GEMM's threads did not get their cores (another process ran):
  -- 2 threads with 1.0 core between them (what a second job on 2 cores gives), vs 1.9 (kept)
  local function loaded(cores) return function(kind) return kind == "bf16" and 4.28e11 or 1.5e11, cores end end
  v, note = peak.cpu_rate("f32", {path = dir .. "/loaded.json", key = KEY, measure = loaded(1.0), threads = 2,
    recalibrate = false})
  T.eq(v, 1.5e11)
  T.ok(note:find("measured now under load, not cached: the GEMM's 2 threads had 1.00 cores", 1, true), note)
  T.eq(T.read_file(dir .. "/loaded.json"), nil, "no cache file")
  v, note = peak.cpu_rate("f32", {path = dir .. "/loaded.json", key = KEY, measure = loaded(1.9), threads = 2,
    recalibrate = false})
  T.eq(note, "calibrated now, cached in " .. dir .. "/loaded.json")
  -- the real measurement reports the cores it had: between 0 and a little over its thread count. Other
  -- threads' CPU time is accounted up to a scheduler tick late (4 ms at HZ=250), so over 10 timed reps
  -- (about 60 ms here) the share may read up to about 2 threads x 4 ms / 60 ms = 0.13 over
  local rate, cores = peak.sgemm_rate(10)
  T.ok(rate > 0 and cores > 0 and cores <= peak.cpu_threads() + 0.25, string.format("sgemm %g FLOP/s on %g cores", rate, cores))
  -- nothing is measured where the caller may not measure (ranks but 0)
  T.eq(peak.cpu_rate("bf16", {path = dir .. "/none.json", key = KEY, measure = stub().fn, may_measure = false}), nil)
  -- a cache that cannot be written: the figure holds for this run, and the note says why it is not kept
  local file = T.write_file(dir .. "/a_file", "")
  v, note = peak.cpu_rate("f32", {path = file .. "/peak.json", key = KEY, measure = stub().fn, recalibrate = false})
  T.eq(v, 1.5e11)
  T.ok(note:find("calibrated now; not cached: " .. file .. "/peak.json", 1, true), note)
  T.raises(function() peak.cpu_rate("f32", {path = path, key = KEY, measure = function() return 0 / 0 end, recalibrate = true}) end,
    "measuring the CPU's f32 GEMM rate gave")
end)

T.case("CPU: NVLUA_RECALIBRATE=1 measures again (child processes); another value is refused", function()
  local dir = fresh("env")
  local script = T.write_file(dir .. "/cal.lua", string.format([[
local peak = require "nvlua.peak"
local n = 0
local v = peak.cpu_rate("f32", {path = %q, key = "k", measure = function() n = n + 1; return 2e11 + n end})
print(string.format("%%.0f %%d", v, n))
]], dir .. "/peak.json"))
  local function child(env)
    env.NVLUA_PATH = os.getenv("NVLUA_PATH") -- this file's Lua modules, where the runner was given them
    local r = T.run_nvlua(T.shq(script), {env = env})
    return r.out, r.err, r.code
  end
  T.eq(child({}), "200000000001 1\n", "first: measured")
  T.eq(child({}), "200000000001 0\n", "then read from the cache")
  T.eq(child({NVLUA_RECALIBRATE = "0"}), "200000000001 0\n", "NVLUA_RECALIBRATE=0: read")
  T.eq(child({NVLUA_RECALIBRATE = "1"}), "200000000001 1\n", "NVLUA_RECALIBRATE=1: measured again")
  local out, err, code = child({NVLUA_RECALIBRATE = "yes"})
  T.eq({out, code}, {"", 1})
  T.ok(err:find("NVLUA_RECALIBRATE must be 0 or 1, got 'yes'", 1, true), err)
end)

-- ---- mfu_peak=<number> ------------------------------------------------------------------------

T.case("mfu_peak=<number> is used as given: a run's MFU is its FLOP/s over that number; bad values are refused", function()
  local dir = fresh("run")
  local corpus = T.write_corpus(dir .. "/corpus.txt", {seed = 99, lines = 200,
    words = {"in", "the", "beginning", "was", "light", "and", "darkness", "upon", "waters"}})
  local c = config.parse(train.defaults, {"data=" .. corpus, "cache=" .. dir .. "/cache", "out=" .. dir .. "/out",
    "layers=1", "hidden=32", "heads=2", "kv_heads=1", "ffn=64", "seq=16", "batch=2", "steps=2", "warmup=1",
    "eval_every=0", "sample_tokens=0", "plot=false", "quiet=true", "save=false", "recipe=bf16", "mfu_peak=2.5e9"})
  T.eq(peak.for_run(c, {}), 2.5e9)
  T.eq(select(2, peak.for_run(c, {})), "mfu_peak=2.5e9, 2.5 GFLOP/s")
  train.run(c, train.build(c))
  local flops_tok = train.flops_per_token(train.model_config(c, 256), 16)
  local n = 0
  for line in io.lines(dir .. "/out/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.mfu then
      n = n + 1
      T.near(r.mfu * 2.5e9, flops_tok * r.tokens_per_s, 1e-9 * flops_tok * r.tokens_per_s, "mfu = FLOP/s / 2.5e9")
    end
  end
  T.eq(n, 2)
  for v, msg in pairs({["989"] = "config: mfu_peak: a peak is in FLOP/s per device (989e12 for 989 TFLOP/s), got 989",
      fp16 = "config: mfu_peak: must be bf16, recipe, fp8, fp4, tf32, fp32, or a peak in FLOP/s (such as 989e12), got 'fp16'",
      ["0x10"] = "got '0x10'", ["-5e12"] = "got '-5e12'", inf = "got 'inf'"}) do
    T.raises(function() train.schema:parse({"mfu_peak=" .. v}) end, msg)
  end
end)

T.case("cleanup", function() T.ok(T.rm_tree(ROOT)) end)
