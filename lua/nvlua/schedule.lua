-- nvlua.schedule: learning-rate schedules, each a callable value of the (1-based) step that
-- describes itself (kind and options: the run record, nvlua.record). A plain Lua function of the
-- step is a schedule too (the training loop calls either); schedule.describe says what each is.
--   local lr = schedule.wsd{lr = 3e-4, warmup = 100, total = 2000, decay = 0.2, min_lr = 0}
--   lr(step) -> learning rate
--   tostring(lr) -> "wsd(decay=0.2, lr=0.0003, min_lr=0, total=2000, warmup=100)"
local schedule = {}

local Schedule = {}
Schedule.__index = Schedule
Schedule.__name = "nvlua.Schedule"
Schedule.__call = function(s, step) return s.fn(step) end
Schedule.__tostring = function(s)
  local keys, parts = {}, {}
  for k in pairs(s.options) do keys[#keys + 1] = k end
  table.sort(keys)
  for i, k in ipairs(keys) do parts[i] = k .. "=" .. tostring(s.options[k]) end
  return s.kind .. "(" .. table.concat(parts, ", ") .. ")"
end

-- kind's schedule: fn(step), computed from the options o (a copy the caller cannot change, so the
-- description stays what the function computes)
local function new(kind, o, fn) return setmetatable({kind = kind, options = o, fn = fn}, Schedule) end

local function copy(o)
  local t = {}
  for k, v in pairs(o) do t[k] = v end
  return t
end

--- schedule.is_schedule(v) -> true for the values schedule.constant/cosine/wsd/linear/make return
function schedule.is_schedule(v) return getmetatable(v) == Schedule end

local function check(o, name, required)
  for _, k in ipairs(required) do
    if type(o[k]) ~= "number" then error(string.format("schedule.%s: '%s' must be a number", name, k), 3) end
  end
end

local function warm(o, step) return o.warmup and o.warmup > 0 and step <= o.warmup and o.lr * step / o.warmup end

--- constant{lr, warmup = 0}
function schedule.constant(o)
  check(o, "constant", {"lr"})
  o = copy(o)
  return new("constant", o, function(step) return warm(o, step) or o.lr end)
end

--- cosine{lr, warmup, total, min_lr = 0}: linear warmup, then cosine from lr to min_lr at total
function schedule.cosine(o)
  check(o, "cosine", {"lr", "total"})
  o = copy(o)
  local min = o.min_lr or 0
  return new("cosine", o, function(step)
    local w = warm(o, step)
    if w then return w end
    local t = math.min(1, (step - (o.warmup or 0)) / math.max(1, o.total - (o.warmup or 0)))
    return min + (o.lr - min) * 0.5 * (1 + math.cos(math.pi * t))
  end)
end

--- wsd{lr, warmup, total, decay = 0.2, min_lr = 0, shape = "linear"|"cosine"}: warmup, a stable
-- phase at lr, and a decay to min_lr over the last `decay` fraction of the steps (the paper's
-- schedule).
function schedule.wsd(o)
  check(o, "wsd", {"lr", "total"})
  o = copy(o)
  local min, frac = o.min_lr or 0, o.decay or 0.2
  if frac < 0 or frac > 1 then error("schedule.wsd: decay must be a fraction in [0, 1]", 2) end
  local decay_start = o.total - math.floor(frac * o.total + 0.5)
  return new("wsd", o, function(step)
    local w = warm(o, step)
    if w then return w end
    if step <= decay_start then return o.lr end
    local t = math.min(1, (step - decay_start) / math.max(1, o.total - decay_start))
    if o.shape == "cosine" then return min + (o.lr - min) * 0.5 * (1 + math.cos(math.pi * t)) end
    return o.lr + (min - o.lr) * t
  end)
end

--- linear{lr, warmup, total, min_lr = 0}: warmup, then linear decay to min_lr at total
function schedule.linear(o)
  check(o, "linear", {"lr", "total"})
  o = copy(o)
  local min = o.min_lr or 0
  return new("linear", o, function(step)
    local w = warm(o, step)
    if w then return w end
    local t = math.min(1, (step - (o.warmup or 0)) / math.max(1, o.total - (o.warmup or 0)))
    return o.lr + (min - o.lr) * t
  end)
end

local KINDS = {constant = true, cosine = true, wsd = true, linear = true}

--- by name: schedule.make("wsd", opts)
function schedule.make(name, o)
  local f = KINDS[name] and schedule[name]
  if not f then
    error("schedule: unknown schedule '" .. tostring(name) .. "' (constant, cosine, wsd, linear)", 2)
  end
  return f(o)
end

--- schedule.describe(s [, {steps =, warmup =, sample = true}]) -> a plain table saying what the
-- schedule s is: {kind, options, text} for a schedule value; {kind = "lua function", defined_at =
-- "<source>:<line>", text = "lua function defined at <source>:<line>"} for a function
-- (debug.getinfo); and samples = {{step =, lr =}, ...}: s at step 1, at the end of the warmup and at
-- 25, 50, 75 and 100% of the steps (the options' warmup and total where s has them, else the given
-- ones), so a record can be checked against the schedule it names. A sample that raises records the
-- message as its lr. sample = false: no samples (s is not called).
function schedule.describe(s, o)
  o = o or {}
  local d, warmup, steps
  if schedule.is_schedule(s) then
    d = {kind = s.kind, options = copy(s.options), text = tostring(s)}
    warmup, steps = s.options.warmup or o.warmup, s.options.total or o.steps
  elseif type(s) == "function" then
    local at = require("nvlua.util").defined_at(s)
    d = {kind = "lua function", defined_at = at, text = "lua function defined at " .. at}
    warmup, steps = o.warmup, o.steps
  else
    local mt = getmetatable(s)
    if not (type(s) == "table" and mt and mt.__call) then
      error("schedule.describe: expects a schedule value or a function(step) -> lr, got " .. type(s), 2)
    end
    d = {kind = "callable table", text = tostring(s)}
    warmup, steps = o.warmup, o.steps
  end
  if o.sample == false then return d end
  local at, seen = {}, {}
  local function add(step)
    step = math.tointeger(step)
    if step and step >= 1 and not seen[step] then seen[step] = true; at[#at + 1] = step end
  end
  add(1)
  if type(warmup) == "number" and warmup > 0 then add(math.floor(warmup)) end
  if type(steps) == "number" and steps >= 1 then
    for _, q in ipairs({0.25, 0.5, 0.75, 1}) do add(math.max(1, math.floor(q * steps + 0.5))) end
  end
  table.sort(at)
  d.samples = {}
  for i, step in ipairs(at) do
    local ok, lr = pcall(s, step)
    d.samples[i] = {step = step, lr = ok and lr or ("error: " .. tostring(lr))}
  end
  return d
end

return schedule
