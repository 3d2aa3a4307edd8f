/* dist.h: data-parallel collectives across processes (DESIGN.md "Scale-out"). Ranks are launched
 * by Open MPI (mpirun) or Slurm (srun); CPU tensors travel through MPI, CUDA tensors through NCCL
 * (one communicator, bootstrapped over MPI). Built without MPI, or run without a launcher, this is
 * a world of one process whose collectives are identities, so single-process code needs no
 * special case.
 *
 * Ranks are 0-based (MPI's numbering; the data loader takes the same). Reductions: sum, avg
 * (sum / world, correctly rounded division), max, min. bf16 tensors are reduced in f32 and
 * rounded once; integer tensors take sum, max and min. A collective is called by every rank with
 * tensors of the same dtype and shape; a mismatch is a programmer error (MPI may report it, or
 * hang until the timeout below).
 *
 * Faults: a collective that does not complete within the timeout (NVLUA_DIST_TIMEOUT seconds,
 * default 600; 0 disables) makes a watchdog thread print which rank waited in which op and end
 * the process (exit status 1), and mpirun then ends the job. A rank that dies is noticed by the
 * launcher, which ends the others (Open MPI's default). MPI errors come back as statuses
 * (MPI_ERRORS_RETURN) whose message names the op and MPI's error string.
 *
 * Not here: Lua (lua/bind/dist.c), what is reduced when (lua/nvlua/train.lua, optim.lua). */
#ifndef NVL_DIST_H
#define NVL_DIST_H
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { NVL_DIST_SUM = 0, NVL_DIST_AVG = 1, NVL_DIST_MAX = 2, NVL_DIST_MIN = 3, NVL_DIST_OP_COUNT } nvl_dist_op;
extern const char *const nvl_dist_op_names[NVL_DIST_OP_COUNT];

/* Start (idempotent): MPI_Init_thread when nvlua has MPI and the process was started by a
 * launcher (mpirun, srun; NVLUA_DIST_MPI=1 forces it, 0 forbids it); otherwise a world of one.
 * MPI_THREAD_FUNNELED, or with nvl_dist_init_threads(1) MPI_THREAD_MULTIPLE (what the background
 * all-reduce below needs). The call that starts MPI decides: asking for MULTIPLE after MPI was
 * started without it is an error (NVL_ESTATE); otherwise a later call changes nothing. */
nvl_status nvl_dist_init(void);
nvl_status nvl_dist_init_threads(int multiple);
/* 1 after nvl_dist_init. */
int nvl_dist_initialized(void);
/* This process's rank, the number of ranks, its rank among the ranks on its node and their
 * number (0, 1, 0, 1 before init or without MPI). */
int nvl_dist_rank(void);
int nvl_dist_world_size(void);
int nvl_dist_local_rank(void);
int nvl_dist_local_size(void);
/* "mpi" when MPI runs the collectives, else "none". */
const char *nvl_dist_backend(void);
/* What was compiled in: MPI (with its library version in *mpi_version, may be NULL), NCCL. */
int nvl_dist_mpi_compiled(const char **mpi_version);
int nvl_dist_nccl_compiled(void);
/* What nvl_dist_init did to give this rank its GPU, for the log: CUDA_VISIBLE_DEVICES as set or kept,
 * the entry chosen, the node-local rank and where it came from ("" when it did nothing: no launcher,
 * one rank on the node, or a build without CUDA). */
const char *nvl_dist_gpu_placement(void);
/* Give a process that an MPI launcher started its GPU (CUDA_VISIBLE_DEVICES, from the launcher's
 * node-local rank) if that was not done yet: nvl_dist_init calls it before MPI_Init, and core's
 * dispatch before the CUDA table's first use, since the CUDA runtime reads CUDA_VISIBLE_DEVICES once
 * when it starts (a config check of device=cuda before dist.init starts it). Idempotent, thread-safe. */
void nvl_dist_place_gpu(void);

/* Every rank waits for every other. */
nvl_status nvl_dist_barrier(void);
/* t (every rank's, same dtype and shape) = op over the ranks, in place. */
nvl_status nvl_dist_all_reduce(nvl_tensor *t, nvl_dist_op op);
/* Bucketed gradient reduction, overlapped with the backward pass: start t = op (sum or avg) over
 * the ranks, in place, without waiting (f32, contiguous; every rank starts the same tensors in
 * the same order). On the CPU an MPI_Iallreduce (each start also lets earlier ones progress); on
 * CUDA NCCL on its own stream, after stream 0's queued work. t must not be read or written until
 * nvl_dist_wait_all returns. A world of one: nothing to do. */
nvl_status nvl_dist_all_reduce_start(nvl_tensor *t, nvl_dist_op op);
/* Complete every started all-reduce: on the CPU MPI_Waitall, then avg's division; on CUDA stream 0
 * waits for NCCL's stream (an event: the host does not wait). */
nvl_status nvl_dist_wait_all(void);
/* The number of started, not yet completed all-reduces. */
int nvl_dist_pending(void);
/* Background all-reduce (ShadowSync's parameter averaging): start t = op (sum or avg) over the
 * ranks of src (NULL or t itself: of t, in place) and return; delta: then t -= src, the change the
 * reduction brings to src (f32 element by element: (sum / world) - src). f32, contiguous, CPU; one at
 * a time. With MPI_THREAD_MULTIPLE a thread of its own runs it all (MPI_Allreduce on a communicator
 * of its own, the division, the subtraction), so it advances while the caller computes; Open MPI
 * has no progress thread, so without one a nonblocking all-reduce advances only inside the caller's
 * MPI calls. Without MPI_THREAD_MULTIPLE it is an MPI_Iallreduce (that weaker overlap; the division
 * and subtraction at the wait). t and src must not be written, nor t read, until nvl_dist_bg_wait
 * returns. Every rank starts the same tensors in the same order. A world of one: done at once. */
nvl_status nvl_dist_all_reduce_bg(nvl_tensor *t, const nvl_tensor *src, nvl_dist_op op, int delta);
/* Complete the background all-reduce (nothing when none is pending). */
nvl_status nvl_dist_bg_wait(void);
/* 1 while one is started and not waited for. */
int nvl_dist_bg_pending(void);
/* 1 while one is started and not known to be complete (its thread still runs; without the thread:
 * until it is waited for). Makes no MPI call. */
int nvl_dist_bg_busy(void);
/* 1 when background all-reduces run in a thread of their own (MPI_THREAD_MULTIPLE granted). */
int nvl_dist_bg_threaded(void);
/* x (n doubles on every rank) = op over the ranks, element by element, in one collective (for
 * losses, norms, flags). */
nvl_status nvl_dist_all_reduce_f64(double *x, int n, nvl_dist_op op);
/* t = root's t on every rank. */
nvl_status nvl_dist_broadcast(nvl_tensor *t, int root);
/* t (world * n, ...) is cut along dim 0 into world equal chunks; out (n, ...) on rank r = op over
 * the ranks of chunk r. */
nvl_status nvl_dist_reduce_scatter(nvl_tensor *out, const nvl_tensor *t, nvl_dist_op op);
/* out (world * n, ...) = the ranks' t (n, ...) in rank order. t may be out's own chunk (the view
 * of rows [rank n, (rank+1) n) of a contiguous out): then it is gathered in place. */
nvl_status nvl_dist_all_gather(nvl_tensor *out, const nvl_tensor *t);

/* nvl_dist_all_reduce and nvl_dist_all_gather, ordered instead of waited for: on CUDA tensors the
 * collective is queued on NCCL's stream after stream 0's queued work and stream 0's later work waits
 * for it (an event), and the host does not wait (no host synchronisation; the tensors may be freed
 * at once: the caching allocator hands their blocks only to stream 0's later work). CPU tensors:
 * the blocking collectives. The quantized all-gather (core/qgather.h) is made of these. */
nvl_status nvl_dist_all_reduce_ordered(nvl_tensor *t, nvl_dist_op op);
nvl_status nvl_dist_all_gather_ordered(nvl_tensor *out, const nvl_tensor *t);

/* A nonblocking all-gather (prefetching the next layer's weights while this one computes): start out =
 * the ranks' t as nvl_dist_all_gather does (contiguous tensors; in place when t is out's own chunk)
 * and return; *ticket names it for nvl_dist_all_gather_wait (-1: nothing to wait for, a world of one).
 * CPU tensors: MPI_Iallgather (Open MPI advances it inside MPI calls: each start and wait tests the
 * gathers in flight). CUDA tensors: NCCL on its stream after stream 0's queued work, then an event; stream
 * 0 does not wait, so the work queued next runs beside it. out and t are held (a share each) until the
 * wait; neither may be touched meanwhile. At most 256 in flight. */
nvl_status nvl_dist_all_gather_start(nvl_tensor *out, const nvl_tensor *t, int *ticket);
/* Complete one: CPU, MPI_Wait (out then holds the result); CUDA, stream 0's later work waits for it (an
 * event; the host does not wait). */
nvl_status nvl_dist_all_gather_wait(int ticket);

/* The row split every sharded feature uses (ZeRO-2/3 shards, the quantized all-gather): `rows` rows
 * over `world` ranks in units of `align` rows (align >= 1), front-loaded like torch.chunk and FSDP2:
 *   chunk = ceil(ceil(rows / align) / world) * align        rows per rank, padding included
 *   rank r holds the contiguous rows [min(r * chunk, rows), min((r + 1) * chunk, rows))
 * Every shard is a multiple of align rows except the one that ends at `rows`; no rank holds more than
 * chunk rows, the smallest maximum any split into align-row units allows (so memory per rank is as
 * even as it can be); ranks past the end hold 0 rows (whenever (world - 1) * chunk >= rows, so always
 * when rows <= world - 1 units, and also e.g. 5 units on 4 ranks: 2, 2, 1, 0). Padding every shard to
 * chunk rows puts the padding after row `rows`, so equal-count collectives (NCCL's all-gather and
 * reduce-scatter, which have no v-variants) gather and scatter in place: world * chunk rows whose
 * first `rows` are the tensor. *row0, *n: rank's first row (0-based) and row count; *chunk. */
void nvl_dist_shard_rows(int64_t rows, int world, int64_t align, int rank, int64_t *row0, int64_t *n, int64_t *chunk);

/* Bytes this rank has sent in collectives since start (or nvl_dist_bytes_reset), by kind, as the ring
 * algorithms NCCL and MPI use for large messages move them, counted per call from the sizes (not
 * measured on the wire): all-gather (N - 1) / N of the gathered tensor, reduce-scatter (N - 1) / N of
 * the tensor scattered, all-reduce 2 (N - 1) / N of the tensor (the bucketed, background and
 * number all-reduces too), broadcast (N - 1) / N (averaged over the ranks); N the world size, each
 * rounded down to a byte; 0 in a world of one. */
typedef enum { NVL_DIST_BYTES_ALL_GATHER = 0, NVL_DIST_BYTES_REDUCE_SCATTER = 1, NVL_DIST_BYTES_ALL_REDUCE = 2,
               NVL_DIST_BYTES_BROADCAST = 3, NVL_DIST_BYTES_COUNT } nvl_dist_bytes_kind;
extern const char *const nvl_dist_bytes_names[NVL_DIST_BYTES_COUNT];
int64_t nvl_dist_bytes(nvl_dist_bytes_kind kind);
void nvl_dist_bytes_reset(void);

/* Collective timeout in seconds (0: none); the default comes from NVLUA_DIST_TIMEOUT or 600. */
void nvl_dist_set_timeout(double seconds);
double nvl_dist_timeout(void);

/* End cleanly: MPI_Finalize (every rank must call it; idempotent; nothing before init). */
void nvl_dist_finalize(void);
/* End every rank's process with this exit status (MPI_Abort when the world is larger than one,
 * else exit). For a rank that fails alone: the others would wait in their next collective. */
void nvl_dist_abort(int status);
/* The driver's last call: finalize when ok, else (a script that failed on this rank) print
 * nothing more and abort the job. */
void nvl_dist_shutdown(int ok);

/* ---- NCCL (core/dist_nccl.c; compiled with CUDA and NCCL, untested without a GPU) ---------- */
/* 1 if the NCCL library can be loaded and every function resolves; else 0 and *why. */
int nvl_nccl_available(const char **why);

#ifdef __cplusplus
}
#endif
#endif
