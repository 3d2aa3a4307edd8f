/* dist_nccl.h: what core/dist.c asks of the NCCL backend (core/dist_nccl.c): collectives on CUDA
 * tensors over one communicator, and the hooks of dist.c's watchdog. Internal to core/. Without
 * CUDA + NCCL every collective here fails with NVL_EUNSUPPORTED. */
#ifndef NVL_DIST_NCCL_H
#define NVL_DIST_NCCL_H
#include "dist.h"

/* 1 if compiled with NCCL. */
int nvl_nccl_compiled(void);
/* Load libnccl and resolve its functions (once); 1 on success, else 0 and *why. */
int nvl_nccl_load(const char **why);
/* Watchdog tick: NULL, or the NCCL asynchronous error (the communicator is then aborted). */
const char *nvl_nccl_watch(int in_op);
/* Abort the communicator (if any), so kernels waiting on dead peers return. */
void nvl_nccl_abort(void);
/* Destroy the communicator (at finalize). */
void nvl_nccl_shutdown(void);
/* The collectives of dist.h on contiguous CUDA tensors, checked by dist.c. */
nvl_status nvl_nccl_all_reduce(nvl_tensor *t, nvl_dist_op op, int rank, int world);
/* Queue the all-reduce on NCCL's stream after stream 0's work; no wait (nvl_nccl_wait_all). */
nvl_status nvl_nccl_all_reduce_start(nvl_tensor *t, nvl_dist_op op, int rank, int world);
/* Stream 0 waits (an event) for every all-reduce queued by nvl_nccl_all_reduce_start. */
nvl_status nvl_nccl_wait_all(void);
nvl_status nvl_nccl_broadcast(nvl_tensor *t, int root, int rank, int world);
nvl_status nvl_nccl_reduce_scatter(nvl_tensor *out, const nvl_tensor *t, nvl_dist_op op, int rank, int world);
nvl_status nvl_nccl_all_gather(nvl_tensor *out, const nvl_tensor *t, int in_place, int rank, int world);
/* The all-reduce and all-gather above without the host's wait: queued after stream 0's work, stream
 * 0's later work after them (an event); dist.h nvl_dist_*_ordered. */
nvl_status nvl_nccl_all_reduce_ordered(nvl_tensor *t, nvl_dist_op op, int rank, int world);
nvl_status nvl_nccl_all_gather_ordered(nvl_tensor *out, const nvl_tensor *t, int rank, int world);
/* The all-gather queued after stream 0's work with an event of its own after it (*slot names the event),
 * stream 0 not waiting; nvl_nccl_event_wait(slot): stream 0's later work waits for it, the slot is free. */
nvl_status nvl_nccl_all_gather_start(nvl_tensor *out, const nvl_tensor *t, int rank, int world, int *slot);
nvl_status nvl_nccl_event_wait(int slot);
/* From dist.c: buf = root's buf on every rank (MPI_Bcast; nothing in a world of one). */
nvl_status nvl_dist_bcast_bytes(void *buf, int bytes, int root);

#endif
