-- tests/test_tensorboard.lua: TensorBoard event files (lua/nvlua/tensorboard.lua) and the training
-- loop's use of them (tensorboard=true):
--   * CRC-32C (core.crc32c) against RFC 3720 B.4's published vectors and the CRC catalogue's check
--     value of "123456789"; the masked CRC from a published CRC and the mask formula.
--   * the TFRecord framing and the Event protobuf, read back by a decoder written here (its own
--     bit-by-bit CRC-32C, its own varint and wire-format parser), and byte for byte against events
--     encoded by hand from the protobuf wire format.
--   * the file: TensorBoard's name (events.out.tfevents.<time>.<host>.<pid>.<n>), the file version
--     first, every write readable before the file is closed; bad input refused with a clear error.
--   * resume: earlier files cut back to the resume step (a torn last record dropped too), removed
--     on a fresh start.
--   * a run: every step's metrics.jsonl numbers (loss, lr, grad norm, tokens/s, MFU, ...) and every
--     eval's equal to the events' scalars, float32-rounded; the config as text at step 0; a skipped
--     step counted; a run that died after its last checkpoint and was resumed logs each step once;
--     ranks other than 0 and tensorboard=false write nothing.
--   * TensorBoard's own reader (scripts/check_tensorboard.py, the tensorboard package) on those
--     runs, when a python with tensorboard is here (python3, or build/tb-venv that .ci/run makes).
local T = require "nvlua.test"
local tb = require "nvlua.tensorboard"
local core = require "nvlua.core"
local train = require "nvlua.train"
local config = require "nvlua.config"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"
local lfs = require "lfs"

local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

-- ---- an independent reader: CRC-32C bit by bit, the wire format, TFRecord framing ---------------

local function crc32c_bitwise(s)
  local r = 0xFFFFFFFF
  for i = 1, #s do
    r = r ~ s:byte(i)
    for _ = 1, 8 do r = (r & 1 == 1) and ((r >> 1) ~ 0x82F63B78) or (r >> 1) end
  end
  return r ~ 0xFFFFFFFF
end

local function mask(c) return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF end

-- The fields of an encoded message: {[field] = {value, ...}}; varints as integers, fixed64 and fixed32 as
-- their raw 8 and 4 bytes, length-delimited as strings.
local function fields(s)
  local out, pos = {}, 1
  local function varint()
    local n, shift = 0, 0
    while true do
      local b = assert(s:byte(pos), "varint cut short")
      pos = pos + 1
      n = n | (b & 0x7F) << shift
      if b < 0x80 then return n end
      shift = shift + 7
    end
  end
  while pos <= #s do
    local k = varint()
    local f, wire, v = k >> 3, k & 7, nil
    if wire == 0 then v = varint()
    elseif wire == 1 then v = s:sub(pos, pos + 7); pos = pos + 8
    elseif wire == 5 then v = s:sub(pos, pos + 3); pos = pos + 4
    elseif wire == 2 then local n = varint(); v = s:sub(pos, pos + n - 1); pos = pos + n
    else error("wire type " .. wire) end
    assert(pos <= #s + 1, "field cut short")
    out[f] = out[f] or {}
    table.insert(out[f], v)
  end
  return out
end

-- The records of a TFRecord file, each CRC checked; raises on a bad or cut record.
local function records(bytes)
  local out, pos = {}, 1
  while pos <= #bytes do
    local lenbytes = bytes:sub(pos, pos + 7)
    local len = string.unpack("<I8", lenbytes)
    T.eq(string.unpack("<I4", bytes, pos + 8), mask(crc32c_bitwise(lenbytes)), "the length's masked CRC")
    local data = bytes:sub(pos + 12, pos + 11 + len)
    T.eq(#data, len, "the record's data is all there")
    T.eq(string.unpack("<I4", bytes, pos + 12 + len), mask(crc32c_bitwise(data)), "the data's masked CRC")
    out[#out + 1] = data
    pos = pos + 16 + len
  end
  return out
end

local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

-- An encoded Event decoded: {wall_time, step, file_version, scalars = {[tag] = float}, texts = {[tag] =
-- {text, plugin, data_class, dtype}}}
local function event(data)
  local f = fields(data)
  local e = {wall_time = string.unpack("<d", f[1][1]), step = f[2] and f[2][1] or 0,
    file_version = f[3] and f[3][1], scalars = {}, texts = {}, has_summary = f[5] ~= nil}
  for _, v in ipairs(f[5] and fields(f[5][1])[1] or {}) do
    local vf = fields(v)
    local tag = vf[1][1]
    if vf[2] then e.scalars[tag] = string.unpack("<f", vf[2][1]) end
    if vf[8] then
      local tensor, meta = fields(vf[8][1]), fields(vf[9][1])
      e.texts[tag] = {text = tensor[8][1], dtype = tensor[1][1], shape = tensor[2],
        plugin = fields(meta[1][1])[1][1], data_class = meta[4][1]}
    end
  end
  return e
end

local function read_events(path) -- -> the decoded events of one file
  local out = {}
  for i, r in ipairs(records(assert(T.read_file(path)))) do out[i] = event(r) end
  return out
end

local function events_files(dir) -- -> the events files' paths in dir, sorted
  local out = {}
  for n in lfs.dir(dir) do if n:match("^events%.out%.tfevents%.") then out[#out + 1] = dir .. "/" .. n end end
  table.sort(out)
  return out
end

local function hex(s) return (s:gsub(".", function(c) return string.format("%02X", c:byte()) end)) end
local function unhex(h) return (h:gsub("%s", ""):gsub("..", function(b) return string.char(tonumber(b, 16)) end)) end

-- ---- CRC-32C, framing, encoding --------------------------------------------------------------------

T.case("CRC-32C: RFC 3720 B.4's vectors and the check value of 123456789", function()
  local function bytes(from, to, stepv)
    local t = {}
    for b = from, to, stepv or 1 do t[#t + 1] = string.char(b) end
    return table.concat(t)
  end
  T.eq(core.crc32c(string.rep("\0", 32)), 0x8A9136AA, "32 bytes of zeros")
  T.eq(core.crc32c(string.rep("\255", 32)), 0x62A8AB43, "32 bytes of ones")
  T.eq(core.crc32c(bytes(0, 31)), 0x46DD794E, "32 incrementing bytes")
  T.eq(core.crc32c(bytes(31, 0, -1)), 0x113FDB5C, "32 decrementing bytes")
  T.eq(core.crc32c(unhex([[01C00000 00000000 00000000 00000000 14000000 00000400 00000014 00000018
    28000000 00000000 02000000 00000000]])), 0xD9963A56, "an iSCSI read command PDU")
  T.eq(core.crc32c("123456789"), 0xE3069283, "the catalogue's check value")
  T.eq(core.crc32c(""), 0)
  T.eq(core.crc32c("56789", core.crc32c("1234")), 0xE3069283, "continued over two pieces")
  -- the test's own bitwise CRC agrees (the reader below uses it)
  T.eq(crc32c_bitwise("123456789"), 0xE3069283)
  T.raises(function() core.crc32c(nil) end, "bad argument #1 to 'crc32c'")
  T.raises(function() core.crc32c("x", -1) end, "crc must be in [0, 2^32)")
end)

T.case("masked CRC and TFRecord framing, read back by an independent decoder", function()
  -- the mask applied by hand to the published CRC of 123456789
  local c = 0xE3069283
  T.eq(tb.masked_crc("123456789"), (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)
  for _, data in ipairs({"", "hello", string.rep("\0\1\2\255", 300)}) do
    local r = tb.record(data)
    T.eq(#r, #data + 16)
    T.eq(records(r), {data})
  end
  T.eq(hex(tb.record("hello"):sub(1, 8)), "0500000000000000", "the length: uint64 little-endian")
end)

T.case("events encoded byte for byte as the protobuf wire format says", function()
  -- Event{wall_time = 1.5, step = 300, summary{value{tag = "a", simple_value = 0.25}}}:
  -- 09 <1.5 as a little-endian double> | 10 <300 as a varint: AC 02> | 2A 0A <Summary: 0A 08 <Value:
  -- 0A 01 'a' | 15 <0.25 as a little-endian float>>>
  T.eq(hex(tb.event({wall_time = 1.5, step = 300, values = {tb.scalar_value("a", 0.25)}})),
    "09000000000000F83F" .. "10AC02" .. "2A0A" .. "0A08" .. "0A0161" .. "150000803E")
  -- the first event: file_version (field 3) "brain.Event:2"
  T.eq(hex(tb.event({wall_time = 0, step = 0, file_version = "brain.Event:2"})),
    "090000000000000000" .. "1000" .. "1A0D" .. hex("brain.Event:2"))
  -- text: Value{tag 't', metadata (9){plugin_data (1){plugin_name (1) "text"}, data_class (4) 2 (tensor)},
  -- tensor (8){dtype (1) 7 (DT_STRING), string_val (8) "x"}}
  T.eq(hex(tb.text_value("t", "x")), "0A0174" .. "4A0A" .. "0A06" .. "0A04" .. hex("text") .. "2002" .. "4205" ..
    "0807" .. "420178")
  -- a step past 2^32 takes 5 varint bytes
  T.eq(hex(tb.event({wall_time = 0, step = 1 << 32})), "090000000000000000" .. "108080808010")
end)

-- ---- the writer ----------------------------------------------------------------------------------

-- this machine's host name and this process's id, from /proc (not the code under test)
local function proc_line(path)
  local f = assert(io.open(path))
  local l = f:read("l")
  f:close()
  return l
end

T.case("tb.open: TensorBoard's file name, the file version first, every write readable at once", function()
  local dir = fresh("writer") .. "/tb"
  local t0 = os.time()
  local w = tb.open(dir)
  local w2 = tb.open(dir)
  local t1 = os.time()
  local name = w.path:match("[^/]+$")
  local time, host, pid, n = name:match("^events%.out%.tfevents%.(%d%d%d%d%d%d%d%d%d%d)%.(.+)%.(%d+)%.(%d+)$")
  T.ok(time, "the name " .. name)
  T.ok(tonumber(time) >= t0 and tonumber(time) <= t1, "the time in the name is now")
  T.eq(host, proc_line("/proc/sys/kernel/hostname"))
  T.eq(pid, proc_line("/proc/self/stat"):match("^(%d+)"))
  local time2, n2 = w2.path:match("tfevents%.(%d+)%..*%.(%d+)$")
  T.eq(tonumber(n2), tonumber(n) + 1, "the process's second file counts on")
  T.ok(tonumber(time2) > tonumber(time), "a second file in the same second: its name sorts after the first's")
  w2:close()

  local ev = read_events(w.path) -- before close: flushed
  T.eq(#ev, 1)
  T.eq(ev[1].file_version, "brain.Event:2")
  T.eq(ev[1].has_summary, false)
  T.ok(ev[1].wall_time >= t0 and ev[1].wall_time < t1 + 1, "wall time in Unix seconds")
  w:scalars(3, {["train/loss"] = 0.1, ["train/lr"] = 3e-3, big = 1e39, nan = 0 / 0, inf = -math.huge})
  ev = read_events(w.path)
  T.eq(#ev, 2, "the step's event is in the file before it is closed")
  T.eq(ev[2].step, 3)
  T.eq(ev[2].scalars, {["train/loss"] = f32(0.1), ["train/lr"] = f32(3e-3), big = math.huge, nan = 0 / 0,
    inf = -math.huge}, "float32 values; beyond float32's range an infinity; NaN kept")
  T.ok(ev[2].wall_time >= ev[1].wall_time)
  w:text("notes", "**bold**", 7)
  ev = read_events(w.path)
  T.eq(ev[3].step, 7)
  T.eq(ev[3].texts.notes, {text = "**bold**", dtype = 7, plugin = "text", data_class = 2})
  w:close()
  w:close() -- again: nothing
  T.raises(function() w:scalars(4, {x = 1}) end, "is closed")
end)

T.case("bad input: a clear error naming what was wrong", function()
  local dir = fresh("bad")
  local file = T.write_file(dir .. "/afile", "x")
  T.raises(function() tb.open(file) end, "afile is not a directory")
  T.raises(function() tb.open(dir, {resume = 2}) end, "tensorboard.open: unknown option 'resume' (valid: resume_step)")
  T.raises(function() tb.open(dir, {resume_step = -1}) end, "option resume_step must be a non-negative integer, got -1")
  T.raises(function() tb.open(dir, {resume_step = 1.5}) end, "option resume_step must be a non-negative integer")
  T.raises(function() tb.open(nil) end, "tensorboard.open: dir must be a directory path")
  local w = tb.open(dir .. "/tb")
  T.raises(function() w:scalars(-1, {x = 1}) end, "scalars: step must be a non-negative integer, got -1")
  T.raises(function() w:scalars(1.5, {x = 1}) end, "scalars: step must be a non-negative integer, got 1.5")
  T.raises(function() w:scalars(1, {loss = "nan"}) end, "scalars: the value of loss must be a number, got string")
  T.raises(function() w:scalars(1, {[""] = 1}) end, "scalars: a tag must be a non-empty string")
  T.raises(function() w:scalars(1, 5) end, "scalars: values must be a table")
  T.raises(function() w:text("t", 5, 0) end, "text: the text of t must be a string")
  T.raises(function() w:text(nil, "x", 0) end, "text: a tag must be a non-empty string")
  w:close()
  T.eq(#read_events(w.path), 1, "nothing of the bad calls was written")
end)

T.case("resume: earlier files keep their events up to the resume step (a torn record dropped); a fresh start " ..
  "removes them", function()
  local dir = fresh("resume") .. "/tb"
  local w = tb.open(dir)
  w:text("config", "c", 0)
  for s = 1, 5 do w:scalars(s, {["train/loss"] = s}) end
  w:close()
  -- a crash in the middle of a write: half of a record at the end
  local f = assert(io.open(w.path, "ab"))
  f:write(tb.record(tb.event({wall_time = 0, step = 6, values = {tb.scalar_value("train/loss", 6)}})):sub(1, 20))
  f:close()
  local untouched = tb.open(dir) -- no resume_step: earlier files left as they are
  untouched:close()
  T.ok(not pcall(read_events, w.path), "the torn record is still there")
  os.remove(untouched.path)

  local w2 = tb.open(dir, {resume_step = 3})
  local ev = read_events(w.path)
  local steps = {}
  for i, e in ipairs(ev) do steps[i] = e.step end
  T.eq(steps, {0, 0, 1, 2, 3}, "the file version, the config at 0, steps 1..3")
  T.eq(ev[2].texts.config.text, "c")
  T.eq(ev[5].scalars, {["train/loss"] = 3})
  w2:scalars(4, {["train/loss"] = 40})
  w2:close()
  T.eq(events_files(dir), {w.path, w2.path})
  T.eq(#read_events(w2.path), 2)

  local w3 = tb.open(dir, {resume_step = 0})
  T.eq(events_files(dir), {w3.path}, "a fresh start removes the earlier files")
  w3:close()
end)

-- ---- the training loop -----------------------------------------------------------------------------

local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 4242, lines = 300,
  words = {"in", "the", "beginning", "was", "word", "and", "light", "darkness", "waters", "face", "deep", "day"}})
local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=32", "heads=4", "kv_heads=2",
  "ffn=64", "seq=16", "batch=2", "steps=6", "warmup=2", "eval_every=3", "eval_batches=2", "sample_tokens=0",
  "plot=false", "quiet=true", "keep=0", "seed=7", "recipe=bf16"}

local function cfg(dir, extra)
  local args = {"out=" .. dir}
  for _, a in ipairs(BASE) do args[#args + 1] = a end
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  return config.parse(train.defaults, args)
end

local function run(c, hook)
  local p = train.build(c)
  p.peak = 1e9 -- no sgemm measurement
  if hook then hook(p) end
  return train.run(c, p), p
end

local function read_metrics(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do out[#out + 1] = cjson.decode(line) end
  return out
end

-- every scalar in the run's events files: {[tag] = {[step] = {values...}}}
local function run_scalars(dir)
  local out = {}
  for _, path in ipairs(events_files(dir .. "/tb")) do
    for _, e in ipairs(read_events(path)) do
      for tag, v in pairs(e.scalars) do
        out[tag] = out[tag] or {}
        out[tag][e.step] = out[tag][e.step] or {}
        table.insert(out[tag][e.step], v)
      end
    end
  end
  return out
end

-- metrics.jsonl's step and eval records against the events: each number once, float32-rounded
local FIELDS = {loss = "train/loss", lr = "train/lr", grad_norm = "train/grad_norm", tokens_per_s = "perf/tokens_per_s",
  mfu = "perf/mfu", ms = "perf/ms", val_loss = "eval/val_loss", val_ppl = "eval/val_ppl"}
local function same_as_metrics(dir)
  local got = run_scalars(dir)
  local n = 0
  for _, rec in ipairs(read_metrics(dir)) do
    for k, tag in pairs(FIELDS) do
      if type(rec[k]) == "number" then
        local vs = got[tag] and got[tag][rec.step]
        T.eq(vs, {f32(rec[k])}, string.format("%s at step %d (metrics.jsonl's %s)", tag, rec.step, k))
        n = n + 1
      end
    end
  end
  -- and nothing beyond them under these tags
  for _, tag in pairs(FIELDS) do
    for step in pairs(got[tag] or {}) do
      local found = false
      for _, rec in ipairs(read_metrics(dir)) do
        for k, t in pairs(FIELDS) do
          if t == tag and rec.step == step and type(rec[k]) == "number" then found = true end
        end
      end
      T.ok(found, tag .. " at step " .. step .. " is not in metrics.jsonl")
    end
  end
  return n, got
end

local RUNS = {} -- the runs the real reader checks at the end

T.case("a run: every step's and eval's numbers equal metrics.jsonl's (float32); the config as text at step 0",
  function()
  local dir = fresh("run")
  local c = cfg(dir)
  run(c)
  local files = events_files(dir .. "/tb")
  T.eq(#files, 1)
  local n = same_as_metrics(dir)
  T.eq(n, 6 * 6 + 2 * 2, "6 step records of 6 numbers, 2 evals of 2")
  local ev = read_events(files[1])
  T.eq(ev[1].file_version, "brain.Event:2")
  local cfgtext = ev[2].texts.config
  T.eq(ev[2].step, 0)
  T.eq(cfgtext.plugin, "text")
  local json = assert(T.read_file(dir .. "/config.json"))
  T.eq(cfgtext.text, (json:gsub("[^\n]+", "    %0")), "config.json as a markdown code block")
  T.eq(run_scalars(dir)["train/skipped_steps"][6], {0})
  RUNS[#RUNS + 1] = dir
end)

T.case("MoR: each mor_<x> share of metrics.jsonl is the scalar mor/<x>", function()
  local dir = fresh("mor")
  run(cfg(dir, {"recipe=mor", "steps=2", "eval_every=0"}))
  local got = run_scalars(dir)
  local n = 0
  for _, rec in ipairs(read_metrics(dir)) do
    for k, v in pairs(rec) do
      local x = k:match("^mor_(.+)$")
      if x then
        T.eq(got["mor/" .. x] and got["mor/" .. x][rec.step], {f32(v)}, k .. " at step " .. rec.step)
        n = n + 1
      end
    end
  end
  T.ok(n >= 2 * 5, "the MoR shares were logged (" .. n .. ")")
  T.ok(got["mor/low"], "mor/low")
end)

T.case("a skipped step: no loss scalar, train/skipped_steps counts it", function()
  local dir = fresh("skip")
  local c = cfg(dir, {"eval_every=0"})
  run(c, function(p)
    local m = p.model
    local orig = m.forward_backward
    m.forward_backward = function(self, x, y, o)
      local loss, n = orig(self, x, y, o)
      if self.step == 3 then return 0 / 0, n end -- a NaN loss: the step is skipped
      return loss, n
    end
  end)
  local got = run_scalars(dir)
  T.eq(got["train/loss"][3], nil, "the NaN loss (metrics.jsonl: a string) is not a scalar")
  T.ok(got["train/loss"][2] and got["train/loss"][4])
  local counts = {}
  for s = 1, 6 do counts[s] = got["train/skipped_steps"][s][1] end
  T.eq(counts, {0, 0, 1, 1, 1, 1})
  same_as_metrics(dir)
end)

T.case("a run that died after its last checkpoint, resumed: a second file, each step logged once", function()
  local dir = fresh("crash")
  run(cfg(dir, {"ckpt_every=2"}))
  ckpt.rm_rf(dir .. "/checkpoints/step-000006")
  ckpt.rm_rf(dir .. "/checkpoints/step-000004")
  local s = run(cfg(dir, {"ckpt_every=2", "resume=auto"}))
  T.eq(s.losses[1][1], 3, "resumed after step 2")
  local files = events_files(dir .. "/tb")
  T.eq(#files, 2)
  local first, second = read_events(files[1]), read_events(files[2])
  T.eq(first[#first].step, 2, "the first file cut back to step 2")
  T.eq(second[1].file_version, "brain.Event:2")
  T.eq(second[2].step, 3, "the second file starts at step 3 (no config again)")
  local n = same_as_metrics(dir)
  T.eq(n, 6 * 6 + 2 * 2)
  RUNS[#RUNS + 1] = dir
end)

T.case("tensorboard=false, and ranks other than 0, write no events", function()
  local dir = fresh("off")
  run(cfg(dir, {"tensorboard=false"}))
  T.eq(lfs.attributes(dir .. "/tb"), nil)
  T.ok(lfs.attributes(dir .. "/metrics.jsonl"), "the run itself was logged")
  local dir1 = fresh("rank1")
  run(cfg(dir1, {"save=false"}), function(p) p.rank = 1 end)
  T.eq(lfs.attributes(dir1 .. "/tb"), nil, "rank 1 writes no tb/")
end)

-- ---- TensorBoard's own reader ----------------------------------------------------------------------

-- a python that imports tensorboard: python3, or .ci/run's virtualenv
local function tb_python()
  for _, py in ipairs({"python3", "build/tb-venv/bin/python"}) do
    if os.execute(py .. " -c 'import tensorboard' >/dev/null 2>&1") then return py end
  end
end

T.case("TensorBoard's reader (scripts/check_tensorboard.py) reads these runs as metrics.jsonl", function()
  local py = tb_python()
  if not py then
    T.skip("no python with the tensorboard package (pip install tensorboard; .ci/run makes build/tb-venv)")
  end
  T.eq(#RUNS, 2, "the runs above")
  local out = os.tmpname()
  local args = {}
  for i, d in ipairs(RUNS) do args[i] = T.shq(d) end
  local _, how, code = os.execute(string.format("%s scripts/check_tensorboard.py %s >%s 2>&1", py,
    table.concat(args, " "), T.shq(out)))
  local text = T.read_file(out) or ""
  os.remove(out)
  T.ok(how == "exit" and code == 0, "scripts/check_tensorboard.py failed:\n" .. text)
  T.ok(text:find("check_tensorboard: OK", 1, true), text)
end)

T.case("(cleanup)", function() assert(T.rm_tree(ROOT)) end)
