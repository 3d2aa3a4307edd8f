-- OpenMP's wait setting: nvlua starts libgomp with a short spin (GOMP_SPINCOUNT=5000) unless the
-- environment says otherwise (lua/bind/main.c, omp_wait_default). libgomp reads its environment
-- before main, so nvlua executes itself again with the setting; these cases check that libgomp
-- really started with it (OMP_DISPLAY_ENV=VERBOSE: libgomp prints the values it uses), and that the
-- second execution keeps the arguments, stdin, the process name and a user's own setting. How much
-- it matters for speed is a benchmark, not a test: scripts/bench_omp.sh, experiments/bench/omp_wait.md.
local T = require "nvlua.test"

-- the values libgomp printed, in order (one block per execution)
local function spins(err)
  local t = {}
  for v in err:gmatch("GOMP_SPINCOUNT = '(%d+)'") do t[#t + 1] = v end
  return t
end

T.case("no setting in the environment: libgomp runs with GOMP_SPINCOUNT=5000, arguments and stdin intact", function()
  local r = T.run_nvlua("- a 'b c'", {env = {OMP_DISPLAY_ENV = "VERBOSE"},
    stdin = "print(os.getenv('GOMP_SPINCOUNT'), arg[1], arg[2], io.read('l'))\n"})
  T.eq(r.code, 0, r.err)
  local s = spins(r.err)
  T.eq(s[#s], "5000", "the setting libgomp ran the script with")
  T.eq(#s, 2, "libgomp's default in the first execution, then nvlua's")
  T.eq(r.out, "5000\ta\tb c\tnil\n") -- the script itself was all of stdin
end)

T.case("stdin reaches the script after the second execution", function()
  local r = T.run_nvlua("-e " .. T.shq("print(io.read('l')) print(io.read('l'))"), {stdin = "first\nsecond\n"})
  T.eq(r.code, 0, r.err)
  T.eq(r.out, "first\nsecond\n")
end)

T.case("the process keeps its name (ps, pkill nvlua)", function()
  local r = T.run_nvlua("-e " .. T.shq("io.write(io.open('/proc/self/comm'):read('l'))"))
  T.eq(r.code, 0, r.err)
  T.eq(r.out, "nvlua")
end)

T.case("a user's GOMP_SPINCOUNT or OMP_WAIT_POLICY is kept as given, and -v says so", function()
  local r = T.run_nvlua("-v", {env = {OMP_DISPLAY_ENV = "VERBOSE", GOMP_SPINCOUNT = "5"}})
  T.eq(r.code, 0, r.err)
  T.eq(table.concat(spins(r.err), ","), "5", "one execution, the user's value")
  T.ok(r.out:find("OpenMP: GOMP_SPINCOUNT=5 (set by the environment)", 1, true), r.out)
  r = T.run_nvlua("-e " .. T.shq("print(os.getenv('GOMP_SPINCOUNT'))"),
    {env = {OMP_DISPLAY_ENV = "VERBOSE", OMP_WAIT_POLICY = "active"}})
  T.eq(r.code, 0, r.err)
  T.eq(r.out, "nil\n")
  T.ok(r.err:find("OMP_WAIT_POLICY = 'ACTIVE'", 1, true), r.err)
  T.eq(#spins(r.err), 1, "no second execution")
end)

T.case("NVLUA_OMP_DEFAULT=0 keeps libgomp's default; -v reports nvlua's default otherwise", function()
  local r = T.run_nvlua("-v", {env = {OMP_DISPLAY_ENV = "VERBOSE", NVLUA_OMP_DEFAULT = "0"}})
  T.eq(r.code, 0, r.err)
  T.eq(#spins(r.err), 1)
  T.ok(r.out:find("OpenMP: libgomp's default wait (NVLUA_OMP_DEFAULT=0)", 1, true), r.out)
  r = T.run_nvlua("-v")
  T.ok(r.out:find("OpenMP: GOMP_SPINCOUNT=5000 (nvlua's default", 1, true), r.out)
end)
