-- nvlua.help: help() and help(x), the REPL's `help` (nv.help). help() prints an index of the API,
-- one line per area with where to look next. help(x) prints the documentation of x — a function,
-- a module, a class, a value with methods (a tensor, a recipe, a model) — read from the Lua
-- sources themselves: the comment block above a definition (`--- name(args) -> result: what`,
-- the convention of lua/nvlua), a module's leading comment block and its functions' first doc
-- lines. A C function has no source: its doc is the comment at the line of lua/nvlua that exports
-- it (`nv.scope = core.scope`), else help says so and where to look. help("train"),
-- help("nvlua.train"), help("nv.quantize") and help("recipe.custom") find x by name.
--   help.text(x) -> what help(x) prints
-- Not here: a script's keys (`nvlua script.lua --help`, nvlua.config), the REPL's printing of
-- values (nvlua.pretty).
local core = require "nvlua.core"
local pretty = require "nvlua.pretty"
local util = require "nvlua.util"

local M = {}

local INDEX = [[
nvlua %s - low-precision LLM training in Lua.   local nv = require "nvlua"
help(x) documents a function, module, class or value: help(nv.quantize)  help(nv.recipe)  help("train")

Tensors     nv.zeros(2,3) nv.ones nv.full nv.arange nv.rand nv.randn nv.tensor{{1,2}}; t:matmul(u) t:view()
            t:free(), nv.scope(fn) (frees what fn made)   help(nv.Tensor) help(nv.scope)
Types       dtypes %s;  formats %s
Formats     q = nv.quantize(x, "nvfp4", {block="2d", rht=true, sr=true})  nv.qmatmul(qa, qb)
            q:dequantize() (x's domain; {domain="rotated"}: the values an RHT operand's GEMM multiplies)
            nv.formats.nvfp4 (a format's traits)  nv.quant.report(x, {...})   help(nv.quantize) help(nv.quant)
Recipes     nv.recipe.nvfp4{} mxfp8 fp8_cs bf16 ...: a format per layer and GEMM   help(nv.recipe)
            per layer, your own: nv.recipe.custom(function(ctx) ... end)   help(nv.recipe.custom)
            recipe=<name> for your own: nv.recipe.register(name, ctor)   help(nv.recipe.register)
MoR         nv.mor.choose(x, {candidates = {"nvfp4", "e4m3"}}): formats chosen by measured error   help(nv.mor)
Models      nvlua.nn: Linear, RMSNorm, Attention, MLP (forward/backward); nvlua.llama: Llama 3
            help("nn") help("llama") help(model)
Generating  model:generate(nv.data.ByteTokenizer, "And ", {max_new_tokens = 40, temperature = 0.8})
            -> text, ids, why it stopped (a KV cache: model:kv_cache(), model:forward(ids, {cache =}))
Training    nvlua.train: train.main(defaults, arg) runs an experiment   help("train")   nvlua script.lua --help
            init=hf:<dir>|ckpt:<dir> starts from pretrained weights; nvlua.record: out/run.json   help("record")
Config      nvlua.config: an experiment's keys (types, ranges, docs), key=value arguments   help("config")
Optimizer   nvlua.optim: AdamW, clipping; nvlua.schedule: wsd, cosine, linear   help("optim") help("schedule")
Logging     nvlua.tensorboard: event files; nvlua.peak: the peak MFU is against; nvlua.plot: loss curves (PNG)
            help("tensorboard") help("peak")
Data        nvlua.data: KJV, text, token shards, Megatron; nvlua.tokenizer: tokenizer.json
            nv.tokenizer.load(path):encode(text) / :decode(ids)   help("data") help("tokenizer")
Evaluating  nvlua.eval: zero-shot tasks by log-likelihood (lm-eval's scoring, offline data)   help("eval")
            nv.eval.evaluate(model, tok, "arc_easy,piqa", {limit = 100}); scripts/eval.lua; eval_tasks= in training
Checkpoints nvlua.checkpoint: save, resume; nvlua.hf: Hugging Face model directories   help("checkpoint") help("hf")
Deploying   nvlua.deploy: NVFP4 / MXFP4 / FP8 checkpoints engines load, the trained codes   help("deploy")
            hf.save_pretrained(model, dir, {quantize = "nvfp4", calibration = batches}); scripts/export.lua
Scale-out   nvlua.dist: MPI / NCCL collectives; nvlua.shard: ZeRO-2/3; nvlua.plan: memory and FLOPs before a run
            help("dist") help("shard") help("plan")
Pruning     nv.prune: importance, width, depth (Minitron)   help(nv.prune)
Devices     nv.cuda.available() nv.cuda.devices(); t:cuda() t:cpu()   help(nv.cuda)
More        nvlua.safetensors nvlua.formats nvlua.stats nvlua.gradcheck nvlua.pretty nvlua.util
            nvlua.test, nvlua.help (help.text(x) returns what help(x) prints)
            nvlua.deploy_read: ModelOpt / compressed-tensors checkpoints, read by hf.from_pretrained
Info        nv.info()  nv.memory()  nv.clock()  nvlua -v
]]

local TENSOR = [[
Tensors (nvlua.Tensor): a C type; its methods are t:name(...).
Create      nv.zeros(2,3)  nv.ones({2,3}, "bf16")  nv.full({2,3}, 7)  nv.empty(4, {dtype="i32"})
            nv.arange(10)  nv.arange(0, 1, 0.25)  nv.tensor({{1,2},{3,4}})
            nv.rand(2,3)  nv.randn(8, {generator = nv.Generator(42)})  nv.manual_seed(42)
Inspect     t:size() t:size(1) t:dim() t:numel() t:dtype() t:device() t:stride() t[i] #t
            t:totable() t:get(i,j) t:set(i,j,v) t:item() print(t)
Views       t:view(2,-1) t:reshape(...) t:transpose(1,2) t:t() t:permute(2,1) t:narrow(1,2,3)
            t:select(1,2) t:expand(4,3) t:contiguous() t:clone() t:copy_(src)
Math        + - * / ^ with broadcasting and scalars (bf16 + f32 -> f32); t:exp() log sqrt abs neg pow
            maximum minimum t:sum() t:sum(2) mean max min amax (t:max(2) -> values, indices)
            t:eq(x) ne lt le gt ge (u8 masks)   a:allclose(b, rtol, atol)   t:to("bf16")
            a:matmul(b) (2-D and batched; one dtype: bf16 x f32 is an error, convert one)
Memory      t:free()   local t <close> = nv.zeros(n)   nv.scope(fn)  nv.keep(t)  nv.unscope(t)
Devices     t:cuda() t:cpu()
]]

local USAGE = 'help() lists the API; help(x) documents a function, module, class or value: help(nv.quantize), ' ..
  'help(nv.recipe), help("train")'

-- ---- reading the sources ------------------------------------------------------------------------

local lines_cache = {}

-- The lines of a file (cached), or nil when it cannot be read.
local function file_lines(path)
  if lines_cache[path] == nil then
    local f = io.open(path, "r")
    local lines = false
    if f then
      lines = {}
      for l in f:lines() do lines[#lines + 1] = l end
      f:close()
    end
    lines_cache[path] = lines
  end
  return lines_cache[path] or nil
end

local function is_comment(l) return l:match("^%s*%-%-") ~= nil end
local function is_separator(l) return l:match("^%s*%-%- %-%-%-%-") ~= nil end -- "-- ---- section ----"
local function uncomment(l) return (l:gsub("^%s*%-%-%-? ?", "")) end

-- The doc comment directly above line n: the comment lines touching it, from the first `---` line
-- among them (the whole block when none is), without the comment marks; nil when there are none.
local function doc_above(lines, n)
  local first = n
  while first > 1 and is_comment(lines[first - 1]) and not is_separator(lines[first - 1]) do first = first - 1 end
  if first == n then return nil end
  for i = first, n - 1 do
    if lines[i]:match("^%s*%-%-%-") then first = i; break end
  end
  local out = {}
  for i = first, n - 1 do out[#out + 1] = uncomment(lines[i]) end
  return out
end

-- The first doc line of the file that documents name: a `---` line starting with it (or naming it
-- as one of several: "--- nv.zeros / nv.ones(...)"), then its continuation lines.
local function doc_naming(lines, name)
  local pat = name:gsub("[%p]", "%%%0") .. "[%(:%s,]"
  for i, l in ipairs(lines) do
    local text = l:match("^%s*%-%-%-%s*(.*)$")
    if text and (text:find("^" .. pat) or text:find("^[%w_.:]+ / " .. pat)) then
      local out = {uncomment(l)}
      for j = i + 1, #lines do
        if not is_comment(lines[j]) or lines[j]:match("^%s*%-%-%-") or is_separator(lines[j]) then break end
        out[#out + 1] = uncomment(lines[j])
      end
      return out
    end
  end
end

-- The leading comment block of a file (a module's description).
local function header(lines)
  local out = {}
  for _, l in ipairs(lines) do
    if not is_comment(l) then break end
    out[#out + 1] = uncomment(l)
  end
  return out
end

-- ---- naming values ------------------------------------------------------------------------------

-- The nvlua modules loaded: {short name, table, package name}, "nv" (the nvlua table) first, nvlua.core last.
local function modules()
  local list, names = {}, {}
  for name, mod in pairs(package.loaded) do
    local short = type(name) == "string" and name:match("^nvlua%.(.+)$")
    if short and short ~= "core" and type(mod) == "table" then names[#names + 1] = short end
  end
  table.sort(names)
  list[1] = {"nv", require "nvlua", "nvlua"}
  for _, s in ipairs(names) do list[#list + 1] = {s, package.loaded["nvlua." .. s], "nvlua." .. s} end
  list[#list + 1] = {"core", core, "nvlua.core"}
  return list
end

local function is_name(k) return type(k) == "string" and k:match("^[%a_][%w_]*$") ~= nil end

-- Where values live: names[v] = {name = "nv.recipe.custom", module = the modules() entry of the
-- file that defines or exports it, key = "custom", package = "nvlua.recipe" for a module}. The
-- modules are walked breadth first, two tables deep, nv first, and nvlua.core after all of them,
-- so a value gets the shortest name people use: nv.scope, not core.scope; nn.Module, not
-- llama.Block.super.
local function index()
  local names, pkg = {}, {}
  local mods = modules()
  for _, m in ipairs(mods) do pkg[m[2]] = pkg[m[2]] or m end
  local function walk(queue)
    local i = 1
    while queue[i] do
      local t, prefix, mod, depth = table.unpack(queue[i])
      i = i + 1
      local keys = {}
      for k in pairs(t) do if is_name(k) and not k:match("^_") then keys[#keys + 1] = k end end
      table.sort(keys)
      for _, k in ipairs(keys) do
        local v = rawget(t, k)
        local tv = type(v)
        if (tv == "function" or tv == "table") and not names[v] then
          local vm = pkg[v] or mod -- a module reached from another (nv.recipe) is its own file's
          names[v] = {name = prefix .. "." .. k, module = vm, key = k, package = pkg[v] and pkg[v][3]}
          if tv == "table" and depth < 2 and v ~= core then
            queue[#queue + 1] = {v, prefix .. "." .. k, vm, depth + 1}
          end
        end
      end
    end
  end
  local queue = {}
  for _, m in ipairs(mods) do
    if m[2] ~= core and not names[m[2]] then
      names[m[2]] = {name = m[1], module = m, package = m[3]}
      queue[#queue + 1] = {m[2], m[1], m, 0}
    end
  end
  walk(queue)
  walk({{core, "core", pkg[core], 0}}) -- what no module exports
  return names
end

-- The source file of a module entry, or nil (a C module, nvlua.signal).
local function module_path(mod) return package.searchpath(mod[3], package.path) end

-- The path of a Lua function's source file, or nil for a C function or a chunk without a file.
local function source_of(f)
  local info = debug.getinfo(f, "S")
  if info.what == "C" then return nil end
  return info.source:match("^@(.*)$"), info.linedefined
end

-- Is line l where a file exports the C function core[cname]: "nv.scope = core.scope", "  memory =
-- core.cuda_memory," (a field of a table constructor)?
local function exports(l, cname) return l:find("^%s*[%w_.]+%s*=%s*core%." .. cname .. "%f[^%w_]") ~= nil end

-- The key of nvlua.core that holds f, or nil.
local function core_name(f)
  for k, v in pairs(core) do if v == f then return k end end
end

-- The doc lines of function f (nil: none found), and where it is defined ("path:line"). where:
-- its entry of index() (nil for a function no module holds).
local function function_doc(f, where)
  local name = where and where.name
  local path, line = source_of(f)
  if path then
    local lines = file_lines(path)
    local doc = lines and (doc_above(lines, line) or (name and doc_naming(lines, name)))
    return doc, string.format("%s:%d", path, line)
  end
  -- a C function: the comment at the line of its module's file that exports it
  local file = where and where.key and module_path(where.module)
  local lines = file and file_lines(file)
  if not lines then return nil end
  local cname = core_name(f)
  for n, l in ipairs(lines) do
    if cname and exports(l, cname) then
      local doc = doc_above(lines, n)
      local trailing = l:match("%-%-%s*(.*)$")
      return doc or (trailing and {trailing}) or doc_naming(lines, name), string.format("%s:%d", file, n)
    end
  end
  return doc_naming(lines, name)
end

-- The first doc line of f, for a list ("name(args) -> ...: what"), led by name if it does not say it.
local function summary(f, name, where)
  local doc = function_doc(f, where)
  if not doc or not doc[1] then return name end
  if doc[1]:find("^[%w_.:]*" .. name:match("[^.:]+$") .. "%f[^%w_]") then return doc[1] end
  return name .. ": " .. doc[1]
end

-- ---- what help(x) says --------------------------------------------------------------------------

local function index_text()
  local dtypes = {}
  for _, d in ipairs(core.dtypes()) do if not d.is_quantized then dtypes[#dtypes + 1] = d.name end end
  local formats = require("nvlua.formats").names
  return string.format(INDEX, core.version, table.concat(dtypes, " "), table.concat(formats, " "))
end

-- A class: a table that is its own __index (nn.class, a metatable of methods).
local function is_class(t) return type(t) == "table" and rawget(t, "__index") == t end

-- The functions of t (own keys, sorted; metamethods and _private ones left out) as summary lines,
-- and the first one's key.
local function function_lines(t, prefix, names, sep)
  local keys = {}
  for k, v in pairs(t) do
    if is_name(k) and type(v) == "function" and not k:match("^_") then keys[#keys + 1] = k end
  end
  table.sort(keys)
  local out = {}
  for _, k in ipairs(keys) do
    local f = t[k]
    local name = prefix .. sep .. k
    out[#out + 1] = "  " .. summary(f, name, names[f])
  end
  return out, keys[1]
end

local function function_text(f, names)
  local where = names[f]
  local doc, at = function_doc(f, where)
  local out = {(where and where.name or "a function") .. (at and ("   (" .. at .. ")") or "")}
  if doc then
    for _, l in ipairs(doc) do out[#out + 1] = "  " .. l end
  elseif source_of(f) then
    out[#out + 1] = "  (no doc comment above its definition)"
  elseif where then
    local parent = where.name:match("^(.*)%.[^.]*$")
    out[#out + 1] = "  a C function without a doc comment; " .. (parent == "nv" and "help() lists the API" or
      string.format("help(%s) shows what is beside it", parent:find("%.") and parent or string.format("%q", parent)))
  else
    out[#out + 1] = "  a C function that no nvlua module exports; " .. USAGE
  end
  return table.concat(out, "\n") .. "\n"
end

local function class_text(cls, names, name)
  local out = {}
  local where = names[cls]
  name = name or (where and where.name) or rawget(cls, "__name") or "a class"
  out[#out + 1] = name .. " (a class)"
  local file = where and where.module and module_path(where.module)
  local lines = file and file_lines(file)
  local doc = lines and doc_naming(lines, name)
  for _, l in ipairs(doc or {}) do out[#out + 1] = "  " .. l end
  local parent = rawget(cls, "super")
  if parent then
    local pn = names[parent] and names[parent].name or tostring(rawget(parent, "__name"))
    out[#out + 1] = string.format("  inherits the methods of %s (help(%s))", pn, pn)
  end
  out[#out + 1] = "Methods:"
  local inst = name:match("([%w_]+)$"):lower()
  for _, l in ipairs(function_lines(cls, inst, names, ":")) do out[#out + 1] = l end
  return table.concat(out, "\n") .. "\n"
end

local function tensor_text()
  local keys = {}
  for k in pairs(core.Tensor.__methods) do if is_name(k) then keys[#keys + 1] = k end end
  table.sort(keys)
  local out, line = {TENSOR, "Methods:"}, " "
  for _, k in ipairs(keys) do
    if #line + #k + 1 > 100 then out[#out + 1] = line; line = " " end
    line = line .. " " .. k
  end
  out[#out + 1] = line
  return table.concat(out, "\n") .. "\n"
end

-- help of a table of functions: a module (its header), or a table of one (nv.cuda).
local function module_text(t, names)
  local where = names[t]
  local name = where and where.name or "a table"
  local out = {}
  local path = where and where.package and package.searchpath(where.package, package.path)
  local lines = path and file_lines(path)
  if lines then
    for _, l in ipairs(header(lines)) do out[#out + 1] = l end
    out[#out + 1] = ""
  elseif where then
    local home = where.module and where.module[3] or "nvlua"
    out[#out + 1] = string.format("%s: a table of %s", name, home)
  end
  local fl, first = function_lines(t, name, names, ".")
  if #fl > 0 then
    out[#out + 1] = string.format("Functions of %s (help(%s.%s) for one):", name, name, first)
    for _, l in ipairs(fl) do out[#out + 1] = l end
  end
  local classes, tables, values = {}, {}, {}
  local keys = {}
  for k in pairs(t) do if is_name(k) and not k:match("^_") then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = t[k]
    if is_class(v) then classes[#classes + 1] = name .. "." .. k
    elseif type(v) == "table" then tables[#tables + 1] = name .. "." .. k
    elseif type(v) ~= "function" then values[#values + 1] = string.format("%s.%s = %s", name, k, pretty.format(v)) end
  end
  if #classes > 0 then out[#out + 1] = "Classes (help(x) for one's methods): " .. table.concat(classes, "  ") end
  if #tables > 0 then out[#out + 1] = "Tables: " .. table.concat(tables, "  ") end
  if #values > 0 then out[#out + 1] = "Values: " .. table.concat(values, "  ") end
  return table.concat(out, "\n") .. "\n"
end

local function has_functions(t)
  for k, v in pairs(t) do if is_name(k) and type(v) == "function" then return true end end
  return false
end

-- The class of a value with methods (a recipe, a model, a quantized tensor: a C type's methods are
-- its metatable's __methods), or nil.
local function class_of(x)
  local mt = getmetatable(x)
  if type(mt) ~= "table" then return nil end
  local cls = is_class(mt) and mt or type(mt.__index) == "table" and mt.__index or
    type(mt.__methods) == "table" and mt.__methods
  return cls and has_functions(cls) and cls or nil
end

-- The value a name stands for: "train" or "nvlua.train" (a module), "quantize" or "nv.quantize" (a
-- key of nv), "recipe.custom", "nn.Linear.forward" (a path from either); nil (and why) for none.
local function lookup(s)
  local parts = {}
  for p in s:gmatch("[^.:]+") do parts[#parts + 1] = p end
  local v = require "nvlua"
  if parts[1] == "nv" then
    table.remove(parts, 1)
  else
    if parts[1] == "nvlua" then table.remove(parts, 1) end
    local mod = parts[1] and "nvlua." .. parts[1]
    if mod and (package.loaded[mod] or package.searchpath(mod, package.path)) then
      local ok, m = pcall(require, mod)
      if not ok then return nil, string.format("require \"%s\" failed: %s", mod, tostring(m)) end
      v = m
      table.remove(parts, 1)
    end
  end
  for _, p in ipairs(parts) do
    local ok, x = pcall(function() return v[p] end) -- v may be a value without fields
    if not ok or x == nil then return nil end
    v = x
  end
  return v
end

-- The names help(string) could have meant: the modules (loaded or not) and nv's keys.
local function known_names()
  local list = {}
  for _, m in ipairs(modules()) do list[#list + 1] = m[1] end
  local here = package.searchpath("nvlua.help", package.path)
  if here then
    for f in require("lfs").dir(here:match("^(.*)/[^/]*$")) do
      local n = f:match("^(.+)%.lua$")
      if n and n ~= "init" then list[#list + 1] = n end
    end
  end
  for k in pairs(require "nvlua") do if is_name(k) then list[#list + 1] = k end end
  table.sort(list)
  local unique = {}
  for i, n in ipairs(list) do if n ~= list[i - 1] then unique[#unique + 1] = n end end
  return unique
end

--- help.text([x]) -> what help(x) prints: the API's index without x (or for nv), else the doc of
-- the function, module, class or value x, or of what the string x names ("train", "nv.quantize")
function M.text(...)
  if select("#", ...) == 0 then return index_text() end
  local x = ...
  if type(x) == "string" then
    local v, why = lookup(x)
    if v == nil then
      local hint = core.did_you_mean(x:match("[^.:]*$"), known_names())
      return string.format("help: nothing is called '%s'%s%s\n%s\n", x, why and (" (" .. why .. ")") or "",
        hint and ("; " .. hint) or "", USAGE)
    end
    x = v
  end
  local nv = require "nvlua"
  if x == nv then return index_text() end
  if x == core.Tensor.__methods then return tensor_text() end
  if nv.is_tensor(x) then return "a tensor: " .. tostring(x):match("[^\n]*$") .. "\n\n" .. tensor_text() end
  local names = index()
  if type(x) == "function" then
    for name, v in pairs(package.loaded) do -- a module that is a function (nvlua.gradcheck): its header first
      local path = v == x and package.searchpath(name, package.path)
      local lines = path and file_lines(path)
      if lines then return table.concat(header(lines), "\n") .. "\n\n" .. function_text(x, names) end
    end
    return function_text(x, names)
  end
  if is_class(x) then return class_text(x, names) end
  local cls = class_of(x)
  if cls then
    local type_name = getmetatable(x).__name
    type_name = type(type_name) == "string" and type_name or nil
    local name = names[cls] and names[cls].name or type_name or "a value with methods"
    return string.format("%s: %s\n\n%s", type_name or name, tostring(x):match("^[^\n]*"), class_text(cls, names, name))
  end
  if type(x) == "table" then
    if has_functions(x) then return module_text(x, names) end
    return string.format("%s: a table of values, no functions to document:\n%s\n",
      names[x] and names[x].name or "this", pretty.format(x))
  end
  if x == nil then return "help: got nil (a misspelt name holds nil); " .. USAGE .. "\n" end
  return string.format("help: %s is a %s, which has no documentation; %s\n",
    type(x) == "string" and string.format("%q", x) or tostring(x), type(x), USAGE)
end

--- help.help([x]): print help.text(x): the API's index, or the documentation of x
function M.help(...) io.stdout:write(M.text(...)) end

return M
