-- tests/test_help.lua: discoverability (lua/nvlua/help.lua, nvlua.config's --help, the "did you
-- mean" of error messages). help(x) must print the doc comment the source holds: each case reads
-- the source lines itself (a `---` line and the comment lines under it) and looks for them in
-- help's text. `nvlua <experiment> --help` must list every key of the schema it parses (the test
-- enumerates train.schema's keys) and exit 0 having built nothing. The suggestions' expected
-- texts are written out by hand from the rule: case ignored, edit distance at most 2 (1 for words
-- of 3 letters or fewer) with a swap of neighbours counting 1, else the word an abbreviation.
local T = require "nvlua.test"
local nv = require "nvlua"
local help = require "nvlua.help"
local util = require "nvlua.util"
local train = require "nvlua.train"
local lfs = require "lfs"

-- the repository root, as an absolute path (the children run elsewhere): this file's directory's parent
local HERE = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local ROOT = (HERE:sub(1, 1) == "/" and HERE or lfs.currentdir() .. "/" .. HERE) .. "/.."

local function has(s, part, what)
  T.ok(s:find(part, 1, true), string.format("%s should contain %q, got %q", what or "text", part, s))
end

-- The doc comment of the definition in module mod's file whose doc begins "--- <start>": that line
-- and the `--` lines under it, without the comment marks (read here, not through nvlua.help).
local function doc_lines(mod, start)
  local path = assert(package.searchpath(mod, package.path))
  local out
  for l in io.lines(path) do
    if out then
      local text = l:match("^%-%- ?(.*)$")
      if not text or l:match("^%-%-%-") then break end
      out[#out + 1] = text
    elseif l:sub(1, 4 + #start) == "--- " .. start then
      out = {l:sub(5)}
    end
  end
  return assert(out, "no doc comment '--- " .. start .. "' in " .. path)
end

-- ---- help() and help(x) ----------------------------------------------------------------------

T.case("help(nv.quantize) prints its doc comment from quant.lua", function()
  local doc = doc_lines("nvlua.quant", "nv.quantize(")
  T.ok(#doc >= 3, "the doc comment has several lines")
  local text = help.text(nv.quantize)
  T.ok(text:find("^nv.quantize "), "headed by its name: " .. text)
  for _, l in ipairs(doc) do has(text, l, "help(nv.quantize)") end
  -- and it is what nv.help prints
  local r = T.run_nvlua("-e 'require(\"nvlua\").help(require(\"nvlua\").quantize)'")
  T.eq(r.code, 0)
  T.eq(r.err, "")
  T.eq(r.out, text)
end)

T.case("help(module) prints its header and lists its functions with their first doc line", function()
  local text = help.text(require "nvlua.train")
  has(text, "nvlua.train: the training loop every experiment uses", "the header")
  has(text, "\n  " .. doc_lines("nvlua.train", "train.main(")[1] .. "\n", "train.main's line")
  has(text, "\n  " .. doc_lines("nvlua.train", "train.check(")[1] .. "\n", "train.check's line")
  T.eq(help.text("train"), text, "by its short name")
  T.eq(help.text("nvlua.train"), text, "by its package name")
  local rtext = help.text(nv.recipe)
  has(rtext, "\n  " .. doc_lines("nvlua.recipe", "recipe.custom(")[1] .. "\n", "recipe.custom in help(nv.recipe)")
  T.eq(help.text("recipe"), rtext)
end)

T.case("help by name: nv's keys and paths through modules", function()
  T.eq(help.text("nv.quantize"), help.text(nv.quantize))
  T.eq(help.text("quantize"), help.text(nv.quantize))
  local custom = help.text("recipe.custom")
  for _, l in ipairs(doc_lines("nvlua.recipe", "recipe.custom(")) do has(custom, l, "help('recipe.custom')") end
  T.eq(help.text("nn.Linear.forward"), help.text(require("nvlua.nn").Linear.forward))
end)

T.case("help of a C function: the doc comment where lua/nvlua exports it", function()
  T.eq(debug.getinfo(nv.scope, "S").what, "C", "nv.scope is C")
  local text = help.text(nv.scope)
  for _, l in ipairs(doc_lines("nvlua", "nv.scope(")) do has(text, l, "help(nv.scope)") end
  -- a field of nv.cuda with its doc on the same line
  has(help.text(nv.cuda.devices), "nv.cuda.devices() -> {{name, memory, capability", "help(nv.cuda.devices)")
  has(help.text(nv.cuda), "nv.cuda.devices() -> {{name, memory", "help(nv.cuda) lists it")
end)

T.case("help of a class and of values with methods", function()
  local nn = require "nvlua.nn"
  local text = help.text(nn.Linear)
  for _, l in ipairs(doc_lines("nvlua.nn", "nn.Linear(")) do has(text, l, "help(nn.Linear)") end
  has(text, "inherits the methods of nn.Module", "its parent")
  has(text, "linear:forward", "a method")
  has(text, "linear:backward", "a method")
  local r = nv.recipe.nvfp4()
  local rtext = help.text(r)
  T.ok(rtext:find("^nvlua.Recipe: nvfp4%("), "what the value is: " .. rtext)
  has(rtext, "\n  " .. doc_lines("nvlua.recipe", "recipe:linear_forward(")[1] .. "\n", "a recipe method")
  local t = nv.zeros(2, 3)
  local ttext = help.text(t)
  T.ok(ttext:find("^a tensor: %[nvlua.Tensor f32 2x3%]"), ttext)
  T.eq(ttext:gsub("^[^\n]*\n\n", ""), help.text(nv.Tensor), "then help(nv.Tensor)")
  for name in pairs(nv.Tensor) do has(help.text(nv.Tensor), " " .. name, "help(nv.Tensor) lists the method") end
end)

T.case("help() indexes every module of lua/nvlua", function()
  local text = help.text()
  T.eq(help.text(nv), text, "help(nv)")
  T.eq(help.text("nvlua"), text, "help('nvlua')")
  local dir = assert(package.searchpath("nvlua.help", package.path)):match("^(.*)/[^/]*$")
  local n = 0
  for f in lfs.dir(dir) do
    local m = f:match("^(.+)%.lua$")
    if m and m ~= "init" then -- (init.lua is nv itself)
      n = n + 1
      T.ok(text:find("nvlua." .. m, 1, true) or text:find("nv." .. m, 1, true), "help() mentions nvlua." .. m)
    end
  end
  T.ok(n >= 20, "found the modules: " .. n)
  has(text, "nvlua script.lua --help", "the scripts' keys")
  has(text, "nv.recipe.custom", "per-layer recipes")
end)

T.case("help of something undocumented says what it is and where to look", function()
  local text = help.text(42)
  has(text, "help: 42 is a number", "a number")
  has(text, "help() lists the API", "the way on")
  text = help.text("quantise")
  has(text, "help: nothing is called 'quantise'; did you mean 'quantize'?", "a misspelt name")
  has(help.text(nil), "help: got nil", "nil")
  has(help.text(nv.formats.nvfp4), 'name = "nvfp4"', "a table of values shows them")
  has(help.text(function() end), "(no doc comment above its definition)", "an anonymous function")
end)

-- ---- nvlua <script> --help ---------------------------------------------------------------------

T.case("nvlua experiments/tiny_llama_nvfp4.lua --help: description, every key, exit 0, nothing built", function()
  local dir = T.tmpdir()
  local script = ROOT .. "/experiments/tiny_llama_nvfp4.lua"
  local first = io.lines(script)():gsub("^%-%- ", "")
  for _, flag in ipairs({"--help", "-h"}) do
    local r = T.run_nvlua(T.shq(script) .. " steps=3 " .. flag, {cd = dir})
    T.eq(r.code, 0, flag .. " exits 0")
    T.eq(r.err, "", flag .. ": stderr")
    T.ok(r.out:sub(1, #first) == first, flag .. ": the script's description first: " .. r.out:sub(1, 200))
    has(r.out, "usage: nvlua " .. script .. " [key=value ...]", flag)
    for k in pairs(train.schema.specs) do
      T.ok(r.out:find("\n  " .. k .. "=", 1, true), flag .. " lists the key " .. k)
    end
    -- two keys as a user reads them (what train.schema declares, written out here)
    T.ok(r.out:find("\n  schedule=wsd +a schedule value or function or one of wsd, cosine, linear, constant\n"), "schedule's line")
    T.ok(r.out:find("\n  data=kjv +a string\n +kjv | shards:<dir> | megatron:<prefix> | a text file\n"), "data's doc")
    local entries = {}
    for e in lfs.dir(dir) do if e ~= "." and e ~= ".." then entries[#entries + 1] = e end end
    T.eq(entries, {}, flag .. ": nothing was written (no run directory)")
  end
  T.rm_tree(dir)
end)

T.case("every experiment honours --help", function()
  local n = 0
  for f in lfs.dir(ROOT .. "/experiments") do
    if f:match("%.lua$") then
      n = n + 1
      local r = T.run_nvlua(T.shq("experiments/" .. f) .. " --help", {cd = ROOT})
      T.eq(r.code, 0, f .. " --help exits 0: " .. r.err)
      has(r.out, "usage: nvlua experiments/" .. f, f)
      T.ok(r.out:find("\n  seed=", 1, true) or f == "shadow_sync.lua", f .. " lists train's keys")
    end
  end
  T.ok(n >= 6, "the experiments: " .. n)
end)

-- ---- did you mean ---------------------------------------------------------------------------

T.case("util.did_you_mean: the closest names by edit distance, swaps and abbreviations", function()
  local keys = {"steps", "seq", "seed", "sr", "schedule", "lr"}
  T.eq(util.did_you_mean("stpes", keys), "did you mean 'steps'?", "a swap of neighbours is one edit")
  T.eq(util.did_you_mean("setps", keys), "did you mean 'steps'?")
  T.eq(util.did_you_mean("STEPS", keys), "did you mean 'steps'?", "case ignored")
  T.eq(util.did_you_mean("stepsss", keys), "did you mean 'steps'?", "two edits for a long word")
  T.eq(util.did_you_mean("sched", keys), "did you mean 'schedule'?", "an abbreviation")
  T.eq(util.did_you_mean("se", keys), "did you mean 'seq' or 'sr'?", "the best ones, in the list's order")
  T.eq(util.did_you_mean("sed", keys), "did you mean 'seq' or 'seed'?")
  T.eq(util.did_you_mean("xyz", keys), nil, "nothing close")
  T.eq(util.did_you_mean("abc", {"xbz"}), nil, "two edits are too many for a 3-letter word")
  T.eq(util.did_you_mean("s", {"a", "b", "c", "d"}), "did you mean 'a', 'b' or 'c'?", "three at most")
  T.eq(util.suggest("stpes", keys), "; did you mean 'steps'?")
  T.eq(util.suggest(7, keys), "", "not a string: no suggestion")
  T.raises(function() util.did_you_mean("x") end, "bad argument #2")
end)

T.case("unknown options and formats suggest the closest valid ones", function()
  local x = nv.ones(4, 32)
  T.raises(function() nv.quantize(x, "e4m3", {blcok = "2d"}) end,
    "quantize: unknown option 'blcok' (valid: amax, axis, block, ")
  T.raises(function() nv.quantize(x, "e4m3", {blcok = "2d"}) end, "sr_row_offset, view); did you mean 'block'?")
  local err = T.raises(function() nv.quantize(x, "e4m3", {zzzz = 1}) end, "unknown option 'zzzz'")
  T.eq(err:find("did you mean", 1, true), nil, "nothing close: no guess")
  T.raises(function() nv.quantize(x, "nvpf4") end, "invalid format 'nvpf4' (valid: f32, bf16")
  T.raises(function() nv.quantize(x, "nvpf4") end, "mxfp4); did you mean 'nvfp4'?")
  T.raises(function() nv.recipe.make("nvpf4") end, "recipe.make: unknown recipe 'nvpf4' (valid: ")
  T.raises(function() nv.recipe.make("nvpf4") end, "); did you mean 'nvfp4'?")
  -- an options table checked in C (lua/bind/opts.c)
  T.raises(function() nv.core.rope_tables(8, 16, 10000.0, {factr = 8}) end, "); did you mean 'factor'?")
end)
