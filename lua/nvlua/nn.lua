-- nvlua.nn: the Lua layer library.   local nn = require "nvlua.nn"
-- Modules hold parameters (f32 master weights), their gradients (f32, accumulated) and the
-- activations saved for backward; the arithmetic is the C layers' (core/layers.h) and, for every
-- linear layer, the recipe's three GEMMs (lua/nvlua/recipe.lua). Torch7-style: m:forward(x) -> y,
-- m:backward(dy) -> dx; parameter gradients accumulate (+=), the returned dx is a new tensor the
-- caller owns. Parameters and submodules are registered explicitly, never found by field name.
-- Here: Module, ModuleList, Linear, Embedding, RMSNorm, RoPE tables, grouped-query Attention,
-- the SwiGLU MLP, and nn.llama_config (Hugging Face LlamaConfig keys), the config Attention and
-- MLP take. The Llama model (its Block, loss, flat gradient buffer) is lua/nvlua/llama.lua;
-- nn.Llama and nn.Block name the same classes (looked up on first use: llama.lua requires nn).
-- Not here: quantization (the recipe does it), the optimizer (optim.lua), the training loop.
-- Shape letters: B batch, T sequence, N = B*T tokens, C hidden, F FFN width, V vocabulary,
-- Hq / Hkv query / key-value heads, D head dim.
-- Memory: each forward and backward runs in an nv.scope, which frees the call's temporaries when
-- it returns (never its caller's input, nor the output it returns). What a forward saves for its
-- backward is taken out of the scopes (nv.unscope) and handed back to backward's scope
-- (nv.adopt), which frees it. A layer keeps its own handle (a view: storage is refcounted) of
-- each input its backward reads, so a container saves nothing for its children and an
-- activation lives exactly as long as some layer still needs it. A temporary whose last use comes
-- before more is allocated dies right there, in a nested scope, as the hand-written frees did.
-- In eval mode a module keeps nothing for backward, and a forward frees what an earlier forward
-- saved for a backward that never ran.
local nv = require "nvlua"
local core = require "nvlua.core"
local util = require "nvlua.util"
local user_error = util.user_error

-- Does the forward producing an activation like x give its amax from the same pass? On a device
-- with bf16 activations (CUDA's fused kernels); elsewhere it would be a pass of its own.
local function fused_amax(x) return x:device() ~= "cpu" and x:dtype() == "bf16" end
local function note_amax(t, amax) return require("nvlua.recipe").note_amax(t, amax) end
local check_opts, same_shape, shape_str = util.check_opts, util.same_shape, util.shape_str

local nn = {}

-- ---- classes ------------------------------------------------------------------------------------

--- nn.class(name [, parent]) -> a class table; Class(...) makes an instance and calls its __init.
function nn.class(name, parent)
  local cls = {}
  cls.__index = cls
  cls.__name = "nvlua.nn." .. name
  cls.__tostring = parent and parent.__tostring
  cls.class_name = name
  cls.super = parent
  return setmetatable(cls, {
    __index = parent,
    __call = function(c, ...)
      local o = setmetatable({}, c)
      o:__init(...)
      return o
    end,
  })
end

--- nn.is_instance(obj, cls): obj's class is cls or derives from it
function nn.is_instance(obj, cls)
  if type(obj) ~= "table" then return false end
  local c = getmetatable(obj)
  while c do
    if c == cls then return true end
    c = rawget(c, "super")
  end
  return false
end



local function check_int(v, what, fname, min)
  if math.type(v) ~= "integer" or v < (min or 1) then
    error(string.format("%s: %s must be an integer >= %d, got %s", fname, what, min or 1, tostring(v)), 3)
  end
end


-- While a model is built in row shards (nn.build_rows): rows(shape) -> row0 (0-based), nrows, chunk;
-- made[t] = the whole shape of a parameter tensor t made so (weak keys)
local build_rows, made = nil, setmetatable({}, {__mode = "k"})

--- nn.build_rows(rows, fn) -> fn()'s results: every parameter the layers create while fn runs is only
-- the rows rows(shape) -> row0 (0-based), nrows, chunk names: a (chunk, ...) tensor whose first
-- nrows rows are the whole parameter's rows [row0, row0 + nrows), the values the whole initialisation
-- gives them (normal: the same Philox draw, its elements from row0 · row size on, core.randn_'s
-- `first`; ones), the rest zeros; its entry's full_shape is the whole shape, and its gradient is
-- (chunk, ...) too. No whole parameter is ever made (nvlua.shard builds shard=full models so).
function nn.build_rows(rows, fn)
  if type(rows) ~= "function" or type(fn) ~= "function" then error("nn.build_rows: expects (function, function)", 2) end
  if build_rows then error("nn.build_rows: already building in rows", 2) end
  build_rows = rows
  local r = table.pack(pcall(fn))
  build_rows = nil
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

-- a parameter of `shape`: whole, init(t, first) filling a whole tensor t (first = 0); under
-- nn.build_rows this rank's rows, init(rows, first) filling them (first: their first element's index
-- in the whole tensor) or, with no rows here, init(nil) (a draw must still advance its generator)
local function make_param(shape, init)
  if not build_rows then
    local t = nv.empty(shape)
    init(t, 0)
    return t
  end
  local row0, nrows, chunk = build_rows(shape)
  local s, row = {table.unpack(shape)}, 1
  for i = 2, #shape do row = row * shape[i] end
  s[1] = chunk
  local t = nv.zeros(s)
  if nrows > 0 then
    local v = t:narrow(1, 1, nrows)
    init(v, row0 * row)
    v:free() -- (the handle; t keeps the storage)
  else
    init(nil)
  end
  made[t] = shape
  return t
end

-- normal(0, std) f32 [shape] from generator g (nil: the default generator)
local function normal(shape, std, g)
  return make_param(shape, function(t, first)
    if not t then -- no rows here: the whole draw's generator step
      g = g or nv.default_generator()
      g:set_offset(g:offset() + 1)
      return
    end
    core.randn_(t, g, first)
    t:mul_(std)
  end)
end

-- ---- Module -------------------------------------------------------------------------------------

--- nn.Module: the base class. A plain Module() is a container for registered submodules.
local Module = nn.class("Module")
nn.Module = Module

function Module:__init()
  self._params = {}   -- ordered: {name=, param= [..] f32, grad= [..] f32, no_decay=}
  self._modules = {}  -- ordered: {name=, module=}
  self.training = true
end

--- m:register_parameter(name, tensor [, {no_decay = bool}]) -> its entry {name, param, grad, no_decay}
-- The gradient (f32, zeros, the parameter's shape) is allocated here. Both are the module's: taken
-- out of any open nv.scope, so a module built inside one keeps them.
function Module:register_parameter(name, t, opts)
  opts = check_opts(opts, {no_decay = true}, "register_parameter")
  if type(name) ~= "string" or name == "" or name:find(".", 1, true) then
    error("register_parameter: name must be a non-empty string without dots, got " .. tostring(name), 2)
  end
  if not nv.is_tensor(t) or t:dtype() ~= "f32" then
    error("register_parameter: '" .. name .. "' must be an f32 tensor", 2)
  end
  for _, e in ipairs(self._params) do
    if e.name == name then error("register_parameter: '" .. name .. "' is already registered", 2) end
  end
  for _, e in ipairs(self._modules) do
    if e.name == name then error("register_parameter: '" .. name .. "' is already a submodule", 2) end
  end
  local entry = {name = name, param = nv.unscope(t), grad = nv.unscope(nv.zeros(t:size())),
    no_decay = opts.no_decay == true, full_shape = made[t]} -- full_shape: made in rows (nn.build_rows)
  self._params[#self._params + 1] = entry
  return entry
end

--- m:register_module(name, module) -> module
function Module:register_module(name, m)
  if type(name) ~= "string" or name == "" or name:find(".", 1, true) then
    error("register_module: name must be a non-empty string without dots, got " .. tostring(name), 2)
  end
  if not nn.is_instance(m, Module) then error("register_module: '" .. name .. "' is not an nn.Module", 2) end
  for _, e in ipairs(self._modules) do
    if e.name == name then error("register_module: '" .. name .. "' is already registered", 2) end
  end
  for _, e in ipairs(self._params) do
    if e.name == name then error("register_module: '" .. name .. "' is already a parameter", 2) end
  end
  self._modules[#self._modules + 1] = {name = name, module = m}
  return m
end

-- Visit (full name, entry) of every parameter, depth first in registration order; a tensor
-- registered twice (shared) is visited once.
local function each_entry(m, prefix, fn, seen)
  for _, e in ipairs(m._params) do
    if not seen[e.param] then
      seen[e.param] = true
      fn(prefix .. e.name, e)
    end
  end
  for _, c in ipairs(m._modules) do each_entry(c.module, prefix .. c.name .. ".", fn, seen) end
end

--- m:named_parameters([prefix]) -> ordered array of {name = full dotted name, param, grad, no_decay}
function Module:named_parameters(prefix)
  local out = {}
  each_entry(self, prefix and prefix ~= "" and prefix .. "." or "", function(name, e)
    out[#out + 1] = {name = name, param = e.param, grad = e.grad, no_decay = e.no_decay}
  end, {})
  return out
end

--- m:parameters() -> ordered array of parameter tensors
function Module:parameters()
  local out = {}
  for _, p in ipairs(self:named_parameters()) do out[#out + 1] = p.param end
  return out
end

--- m:named_modules([prefix]) -> ordered array of {name =, module =}, m itself first (name prefix or "")
function Module:named_modules(prefix)
  local out = {}
  local function walk(m, name)
    out[#out + 1] = {name = name, module = m}
    for _, c in ipairs(m._modules) do walk(c.module, name == "" and c.name or name .. "." .. c.name) end
  end
  walk(self, prefix or "")
  return out
end

--- m:modules() -> ordered array of all modules, m first
function Module:modules()
  local out = {}
  for _, e in ipairs(self:named_modules()) do out[#out + 1] = e.module end
  return out
end

--- m:child(name) -> the registered submodule called name (or nil)
function Module:child(name)
  for _, e in ipairs(self._modules) do if e.name == name then return e.module end end
end

--- m:zero_grad(): every parameter gradient = 0
function Module:zero_grad()
  each_entry(self, "", function(_, e) e.grad:zero_() end, {})
  return self
end

-- device is "cpu", or "cuda" with a GPU present; anything else raises a message naming fname.
local function check_device(device, fname)
  if device ~= "cpu" and device ~= "cuda" then
    user_error(string.format("%s: invalid device '%s' (valid: cpu, cuda)", fname, tostring(device)), 3)
  end
  if device == "cuda" and not nv.cuda.available() then
    user_error(string.format("%s: device 'cuda' is not available here (%s)", fname, nv.cuda.unavailable_reason()), 3)
  end
end
nn.check_device = check_device

-- t on device: t itself, or a copy there with t freed
local function moved(t, device)
  if t:device() == device then return t end
  local d = t:to(device)
  t:free()
  return d
end

-- Move m's parameters (and, with grads, their gradients) and RoPE tables to a checked device.
local function move_to(m, device, grads)
  each_entry(m, "", function(_, e)
    e.param = nv.unscope(moved(e.param, device))
    if grads then e.grad = nv.unscope(moved(e.grad, device)) end
  end, {})
  for _, sub in ipairs(m:modules()) do
    if sub.rope then sub.rope:to(device) end
  end
  m.device = device
end

--- m:to(device) -> m: every parameter and its gradient moved to "cpu" or "cuda" (values copied
-- exactly), and the RoPE tables with them; the layers then run on that device, since each op
-- runs where its tensors are. Call it between steps (nothing saved for a backward is moved).
function Module:to(device)
  check_device(device, "Module:to")
  move_to(self, device, true)
  return self
end

--- m:train([mode = true]) / m:eval(): set training mode on m and every submodule
function Module:train(mode)
  if mode == nil then mode = true end
  for _, m in ipairs(self:modules()) do m.training = mode and true or false end
  return self
end

function Module:eval() return self:train(false) end

--- m:num_parameters() -> total number of parameter elements (a shared tensor counted once)
function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:named_parameters()) do n = n + p.param:numel() end
  return n
end

--- nn.check_recipe(r [, fname]) -> what set_recipe takes for r: a recipe value (nvlua.recipe, or a
-- table with linear_forward and linear_backward methods) as it is, the name of a registered recipe
-- (recipe.names()) as recipe.make(name), nil as nil (the default recipe). Anything else is a user
-- error naming fname ("set_recipe") and the value, raised at the caller's caller.
function nn.check_recipe(r, fname)
  fname = fname or "set_recipe"
  if r == nil then return nil end
  local recipe = require "nvlua.recipe"
  if type(r) == "string" then
    local names = recipe.names()
    for _, n in ipairs(names) do if n == r then return recipe.make(r) end end
    util.user_error(string.format("%s: unknown recipe '%s' (valid: %s, or a recipe value)%s", fname, r,
      table.concat(names, ", "), util.suggest(r, names)), 3)
  end
  if type(r) ~= "table" or type(r.linear_forward) ~= "function" or type(r.linear_backward) ~= "function" then
    util.user_error(string.format("%s: the recipe must be a recipe value (nvlua.recipe) or the name of one, got %s",
      fname, type(r) == "table" and "a table without linear_forward/linear_backward" or tostring(r)), 3)
  end
  return r
end

--- m:set_recipe(r): every Linear under m computes its GEMMs with recipe r, and every Embedding
-- under m returns activations of r's act_dtype (NUMERICS §11); the other layers follow the
-- dtype of what they are given. r: a recipe value or a registered recipe's name (nn.check_recipe);
-- nil puts back the default (recipe.f32()).
function Module:set_recipe(r)
  r = nn.check_recipe(r, "set_recipe")
  for _, m in ipairs(self:modules()) do
    if nn.is_instance(m, nn.Linear) then m.recipe = r end
    if nn.is_instance(m, nn.Embedding) then m.recipe = r end
  end
  return self
end

--- m:set_names([prefix]): each module's .name = its full dotted path under m (the names Linear
-- hands its recipe); called by the model constructors.
function Module:set_names(prefix)
  for _, e in ipairs(self:named_modules(prefix)) do
    if e.name ~= "" then e.module.name = e.name end
  end
  return self
end

--- m:state_dict() -> {name = parameter tensor} (the live tensors, not copies)
function Module:state_dict()
  local d = {}
  for _, p in ipairs(self:named_parameters()) do d[p.name] = p.param end
  return d
end

-- The one dtype conversion load_state_dict makes: between the float dtypes (a bf16 Hugging Face
-- checkpoint into f32 parameters, or back), as :copy_ converts. Any other dtype must match
-- the parameter's exactly: an i32 tensor has the bytes of an f32 one but not its values.
local FLOAT_DTYPES = {f32 = true, bf16 = true}

--- m:load_state_dict(dict [, {strict = true}]) -> {missing = {...}, unexpected = {...}}
--- Copies each tensor into the parameter of that name. Its dtype must be the parameter's, or
--- both must be float dtypes (f32, bf16: converted as :copy_ converts); shape and dtype
--- mismatches always raise; missing or unexpected names raise when strict. Nothing is copied
--- unless every check passes.
function Module:load_state_dict(dict, opts)
  opts = check_opts(opts, {strict = true}, "load_state_dict")
  local strict = opts.strict ~= false
  if type(dict) ~= "table" then error("load_state_dict: expected a table {name = tensor}, got " .. type(dict), 2) end
  local params = self:named_parameters()
  local known = {}
  local missing, mismatched, wrong_dtype, unexpected, bad = {}, {}, {}, {}, {}
  for _, p in ipairs(params) do
    known[p.name] = true
    local t = dict[p.name]
    if t == nil then
      missing[#missing + 1] = p.name
    elseif not nv.is_tensor(t) then
      bad[#bad + 1] = p.name .. " (" .. type(t) .. ")"
    else
      if not same_shape(t:size(), p.param:size()) then
        mismatched[#mismatched + 1] = string.format("%s: expected %s, got %s", p.name, shape_str(p.param), shape_str(t))
      end
      local want, got = p.param:dtype(), t:dtype()
      if want ~= got and not (FLOAT_DTYPES[want] and FLOAT_DTYPES[got]) then
        wrong_dtype[#wrong_dtype + 1] = string.format("%s: expected %s, got %s", p.name, want, got)
      end
    end
  end
  for k in pairs(dict) do if not known[k] then unexpected[#unexpected + 1] = tostring(k) end end
  table.sort(unexpected)
  local problems = {}
  if #bad > 0 then problems[#problems + 1] = "not tensors: " .. table.concat(bad, ", ") end
  if #mismatched > 0 then problems[#problems + 1] = "shape mismatch: " .. table.concat(mismatched, "; ") end
  if #wrong_dtype > 0 then problems[#problems + 1] = "dtype mismatch: " .. table.concat(wrong_dtype, "; ") end
  if strict and #missing > 0 then problems[#problems + 1] = "missing keys: " .. table.concat(missing, ", ") end
  if strict and #unexpected > 0 then problems[#problems + 1] = "unexpected keys: " .. table.concat(unexpected, ", ") end
  if #problems > 0 then error("load_state_dict: " .. table.concat(problems, "; "), 2) end
  for _, p in ipairs(params) do
    local t = dict[p.name]
    if t ~= nil then p.param:copy_(t) end
  end
  return {missing = missing, unexpected = unexpected}
end

function Module:forward() error(self.class_name .. ":forward is not implemented", 2) end
function Module:backward() error(self.class_name .. ":backward is not implemented", 2) end

function Module:extra_repr() return "" end

function Module:__tostring()
  local lines = {}
  local function walk(m, name, indent)
    local head = indent .. (name and ("(" .. name .. "): ") or "") .. m.class_name .. "(" .. m:extra_repr() .. ")"
    lines[#lines + 1] = head
    for _, c in ipairs(m._modules) do walk(c.module, c.name, indent .. "  ") end
  end
  walk(self, nil, "")
  return table.concat(lines, "\n")
end

--- nn.ModuleList(): numbered submodules "0", "1", ... (Hugging Face's layers.{i})
local ModuleList = nn.class("ModuleList", Module)
nn.ModuleList = ModuleList

function ModuleList:__init(mods)
  Module.__init(self)
  self.n = 0
  for _, m in ipairs(mods or {}) do self:append(m) end
end

function ModuleList:append(m)
  self:register_module(tostring(self.n), m)
  self.n = self.n + 1
  self[self.n] = m -- 1-based array access for Lua loops; registration is what names it
  return m
end

function ModuleList:__len() return self.n end

-- ---- recipes ------------------------------------------------------------------------------------

--- nn.default_recipe(): the recipe Linear uses when none was set (recipe.f32())
function nn.default_recipe()
  if not nn._default_recipe then
    local ok, recipe = pcall(require, "nvlua.recipe")
    if not ok then error("nn: no recipe given and nvlua.recipe cannot be loaded: " .. tostring(recipe), 3) end
    nn._default_recipe = recipe.f32()
  end
  return nn._default_recipe
end

-- drop a recipe's saved state (a forward ran twice without a backward)
local function release_saved(recipe, saved)
  if saved ~= nil and type(recipe.release) == "function" then recipe:release(saved) end
end

-- forget what an earlier forward of m saved for a backward that never ran: the tensors of
-- m._saved (the module's own, one level deep) are freed now, before the new forward allocates
local function drop_saved(m)
  local s = m._saved
  m._saved = nil
  if type(s) == "table" then
    for _, v in pairs(s) do if nv.is_tensor(v) then v:free() end end
  end
end

-- the state m's forward saved for its backward, taken from m; raises without one
local function take_saved(m, what)
  local s = m._saved
  if not s then error(what .. ":backward without a forward in training mode", 3) end
  m._saved = nil
  return s
end

-- ---- Linear -------------------------------------------------------------------------------------

--- nn.Linear(in_features, out_features [, opts]): y = x W^T, W [out, in] f32, no bias.
-- opts: name (Hugging Face module name, passed to the recipe), block (0-based block index),
-- num_blocks, high_precision, recipe, generator, std (init, default 0.02), tie (a parameter
-- entry {param, grad} of shape [out, in] to share instead of owning a weight: tied embeddings).
-- The three GEMMs are the recipe's: recipe:linear_forward / recipe:linear_backward. What
-- linear_forward makes runs in Linear's scope: the tensors directly in its saved table are kept
-- for backward (unscoped; linear_backward or recipe:release frees them), anything else dies with
-- the forward.
local Linear = nn.class("Linear", Module)
nn.Linear = Linear

-- Checkers for util.check_opts: the init std is a finite number >= 0 (0: zeros), an eps finite > 0.
local function is_std(v)
  if type(v) ~= "number" or not (v >= 0 and v < math.huge) then return "must be a finite number >= 0" end
end
local function is_eps(v)
  if type(v) ~= "number" or not (v > 0 and v < math.huge) then return "must be a finite number > 0" end
end

local LINEAR_OPTS = {name = true, block = true, num_blocks = true, high_precision = true, recipe = true,
  generator = true, std = is_std, tie = true}

function Linear:__init(in_features, out_features, opts)
  Module.__init(self)
  opts = check_opts(opts, LINEAR_OPTS, "Linear")
  check_int(in_features, "in_features", "Linear")
  check_int(out_features, "out_features", "Linear")
  self.in_features, self.out_features = in_features, out_features
  self.name = opts.name
  self.block = opts.block
  self.num_blocks = opts.num_blocks
  self.high_precision = opts.high_precision == true
  self.recipe = opts.recipe
  self.step = 0
  if opts.tie then
    local p = opts.tie.param
    if not (nv.is_tensor(p) and same_shape(p:size(), {out_features, in_features})) then
      user_error(string.format("Linear: tied weight must be [%d,%d], got %s", out_features, in_features,
        nv.is_tensor(p) and shape_str(p) or type(p)), 2)
    end
    self.weight_entry = opts.tie
    self.tied = true
  else
    self.weight_entry = self:register_parameter("weight", normal({out_features, in_features}, opts.std or 0.02,
      opts.generator))
  end
end

function Linear:extra_repr()
  return string.format("%d -> %d%s", self.in_features, self.out_features, self.tied and ", tied" or "")
end

--- the context the recipe sees (NUMERICS §6 choices are made per name / block / step; recompute_input:
-- see Linear:restore_input; group: see nn.fuse)
function Linear:context()
  local f, group = self.fused, nil
  if f then -- made once per name (names are given after construction: set_names)
    group = self.fused_group
    if not group or group.of ~= self.name then
      group = {name = ((self.name or "linear"):gsub("[^.]+$", f.as, 1)), id = f, part = self.fused_part, weights = f.weights,
        of = self.name}
      self.fused_group = group
    end
  end
  return {name = self.name or "linear", block = self.block, num_blocks = self.num_blocks,
    high_precision = self.high_precision, step = self.step or 0, recompute_input = self.recompute_input or nil,
    group = group}
end

--- nn.fuse(linears, as): the Linears given (which read one input) are the parts of one fused linear,
-- as Megatron trains them (linear_qkv, linear_fc1: one weight) and inference engines load them
-- (vLLM's qkv_proj, gate_up_proj). Each part's context (Linear:context) then carries group =
-- {name = the part's name with its last component replaced by `as`, id = one table for the group,
-- part = its index, weights = fn() -> the parts' weights now, in order}; a recipe with fused_amax
-- scales the parts' weights by the group's amax (nvlua.recipe). The layers still compute apart.
function nn.fuse(linears, as)
  local f = {as = as}
  function f.weights()
    local w = {}
    for i, m in ipairs(linears) do w[i] = m.weight_entry.param end
    return w
  end
  for i, m in ipairs(linears) do m.fused, m.fused_part = f, i end
end

-- forget the state saved by a forward that had no backward
function Linear:_drop()
  if self._saved then release_saved(self._saved.recipe, self._saved.saved) end
  drop_saved(self)
end

--- y (..., out) = x (..., in) W^T
function Linear:forward(x)
  local shape = x:size()
  local K = shape[#shape]
  if #shape < 2 or K ~= self.in_features then
    user_error(string.format("Linear(%s): input %s %s, expected [..., %d]", self.name or "", shape_str(shape), x:dtype(),
      self.in_features), 2)
  end
  self:_drop()
  local r = self.recipe or nn.default_recipe()
  local ctx = self:context()
  return nv.scope(function()
    local x2 = x:reshape(x:numel() // K, K)                           -- (N, in), our own handle
    local y, saved = r:linear_forward(ctx, x2, self.weight_entry.param, not self.training) -- (N, out)
    if self.training then -- in eval the scope frees x2 and what the recipe saved
      -- x2 is kept only when the recipe kept it (not when it kept x's quantized wgrad copy instead);
      -- with recompute_input not even then: the scope frees it, restore_input gives it back
      local keep = saved.x and x2 or nil
      local dropped = keep ~= nil and self.recompute_input
      if dropped then saved.x, keep = nil, nil end
      self._saved = nv.unscope({saved = nv.unscope(saved), x = keep, ctx = ctx, recipe = r, shape = shape,
        needs_input = dropped or nil})
    end
    if #shape == 2 then return y end
    local oshape = {table.unpack(shape)}
    oshape[#oshape] = self.out_features
    return y:view(oshape)                                             -- (..., out)
  end)
end

--- m.recompute_input = true (selective activation recompute, set by llama.Block:set_recompute): a
-- training forward keeps neither its input x nor a quantized copy of it (the recipe makes none:
-- ctx.recompute_input); before the backward, m:restore_input(x) gives it back — the same bits,
-- recomputed by the caller. m:needs_input() -> true between such a forward and its restore_input.
function Linear:needs_input() return self._saved ~= nil and self._saved.needs_input == true end

--- m:restore_input(x): x (..., in), the input of the last training forward again (see recompute_input);
-- m keeps its own handle of it until its backward, the caller's handle is the caller's
function Linear:restore_input(x)
  if not self:needs_input() then
    error(string.format("Linear(%s):restore_input: the layer is not waiting for its input (recompute_input not " ..
      "set, or no training forward since its last backward)", self.name or ""), 2)
  end
  local s = self._saved
  local n = 1
  for _, d in ipairs(s.shape) do n = n * d end
  if not (nv.is_tensor(x) and x:numel() == n and x:size(x:dim()) == self.in_features) then
    error(string.format("Linear(%s):restore_input: expected the forward's input %s, got %s", self.name or "",
      shape_str(s.shape), nv.is_tensor(x) and shape_str(x) or type(x)), 2)
  end
  local x2 = nv.unscope(x:reshape(x:numel() // self.in_features, self.in_features)) -- (N, in), our own handle
  s.x, s.saved.x, s.needs_input = x2, x2, nil
end

--- dx (..., in) = dy W; dW += dy^T x
function Linear:backward(dy)
  local what = "Linear(" .. (self.name or "") .. ")"
  if self:needs_input() then
    error(what .. ":backward: its input was not kept (recompute_input); give it back with restore_input first", 2)
  end
  local s = take_saved(self, what)
  return nv.scope(function()
    nv.adopt(s.x) -- what the recipe saved is the recipe's to free (linear_backward)
    local dy2 = dy:reshape(dy:numel() // self.out_features, self.out_features)          -- (N, out)
    local dx = s.recipe:linear_backward(s.ctx, dy2, s.saved, self.weight_entry.grad) -- (N, in)
    return #s.shape == 2 and dx or dx:view(s.shape)                                  -- (..., in)
  end)
end

-- ---- Embedding ----------------------------------------------------------------------------------

--- nn.Embedding(num_embeddings, dim [, {generator=, std=0.02, recipe=}]): out (..., C) = weight[ids];
-- the recipe (m:set_recipe) only gives the output's dtype, its act_dtype
local Embedding = nn.class("Embedding", Module)
nn.Embedding = Embedding

function Embedding:__init(num, dim, opts)
  Module.__init(self)
  opts = check_opts(opts, {generator = true, std = is_std, name = true, recipe = true}, "Embedding")
  check_int(num, "num_embeddings", "Embedding")
  check_int(dim, "embedding_dim", "Embedding")
  self.num_embeddings, self.dim = num, dim
  self.name = opts.name
  self.recipe = opts.recipe
  self.weight_entry = self:register_parameter("weight", normal({num, dim}, opts.std or 0.02, opts.generator),
    {no_decay = true})
end

function Embedding:extra_repr() return self.num_embeddings .. ", " .. self.dim end

--- ids (...) i64 -> out (..., C), f32, or bf16 under a recipe (m:set_recipe) whose act_dtype is
--- bf16. The ids have no gradient.
function Embedding:forward(ids)
  if not nv.is_tensor(ids) or ids:dtype() ~= "i64" then
    error("Embedding:forward: ids must be an i64 tensor, got " .. (nv.is_tensor(ids) and ids:dtype() or type(ids)), 2)
  end
  local shape = ids:size()
  drop_saved(self)
  return nv.scope(function()
    local flat = ids:reshape(ids:numel())                             -- (N), our own handle
    local act = self.recipe and self.recipe.act_dtype or "f32"
    local out = core.embedding_forward(flat, self.weight_entry.param, act) -- (N, C)
    if self.training then self._saved = nv.unscope({ids = flat}) end
    shape[#shape + 1] = self.dim
    return out:view(shape)                                            -- (..., C)
  end)
end

--- weight.grad += scatter(dout); returns nil (ids are not differentiable)
function Embedding:backward(dout)
  local s = take_saved(self, "Embedding")
  nv.scope(function()
    nv.adopt(s.ids)
    core.embedding_backward(self.weight_entry.grad, dout:reshape(s.ids:numel(), self.dim), s.ids) -- dout as (N, C)
  end)
  return nil
end

-- ---- RMSNorm ------------------------------------------------------------------------------------

--- nn.RMSNorm(dim [, {eps = 1e-6}]): out = x / sqrt(mean(x^2) + eps) * weight; weight = ones
local RMSNorm = nn.class("RMSNorm", Module)
nn.RMSNorm = RMSNorm

function RMSNorm:__init(dim, opts)
  Module.__init(self)
  opts = check_opts(opts, {eps = is_eps, name = true}, "RMSNorm")
  check_int(dim, "dim", "RMSNorm")
  self.dim = dim
  self.eps = opts.eps or 1e-6
  self.name = opts.name
  self.weight_entry = self:register_parameter("weight", make_param({dim}, function(t) if t then t:fill_(1) end end),
    {no_decay = true})
end

function RMSNorm:extra_repr() return string.format("%d, eps=%g", self.dim, self.eps) end

function RMSNorm:forward(x)
  local shape = x:size()
  if shape[#shape] ~= self.dim then
    user_error(string.format("RMSNorm: input %s, expected [..., %d]", shape_str(shape), self.dim), 2)
  end
  drop_saved(self)
  return nv.scope(function()
    local x2 = x:reshape(x:numel() // self.dim, self.dim)                          -- (N, C), our own handle
    -- on a device with bf16 activations the kernel also gives max |out| (the next linear's
    -- quantization takes it: recipe.note_amax)
    local fused = fused_amax(x2)
    local out, rstd, amax = core.rmsnorm_forward(x2, self.weight_entry.param, self.eps, fused) -- (N, C), (N)
    if amax then note_amax(out, amax) end
    if self.training then self._saved = nv.unscope({x = x2, rstd = rstd, shape = shape}) end
    return #shape == 2 and out or out:view(shape)
  end)
end

--- m:recompute() -> out: the output of the last training forward again, the same bits, from the
-- input it keeps for its backward (selective activation recompute: llama.Block); m's saved state
-- stays for the backward. No amax is noted (recipe.note_amax): the output feeds no forward GEMM now.
function RMSNorm:recompute()
  local s = self._saved
  if not s then error("RMSNorm:recompute without a training forward awaiting its backward", 2) end
  return nv.scope(function()
    local out = core.rmsnorm_forward(s.x, self.weight_entry.param, self.eps, false) -- (N, C); its rstd dies here
    return #s.shape == 2 and out or out:view(s.shape)
  end)
end

function RMSNorm:backward(dout)
  local s = take_saved(self, "RMSNorm")
  return nv.scope(function()
    nv.adopt(s.x, s.rstd)
    local d2 = dout:reshape(dout:numel() // self.dim, self.dim)                      -- (N, C)
    local dx = core.rmsnorm_backward(self.weight_entry.grad, d2, s.x, self.weight_entry.param, s.rstd) -- (N, C)
    return #s.shape == 2 and dx or dx:view(s.shape)
  end)
end

-- ---- configuration (Hugging Face LlamaConfig keys and defaults) ----------------------------------

-- The keys nn.Llama understands, with Hugging Face's LlamaConfig defaults — except the five sizes
-- (SIZE_KEYS), which must be given: LlamaConfig defaults them to a 6.7B model (vocab 32000, hidden
-- 4096, FFN 11008, 32 layers, 32 heads), which a config that forgot them would silently build.
-- head_dim defaults to hidden_size / num_attention_heads and num_key_value_heads to
-- num_attention_heads.
local NONE = {} -- no default value
local SIZE_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}
nn.LLAMA_SIZE_KEYS = SIZE_KEYS
local CONFIG_DEFAULTS = {
  vocab_size = NONE, hidden_size = NONE, intermediate_size = NONE, num_hidden_layers = NONE,
  num_attention_heads = NONE, num_key_value_heads = NONE, head_dim = NONE, rope_theta = NONE,
  rope_scaling = NONE, rope_parameters = NONE, rms_norm_eps = 1e-6, max_position_embeddings = 2048,
  tie_word_embeddings = false, initializer_range = 0.02,
}
-- Keys of a Hugging Face config.json that are accepted when they describe what nvlua computes
-- (checked), or that carry no arithmetic (ignored: kept as given). pretraining_tp is ignored:
-- transformers' Llama (4.57, 5.x) no longer reads it (older versions split the GEMMs by it: the
-- same sums in another order).
local CONFIG_CHECKED = {
  hidden_act = "silu", attention_bias = false, mlp_bias = false, attention_dropout = 0, model_type = "llama",
  partial_rotary_factor = 1,
}
local CONFIG_IGNORED = {
  architectures = true, torch_dtype = true, dtype = true, bos_token_id = true, eos_token_id = true,
  pad_token_id = true, use_cache = true, transformers_version = true, pretraining_tp = true,
}

-- RoPE (Hugging Face modeling_rope_utils.py): the rope types nvlua computes and the keys of
-- rope_parameters / rope_scaling each one reads (required, except a llama3
-- original_max_position_embeddings, which defaults to max_position_embeddings as in transformers 5).
local ROPE_TYPES = {
  default = {},
  linear = {"factor"},
  dynamic = {"factor"},
  llama3 = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
-- The other keys of transformers' RopeParameters: ignored by these types (as transformers ignores
-- them), except partial_rotary_factor, which must be 1 (nvlua rotates the whole head).
local ROPE_OTHER_KEYS = {rope_type = true, type = true, rope_theta = true, partial_rotary_factor = true,
  factor = true, low_freq_factor = true, high_freq_factor = true, original_max_position_embeddings = true,
  attention_factor = true, beta_fast = true, beta_slow = true, short_factor = true, long_factor = true,
  mscale = true, mscale_all_dim = true, truncate = true, mrope_section = true}
local ROPE_TYPE_NAMES = "default, linear, dynamic, llama3"

local function config_keys()
  local names = {}
  for k in pairs(CONFIG_DEFAULTS) do names[#names + 1] = k end
  for k in pairs(CONFIG_CHECKED) do names[#names + 1] = k end
  for k in pairs(CONFIG_IGNORED) do names[#names + 1] = k end
  table.sort(names)
  return names
end

--- nn.llama_config_key(k) -> true when nn.llama_config takes the key k
function nn.llama_config_key(k)
  return CONFIG_DEFAULTS[k] ~= nil or CONFIG_CHECKED[k] ~= nil or CONFIG_IGNORED[k] ~= nil
end

-- One rope description (what: "rope_scaling" or "rope_parameters") read as transformers reads it:
-- -> theta (nil: not given), the resolved scaling (nil: none) {rope_type =, the type's keys}.
local function read_rope(what, p, mpe)
  if type(p) ~= "table" then
    user_error(string.format("llama_config: %s must be a table or nil, got %s", what, type(p)), 0)
  end
  for k, v in pairs(p) do
    if not ROPE_OTHER_KEYS[k] then
      local nested = type(v) == "table" and " (rope parameters per layer type are not supported)" or ""
      user_error(string.format("llama_config: unknown %s key '%s'%s (valid: rope_type, rope_theta, %s)", what, tostring(k),
        nested, "factor, low_freq_factor, high_freq_factor, original_max_position_embeddings"), 0)
    end
  end
  local prf = p.partial_rotary_factor
  if prf ~= nil and prf ~= 1 then
    user_error(string.format("llama_config: %s.partial_rotary_factor = %s is not supported (nvlua rotates the whole " ..
      "head: 1)", what, tostring(prf)), 0)
  end
  local rtype = p.rope_type or p.type or "default"
  local keys = ROPE_TYPES[rtype]
  if not keys then
    user_error(string.format("llama_config: %s rope_type '%s' is not supported (nvlua computes %s)", what, tostring(rtype),
      ROPE_TYPE_NAMES), 0)
  end
  if rtype == "default" then return p.rope_theta, nil end
  local out = {rope_type = rtype}
  for _, k in ipairs(keys) do
    local v = p[k]
    if v == nil and k == "original_max_position_embeddings" then v = mpe end
    if type(v) ~= "number" or not (v > 0 and v < math.huge) then
      user_error(string.format("llama_config: %s.%s must be a number > 0 for rope_type '%s', got %s", what, k, rtype,
        tostring(v)), 0)
    end
    out[k] = k == "original_max_position_embeddings" and math.tointeger(v) or v
  end
  if rtype == "llama3" and not (out.high_freq_factor > out.low_freq_factor) then
    user_error(string.format("llama_config: %s.high_freq_factor (%s) must be greater than low_freq_factor (%s)", what,
      tostring(out.high_freq_factor), tostring(out.low_freq_factor)), 0)
  end
  return p.rope_theta, out
end

local function same_rope(t1, s1, t2, s2)
  if t1 ~= t2 or (s1 == nil) ~= (s2 == nil) then return false end
  for k, v in pairs(s1 or {}) do if s2[k] ~= v then return false end end
  return true
end

local function rope_text(theta, s)
  local parts = {"rope_theta " .. tostring(theta), "rope_type " .. (s and s.rope_type or "default")}
  for _, k in ipairs(s and ROPE_TYPES[s.rope_type] or {}) do parts[#parts + 1] = k .. " " .. tostring(s[k]) end
  return table.concat(parts, ", ")
end

-- c.rope_theta and c.rope_scaling resolved from the forms transformers reads: rope_parameters
-- (transformers 5: {rope_theta, rope_type, ...}) and the legacy top-level rope_theta and
-- rope_scaling ({rope_type | type, ...}, transformers 4). Where both forms are given they must
-- agree (transformers 4 reads only the legacy keys). c.rope_parameters is removed.
local function resolve_rope(c)
  local mpe = c.max_position_embeddings
  local rs = c.rope_scaling
  if type(rs) == "table" and next(rs) == nil then rs = nil end -- {}: none, as transformers 5 reads it
  local theta, scaling = c.rope_theta, nil
  if rs ~= nil then
    local t
    t, scaling = read_rope("rope_scaling", rs, mpe)
    if t ~= nil and t ~= (theta or 10000.0) then -- transformers 5 reads rope_scaling's, 4.x the top-level one
      user_error(string.format("llama_config: rope_scaling.rope_theta (%s) and rope_theta (%s) disagree; transformers 5 " ..
        "and 4 would compute different models", tostring(t), tostring(theta or 10000.0)), 0)
    end
  end
  if c.rope_parameters ~= nil then
    local t, s = read_rope("rope_parameters", c.rope_parameters, mpe)
    t = t or theta or 10000.0
    if (c.rope_theta ~= nil or rs ~= nil) and not same_rope(t, s, theta or 10000.0, scaling) then
      user_error(string.format("llama_config: rope_parameters (%s) and the legacy rope_theta/rope_scaling (%s) disagree; " ..
        "transformers 5 and 4 would compute different models", rope_text(t, s), rope_text(theta or 10000.0, scaling)),
        0)
    end
    theta, scaling = t, s
  end
  c.rope_theta, c.rope_scaling, c.rope_parameters = theta or 10000.0, scaling, nil
end

-- The integer keys of c (integral floats from JSON made integers), checked.
local function check_sizes(c)
  for _, k in ipairs({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "max_position_embeddings", "num_key_value_heads", "head_dim"}) do
    local v = c[k]
    if type(v) == "number" and v == math.floor(v) then c[k] = math.tointeger(v) end
    local optional = k == "num_key_value_heads" or k == "head_dim"
    if (v ~= nil or not optional) and (math.type(c[k]) ~= "integer" or c[k] < 1) then
      user_error(string.format("llama_config: %s must be an integer >= 1, got %s", k, tostring(v)), 0)
    end
  end
  c.num_key_value_heads = c.num_key_value_heads or c.num_attention_heads
  if c.num_attention_heads % c.num_key_value_heads ~= 0 then
    user_error(string.format("llama_config: num_attention_heads (%d) must be a multiple of num_key_value_heads (%d)",
      c.num_attention_heads, c.num_key_value_heads), 0)
  end
  if not c.head_dim then
    if c.hidden_size % c.num_attention_heads ~= 0 then
      user_error(string.format("llama_config: hidden_size (%d) is not divisible by num_attention_heads (%d); give head_dim",
        c.hidden_size, c.num_attention_heads), 0)
    end
    c.head_dim = c.hidden_size // c.num_attention_heads
  end
  if c.head_dim % 2 ~= 0 then user_error("llama_config: head_dim must be even for RoPE, got " .. c.head_dim, 0) end
end

--- nn.llama_config(cfg) -> a new, complete and checked config table (defaults filled in).
-- The sizes vocab_size, hidden_size, intermediate_size, num_hidden_layers and num_attention_heads
-- must be given (an error names the missing ones); the rest default as in Hugging Face's LlamaConfig.
-- Unknown keys raise an error listing the valid ones. RoPE: rope_theta and rope_scaling (nil, or
-- {rope_type = "llama3" | "linear" | "dynamic", and that type's keys}) resolved from either form of
-- a Hugging Face config (see resolve_rope); other rope types (yarn, longrope, ...) are refused.
function nn.llama_config(cfg)
  if type(cfg) ~= "table" then error("llama_config: config must be a table, got " .. type(cfg), 2) end
  if cfg._checked then return cfg end
  local missing = {}
  for _, k in ipairs(SIZE_KEYS) do if cfg[k] == nil then missing[#missing + 1] = k end end
  if #missing > 0 then
    user_error(string.format("llama_config: the config must give the model's sizes %s; missing: %s (nvlua does not " ..
      "take Hugging Face's defaults for them, a 6.7B model)", table.concat(SIZE_KEYS, ", "),
      table.concat(missing, ", ")), 2)
  end
  local c = {}
  for k, v in pairs(cfg) do
    if not nn.llama_config_key(k) then
      local names = config_keys()
      user_error(string.format("llama_config: unknown key '%s' (valid: %s)%s", tostring(k), table.concat(names, ", "),
        util.suggest(k, names)), 2)
    end
    if CONFIG_CHECKED[k] ~= nil and v ~= CONFIG_CHECKED[k] then
      user_error(string.format("llama_config: %s = %s is not supported (nvlua computes %s = %s)", k, tostring(v), k,
        tostring(CONFIG_CHECKED[k])), 2)
    end
    c[k] = v
  end
  for k, v in pairs(CONFIG_DEFAULTS) do if c[k] == nil and v ~= NONE then c[k] = v end end
  local ok, err = pcall(function()
    check_sizes(c)
    resolve_rope(c)
  end)
  if not ok then user_error(err, 2) end
  for _, k in ipairs({"rope_theta", "rms_norm_eps", "initializer_range"}) do -- NaN and inf too (JSON's NaN, 1e999)
    local v = c[k]
    if type(v) ~= "number" or not (v > 0 and v < math.huge) then
      user_error(string.format("llama_config: %s must be a finite number > 0, got %s", k, tostring(v)), 2)
    end
  end
  if type(c.tie_word_embeddings) ~= "boolean" then
    user_error("llama_config: tie_word_embeddings must be true or false, got " .. tostring(c.tie_word_embeddings), 2)
  end
  c._checked = true
  return c
end

-- ---- RoPE tables --------------------------------------------------------------------------------

--- nn.RopeCache(head_dim, theta [, scaling [, max_positions]]): cos/sin (T, D) tables, computed once
-- for the longest T asked for and shared by every attention layer of a model; :get(T) returns row
-- views. scaling: nn.llama_config's rope_scaling (nil: none); max_positions: max_position_embeddings,
-- which dynamic scaling needs (it is computed for T <= max_positions, the lengths nvlua runs).
local RopeCache = {}
RopeCache.__index = RopeCache
nn.RopeCache = function(head_dim, theta, scaling, max_positions)
  return setmetatable({head_dim = head_dim, theta = theta, scaling = scaling, max_positions = max_positions, T = 0,
    device = "cpu"}, RopeCache)
end

--- rope:to(device): keep the tables on "cpu" or "cuda" (computed on the CPU, copied exactly)
function RopeCache:to(device)
  if self.cos then self.cos, self.sin = nv.unscope(moved(self.cos, device), moved(self.sin, device)) end
  self.device = device
  return self
end

-- The tables are made on first use, inside a forward's scope: they are the cache's (unscoped).
function RopeCache:get(T)
  if T > self.T then
    if self.cos then self.cos:free(); self.sin:free() end
    local c, s = core.rope_tables(T, self.head_dim, self.theta, self.scaling, self.max_positions) -- (T, D) x2, cpu
    self.cos, self.sin = nv.unscope(moved(c, self.device), moved(s, self.device))
    self.T = T
  end
  if T == self.T then return self.cos, self.sin end
  return self.cos:narrow(1, 1, T), self.sin:narrow(1, 1, T)
end

--- rope:rows(p0, T) -> cos, sin (T, D): the rows of positions p0 .. p0 + T - 1 (a KV-cache step's); the
-- tables grow by doubling (to at most max_positions) so that one token at a time recomputes them
-- O(log T) times, not per token
function RopeCache:rows(p0, T)
  local need = p0 + T
  if need > self.T then self:get(math.max(need, math.min(2 * self.T, self.max_positions or math.huge))) end
  return self.cos:narrow(1, p0 + 1, T), self.sin:narrow(1, p0 + 1, T)
end

function RopeCache:free()
  if self.cos then self.cos:free(); self.sin:free() end
  self.cos, self.sin, self.T = nil, nil, 0
end

-- ---- Attention ----------------------------------------------------------------------------------

--- nn.Attention(config [, {rope = RopeCache, generator =}]): causal grouped-query self-attention
-- with RoPE; q/k/v/o_proj Linears; scale 1/sqrt(head_dim). x (B, T, C) -> y (B, T, C).
-- m:forward(x, kv) (eval mode) runs x as the positions kv.pos .. kv.pos + T - 1 after those in a key/value
-- cache, kv = {k =, v = (B, S, Hkv, D) f32, pos =} (llama.lua's KVCache): the RoPE'd keys and the values
-- of x are written to rows pos .. pos + T - 1 and the queries attend over rows 0 .. their own position.
-- At pos = 0 the attention is the training forward's own (core.attention_forward, whatever its route);
-- after it, core.attention_forward_at, fp32 math over the f32 cache (bf16 queries widened exactly,
-- the output rounded once: NUMERICS §11's reference rule).
local Attention = nn.class("Attention", Module)
nn.Attention = Attention

function Attention:__init(config, opts)
  Module.__init(self)
  local c = nn.llama_config(config)
  opts = check_opts(opts, {rope = true, generator = true, recipe = true}, "Attention")
  self.hidden, self.n_heads, self.n_kv_heads, self.head_dim = c.hidden_size, c.num_attention_heads,
    c.num_key_value_heads, c.head_dim
  self.max_positions = c.max_position_embeddings
  self.scale = 1 / math.sqrt(c.head_dim)
  self.rope = opts.rope or nn.RopeCache(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
  local C, Dq, Dkv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  local lo = {generator = opts.generator, std = c.initializer_range, recipe = opts.recipe}
  self.q_proj = self:register_module("q_proj", Linear(C, Dq, lo))
  self.k_proj = self:register_module("k_proj", Linear(C, Dkv, lo))
  self.v_proj = self:register_module("v_proj", Linear(C, Dkv, lo))
  self.o_proj = self:register_module("o_proj", Linear(Dq, C, lo))
  nn.fuse({self.q_proj, self.k_proj, self.v_proj}, "qkv_proj")
end

function Attention:extra_repr()
  return string.format("heads=%d, kv_heads=%d, head_dim=%d", self.n_heads, self.n_kv_heads, self.head_dim)
end

-- fn(...) with sibling linears quantizing their shared input once (recipe.share)
local function share(fn, ...) return require("nvlua.recipe").share(fn, ...) end

-- proj(x) as heads (B, T, H, D), rotated; the unrotated projection dies here
local function project_rotate(proj, x, H, D, cos, sin)
  return nv.scope(function()
    return core.rope_forward(proj:forward(x):view(x:size(1), x:size(2), H, D), cos, sin)
  end)
end

-- proj's input gradient (B, T, C) from dr (B, T, H, D), the gradient of its rotated output,
-- which is consumed: dr dies before proj's backward runs, the unrotated gradient right after it.
local function rotate_project_backward(proj, dr, cos, sin)
  local B, T, H, D = dr:size(1), dr:size(2), dr:size(3), dr:size(4)
  return nv.scope(function()
    local d = nv.scope(function()
      nv.adopt(dr)
      return core.rope_backward(dr, cos, sin):view(B, T, H * D)        -- (B, T, H*D)
    end)
    return proj:backward(d)                                            -- (B, T, C)
  end)
end

-- The forward over a key/value cache (see the class comment); x checked, eval mode.
local function forward_cached(self, x, kv)
  local B, T = x:size(1), x:size(2)
  local Hq, Hkv, D, p0 = self.n_heads, self.n_kv_heads, self.head_dim, kv.pos
  return nv.scope(function()
    local cos, sin = self.rope:rows(p0, T)                               -- (T, D)
    local q, k, v = share(function() -- one quantization of x for the three projections
      return project_rotate(self.q_proj, x, Hq, D, cos, sin),            -- (B, T, Hq, D)
        project_rotate(self.k_proj, x, Hkv, D, cos, sin),                -- (B, T, Hkv, D)
        self.v_proj:forward(x):view(B, T, Hkv, D)                        -- (B, T, Hkv, D)
    end)
    kv.k:narrow(2, p0 + 1, T):copy_(k)                                   -- f32 (B, T, Hkv, D) rows of the cache
    kv.v:narrow(2, p0 + 1, T):copy_(v)
    local out
    if p0 == 0 then
      out = core.attention_forward(q, k, v, self.scale)                  -- (B, T, Hq, D)
    else
      local qf = q:dtype() == "f32" and q or q:to("f32")
      out = core.attention_forward_at(qf, kv.k, kv.v, p0, self.scale)    -- (B, T, Hq, D) f32
      if out:dtype() ~= q:dtype() then out = out:to(q:dtype()) end
    end
    return self.o_proj:forward(out:view(B, T, Hq * D))                   -- (B, T, C)
  end)
end

function Attention:forward(x, kv)
  if x:dim() ~= 3 or x:size(3) ~= self.hidden then
    user_error(string.format("Attention: input %s, expected [B, T, %d]", shape_str(x), self.hidden), 2)
  end
  if kv then
    if self.training then error("Attention:forward: a key/value cache is for eval mode (call model:eval())", 2) end
    drop_saved(self)
    return forward_cached(self, x, kv)
  end
  local B, T = x:size(1), x:size(2)
  if T > self.max_positions then
    user_error(string.format("Attention: sequence length %d exceeds max_position_embeddings %d", T, self.max_positions), 2)
  end
  local Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
  drop_saved(self)
  return nv.scope(function()
    local cos, sin = self.rope:get(T)                                    -- (T, D)
    local q, k, v = share(function() -- one quantization of x for the three projections
      return project_rotate(self.q_proj, x, Hq, D, cos, sin),            -- (B, T, Hq, D)
        project_rotate(self.k_proj, x, Hkv, D, cos, sin),                -- (B, T, Hkv, D)
        self.v_proj:forward(x):view(B, T, Hkv, D)                        -- (B, T, Hkv, D)
    end)
    local out, lse = core.attention_forward(q, k, v, self.scale)        -- (B, T, Hq, D), (B, Hq, T)
    local y = self.o_proj:forward(out:view(B, T, Hq * D))                -- (B, T, C)
    if self.training then self._saved = nv.unscope({q = q, k = k, v = v, out = out, lse = lse, T = T}) end
    return y
  end)
end

--- m:restore_input(x): the forward's input x (B, T, C) again, for q/k/v projections that did not keep
-- it (their recompute_input: selective recompute, llama.Block); each keeps its own handle
function Attention:restore_input(x)
  for _, p in ipairs({self.q_proj, self.k_proj, self.v_proj}) do p:restore_input(x) end
end

function Attention:backward(dy)
  local s = take_saved(self, "Attention")
  local B, T = dy:size(1), dy:size(2)
  local Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
  return nv.scope(function()
    local cos, sin = self.rope:get(s.T)
    local dq, dk, dv = nv.scope(function() -- the saved activations and dout die at their last use
      nv.adopt(s)
      local dout = self.o_proj:backward(dy):view(B, T, Hq, D)           -- (B, T, Hq, D)
      return core.attention_backward(dout, s.q, s.k, s.v, s.out, s.lse, self.scale)
    end)                                                                 -- rotated: (B, T, Hq|Hkv|Hkv, D)
    return share(function() -- one quantization of x for the three wgrads
      local dx = rotate_project_backward(self.q_proj, dq, cos, sin)      -- (B, T, C)
      nv.scope(function() dx:add_(rotate_project_backward(self.k_proj, dk, cos, sin)) end)
      dx:add_(self.v_proj:backward(dv:view(B, T, Hkv * D)))
      return dx
    end)
  end)
end

-- ---- MLP ----------------------------------------------------------------------------------------

--- nn.MLP(config [, {generator =}]): down_proj(silu(gate_proj(x)) * up_proj(x)). x (..., C).
local MLP = nn.class("MLP", Module)
nn.MLP = MLP

function MLP:__init(config, opts)
  Module.__init(self)
  local c = nn.llama_config(config)
  opts = check_opts(opts, {generator = true, recipe = true}, "MLP")
  local C, F = c.hidden_size, c.intermediate_size
  self.hidden, self.ffn = C, F
  local lo = {generator = opts.generator, std = c.initializer_range, recipe = opts.recipe}
  self.gate_proj = self:register_module("gate_proj", Linear(C, F, lo))
  self.up_proj = self:register_module("up_proj", Linear(C, F, lo))
  self.down_proj = self:register_module("down_proj", Linear(F, C, lo))
  nn.fuse({self.gate_proj, self.up_proj}, "gate_up_proj")
end

function MLP:extra_repr() return string.format("%d -> %d -> %d", self.hidden, self.ffn, self.hidden) end

function MLP:forward(x)
  local shape = x:size()
  if shape[#shape] ~= self.hidden then
    user_error(string.format("MLP: input %s, expected [..., %d]", shape_str(shape), self.hidden), 2)
  end
  drop_saved(self)
  return nv.scope(function()
    local x2 = x:reshape(x:numel() // self.hidden, self.hidden)        -- (N, C)
    local g, u = share(function() -- one quantization of x2 for both
      return self.gate_proj:forward(x2), self.up_proj:forward(x2)      -- (N, F), (N, F)
    end)
    local h, amax = core.swiglu_forward(g, u, fused_amax(g))            -- (N, F) (its amax: see RMSNorm)
    if amax then note_amax(h, amax) end
    local y = self.down_proj:forward(h)                                -- (N, C); down_proj keeps h (N, F)
    if self.training then self._saved = nv.unscope({g = g, u = u, shape = shape}) end
    return #shape == 2 and y or y:view(shape)
  end)
end

--- m:restore_input(x): the forward's input x (..., C) again, for gate and up projections that did not
-- keep it (their recompute_input: selective recompute, llama.Block); each keeps its own handle
function MLP:restore_input(x)
  self.gate_proj:restore_input(x)
  self.up_proj:restore_input(x)
end

function MLP:backward(dy)
  local s = take_saved(self, "MLP")
  return nv.scope(function()
    local dg, du = nv.scope(function() -- g, u and dh die once SwiGLU's backward has read them
      nv.adopt(s)
      if self.down_proj:needs_input() then -- selective recompute: SwiGLU's product again, from g and u
        nv.scope(function() self.down_proj:restore_input(core.swiglu_forward(s.g, s.u, false)) end) -- (N, F)
      end
      local dh = self.down_proj:backward(dy:reshape(dy:numel() // self.hidden, self.hidden)) -- (N, F)
      return core.swiglu_backward(dh, s.g, s.u)                       -- (N, F), (N, F)
    end)
    local dx = share(function() -- one quantization of x for both wgrads
      local d = nv.scope(function() -- dg dies before up_proj's backward runs
        nv.adopt(dg)
        return self.gate_proj:backward(dg)                             -- (N, C)
      end)
      d:add_(self.up_proj:backward(du))
      return d
    end)
    return #s.shape == 2 and dx or dx:view(s.shape)
  end)
end

-- ---- for model files (lua/nvlua/llama.lua) -----------------------------------------------------

--- nn.each_entry(m, fn): fn(full name, entry) for each of m's parameter entries, the live
-- {name, param, grad, no_decay} tables (fn may replace entry.grad), depth first in registration
-- order, a shared tensor once.
function nn.each_entry(m, fn) each_entry(m, "", fn, {}) end

--- nn.move_to(m, device, grads): m's parameters (with grads, also their gradients) and RoPE
-- tables moved to device (already checked: nn.check_device), m.device set.
nn.move_to = move_to

--- nn.drop_saved(m): free the tensors of m._saved (one level deep) and forget it: what an earlier
-- forward saved for a backward that never ran. nn.take_saved(m, what) -> m._saved, taken for
-- m's backward (raises "<what>:backward without a forward in training mode" without one).
nn.drop_saved = drop_saved
nn.take_saved = take_saved

-- nn.Llama and nn.Block are nvlua.llama's, which requires this file: looked up on first use.
local FROM_LLAMA = {Llama = true, Block = true}
setmetatable(nn, {__index = function(t, k)
  if FROM_LLAMA[k] then
    local v = require("nvlua.llama")[k]
    rawset(t, k, v)
    return v
  end
end})

return nn
