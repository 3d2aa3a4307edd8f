-- nvlua.checkpoint: checkpoints: a Hugging Face Llama model directory plus the training state beside it.
--
--   <run>/checkpoints/step-000100/
--     model/                 the model directory, to upload as it is (nvlua.hf, nvlua.tokenizer):
--       model.safetensors      parameters under HF names, f32, __metadata__ {"format": "pt"}
--       config.json            the HF LlamaConfig (all keys; bos/eos ids from the tokenizer), so
--                              LlamaForCausalLM.from_pretrained loads it
--       tokenizer.json, tokenizer_config.json [, special_tokens_map.json, generation_config.json]
--                              when the run's data has a tokenizer (AutoTokenizer loads them)
--     trainer.safetensors    AdamW moments (m.<name>, v.<name>): never inside model/
--     trainer.json           step, optimizer step, data cursor, recipe state (SR generator, amax
--                            histories), default generator, the run config, the metrics so far, and
--                            the bookkeeping below. Written last: it is the completeness marker.
-- A checkpoint written before model/ existed (model.safetensors and config.json beside
-- trainer.json) still loads and resumes: ckpt.model_dir finds the model files in either layout.
--
-- The protocol leaves no moment without a complete checkpoint (every file and directory change
-- is fsync'd before the next one; a crash = the process killed at any point):
--   save    step-N.partial/ is written, trainer.json last (with the size of every other file);
--           an existing step-N is renamed to step-N.old, step-N.partial to step-N, step-N.old is
--           removed; then checkpoints beyond `keep` are pruned.
--   remove  trainer.json first (from then on the directory is not a checkpoint), then the rest.
--   A save is committed by the rename of step-N.partial to step-N: a .partial is never resumed from.
--   recover (at every save and at resume=auto) settles what a crash left: a step-N.partial, and a
--           directory without trainer.json, are removed; a step-N.old with no step-N (a crash
--           between the two renames) is renamed back to step-N; a step-N.old beside step-N is removed.
-- list()/latest() see the same effective checkpoints without changing anything.
--   set aside (resume=auto, train.lua) a damaged checkpoint (ckpt.verify) is renamed to step-N.corrupt
--           (.corrupt-2, ... when taken): no longer a checkpoint to list, prune or replace, kept for
--           a person to inspect (overwrite=true's remove_all removes it with the rest).
--
-- Background saves (save{background = true}) run the same protocol in the same order: the caller
-- settles what a crash left (recover), creates step-N.partial and lists every step — each file's
-- contents (strings and tensors, collected from util.atomic_write), the syncs, renames, removals
-- and pruning; core.bg_submit copies the contents into a host staging buffer and a C writer thread
-- (lua/bind/sys.c) does the rest while training goes on (defer_copy: the writer makes the copy too,
-- and the caller waits for it with snapshot_wait before changing the state).
--
-- Bookkeeping in trainer.json: seq, the order in which the run's checkpoints were written (pruning
-- and latest() go by it, not by step number: a run resumed from an older checkpoint writes newer
-- ones with smaller step numbers); bad_steps_in_row and skipped_steps, the trainer's counters of
-- steps skipped for a non-finite loss, gradient, weight or activation (a checkpoint written during such a streak is
-- "unhealthy": pruning always keeps the newest healthy one, and load refuses a checkpoint whose
-- streak already exceeds max_bad_steps); files, the byte size of every other file, by its path in
-- the checkpoint ("model/config.json", "trainer.safetensors"); max_batches_per_step (train.lua: the
-- largest grad_accum the run has used since it started, absent when that is unknown), which bounds
-- the data cursor: at step S it lies in [S, S * max_batches_per_step].
--
-- Fault injection for the crash tests: NVLUA_FAULT=<point>[:<nth>] kills the process with SIGKILL
-- the nth time (default 1) it reaches that point of the protocol (ckpt.FAULT_POINTS).
local nv = require "nvlua"
local core = require "nvlua.core"
local lfs = require "lfs"
local cjson = require "cjson"
local st = require "nvlua.safetensors"
local hf = require "nvlua.hf"
local data = require "nvlua.data"
local config = require "nvlua.config"
local util = require "nvlua.util"
local user_error = util.user_error
local tokenizer = require "nvlua.tokenizer"

local ckpt = {}

local MARKER = "trainer.json"
local MODEL = "model" -- the model directory inside a checkpoint

--- ckpt.model_dir(dir) -> the model directory of a checkpoint: dir/model, or dir itself when that
-- does not exist (a checkpoint of the earlier layout, or a Hugging Face model directory).
function ckpt.model_dir(dir)
  if lfs.attributes(dir .. "/" .. MODEL, "mode") == "directory" then return dir .. "/" .. MODEL end
  return dir
end

ckpt.hf_config = hf.config -- the HF LlamaConfig of a model config (nvlua.hf)

-- ---- fault injection ----------------------------------------------------------------------------

--- The fault points of the protocol, in the order a save reaches them.
ckpt.FAULT_POINTS = {
  "save.data",       -- step-N.partial holds model/model.safetensors only
  "save.marker",     -- step-N.partial holds every file but trainer.json
  "save.partial",    -- step-N.partial is complete; nothing renamed yet
  "save.aside",      -- (replacing step-N) step-N renamed to step-N.old, step-N.partial not yet in
  "save.renamed",    -- (replacing step-N) the new step-N in place, step-N.old still complete
  "old.marker",      -- removing step-N.old: its trainer.json removed
  "old.half",        -- ... and one more of its files
  "save.done",       -- the new checkpoint in place, before pruning
  "prune.marker",    -- pruning a checkpoint: its trainer.json removed
  "prune.half",      -- ... and one more of its files
  "recover.renamed", -- recover() renamed step-N.old back to step-N, a step-N.partial not yet removed
  "clean.marker",    -- recover() removing a leftover: its trainer.json (if any) removed
  "clean.half",      -- ... and one more of its files
}

local fault_point, fault_nth, fault_seen -- NVLUA_FAULT, parsed when a fault point is first reached

local function parse_fault()
  local spec = os.getenv("NVLUA_FAULT") or ""
  fault_point, fault_nth, fault_seen = false, 1, 0
  if spec == "" then return end
  local p, n = spec:match("^([%w._]+):?(%d*)$")
  for _, k in ipairs(ckpt.FAULT_POINTS) do
    if k == p and n ~= "0" then
      fault_point, fault_nth = p, tonumber(n) or 1
      return
    end
  end
  user_error(string.format("NVLUA_FAULT=%s: expected <point>[:<nth>], nth >= 1, point one of %s", spec,
    table.concat(ckpt.FAULT_POINTS, ", ")), 0)
end

-- Reached a fault point: the process kills itself (SIGKILL, as kill -9 would) when NVLUA_FAULT names
-- this point and this is its nth time. The shell os.execute starts is a child of this process.
-- A save in the background (ckpt.save{background = true}) records its steps in bgops instead of
-- running them — the files' writes (util.with_write_sink), the syncs, renames and removals — for the
-- writer thread (core.bg_submit) to run in the same order.
local bgops -- nil: every operation runs now

local function fault(point)
  if fault_point == nil then parse_fault() end
  if point ~= fault_point then return end
  fault_seen = fault_seen + 1
  if fault_seen ~= fault_nth then return end
  if bgops then -- the writer thread kills the process when it gets there
    bgops[#bgops + 1] = {"kill", point}
    return
  end
  io.stdout:flush()
  io.stderr:write(string.format("NVLUA_FAULT: killing this process at %s (time %d)\n", point, fault_seen))
  io.stderr:flush()
  os.execute("kill -9 $PPID")
  error("NVLUA_FAULT: the SIGKILL at " .. point .. " did not end the process", 0)
end

-- ---- files and directories ----------------------------------------------------------------------

local function rm_rf(path)
  local a = lfs.attributes(path)
  if not a then return end
  if a.mode == "directory" then
    for n in lfs.dir(path) do
      if n ~= "." and n ~= ".." then rm_rf(path .. "/" .. n) end
    end
    lfs.rmdir(path)
  else
    os.remove(path)
  end
end
ckpt.rm_rf = rm_rf

local function is_dir(path) return lfs.attributes(path, "mode") == "directory" end

--- Is dir a complete checkpoint (does it hold trainer.json)?
local function complete(dir) return dir ~= nil and lfs.attributes(dir .. "/" .. MARKER, "mode") == "file" end
ckpt.complete = complete

local function sync_dir(dir)
  if bgops then bgops[#bgops + 1] = {"fsync", dir, true}; return end
  local ok, err = core.fsync(dir, true)
  if not ok then user_error("checkpoint: cannot sync the directory " .. dir .. ": " .. tostring(err), 0) end
end

local function rename(from, to)
  if bgops then bgops[#bgops + 1] = {"rename", from, to}; return end
  local ok, err = os.rename(from, to)
  if not ok then user_error(string.format("checkpoint: cannot rename %s to %s: %s", from, to, tostring(err)), 0) end
end

-- Remove a checkpoint directory: its marker first (synced), then the rest. what names its fault
-- points (what .. ".marker", what .. ".half").
local function remove_checkpoint(dir, what)
  local marker = dir .. "/" .. MARKER
  if bgops then -- the same steps, for the writer thread
    if not lfs.attributes(dir) then -- step-N.old, made by a rename the writer has not run yet: all of it
      bgops[#bgops + 1] = {"unlink", marker}
      sync_dir(dir)
      fault(what .. ".marker")
      bgops[#bgops + 1] = {"rmtree", dir}
      return
    end
    if lfs.attributes(marker) then
      bgops[#bgops + 1] = {"unlink", marker}
      sync_dir(dir)
    end
    fault(what .. ".marker")
    local names = {}
    for n in lfs.dir(dir) do if n ~= "." and n ~= ".." and n ~= MARKER then names[#names + 1] = n end end
    table.sort(names)
    for i, n in ipairs(names) do
      bgops[#bgops + 1] = {"rmtree", dir .. "/" .. n}
      if i == 1 then fault(what .. ".half") end
    end
    bgops[#bgops + 1] = {"rmdir", dir}
    return
  end
  if lfs.attributes(marker) then
    local ok, err = os.remove(marker)
    if not ok then user_error("checkpoint: cannot remove " .. marker .. ": " .. tostring(err), 0) end
    sync_dir(dir)
  end
  fault(what .. ".marker")
  local names = {}
  for n in lfs.dir(dir) do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
  table.sort(names)
  for i, n in ipairs(names) do
    rm_rf(dir .. "/" .. n)
    if i == 1 then fault(what .. ".half") end
  end
  local ok, err = lfs.rmdir(dir)
  if not ok then user_error("checkpoint: cannot remove the directory " .. dir .. ": " .. tostring(err), 0) end
end

--- ckpt.remove_all(run_dir): every checkpoint under run_dir/checkpoints removed, each one's marker
-- first (a removal cut short leaves nothing that counts as complete), then the directory.
function ckpt.remove_all(run_dir)
  local root = run_dir .. "/checkpoints"
  if not is_dir(root) then return end
  local names = {}
  for n in lfs.dir(root) do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
  table.sort(names)
  for _, n in ipairs(names) do
    local p = root .. "/" .. n
    if is_dir(p) then remove_checkpoint(p, "overwrite") else rm_rf(p) end
  end
  local ok, err = lfs.rmdir(root)
  if not ok then user_error("checkpoint: cannot remove the directory " .. root .. ": " .. tostring(err), 0) end
end

local function step_name(step) return string.format("step-%06d", step) end

-- The step directories under root, by step: {[N] = {final =, partial =, old = paths}}, and the steps
-- sorted. Only the names save writes count (step-%06d, .partial, .old).
local KINDS = {{"", "final"}, {".partial", "partial"}, {".old", "old"}}
local function scan(root)
  local by, steps = {}, {}
  if not is_dir(root) then return by, steps end
  for n in lfs.dir(root) do
    local s, suffix = n:match("^step%-(%d+)(.*)$")
    local step = s and math.tointeger(tonumber(s))
    if step and n == step_name(step) .. suffix and is_dir(root .. "/" .. n) then
      for _, k in ipairs(KINDS) do
        if suffix == k[1] then
          if not by[step] then by[step] = {}; steps[#steps + 1] = step end
          by[step][k[2]] = root .. "/" .. n
        end
      end
    end
  end
  table.sort(steps)
  return by, steps
end

-- JSON numbers are doubles: 64-bit integers (generator seeds, offsets) travel as strings.
local function int_to_text(v) return math.type(v) == "integer" and string.format("%d", v) or v end

-- config.encode: numbers read back bit for bit (cjson keeps 14 digits); a non-finite number
-- (an amax pushed by a step that went NaN) is written as a string and mapped back on load.
local function write_json(path, t)
  local ok, err = util.atomic_write(path, config.encode(t) .. "\n")
  if not ok then user_error("checkpoint: " .. path .. ": " .. err, 0) end
end
local NONFINITE = {inf = math.huge, ["-inf"] = -math.huge, nan = 0 / 0, ["-nan"] = 0 / 0}
local function text_to_number(v) if type(v) == "string" then return NONFINITE[v] or tonumber(v) end return v end

local function read_json(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, s or "")
  if not ok then user_error("checkpoint: " .. path .. ": bad JSON: " .. tostring(v), 2) end
  return v
end

-- An integer >= 0 from a JSON number or decimal text, else nil.
local function nonneg_int(v)
  local i
  if type(v) == "number" then i = math.tointeger(v)
  elseif type(v) == "string" and v:match("^%d+$") then i = math.tointeger(tonumber(v)) end
  return i and i >= 0 and i or nil
end

-- the step a checkpoint directory's name gives (step-N, step-N.old, step-N.partial), or nil
local function step_of_name(dir)
  local n = dir:match("([^/]+)/*$") or ""
  local s = n:match("^step%-(%d+)$") or n:match("^step%-(%d+)%.old$") or n:match("^step%-(%d+)%.partial$")
  return s and math.tointeger(tonumber(s))
end

-- The bookkeeping of a complete checkpoint directory: {seq, healthy}. A trainer.json that cannot be
-- this directory's (unreadable, not an object, no step or another step than the name's, written with
-- the bookkeeping but without seq) sorts as the newest (seq = huge), so that resuming looks at it
-- first and reports it instead of passing over it to an older one.
local function read_info(dir)
  local ok, t = pcall(read_json, dir .. "/" .. MARKER)
  local bad_marker = {seq = math.huge, healthy = false}
  if not ok or type(t) ~= "table" then return bad_marker end
  local step, named = nonneg_int(t.step), step_of_name(dir)
  if step == nil or (named and step ~= named) or (t.seq == nil and t.files ~= nil) then return bad_marker end
  local seq = t.seq == nil and 0 or nonneg_int(t.seq) or math.huge
  local bad = t.bad_steps_in_row == nil and 0 or nonneg_int(t.bad_steps_in_row)
  return {seq = seq, healthy = bad == 0}
end

-- The effective complete checkpoints of a run, oldest first (by seq, then step): per step, step-N,
-- else a complete step-N.old. -> {{dir, step, seq, healthy}, ...}
local function entries(run_dir)
  local by, steps = scan(run_dir .. "/checkpoints")
  local out = {}
  for _, step in ipairs(steps) do
    local e = by[step]
    local dir = complete(e.final) and e.final or complete(e.old) and e.old or nil
    if dir then
      local info = read_info(dir)
      out[#out + 1] = {dir = dir, step = step, seq = info.seq, healthy = info.healthy}
    end
  end
  table.sort(out, function(a, b)
    if a.seq ~= b.seq then return a.seq < b.seq end
    return a.step < b.step
  end)
  return out
end

--- ckpt.recover(run_dir): settle what a crash left under run_dir/checkpoints (see the header).
-- Changes nothing when every directory there is a complete step-N.
function ckpt.recover(run_dir)
  local root = run_dir .. "/checkpoints"
  local by, steps = scan(root)
  for _, step in ipairs(steps) do
    local e = by[step]
    if e.final and not complete(e.final) then -- a removal cut short
      remove_checkpoint(e.final, "clean")
      e.final = nil
    end
    if not e.final and complete(e.old) then -- a crash between save's two renames
      e.final = root .. "/" .. step_name(step)
      rename(e.old, e.final)
      sync_dir(root)
      e.old = nil
      fault("recover.renamed")
    end
    if e.partial then remove_checkpoint(e.partial, "clean") end
    if e.old then remove_checkpoint(e.old, "clean") end
  end
end

-- ---- saving -------------------------------------------------------------------------------------

-- Write everything of a checkpoint into the (new) directory dir, trainer.json last. -> nothing
local function write_checkpoint(dir, o, seq)
  for _, d in ipairs({dir, dir .. "/" .. MODEL}) do
    local ok, err = lfs.mkdir(d)
    if not ok then user_error("checkpoint: cannot create " .. d .. ": " .. tostring(err), 0) end
  end
  local files = {}
  local function written(name, wok, werr) -- werr: the bytes written when wok
    if not wok then user_error("checkpoint: " .. dir .. "/" .. name .. ": " .. tostring(werr), 0) end
    files[name] = werr
  end
  local tok, mdir = o.tokenizer, dir .. "/" .. MODEL
  -- one model.safetensors whatever the size (load and the bookkeeping read that one file; safetensors
  -- has no size limit and transformers loads it)
  local model_files = hf.save_pretrained(o.model, mdir, {after_weights = function() fault("save.data") end,
    bos_token_id = tok and tok.bos_id, eos_token_id = tok and tok.eos_id, max_shard_size = math.maxinteger})
  if tok then
    local max_len = o.model.config.max_position_embeddings
    for name, size in pairs(tokenizer.export(tok, mdir, {model_max_length = max_len})) do model_files[name] = size end
  end
  for name, size in pairs(model_files) do files[MODEL .. "/" .. name] = size end
  sync_dir(mdir)
  local trainer = {step = o.step, config = o.config, metrics = o.metrics, seq = seq, files = files,
    bad_steps_in_row = o.bad_in_row or 0, skipped_steps = o.skipped or 0, max_batches_per_step = o.max_batches_per_step}
  if o.optimizer then
    local s = o.optimizer:state()
    local tensors = {}
    for k, t in pairs(s.m) do tensors["m." .. k] = t end
    for k, t in pairs(s.v) do tensors["v." .. k] = t end
    written("trainer.safetensors", st.save(dir .. "/trainer.safetensors", tensors, {}))
    trainer.optimizer_step = s.step
  end
  if o.recipe then
    local rs = o.recipe:state()
    rs.seed, rs.offset = int_to_text(rs.seed), int_to_text(rs.offset)
    trainer.recipe = rs
  end
  if o.loader then
    local ls = o.loader:state()
    trainer.loader = {cursor = int_to_text(ls.cursor), seed = int_to_text(ls.seed)}
  end
  local g = nv.default_generator()
  trainer.default_generator = {seed = int_to_text(g:seed()), offset = int_to_text(g:offset())}
  sync_dir(dir)
  fault("save.marker")
  write_json(dir .. "/" .. MARKER, trainer) -- fsyncs the file and dir
end

local function identity(path)
  local a = path and lfs.attributes(path)
  return a and (a.dev .. ":" .. a.ino) or nil
end

-- Remove the checkpoints beyond the newest `keep` (by seq), except: just (the one just written),
-- the one at o.protect (the checkpoint this run resumed from), and the newest healthy one.
local function prune(run_dir, just, o)
  local keep = o.keep or 3
  if keep <= 0 then return end
  local all = entries(run_dir)
  local protect = identity(o.protect)
  local kept, healthy_kept = 1, (o.bad_in_row or 0) == 0
  for i = #all, 1, -1 do
    local e = all[i]
    if e.dir ~= just then
      local keep_it = false
      if kept < keep then
        kept, keep_it = kept + 1, true
      elseif (protect and identity(e.dir) == protect) or (e.healthy and not healthy_kept) then
        keep_it = true
      end
      healthy_kept = healthy_kept or (keep_it and e.healthy)
      if not keep_it then remove_checkpoint(e.dir, "prune") end
    end
  end
end

--- ckpt.wait(): wait for a background save (ckpt.save{background = true}) to finish; raises its error.
function ckpt.wait()
  local err = core.bg_wait()
  if err then user_error("checkpoint: " .. err, 0) end
end

--- ckpt.release(): frees the host staging buffer of background saves (none may be writing: ckpt.wait
-- first); the next background save allocates it again
function ckpt.release() core.bg_release() end

--- ckpt.reserve({model =, tokenizer =}): the host staging buffer of background saves made ahead
-- (core.bg_reserve: the writer thread faults its pages in), as large as the model's checkpoint will
-- need: the parameters and the two AdamW moments (f32), the tokenizer's text and 1 MiB for the
-- headers and JSON files. A save that needs more makes a larger one itself.
function ckpt.reserve(o)
  local bytes = (1 << 20) + (o.tokenizer and type(o.tokenizer.text) == "string" and #o.tokenizer.text or 0)
  for _, e in ipairs(o.model:named_parameters()) do bytes = bytes + e.param:nbytes() + 8 * e.param:numel() end
  ckpt.wait()
  core.bg_reserve(bytes)
end

--- ckpt.snapshot_wait() -> seconds waited: returns once a background save made with defer_copy = true
-- has its copy of the state (at once when none is pending). Call it before changing any tensor the
-- save wrote (train.run: before the optimizer step).
function ckpt.snapshot_wait() return core.bg_snapshot_wait() end

--- ckpt.poll(): raises the error of a background save that has finished with one (nothing while
-- one still runs, or after a clean one)
function ckpt.poll()
  if not core.bg_busy() then ckpt.wait() end
end

-- a background save's files, as the writer's ops (util.with_write_sink)
local function collect_write(path, pieces) bgops[#bgops + 1] = {"write", path, pieces} end

--- ckpt.save(run_dir, {model=, optimizer=, recipe=, loader=, step=, config=, metrics=, keep=3 (0: all),
-- protect=<dir never pruned>, bad_in_row=0, skipped=0, tokenizer=, max_batches_per_step=, background=false,
-- defer_copy=false}) -> the checkpoint directory. tokenizer (data.ByteTokenizer or a tokenizer.load one): its files go into
-- model/ (nvlua.tokenizer). Replaces an existing checkpoint of the same step. Raises on an I/O failure.
-- background: the calling thread settles what a crash left (recover), creates step-N.partial and
-- lists the protocol's steps — each file's contents (headers, JSON, the tensors), the syncs, the
-- renames, the removals and the pruning, in the order a blocking save runs them; core.bg_submit
-- copies the contents into a host staging buffer (the step's part: one copy of the state) and a
-- writer thread (C) writes and syncs each file and runs the rest while training goes on. At most one
-- runs: a save first waits for the previous one; ckpt.poll() raises a finished one's error,
-- ckpt.wait() waits for it. defer_copy (with background): save returns before the CPU tensors are
-- copied; the writer thread copies them first, overlapping what the caller does next, which must
-- call ckpt.snapshot_wait() before it changes any of them (they are held meanwhile: freeing one is
-- safe). CUDA tensors are copied to the host before save returns either way.
function ckpt.save(run_dir, o)
  if o.background then
    ckpt.wait()
    data.mkdir_p(run_dir .. "/checkpoints")
    ckpt.recover(run_dir) -- now, as a blocking save does (it settles what a crash left)
    bgops = {}
    local ok, res = pcall(util.with_write_sink, collect_write, ckpt._save, run_dir, o, true)
    local ops = bgops
    bgops = nil
    if not ok then error(res, 0) end
    core.bg_submit(ops, o.defer_copy or false)
    return res
  end
  return ckpt._save(run_dir, o)
end

function ckpt._save(run_dir, o, recovered)
  if not nonneg_int(o.step) or math.type(o.step) ~= "integer" then
    error("checkpoint.save: step must be an integer >= 0, got " .. tostring(o.step), 2)
  end
  if o.keep ~= nil and math.type(o.keep) ~= "integer" then
    error("checkpoint.save: keep must be an integer (0: keep all), got " .. tostring(o.keep), 2)
  end
  if o.max_batches_per_step ~= nil and (math.type(o.max_batches_per_step) ~= "integer" or o.max_batches_per_step < 1)
  then
    user_error("checkpoint.save: max_batches_per_step must be an integer >= 1, got " .. tostring(o.max_batches_per_step), 2)
  end
  local root = run_dir .. "/checkpoints"
  data.mkdir_p(root)
  if not recovered then ckpt.recover(run_dir) end
  local seq = 1
  for _, e in ipairs(entries(run_dir)) do
    if e.seq ~= math.huge and e.seq >= seq then seq = e.seq + 1 end
  end
  local final = root .. "/" .. step_name(o.step)
  local partial, old = final .. ".partial", final .. ".old"
  write_checkpoint(partial, o, seq)
  sync_dir(root)
  fault("save.partial")
  local replacing = lfs.attributes(final) ~= nil
  if replacing then
    rename(final, old)
    sync_dir(root)
    fault("save.aside")
  end
  rename(partial, final)
  sync_dir(root)
  if replacing then
    fault("save.renamed")
    remove_checkpoint(old, "old")
  end
  fault("save.done")
  prune(run_dir, final, o)
  return final
end

--- Complete checkpoints of a run, oldest first (in the order they were written; see the header).
-- A crash can leave one as step-N.old: listed under that name.
function ckpt.list(run_dir)
  local out = {}
  for i, e in ipairs(entries(run_dir)) do out[i] = e.dir end
  return out
end

--- The newest complete checkpoint of a run, or nil.
function ckpt.latest(run_dir)
  local all = entries(run_dir)
  return all[#all] and all[#all].dir
end

--- The newest complete checkpoint of a run not written during a streak of skipped steps, or nil.
function ckpt.latest_healthy(run_dir)
  local all = entries(run_dir)
  for i = #all, 1, -1 do if all[i].healthy then return all[i].dir end end
  return nil
end

--- ckpt.set_aside(dir) -> the new path: a damaged checkpoint renamed to <dir>.corrupt (or .corrupt-2,
-- ...; synced), which no listing, pruning or save counts as a checkpoint; kept for inspection.
function ckpt.set_aside(dir)
  local to, k = dir .. ".corrupt", 1
  while lfs.attributes(to) do
    k = k + 1
    to = dir .. ".corrupt-" .. k
  end
  rename(dir, to)
  sync_dir(dir:match("^(.*)/[^/]+$") or ".")
  return to
end

--- ckpt.read_config(dir), ckpt.from_pretrained(dir [, {recipe =}]): nvlua.hf's, for a checkpoint
-- (its model directory, in either layout) or a Hugging Face model directory.
ckpt.read_config = hf.read_config -- both take a checkpoint (its model/) or a model directory
ckpt.from_pretrained = hf.from_pretrained

-- ---- loading ------------------------------------------------------------------------------------
-- ckpt.load checks everything it reads before it changes anything; each problem is raised as
-- "checkpoint <dir>/<file>: <what is wrong>".

local function fail(dir, file, fmt, ...)
  user_error(string.format("checkpoint %s/%s: " .. fmt, dir, file, ...), 0)
end

-- a value as a message shows it: strings quoted, tables by kind
local function repr(v)
  if type(v) == "string" then return string.format("%q", v) end
  if type(v) == "table" then return v == cjson.null and "null" or "a JSON " .. (#v > 0 and "array" or "object") end
  return tostring(math.tointeger(v) or v)
end

-- a JSON object file of the checkpoint: missing, empty, not JSON, not an object all raise
local function read_object(dir, name)
  local path = dir .. "/" .. name
  local a = lfs.attributes(path)
  if not a then
    if not is_dir(dir) then fail(dir, name, "missing (the directory %s does not exist)", dir) end
    if name == MARKER then
      fail(dir, name, "missing: not a complete checkpoint (trainer.json is written last and removed first, " ..
        "so the writing or the removal of this directory was cut off)")
    end
    fail(dir, name, "missing")
  end
  if a.mode ~= "file" then fail(dir, name, "is a %s, not a file", a.mode) end
  if a.size == 0 then fail(dir, name, "empty (0 bytes)") end
  local f, err = io.open(path, "rb")
  if not f then fail(dir, name, "cannot be read: %s", tostring(err)) end
  local s = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, s or "")
  if not ok then fail(dir, name, "not valid JSON (truncated or overwritten?): %s", tostring(v)) end
  if type(v) ~= "table" or v == cjson.null or #v > 0 then
    fail(dir, name, "expected a JSON object, got %s", repr(v))
  end
  return v
end

-- checkers: value -> normalised value, or nil when it is not one
local function any_int(v)
  if type(v) == "number" then return math.tointeger(v) end
  if type(v) == "string" and v:match("^%-?%d+$") then return math.tointeger(tonumber(v)) end
  return nil
end
local function a_table(v) return type(v) == "table" and v ~= cjson.null and v or nil end
local function a_string(v) return type(v) == "string" and v or nil end
local function amax(v) -- a number, or the text of a non-finite one
  if type(v) == "number" then return v end
  return type(v) == "string" and text_to_number(v) or nil
end

-- t[key] through check (what: the phrase for an error); nil when absent and optional
local function field(dir, t, label, key, check, what, optional)
  local v = t[key]
  if v == nil or v == cjson.null then
    if optional then return nil end
    fail(dir, MARKER, "field %s is missing", label)
  end
  local x = check(v)
  if x == nil then fail(dir, MARKER, "field %s must be %s, got %s", label, what, repr(v)) end
  return x
end

local NONNEG, INT = "an integer >= 0", "an integer (JSON number or decimal text)"

-- trainer.json's recipe state, checked so that recipe:load_state gets what it expects
local function check_recipe_state(dir, r)
  field(dir, r, "recipe.recipe", "recipe", a_string, "a recipe name")
  r.seed = field(dir, r, "recipe.seed", "seed", any_int, INT)
  r.offset = field(dir, r, "recipe.offset", "offset", nonneg_int, NONNEG)
  local hs = field(dir, r, "recipe.histories", "histories", a_table, "an object", true) or {}
  for key, h in pairs(hs) do
    local label = "recipe.histories." .. tostring(key)
    if not a_table(h) then fail(dir, MARKER, "field %s must be an object, got %s", label, repr(h)) end
    for _, k in ipairs({"len", "count", "pos"}) do h[k] = field(dir, h, label .. "." .. k, k, nonneg_int, NONNEG) end
    local values = field(dir, h, label .. ".values", "values", a_table, "an array of numbers", true) or {}
    if h.count > h.len or #values < h.count then
      fail(dir, MARKER, "field %s: count %d, len %d and %d values do not fit together", label, h.count, h.len, #values)
    end
    for i = 1, h.count do values[i] = field(dir, values, label .. ".values[" .. i .. "]", i, amax, "a number") end
    h.values = values
    h.last = field(dir, h, label .. ".last", "last", amax, "a number", true)
  end
  return r
end

-- trainer.json, read and checked: the fields load uses, normalised (integers as integers)
local function read_trainer(dir, o)
  local t = read_object(dir, MARKER)
  t.step = field(dir, t, "step", "step", nonneg_int, NONNEG)
  local named = step_of_name(dir)
  if named and named ~= t.step then
    fail(dir, MARKER, "field step is %d, but the directory's name says step %d: trainer.json belongs to another " ..
      "checkpoint or was edited", t.step, named)
  end
  t.seq = field(dir, t, "seq", "seq", nonneg_int, NONNEG, t.files == nil) -- optional before the bookkeeping
  t.bad_steps_in_row = field(dir, t, "bad_steps_in_row", "bad_steps_in_row", nonneg_int, NONNEG, true) or 0
  t.skipped_steps = field(dir, t, "skipped_steps", "skipped_steps", nonneg_int, NONNEG, true) or 0
  local files = field(dir, t, "files", "files", a_table, "an object {name = size}", true) or {}
  for name in pairs(files) do
    files[name] = field(dir, files, "files." .. tostring(name), name, nonneg_int, NONNEG)
  end
  t.files = files
  if o.optimizer then
    t.optimizer_step = field(dir, t, "optimizer_step", "optimizer_step", nonneg_int, NONNEG)
  end
  t.max_batches_per_step = field(dir, t, "max_batches_per_step", "max_batches_per_step", function(v)
    local i = nonneg_int(v)
    return i and i >= 1 and i or nil
  end, "an integer >= 1", true)
  local l = field(dir, t, "loader", "loader", a_table, "an object {cursor, seed}", true)
  if l then
    l.cursor = field(dir, l, "loader.cursor", "cursor", nonneg_int, NONNEG)
    l.seed = field(dir, l, "loader.seed", "seed", any_int, INT)
    -- a training run draws at least one batch per step, and at most the largest grad_accum it used
    local m = t.max_batches_per_step
    local ga = type(t.config) == "table" and t.config.grad_accum
    local by_train = m or (type(ga) == "number" and math.tointeger(ga) ~= nil) -- a train.lua run wrote it
    local most = m and (t.step > math.maxinteger // m and math.maxinteger or t.step * m)
    if by_train and (l.cursor < t.step or (most and l.cursor > most)) then
      fail(dir, MARKER, "field loader.cursor is %d, impossible at step %d: every step draws %s, so the data " ..
        "cursor lies in [%d, %s]", l.cursor, t.step, m and string.format("1 to %d batches (grad_accum)", m) or
        "at least one batch", t.step, most and string.format("%d", most) or "...")
    end
  end
  local g = field(dir, t, "default_generator", "default_generator", a_table, "an object {seed, offset}", true)
  if g then
    g.seed = field(dir, g, "default_generator.seed", "seed", any_int, INT)
    g.offset = field(dir, g, "default_generator.offset", "offset", nonneg_int, NONNEG)
  end
  local r = field(dir, t, "recipe", "recipe", a_table, "an object (the recipe state)", true)
  if r then check_recipe_state(dir, r) end
  return t
end

-- The model files' paths in a checkpoint: "model/" in the layout with a model directory, "" in the
-- earlier one (ckpt.model_dir; trainer.json's files say which when the directory is gone).
local function model_prefix(dir, tr)
  for name in pairs(tr.files) do if name:sub(1, #MODEL + 1) == MODEL .. "/" then return MODEL .. "/" end end
  return ckpt.model_dir(dir) == dir and "" or MODEL .. "/"
end

-- the files load reads, and every other file trainer.json recorded (the tokenizer's): present, not
-- empty, of the size recorded
local function check_files(dir, tr, o)
  local m = model_prefix(dir, tr)
  local need = {m .. "config.json", m .. "model.safetensors"}
  if o.optimizer then need[#need + 1] = "trainer.safetensors" end
  local all, seen = {table.unpack(need)}, {}
  for _, name in ipairs(need) do seen[name] = true end
  local recorded = {}
  for name in pairs(tr.files) do if not seen[name] then recorded[#recorded + 1] = name end end
  table.sort(recorded)
  table.move(recorded, 1, #recorded, #all + 1, all)
  for _, name in ipairs(all) do
    local a = lfs.attributes(dir .. "/" .. name)
    if not a and seen[name] then
      fail(dir, name, "missing (a checkpoint has %s and trainer.json)", table.concat(need, ", "))
    end
    if not a then fail(dir, name, "missing (trainer.json recorded it when the checkpoint was written)") end
    if a.mode ~= "file" then fail(dir, name, "is a %s, not a file", a.mode) end
    if a.size == 0 then fail(dir, name, "empty (0 bytes)") end
    local want = tr.files[name]
    if want and a.size ~= want then
      fail(dir, name, "%d bytes, but trainer.json recorded %d when the checkpoint was written (truncated or replaced)",
        a.size, want)
    end
  end
end

-- the keys that fix the parameters' shapes
local SHAPE_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
  "num_key_value_heads", "head_dim", "tie_word_embeddings"}

local function check_model_config(dir, tr, model)
  local name = model_prefix(dir, tr) .. "config.json"
  local c = read_object(dir, name)
  local want = ckpt.hf_config(model.config)
  local diffs = {}
  for _, k in ipairs(SHAPE_KEYS) do
    local v = c[k]
    if type(v) == "number" then v = math.tointeger(v) or v end
    if v ~= want[k] then diffs[#diffs + 1] = string.format("%s = %s (this model: %s)", k, repr(v), repr(want[k])) end
  end
  if #diffs > 0 then
    fail(dir, name, "model shape mismatch: the checkpoint is of another model: %s", table.concat(diffs, ", "))
  end
end

-- the tensors of a safetensors file of the checkpoint
local function load_tensors(dir, name)
  local path = dir .. "/" .. name
  local ok, t, err = pcall(st.load, path)
  if not ok then t, err = nil, t end
  if not t then
    local msg = tostring(err)
    local pre = "safetensors: " .. path .. ": "
    if msg:sub(1, #pre) == pre then msg = msg:sub(#pre + 1) end
    fail(dir, name, "unreadable: %s", msg)
  end
  return t
end

local function free_all(ts) for _, t in pairs(ts or {}) do t:free() end end

-- an error raised by another module's load function, without its position
local function strip_position(err) return (tostring(err):gsub("^[^\n]-%.lua:%d+: ", "")) end

-- Refuse a diverged checkpoint: one taken after more than max_bad_steps skipped steps in a row,
-- or holding a non-finite parameter.
local function check_diverged(dir, tr, tensors, max_bad, weights)
  local parent = dir:match("^(.*)/checkpoints/[^/]+$")
  local healthy = parent and ckpt.latest_healthy(parent)
  local hint = healthy and healthy ~= dir and "; the newest checkpoint of the run written before such a streak is " ..
    healthy .. " (resume=" .. healthy .. ")" or ""
  if max_bad and tr.bad_steps_in_row > max_bad then
    fail(dir, MARKER, "the run had diverged: this checkpoint was written after %d consecutive skipped steps " ..
      "(non-finite loss, gradient, weight or activation), more than max_bad_steps=%d%s", tr.bad_steps_in_row, max_bad, hint)
  end
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local ok, ss = pcall(core.sumsq, tensors[name])
    if ok and (ss ~= ss or ss == math.huge) then
      fail(dir, weights, "the run had diverged: tensor %s holds non-finite values%s", name, hint)
    end
  end
end

-- the AdamW state of trainer.safetensors: {step, m, v}
local function optimizer_state(dir, tr, ts)
  local m, v = {}, {}
  for k, t in pairs(ts) do
    local which, name = k:match("^([mv])%.(.*)$")
    if which == "m" then m[name] = t elseif which == "v" then v[name] = t
    else fail(dir, "trainer.safetensors", "unexpected tensor %q (expected m.<name> and v.<name>)", k) end
  end
  return {step = tr.optimizer_step, m = m, v = v}
end

--- ckpt.verify(dir [, {optimizer = true}]) -> nil when dir is an intact checkpoint, else the problem
-- ("checkpoint <dir>/<file>: ..."): what load checks of the files themselves (trainer.json and its
-- fields, the step against the directory's name, the data cursor against the step, every file present
-- with the size recorded, the safetensors headers readable), without a model to compare with. A
-- checkpoint that passes can still be refused by load for another model, recipe or data seed, or as
-- diverged: those are not damage.
function ckpt.verify(dir, o)
  o = o or {}
  local ok, err = pcall(function()
    local tr = read_trainer(dir, o)
    check_files(dir, tr, o)
    read_object(dir, model_prefix(dir, tr) .. "config.json")
    local names = {model_prefix(dir, tr) .. "model.safetensors"}
    if o.optimizer then names[2] = "trainer.safetensors" end
    for _, name in ipairs(names) do
      local hok, h, herr = pcall(st.read_header, dir .. "/" .. name)
      if not hok then h, herr = nil, h end
      if not h then
        local msg = tostring(herr)
        local pre = "safetensors: " .. dir .. "/" .. name .. ": "
        if msg:sub(1, #pre) == pre then msg = msg:sub(#pre + 1) end
        fail(dir, name, "unreadable: %s", msg)
      end
    end
  end)
  if ok then return nil end
  return tostring(err)
end

--- ckpt.load(dir, {model=, optimizer=, recipe=, loader=, max_bad_steps=}) -> trainer table (step,
-- bad_steps_in_row, skipped_steps, config, metrics, ...). Restores everything save() wrote, so
-- training continues bit for bit. Every problem (a missing, empty, truncated or malformed file, a
-- field of the wrong type, a checkpoint of another model or recipe, another data seed, a diverged
-- run: more than max_bad_steps skipped steps in a row, or non-finite parameters) raises
-- "checkpoint <dir>/<file>: ..." before anything is changed.
function ckpt.load(dir, o)
  local tr = read_trainer(dir, o)
  check_files(dir, tr, o)
  check_model_config(dir, tr, o.model)
  if o.recipe and tr.recipe then
    local mine = o.recipe:state().recipe
    if tr.recipe.recipe ~= mine then
      fail(dir, MARKER, "written under recipe %s, but this run's recipe is %s (resume with recipe=%s)",
        tr.recipe.recipe, tostring(mine), tr.recipe.recipe)
    end
  end
  if o.loader and tr.loader and tr.loader.seed ~= o.loader:state().seed then
    fail(dir, MARKER, "the checkpoint's data seed %d differs from this run's %d (data_seed=)", tr.loader.seed,
      o.loader:state().seed)
  end
  local weights = model_prefix(dir, tr) .. "model.safetensors"
  local tensors = load_tensors(dir, weights)
  local ok, err = pcall(check_diverged, dir, tr, tensors, o.max_bad_steps, weights)
  local ts
  if ok and o.optimizer then ok, err = pcall(function() ts = load_tensors(dir, "trainer.safetensors") end) end
  local ostate
  if ok and ts then ok, err = pcall(function() ostate = optimizer_state(dir, tr, ts) end) end
  if ok then ok, err = pcall(o.model.load_state_dict, o.model, tensors) end
  if not ok and not tostring(err):find("^checkpoint ") then
    err = string.format("checkpoint %s/%s: %s", dir, weights, strip_position(err))
  end
  if ok and ostate then
    ok, err = pcall(o.optimizer.load_state, o.optimizer, ostate)
    if not ok then err = string.format("checkpoint %s/trainer.safetensors: %s", dir, strip_position(err)) end
  end
  free_all(tensors)
  free_all(ts)
  if not ok then error(err, 0) end
  if o.recipe and tr.recipe then
    ok, err = pcall(o.recipe.load_state, o.recipe, tr.recipe)
    if not ok then fail(dir, MARKER, "recipe state: %s", strip_position(err)) end
  end
  if o.loader and tr.loader then o.loader:load_state(tr.loader) end
  if tr.default_generator then
    local g = nv.default_generator()
    g:manual_seed(tr.default_generator.seed)
    g:set_offset(tr.default_generator.offset)
  end
  return tr
end

return ckpt
