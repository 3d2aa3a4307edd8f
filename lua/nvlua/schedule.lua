-- nvlua.schedule: learning-rate schedules, each a Lua function of the (1-based) step.
--   local lr = schedule.wsd{lr = 3e-4, warmup = 100, total = 2000, decay = 0.2, min_lr = 0}
--   lr(step) -> learning rate
local schedule = {}

local function check(o, name, required)
  for _, k in ipairs(required) do
    if type(o[k]) ~= "number" then error(string.format("schedule.%s: '%s' must be a number", name, k), 3) end
  end
end

local function warm(o, step) return o.warmup and o.warmup > 0 and step <= o.warmup and o.lr * step / o.warmup end

--- constant{lr, warmup = 0}
function schedule.constant(o)
  check(o, "constant", {"lr"})
  return function(step) return warm(o, step) or o.lr end
end

--- cosine{lr, warmup, total, min_lr = 0}: linear warmup, then cosine from lr to min_lr at total
function schedule.cosine(o)
  check(o, "cosine", {"lr", "total"})
  local min = o.min_lr or 0
  return function(step)
    local w = warm(o, step)
    if w then return w end
    local t = math.min(1, (step - (o.warmup or 0)) / math.max(1, o.total - (o.warmup or 0)))
    return min + (o.lr - min) * 0.5 * (1 + math.cos(math.pi * t))
  end
end

--- wsd{lr, warmup, total, decay = 0.2, min_lr = 0, shape = "linear"|"cosine"}: warmup, a stable
-- phase at lr, and a decay to min_lr over the last `decay` fraction of the steps (the paper's
-- schedule).
function schedule.wsd(o)
  check(o, "wsd", {"lr", "total"})
  local min, frac = o.min_lr or 0, o.decay or 0.2
  if frac < 0 or frac > 1 then error("schedule.wsd: decay must be a fraction in [0, 1]", 2) end
  local decay_start = o.total - math.floor(frac * o.total + 0.5)
  return function(step)
    local w = warm(o, step)
    if w then return w end
    if step <= decay_start then return o.lr end
    local t = math.min(1, (step - decay_start) / math.max(1, o.total - decay_start))
    if o.shape == "cosine" then return min + (o.lr - min) * 0.5 * (1 + math.cos(math.pi * t)) end
    return o.lr + (min - o.lr) * t
  end
end

--- linear{lr, warmup, total, min_lr = 0}: warmup, then linear decay to min_lr at total
function schedule.linear(o)
  check(o, "linear", {"lr", "total"})
  local min = o.min_lr or 0
  return function(step)
    local w = warm(o, step)
    if w then return w end
    local t = math.min(1, (step - (o.warmup or 0)) / math.max(1, o.total - (o.warmup or 0)))
    return o.lr + (min - o.lr) * t
  end
end

--- by name: schedule.make("wsd", opts)
function schedule.make(name, o)
  local f = schedule[name]
  if type(f) ~= "function" or name == "make" then
    error("schedule: unknown schedule '" .. tostring(name) .. "' (constant, cosine, wsd, linear)", 2)
  end
  return f(o)
end

return schedule
