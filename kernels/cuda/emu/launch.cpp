/* launch.cpp: kernel launches on the CPU (emu_device.h gives the model): the launch checks, one fiber
 * per CUDA thread with a small context switch of its own (x86-64; ucontext elsewhere), the block
 * scheduler with its barrier and warp-function rules, per-block shared memory, and the counters of
 * launches.
 *
 * A block runs its threads in order (NVLUA_EMU_ORDER: forward, reverse, or shuffled per block with a
 * seed), each until it finishes or waits. When every thread waits or has finished: each warp
 * function whose lanes all wait at it completes; else a barrier that every thread reached at the
 * same call opens; anything else is a rule broken (divergence), which ends the kernel with a fault.
 * A fiber's stack is taken from a pool when its thread first runs and returned when it finishes, so
 * a kernel without barriers runs all its threads on one stack.
 *
 * Not here: the runtime API (runtime.cpp). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <map>
#include <random>

#include "emu.h"
#include "emu_device.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace nvl_emu {

Thread *cur_thread;
uint3 cur_block;
dim3 cur_block_dim, cur_grid_dim;

/* ---- fibers ----------------------------------------------------------------------------------------- */

static const size_t STACK = 64 * 1024, GUARD = 4096;

#if defined(__x86_64__)
/* nvl_emu_swap(save, load): push the callee-saved registers and the SSE/x87 control words, store rsp
 * in *save, switch to load, pop, return there. A new fiber's stack holds that frame with
 * nvl_emu_trampoline as its return address. */
extern "C" void nvl_emu_swap(void **save, void *load);
extern "C" void nvl_emu_trampoline(void);
asm(R"(
  .text
  .globl nvl_emu_swap
  .type nvl_emu_swap, @function
nvl_emu_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size nvl_emu_swap, .-nvl_emu_swap
  .globl nvl_emu_trampoline
  .type nvl_emu_trampoline, @function
nvl_emu_trampoline:
  call nvl_emu_fiber_main
  ud2
  .size nvl_emu_trampoline, .-nvl_emu_trampoline
)");

struct Ctx {
  void *sp;
};
static void ctx_init(Ctx *c, char *stack_top) {
  uintptr_t sp = ((uintptr_t)stack_top - 128) & ~(uintptr_t)15;
  uint64_t *f = (uint64_t *)sp;
  uint32_t mx;
  uint16_t cw;
  asm volatile("stmxcsr %0" : "=m"(mx));
  asm volatile("fnstcw %0" : "=m"(cw));
  f[0] = (uint64_t)mx | ((uint64_t)cw << 32);
  for (int i = 1; i <= 6; i++) f[i] = 0;
  f[7] = (uint64_t)(uintptr_t)nvl_emu_trampoline;
  c->sp = f; /* after the final ret, rsp = sp + 64: 16-aligned, as the trampoline's call needs */
}
static void ctx_switch(Ctx *from, Ctx *to) { nvl_emu_swap(&from->sp, to->sp); }
#else
extern "C" void nvl_emu_fiber_main(void);
struct Ctx {
  ucontext_t uc;
};
static void ctx_init(Ctx *c, char *stack_top) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack_top - STACK;
  c->uc.uc_stack.ss_size = STACK;
  c->uc.uc_link = NULL;
  makecontext(&c->uc, nvl_emu_fiber_main, 0);
}
static void ctx_switch(Ctx *from, Ctx *to) { swapcontext(&from->uc, &to->uc); }
#endif

/* ---- the launch in progress --------------------------------------------------------------------------- */

enum TState { T_READY, T_BAR, T_WARP, T_DONE };

struct TInfo : Thread {
  TState st;
  int stack; /* pool slot, -1 before the thread first runs */
  Ctx ctx;
  const char *file; /* where it waits */
  int line;
  int kind, width, param;
  unsigned mask;
  uint64_t value, result;
};

struct Launch {
  bool active, failed, in_block;
  const void *kernel;
  const char *name;
  LaunchCfg cfg;
  int nthreads;
  void (*main)(void *);
  void *ctx;
  Stream *stream;
  std::vector<Access> acc;
  /* shared memory: static variables by declaration, the dynamic part */
  std::vector<std::pair<const void *, size_t>> statics;
  size_t static_top, dyn, limit;
};

static Launch L;
static std::vector<TInfo> th;
static TInfo *running;
static Ctx sched;
static std::vector<char *> stacks; /* the pool: each STACK bytes above a guard page */
static std::vector<int> free_stacks;
static std::map<const void *, int> smem_attr; /* kernel -> cudaFuncAttributeMaxDynamicSharedMemorySize */
static std::mt19937_64 rng;
static bool rng_seeded;

static char *arena;                   /* shared memory of the running block */
static const size_t ARENA = 256 * 1024; /* > 227 KiB, the largest opt-in; followed by a guard page */

bool in_kernel() { return L.active && running; }

std::string kernel_context() {
  char b[400];
  if (!L.active) return "no kernel";
  if (!running)
    snprintf(b, sizeof b, "kernel %s", L.name);
  else
    snprintf(b, sizeof b, "kernel %s, block (%u,%u,%u), thread (%u,%u,%u)", L.name, cur_block.x, cur_block.y,
             cur_block.z, running->idx.x, running->idx.y, running->idx.z);
  return b;
}

bool in_fiber_guard(const void *addr) {
  for (char *s : stacks)
    if ((const char *)addr >= s - GUARD && (const char *)addr < s) return true;
  return false;
}

int max_dynamic_smem(const void *kernel) {
  auto it = smem_attr.find(kernel);
  return it == smem_attr.end() ? 0 : it->second;
}

static const char *base(const char *f) {
  const char *s = strrchr(f, '/');
  return s ? s + 1 : f;
}

/* End the kernel with a fault: the running thread (if any) never resumes. */
static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...) {
  if (L.failed) return;
  va_list ap;
  va_start(ap, fmt);
  char msg[900];
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  L.failed = true;
  if (L.in_block)
    fault(cudaErrorLaunchFailure, "kernel %s, block (%u,%u,%u): %s", L.name, cur_block.x, cur_block.y, cur_block.z,
          msg);
  else
    fault(cudaErrorLaunchFailure, "kernel %s (%s:%d): %s", L.name, base(L.cfg.file), L.cfg.line, msg);
}

/* Leave the running fiber for good (after fail). */
[[noreturn]] static void abandon() {
  running->st = T_DONE;
  ctx_switch(&running->ctx, &sched);
  abort(); /* never resumed */
}

/* ---- stacks ---------------------------------------------------------------------------------------------- */

static int take_stack() {
  if (!free_stacks.empty()) {
    int s = free_stacks.back();
    free_stacks.pop_back();
    return s;
  }
  char *m = (char *)mmap(NULL, STACK + GUARD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return -1;
  mprotect(m, GUARD, PROT_NONE);
  stacks.push_back(m + GUARD);
  return (int)stacks.size() - 1;
}

}  // namespace nvl_emu

using namespace nvl_emu;

extern "C" void nvl_emu_fiber_main(void) {
  L.main(L.ctx);
  running->st = T_DONE;
  ctx_switch(&running->ctx, &sched);
  abort();
}

namespace nvl_emu {

/* Run t until it waits or finishes. */
static void resume(TInfo *t) {
  if (t->stack < 0) {
    t->stack = take_stack();
    if (t->stack < 0) {
      fail("cannot allocate a fiber stack");
      return;
    }
    ctx_init(&t->ctx, stacks[(size_t)t->stack] + STACK);
  }
  running = t;
  cur_thread = t;
  ctx_switch(&sched, &t->ctx);
  running = NULL;
  if (t->st == T_DONE && t->stack >= 0) {
    free_stacks.push_back(t->stack);
    t->stack = -1;
  }
}

/* Park the running thread at a barrier or warp function until the scheduler resumes it. */
static void wait_here() {
  TInfo *t = running;
  ctx_switch(&t->ctx, &sched);
  running = t;
  cur_thread = t;
  if (L.failed) abandon();
}

/* ---- warp functions and barriers ----------------------------------------------------------------------- */

static const char *const WNAME[] = {"__shfl_sync", "__shfl_xor_sync", "__shfl_up_sync", "__shfl_down_sync",
                                    "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp",
                                    "__reduce_max_sync", "wmma::load_matrix_sync", "wmma::store_matrix_sync",
                                    "wmma::mma_sync", "wmma::fill_fragment"};

static int tid_of(const TInfo &t) {
  return (int)(t.idx.x + L.cfg.block.x * (t.idx.y + L.cfg.block.y * t.idx.z));
}

uint64_t warp_op(int kind, unsigned mask, uint64_t value, int param, int width, const char *file, int line) {
  TInfo *t = running;
  if (!t) abort();
  t->st = T_WARP;
  t->kind = kind;
  t->mask = mask;
  t->value = value;
  t->param = param;
  t->width = width;
  t->file = file;
  t->line = line;
  wait_here();
  return t->result;
}

void syncthreads(const char *file, int line) {
  TInfo *t = running;
  if (!t) abort();
  t->st = T_BAR;
  t->file = file;
  t->line = line;
  wait_here();
}

void device_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char msg[700];
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fail("thread %d at %s:%d: %s", running ? tid_of(*running) : -1, base(file), line, msg);
  abandon();
}

static std::string where(const TInfo &t) {
  char b[200];
  if (t.st == T_DONE) return "has exited";
  if (t.st == T_BAR) snprintf(b, sizeof b, "waits at __syncthreads (%s:%d)", base(t.file), t.line);
  else snprintf(b, sizeof b, "waits at %s mask 0x%08x (%s:%d)", WNAME[t.kind], t.mask, base(t.file), t.line);
  return b;
}

/* The source lane of a shuffle by lane `lane` of t's call, or -1 when the lane keeps its own value. */
static int shfl_source(const TInfo &t, int lane) {
  const int w = t.width, seg = lane & ~(w - 1);
  switch (t.kind) {
    case W_SHFL_IDX: return seg + (t.param & (w - 1));
    case W_SHFL_XOR: {
      int s = lane ^ t.param;
      return s >= seg + w || s < 0 || s > 31 ? -1 : s;
    }
    case W_SHFL_UP: return lane - t.param < seg ? -1 : lane - t.param;
    default: return lane + t.param >= seg + w ? -1 : lane + t.param;
  }
}

/* Complete the warp function that lane `lane` of warp `w` waits at, if every lane of its mask waits
 * at the same one; a lane that cannot is a broken rule. Returns 1 completed, 0 not yet, -1 failed. */
static int complete_warp_op(int w, int lane) {
  TInfo &t = th[(size_t)(32 * w + lane)];
  const char *fn = WNAME[t.kind];
  if (!(t.mask >> lane & 1))
    return fail("%s at %s:%d by thread %d: the mask 0x%08x does not include the calling lane %d", fn, base(t.file),
                t.line, tid_of(t), t.mask, lane), -1;
  if (t.width < 1 || t.width > 32 || (t.width & (t.width - 1)))
    return fail("%s at %s:%d: width %d is not a power of two up to 32", fn, base(t.file), t.line, t.width), -1;
  for (int j = 0; j < 32; j++) {
    if (!(t.mask >> j & 1)) continue;
    if (32 * w + j >= L.nthreads)
      return fail("%s at %s:%d by thread %d: mask 0x%08x names lane %d, which does not exist (%d threads per block)",
                  fn, base(t.file), t.line, tid_of(t), t.mask, j, L.nthreads), -1;
    const TInfo &u = th[(size_t)(32 * w + j)];
    if (u.st == T_READY) return 0;
    if (u.st != T_WARP || u.kind != t.kind || u.mask != t.mask || u.line != t.line || strcmp(u.file, t.file) ||
        u.width != t.width)
      return fail("divergent warp: thread %d waits at %s mask 0x%08x (%s:%d), but lane %d of its mask (thread %d) %s",
                  tid_of(t), fn, t.mask, base(t.file), t.line, j, tid_of(u), where(u).c_str()), -1;
    if (t.kind >= W_WMMA_LOAD && (u.value != t.value || u.param != t.param))
      return fail("%s at %s:%d: lane %d (thread %d) passes 0x%llx / %d, lane %d (thread %d) 0x%llx / %d: the "
                  "pointer, ldm and fill value must be the same in every lane of the warp", fn, base(t.file), t.line,
                  lane, tid_of(t), (unsigned long long)t.value, t.param, j, tid_of(u),
                  (unsigned long long)u.value, u.param), -1;
  }
  uint64_t acc = t.kind == W_ALL ? 1 : 0;
  for (int j = 0; j < 32; j++) {
    if (!(t.mask >> j & 1)) continue;
    const uint64_t v = th[(size_t)(32 * w + j)].value;
    if (t.kind == W_BALLOT) acc |= (uint64_t)(v != 0) << j;
    if (t.kind == W_ANY) acc |= v != 0;
    if (t.kind == W_ALL) acc &= v != 0;
    if (t.kind == W_REDUCE_MAX) acc = std::max(acc, v & 0xffffffffu);
  }
  for (int j = 0; j < 32; j++) {
    if (!(t.mask >> j & 1)) continue;
    TInfo &u = th[(size_t)(32 * w + j)];
    u.result = acc;
    if (t.kind <= W_SHFL_DOWN) {
      int s = shfl_source(u, j);
      if (s >= 0 && !(t.mask >> s & 1))
        return fail("%s at %s:%d: lane %d (thread %d) reads lane %d, which is not in the mask 0x%08x (undefined)", fn,
                    base(t.file), t.line, j, tid_of(u), s, t.mask), -1;
      u.result = s < 0 ? u.value : th[(size_t)(32 * w + s)].value;
    }
    u.st = T_READY;
  }
  return 1;
}

/* After every thread waits or has finished: complete warp functions, else open the barrier.
 * Returns true if some thread can run again. */
static bool resolve() {
  bool progress = false;
  for (int i = 0; i < L.nthreads && !L.failed; i++)
    if (th[(size_t)i].st == T_WARP && complete_warp_op(i / 32, i % 32) > 0) progress = true;
  if (progress || L.failed) return progress;
  int first = -1, done = 0;
  for (int i = 0; i < L.nthreads; i++) {
    const TInfo &t = th[(size_t)i];
    if (t.st == T_DONE) done++;
    else if (first < 0) first = i;
  }
  if (first < 0) return false;
  const TInfo &b = th[(size_t)first];
  for (int i = 0; i < L.nthreads; i++) {
    const TInfo &t = th[(size_t)i];
    if (t.st == T_DONE || (t.st == T_BAR && t.line == b.line && !strcmp(t.file, b.file))) continue;
    return fail("divergent __syncthreads: thread %d %s, thread %d %s", tid_of(b), where(b).c_str(), i,
                where(t).c_str()), false;
  }
  if (done)
    return fail("__syncthreads at %s:%d reached by %d threads while %d threads of the block have exited", base(b.file),
                b.line, L.nthreads - done, done), false;
  for (int i = 0; i < L.nthreads; i++) th[(size_t)i].st = T_READY;
  return true;
}

/* ---- shared memory --------------------------------------------------------------------------------------- */

static const size_t STATIC_MAX = 48 * 1024;

void *shared_static(const void *key, size_t bytes, size_t align, const char *name) {
  for (auto &s : L.statics)
    if (s.first == key) return arena + s.second;
  size_t off = (L.static_top + std::max(align, (size_t)8) - 1) & ~(std::max(align, (size_t)8) - 1);
  L.static_top = off + bytes;
  if (L.static_top > STATIC_MAX)
    fail("static shared memory reaches %zu bytes with '%s' (the limit is 48 KiB)", L.static_top, name);
  else if (L.static_top + L.dyn > L.limit)
    fail("%zu bytes of static and %zu of dynamic shared memory exceed the kernel's %zu (%s)", L.static_top, L.dyn,
         L.limit, L.limit > STATIC_MAX ? "its cudaFuncAttributeMaxDynamicSharedMemorySize opt-in" : "48 KiB without "
         "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)");
  if (L.failed) abandon();
  memset(arena + off, 0xFF, bytes);
  L.statics.push_back({key, off});
  return arena + off;
}

void *shared_dynamic() { return arena + ARENA - L.dyn; }

/* ---- running blocks --------------------------------------------------------------------------------------- */

static void order_of(std::vector<int> &o, int n) {
  o.resize((size_t)n);
  for (int i = 0; i < n; i++) o[(size_t)i] = config().order == 1 ? n - 1 - i : i;
  if (config().order == 2) std::shuffle(o.begin(), o.end(), rng);
}

static void run_block(uint3 b) {
  cur_block = b;
  L.in_block = true;
  const dim3 bd = L.cfg.block;
  for (int i = 0; i < L.nthreads; i++) {
    TInfo &t = th[(size_t)i];
    t.idx = uint3{(unsigned)i % bd.x, (unsigned)i / bd.x % bd.y, (unsigned)i / (bd.x * bd.y)};
    t.st = T_READY;
    t.stack = -1;
  }
  memset(arena, 0xFF, L.static_top);
  memset(arena + ARENA - L.dyn, 0xFF, L.dyn);
  static std::vector<int> order;
  order_of(order, L.nthreads);
  for (;;) {
    for (int i : order)
      if (th[(size_t)i].st == T_READY && !L.failed) resume(&th[(size_t)i]);
    if (L.failed || !resolve()) break;
  }
  for (TInfo &t : th) /* a failed block leaves fibers mid-way: their stacks go back unused */
    if (t.stack >= 0) {
      free_stacks.push_back(t.stack);
      t.stack = -1;
    }
  L.in_block = false;
}

void launch_run(void (*thread_main)(void *), void *ctx) {
  L.main = thread_main;
  L.ctx = ctx;
  cur_grid_dim = L.cfg.grid;
  cur_block_dim = L.cfg.block;
  if (!op_enqueue(L.stream, L.name, L.acc.data(), (int)L.acc.size())) return;
  const dim3 g = L.cfg.grid;
  const int64_t nb = (int64_t)g.x * g.y * g.z;
  KernelCount &k = kernel_counter(L.kernel, L.name);
  k.launches++;
  k.blocks += nb;
  k.threads += nb * L.nthreads;
  counters().launches++;
  track_begin(L.acc.data(), (int)L.acc.size());
  std::vector<int64_t> blocks;
  if (config().order != 0) {
    blocks.resize((size_t)nb);
    for (int64_t i = 0; i < nb; i++) blocks[(size_t)i] = config().order == 1 ? nb - 1 - i : i;
    if (config().order == 2) std::shuffle(blocks.begin(), blocks.end(), rng);
  }
  for (int64_t i = 0; i < nb && !L.failed; i++) {
    int64_t j = config().order ? blocks[(size_t)i] : i;
    run_block(uint3{(unsigned)(j % g.x), (unsigned)(j / g.x % g.y), (unsigned)(j / ((int64_t)g.x * g.y))});
  }
  track_end(k);
}

/* ---- launch checks -------------------------------------------------------------------------------------------- */

/* __launch_bounds__(n) as emu_device.h records it: ceil(n/32) one-byte nops at the kernel's entry
 * (after an endbr64 when the build has -fcf-protection). 0: no bound. */
static int launch_bound(const void *kernel) {
  const unsigned char *c = (const unsigned char *)kernel;
  if (c[0] == 0xf3 && c[1] == 0x0f && c[2] == 0x1e && c[3] == 0xfa) c += 4;
  int n = 0;
  while (c[n] == 0x90 && n < 64) n++;
  return 32 * n;
}

static bool bad_config(const char *what) {
  refuse(cudaErrorInvalidConfiguration, "launch of %s (%s:%d) with grid (%u,%u,%u) and block (%u,%u,%u): %s",
         L.name, base(L.cfg.file), L.cfg.line, L.cfg.grid.x, L.cfg.grid.y, L.cfg.grid.z, L.cfg.block.x, L.cfg.block.y,
         L.cfg.block.z, what);
  return false;
}

static bool check_config(size_t param_bytes) {
  const LaunchCfg &c = L.cfg;
  const cudaDeviceProp &p = props(current_device());
  const int64_t threads = (int64_t)c.block.x * c.block.y * c.block.z;
  if (!c.grid.x || !c.grid.y || !c.grid.z || c.grid.x > (unsigned)p.maxGridSize[0] ||
      c.grid.y > (unsigned)p.maxGridSize[1] || c.grid.z > (unsigned)p.maxGridSize[2])
    return bad_config("the grid is empty or larger than the device's maximum (2^31-1, 65535, 65535)");
  if (!threads || threads > p.maxThreadsPerBlock || c.block.z > (unsigned)p.maxThreadsDim[2])
    return bad_config("a block has 1 to 1024 threads, at most 64 along z");
  L.nthreads = (int)threads;
  int bound = launch_bound(L.kernel);
  if (bound && threads > bound)
    return refuse(cudaErrorLaunchOutOfResources, "launch of %s (%s:%d) with %lld threads per block; the kernel is "
                  "declared __launch_bounds__(%d)", L.name, base(c.file), c.line, (long long)threads, bound), false;
  const int attr = max_dynamic_smem(L.kernel);
  L.limit = attr ? (size_t)attr : STATIC_MAX;
  if (c.smem > L.limit)
    return refuse(cudaErrorInvalidValue, "launch of %s (%s:%d) with %zu bytes of dynamic shared memory: more than %zu "
                  "(%s)", L.name, base(c.file), c.line, c.smem, L.limit, attr ? "its opt-in" :
                  "48 KiB without cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)"), false;
  if (param_bytes > 32764)
    return refuse(cudaErrorInvalidValue, "launch of %s: %zu bytes of parameters (at most 32764)", L.name,
                  param_bytes), false;
  return true;
}

bool launch_begin(const void *kernel, const char *name, const LaunchCfg &c, size_t param_bytes) {
  big_lock().lock();
  init();
  if (L.active) { /* a kernel launched from a kernel: not modelled */
    fprintf(stderr, "nvlua cuda emulator: fatal: %s launched from inside %s\n", name, L.name);
    abort();
  }
  L.active = true;
  L.failed = false;
  L.kernel = kernel;
  L.name = name;
  L.cfg = c;
  L.acc.clear();
  L.statics.clear();
  L.static_top = 0;
  L.dyn = (c.smem + 15) & ~(size_t)15;
  if (!rng_seeded) {
    rng.seed(config().seed);
    rng_seeded = true;
  }
  if (!arena) {
    arena = (char *)mmap(NULL, ARENA + GUARD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    mprotect(arena + ARENA, GUARD, PROT_NONE);
  }
  L.stream = visible_devices() ? stream_of(c.stream, name) : NULL;
  bool ok = L.stream != NULL;
  if (!visible_devices()) refuse(cudaErrorNoDevice, "launch of %s: no device", name);
  if (ok && stream_device(L.stream) != current_device()) {
    refuse(cudaErrorInvalidResourceHandle, "launch of %s on %s while cuda:%d is current", name,
           stream_name(L.stream).c_str(), current_device());
    ok = false;
  }
  if (ok) ok = check_config(param_bytes);
  if (ok && (int64_t)th.size() < L.nthreads) th.resize((size_t)L.nthreads);
  if (!ok) {
    L.active = false;
    big_lock().unlock();
  }
  return ok;
}

static void add_access(Alloc *a, int mode, const char *what) {
  for (Access &x : L.acc)
    if (x.a == a) {
      x.mode |= mode;
      return;
    }
  L.acc.push_back(Access{a, mode, what});
}

static const char *const ARG_NAMES[] = {"argument #1", "argument #2", "argument #3", "argument #4", "argument #5",
                                        "argument #6", "argument #7", "argument #8", "argument #9", "argument #10",
                                        "argument #11", "argument #12", "argument #13", "argument #14",
                                        "argument #15", "argument #16"};

bool arg_pointer(int i, void **p, bool written) {
  if (!*p) return true;
  const char *what = ARG_NAMES[std::min(i, 15)];
  Alloc *a = find_alloc(*p, 0);
  if (!a) {
    fail("%s (%p) is not device memory: %s", what, *p, in_device_range(*p) ? describe_ptr(*p).c_str() :
         "a host pointer (kernels take device pointers; copy the data to the device first)");
    return false;
  }
  if (a->dev != current_device()) {
    fail("%s is memory of cuda:%d, but the kernel runs on cuda:%d (no peer access)", what, a->dev, current_device());
    return false;
  }
  add_access(a, written ? ACC_READ | ACC_WRITE : ACC_READ, what);
  *p = host_view(a, *p);
  return true;
}

/* A mapped host address in the range where this process keeps its heap, libraries and stacks? */
static bool looks_like_host_pointer(uint64_t v) {
  if (v < ((uint64_t)1 << 40) || v >= ((uint64_t)1 << 47)) return false;
  unsigned char vec;
  return mincore((void *)(v & ~(uint64_t)4095), 1, &vec) == 0;
}

bool arg_struct(int i, void *bytes, size_t n) {
  const char *what = ARG_NAMES[std::min(i, 15)];
  for (size_t off = 0; off + 8 <= n; off += 8) {
    uint64_t v;
    memcpy(&v, (char *)bytes + off, 8);
    if (in_device_range((void *)v)) {
      Alloc *a = find_alloc((void *)v, 0);
      if (!a || a->dev != current_device()) {
        fail("%s holds at byte %zu a device address outside any live allocation of cuda:%d (%s)", what, off,
             current_device(), describe_ptr((void *)v).c_str());
        return false;
      }
      add_access(a, ACC_READ | ACC_WRITE, what);
      v = (uint64_t)(uintptr_t)host_view(a, (void *)v);
      memcpy((char *)bytes + off, &v, 8);
    } else if (looks_like_host_pointer(v)) {
      fail("%s holds at byte %zu what looks like a host pointer (%p); kernels take device pointers", what, off,
           (void *)v);
      return false;
    }
  }
  return true;
}

void launch_end() {
  L.active = false;
  running = NULL;
  big_lock().unlock();
}

/* "...kernel_name() [with auto F = quant_unit_kernel<float, 3>]" -> "quant_unit_kernel<float, 3>" */
const char *pretty_kernel_name(const char *pretty, const void *key) {
  static std::map<const void *, std::string> names;
  NVL_EMU_LOCK;
  auto it = names.find(key);
  if (it != names.end()) return it->second.c_str();
  std::string s = pretty;
  size_t a = s.find("F = ");
  s = a == std::string::npos ? s : s.substr(a + 4);
  if (!s.empty() && s.back() == ']') s.pop_back();
  if (!s.empty() && s[0] == '&') s.erase(0, 1);
  for (size_t p; (p = s.find("{anonymous}::")) != std::string::npos;) s.erase(p, 13);
  return names.emplace(key, s).first->second.c_str();
}

}  // namespace nvl_emu

extern "C" cudaError_t nvl_emu_func_set_attribute(const void *func, cudaFuncAttribute attr, int value) {
  NVL_EMU_LOCK;
  init();
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return refuse(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d is not modelled", (int)attr);
  const int optin = (int)props(current_device()).sharedMemPerBlockOptin;
  if (value < 0 || value > optin)
    return refuse(cudaErrorInvalidValue, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize, %d): the device allows "
                  "%d bytes per block", value, optin);
  smem_attr[func] = value;
  return cudaSuccess;
}
