/* mma.h (emulation): CUDA's warp matrix functions (nvcuda::wmma) for the emulation build, as far as the
 * .cu files of kernels/cuda use them: 16x16x16 tiles, bf16 matrix_a / matrix_b (row or column major) and a
 * float accumulator; fill_fragment, load_matrix_sync, store_matrix_sync, mma_sync. C++ only.
 *
 * Rules checked as a GPU imposes them (CUDA Programming Guide, "Warp Matrix Functions"): every function is
 * called by all 32 lanes of a warp at the same call site, convergently (the emulator's warp-function
 * machinery: a lane that is missing, has exited or waits elsewhere is a divergent-warp fault), with the
 * same pointer, ldm and fill value in every lane; a load/store pointer is 256-bit (32-byte) aligned; ldm is
 * a multiple of 8 elements for bf16 and of 4 for float. A broken rule ends the kernel with a fault.
 *
 * Fragment layout: WMMA leaves the element -> lane mapping unspecified. Here each lane holds its own
 * elements (x[], num_elements 8) in the layout of PTX mma.m16n8k16 (PTX ISA, "Matrix Fragments for
 * mma.m16n8k16 with floating point type"), the 16x16 tile taken as two n8 halves: with g = lane / 4 and
 * c = lane % 4,
 *   matrix_a a_i: row g + 8 ((i >> 1) & 1), col 2c + (i & 1) + 8 (i >> 2);
 *   matrix_b b_i: row (k) 2c + (i & 1) + 8 ((i >> 1) & 1), col (n) g + 8 (i >> 2);
 *   accumulator c_i: row g + 8 ((i >> 1) & 1), col 2c + (i & 1) + 8 (i >> 2).
 * Code that gives x[] element-wise meaning beyond a uniform operation (the same op on every element)
 * depends on a layout CUDA does not promise; kernels here do not.
 *
 * Memory order, modelled strictly: a lane reads (load) or writes (store) its own elements when it reaches
 * the call, before the warp converges, so a lane's shared-memory writes that another lane's load needs
 * must be ordered by __syncwarp / __syncthreads first, as on a GPU. mma_sync stages every lane's operands
 * in a per-warp buffer, converges, computes each lane's own elements of D, and converges again.
 * Arithmetic of mma_sync: bf16 products are exact in fp32; each lane's d = c + sum_k a b is summed in
 * fp32 in k order 0..15 starting from c. A tensor core's internal order and rounding are unspecified
 * (NVIDIA documents none), so a result may differ from a GPU's by fp32 summation-order error: tests
 * compare within such bounds, never bit for bit. */
#ifndef NVL_EMU_MMA_H
#define NVL_EMU_MMA_H
#include <stdint.h>
#include <string.h>

#include "cuda_bf16.h"
#include "emu_device.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator models the 16x16x16 wmma shape only");
  static_assert((std::is_same<Use, accumulator>::value && std::is_same<T, float>::value) ||
                    (!std::is_same<Use, accumulator>::value && std::is_same<T, __nv_bfloat16>::value),
                "the emulator models bf16 matrix_a/matrix_b and float accumulator fragments only");
  enum { num_elements = 8 };
  T x[8];
};

}  // namespace wmma
}  // namespace nvcuda

namespace nvl_emu {
namespace wmma_detail {

/* row / col in the 16x16 tile of element i of lane `lane` (header comment) */
inline int row_a(int lane, int i) { return lane / 4 + 8 * ((i >> 1) & 1); }
inline int col_a(int lane, int i) { return 2 * (lane % 4) + (i & 1) + 8 * (i >> 2); }
inline int row_b(int lane, int i) { return 2 * (lane % 4) + (i & 1) + 8 * ((i >> 1) & 1); }
inline int col_b(int lane, int i) { return lane / 4 + 8 * (i >> 2); }

inline int tid() { return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

/* mma_sync's staging: per warp of the block, the 16x16 A, B, C tiles as float */
struct Stage {
  float a[16][16], b[16][16], c[16][16];
};
inline Stage stage[32];

inline float bf(__nv_bfloat16 h) { return __bfloat162float(h); }

inline void check_ptr(const void *p, unsigned ldm, unsigned mult, const char *fn, const char *file, int line) {
  if ((uintptr_t)p % 32) device_fail(file, line, "%s: the pointer %p is not 256-bit (32-byte) aligned", fn, p);
  if (ldm % mult)
    device_fail(file, line, "%s: ldm %u is not a multiple of %u elements (16 bytes) for this element type", fn, ldm,
                mult);
}

inline uint64_t ptr_bits(const void *p) { return (uint64_t)(uintptr_t)p; }

}  // namespace wmma_detail
}  // namespace nvl_emu

namespace nvcuda {
namespace wmma {

template <class Use, class T, class L>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L> &f, T v, NVL_EMU_SITE) {
  for (int i = 0; i < 8; i++) f.x[i] = v;
  (void)::nvl_emu::warp_op(::nvl_emu::W_WMMA_FILL, 0xffffffffu, ::nvl_emu::to_bits(v), 0, 32, nvl_file, nvl_line);
}

/* matrix_a / matrix_b from bf16 memory; the layout is the fragment's */
template <class Use, class L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, L> &f, const __nv_bfloat16 *p, unsigned ldm,
                             NVL_EMU_SITE) {
  namespace d = ::nvl_emu::wmma_detail;
  static_assert(!std::is_same<L, void>::value, "a matrix_a/matrix_b fragment names its layout");
  d::check_ptr(p, ldm, 8, "wmma::load_matrix_sync", nvl_file, nvl_line);
  const int lane = d::tid() % 32;
  constexpr bool a = std::is_same<Use, matrix_a>::value, row = std::is_same<L, row_major>::value;
  for (int i = 0; i < 8; i++) {
    const int r = a ? d::row_a(lane, i) : d::row_b(lane, i), c = a ? d::col_a(lane, i) : d::col_b(lane, i);
    f.x[i] = row ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
  }
  (void)::nvl_emu::warp_op(::nvl_emu::W_WMMA_LOAD, 0xffffffffu, d::ptr_bits(p), (int)ldm, 32, nvl_file, nvl_line);
}

/* an accumulator from float memory */
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm, layout_t l,
                             NVL_EMU_SITE) {
  namespace d = ::nvl_emu::wmma_detail;
  d::check_ptr(p, ldm, 4, "wmma::load_matrix_sync", nvl_file, nvl_line);
  const int lane = d::tid() % 32;
  for (int i = 0; i < 8; i++) {
    const int r = d::row_a(lane, i), c = d::col_a(lane, i);
    f.x[i] = l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
  }
  (void)::nvl_emu::warp_op(::nvl_emu::W_WMMA_LOAD, 0xffffffffu, d::ptr_bits(p), (int)(ldm * 2 + l), 32, nvl_file,
                           nvl_line);
}

inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm, layout_t l,
                              NVL_EMU_SITE) {
  namespace d = ::nvl_emu::wmma_detail;
  d::check_ptr(p, ldm, 4, "wmma::store_matrix_sync", nvl_file, nvl_line);
  const int lane = d::tid() % 32;
  for (int i = 0; i < 8; i++) {
    const int r = d::row_a(lane, i), c = d::col_a(lane, i);
    (l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r]) = f.x[i];
  }
  (void)::nvl_emu::warp_op(::nvl_emu::W_WMMA_STORE, 0xffffffffu, d::ptr_bits(p), (int)(ldm * 2 + l), 32, nvl_file,
                           nvl_line);
}

/* d = a b + c (d may be c) */
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &dst,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float> &c, NVL_EMU_SITE) {
  namespace d = ::nvl_emu::wmma_detail;
  const int t = d::tid(), lane = t % 32;
  d::Stage &s = d::stage[t / 32];
  for (int i = 0; i < 8; i++) {
    s.a[d::row_a(lane, i)][d::col_a(lane, i)] = d::bf(a.x[i]);
    s.b[d::row_b(lane, i)][d::col_b(lane, i)] = d::bf(b.x[i]);
    s.c[d::row_a(lane, i)][d::col_a(lane, i)] = c.x[i];
  }
  (void)::nvl_emu::warp_op(::nvl_emu::W_WMMA_MMA, 0xffffffffu, 0, 0, 32, nvl_file, nvl_line);
  float out[8];
  for (int i = 0; i < 8; i++) {
    const int r = d::row_a(lane, i), col = d::col_a(lane, i);
    float acc = s.c[r][col];
    for (int k = 0; k < 16; k++) acc += s.a[r][k] * s.b[k][col];
    out[i] = acc;
  }
  (void)::nvl_emu::warp_op(::nvl_emu::W_WMMA_MMA, 0xffffffffu, 1, 0, 32, nvl_file, nvl_line);
  for (int i = 0; i < 8; i++) dst.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda
#endif
