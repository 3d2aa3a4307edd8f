-- nvlua.plot: loss curves as PNG through gnuplot (Debian gnuplot-nox). Each series is
-- {title = "...", x = {...}, y = {...}}; the data goes to a .dat file beside the PNG.
local plot = {}

--- plot.lines(png_path, series, {title=, xlabel=, ylabel=, logy=}) -> true | nil, msg
function plot.lines(path, series, o)
  o = o or {}
  local base = path:gsub("%.png$", "")
  local dat = base .. ".dat"
  local f, err = io.open(dat, "w")
  if not f then return nil, err end
  local cmds = {}
  for i, s in ipairs(series) do
    f:write(string.format("# %s\n", s.title or ("series " .. i)))
    for j = 1, #s.x do f:write(string.format("%.10g %.10g\n", s.x[j], s.y[j])) end
    f:write("\n\n")
    cmds[#cmds + 1] = string.format("'%s' index %d with lines lw 2 title '%s'", dat, i - 1,
      (s.title or ("series " .. i)):gsub("'", ""))
  end
  f:close()
  local script = table.concat({
    "set terminal pngcairo size 1000,600 noenhanced",
    string.format("set output '%s'", path),
    string.format("set title '%s'", (o.title or ""):gsub("'", "")),
    string.format("set xlabel '%s'", o.xlabel or "step"),
    string.format("set ylabel '%s'", o.ylabel or "loss"),
    "set grid",
    "set key top right",
    o.logy and "set logscale y" or "",
    "plot " .. table.concat(cmds, ", "),
  }, "\n")
  local gp = base .. ".gp"
  local g = assert(io.open(gp, "w"))
  g:write(script, "\n")
  g:close()
  local ok = os.execute(string.format("gnuplot '%s' 2>/dev/null", gp))
  if not ok then return nil, "gnuplot failed or is not installed (Debian gnuplot-nox; scripts/setup.sh installs it)" end
  return true
end

--- plot.results(dir, lines, png_name, series, opts): an experiment's ending — lines printed and
-- written to dir/results.md, series drawn to dir/png_name (plot.lines' opts), both paths printed
function plot.results(dir, lines, png_name, series, o)
  print("")
  for _, l in ipairs(lines) do print(l) end
  local f = assert(io.open(dir .. "/results.md", "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  local png = dir .. "/" .. png_name
  local ok, err = plot.lines(png, series, o)
  print(ok and ("\nplot: " .. png) or ("\nplot: " .. tostring(err)))
  print("table: " .. dir .. "/results.md")
end

return plot
