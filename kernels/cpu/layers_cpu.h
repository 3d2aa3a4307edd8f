/* layers_cpu.h: fast CPU kernels of the layer library (OpenMP over rows or column chunks,
 * inner loops the compiler vectorises). Same arguments and contracts as the references in
 * kernels/cpu/ref/layers_ref.h, against which tests/test_layers.lua checks each one:
 *   bit-identical: embedding forward/backward, rmsnorm dweight, rope forward/backward, adamw
 *     (same arithmetic in the same order; parameter-gradient sums run over rows in order);
 *   within a stated tolerance: rmsnorm (row sums of squares and dot products reassociated by
 *     SIMD), swiglu and cross-entropy (f32 expf instead of double exp), sumsq (chunked sums).
 * Every result is independent of the number of threads: reductions use fixed chunks that are
 * combined in order. The kernels are static in layers_cpu.c and reach core through
 * nvl_layers_cpu, the CPU table's layer sub-table. */
#ifndef NVL_LAYERS_CPU_H
#define NVL_LAYERS_CPU_H
#include "cpu/ref/layers_ref.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CPU table's layer kernels (static in layers_cpu.c; attention from attention_cpu.c). */
extern const nvl_layer_kernels nvl_layers_cpu;

#ifdef __cplusplus
}
#endif
#endif
