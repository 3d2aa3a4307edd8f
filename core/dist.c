/* dist.c: the process group and the collectives on CPU tensors (see dist.h). MPI when nvlua was
 * built with it (NVLUA_HAVE_MPI) and a launcher started the process; else a world of one.
 * CUDA tensors are handed to core/dist_nccl.c. A watchdog thread (worlds larger than one) ends a
 * process whose collective has waited longer than the timeout: MPI has no timeouts of its own.
 * Not here: Lua, NCCL calls, what training reduces. */
#include "dist.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef NVLUA_HAVE_MPI
#include <mpi.h>
#endif
#include "dist_nccl.h"

const char *const nvl_dist_op_names[NVL_DIST_OP_COUNT] = {"sum", "avg", "max", "min"};

static struct {
  int init, finalized, use_mpi;
  int rank, world, local_rank, local_size;
  int multiple;       /* MPI_THREAD_MULTIPLE was granted */
  int asked_multiple; /* and asked for (MPI may grant less) */
} S = {0, 0, 0, 0, 1, 0, 1, 0, 0};

/* ---- the row split and the byte counters (dist.h) --------------------------------------------- */

void nvl_dist_shard_rows(int64_t rows, int world, int64_t align, int rank, int64_t *row0, int64_t *n, int64_t *chunk) {
  if (rows < 0) rows = 0;
  if (world < 1) world = 1;
  if (align < 1) align = 1;
  int64_t units = (rows + align - 1) / align;
  int64_t c = (units + world - 1) / world * align;
  int64_t a = (int64_t)rank * c, b = a + c;
  if (a > rows) a = rows;
  if (b > rows) b = rows;
  *row0 = a;
  *n = b - a;
  *chunk = c;
}

const char *const nvl_dist_bytes_names[NVL_DIST_BYTES_COUNT] = {"all_gather", "reduce_scatter", "all_reduce",
                                                                 "broadcast"};
static _Atomic long long bytes_sent[NVL_DIST_BYTES_COUNT];

int64_t nvl_dist_bytes(nvl_dist_bytes_kind kind) {
  return (unsigned)kind < NVL_DIST_BYTES_COUNT ? (int64_t)atomic_load(&bytes_sent[kind]) : 0;
}

void nvl_dist_bytes_reset(void) {
  for (int k = 0; k < NVL_DIST_BYTES_COUNT; k++) atomic_store(&bytes_sent[k], 0);
}

/* Count a collective over `bytes` bytes (the gathered, scattered, reduced or broadcast tensor). */
static void count_bytes(nvl_dist_bytes_kind kind, size_t bytes) {
  int n = S.world;
  if (n <= 1) return;
  long long b = (long long)bytes * (n - 1) / n;
  if (kind == NVL_DIST_BYTES_ALL_REDUCE) b = 2 * (long long)bytes * (n - 1) / n;
  atomic_fetch_add(&bytes_sent[kind], b);
}

#ifdef NVLUA_HAVE_MPI
static MPI_Comm comm = MPI_COMM_NULL; /* a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN */
static MPI_Comm comm_bg = MPI_COMM_NULL; /* another, for the background all-reduce's thread */
#endif

/* ---- the watchdog --------------------------------------------------------------------------- */

static _Atomic long long op_start_ns;        /* when the collective in flight began; 0: none */
static _Atomic long long timeout_ms = -1;    /* -1: not read from the environment yet */
static char op_desc[192];                    /* the collective in flight, for the message */
static _Atomic long long bg_start_ns;        /* the same for the background all-reduce's thread */
static char bg_desc[192];
static pthread_t watchdog;
static atomic_int watchdog_stop, watchdog_running;

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

double nvl_dist_timeout(void) {
  long long ms = atomic_load(&timeout_ms);
  if (ms < 0) {
    const char *e = getenv("NVLUA_DIST_TIMEOUT");
    double s = e && *e ? atof(e) : 600.0;
    ms = s > 0 ? (long long)(s * 1000.0) : 0;
    atomic_store(&timeout_ms, ms);
  }
  return (double)ms / 1000.0;
}

void nvl_dist_set_timeout(double seconds) { atomic_store(&timeout_ms, seconds > 0 ? (long long)(seconds * 1000.0) : 0); }

/* Mark a collective in flight (desc is printf-style) / done. */
static void op_begin(const char *fmt, ...) __attribute__((format(printf, 1, 2), unused));
static void op_begin(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(op_desc, sizeof op_desc, fmt, ap);
  va_end(ap);
  atomic_store(&op_start_ns, now_ns()); /* seq_cst: op_desc is written before */
}
static __attribute__((unused)) void op_end(void) { atomic_store(&op_start_ns, 0); }

/* Wakes every 100 ms; ends the process when a collective has run past the timeout, or when NCCL
 * reports an asynchronous error (its communicator is aborted first). Calls no MPI function, only
 * write and _exit, so it is safe next to any MPI call. */
static void *watchdog_main(void *arg) {
  (void)arg;
  while (!atomic_load(&watchdog_stop)) {
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    long long t0 = atomic_load(&op_start_ns), ms = atomic_load(&timeout_ms);
    const char *desc = op_desc;
    long long tb = atomic_load(&bg_start_ns); /* the background thread's, when it has waited longer */
    if (tb && (!t0 || tb < t0)) t0 = tb, desc = bg_desc;
    const char *nccl_err = nvl_nccl_watch(t0 != 0);
    double waited = t0 ? (double)(now_ns() - t0) / 1e9 : 0.0;
    if (nccl_err || (t0 && ms > 0 && waited * 1000.0 > (double)ms)) {
      char msg[512];
      if (nccl_err)
        snprintf(msg, sizeof msg, "nvlua dist: rank %d of %d: NCCL failed during %s: %s; communicator aborted, "
                 "ending this process\n", S.rank, S.world, t0 ? desc : "(no collective)", nccl_err);
      else
        snprintf(msg, sizeof msg, "nvlua dist: rank %d of %d: %s did not complete within %.0f s (timeout "
                 "NVLUA_DIST_TIMEOUT=%g): a peer rank is dead or hung; ending this process\n", S.rank, S.world,
                 desc, waited, (double)ms / 1000.0);
      if (!nccl_err) nvl_nccl_abort();
      fflush(stdout);
      ssize_t w = write(2, msg, strlen(msg));
      (void)w;
      _exit(1);
    }
  }
  return NULL;
}

static __attribute__((unused)) void watchdog_start(void) {
  nvl_dist_timeout(); /* read the environment once, on the main thread */
  atomic_store(&watchdog_stop, 0);
  if (pthread_create(&watchdog, NULL, watchdog_main, NULL) == 0) atomic_store(&watchdog_running, 1);
  else fprintf(stderr, "nvlua dist: warning: no watchdog thread; collectives have no timeout\n");
}

static void watchdog_join(void) {
  if (!atomic_load(&watchdog_running)) return;
  atomic_store(&watchdog_stop, 1);
  pthread_join(watchdog, NULL);
  atomic_store(&watchdog_running, 0);
}

/* ---- the process group ------------------------------------------------------------------------- */

#ifdef NVLUA_HAVE_MPI
/* Was this process started by an MPI launcher? (A plain `nvlua script` is a world of one.) */
static int launched(void) {
  const char *force = getenv("NVLUA_DIST_MPI");
  if (force && *force) return atoi(force) != 0;
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS",
                                     NULL};
  for (int i = 0; vars[i]; i++)
    if (getenv(vars[i])) return 1;
  return 0;
}

static nvl_status mpi_fail(const char *op, const char *call, int rc) {
  char s[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "error code %d", rc);
  return nvl_error(NVL_EDEVICE, "%s: %s failed on rank %d of %d: %s", op, call, S.rank, S.world, s);
}
#define MPI_TRY(op, call)                             \
  do {                                                \
    int rc_ = (call);                                 \
    if (rc_ != MPI_SUCCESS) return mpi_fail(op, #call, rc_); \
  } while (0)
#endif

#if defined(NVLUA_HAVE_CUDA) && defined(NVLUA_HAVE_MPI)
static char gpu_placement[320]; /* what dist.init did to CUDA_VISIBLE_DEVICES, for the log ("": nothing) */
static int gpu_placed;          /* place_gpu ran (before MPI_Init or after) */

/* One GPU per rank: core allocates on device 0, so each rank of a node narrows CUDA_VISIBLE_DEVICES to
 * its own GPU, from its node-local rank r (source: where r came from). Unset: device r. A list of n > 1
 * entries, as containers and schedulers export "0,1,...,7" to every rank: entry r % n (indices or
 * UUIDs, as given). One entry: the launcher already bound a GPU to this rank (srun --gpus-per-task),
 * which is its device 0: kept. Empty (no GPU): kept. Before MPI_Init where the launcher exports r:
 * a CUDA-aware MPI starts the CUDA runtime inside MPI_Init, after which CUDA_VISIBLE_DEVICES is no
 * longer read (issue 15 D8: every rank got GPU 0; issue 29: so did every rank given "0,...,7"). */
static void place_gpu(long r, const char *source) {
  const char *v = getenv("CUDA_VISIBLE_DEVICES");
  char list[256], pick[128];
  gpu_placed = 1;
  if (!v) {
    snprintf(pick, sizeof pick, "%ld", r);
    setenv("CUDA_VISIBLE_DEVICES", pick, 1);
    snprintf(gpu_placement, sizeof gpu_placement, "CUDA_VISIBLE_DEVICES=%s (was unset: the device of local rank %ld, "
             "from %s)", pick, r, source);
    return;
  }
  snprintf(list, sizeof list, "%s", v);
  long n = 0;
  for (const char *p = list; *p; p++) n += *p == ',';
  n += 1;
  if (!list[0] || n == 1) {
    snprintf(gpu_placement, sizeof gpu_placement, "CUDA_VISIBLE_DEVICES=%s (%s, kept; local rank %ld, from %s)", list,
             list[0] ? "one entry: the launcher's choice" : "empty: no GPU", r, source);
    return;
  }
  long want = r % n, i = 0;
  const char *p = list;
  for (; i < want; p++)
    if (*p == ',') i++;
  while (*p == ' ') p++;
  size_t len = strcspn(p, ",");
  while (len > 0 && p[len - 1] == ' ') len--;
  snprintf(pick, sizeof pick, "%.*s", (int)len, p);
  setenv("CUDA_VISIBLE_DEVICES", pick, 1);
  snprintf(gpu_placement, sizeof gpu_placement, "CUDA_VISIBLE_DEVICES=%s (entry %ld of %s for local rank %ld, from %s%s)",
           pick, want + 1, list, r, source, r >= n ? "; more ranks than GPUs: ranks share them" : "");
}

/* The node-local rank the launcher exports (Open MPI, MPICH/Intel MPI, PMI, Slurm), before MPI_Init. */
static void pick_gpu_before_mpi(void) {
  static const char *const rank_vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
                                          "SLURM_LOCALID", NULL};
  if (gpu_placed) return;
  for (int i = 0; rank_vars[i]; i++) {
    const char *v = getenv(rank_vars[i]);
    char *end = NULL;
    long r = v ? strtol(v, &end, 10) : -1;
    if (v && *v && end && !*end && r >= 0 && r < 4096) {
      place_gpu(r, rank_vars[i]);
      return;
    }
  }
}

static void place_early(void) {
  if (launched()) pick_gpu_before_mpi();
}
#endif

void nvl_dist_place_gpu(void) {
#if defined(NVLUA_HAVE_CUDA) && defined(NVLUA_HAVE_MPI)
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, place_early);
#endif
}

const char *nvl_dist_gpu_placement(void) {
#if defined(NVLUA_HAVE_CUDA) && defined(NVLUA_HAVE_MPI)
  return gpu_placement;
#else
  return "";
#endif
}

nvl_status nvl_dist_init(void) { return nvl_dist_init_threads(0); }

nvl_status nvl_dist_init_threads(int multiple) {
  if (S.init) {
    if (multiple && S.use_mpi && !S.asked_multiple)
      return nvl_error(NVL_ESTATE, "dist.init: MPI was started without MPI_THREAD_MULTIPLE by an earlier dist.init(); "
                       "the first call must ask for threads = \"multiple\"");
    return NVL_OK;
  }
  S.asked_multiple = multiple;
#ifdef NVLUA_HAVE_MPI
  if (launched()) {
    int provided, flag = 0;
    MPI_Initialized(&flag);
#ifdef NVLUA_HAVE_CUDA
    if (!flag) nvl_dist_place_gpu();
#endif
    if (!flag && MPI_Init_thread(NULL, NULL, multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED, &provided) !=
                     MPI_SUCCESS)
      return nvl_error(NVL_EDEVICE, "dist.init: MPI_Init_thread failed");
    if (flag) MPI_Query_thread(&provided);
    S.multiple = provided >= MPI_THREAD_MULTIPLE;
    MPI_Comm local;
    MPI_TRY("dist.init", MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    MPI_TRY("dist.init", MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MPI_TRY("dist.init", MPI_Comm_rank(comm, &S.rank));
    MPI_TRY("dist.init", MPI_Comm_size(comm, &S.world));
    MPI_TRY("dist.init", MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, S.rank, MPI_INFO_NULL, &local));
    MPI_TRY("dist.init", MPI_Comm_rank(local, &S.local_rank));
    MPI_TRY("dist.init", MPI_Comm_size(local, &S.local_size));
    MPI_Comm_free(&local);
    if (S.multiple) {
      MPI_TRY("dist.init", MPI_Comm_dup(comm, &comm_bg));
      MPI_TRY("dist.init", MPI_Comm_set_errhandler(comm_bg, MPI_ERRORS_RETURN));
    }
    S.use_mpi = 1;
#ifdef NVLUA_HAVE_CUDA
    /* a launcher that exports no node-local rank: MPI's, which a CUDA-aware MPI may have been too
     * late for (pick_gpu_before_mpi); effective otherwise, as no CUDA tensor exists before init */
    if (!gpu_placed && S.local_size > 1) place_gpu(S.local_rank, "MPI_COMM_TYPE_SHARED");
#endif
    if (S.world > 1) watchdog_start();
  }
#endif
  S.init = 1;
  return NVL_OK;
}

int nvl_dist_initialized(void) { return S.init; }
int nvl_dist_rank(void) { return S.rank; }
int nvl_dist_world_size(void) { return S.world; }
int nvl_dist_local_rank(void) { return S.local_rank; }
int nvl_dist_local_size(void) { return S.local_size; }
const char *nvl_dist_backend(void) { return S.use_mpi ? "mpi" : "none"; }

int nvl_dist_mpi_compiled(const char **mpi_version) {
#ifdef NVLUA_HAVE_MPI
  static char v[MPI_MAX_LIBRARY_VERSION_STRING];
  if (mpi_version) {
    int len = 0;
    if (!v[0] && MPI_Get_library_version(v, &len) == MPI_SUCCESS) {
      char *nl = strchr(v, '\n');
      if (nl) *nl = '\0';
      char *comma = strchr(v, ',');
      if (comma) *comma = '\0';
    }
    *mpi_version = v;
  }
  return 1;
#else
  if (mpi_version) *mpi_version = "";
  return 0;
#endif
}

int nvl_dist_nccl_compiled(void) { return nvl_nccl_compiled(); }

void nvl_dist_finalize(void) {
  if (!S.init || S.finalized) return;
  /* a background all-reduce still running: every rank completes it (the watchdog still times it) */
  if (S.use_mpi) nvl_dist_bg_wait();
  watchdog_join();
  nvl_nccl_shutdown();
#ifdef NVLUA_HAVE_MPI
  if (S.use_mpi) {
    if (comm_bg != MPI_COMM_NULL) MPI_Comm_free(&comm_bg);
    MPI_Comm_free(&comm);
    MPI_Finalize();
  }
#endif
  S.finalized = 1;
}

void nvl_dist_abort(int status) {
#ifdef NVLUA_HAVE_MPI
  if (S.use_mpi && !S.finalized && S.world > 1) {
    fflush(stdout);
    fflush(stderr);
    nvl_nccl_abort();
    MPI_Abort(comm, status ? status : 1); /* ends every rank; does not return */
  }
#endif
  (void)status;
}

void nvl_dist_shutdown(int ok) {
  if (!S.init || S.finalized) return;
  if (ok) {
    nvl_dist_finalize();
    return;
  }
  if (S.use_mpi && S.world > 1) {
    fflush(stdout);
    fprintf(stderr, "nvlua dist: rank %d of %d failed (the error above); ending the job\n", S.rank, S.world);
  }
  nvl_dist_abort(1);
  nvl_dist_finalize(); /* a world of one that failed: finalize all the same */
}

/* ---- checks ------------------------------------------------------------------------------------ */

static nvl_status check_op(const char *name, nvl_dist_op op, const nvl_tensor *t) {
  if ((unsigned)op >= NVL_DIST_OP_COUNT) return nvl_error(NVL_EINVAL, "%s: invalid op %d (valid: sum, avg, max, min)", name, (int)op);
  if (op == NVL_DIST_AVG && t && !nvl_dtypes[t->dtype].is_float)
    return nvl_error(NVL_EINVAL, "%s: avg needs a float tensor, got %s", name, nvl_dtypes[t->dtype].name);
  return NVL_OK;
}

static nvl_status check_tensor(const char *name, const nvl_tensor *t) {
  NVL_TRY(nvl_tensor_check_live(t, name));
  if (nvl_dtypes[t->dtype].is_quantized) return nvl_error(NVL_EINVAL, "%s: quantized tensors cannot be reduced", name);
  return NVL_OK;
}

/* x (n) /= world, the avg of a sum. */
static void divide(nvl_tensor *w, int world) {
  float *p = nvl_tensor_data(w);
  for (int64_t i = 0, n = nvl_tensor_numel(w); i < n; i++) p[i] = p[i] / (float)world;
}

#ifdef NVLUA_HAVE_MPI
static MPI_Datatype mpi_type(nvl_dtype dt) {
  switch (dt) {
    case NVL_F32: return MPI_FLOAT;
    case NVL_I32: return MPI_INT32_T;
    case NVL_I64: return MPI_INT64_T;
    case NVL_U8: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL; /* bf16: reduced as f32 */
  }
}

static MPI_Op mpi_op(nvl_dist_op op) {
  return op == NVL_DIST_MAX ? MPI_MAX : op == NVL_DIST_MIN ? MPI_MIN : MPI_SUM;
}

/* MPI counts are int: the collectives below move at most INT_MAX elements (8 GiB of f32) per
 * call; larger tensors are refused with a message (chunk them in the caller). */
static nvl_status check_count(const char *name, int64_t n) {
  if (n > INT_MAX) return nvl_error(NVL_EUNSUPPORTED, "%s: %lld elements is more than one MPI call moves (%d)", name, (long long)n, INT_MAX);
  return NVL_OK;
}
#endif

#ifdef NVLUA_HAVE_MPI
/* w (f32 or the dtype itself, contiguous, CPU) = a working copy of t for a reduction: t itself
 * when it is contiguous and not bf16. *shared says which. */
static nvl_status work_copy(nvl_tensor *w, const nvl_tensor *t, int *shared) {
  if (t->dtype == NVL_BF16) {
    *shared = 0;
    return nvl_tensor_clone_to(w, t, NVL_F32, NVL_CPU);
  }
  NVL_TRY(nvl_tensor_contiguous(w, t));
  *shared = nvl_tensor_data(w) == nvl_tensor_data(t) && nvl_tensor_is_contiguous(t);
  return NVL_OK;
}

/* For dist_nccl.c: buf (bytes) = root's buf on every rank (the NCCL unique id). */
nvl_status nvl_dist_bcast_bytes(void *buf, int bytes, int root) {
  if (!S.use_mpi) return NVL_OK;
  op_begin("broadcast (the NCCL unique id)");
  int rc = MPI_Bcast(buf, bytes, MPI_BYTE, root, comm);
  op_end();
  return rc == MPI_SUCCESS ? NVL_OK : mpi_fail("dist", "MPI_Bcast", rc);
}
#else
nvl_status nvl_dist_bcast_bytes(void *buf, int bytes, int root) {
  (void)buf; (void)bytes; (void)root;
  return NVL_OK;
}
#endif

static int same_shape_tail(const nvl_tensor *a, const nvl_tensor *b) {
  if (a->ndim != b->ndim || a->ndim < 1) return 0;
  for (int d = 1; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* ---- collectives --------------------------------------------------------------------------------- */

nvl_status nvl_dist_barrier(void) {
#ifdef NVLUA_HAVE_MPI
  if (S.use_mpi) {
    op_begin("barrier");
    int rc = MPI_Barrier(comm);
    op_end();
    if (rc != MPI_SUCCESS) return mpi_fail("barrier", "MPI_Barrier", rc);
  }
#endif
  return NVL_OK;
}

nvl_status nvl_dist_all_reduce_f64(double *x, int n, nvl_dist_op op) {
  NVL_TRY(check_op("all_reduce", op, NULL));
  if (n < 0) return nvl_error(NVL_EINVAL, "all_reduce: %d numbers", n);
  count_bytes(NVL_DIST_BYTES_ALL_REDUCE, (size_t)n * sizeof(double));
#ifdef NVLUA_HAVE_MPI
  if (S.use_mpi && n > 0) {
    op_begin("all_reduce (%d number%s, %s)", n, n == 1 ? "" : "s", nvl_dist_op_names[op]);
    int rc = MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, mpi_op(op), comm);
    op_end();
    if (rc != MPI_SUCCESS) return mpi_fail("all_reduce", "MPI_Allreduce", rc);
  }
#endif
  if (op == NVL_DIST_AVG)
    for (int i = 0; i < n; i++) x[i] /= S.world;
  return NVL_OK;
}

nvl_status nvl_dist_all_reduce(nvl_tensor *t, nvl_dist_op op) {
  NVL_TRY(check_tensor("all_reduce", t));
  NVL_TRY(check_op("all_reduce", op, t));
  count_bytes(NVL_DIST_BYTES_ALL_REDUCE, nvl_tensor_nbytes(t));
  if (t->device == NVL_CUDA) return nvl_nccl_all_reduce(t, op, S.rank, S.world);
  if (!S.use_mpi) return NVL_OK; /* a world of one: sum, max, min and avg are t itself */
#ifdef NVLUA_HAVE_MPI
  char d[160];
  int64_t n = nvl_tensor_numel(t);
  NVL_TRY(check_count("all_reduce", n));
  nvl_tensor w = nvl_tensor_null();
  int shared;
  NVL_TRY(work_copy(&w, t, &shared));
  op_begin("all_reduce (%s, %s)", nvl_tensor_desc(t, d, sizeof d), nvl_dist_op_names[op]);
  int rc = MPI_Allreduce(MPI_IN_PLACE, nvl_tensor_data(&w), (int)n, mpi_type(w.dtype), mpi_op(op), comm);
  op_end();
  nvl_status st = rc == MPI_SUCCESS ? NVL_OK : mpi_fail("all_reduce", "MPI_Allreduce", rc);
  if (st == NVL_OK && op == NVL_DIST_AVG) divide(&w, S.world);
  if (st == NVL_OK && !shared) st = nvl_tensor_copy(t, &w);
  nvl_tensor_release(&w);
  return st;
#endif
  return NVL_OK;
}

/* ---- bucketed all-reduce ---------------------------------------------------------------------- */

#define MAX_PENDING 1024
static struct {
  nvl_tensor t;
  nvl_dist_op op;
#ifdef NVLUA_HAVE_MPI
  MPI_Request req;
#endif
} pending[MAX_PENDING];
/* CUDA tensors an NCCL all-reduce started on still reads and writes: held (a share each) until
 * wait_all has put stream 0 after the collectives, so a tensor freed meanwhile keeps its block out of
 * the caching allocator's reach */
static nvl_tensor pending_cuda[MAX_PENDING];
static int npending, npending_cuda;

int nvl_dist_pending(void) { return npending + npending_cuda; }

nvl_status nvl_dist_all_reduce_start(nvl_tensor *t, nvl_dist_op op) {
  char d[160];
  NVL_TRY(check_tensor("all_reduce_start", t));
  NVL_TRY(check_op("all_reduce_start", op, t));
  if (op != NVL_DIST_SUM && op != NVL_DIST_AVG)
    return nvl_error(NVL_EINVAL, "all_reduce_start: op must be sum or avg, got %s", nvl_dist_op_names[op]);
  if (t->dtype != NVL_F32 || !nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "all_reduce_start: expects a contiguous f32 tensor, got %s", nvl_tensor_desc(t, d, sizeof d));
  count_bytes(NVL_DIST_BYTES_ALL_REDUCE, nvl_tensor_nbytes(t));
  if (t->device == NVL_CUDA) {
    if (S.world == 1 && !S.use_mpi) return NVL_OK;
    if (npending_cuda == MAX_PENDING)
      return nvl_error(NVL_EINVAL, "all_reduce_start: more than %d all-reduces pending; call wait_all", MAX_PENDING);
    NVL_TRY(nvl_nccl_all_reduce_start(t, op, S.rank, S.world));
    nvl_tensor_share(&pending_cuda[npending_cuda++], t);
    return NVL_OK;
  }
  if (!S.use_mpi) return NVL_OK; /* a world of one */
#ifdef NVLUA_HAVE_MPI
  int64_t n = nvl_tensor_numel(t);
  NVL_TRY(check_count("all_reduce_start", n));
  if (npending == MAX_PENDING)
    return nvl_error(NVL_EINVAL, "all_reduce_start: more than %d all-reduces pending; call wait_all", MAX_PENDING);
  int rc = MPI_Iallreduce(MPI_IN_PLACE, nvl_tensor_data(t), (int)n, MPI_FLOAT, MPI_SUM, comm, &pending[npending].req);
  if (rc != MPI_SUCCESS) return mpi_fail("all_reduce_start", "MPI_Iallreduce", rc);
  nvl_tensor_share(&pending[npending].t, t);
  pending[npending].op = op;
  npending++;
  int flag; /* let the started ones progress (Open MPI progresses inside MPI calls) */
  for (int i = 0; i < npending; i++) {
    rc = MPI_Test(&pending[i].req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail("all_reduce_start", "MPI_Test", rc);
  }
#endif
  return NVL_OK;
}

nvl_status nvl_dist_wait_all(void) {
  nvl_status st = NVL_OK;
  if (npending_cuda) {
    st = nvl_nccl_wait_all();
    for (int i = 0; i < npending_cuda; i++) nvl_tensor_release(&pending_cuda[i]);
    npending_cuda = 0;
  }
#ifdef NVLUA_HAVE_MPI
  if (npending) {
    op_begin("all_reduce (%d buckets started by all_reduce_start)", npending);
    for (int i = 0; i < npending; i++) { /* a completed request is MPI_REQUEST_NULL: waiting on it returns at once */
      int rc = MPI_Wait(&pending[i].req, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS && st == NVL_OK) st = mpi_fail("wait_all", "MPI_Wait", rc);
    }
    op_end();
    for (int i = 0; i < npending; i++) {
      if (st == NVL_OK && pending[i].op == NVL_DIST_AVG) divide(&pending[i].t, S.world);
      nvl_tensor_release(&pending[i].t);
    }
    npending = 0;
  }
#endif
  return st;
}

/* ---- background all-reduce (ShadowSync) -------------------------------------------------------- */

static struct {
  nvl_tensor t;    /* a share of the output; null: none pending */
  nvl_tensor src;  /* a share of the source when it is not t */
  nvl_dist_op op;
  int delta;       /* then t -= src */
  int threaded;    /* run by the thread below (else req) */
  pthread_t thread;
  int rc;          /* the thread's MPI return code */
  atomic_int running; /* the thread has not finished */
#ifdef NVLUA_HAVE_MPI
  MPI_Request req;
#endif
} BG;

int nvl_dist_bg_pending(void) { return BG.t.storage != NULL; }
int nvl_dist_bg_busy(void) { return BG.t.storage != NULL && (!BG.threaded || atomic_load(&BG.running)); }
int nvl_dist_bg_threaded(void) { return S.use_mpi && S.multiple; }

/* After the sum: avg's division, then delta's subtraction (t = avg - src), element by element in f32. */
static void bg_finish(void) {
  float *t = nvl_tensor_data(&BG.t);
  const float *src = BG.src.storage ? nvl_tensor_data(&BG.src) : t;
  int64_t n = nvl_tensor_numel(&BG.t);
  if (BG.op == NVL_DIST_AVG) divide(&BG.t, S.world);
  if (BG.delta)
    for (int64_t i = 0; i < n; i++) t[i] = t[i] - src[i];
}

static void bg_release(void) {
  nvl_tensor_release(&BG.t);
  nvl_tensor_release(&BG.src);
}

#ifdef NVLUA_HAVE_MPI
static void *bg_allreduce_main(void *arg) {
  (void)arg;
  char d[160];
  snprintf(bg_desc, sizeof bg_desc, "background all_reduce (%s, %s)", nvl_tensor_desc(&BG.t, d, sizeof d),
           nvl_dist_op_names[BG.op]);
  atomic_store(&bg_start_ns, now_ns());
  BG.rc = MPI_Allreduce(BG.src.storage ? nvl_tensor_data(&BG.src) : MPI_IN_PLACE, nvl_tensor_data(&BG.t),
                        (int)nvl_tensor_numel(&BG.t), MPI_FLOAT, MPI_SUM, comm_bg);
  atomic_store(&bg_start_ns, 0);
  if (BG.rc == MPI_SUCCESS) bg_finish();
  atomic_store(&BG.running, 0);
  return NULL;
}
#endif

nvl_status nvl_dist_all_reduce_bg(nvl_tensor *t, const nvl_tensor *src, nvl_dist_op op, int delta) {
  char d[160], d2[160];
  NVL_TRY(check_tensor("all_reduce_bg", t));
  NVL_TRY(check_op("all_reduce_bg", op, t));
  if (op != NVL_DIST_SUM && op != NVL_DIST_AVG)
    return nvl_error(NVL_EINVAL, "all_reduce_bg: op must be sum or avg, got %s", nvl_dist_op_names[op]);
  if (t->dtype != NVL_F32 || !nvl_tensor_is_contiguous(t) || t->device != NVL_CPU)
    return nvl_error(NVL_EINVAL, "all_reduce_bg: expects a contiguous f32 CPU tensor, got %s", nvl_tensor_desc(t, d, sizeof d));
  if (src) {
    NVL_TRY(check_tensor("all_reduce_bg", src));
    if (src->dtype != NVL_F32 || !nvl_tensor_is_contiguous(src) || src->device != NVL_CPU ||
        nvl_tensor_numel(src) != nvl_tensor_numel(t))
      return nvl_error(NVL_EINVAL, "all_reduce_bg: src must be a contiguous f32 CPU tensor of t's %lld elements, got %s",
                       (long long)nvl_tensor_numel(t), nvl_tensor_desc(src, d2, sizeof d2));
    if (nvl_tensor_data(src) == nvl_tensor_data(t)) src = NULL; /* the same memory: in place */
  }
  if (delta && !src) return nvl_error(NVL_EINVAL, "all_reduce_bg: delta (t = reduced - src) needs a src other than t");
  if (BG.t.storage) return nvl_error(NVL_ESTATE, "all_reduce_bg: one is already running (bg_wait first)");
  count_bytes(NVL_DIST_BYTES_ALL_REDUCE, nvl_tensor_nbytes(t));
  int64_t n = nvl_tensor_numel(t);
#ifdef NVLUA_HAVE_MPI
  NVL_TRY(check_count("all_reduce_bg", n));
#endif
  nvl_tensor_share(&BG.t, t);
  if (src) nvl_tensor_share(&BG.src, src);
  BG.op = op;
  BG.delta = delta;
  BG.threaded = 0;
  if (!S.use_mpi) { /* a world of one: the reduction is the source itself */
    if (src) memcpy(nvl_tensor_data(t), nvl_tensor_data(src), (size_t)n * sizeof(float));
    bg_finish();
    bg_release();
    return NVL_OK;
  }
#ifdef NVLUA_HAVE_MPI
  BG.threaded = S.multiple;
  if (BG.threaded) {
    atomic_store(&BG.running, 1);
    if (pthread_create(&BG.thread, NULL, bg_allreduce_main, NULL) != 0) {
      atomic_store(&BG.running, 0);
      bg_release();
      return nvl_error(NVL_EDEVICE, "all_reduce_bg: cannot start its thread");
    }
    return NVL_OK;
  }
  int rc = MPI_Iallreduce(src ? nvl_tensor_data(src) : MPI_IN_PLACE, nvl_tensor_data(t), (int)n, MPI_FLOAT, MPI_SUM,
                          comm, &BG.req);
  if (rc != MPI_SUCCESS) {
    bg_release();
    return mpi_fail("all_reduce_bg", "MPI_Iallreduce", rc);
  }
#endif
  return NVL_OK;
}

nvl_status nvl_dist_bg_wait(void) {
  if (!BG.t.storage) return NVL_OK;
  nvl_status st = NVL_OK;
#ifdef NVLUA_HAVE_MPI
  if (BG.threaded) {
    pthread_join(BG.thread, NULL); /* the watchdog times the thread's MPI_Allreduce */
    if (BG.rc != MPI_SUCCESS) st = mpi_fail("bg_wait", "MPI_Allreduce (background)", BG.rc);
  } else {
    op_begin("all_reduce (started by all_reduce_bg)");
    int rc = MPI_Wait(&BG.req, MPI_STATUS_IGNORE);
    op_end();
    if (rc != MPI_SUCCESS) st = mpi_fail("bg_wait", "MPI_Wait", rc);
    else bg_finish();
  }
#endif
  bg_release();
  return st;
}

nvl_status nvl_dist_broadcast(nvl_tensor *t, int root) {
  NVL_TRY(check_tensor("broadcast", t));
  if (root < 0 || root >= S.world)
    return nvl_error(NVL_EINVAL, "broadcast: root %d is not a rank (0..%d)", root, S.world - 1);
  count_bytes(NVL_DIST_BYTES_BROADCAST, nvl_tensor_nbytes(t));
  if (t->device == NVL_CUDA) return nvl_nccl_broadcast(t, root, S.rank, S.world);
  if (!S.use_mpi) return NVL_OK;
#ifdef NVLUA_HAVE_MPI
  char d[160];
  int64_t bytes = (int64_t)nvl_tensor_nbytes(t);
  NVL_TRY(check_count("broadcast", bytes));
  nvl_tensor w = nvl_tensor_null();
  NVL_TRY(nvl_tensor_contiguous(&w, t));
  int shared = nvl_tensor_data(&w) == nvl_tensor_data(t) && nvl_tensor_is_contiguous(t);
  op_begin("broadcast (%s, root %d)", nvl_tensor_desc(t, d, sizeof d), root);
  int rc = MPI_Bcast(nvl_tensor_data(&w), (int)bytes, MPI_BYTE, root, comm);
  op_end();
  nvl_status st = rc == MPI_SUCCESS ? NVL_OK : mpi_fail("broadcast", "MPI_Bcast", rc);
  if (st == NVL_OK && !shared) st = nvl_tensor_copy(t, &w);
  nvl_tensor_release(&w);
  return st;
#endif
  return NVL_OK;
}

nvl_status nvl_dist_reduce_scatter(nvl_tensor *out, const nvl_tensor *t, nvl_dist_op op) {
  char d1[160], d2[160];
  NVL_TRY(check_tensor("reduce_scatter", t));
  NVL_TRY(check_tensor("reduce_scatter", out));
  NVL_TRY(check_op("reduce_scatter", op, t));
  if (t->ndim < 1 || t->shape[0] % S.world || out->dtype != t->dtype || out->device != t->device ||
      !same_shape_tail(out, t) || out->shape[0] * S.world != t->shape[0])
    return nvl_error(NVL_EINVAL, "reduce_scatter: t is cut along dim 1 into %d equal chunks and out holds one: got t "
                     "%s, out %s", S.world, nvl_tensor_desc(t, d1, sizeof d1), nvl_tensor_desc(out, d2, sizeof d2));
  count_bytes(NVL_DIST_BYTES_REDUCE_SCATTER, nvl_tensor_nbytes(t));
  if (t->device == NVL_CUDA) return nvl_nccl_reduce_scatter(out, t, op, S.rank, S.world);
  if (!S.use_mpi) return nvl_tensor_copy(out, t);
#ifdef NVLUA_HAVE_MPI
  int64_t n = nvl_tensor_numel(out);
  NVL_TRY(check_count("reduce_scatter", n * S.world));
  nvl_tensor w = nvl_tensor_null(), r = nvl_tensor_null();
  int shared_in, shared_out;
  NVL_TRY(work_copy(&w, t, &shared_in));
  nvl_status st = work_copy(&r, out, &shared_out);
  if (st == NVL_OK) {
    op_begin("reduce_scatter (%s, %s)", nvl_tensor_desc(t, d1, sizeof d1), nvl_dist_op_names[op]);
    int rc = MPI_Reduce_scatter_block(nvl_tensor_data(&w), nvl_tensor_data(&r), (int)n, mpi_type(w.dtype), mpi_op(op),
                                      comm);
    op_end();
    st = rc == MPI_SUCCESS ? NVL_OK : mpi_fail("reduce_scatter", "MPI_Reduce_scatter_block", rc);
  }
  if (st == NVL_OK && op == NVL_DIST_AVG) divide(&r, S.world);
  if (st == NVL_OK && !shared_out) st = nvl_tensor_copy(out, &r);
  nvl_tensor_release(&w);
  nvl_tensor_release(&r);
  return st;
#endif
  return NVL_OK;
}

static nvl_status all_gather(nvl_tensor *out, const nvl_tensor *t, int ordered) {
  char d1[160], d2[160];
  NVL_TRY(check_tensor("all_gather", t));
  NVL_TRY(check_tensor("all_gather", out));
  if (t->ndim < 1 || out->dtype != t->dtype || out->device != t->device || !same_shape_tail(out, t) ||
      out->shape[0] != t->shape[0] * S.world)
    return nvl_error(NVL_EINVAL, "all_gather: out holds the %d ranks' t along dim 1: got out %s, t %s", S.world,
                     nvl_tensor_desc(out, d1, sizeof d1), nvl_tensor_desc(t, d2, sizeof d2));
  size_t chunk = nvl_tensor_nbytes(t);
  int in_place = t->storage == out->storage && nvl_tensor_is_contiguous(out) && nvl_tensor_is_contiguous(t) &&
                 (char *)nvl_tensor_data(t) == (char *)nvl_tensor_data(out) + (size_t)S.rank * chunk;
  count_bytes(NVL_DIST_BYTES_ALL_GATHER, nvl_tensor_nbytes(out));
  if (t->device == NVL_CUDA)
    return ordered ? nvl_nccl_all_gather_ordered(out, t, S.rank, S.world)
                   : nvl_nccl_all_gather(out, t, in_place, S.rank, S.world);
  if (!S.use_mpi) return in_place ? NVL_OK : nvl_tensor_copy(out, t);
#ifdef NVLUA_HAVE_MPI
  NVL_TRY(check_count("all_gather", (int64_t)chunk * S.world));
  nvl_tensor w = nvl_tensor_null(), r = nvl_tensor_null();
  nvl_status st = NVL_OK;
  if (!in_place) {
    if (t->storage == out->storage)
      return nvl_error(NVL_EINVAL, "all_gather: t shares out's storage but is not this rank's chunk of a contiguous out");
    st = nvl_tensor_contiguous(&w, t);
  }
  if (st == NVL_OK) st = nvl_tensor_contiguous(&r, out);
  int shared_out = st == NVL_OK && nvl_tensor_data(&r) == nvl_tensor_data(out) && nvl_tensor_is_contiguous(out);
  if (st == NVL_OK) {
    op_begin("all_gather (%s)", nvl_tensor_desc(t, d1, sizeof d1));
    int rc = MPI_Allgather(in_place ? MPI_IN_PLACE : nvl_tensor_data(&w), (int)chunk, MPI_BYTE, nvl_tensor_data(&r),
                           (int)chunk, MPI_BYTE, comm);
    op_end();
    st = rc == MPI_SUCCESS ? NVL_OK : mpi_fail("all_gather", "MPI_Allgather", rc);
  }
  if (st == NVL_OK && !shared_out) st = nvl_tensor_copy(out, &r);
  nvl_tensor_release(&w);
  nvl_tensor_release(&r);
  return st;
#endif
  return NVL_OK;
}

nvl_status nvl_dist_all_gather(nvl_tensor *out, const nvl_tensor *t) { return all_gather(out, t, 0); }

/* ---- nonblocking all-gathers ---------------------------------------------------------------------- */

#define MAX_GATHERS 256
static struct {
  int used, cuda_slot;
  nvl_tensor out, t; /* held until the wait */
#ifdef NVLUA_HAVE_MPI
  MPI_Request req;
#endif
} gathers[MAX_GATHERS];

/* let the gathers in flight progress (Open MPI advances nonblocking collectives inside MPI calls) */
static nvl_status gathers_test(const char *op) {
#ifdef NVLUA_HAVE_MPI
  for (int i = 0; i < MAX_GATHERS; i++)
    if (gathers[i].used && gathers[i].cuda_slot < 0) {
      int flag, rc = MPI_Test(&gathers[i].req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return mpi_fail(op, "MPI_Test", rc);
    }
#else
  (void)op;
#endif
  return NVL_OK;
}

nvl_status nvl_dist_all_gather_start(nvl_tensor *out, const nvl_tensor *t, int *ticket) {
  char d1[160], d2[160];
  *ticket = -1;
  NVL_TRY(check_tensor("all_gather_start", t));
  NVL_TRY(check_tensor("all_gather_start", out));
  if (t->ndim < 1 || out->dtype != t->dtype || out->device != t->device || !same_shape_tail(out, t) ||
      out->shape[0] != t->shape[0] * S.world || !nvl_tensor_is_contiguous(out) || !nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "all_gather_start: out (contiguous) holds the %d ranks' t (contiguous) along dim 1: got "
                     "out %s, t %s", S.world, nvl_tensor_desc(out, d1, sizeof d1), nvl_tensor_desc(t, d2, sizeof d2));
  size_t chunk = nvl_tensor_nbytes(t);
  int in_place = t->storage == out->storage &&
                 (char *)nvl_tensor_data(t) == (char *)nvl_tensor_data(out) + (size_t)S.rank * chunk;
  if (t->storage == out->storage && !in_place)
    return nvl_error(NVL_EINVAL, "all_gather_start: t shares out's storage but is not this rank's chunk of out");
  count_bytes(NVL_DIST_BYTES_ALL_GATHER, nvl_tensor_nbytes(out));
  if (t->device != NVL_CUDA && !S.use_mpi) return in_place ? NVL_OK : nvl_tensor_copy(out, t); /* a world of one */
  int i = 0;
  while (i < MAX_GATHERS && gathers[i].used) i++;
  if (i == MAX_GATHERS)
    return nvl_error(NVL_EINVAL, "all_gather_start: more than %d all-gathers in flight; wait for some", MAX_GATHERS);
  gathers[i].cuda_slot = -1;
  if (t->device == NVL_CUDA) {
    NVL_TRY(nvl_nccl_all_gather_start(out, t, S.rank, S.world, &gathers[i].cuda_slot));
  } else {
#ifdef NVLUA_HAVE_MPI
    NVL_TRY(check_count("all_gather_start", (int64_t)chunk * S.world));
    int rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : nvl_tensor_data(t), (int)chunk, MPI_BYTE, nvl_tensor_data(out),
                            (int)chunk, MPI_BYTE, comm, &gathers[i].req);
    if (rc != MPI_SUCCESS) return mpi_fail("all_gather_start", "MPI_Iallgather", rc);
#endif
  }
  gathers[i].used = 1;
  nvl_tensor_share(&gathers[i].out, out);
  nvl_tensor_share(&gathers[i].t, t);
  *ticket = i;
  return gathers_test("all_gather_start");
}

nvl_status nvl_dist_all_gather_wait(int ticket) {
  if (ticket == -1) return NVL_OK;
  if (ticket < 0 || ticket >= MAX_GATHERS || !gathers[ticket].used)
    return nvl_error(NVL_EINVAL, "all_gather_wait: no all-gather in flight has ticket %d", ticket);
  nvl_status st = NVL_OK;
  if (gathers[ticket].cuda_slot >= 0) {
    st = nvl_nccl_event_wait(gathers[ticket].cuda_slot);
  } else {
#ifdef NVLUA_HAVE_MPI
    char d[160];
    op_begin("all_gather (started by all_gather_start: %s)", nvl_tensor_desc(&gathers[ticket].t, d, sizeof d));
    int rc = MPI_Wait(&gathers[ticket].req, MPI_STATUS_IGNORE);
    op_end();
    if (rc != MPI_SUCCESS) st = mpi_fail("all_gather_wait", "MPI_Wait", rc);
#endif
  }
  gathers[ticket].used = 0;
  nvl_tensor_release(&gathers[ticket].out);
  nvl_tensor_release(&gathers[ticket].t);
  return st;
}

nvl_status nvl_dist_all_gather_ordered(nvl_tensor *out, const nvl_tensor *t) { return all_gather(out, t, 1); }

nvl_status nvl_dist_all_reduce_ordered(nvl_tensor *t, nvl_dist_op op) {
  NVL_TRY(check_tensor("all_reduce", t));
  NVL_TRY(check_op("all_reduce", op, t));
  if (t->device != NVL_CUDA) return nvl_dist_all_reduce(t, op);
  count_bytes(NVL_DIST_BYTES_ALL_REDUCE, nvl_tensor_nbytes(t));
  return nvl_nccl_all_reduce_ordered(t, op, S.rank, S.world);
}

int nvl_nccl_available(const char **why) { return nvl_nccl_load(why); }
