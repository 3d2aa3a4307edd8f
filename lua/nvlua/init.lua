-- nvlua: the Lua face of the engine. `local nv = require "nvlua"` returns this table (no globals).
-- The C core (nvlua.core, lua/bind/) holds tensors and kernels; this file adds the creation
-- helpers and printing, and gathers the API (help() lists it: nvlua.help). Dims and indices are
-- 1-based everywhere in Lua.
local core = require "nvlua.core"

local nv = {}
local Tensor = core.Tensor            -- the metatable of every tensor
local methods = Tensor.__methods      -- t:method() lookups land here; Lua conveniences join them

nv.core = core
nv.version = core.version -- not build_info(): its CUDA probe would start the CUDA runtime (see dist.init)
nv.Tensor = methods

local DTYPES = {}
for _, d in ipairs(core.dtypes()) do
  if not d.is_quantized then DTYPES[d.name] = d end
end
local formats = require "nvlua.formats"
nv.dtypes = DTYPES                  -- plain tensor element types
nv.formats = formats.traits         -- the formats nv.quantize takes: name -> traits (nvlua.formats)
nv.format_names = formats.names     -- their names, f32 and bf16 first
--- nv.use_reference(on) -> previous: while on, every op on CPU tensors runs the scalar reference
-- kernels (kernels/cpu/ref) instead of the fast ones (tests compare the two); device ops refuse.
nv.use_reference = core.use_reference

-- Creation arguments: sizes as integers or one table, then optionally a dtype name or an
-- options table {dtype=, device=, generator=}.
local function parse_create(fname, ...)
  local n = select("#", ...)
  local args = {...}
  while n > 0 and args[n] == nil do n = n - 1 end
  local opts = {}
  local last = args[n]
  if type(last) == "string" then
    opts = {dtype = last}; n = n - 1
  elseif type(last) == "table" and getmetatable(last) == nil and n >= 2 then
    opts = last; n = n - 1
  elseif type(last) == "table" and n == 1 and (last.dtype or last.device or last.generator) then
    error(fname .. ": missing sizes", 3)
  end
  local shape
  if n == 1 and type(args[1]) == "table" then
    shape = args[1]
  else
    shape = {}
    for i = 1, n do
      local s = args[i]
      if math.type(s) ~= "integer" then
        local v = type(s) == "number" and math.tointeger(s) -- nil for fractions, NaN, inf and |s| >= 2^63
        if not v then
          error(string.format("%s: size #%d must be an integer, got %s", fname, i,
            type(s) == "number" and tostring(s) or type(s)), 3)
        end
        s = v
      end
      shape[i] = s
    end
  end
  for i, s in ipairs(shape) do
    if math.type(s) ~= "integer" or s < 0 then
      error(string.format("%s: size #%d must be a non-negative integer, got %s", fname, i, tostring(s)), 3)
    end
  end
  if opts.dtype and not DTYPES[opts.dtype] then
    local names = {}
    for _, d in ipairs(core.dtypes()) do if not d.is_quantized then names[#names + 1] = d.name end end
    error(string.format("%s: invalid dtype '%s' (valid: %s)", fname, tostring(opts.dtype), table.concat(names, ", ")), 3)
  end
  return shape, opts
end

local function on_device(t, opts)
  if opts.device ~= nil and opts.device ~= "cpu" and opts.device ~= "cuda" then
    t:free()
    error(string.format("invalid device '%s' (valid: cpu, cuda)", tostring(opts.device)), 3)
  end
  if opts.device and opts.device ~= "cpu" then
    local d = t:to(opts.device)
    t:free()
    return d
  end
  return t
end

--- nv.empty(sizes... [, dtype|opts]) -> uninitialised tensor
function nv.empty(...)
  local shape, opts = parse_create("empty", ...)
  return core.empty(shape, opts.dtype, opts.device)
end

--- nv.zeros / nv.ones(sizes... [, dtype|opts])
function nv.zeros(...)
  local shape, opts = parse_create("zeros", ...)
  return on_device(core.fill_(core.empty(shape, opts.dtype), 0), opts)
end

function nv.ones(...)
  local shape, opts = parse_create("ones", ...)
  return on_device(core.fill_(core.empty(shape, opts.dtype), 1), opts)
end

--- nv.full(sizes, value [, dtype|opts]); sizes as a table
function nv.full(shape, value, o)
  if type(shape) ~= "table" then error("full: sizes must be a table, e.g. nv.full({2, 3}, 7)", 2) end
  if type(value) ~= "number" then error("full: value must be a number, got " .. type(value), 2) end
  local sh, opts = parse_create("full", shape, o)
  return on_device(core.fill_(core.empty(sh, opts.dtype), value), opts)
end

--- nv.arange(n) | nv.arange(start, stop [, step] [, dtype]): [start, stop), i64 for integers, else f32
function nv.arange(a, b, c, d)
  local dtype
  if type(c) == "string" then dtype, c = c, nil elseif type(b) == "string" then dtype, b = b, nil end
  if type(d) == "string" then dtype = d end
  local start, stop, step
  if b == nil then start, stop, step = 0, a, 1 else start, stop, step = a, b, c or 1 end
  for i, v in ipairs({start, stop, step}) do
    if type(v) ~= "number" then error("arange: argument #" .. i .. " must be a number, got " .. type(v), 2) end
  end
  if step == 0 then error("arange: step must not be zero", 2) end
  for i, v in ipairs({start, stop, step}) do
    if v ~= v or v == math.huge or v == -math.huge then error("arange: argument #" .. i .. " must be finite", 2) end
  end
  local n = math.tointeger(math.max(0, math.ceil((stop - start) / step)))
  if not n then
    error(string.format("arange: (%s - %s) / %s elements is too many", tostring(stop), tostring(start), tostring(step)), 2)
  end
  if not dtype then
    local ints = math.type(start) == "integer" and math.type(stop) == "integer" and math.type(step) == "integer"
    dtype = ints and "i64" or "f32"
  end
  if not DTYPES[dtype] then error("arange: invalid dtype '" .. dtype .. "'", 2) end
  return core.arange_(core.empty({n}, dtype), start, step)
end

--- nv.rand / nv.randn(sizes... [, dtype|opts]): uniform [0,1) / standard normal, from Philox4x32-10
function nv.rand(...)
  local shape, opts = parse_create("rand", ...)
  return on_device(core.rand_(core.empty(shape, opts.dtype), opts.generator), opts)
end

function nv.randn(...)
  local shape, opts = parse_create("randn", ...)
  return on_device(core.randn_(core.empty(shape, opts.dtype), opts.generator), opts)
end

--- nv.tensor(nested_table | number [, dtype]) -> a new CPU tensor
function nv.tensor(data, dtype)
  if dtype ~= nil and not DTYPES[dtype] then error("tensor: invalid dtype '" .. tostring(dtype) .. "'", 2) end
  return core.tensor(data, dtype)
end

--- nv.manual_seed(seed): the default generator restarts from seed (offset 0)
nv.manual_seed = core.manual_seed
--- nv.Generator(seed) -> a Philox4x32-10 stream of its own (g:seed() g:offset() g:set_offset(n) g:manual_seed(s))
nv.Generator = core.Generator
--- nv.default_generator() -> the generator random ops and SR draw from when given none
nv.default_generator = core.default_generator
--- nv.matmul(a, b) -> a @ b (2-D, or batched over leading dims); also a:matmul(b)
nv.matmul = core.matmul
--- nv.allclose(a, b [, rtol = 1e-5 [, atol = 1e-8 [, equal_nan]]]) -> |a - b| <= atol + rtol |b| everywhere
nv.allclose = core.allclose

--- nv.is_tensor(x) -> true for a tensor
function nv.is_tensor(x) return getmetatable(x) == Tensor end

-- ---- the arena (lua/bind/scope.c) ---------------------------------------------------------------
-- While a scope is open, every tensor and quantized tensor created (by any op, in any function)
-- is recorded in the innermost one; when the scope's function returns, every recorded tensor is
-- freed (t:free()) except what it returns: returned tensors, and tensors that are values of a
-- returned plain table (no metatable; one level deep, not nested tables), move to the enclosing
-- scope. A view keeps its storage alive, so freeing its base leaves a returned view valid; freeing
-- twice is harmless. Anything stored for later (module state, caches, optimizer state) must be
-- taken out with nv.unscope (or nv.keep'd up to where it is stored). Scopes are per coroutine,
-- and a coroutine cannot yield from inside one: coroutine.yield there raises "coroutine.yield
-- inside nv.scope ..." (the scope is closed as the error unwinds).

--- nv.scope(fn, ...) -> fn(...)'s results, with a scope open while fn runs. An error in fn frees
-- the scope's tensors and propagates unchanged (its traceback intact); scopes nest.
nv.scope = core.scope
--- nv.keep(...) -> its arguments: their tensors (and those in plain tables among them, one level
-- deep) leave the innermost scope for the enclosing one, or every scope at the outermost.
nv.keep = core.keep
--- nv.unscope(...) -> its arguments: their tensors leave every open scope; the holder frees them.
nv.unscope = core.unscope
--- nv.adopt(...) -> its arguments: their tensors are freed when the innermost scope ends (the
-- tensors must be the caller's to free: a module's saved activations in its backward).
nv.adopt = core.adopt
--- nv.unscoped(fn, ...) -> fn(...)'s results, run as if no scope were open: what fn makes is no
-- open scope's to free (a callback that keeps what it makes, e.g. a recipe:trace hook)
nv.unscoped = core.unscoped
--- nv.scope_depth() -> how many scopes are open (in this coroutine)
nv.scope_depth = core.scope_depth

--- nv.memory() -> {cpu = live bytes, cuda = live bytes, peak = {...}, tensors = {...}, cached = bytes}
-- (cached: freed host buffers >= 1 MiB kept for reuse, at most NVLUA_CPU_CACHE_MB, default 1024)
nv.memory = core.memory
--- nv.empty_cache(): give the cached host buffers back to the OS
nv.empty_cache = core.empty_cache
--- nv.reset_peak_memory(): nv.memory().peak restarts from the live bytes
nv.reset_peak_memory = core.reset_peak_memory

nv.cuda = {
  available = core.cuda_available,       -- nv.cuda.available() -> true when a GPU can be used
  --- nv.cuda.unavailable_reason() -> why no GPU can be used ("" when one can)
  unavailable_reason = function() return core.build_info().cuda_unavailable_reason or "" end,
  --- nv.cuda.devices() -> {{name, memory, capability, multiprocessors, pci_bus_id}, ...}
  devices = core.cuda_devices,
  gemm_path = core.cuda_gemm_path,       -- which GEMM path a format takes on this device
  synchronize = core.cuda_synchronize,   -- nv.cuda.synchronize([device]): wait for the device's queued work
  set_sync = core.cuda_set_sync,         -- debugging: wait after every launch (off by default; NVLUA_CUDA_SYNC=1)
  memory = core.cuda_memory,             -- nv.cuda.memory() -> {[device] = the caching allocator's statistics}
  empty_cache = core.cuda_empty_cache,   -- nv.cuda.empty_cache([device]): give the allocator's free blocks back
  --- nv.cuda.emulated() -> a description when the CUDA backend runs on the CPU emulation of CUDA
  -- (a -DNVLUA_CUDA=EMU build: results are the CPU's, not a GPU's), else nil
  emulated = core.cuda_emulated,
}

--- nv.clock() -> monotonic wall-clock seconds
nv.clock = core.clock

--- nv.dist: data-parallel collectives (MPI on the CPU, NCCL on GPUs); world of one without a launcher
nv.dist = require "nvlua.dist"

--- nv.info() -> what `nvlua -v` reports, as fields: version, blas, dnnl (the CPU bf16 GEMMs), fp_env,
-- cuda_compiled, cuda_runtime (1000 * major + 10 * minor), cublaslt, cuda_unavailable_reason ("" when a
-- GPU can be used), cuda_emulated (the CPU emulation of CUDA, nil otherwise), cudnn = {compiled_version,
-- version (the library's, 0 unless it loads; major * 10000 + minor * 100 + patch), loads, error}, gpus =
-- {{name, memory (bytes), capability, multiprocessors, pci_bus_id}, ...} (empty without a GPU). The
-- same C functions answer both (core/info.c, core/device.h, nvl_cudnn_attention_stats).
function nv.info()
  local i = core.build_info()
  local a = core.attention_cudnn()
  i.cudnn = {compiled_version = a.compiled_version, version = a.version, loads = a.library_loads,
    error = a.library_error}
  i.cuda_emulated = core.cuda_emulated()
  i.gpus = core.cuda_available() and core.cuda_devices() or {}
  return i
end

-- ---- printing -------------------------------------------------------------------------------

local EDGE = 3          -- elements shown at each end of an abbreviated dim
local ABBREV_OVER = 1000 -- tensors with more elements than this are abbreviated

local function fmt_number(v, is_float)
  if not is_float then return string.format("%d", v) end
  if v ~= v then return "nan" end
  if v == math.huge then return "inf" elseif v == -math.huge then return "-inf" end
  return string.format("%.4g", v)
end

-- indices to show along a dim of size n
local function shown(n, abbrev)
  local idx = {}
  if abbrev and n > 2 * EDGE then
    for i = 1, EDGE do idx[#idx + 1] = i end
    idx[#idx + 1] = false -- the ellipsis
    for i = n - EDGE + 1, n do idx[#idx + 1] = i end
  else
    for i = 1, n do idx[#idx + 1] = i end
  end
  return idx
end

local function format_tensor(t)
  if t:is_freed() then return "[nvlua.Tensor (freed)]" end
  local size = t:size()
  local desc = string.format("[nvlua.Tensor %s %s%s]", t:dtype(), #size == 0 and "scalar" or table.concat(size, "x"),
    t:device() == "cpu" and "" or " cuda")
  if t:device() ~= "cpu" then return desc end
  if t:numel() == 0 then return desc end
  local is_float = DTYPES[t:dtype()].is_float
  local abbrev = t:numel() > ABBREV_OVER
  local lines = {}
  if #size == 0 then return fmt_number(t:totable(), is_float) .. "\n" .. desc end
  -- collect the strings of the shown elements, to align columns
  local width = 0
  local function cell(...)
    local s = fmt_number(t:get(...), is_float)
    if #s > width then width = #s end
    return s
  end
  local last = #size
  local function rows(prefix, dim, out)
    if dim == last then
      local r = {}
      for _, i in ipairs(shown(size[dim], abbrev)) do
        if i then
          local ix = {table.unpack(prefix)}; ix[#ix + 1] = i
          r[#r + 1] = cell(table.unpack(ix))
        else
          r[#r + 1] = false
        end
      end
      out[#out + 1] = {prefix = prefix, cells = r}
      return
    end
    for _, i in ipairs(shown(size[dim], abbrev)) do
      if i then
        local p = {table.unpack(prefix)}; p[#p + 1] = i
        rows(p, dim + 1, out)
      else
        out[#out + 1] = {ellipsis = true}
      end
    end
  end
  local out = {}
  rows({}, 1, out)
  local prev_head
  for _, r in ipairs(out) do
    if r.ellipsis then
      lines[#lines + 1] = " ..."
    else
      if last > 2 then -- a header per 2-D slice, as Torch7 does: (i,j,.,.)
        local head = {}
        for k = 1, last - 2 do head[k] = tostring(r.prefix[k]) end
        local h = "(" .. table.concat(head, ",") .. ",.,.) = "
        if h ~= prev_head then
          if prev_head then lines[#lines + 1] = "" end
          lines[#lines + 1] = h
          prev_head = h
        end
      end
      local parts = {}
      for _, c in ipairs(r.cells) do parts[#parts + 1] = c and string.rep(" ", width - #c) .. c or "..." end
      lines[#lines + 1] = " " .. table.concat(parts, "  ")
    end
  end
  lines[#lines + 1] = desc
  return table.concat(lines, "\n")
end
Tensor.__tostring = format_tensor
Tensor.__name = "nvlua.Tensor"

-- Lua conveniences on the tensor methods table
function methods.type(t) return "nvlua.Tensor" end
function methods.item(t)
  if t:numel() ~= 1 then error("item: tensor has " .. t:numel() .. " elements, expected 1", 2) end
  return t:reshape(1):get(1)
end
function methods.float(t) return t:to("f32") end
function methods.bf16(t) return t:to("bf16") end
function methods.t(t) return t:transpose() end
function methods.zero_(t) return t:fill_(0) end

-- ---- quantization (lua/nvlua/quant.lua) ---------------------------------------------------------
local quant = require "nvlua.quant"
nv.quant = {report = quant.report, show = quant.show, all_gather_quantized = quant.all_gather_quantized,
  gather_align = quant.gather_align}
nv.quantize = quant.quantize
nv.qmatmul = quant.qmatmul
nv.rht = quant.rht
nv.AmaxHistory = quant.AmaxHistory
nv.recipe = require "nvlua.recipe"
nv.stats = require "nvlua.stats"
nv.mor = require "nvlua.mor"
nv.prune = require "nvlua.prune"

-- ---- help -----------------------------------------------------------------------------------

--- nv.help([x]): help() prints the API's index; help(x) the documentation of a function, module,
-- class or value, read from its doc comments; help("train") names a module (nvlua.help)
function nv.help(...) return require("nvlua.help").help(...) end

-- ---- modules loaded at first use ------------------------------------------------------------
-- nv.tokenizer (nv.tokenizer.load(path):encode(text)), nv.eval, nv.data, nv.hf, nv.llama, nv.nn, nv.train:
-- required when first read (they require nvlua themselves, and a script that never touches them does not
-- pay for them)
local LAZY = {tokenizer = "nvlua.tokenizer", eval = "nvlua.eval", data = "nvlua.data", hf = "nvlua.hf",
  llama = "nvlua.llama", nn = "nvlua.nn", train = "nvlua.train"}
setmetatable(nv, {__index = function(t, k)
  local name = LAZY[k]
  if not name then return nil end
  local m = require(name)
  rawset(t, k, m)
  return m
end})

return nv
