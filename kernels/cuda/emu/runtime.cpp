/* runtime.cpp: the CUDA runtime API on the CPU, for the emulation build (see emu.h for the memory
 * and ordering model): devices with an H100's (NVLUA_EMU_CC=90, the default), a B200's (100), a
 * B300's (103), an RTX 5090's (120) or an A100's (80) properties and limits (the last two: GPUs nvlua
 * refuses, to test the refusal), device memory in a reserved range the host cannot read, copies and
 * memsets, streams and events executed in call order with cross-stream ordering checked, errors
 * with messages, counters, and the fault handler that names what a bad access touched.
 *
 * Device work runs when it is queued, so results appear at once; what the emulator checks is what a
 * GPU would do with the same calls: a copy from pageable host memory synchronises the host
 * (counted, like every other host synchronisation), a kernel fault is reported by the next
 * synchronising call, CUDA_VISIBLE_DEVICES is read once, when the runtime starts.
 * Faults are not sticky here (a GPU's context would be lost): tests go on after one.
 *
 * Not here: kernels (launch.cpp), cuBLASLt (blaslt.cpp), NCCL (nccl.cpp). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "emu.h"

namespace nvl_emu {

/* ---- lock, configuration -------------------------------------------------------------------------- */

std::recursive_mutex &big_lock() {
  static std::recursive_mutex mu;
  return mu;
}

static Config cfg;
static bool inited;
static std::vector<int> visible; /* visible device -> physical index */
static std::vector<cudaDeviceProp> dev_props;

const Config &config() { return cfg; }

static long env_int(const char *name, long def, long lo, long hi) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  long x = strtol(v, &end, 0);
  if (*end || x < lo || x > hi) {
    snprintf(cfg.bad, sizeof cfg.bad, "%s=%s is not an integer in %ld..%ld", name, v, lo, hi);
    return def;
  }
  return x;
}

static void read_order() {
  const char *o = getenv("NVLUA_EMU_ORDER");
  cfg.order = 0;
  cfg.seed = 1;
  if (!o || !*o || !strcmp(o, "forward")) return;
  if (!strcmp(o, "reverse")) {
    cfg.order = 1;
  } else if (!strncmp(o, "shuffle", 7) && (o[7] == 0 || o[7] == ':')) {
    cfg.order = 2;
    if (o[7] == ':') cfg.seed = strtoull(o + 8, NULL, 0);
  } else {
    snprintf(cfg.bad, sizeof cfg.bad, "NVLUA_EMU_ORDER=%s is not forward, reverse or shuffle[:SEED]", o);
  }
}

static size_t default_capacity() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  size_t phys = pages > 0 && page > 0 ? (size_t)pages * (size_t)page : (size_t)8 << 30;
  size_t c = phys / 2;
  return c > ((size_t)80 << 30) ? (size_t)80 << 30 : c;
}

/* CUDA_VISIBLE_DEVICES as the runtime reads it: indices up to the first invalid one. */
static void read_visible() {
  visible.clear();
  const char *v = getenv("CUDA_VISIBLE_DEVICES");
  if (!v) {
    for (int i = 0; i < cfg.gpus; i++) visible.push_back(i);
    return;
  }
  const char *p = v;
  while (*p) {
    char *end;
    long x = strtol(p, &end, 10);
    if (end == p || x < 0 || x >= cfg.gpus || std::count(visible.begin(), visible.end(), (int)x)) break;
    visible.push_back((int)x);
    p = end;
    while (*p == ' ') p++;
    if (*p != ',') break;
    p++;
  }
}

/* The devices NVLUA_EMU_CC emulates: name, SMs, and the shared memory a block may opt in to. */
struct Model {
  int cc;
  const char *name, *short_name;
  int sms, optin_kib;
};
static const Model models[] = {{90, "NVIDIA H100 80GB HBM3", "H100", 132, 227},
                               {100, "NVIDIA B200", "B200", 148, 227},
                               {103, "NVIDIA B300 SXM6 AC", "B300", 148, 227},
                               {120, "NVIDIA GeForce RTX 5090", "RTX 5090", 170, 99},
                               {80, "NVIDIA A100-SXM4-80GB", "A100", 108, 163}};

static const Model &model() {
  for (const Model &m : models)
    if (m.cc == cfg.cc) return m;
  return models[0];
}

static void fill_props() {
  dev_props.clear();
  const Model &m = model();
  for (size_t i = 0; i < visible.size(); i++) {
    cudaDeviceProp p;
    memset(&p, 0, sizeof p);
    snprintf(p.name, sizeof p.name, "%s (emulated on the CPU: physical GPU %d of %d)", m.name, visible[i], cfg.gpus);
    p.totalGlobalMem = cfg.capacity;
    p.sharedMemPerBlock = 48 * 1024;
    p.sharedMemPerBlockOptin = (size_t)m.optin_kib * 1024;
    p.warpSize = 32;
    p.maxThreadsPerBlock = 1024;
    p.maxThreadsDim[0] = p.maxThreadsDim[1] = 1024;
    p.maxThreadsDim[2] = 64;
    p.maxGridSize[0] = 2147483647;
    p.maxGridSize[1] = p.maxGridSize[2] = 65535;
    p.major = cfg.cc / 10;
    p.minor = cfg.cc % 10;
    p.multiProcessorCount = m.sms;
    p.pciBusID = 0x18 + 0x10 * visible[i]; /* PCI bus per physical GPU, as a machine numbers them */
    dev_props.push_back(p);
  }
}

static void memory_init();
static void install_fault_handler();

void init() {
  NVL_EMU_LOCK;
  if (inited) return;
  inited = true;
  cfg.bad[0] = 0;
  cfg.gpus = (int)env_int("NVLUA_EMU_GPUS", 1, 1, 8);
  cfg.cc = (int)env_int("NVLUA_EMU_CC", 90, 80, 120);
  bool known = false;
  for (const Model &m : models) known = known || m.cc == cfg.cc;
  if (!known) snprintf(cfg.bad, sizeof cfg.bad, "NVLUA_EMU_CC must be 90, 100, 103, 120 or 80");
  cfg.capacity = (size_t)env_int("NVLUA_EMU_MEMORY_MB", (long)(default_capacity() >> 20), 16, 1L << 30) << 20;
  read_order();
  cfg.fatal = (int)env_int("NVLUA_EMU_FATAL", 0, 0, 1);
  const char *fill = getenv("NVLUA_EMU_FILL");
  cfg.fill = fill && !strcmp(fill, "none") ? -1 : (int)env_int("NVLUA_EMU_FILL", 0xFF, 0, 255);
  cfg.cuda_aware_mpi = (int)env_int("NVLUA_EMU_CUDA_AWARE_MPI", 0, 0, 1);
  if (cfg.bad[0]) {
    fprintf(stderr, "nvlua cuda emulator: %s; no device is available\n", cfg.bad);
    return;
  }
  read_visible();
  fill_props();
  memory_init();
  install_fault_handler();
}

int visible_devices() {
  init();
  return cfg.bad[0] ? 0 : (int)visible.size();
}
const cudaDeviceProp &props(int dev) { return dev_props[(size_t)dev]; }
int physical_index(int dev) { return visible[(size_t)dev]; }

static thread_local int cur_dev;
int current_device() { return cur_dev; }

/* ---- errors ------------------------------------------------------------------------------------------- */

static thread_local cudaError_t last_error = cudaSuccess;
static thread_local cudaError_t detail_code = cudaSuccess;
static thread_local char detail_msg[1024];
static cudaError_t pending = cudaSuccess;
static char pending_msg[1024];

static const char *doc_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "unknown error";
  }
}

cudaError_t refuse(cudaError_t e, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char msg[768];
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  last_error = e;
  detail_code = e;
  snprintf(detail_msg, sizeof detail_msg, "%s [cuda emulator: %s]", doc_string(e), msg);
  return e;
}

void fault(cudaError_t e, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char msg[768];
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "nvlua cuda emulator: %s\n", msg);
  fflush(stderr);
  if (cfg.fatal) abort();
  if (pending == cudaSuccess) {
    pending = e;
    snprintf(pending_msg, sizeof pending_msg, "%s [cuda emulator: %s]", doc_string(e), msg);
  }
}

cudaError_t take_fault() {
  cudaError_t e = pending;
  if (e != cudaSuccess) {
    detail_code = e;
    snprintf(detail_msg, sizeof detail_msg, "%s", pending_msg);
    pending = cudaSuccess;
  }
  return e;
}

const char *detail_of(cudaError_t e) { return e == detail_code && detail_msg[0] ? detail_msg : NULL; }

/* ---- counters -------------------------------------------------------------------------------------- */

static Counters ctr;
Counters &counters() { return ctr; }

KernelCount &kernel_counter(const void *key, const char *name) {
  for (KernelCount &k : ctr.kernels)
    if (k.key == key) return k;
  ctr.kernels.push_back(KernelCount{key, name, 0, 0, 0, 0, 0});
  return ctr.kernels.back();
}

void count_gemm(const GemmCount &g) {
  ctr.gemm_flops += g.flops;
  for (GemmCount &x : ctr.gemm_shapes)
    if (x.type_a == g.type_a && x.type_b == g.type_b && x.type_d == g.type_d && x.scale_mode == g.scale_mode &&
        x.m == g.m && x.n == g.n && x.k == g.k) {
      x.calls += g.calls;
      x.flops += g.flops;
      x.bytes_a += g.bytes_a;
      x.bytes_b += g.bytes_b;
      x.bytes_c += g.bytes_c;
      x.bytes_d += g.bytes_d;
      x.bytes_scales += g.bytes_scales;
      return;
    }
  ctr.gemm_shapes.push_back(g);
}

/* ---- memory ------------------------------------------------------------------------------------------ */

static const size_t PAGE = 4096;
static uintptr_t dbase;   /* the device range (PROT_NONE, never touched) */
static char *hbase;       /* the host view range (pages of live allocations read-write) */
static size_t range_bytes;
static size_t next_page;  /* bump pointer, in pages */
static std::map<size_t, size_t> free_runs; /* first page -> pages */
static std::map<uintptr_t, Alloc *> live;  /* device address of each allocation's first byte */
static std::map<uintptr_t, size_t> pinned; /* cudaMallocHost blocks */
static size_t used_bytes[8];

static char *reserve(size_t bytes) {
  const size_t align = (size_t)1 << 30;
  void *p = mmap(NULL, bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return NULL;
  uintptr_t a = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
  return (char *)a;
}

static void memory_init() {
  range_bytes = (cfg.capacity * (size_t)cfg.gpus) * 2 + ((size_t)1 << 30);
  char *d = reserve(range_bytes), *h = reserve(range_bytes);
  if (!d || !h) {
    snprintf(cfg.bad, sizeof cfg.bad, "cannot reserve %zu MiB of address space for device memory", range_bytes >> 20);
    return;
  }
  dbase = (uintptr_t)d;
  hbase = h;
}

bool in_device_range(const void *p) { return (uintptr_t)p >= dbase && (uintptr_t)p < dbase + range_bytes && dbase; }

Alloc *find_alloc(const void *p, size_t bytes) {
  if (!in_device_range(p)) return NULL;
  auto it = live.upper_bound((uintptr_t)p);
  if (it == live.begin()) return NULL;
  --it;
  Alloc *a = it->second;
  uintptr_t x = (uintptr_t)p;
  if (x < a->d || x > a->d + a->size || bytes > a->d + a->size - x) return NULL;
  if (x == a->d + a->size && bytes) return NULL;
  return a;
}

bool is_pinned_host(const void *p, size_t bytes) {
  auto it = pinned.upper_bound((uintptr_t)p);
  if (it == pinned.begin()) return false;
  --it;
  return (uintptr_t)p >= it->first && (uintptr_t)p + bytes <= it->first + it->second;
}

std::string describe_ptr(const void *p) {
  char buf[200];
  if (!in_device_range(p)) return "host memory";
  auto it = live.upper_bound((uintptr_t)p);
  if (it != live.begin()) {
    --it;
    Alloc *a = it->second;
    uintptr_t x = (uintptr_t)p;
    if (x >= a->d && x < a->d + a->pages * PAGE) {
      if (x < a->d + a->size)
        snprintf(buf, sizeof buf, "byte %zu of the %zu-byte device allocation at %p (cuda:%d)", (size_t)(x - a->d),
                 a->size, (void *)a->d, a->dev);
      else
        snprintf(buf, sizeof buf, "%zu bytes past the end of the %zu-byte device allocation at %p (cuda:%d)",
                 (size_t)(x - a->d - a->size), a->size, (void *)a->d, a->dev);
      return buf;
    }
  }
  snprintf(buf, sizeof buf, "device address %p, in no live allocation (freed, or never allocated)", p);
  return buf;
}

/* n pages of the ranges: best fit among freed runs, else fresh. */
static bool take_pages(size_t n, size_t *first) {
  auto best = free_runs.end();
  for (auto it = free_runs.begin(); it != free_runs.end(); ++it)
    if (it->second >= n && (best == free_runs.end() || it->second < best->second)) best = it;
  if (best != free_runs.end()) {
    *first = best->first;
    size_t rest = best->second - n;
    free_runs.erase(best);
    if (rest) free_runs[*first + n] = rest;
    return true;
  }
  if ((next_page + n) * PAGE > range_bytes) return false;
  *first = next_page;
  next_page += n;
  return true;
}

static void give_pages(size_t first, size_t n) {
  auto next = free_runs.find(first + n);
  if (next != free_runs.end()) {
    n += next->second;
    free_runs.erase(next);
  }
  auto prev = free_runs.lower_bound(first);
  if (prev != free_runs.begin()) {
    --prev;
    if (prev->first + prev->second == first) {
      prev->second += n;
      return;
    }
  }
  free_runs[first] = n;
}

static cudaError_t device_alloc(void **out, size_t bytes) {
  const int dev = cur_dev;
  size_t body = (bytes + 255) & ~(size_t)255;
  if (body == 0) body = 256;
  size_t pages = (body + PAGE - 1) / PAGE + 1; /* + the guard page */
  if (used_bytes[dev] + pages * PAGE > cfg.capacity)
    return refuse(cudaErrorMemoryAllocation, "cudaMalloc(%zu bytes) on cuda:%d: %zu of %zu MiB in use", bytes, dev,
                  used_bytes[dev] >> 20, cfg.capacity >> 20);
  size_t first;
  if (!take_pages(pages, &first))
    return refuse(cudaErrorMemoryAllocation, "cudaMalloc(%zu bytes): the emulator's address range is full", bytes);
  char *h = hbase + first * PAGE;
  if (mprotect(h, (pages - 1) * PAGE, PROT_READ | PROT_WRITE) != 0) {
    give_pages(first, pages);
    return refuse(cudaErrorMemoryAllocation, "cudaMalloc(%zu bytes): mprotect failed: %s", bytes, strerror(errno));
  }
  const size_t start = (pages - 1) * PAGE - body; /* the body ends where the guard page starts */
  Alloc *a = new Alloc();
  a->d = dbase + first * PAGE + start;
  a->h = h + start;
  a->size = bytes;
  a->off = first;
  a->pages = pages;
  a->dev = dev;
  a->w_stream = -1;
  if (cfg.fill >= 0) memset(a->h, cfg.fill, body);
  live[a->d] = a;
  used_bytes[dev] += pages * PAGE;
  *out = (void *)a->d;
  return cudaSuccess;
}

static void device_release(Alloc *a) {
  char *h = hbase + a->off * PAGE;
  madvise(h, (a->pages - 1) * PAGE, MADV_DONTNEED);
  mprotect(h, (a->pages - 1) * PAGE, PROT_NONE);
  give_pages(a->off, a->pages);
  used_bytes[a->dev] -= a->pages * PAGE;
  live.erase(a->d);
  delete a;
}

/* ---- streams, events, ordering ------------------------------------------------------------------------ */

typedef std::vector<uint64_t> Clock;

struct Stream {
  int id, dev;
  bool legacy, blocking, destroyed;
  uint64_t seq;
  Clock known;          /* what this stream's next op is ordered after: op numbers per stream id */
  cudaStream_t handle;  /* NULL for the legacy streams */
};

static std::vector<Stream *> streams;     /* by id */
static std::vector<Stream *> legacy_of;   /* by device */
static Clock host_known;

static void merge(Clock &a, const Clock &b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (size_t i = 0; i < b.size(); i++) a[i] = std::max(a[i], b[i]);
}

static Clock full_clock(const Stream *s) {
  Clock c = s->known;
  if (c.size() <= (size_t)s->id) c.resize((size_t)s->id + 1, 0);
  c[(size_t)s->id] = s->seq;
  return c;
}

static uint64_t known_of(const Clock &c, int id) { return (size_t)id < c.size() ? c[(size_t)id] : 0; }

static Stream *new_stream(int dev, bool legacy, bool blocking) {
  Stream *s = new Stream{(int)streams.size(), dev, legacy, blocking, false, 0, Clock(), NULL};
  streams.push_back(s);
  return s;
}

static Stream *legacy_stream(int dev) {
  if (legacy_of.size() <= (size_t)dev) legacy_of.resize((size_t)dev + 1, NULL);
  if (!legacy_of[(size_t)dev]) legacy_of[(size_t)dev] = new_stream(dev, true, true);
  return legacy_of[(size_t)dev];
}

}  // namespace nvl_emu

struct nvl_emu_stream {
  nvl_emu::Stream *s;
};
struct nvl_emu_event {
  nvl_emu::Clock clock;
  bool recorded, timing;
  double t;
  int dev;
};

namespace nvl_emu {

Stream *stream_of(cudaStream_t h, const char *fn) {
  if (!h) return legacy_stream(cur_dev);
  for (Stream *s : streams)
    if (s->handle == h && !s->destroyed) return s;
  refuse(cudaErrorInvalidResourceHandle, "%s: %p is not a live stream", fn, (void *)h);
  return NULL;
}

std::string stream_name(const Stream *s) {
  char b[96];
  if (s->legacy) snprintf(b, sizeof b, "the legacy default stream of cuda:%d", s->dev);
  else snprintf(b, sizeof b, "%s stream #%d of cuda:%d", s->blocking ? "blocking" : "non-blocking", s->id, s->dev);
  return b;
}

int stream_device(const Stream *s) { return s->dev; }

/* What s's next op is ordered after: the host's knowledge, and the legacy stream's implicit waits
 * (it waits for the blocking streams of its device, they wait for it). */
static void prepare(Stream *s) {
  merge(s->known, host_known);
  if (s->legacy) {
    for (Stream *b : streams)
      if (b != s && !b->legacy && b->blocking && b->dev == s->dev) merge(s->known, full_clock(b));
  } else if (s->blocking) {
    merge(s->known, full_clock(legacy_stream(s->dev)));
  }
}

static bool check_access(Stream *s, uint64_t seq, const char *name, const Access &x) {
  Alloc *a = x.a;
  if (a->w_stream >= 0 && a->w_stream != s->id && known_of(s->known, a->w_stream) < a->w_seq) {
    fault(cudaErrorLaunchFailure, "stream-order race: %s on %s %s %s (%zu-byte allocation at %p), last written by %s "
          "on %s, with no event wait or synchronisation in between", name, stream_name(s).c_str(),
          x.mode & ACC_WRITE ? "writes" : "reads", x.what, a->size, (void *)a->d, a->w_what,
          stream_name(streams[(size_t)a->w_stream]).c_str());
    return false;
  }
  if (x.mode & ACC_WRITE) {
    for (size_t r = 0; r < a->r_seq.size(); r++) {
      if ((int)r == s->id || !a->r_seq[r] || known_of(s->known, (int)r) >= a->r_seq[r]) continue;
      fault(cudaErrorLaunchFailure, "stream-order race: %s on %s writes %s (%zu-byte allocation at %p), which %s "
            "still reads, with no event wait or synchronisation in between", name, stream_name(s).c_str(), x.what,
            a->size, (void *)a->d, stream_name(streams[r]).c_str());
      return false;
    }
  }
  (void)seq;
  return true;
}

bool op_enqueue(Stream *s, const char *name, const Access *acc, int n) {
  prepare(s);
  uint64_t seq = ++s->seq;
  for (int i = 0; i < n; i++)
    if (!check_access(s, seq, name, acc[i])) return false;
  for (int i = 0; i < n; i++) {
    Alloc *a = acc[i].a;
    if (acc[i].mode & ACC_WRITE) {
      a->w_stream = s->id;
      a->w_seq = seq;
      a->w_what = name;
      a->r_seq.clear();
    } else {
      if (a->r_seq.size() <= (size_t)s->id) a->r_seq.resize((size_t)s->id + 1, 0);
      a->r_seq[(size_t)s->id] = seq;
    }
  }
  return true;
}

void host_waits_for(Stream *s) { merge(host_known, full_clock(s)); }

static double now_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* ---- global-memory bytes of a launch (emu.h: track_begin) ------------------------------------------------ */

struct Tracked {
  Alloc *a;
  char *first;               /* the host view of the allocation's first page */
  size_t npages;             /* its pages, the guard page not included */
  std::vector<uint8_t> mark; /* per page: 1 read, 2 written */
};
static std::vector<Tracked> tracked;
static size_t n_tracked;
static volatile sig_atomic_t tracking;

bool bytes_tracking_supported() {
#if defined(__x86_64__)
  return true;
#else
  return false;
#endif
}

void track_begin(const Access *acc, int n) {
  if (!bytes_tracking_supported()) return;
  if (tracked.size() < (size_t)n) tracked.resize((size_t)n);
  n_tracked = 0;
  for (int i = 0; i < n; i++) {
    Alloc *a = acc[i].a;
    if (a->pinned_host) continue;
    Tracked &t = tracked[n_tracked++];
    t.a = a;
    t.first = hbase + a->off * PAGE;
    t.npages = a->pages - 1;
    t.mark.assign(t.npages, 0);
    mprotect(t.first, t.npages * PAGE, PROT_NONE);
  }
  tracking = 1;
}

void track_end(KernelCount &k) {
  if (!bytes_tracking_supported()) return;
  tracking = 0;
  for (size_t j = 0; j < n_tracked; j++) {
    Tracked &t = tracked[j];
    const uintptr_t lo = (uintptr_t)t.a->h, hi = lo + t.a->size;
    for (size_t i = 0; i < t.npages; i++) {
      if (!t.mark[i]) continue;
      const uintptr_t page = (uintptr_t)t.first + i * PAGE;
      const uintptr_t p0 = std::max(lo, page), p1 = std::min(hi, page + PAGE);
      const int64_t b = p1 > p0 ? (int64_t)(p1 - p0) : 0;
      if (t.mark[i] & 1) k.bytes_read += b;
      if (t.mark[i] & 2) k.bytes_written += b;
    }
    mprotect(t.first, t.npages * PAGE, PROT_READ | PROT_WRITE);
  }
  n_tracked = 0;
}

/* A fault on a page of a tracked allocation: mark it (a store: written, else read), open it for what
 * the access needs, and let the instruction run again. False: not a tracking fault. */
static bool track_fault(const void *addr, void *uc) {
#if defined(__x86_64__)
  if (!tracking) return false;
  const uintptr_t x = (uintptr_t)addr;
  for (size_t j = 0; j < n_tracked; j++) {
    Tracked &t = tracked[j];
    if (x < (uintptr_t)t.first || x >= (uintptr_t)t.first + t.npages * PAGE) continue;
    const size_t i = (x - (uintptr_t)t.first) / PAGE;
    const bool write = (((ucontext_t *)uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
    const uint8_t bit = write ? 2 : 1;
    if (t.mark[i] & bit) return false; /* already open for this access: not ours */
    t.mark[i] |= bit;
    return mprotect(t.first + i * PAGE, PAGE, write ? PROT_READ | PROT_WRITE : PROT_READ) == 0;
  }
#else
  (void)addr;
  (void)uc;
#endif
  return false;
}

/* ---- the fault handler ------------------------------------------------------------------------------------ */

static void on_segv(int sig, siginfo_t *si, void *uc) {
  const void *addr = si->si_addr;
  if (track_fault(addr, uc)) return;
  char msg[1024];
  const bool kern = in_kernel();
  std::string where = kern ? kernel_context() : "host code";
  if (in_device_range(addr)) {
    snprintf(msg, sizeof msg, "%s dereferenced device memory: %s. Host code must copy device memory "
             "(cudaMemcpy) instead of reading it.", where.c_str(), describe_ptr(addr).c_str());
  } else if ((uintptr_t)addr >= (uintptr_t)hbase && (uintptr_t)addr < (uintptr_t)hbase + range_bytes) {
    const void *d = (const void *)(dbase + ((uintptr_t)addr - (uintptr_t)hbase));
    snprintf(msg, sizeof msg, "%s accessed device memory out of bounds: %s", where.c_str(), describe_ptr(d).c_str());
  } else if (in_fiber_guard(addr)) {
    snprintf(msg, sizeof msg, "%s overflowed its stack (the emulator's fiber stacks are 64 KiB)", where.c_str());
  } else if (kern) {
    snprintf(msg, sizeof msg, "%s accessed %p, which is not device memory (a host pointer, or garbage): on a GPU an "
             "illegal address", where.c_str(), addr);
  } else {
    signal(sig, SIG_DFL); /* not ours: the usual crash */
    return;
  }
  fprintf(stderr, "nvlua cuda emulator: fatal: %s\n", msg);
  fflush(stderr);
  signal(SIGABRT, SIG_DFL);
  abort();
}

static void install_fault_handler() {
  static char altstack[64 * 1024];
  stack_t ss;
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
}

}  // namespace nvl_emu

using namespace nvl_emu;

/* ---- the API ------------------------------------------------------------------------------------------------ */

extern "C" {

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
#define N(x) \
  case x: return #x;
    N(cudaSuccess) N(cudaErrorInvalidValue) N(cudaErrorMemoryAllocation) N(cudaErrorInvalidConfiguration)
    N(cudaErrorInsufficientDriver) N(cudaErrorInvalidDeviceFunction) N(cudaErrorNoDevice) N(cudaErrorInvalidDevice)
    N(cudaErrorInvalidResourceHandle) N(cudaErrorNotReady) N(cudaErrorIllegalAddress)
    N(cudaErrorLaunchOutOfResources) N(cudaErrorLaunchFailure) N(cudaErrorNotSupported)
#undef N
    default: return "cudaErrorUnknown";
  }
}

const char *cudaGetErrorString(cudaError_t e) {
  const char *d = detail_of(e);
  return d ? d : doc_string(e);
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error; }

cudaError_t cudaGetDeviceCount(int *n) {
  NVL_EMU_LOCK;
  init();
  *n = visible_devices();
  if (cfg.bad[0]) return refuse(cudaErrorNoDevice, "%s", cfg.bad);
  return *n ? cudaSuccess : refuse(cudaErrorNoDevice, "CUDA_VISIBLE_DEVICES hides every emulated device");
}

static cudaError_t check_dev(int dev, const char *fn) {
  init();
  if (dev < 0 || dev >= visible_devices())
    return refuse(cudaErrorInvalidDevice, "%s(%d): %d device(s) visible", fn, dev, visible_devices());
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev) {
  NVL_EMU_LOCK;
  cudaError_t e = check_dev(dev, "cudaSetDevice");
  if (e == cudaSuccess) cur_dev = dev;
  return e;
}

cudaError_t cudaGetDevice(int *dev) {
  init();
  *dev = cur_dev;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
  NVL_EMU_LOCK;
  cudaError_t e = check_dev(dev, "cudaGetDeviceProperties");
  if (e == cudaSuccess) *p = props(dev);
  return e;
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr attr, int dev) {
  NVL_EMU_LOCK;
  cudaError_t e = check_dev(dev, "cudaDeviceGetAttribute");
  if (e != cudaSuccess) return e;
  const cudaDeviceProp &p = props(dev);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *v = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrMultiProcessorCount: *v = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *v = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *v = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = (int)p.sharedMemPerBlockOptin; break;
    default: return refuse(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d is not modelled", (int)attr);
  }
  return cudaSuccess;
}

/* The emulator stands for the runtime and driver of CUDA 12.8. */
cudaError_t cudaDriverGetVersion(int *v) {
  *v = 12080;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = 12080;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  NVL_EMU_LOCK;
  init();
  ctr.host_syncs++;
  for (Stream *s : streams)
    if (s->dev == cur_dev) host_waits_for(s);
  return take_fault();
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
  NVL_EMU_LOCK;
  *p = NULL;
  cudaError_t e = check_dev(cur_dev, "cudaMalloc");
  return e != cudaSuccess ? e : device_alloc(p, bytes);
}

/* cudaFree waits for the device (as the real one does) before it releases the memory. */
cudaError_t cudaFree(void *p) {
  NVL_EMU_LOCK;
  if (!p) return cudaSuccess;
  auto it = live.find((uintptr_t)p);
  if (it == live.end())
    return refuse(cudaErrorInvalidValue, "cudaFree(%p): not the start of a live device allocation (%s)", p,
                  describe_ptr(p).c_str());
  ctr.host_syncs++;
  for (Stream *s : streams) host_waits_for(s);
  device_release(it->second);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
  NVL_EMU_LOCK;
  *p = aligned_alloc(256, (bytes + 255) & ~(size_t)255);
  if (!*p) return refuse(cudaErrorMemoryAllocation, "cudaMallocHost(%zu bytes)", bytes);
  pinned[(uintptr_t)*p] = bytes;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
  NVL_EMU_LOCK;
  if (!p) return cudaSuccess;
  if (!pinned.erase((uintptr_t)p)) return refuse(cudaErrorInvalidValue, "cudaFreeHost(%p): not pinned memory", p);
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  NVL_EMU_LOCK;
  init();
  *total = cfg.capacity;
  *free_bytes = cfg.capacity - std::min(cfg.capacity, used_bytes[cur_dev]);
  return cudaSuccess;
}

}  // extern "C"

/* ---- copies ----------------------------------------------------------------------------------------------- */

namespace nvl_emu {

static const char *kind_name(cudaMemcpyKind k) {
  static const char *const n[] = {"host->host", "host->device", "device->host", "device->device", "default"};
  return (unsigned)k <= 4 ? n[k] : "?";
}

/* Resolve one side of a copy: the allocation of a device side, NULL for a host side; false (error set)
 * when the pointer is not what the kind says. */
static bool copy_side(const void *p, size_t bytes, bool device, const char *side, cudaMemcpyKind k, Alloc **a) {
  *a = NULL;
  if (!device) {
    if (in_device_range(p))
      return refuse(cudaErrorInvalidValue, "cudaMemcpy %s: the %s %p is device memory", kind_name(k), side, p), false;
    return true;
  }
  *a = find_alloc(p, bytes);
  if (!*a)
    return refuse(cudaErrorInvalidValue, "cudaMemcpy %s of %zu bytes: the %s is not in one device allocation (%s)",
                  kind_name(k), bytes, side, describe_ptr(p).c_str()), false;
  if ((*a)->dev != cur_dev)
    return refuse(cudaErrorInvalidValue, "cudaMemcpy %s: the %s is memory of cuda:%d, the current device is cuda:%d",
                  kind_name(k), side, (*a)->dev, cur_dev), false;
  return true;
}

/* A copy queued on s; sync: the blocking cudaMemcpy. The host waits where CUDA says it does: before
 * a copy from pageable memory, after a copy to pageable memory, and after any cudaMemcpy to the host. */
static cudaError_t copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, Stream *s, bool sync) {
  if (kind == cudaMemcpyDefault) {
    bool dd = in_device_range(dst), ds = in_device_range(src);
    kind = dd ? (ds ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
              : (ds ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool dev_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool dev_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  Alloc *ad, *as;
  if (!copy_side(dst, bytes, dev_dst, "destination", kind, &ad) || !copy_side(src, bytes, dev_src, "source", kind, &as))
    return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  const bool from_pageable = kind == cudaMemcpyHostToDevice && !is_pinned_host(src, bytes);
  const bool to_host_waits = kind == cudaMemcpyDeviceToHost && (sync || !is_pinned_host(dst, bytes));
  if (from_pageable) {
    ctr.host_syncs++;
    host_waits_for(s);
  }
  Access acc[2] = {};
  int n = 0;
  if (ad) acc[n++] = Access{ad, ACC_WRITE, "the destination"};
  if (as) acc[n++] = Access{as, ACC_READ, "the source"};
  static const char *const names[] = {"a host->host copy", "a host->device copy", "a device->host copy",
                                      "a device->device copy"};
  if (op_enqueue(s, names[kind], acc, n))
    memmove(ad ? host_view(ad, dst) : (char *)dst, as ? host_view(as, src) : (const char *)src, bytes);
  (kind == cudaMemcpyHostToDevice ? ctr.memcpy_h2d : kind == cudaMemcpyDeviceToHost ? ctr.memcpy_d2h
                                                                                       : ctr.memcpy_d2d)++;
  if (kind != cudaMemcpyHostToHost)
    (kind == cudaMemcpyHostToDevice ? ctr.memcpy_h2d_bytes : kind == cudaMemcpyDeviceToHost ? ctr.memcpy_d2h_bytes
                                                                                           : ctr.memcpy_d2d_bytes) +=
        (int64_t)bytes;
  if (to_host_waits) {
    ctr.host_syncs++;
    host_waits_for(s);
    return take_fault();
  }
  return cudaSuccess;
}

}  // namespace nvl_emu

extern "C" {

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
  NVL_EMU_LOCK;
  init();
  if ((unsigned)kind > cudaMemcpyDefault) return refuse(cudaErrorInvalidValue, "cudaMemcpy: kind %d", (int)kind);
  return copy(dst, src, bytes, kind, legacy_stream(cur_dev), true);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t h) {
  NVL_EMU_LOCK;
  init();
  Stream *s = stream_of(h, "cudaMemcpyAsync");
  if (!s) return cudaErrorInvalidResourceHandle;
  if ((unsigned)kind > cudaMemcpyDefault) return refuse(cudaErrorInvalidValue, "cudaMemcpyAsync: kind %d", (int)kind);
  return copy(dst, src, bytes, kind, s, false);
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t h) {
  NVL_EMU_LOCK;
  init();
  Stream *s = stream_of(h, "cudaMemsetAsync");
  if (!s) return cudaErrorInvalidResourceHandle;
  Alloc *a = find_alloc(p, bytes);
  if (!a || a->dev != cur_dev)
    return refuse(cudaErrorInvalidValue, "cudaMemsetAsync of %zu bytes at %p: not in one allocation of cuda:%d (%s)",
                  bytes, p, cur_dev, describe_ptr(p).c_str());
  if (bytes == 0) return cudaSuccess;
  Access acc{a, ACC_WRITE, "its destination"};
  if (op_enqueue(s, "cudaMemsetAsync", &acc, 1)) memset(host_view(a, p), v, bytes);
  ctr.memsets++;
  ctr.memset_bytes += (int64_t)bytes;
  return cudaSuccess;
}

/* ---- streams and events ---------------------------------------------------------------------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *h, unsigned flags) {
  NVL_EMU_LOCK;
  init();
  if (flags & ~1u) return refuse(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: flags 0x%x", flags);
  Stream *s = new_stream(cur_dev, false, !(flags & cudaStreamNonBlocking));
  *h = new nvl_emu_stream{s};
  s->handle = *h;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  NVL_EMU_LOCK;
  Stream *s = h ? stream_of(h, "cudaStreamDestroy") : NULL;
  if (!s) return refuse(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(%p): not a stream", (void *)h);
  s->destroyed = true; /* its id stays: allocations may still name it as their last writer */
  delete h;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  NVL_EMU_LOCK;
  init();
  Stream *s = stream_of(h, "cudaStreamSynchronize");
  if (!s) return cudaErrorInvalidResourceHandle;
  ctr.host_syncs++;
  host_waits_for(s);
  return take_fault();
}

/* Work runs when queued, so a query always finds it done: the host then knows it is. */
cudaError_t cudaStreamQuery(cudaStream_t h) {
  NVL_EMU_LOCK;
  init();
  Stream *s = stream_of(h, "cudaStreamQuery");
  if (!s) return cudaErrorInvalidResourceHandle;
  ctr.queries++;
  host_waits_for(s);
  return take_fault();
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t e, unsigned flags) {
  NVL_EMU_LOCK;
  init();
  Stream *s = stream_of(h, "cudaStreamWaitEvent");
  if (!s) return cudaErrorInvalidResourceHandle;
  if (!e || flags) return refuse(cudaErrorInvalidValue, "cudaStreamWaitEvent: event %p, flags %u", (void *)e, flags);
  merge(s->known, e->clock); /* an unrecorded event: nothing to wait for */
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  NVL_EMU_LOCK;
  init();
  if (flags & ~(unsigned)cudaEventDisableTiming)
    return refuse(cudaErrorInvalidValue, "cudaEventCreateWithFlags: flags 0x%x are not modelled", flags);
  *e = new nvl_emu_event{Clock(), false, !(flags & cudaEventDisableTiming), 0.0, cur_dev};
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  NVL_EMU_LOCK;
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t h) {
  NVL_EMU_LOCK;
  init();
  Stream *s = stream_of(h, "cudaEventRecord");
  if (!s) return cudaErrorInvalidResourceHandle;
  if (!e) return refuse(cudaErrorInvalidResourceHandle, "cudaEventRecord: NULL event");
  prepare(s);
  e->clock = full_clock(s);
  e->recorded = true;
  e->t = now_ms();
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  NVL_EMU_LOCK;
  if (!e) return refuse(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: NULL event");
  ctr.host_syncs++;
  merge(host_known, e->clock);
  return take_fault();
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  NVL_EMU_LOCK;
  if (!e) return refuse(cudaErrorInvalidResourceHandle, "cudaEventQuery: NULL event");
  ctr.queries++;
  merge(host_known, e->clock);
  return take_fault();
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  NVL_EMU_LOCK;
  if (!a || !b || !a->recorded || !b->recorded || !a->timing || !b->timing)
    return refuse(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: both events must be recorded, with timing");
  *ms = (float)(b->t - a->t);
  return cudaSuccess;
}

/* ---- nvlua's view: description and counters (device.cu) ------------------------------------------------------ */

const char *nvl_emu_description(void) {
  static char d[400];
  init();
  snprintf(d, sizeof d, "emulated on the CPU (kernels/cuda/emu): %d %s device(s), sm_%d, thread order %s; "
           "results are the CPU's, not a GPU's", cfg.gpus, model().short_name, cfg.cc,
           cfg.order == 0 ? "forward" : cfg.order == 1 ? "reverse" : "shuffled");
  return d;
}


static const char *const counter_names[] = {"launches", "host_syncs", "queries", "memcpy_h2d", "memcpy_d2h",
                                            "memcpy_d2d", "memsets", "gemms", "heuristics", "collectives",
                                            "cudnn_plans", "cudnn_executes", "memcpy_h2d_bytes", "memcpy_d2h_bytes",
                                            "memcpy_d2d_bytes", "memset_bytes", "gemm_flops", "gemm_subnormals"};

const char *nvl_emu_counter(int i, int64_t *value) {
  NVL_EMU_LOCK;
  const int64_t v[] = {ctr.launches, ctr.host_syncs, ctr.queries, ctr.memcpy_h2d, ctr.memcpy_d2h,
                       ctr.memcpy_d2d, ctr.memsets, ctr.gemms, ctr.heuristics, ctr.collectives,
                       ctr.cudnn_plans, ctr.cudnn_executes, ctr.memcpy_h2d_bytes, ctr.memcpy_d2h_bytes,
                       ctr.memcpy_d2d_bytes, ctr.memset_bytes, ctr.gemm_flops, ctr.gemm_subnormals};
  if (i < 0 || i >= (int)(sizeof v / sizeof v[0])) return NULL;
  *value = v[i];
  return counter_names[i];
}

const char *nvl_emu_kernel_counter(int i, int64_t *launches, int64_t *blocks, int64_t *threads) {
  NVL_EMU_LOCK;
  if (i < 0 || i >= (int)ctr.kernels.size()) return NULL;
  const KernelCount &k = ctr.kernels[(size_t)i];
  *launches = k.launches;
  *blocks = k.blocks;
  *threads = k.threads;
  return k.name.c_str();
}

int nvl_emu_kernel_bytes(int i, int64_t *read, int64_t *written) {
  NVL_EMU_LOCK;
  if (i < 0 || i >= (int)ctr.kernels.size()) return 0;
  *read = ctr.kernels[(size_t)i].bytes_read;
  *written = ctr.kernels[(size_t)i].bytes_written;
  return 1;
}

int nvl_emu_bytes_counted(void) { return bytes_tracking_supported(); }

int nvl_emu_gemm_counter(int i, nvl_emu_gemm_info *g) {
  NVL_EMU_LOCK;
  if (i < 0 || i >= (int)ctr.gemm_shapes.size()) return 0;
  const GemmCount &x = ctr.gemm_shapes[(size_t)i];
  g->type_a = x.type_a;
  g->type_b = x.type_b;
  g->type_d = x.type_d;
  g->scale_mode = x.scale_mode;
  g->m = x.m;
  g->n = x.n;
  g->k = x.k;
  g->calls = x.calls;
  g->flops = x.flops;
  g->bytes_a = x.bytes_a;
  g->bytes_b = x.bytes_b;
  g->bytes_c = x.bytes_c;
  g->bytes_d = x.bytes_d;
  g->bytes_scales = x.bytes_scales;
  return 1;
}

/* Kernels are forgotten (their names come back at their next launch). */
void nvl_emu_reset_counters(void) {
  NVL_EMU_LOCK;
  ctr = Counters();
}

}  // extern "C"
