-- test_cuda_optim.lua: the multi-tensor optimizer on cuda (kernels/cuda/multi_tensor.cu through
-- core/optim.c and optim.lua): one AdamW launch per parameter group and one norm launch per step
-- (the emulator's counters), no host synchronisation for clip + step while the norm is not read,
-- and parameters and moments bit for bit equal to the CPU's after several clipped steps, over
-- ragged sizes (1, 17, 4099 elements) and past one launch's 512-row table. Results here are the
-- CPU emulation's (bit-exact with the CPU under emulation), not a GPU run.
--
-- Exactness: AdamW is the same pinned f32 arithmetic on both sides. The norm's fp64 sum runs in
-- another order on the device; on grads that are multiples of 1/64 below 4 in magnitude every
-- square is a multiple of 2^-12 below 16, so every partial sum of up to 2^40 of them is exact in
-- fp64 and the norm, hence the clip factor, is the same on both sides. On random grads the sums
-- differ by order only: |rel. error| <= 2 gamma_n, gamma_n = n u / (1 - n u), u = 2^-53.
local T = require "nvlua.test"
local nv = require "nvlua"
local optim = require "nvlua.optim"
local core = nv.core

local need_emu = T.need_emu

-- The emulator's counter spent by fn: counted("launches", fn) or counted({"kernels", name}, fn).
local function counter(path)
  local c = core.cuda_emu_counters()
  if type(path) == "string" then return c[path] end
  local k = c.kernels[path[2]]
  return k and k.launches or 0
end
local function counted(path, fn)
  local before = counter(path)
  fn()
  return counter(path) - before
end

local SIZES = { {1}, {17}, {4099}, {3, 5} }
local NO_DECAY = { false, true, false, true }

-- Parameter entries of SIZES on device (fixed seed: the same values on every device).
local function entries(device, seed)
  nv.manual_seed(seed)
  local es = {}
  for i, sz in ipairs(SIZES) do
    local p = nv.randn(table.unpack(sz))
    es[i] = { name = "p" .. i, param = device == "cpu" and p or p:cuda(), grad = nv.zeros(p:size(), { device = device }),
      no_decay = NO_DECAY[i] }
  end
  return es
end

-- n multiples of 1/64 in [-4, 4) from a fixed LCG (exactly summable squares), as a 1-D tensor.
local function grid(n, seed)
  local x, t = seed, {}
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    t[i] = (x % 512 - 256) / 64
  end
  return nv.tensor(t)
end

-- Grads of step s: grid values, the same for every set.
local function set_grads(sets, s)
  for i, sz in ipairs(SIZES) do
    local n = 1
    for _, d in ipairs(sz) do n = n * d end
    local g = grid(n, 100 * s + i):view(table.unpack(sz))
    for _, es in ipairs(sets) do es[i].grad:copy_(g) end
  end
end

local function flat(t) return t:cpu():contiguous():reshape(-1):totable() end

T.case("AdamW on cuda: one launch per group, one norm launch, zero host syncs for clip + step", function()
  need_emu()
  local es = entries("cuda", 1)
  local opt = optim.AdamW(es, { lr = 1e-2, weight_decay = 0.1 })
  set_grads({ es }, 1)
  opt:clip_grad_norm(1.0); opt:step() -- warm: the norm state, the caching allocator
  T.with(core.cuda_set_sync, false, function()
    T.eq(counted("launches", function() opt:clip_grad_norm(1.0) end), 1, "clip_grad_norm: launches")
    T.eq(counted("launches", function() opt:step() end), 2, "step of two groups: launches")
    T.eq(counted({ "kernels", "adamw_multi_kernel" }, function() opt:step() end), 2, "adamw_multi_kernel launches")
    T.eq(counted({ "kernels", "grad_norm_kernel" }, function() opt:clip_grad_norm(1.0) end), 1, "grad_norm_kernel")
    T.eq(counted("host_syncs", function() opt:clip_grad_norm(1.0); opt:step() end), 0, "clip + step: host syncs")
    T.eq(counted("memcpy_d2h", function() opt:clip_grad_norm(1.0); opt:step() end), 0, "clip + step: copies to host")
    local norm = opt:clip_grad_norm(1.0)
    T.eq(counted("host_syncs", function() norm:value() end), 1, "reading the norm: one host sync")
    core.cuda_synchronize()
  end)
end)

T.case("AdamW + clip_grad_norm on cuda = the CPU bit for bit after 4 clipped steps (sizes 1, 17, 4099)", function()
  need_emu()
  local cpu, dev, eager = entries("cpu", 2), entries("cuda", 2), entries("cpu", 2)
  local o = { lr = 1e-2, betas = { 0.9, 0.95 }, weight_decay = 0.1 }
  local oc, od, oe = optim.AdamW(cpu, o), optim.AdamW(dev, o), optim.AdamW(eager, o)
  for s = 1, 4 do
    set_grads({ cpu, dev, eager }, s)
    local nc, nd = oc:clip_grad_norm(1.0), od:clip_grad_norm(1.0)
    local ne = optim.clip_grad_norm(eager, 1.0) -- the eager form: grads scaled in place, then a plain step
    T.ok(ne > 1.0, "clipping is active: norm " .. ne)
    T.eq(nd:value(), nc:value(), "norm of step " .. s .. ": cuda = cpu")
    T.eq(nc:value(), ne, "norm of step " .. s .. ": lazy = eager")
    oc:step(); od:step(); oe:step()
  end
  for i, e in ipairs(cpu) do
    local n = e.name
    T.eq(flat(dev[i].param), flat(e.param), n .. ": param cuda = cpu")
    T.eq(flat(od.m[n]), flat(oc.m[n]), n .. ": m cuda = cpu")
    T.eq(flat(od.v[n]), flat(oc.v[n]), n .. ": v cuda = cpu")
    T.eq(flat(eager[i].param), flat(e.param), n .. ": param lazy clip = eager clip_grad_norm + step")
    T.eq(flat(oe.v[n]), flat(oc.v[n]), n .. ": v lazy = eager")
    T.eq(flat(dev[i].grad), flat(e.grad), n .. ": the lazy clip leaves the grads as they are")
  end
end)

T.case("600 tensors (two table launches): bit-exact with the CPU; random grads' norm within 2 gamma_n", function()
  need_emu()
  local function many(device)
    nv.manual_seed(3)
    local es = {}
    for i = 1, 600 do
      local p = nv.randn(1 + i % 5)
      es[i] = { name = "q" .. i, param = device == "cpu" and p or p:cuda(), grad = nv.zeros(1 + i % 5, { device = device }) }
    end
    return es
  end
  local cpu, dev = many("cpu"), many("cuda")
  local oc, od = optim.AdamW(cpu, { lr = 1e-2 }), optim.AdamW(dev, { lr = 1e-2 })
  local n = 0
  for i, e in ipairs(cpu) do
    local g = grid(e.grad:numel(), i)
    e.grad:copy_(g); dev[i].grad:copy_(g)
    n = n + g:numel()
  end
  T.with(core.cuda_set_sync, false, function()
    T.eq(counted({ "kernels", "grad_norm_kernel" }, function() od:clip_grad_norm(1.0) end), 2, "norm: 2 launches")
    T.eq(counted({ "kernels", "adamw_multi_kernel" }, function() od:step() end), 2, "step: 2 launches (one group)")
  end)
  oc:clip_grad_norm(1.0); oc:step()
  for i, e in ipairs(cpu) do T.eq(flat(dev[i].param), flat(e.param), "param " .. i) end
  -- random grads: fp64 sums in two orders
  for i, e in ipairs(cpu) do
    local g = nv.randn(e.grad:numel()); e.grad:copy_(g); dev[i].grad:copy_(g)
  end
  local want, got = optim.grad_norm(cpu), optim.grad_norm(dev)
  local u = 2.0 ^ -53
  local gamma = n * u / (1 - n * u)
  T.ok(math.abs(got - want) <= 2 * gamma * want, string.format("norm %.17g vs %.17g", got, want))
end)
