-- nvlua.tensorboard: TensorBoard event files written by nvlua itself, so that a run can be watched
-- live in TensorBoard beside others (tensorboard --logdir runs).
--   local tb = require "nvlua.tensorboard"
--   local w = tb.open("runs/run/tb")                  -- a new events file in that directory
--   w:scalars(step, {["train/loss"] = 2.31, ["train/lr"] = 3e-3})
--   w:text("config", "    {...}", 0)                 -- markdown, shown by TensorBoard's text plugin
--   w:close()
-- The file is TensorBoard's and TensorFlow's: named events.out.tfevents.<unix time>.<host>.<pid>.<n>
-- (n counts the files this process opened, as TensorBoard's own writer does), a sequence of TFRecord
-- records (uint64 length, masked CRC-32C of those 8 bytes, the data, masked CRC-32C of the data),
-- each an Event protocol buffer; the first holds only the file version "brain.Event:2". Scalars are
-- Summary values' simple_value (float32); text is a rank-0 DT_STRING tensor with the text plugin's
-- metadata. The protobuf is encoded here by hand (the field numbers of TensorBoard's
-- tensorboard/compat/proto/{event,summary,tensor}.proto, below), and each write is flushed, so a
-- reader sees every step as it is logged.
-- Not here: histograms, images, graphs, hparams; reading event files (tests/test_tensorboard.lua
-- decodes them itself; scripts/check_tensorboard.py with the tensorboard package).
local core = require "nvlua.core"
local lfs = require "lfs"
local util = require "nvlua.util"
local user_error = util.user_error

local tb = {}

-- ---- protobuf wire format: varints (wire type 0), fixed64 (1), length-delimited (2), fixed32 (5)

-- n as a base-128 varint, low groups first (>> is a logical shift: a negative n takes 10 bytes)
local function varint(n)
  local out = {}
  repeat
    local b = n & 0x7F
    n = n >> 7
    out[#out + 1] = string.char(n ~= 0 and (b | 0x80) or b)
  until n == 0
  return table.concat(out)
end

local function key(field, wire) return varint(field << 3 | wire) end
local function f_varint(field, n) return key(field, 0) .. varint(n) end
local function f_double(field, x) return key(field, 1) .. string.pack("<d", x) end
local function f_bytes(field, s) return key(field, 2) .. varint(#s) .. s end
local function f_float(field, x) return key(field, 5) .. string.pack("<f", x) end

-- field numbers: Event (tensorboard/compat/proto/event.proto)
local EVENT_WALL_TIME, EVENT_STEP, EVENT_FILE_VERSION, EVENT_SUMMARY = 1, 2, 3, 5
-- Summary.value; Summary.Value's tag, simple_value, tensor, metadata (summary.proto)
local SUMMARY_VALUE, VALUE_TAG, VALUE_SIMPLE, VALUE_TENSOR, VALUE_METADATA = 1, 1, 2, 8, 9
-- SummaryMetadata's plugin_data, data_class; PluginData's plugin_name (summary.proto)
local META_PLUGIN_DATA, META_DATA_CLASS, PLUGIN_NAME = 1, 4, 1
local DATA_CLASS_TENSOR = 2
-- TensorProto's dtype, string_val (tensor.proto); DT_STRING (types.proto)
local TENSOR_DTYPE, TENSOR_STRING_VAL, DT_STRING = 1, 8, 7

tb.FILE_VERSION = "brain.Event:2"

--- tb.masked_crc(s) -> the masked CRC-32C of s (TFRecord: a CRC of data holding CRCs stays useful)
function tb.masked_crc(s)
  local c = core.crc32c(s)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
end

--- tb.record(data) -> data framed as one TFRecord record
function tb.record(data)
  local len = string.pack("<I8", #data)
  return len .. string.pack("<I4", tb.masked_crc(len)) .. data .. string.pack("<I4", tb.masked_crc(data))
end

--- tb.scalar_value(tag, x) -> an encoded Summary.Value: tag and simple_value (x rounded to float32)
function tb.scalar_value(tag, x) return f_bytes(VALUE_TAG, tag) .. f_float(VALUE_SIMPLE, x) end

--- tb.text_value(tag, text) -> an encoded Summary.Value for TensorBoard's text plugin: a rank-0
-- DT_STRING tensor holding text (markdown), metadata plugin "text" (its TextPluginData version 0
-- encodes as no bytes) and data class tensor
function tb.text_value(tag, text)
  local meta = f_bytes(META_PLUGIN_DATA, f_bytes(PLUGIN_NAME, "text")) .. f_varint(META_DATA_CLASS, DATA_CLASS_TENSOR)
  local tensor = f_varint(TENSOR_DTYPE, DT_STRING) .. f_bytes(TENSOR_STRING_VAL, text)
  return f_bytes(VALUE_TAG, tag) .. f_bytes(VALUE_METADATA, meta) .. f_bytes(VALUE_TENSOR, tensor)
end

--- tb.event{wall_time =, step =, file_version =, values = {encoded Summary.Value, ...}} -> an encoded
-- Event (a summary of those values, when given)
function tb.event(e)
  local parts = {f_double(EVENT_WALL_TIME, e.wall_time), f_varint(EVENT_STEP, e.step or 0)}
  if e.file_version then parts[#parts + 1] = f_bytes(EVENT_FILE_VERSION, e.file_version) end
  if e.values then
    local vs = {}
    for i, v in ipairs(e.values) do vs[i] = f_bytes(SUMMARY_VALUE, v) end
    parts[#parts + 1] = f_bytes(EVENT_SUMMARY, table.concat(vs))
  end
  return table.concat(parts)
end

-- ---- what earlier runs left in the directory (resume) ---------------------------------------------

-- The events files in dir (names sorted) and the newest time in their names (0: none).
local function events_files(dir)
  local names, newest = {}, 0
  for name in lfs.dir(dir) do
    local t = name:match("^events%.out%.tfevents%.(%d+)")
    if t and lfs.attributes(dir .. "/" .. name, "mode") == "file" then
      names[#names + 1] = name
      newest = math.max(newest, tonumber(t))
    end
  end
  table.sort(names)
  return names, newest
end

-- The top-level fields of an encoded Event: its step and whether it holds a summary; nil when it does
-- not parse.
local function event_step(s)
  local pos, step, summary = 1, 0, false
  local function rd_varint()
    local n, shift = 0, 0
    repeat
      local b = s:byte(pos)
      if not b or shift > 63 then return nil end
      n, pos, shift = n | (b & 0x7F) << shift, pos + 1, shift + 7
    until b < 0x80
    return n
  end
  while pos <= #s do
    local k = rd_varint()
    if not k then return nil end
    local field, wire = k >> 3, k & 7
    if wire == 0 then
      local v = rd_varint()
      if not v then return nil end
      if field == EVENT_STEP then step = v end
    elseif wire == 1 then pos = pos + 8
    elseif wire == 5 then pos = pos + 4
    elseif wire == 2 then
      local n = rd_varint()
      if not n or n < 0 then return nil end
      if field == EVENT_SUMMARY then summary = true end
      pos = pos + n
    else return nil end
    if pos > #s + 1 then return nil end
  end
  return step, summary
end

-- The records of an events file whose events are kept (keep(step, has_summary)); reading stops at a
-- record that is cut short or fails its checksums (a crash in the middle of a write). -> the kept
-- bytes, whether anything was dropped
local function filter_records(bytes, keep)
  local out, pos, dropped = {}, 1, false
  while pos <= #bytes do
    if pos + 11 > #bytes then dropped = true; break end
    local len, lcrc = string.unpack("<I8<I4", bytes, pos)
    local data_at = pos + 12
    -- (a length of 2^63 or more reads as negative)
    if tb.masked_crc(bytes:sub(pos, pos + 7)) ~= lcrc or len < 0 or len > #bytes - data_at - 3 then
      dropped = true
      break
    end
    local data = bytes:sub(data_at, data_at + len - 1)
    if tb.masked_crc(data) ~= string.unpack("<I4", bytes, data_at + len) then dropped = true; break end
    local step, summary = event_step(data)
    if step and keep(step, summary) then out[#out + 1] = bytes:sub(pos, data_at + len + 3)
    else dropped = true end
    pos = data_at + len + 4
  end
  return table.concat(out), dropped
end

-- The events files in dir from an earlier run: removed (resume_step 0: a fresh start), else each
-- cut back to the events up to resume_step (the steps after it run again and are logged again:
-- TensorBoard would show both). Rewritten atomically under a temporary name without "tfevents" in
-- it, which TensorBoard would otherwise read as one more events file.
local function settle_earlier(dir, resume_step)
  for i, name in ipairs((events_files(dir))) do
    local path = dir .. "/" .. name
    if resume_step == 0 then
      local ok, err = os.remove(path)
      if not ok then user_error("tensorboard: cannot remove the earlier run's " .. path .. ": " .. tostring(err), 0) end
    else
      local f, err = io.open(path, "rb")
      if not f then user_error("tensorboard: cannot read " .. path .. ": " .. tostring(err), 0) end
      local bytes = f:read("a")
      f:close()
      local kept, dropped = filter_records(bytes, function(step, summary) return not summary or step <= resume_step end)
      if dropped then
        local tmp = string.format("%s/.rewrite.%d.%d", dir, core.getpid(), i)
        local ok, werr = util.atomic_write(path, kept, {tmp = tmp})
        if not ok then user_error("tensorboard: " .. path .. ": " .. werr, 0) end
      end
    end
  end
end

-- ---- the writer -----------------------------------------------------------------------------------

local Writer = {}
Writer.__index = Writer

local files_opened = 0 -- the last part of the file names this process makes

local function check_step(step, what)
  if math.type(step) ~= "integer" or step < 0 then
    user_error(string.format("tensorboard: %s: step must be a non-negative integer, got %s", what, tostring(step)), 3)
  end
end

local function check_tag(tag, what)
  if type(tag) ~= "string" or tag == "" then
    user_error(string.format("tensorboard: %s: a tag must be a non-empty string, got %s", what, tostring(tag)), 3)
  end
end

--- tb.open(dir [, {resume_step =}]) -> writer: a new events file in dir (made if missing), its
-- file-version event written. resume_step: the step a run resumes after; the events files already in
-- dir keep their events up to it (those logged after it are dropped: those steps run again), and
-- with resume_step = 0 (a fresh start) they are removed. Without it, earlier files are left as they are.
-- TensorBoard reads a directory's files in the order of their names: the time in the name is now, or
-- one second past the newest earlier file's when that is not earlier (a restart within the second, a
-- clock set back), so that a new file sorts after the ones before it.
function tb.open(dir, opts)
  opts = util.check_opts(opts, {resume_step = function(v)
    if math.type(v) ~= "integer" or v < 0 then return "must be a non-negative integer" end
  end}, "tensorboard.open")
  if type(dir) ~= "string" or dir == "" then user_error("tensorboard.open: dir must be a directory path", 2) end
  local rs = opts.resume_step
  require("nvlua.data").mkdir_p(dir)
  if lfs.attributes(dir, "mode") ~= "directory" then
    user_error("tensorboard.open: " .. dir .. " is not a directory (it could not be made)", 2)
  end
  if rs then settle_earlier(dir, rs) end
  local _, newest = events_files(dir)
  files_opened = files_opened + 1
  local t = core.unix_time()
  local path = string.format("%s/events.out.tfevents.%010d.%s.%d.%d", dir, math.max(math.floor(t), newest + 1),
    core.hostname(), core.getpid(), files_opened - 1)
  local f, err = io.open(path, "wb")
  if not f then user_error("tensorboard.open: cannot create " .. path .. ": " .. tostring(err), 2) end
  local w = setmetatable({path = path, file = f}, Writer)
  w:_write(tb.event({wall_time = t, step = 0, file_version = tb.FILE_VERSION}))
  return w
end

function Writer:_write(event)
  if not self.file then user_error("tensorboard: " .. self.path .. " is closed", 3) end
  local ok, err = self.file:write(tb.record(event))
  if ok then ok, err = self.file:flush() end
  if not ok then user_error("tensorboard: writing " .. self.path .. " failed: " .. tostring(err), 3) end
end

--- w:scalars(step, {[tag] = number, ...}): one event at step holding each value (float32; NaN and
-- infinities as they are), in the order of the tags
function Writer:scalars(step, values)
  check_step(step, "scalars")
  if type(values) ~= "table" then user_error("tensorboard: scalars: values must be a table {tag = number}", 2) end
  local tags = {}
  for tag, v in pairs(values) do
    check_tag(tag, "scalars")
    if type(v) ~= "number" then
      user_error(string.format("tensorboard: scalars: the value of %s must be a number, got %s", tag, type(v)), 2)
    end
    tags[#tags + 1] = tag
  end
  table.sort(tags)
  local vs = {}
  for i, tag in ipairs(tags) do vs[i] = tb.scalar_value(tag, values[tag]) end
  self:_write(tb.event({wall_time = core.unix_time(), step = step, values = vs}))
end

--- w:text(tag, text, step): text (markdown) at step, for TensorBoard's text plugin
function Writer:text(tag, text, step)
  check_tag(tag, "text")
  if type(text) ~= "string" then user_error("tensorboard: text: the text of " .. tag .. " must be a string", 2) end
  check_step(step, "text")
  self:_write(tb.event({wall_time = core.unix_time(), step = step, values = {tb.text_value(tag, text)}}))
end

--- w:close(): the file closed (again: nothing)
function Writer:close()
  if self.file then self.file:close() end
  self.file = nil
end

return tb
