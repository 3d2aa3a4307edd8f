/* quant.cu: the quantization kernels of core/NUMERICS.md on device tensors — per-tensor amax, fp8
 * per-tensor (current and delayed scaling), the mx formats (both scale rules; e4m3, e5m2 and
 * e2m1 elements, e2m1 with stochastic rounding too), nvfp4 1x16
 * and 16x16, the RHT fused in front of any of them, stochastic rounding from the shared Philox
 * stream, block scales written row-major and in cuBLASLt's 128x4 swizzled layout, and the fused
 * row-wise + column-wise quantization of a 2-D tensor from one read: the quantize and
 * quantize_pair entries of the CUDA table. A quantization blocked along a dimension that is not the
 * last (column-wise: wgrad's copies, a weight's dgrad copy) goes through 64x64 shared-memory tiles,
 * as the pair does, so its global reads (and fp8 / values writes) are coalesced. Results are meant to be bit for bit those of the CPU
 * quantizers (kernels/cpu/quant_cpu.c, itself tested against kernels/cpu/ref/formats_ref.c): the
 * element arithmetic is common.cuh's, the order of operations the references'.
 *
 * Not here: allocation (the caller passes every output; the amax words are call scratch), the
 * GEMMs (gemm.cu), dequantization to the host (core/quant.c copies codes back and decodes there).
 *
 * Shape letters: the input is (B, K, C) contiguous; the blocked layout is (rows = B*C, K), row
 * r = b*C + c, element k at x[(b*K + k)*C + c]. A "unit" is the run of U consecutive elements of
 * one blocked row that one thread handles: a 16-element nvfp4 block, a 32-element mx block,
 * or a 16-element RHT chunk (fp8 / values with the RHT). nb = K/U units per row; the SR stream
 * counts 16-element groups: an nvfp4 unit (r, kb) draws group r*nb + kb, an mx unit groups 2 kb
 * and 2 kb + 1 of row r, as the CPU's. */
#include <stdio.h>
#include <string.h>

#include "common.cuh"

namespace {

enum { KIND_VALUES = NVL_CQ_VALUES, KIND_FP8 = NVL_CQ_FP8, KIND_MX = NVL_CQ_MX, KIND_NVFP4 = NVL_CQ_NVFP4 };

/* How a linear work index maps to units (r, kb); chosen per launch. */
enum {
  MAP_CONTIG = 0,   /* C == 1: units in memory order (r = w / nb, kb = w % nb) */
  MAP_CONTIG2D = 1, /* C == 1, 16x16 tiles: 16 consecutive w = the 16 rows of one tile column */
  MAP_STRIDED = 2,  /* C > 1: w = (b*nb + kb)*C + c, so consecutive threads read consecutive c (the RHT
                     * amax pass, and 16x16 blocks with C % 16 != 0; quantizations take the tiles) */
};

struct QParams {
  const void *x;
  int64_t B, K, C, rows, nb;
  int map;
  int vec;                 /* C == 1 and x 16-byte aligned: vector loads */
  void *codes;
  uint8_t *scales, *scales_swz;
  float signs[16];
  int rht, sr, block2d, elem, rule, values_bf16;
  uint64_t seed, offset;
  int64_t sr_row_off, sr_nbt, sr_kb_off; /* SR group of 16 elements: g = (sr_row_off + r) * sr_nbt + sr_kb_off + j */
  float amax_given;        /* used when amax_bits is NULL */
  const uint32_t *amax_bits;
  uint32_t *nonfinite;     /* the device's flag word (common.cuh flag_nonfinite), or NULL */
};

template <typename T> __device__ __forceinline__ float load_elem(const T *p);
template <> __device__ __forceinline__ float load_elem<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float load_elem<uint16_t>(const uint16_t *p) { return bf16_bits_to_f32(*p); }

/* v (L) = the unit of blocked row r starting at k0. */
template <typename T, int L>
__device__ __forceinline__ void load_unit(float v[L], const QParams &p, int64_t r, int64_t k0) {
  const T *x = static_cast<const T *>(p.x);
  if (p.C == 1) {
    const T *src = x + r * p.K + k0;
    if (p.vec) {
      if (sizeof(T) == 4) {
        const float4 *s4 = reinterpret_cast<const float4 *>(src);
#pragma unroll
        for (int q = 0; q < L / 4; q++) {
          float4 f = s4[q];
          v[4 * q] = f.x; v[4 * q + 1] = f.y; v[4 * q + 2] = f.z; v[4 * q + 3] = f.w;
        }
      } else {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(src);
#pragma unroll
        for (int q = 0; q < L / 8; q++) {
          uint4 u = s4[q];
          const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
          for (int i = 0; i < 4; i++) {
            v[8 * q + 2 * i] = u2f(w[i] << 16);
            v[8 * q + 2 * i + 1] = u2f(w[i] & 0xFFFF0000u);
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < L; j++) v[j] = load_elem<T>(src + j);
    }
  } else {
    int64_t b = r / p.C, c = r % p.C;
    const T *src = x + (b * p.K + k0) * p.C + c;
#pragma unroll
    for (int j = 0; j < L; j++) v[j] = load_elem<T>(src + j * p.C);
  }
}

/* Unit (r, kb) of work index w, per the map. */
__device__ __forceinline__ void unit_of(const QParams &p, int64_t w, int64_t &r, int64_t &kb) {
  if (p.map == MAP_CONTIG) {
    r = w / p.nb;
    kb = w - r * p.nb;
  } else if (p.map == MAP_CONTIG2D) {
    int64_t tile = w >> 4, i = w & 15;
    int64_t tr = tile / p.nb;
    kb = tile - tr * p.nb;
    r = tr * 16 + i;
  } else {
    int64_t c = w % p.C, t = w / p.C;
    int64_t b = t / p.nb;
    kb = t - b * p.nb;
    r = b * p.C + c;
  }
}

__device__ __forceinline__ float param_amax(const QParams &p) {
  return p.amax_bits ? u2f(*p.amax_bits) : p.amax_given;
}

/* Max over the 16 lanes of this lane's aligned half-warp (all 32 lanes take part). */
__device__ __forceinline__ uint32_t max16(uint32_t m) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

/* ---- encoders of one unit, shared by the unit kernel and the fused pair kernel --------------- */

/* Per-launch constants of an nvfp4 quantization, from its amax (formats_ref.c order). */
struct Nvfp4Consts {
  float s_enc6, s_dec;
};
__device__ __forceinline__ Nvfp4Consts nvfp4_consts(float amax) {
  float s_enc = nvfp4_enc_scale(amax);
  Nvfp4Consts c;
  c.s_dec = f_div(1.0f, s_enc);
  c.s_enc6 = f_mul(s_enc, u2f(NVL_ONE_SIXTH_BITS));
  return c;
}

/* One nvfp4 block: v (16, after the RHT) with block (or tile) max bmax -> 8 packed bytes and
 * its scale byte, at unit (r, kb). */
__device__ __forceinline__ void nvfp4_unit(const QParams &p, const Nvfp4Consts &k, const float v[16], uint32_t bmax,
                                           int64_t r, int64_t kb) {
  uint32_t sd = nvfp4_block_scale(u2f(bmax), k.s_enc6);
  float se = nvfp4_elem_scale(sd, k.s_dec);
  uint32_t q[16];
  if (p.sr) {
    uint32_t w[4];
    philox_words(p.seed, p.offset, (uint64_t)((p.sr_row_off + r) * p.sr_nbt + p.sr_kb_off + kb), w);
#pragma unroll
    for (int j = 0; j < 16; j++) q[j] = e2m1_encode_sr(f_mul(v[j], se), (w[j >> 2] >> (8 * (j & 3))) & 0xFFu);
  } else {
#pragma unroll
    for (int j = 0; j < 16; j++) q[j] = e2m1_encode(f_mul(v[j], se));
  }
  uint2 packed;
  packed.x = q[0] | q[1] << 4 | q[2] << 8 | q[3] << 12 | q[4] << 16 | q[5] << 20 | q[6] << 24 | q[7] << 28;
  packed.y = q[8] | q[9] << 4 | q[10] << 8 | q[11] << 12 | q[12] << 16 | q[13] << 20 | q[14] << 24 | q[15] << 28;
  uint8_t *codes = static_cast<uint8_t *>(p.codes);
  *reinterpret_cast<uint2 *>(codes + r * (p.K / 2) + kb * 8) = packed;
  p.scales[r * p.nb + kb] = (uint8_t)sd;
  if (p.scales_swz) p.scales_swz[swizzle_offset(r, kb, p.nb)] = (uint8_t)sd;
}

/* One mx block: v (32) -> 32 codes (e2m1: 16 packed bytes, RNE or SR) and its e8m0 byte. */
__device__ __forceinline__ void mx_unit(const QParams &p, const float v[32], int64_t r, int64_t kb) {
  uint32_t bmax = 0;
#pragma unroll
  for (int j = 0; j < 32; j++) bmax = max(bmax, abs_bits(v[j]));
  const float emax_val = p.elem == 2 ? 6.0f : p.elem == 1 ? 57344.0f : 448.0f;
  const int emax_exp = p.elem == 2 ? 2 : p.elem == 1 ? 15 : 8;
  uint32_t e = p.rule == 0 ? e8m0_rceil(u2f(bmax), emax_val) : e8m0_floor(u2f(bmax), emax_exp);
  float inv = e8m0_inverse(e);
  if (p.elem == 2) {
    uint32_t q[32];
    if (p.sr) {
      uint32_t w[8];
      const uint64_t g0 = (uint64_t)((p.sr_row_off + r) * p.sr_nbt + p.sr_kb_off + 2 * kb);
      philox_words(p.seed, p.offset, g0, w);
      philox_words(p.seed, p.offset, g0 + 1, w + 4);
#pragma unroll
      for (int j = 0; j < 32; j++) q[j] = e2m1_encode_sr(f_mul(v[j], inv), (w[j >> 2] >> (8 * (j & 3))) & 0xFFu);
    } else {
#pragma unroll
      for (int j = 0; j < 32; j++) q[j] = e2m1_encode(f_mul(v[j], inv));
    }
    uint32_t pk[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
      pk[i] = q[8 * i] | q[8 * i + 1] << 4 | q[8 * i + 2] << 8 | q[8 * i + 3] << 12 | q[8 * i + 4] << 16 |
              q[8 * i + 5] << 20 | q[8 * i + 6] << 24 | q[8 * i + 7] << 28;
    *reinterpret_cast<uint4 *>(static_cast<uint8_t *>(p.codes) + r * (p.K / 2) + kb * 16) =
        make_uint4(pk[0], pk[1], pk[2], pk[3]);
  } else {
    const bool e5 = p.elem == 1;
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
      uint32_t b0, b1, b2, b3;
      if (e5) {
        b0 = e5m2_encode(f_mul(v[4 * i], inv)); b1 = e5m2_encode(f_mul(v[4 * i + 1], inv));
        b2 = e5m2_encode(f_mul(v[4 * i + 2], inv)); b3 = e5m2_encode(f_mul(v[4 * i + 3], inv));
      } else {
        b0 = e4m3_encode(f_mul(v[4 * i], inv)); b1 = e4m3_encode(f_mul(v[4 * i + 1], inv));
        b2 = e4m3_encode(f_mul(v[4 * i + 2], inv)); b3 = e4m3_encode(f_mul(v[4 * i + 3], inv));
      }
      w[i] = b0 | b1 << 8 | b2 << 16 | b3 << 24;
    }
    uint4 *dst = reinterpret_cast<uint4 *>(static_cast<uint8_t *>(p.codes) + r * p.K + kb * 32);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
  p.scales[r * p.nb + kb] = (uint8_t)e;
  if (p.scales_swz) p.scales_swz[swizzle_offset(r, kb, p.nb)] = (uint8_t)e;
}

/* 16 elements (an RHT chunk) of a per-tensor fp8 quantization with encode scale s. */
__device__ __forceinline__ void fp8_unit(const QParams &p, float s, const float v[16], int64_t r, int64_t kb) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    uint32_t b[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      b[j] = p.elem == 1 ? e5m2_encode(f_mul(v[4 * i + j], s)) : e4m3_encode(f_mul(v[4 * i + j], s));
    w[i] = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24;
  }
  *reinterpret_cast<uint4 *>(static_cast<uint8_t *>(p.codes) + r * p.K + kb * 16) = make_uint4(w[0], w[1], w[2], w[3]);
}

/* 16 values (an RHT chunk) stored as f32 or bf16. */
__device__ __forceinline__ void values_unit(const QParams &p, const float v[16], int64_t r, int64_t kb) {
  if (p.values_bf16) {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = (uint32_t)f32_to_bf16_bits(v[2 * i]) | (uint32_t)f32_to_bf16_bits(v[2 * i + 1]) << 16;
    uint4 *dst = reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p.codes) + r * p.K + kb * 16);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
    float4 *dst = reinterpret_cast<float4 *>(static_cast<float *>(p.codes) + r * p.K + kb * 16);
#pragma unroll
    for (int q = 0; q < 4; q++) dst[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  }
}

/* ---- the unit kernel: any (B, K, C), one unit per thread ------------------------------------ */

template <typename T, int KIND>
__global__ void __launch_bounds__(256) quant_unit_kernel(QParams p) {
  constexpr int L = KIND == KIND_MX ? 32 : 16;
  const int64_t total = p.rows * p.nb;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int lane = threadIdx.x & 31;
  const float amax = param_amax(p);
  Nvfp4Consts nk = {0.0f, 0.0f};
  float fp8_s = 1.0f;
  if (KIND == KIND_NVFP4) nk = nvfp4_consts(amax);
  if (KIND == KIND_FP8) fp8_s = fp8_tensor_scale(amax, p.elem == 1 ? 57344.0f : 448.0f);
  uint32_t raw = 0; /* the inputs' raw_bits (common.cuh): a quantized format's non-finite flag */
  /* warp-uniform trip count: the 2D tile max shuffles across 16 lanes */
  for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w - lane < total; w += stride) {
    const bool active = w < total;
    int64_t r = 0, kb = 0;
    float v[L];
    if (active) {
      unit_of(p, w, r, kb);
      load_unit<T, L>(v, p, r, kb * L);
#pragma unroll
      for (int j = 0; j < L; j++) raw = max(raw, raw_bits(v[j]));
      if (p.rht) {
        rht16_as<T>(v, p.signs);
        if (L == 32) rht16_as<T>(v + 16, p.signs);
      }
    } else {
#pragma unroll
      for (int j = 0; j < L; j++) v[j] = 0.0f;
    }
    if (KIND == KIND_NVFP4) {
      uint32_t bmax = 0;
#pragma unroll
      for (int j = 0; j < 16; j++) bmax = max(bmax, abs_bits(v[j]));
      if (p.block2d) bmax = max16(bmax);
      if (active) nvfp4_unit(p, nk, v, bmax, r, kb);
    } else if (active) {
      if (KIND == KIND_MX) mx_unit(p, v, r, kb);
      else if (KIND == KIND_FP8) fp8_unit(p, fp8_s, v, r, kb);
      else values_unit(p, v, r, kb);
    }
  }
  if (KIND != KIND_VALUES) flag_nonfinite(raw, p.nonfinite, NVL_NONFINITE_INPUT);
}

/* ---- per-element kernel: fp8 per-tensor and values without the RHT, any K ------------------- */

template <typename T, int KIND>
__global__ void __launch_bounds__(256) quant_elem_kernel(QParams p) {
  const int64_t n = p.rows * p.K;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const T *x = static_cast<const T *>(p.x);
  float s = 1.0f;
  if (KIND == KIND_FP8) s = fp8_tensor_scale(param_amax(p), p.elem == 1 ? 57344.0f : 448.0f);
  uint32_t raw = 0; /* the inputs' raw_bits: fp8's non-finite flag */
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    int64_t src = i;
    if (p.C != 1) {
      int64_t r = i / p.K, k = i - r * p.K;
      int64_t b = r / p.C, c = r - b * p.C;
      src = (b * p.K + k) * p.C + c;
    }
    float v = load_elem<T>(x + src);
    raw = max(raw, raw_bits(v));
    if (KIND == KIND_FP8) {
      float y = f_mul(v, s);
      static_cast<uint8_t *>(p.codes)[i] = (uint8_t)(p.elem == 1 ? e5m2_encode(y) : e4m3_encode(y));
    } else if (p.values_bf16) {
      static_cast<uint16_t *>(p.codes)[i] = f32_to_bf16_bits(v);
    } else {
      static_cast<float *>(p.codes)[i] = v;
    }
  }
  if (KIND == KIND_FP8) flag_nonfinite(raw, p.nonfinite, NVL_NONFINITE_INPUT);
}

/* ---- amax ----------------------------------------------------------------------------------- */

/* Block-wide max of m into *out (atomicMax on the bits: non-negative floats order as integers). */
__device__ __forceinline__ void block_max_to(uint32_t m, uint32_t *out) {
  NVL_SHARED(uint32_t, warp_max, [32]);
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  if (lane == 0) warp_max[wid] = m;
  __syncthreads();
  if (wid == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    m = lane < nw ? warp_max[lane] : 0u;
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if (lane == 0 && m) atomicMax(out, m);
  }
}

/* max |x| over n contiguous elements, NaN ignored. */
template <typename T>
__global__ void __launch_bounds__(256) amax_kernel(const T *__restrict__ x, int64_t n, int vec, uint32_t *out,
                                                   uint32_t *nonfinite) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t m = 0, raw = 0;
  int64_t start = 0;
  if (vec) {
    /* 16 bytes per load: 4 f32 or 8 bf16 */
    constexpr int PER = 16 / sizeof(T);
    const int64_t n16 = n / PER;
    const uint4 *x4 = reinterpret_cast<const uint4 *>(x);
    for (int64_t i = tid; i < n16; i += stride) {
      uint4 u = x4[i];
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int q = 0; q < 4; q++) {
        if (sizeof(T) == 4) {
          m = max(m, abs_bits(u2f(w[q])));
          raw = max(raw, raw_bits(u2f(w[q])));
        } else {
          m = max(m, abs_bits(u2f(w[q] << 16)));
          m = max(m, abs_bits(u2f(w[q] & 0xFFFF0000u)));
          raw = max(raw, max(raw_bits(u2f(w[q] << 16)), raw_bits(u2f(w[q] & 0xFFFF0000u))));
        }
      }
    }
    start = n16 * PER;
  }
  for (int64_t i = start + tid; i < n; i += stride) {
    const float v = load_elem<T>(x + i);
    m = max(m, abs_bits(v));
    raw = max(raw, raw_bits(v));
  }
  flag_nonfinite(raw, nonfinite, NVL_NONFINITE_INPUT);
  block_max_to(m, out);
}

/* max |RHT(x)| over the 16-chunks along K of the blocked layout. */
template <typename T>
__global__ void __launch_bounds__(256) amax_rht_kernel(QParams p, uint32_t *out) {
  const int64_t total = p.rows * p.nb; /* p.nb = K / 16 here */
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t m = 0, raw = 0;
  for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w < total; w += stride) {
    int64_t r, kb;
    unit_of(p, w, r, kb);
    float v[16];
    load_unit<T, 16>(v, p, r, kb * 16);
#pragma unroll
    for (int j = 0; j < 16; j++) raw = max(raw, raw_bits(v[j]));
    rht16_as<T>(v, p.signs);
#pragma unroll
    for (int j = 0; j < 16; j++) m = max(m, abs_bits(v[j]));
  }
  flag_nonfinite(raw, p.nonfinite, NVL_NONFINITE_INPUT);
  block_max_to(m, out);
}

/* ---- tiled quantizations: the fused row-wise + column-wise pair, and the column-wise one ---- *
 * x is (B, R, C) contiguous (B = 1 for the pair): a quantization blocked along R (the "column-wise"
 * copy: blocked row b*C + c, element k = x[b][k][c]) read through 64x64 tiles, so that every global
 * read is coalesced (16-byte pieces, or consecutive elements where C or x's alignment does not allow
 * them) and the transposition happens in shared memory. One CTA per tile: the tile is read once
 * into shared memory (fp32), then
 *   units (mx, nvfp4; fp8 and values with the RHT): every thread quantizes one unit of a column
 *     (along R) and, for the pair, one of a row (along C). Thread t takes unit ku = t / 64 of column
 *     (or row) t % 64, so a warp reads 32 consecutive columns of one unit row from shared memory (the
 *     row stride of 65 words puts them in 32 banks) or 32 consecutive rows of one unit column, and
 *     the 16 lanes sharing a 16x16 tile are an aligned half-warp (the 2D tile max is a shuffle);
 *   elements (fp8 per tensor and values without the RHT): consecutive threads take consecutive k
 *     of one column, so the codes are written coalesced too (any R and C).
 * For units R is a multiple of the unit (the format's rule along the blocked axis), and for the pair
 * C too; C is otherwise ragged: columns past C are zeros read and nothing written. */
constexpr int TILE = 64;

template <typename T, int KIND, int DIRS>
__device__ __forceinline__ void quant_tile(const QParams &pr, const QParams &pc, int64_t R, int64_t C, int vec) {
  constexpr int U = KIND == KIND_MX ? 32 : 16;
  constexpr int UNITS = TILE / U; /* units per tile line */
  NVL_SHARED(float, tile, [TILE][TILE + 1]);
  const int64_t ntc = (C + TILE - 1) / TILE, ntr = (R + TILE - 1) / TILE;
  const int64_t b = (int64_t)blockIdx.x / (ntr * ntc), tb = (int64_t)blockIdx.x - b * ntr * ntc;
  const int64_t r0 = (tb / ntc) * TILE, c0 = (tb % ntc) * TILE;
  const int t = threadIdx.x;
  const T *x = static_cast<const T *>(pc.x) + b * R * C;

  /* load, zero outside x; raw: the elements' raw_bits (common.cuh) */
  uint32_t raw = 0;
  if (vec) { /* 16-byte pieces (4 f32 or 8 bf16): C a multiple of the piece, x 16-byte aligned */
    constexpr int PER = 16 / sizeof(T), PIECES_PER_ROW = TILE / PER;
#pragma unroll
    for (int pass = 0; pass < TILE * PIECES_PER_ROW / 256; pass++) {
      int idx = pass * 256 + t, row = idx / PIECES_PER_ROW, col = (idx % PIECES_PER_ROW) * PER;
      int64_t gr = r0 + row, gc = c0 + col;
      float v[PER];
      if (gr < R && gc < C) {
        uint4 u = *reinterpret_cast<const uint4 *>(x + gr * C + gc);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
          if (sizeof(T) == 4) {
            v[q] = u2f(w[q]);
          } else {
            v[2 * q] = u2f(w[q] << 16);
            v[2 * q + 1] = u2f(w[q] & 0xFFFF0000u);
          }
        }
      } else {
#pragma unroll
        for (int q = 0; q < PER; q++) v[q] = 0.0f;
      }
#pragma unroll
      for (int q = 0; q < PER; q++) {
        tile[row][col + q] = v[q];
        raw = max(raw, raw_bits(v[q]));
      }
    }
  } else { /* one element per thread per pass, consecutive threads on consecutive columns */
    for (int pass = 0; pass < TILE * TILE / 256; pass++) {
      int idx = pass * 256 + t, row = idx / TILE, col = idx % TILE;
      int64_t gr = r0 + row, gc = c0 + col;
      const float v = gr < R && gc < C ? load_elem<T>(x + gr * C + gc) : 0.0f;
      tile[row][col] = v;
      raw = max(raw, raw_bits(v));
    }
  }
  if (KIND != KIND_VALUES) flag_nonfinite(raw, pc.nonfinite, NVL_NONFINITE_INPUT);
  __syncthreads();

  /* the column-wise copy of fp8 and values without the RHT, element by element */
  if ((KIND == KIND_FP8 || KIND == KIND_VALUES) && !pc.rht && (DIRS & 2)) {
    const float s = KIND == KIND_FP8 ? fp8_tensor_scale(param_amax(pc), pc.elem == 1 ? 57344.0f : 448.0f) : 1.0f;
    for (int pass = 0; pass < TILE * TILE / 256; pass++) {
      const int idx = pass * 256 + t, cl = idx / TILE, kl = idx % TILE;
      const int64_t c = c0 + cl, k = r0 + kl;
      if (c >= C || k >= R) continue;
      const float v = tile[kl][cl];
      const int64_t i = (b * C + c) * R + k;
      if (KIND == KIND_FP8) static_cast<uint8_t *>(pc.codes)[i] = (uint8_t)(pc.elem == 1 ? e5m2_encode(f_mul(v, s))
                                                                                          : e4m3_encode(f_mul(v, s)));
      else if (pc.values_bf16) static_cast<uint16_t *>(pc.codes)[i] = f32_to_bf16_bits(v);
      else static_cast<float *>(pc.codes)[i] = v;
    }
    if (DIRS == 2) return;
  }

#pragma unroll
  for (int dir = 0; dir < 2; dir++) { /* 0: row-wise copy, 1: column-wise copy */
    if (!(DIRS & (1 << dir))) continue;
    const QParams &p = dir == 0 ? pr : pc;
    if (dir == 1 && (KIND == KIND_FP8 || KIND == KIND_VALUES) && !p.rht) continue; /* done above */
    const int line = t % TILE, ku = t / TILE;
    const bool in_tile = ku < UNITS;
    /* unit (r, kb) in this copy's blocked layout, and whether it lies inside x */
    const int64_t r = dir == 0 ? r0 + line : b * C + c0 + line;
    const int64_t kb = (dir == 0 ? c0 : r0) / U + ku;
    const bool active = in_tile && (dir == 0 ? r0 + line < R : c0 + line < C) && kb < p.nb;
    float v[U];
#pragma unroll
    for (int j = 0; j < U; j++) v[j] = dir == 0 ? tile[line][(ku % UNITS) * U + j] : tile[(ku % UNITS) * U + j][line];
    if (p.rht) {
      rht16_as<T>(v, p.signs);
      if (U == 32) rht16_as<T>(v + 16, p.signs);
    }
    if (KIND == KIND_NVFP4) {
      const float amax = param_amax(p);
      const Nvfp4Consts nk = nvfp4_consts(amax);
      uint32_t bmax = 0;
#pragma unroll
      for (int j = 0; j < 16; j++) bmax = max(bmax, abs_bits(v[j]));
      if (p.block2d) bmax = max16(bmax); /* all 256 threads are here: UNITS == 4 */
      if (active) nvfp4_unit(p, nk, v, bmax, r, kb);
    } else if (active) {
      if (KIND == KIND_MX) {
        mx_unit(p, v, r, kb);
      } else if (KIND == KIND_FP8) {
        const float s = fp8_tensor_scale(param_amax(p), p.elem == 1 ? 57344.0f : 448.0f);
        fp8_unit(p, s, v, r, kb);
      } else {
        values_unit(p, v, r, kb);
      }
    }
  }
}

/* The fused pair of a 2-D x (R, C): pr blocked along C, pc along R; R and C multiples of the unit. */
template <typename T, int KIND>
__global__ void __launch_bounds__(256) quant_pair_kernel(QParams pr, QParams pc, int64_t R, int64_t C) {
  quant_tile<T, KIND, 3>(pr, pc, R, C, 1);
}

/* The column-wise quantization of x (B, R, C), blocked along R (C > 1). */
template <typename T, int KIND>
__global__ void __launch_bounds__(256) quant_col_kernel(QParams p, int64_t R, int64_t C, int vec) {
  quant_tile<T, KIND, 2>(p, p, R, C, vec);
}

/* ---- host side ------------------------------------------------------------------------------ */

const char *kind_name(int k) {
  static const char *const names[NVL_CQ_KIND_COUNT] = {"values", "fp8", "mx", "nvfp4"};
  return k >= 0 && k < NVL_CQ_KIND_COUNT ? names[k] : "?";
}

int unit_len(int kind, int rht) {
  if (kind == KIND_NVFP4) return 16;
  if (kind == KIND_MX) return 32;
  return rht ? 16 : 0; /* 0: elementwise */
}

nvl_status check_desc(const nvl_cuda_quant_desc *d, const char *fn) {
  if (d->kind < 0 || d->kind >= NVL_CQ_KIND_COUNT)
    return nvl_error(NVL_EINVAL, "%s: invalid kind %d", fn, d->kind);
  if (!d->x || !d->codes) return nvl_error(NVL_EINVAL, "%s: NULL input or output", fn);
  if (d->B < 0 || d->K < 0 || d->C < 1) return nvl_error(NVL_EINVAL, "%s: invalid shape (%lld, %lld, %lld)", fn,
                                                      (long long)d->B, (long long)d->K, (long long)d->C);
  const char *name = kind_name(d->kind);
  int U = unit_len(d->kind, d->rht);
  if (d->rht && d->K % 16)
    return nvl_error(NVL_EINVAL, "%s: the RHT works on 16-element chunks, but K = %lld", fn, (long long)d->K);
  if (U && d->K % U)
    return nvl_error(NVL_EINVAL, "%s: %s blocks %d elements along K, whose length %lld is not a multiple of %d", fn,
                     name, U, (long long)d->K, U);
  if ((d->kind == KIND_NVFP4 || d->kind == KIND_MX) && !d->scales)
    return nvl_error(NVL_EINVAL, "%s: %s needs a scales buffer", fn, name);
  if (d->block2d && (d->kind != KIND_NVFP4 || (d->B * d->C) % 16))
    return nvl_error(NVL_EINVAL, "%s: 16x16 blocks need nvfp4 and rows %% 16 == 0 (rows %lld)", fn,
                     (long long)(d->B * d->C));
  if (d->sr && !(d->kind == KIND_NVFP4 || (d->kind == KIND_MX && d->elem == 2)))
    return nvl_error(NVL_EINVAL, "%s: SR is defined for e2m1 elements only", fn);
  if (d->sr) {
    const int64_t kt = d->sr_k_total ? d->sr_k_total : d->K;
    if (d->sr_row_offset < 0 || d->sr_k_offset < 0 || d->sr_k_total < 0 || d->sr_k_offset % U || kt % U ||
        d->sr_k_offset > kt - d->K)
      return nvl_error(NVL_EINVAL, "%s: SR slab offsets (row %lld, k %lld, k total %lld) do not fit K = %lld", fn,
                       (long long)d->sr_row_offset, (long long)d->sr_k_offset, (long long)d->sr_k_total, (long long)d->K);
  }
  if (d->kind == KIND_FP8 && (d->elem < 0 || d->elem > 1)) return nvl_error(NVL_EINVAL, "%s: invalid fp8 element %d", fn, d->elem);
  if (d->kind == KIND_MX && (d->elem < 0 || d->elem > 2)) return nvl_error(NVL_EINVAL, "%s: invalid mx element %d", fn, d->elem);
  if (d->kind == KIND_MX && (d->rule < 0 || d->rule > 1))
    return nvl_error(NVL_EINVAL, "%s: invalid mx scale rule %d", fn, d->rule);
  return NVL_OK;
}

QParams make_params(const nvl_cuda_quant_desc *d) {
  QParams p;
  memset(&p, 0, sizeof p);
  p.x = d->x;
  p.B = d->B;
  p.K = d->K;
  p.C = d->C;
  p.rows = d->B * d->C;
  int U = unit_len(d->kind, d->rht);
  p.nb = U ? d->K / U : 0;
  p.map = d->C == 1 ? (d->block2d ? MAP_CONTIG2D : MAP_CONTIG) : MAP_STRIDED;
  p.vec = d->C == 1 && ((uintptr_t)d->x & 15) == 0;
  p.codes = d->codes;
  p.scales = d->scales;
  p.scales_swz = d->scales_swz;
  memcpy(p.signs, d->signs, sizeof p.signs);
  p.rht = d->rht;
  p.sr = d->sr;
  p.block2d = d->block2d;
  p.elem = d->elem;
  p.rule = d->rule;
  p.values_bf16 = d->values_bf16;
  p.seed = d->seed;
  p.offset = d->offset;
  p.sr_row_off = d->sr_row_offset;
  p.sr_nbt = (d->sr_k_total ? d->sr_k_total : d->K) / 16;
  p.sr_kb_off = d->sr_k_offset / 16;
  p.amax_given = d->amax;
  p.amax_bits = NULL;
  int dev = 0;
  p.nonfinite = cudaGetDevice(&dev) == cudaSuccess ? nvl_cuda_nonfinite_word(dev) : NULL;
  (void)cudaGetLastError();
  return p;
}

/* Queue the amax of d into *bits (zeroed first); the RHT one when d->rht. */
nvl_status launch_amax(const nvl_cuda_quant_desc *d, uint32_t *bits, int dev) {
  const char *fn = "nvl_cuda_quantize";
  NVL_CUDA_CHECK(cudaMemsetAsync(bits, 0, sizeof(uint32_t), 0));
  const int threads = 256;
  char what[160];
  if (!d->rht) {
    const int64_t n = d->B * d->K * d->C;
    const int vec = ((uintptr_t)d->x & 15) == 0;
    const int blocks = nvl_cuda_grid(vec ? n / (d->x_bf16 ? 8 : 4) + 1 : n, threads, dev);
    if (d->x_bf16)
      NVL_LAUNCH(blocks, threads, 0, 0, amax_kernel<uint16_t>)(static_cast<const uint16_t *>(d->x), n, vec, bits,
                                                                nvl_cuda_nonfinite_word(dev));
    else NVL_LAUNCH(blocks, threads, 0, 0, amax_kernel<float>)(static_cast<const float *>(d->x), n, vec, bits,
                                                               nvl_cuda_nonfinite_word(dev));
    snprintf(what, sizeof what, "amax_kernel<%s> (n=%lld)", d->x_bf16 ? "bf16" : "f32", (long long)n);
  } else {
    nvl_cuda_quant_desc dd = *d;
    dd.block2d = 0;
    QParams p = make_params(&dd);
    p.nb = d->K / 16;
    p.map = d->C == 1 ? MAP_CONTIG : MAP_STRIDED;
    const int64_t units = p.rows * p.nb;
    const int blocks = nvl_cuda_grid(units, threads, dev);
    if (d->x_bf16) NVL_LAUNCH(blocks, threads, 0, 0, amax_rht_kernel<uint16_t>)(p, bits);
    else NVL_LAUNCH(blocks, threads, 0, 0, amax_rht_kernel<float>)(p, bits);
    snprintf(what, sizeof what, "amax_rht_kernel<%s> (rows=%lld, K=%lld)", d->x_bf16 ? "bf16" : "f32",
             (long long)p.rows, (long long)d->K);
  }
  return nvl_cuda_check_launch(dev, fn, what);
}

template <typename T>
void launch_unit_t(int kind, int blocks, const QParams &p) {
  switch (kind) {
    case KIND_NVFP4: NVL_LAUNCH(blocks, 256, 0, 0, quant_unit_kernel<T, KIND_NVFP4>)(p); break;
    case KIND_MX: NVL_LAUNCH(blocks, 256, 0, 0, quant_unit_kernel<T, KIND_MX>)(p); break;
    case KIND_FP8: NVL_LAUNCH(blocks, 256, 0, 0, quant_unit_kernel<T, KIND_FP8>)(p); break;
    default: NVL_LAUNCH(blocks, 256, 0, 0, quant_unit_kernel<T, KIND_VALUES>)(p); break;
  }
}

template <typename T>
void launch_elem_t(int kind, int blocks, const QParams &p) {
  if (kind == KIND_FP8) NVL_LAUNCH(blocks, 256, 0, 0, quant_elem_kernel<T, KIND_FP8>)(p);
  else NVL_LAUNCH(blocks, 256, 0, 0, quant_elem_kernel<T, KIND_VALUES>)(p);
}

template <typename T>
void launch_col_t(int kind, int64_t tiles, const QParams &p, int64_t R, int64_t C, int vec) {
  switch (kind) {
    case KIND_NVFP4: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_col_kernel<T, KIND_NVFP4>)(p, R, C, vec); break;
    case KIND_MX: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_col_kernel<T, KIND_MX>)(p, R, C, vec); break;
    case KIND_FP8: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_col_kernel<T, KIND_FP8>)(p, R, C, vec); break;
    default: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_col_kernel<T, KIND_VALUES>)(p, R, C, vec); break;
  }
}

template <typename T>
void launch_pair_t(int kind, int64_t tiles, const QParams &pr, const QParams &pc, int64_t R, int64_t C) {
  switch (kind) {
    case KIND_NVFP4: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_pair_kernel<T, KIND_NVFP4>)(pr, pc, R, C); break;
    case KIND_MX: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_pair_kernel<T, KIND_MX>)(pr, pc, R, C); break;
    default: NVL_LAUNCH((unsigned)tiles, 256, 0, 0, quant_pair_kernel<T, KIND_FP8>)(pr, pc, R, C); break;
  }
}

/* Zero the swizzled scales (their padding must read as zero; the kernel writes the rest). */
nvl_status clear_swizzled(const nvl_cuda_quant_desc *d) {
  if (!d->scales_swz) return NVL_OK;
  int64_t rows = d->B * d->C, nb = d->K / (d->kind == KIND_MX ? 32 : 16);
  if (rows % 128 == 0 && nb % 4 == 0) return NVL_OK; /* no padding */
  NVL_CUDA_CHECK(cudaMemsetAsync(d->scales_swz, 0, nvl_swizzled_bytes(rows, nb), 0));
  return NVL_OK;
}

/* Queue the kernels of d (amax already queued into amax_bits when it is not NULL). */
nvl_status launch_quant(const nvl_cuda_quant_desc *d, const uint32_t *amax_bits, int dev) {
  QParams p = make_params(d);
  p.amax_bits = amax_bits;
  int U = unit_len(d->kind, d->rht);
  const int threads = 256;
  char what[200];
  if (d->kind == KIND_NVFP4 || d->kind == KIND_MX) NVL_TRY(clear_swizzled(d));
  /* blocked along a dimension that is not the last (C > 1): through 64x64 tiles, so the reads are
   * coalesced (16x16 nvfp4 blocks need whole 16-row groups of the blocked layout per batch: C % 16) */
  const int64_t tiles = d->B * ((d->K + TILE - 1) / TILE) * ((d->C + TILE - 1) / TILE);
  if (d->C > 1 && !(d->block2d && d->C % 16) && tiles < ((int64_t)1 << 31)) {
    if (tiles == 0) return NVL_OK;
    if (U) p.nb = d->K / U;
    else p.nb = 0;
    const int vec = ((uintptr_t)d->x & 15) == 0 && d->C % (d->x_bf16 ? 8 : 4) == 0;
    if (d->x_bf16) launch_col_t<uint16_t>(d->kind, tiles, p, d->K, d->C, vec);
    else launch_col_t<float>(d->kind, tiles, p, d->K, d->C, vec);
    snprintf(what, sizeof what, "quant_col_kernel<%s, %s> (B=%lld, K=%lld, C=%lld%s%s%s)", d->x_bf16 ? "bf16" : "f32",
             kind_name(d->kind), (long long)d->B, (long long)d->K, (long long)d->C, d->rht ? ", rht" : "",
             d->sr ? ", sr" : "", d->block2d ? ", 2d" : "");
    return nvl_cuda_check_launch(dev, "nvl_cuda_quantize", what);
  }
  if (U) {
    const int64_t units = p.rows * p.nb;
    if (units == 0) return NVL_OK;
    const int blocks = nvl_cuda_grid(units, threads, dev);
    if (d->x_bf16) launch_unit_t<uint16_t>(d->kind, blocks, p);
    else launch_unit_t<float>(d->kind, blocks, p);
    snprintf(what, sizeof what, "quant_unit_kernel<%s, %s> (rows=%lld, K=%lld, C=%lld%s%s%s)",
             d->x_bf16 ? "bf16" : "f32", kind_name(d->kind), (long long)p.rows, (long long)d->K, (long long)d->C,
             d->rht ? ", rht" : "", d->sr ? ", sr" : "", d->block2d ? ", 2d" : "");
  } else {
    const int64_t n = p.rows * d->K;
    if (n == 0) return NVL_OK;
    const int blocks = nvl_cuda_grid(n, threads, dev);
    if (d->x_bf16) launch_elem_t<uint16_t>(d->kind, blocks, p);
    else launch_elem_t<float>(d->kind, blocks, p);
    snprintf(what, sizeof what, "quant_elem_kernel<%s, %s> (rows=%lld, K=%lld, C=%lld)", d->x_bf16 ? "bf16" : "f32",
             kind_name(d->kind), (long long)p.rows, (long long)d->K, (long long)d->C);
  }
  return nvl_cuda_check_launch(dev, "nvl_cuda_quantize", what);
}

/* Does d need an amax from the device? */
int needs_amax(const nvl_cuda_quant_desc *d) {
  return !d->has_amax && (d->kind == KIND_FP8 || d->kind == KIND_NVFP4 || d->kind == KIND_MX ||
                          d->kind == KIND_VALUES);
}

/* Kernels that read the amax: fp8 and nvfp4 (mxfp8 and values only report it). */
int kernel_reads_amax(const nvl_cuda_quant_desc *d) { return d->kind == KIND_FP8 || d->kind == KIND_NVFP4; }

} /* namespace */

static nvl_status quantize_one(nvl_kctx *ctx, const nvl_cuda_quant_desc *d, float *amax_out) {
  const int dev = ctx->dev;
  NVL_TRY(check_desc(d, "nvl_cuda_quantize"));
  NVL_TRY(nvl_cuda_use_device(dev, "nvl_cuda_quantize"));
  uint32_t *bits = NULL;
  if (d->amax_only) return launch_amax(d, d->amax_dev_out, dev); /* max |x| (after the RHT), nothing else */
  if (d->amax_dev_in) { /* another quantization's amax, on the device: no reduction, no read-back */
    NVL_TRY(launch_quant(d, d->amax_dev_in, dev));
    return NVL_OK;
  }
  if (d->amax_dev_out && needs_amax(d)) { /* the amax stays on the device, in q's own word */
    NVL_TRY(launch_amax(d, d->amax_dev_out, dev));
    NVL_TRY(launch_quant(d, kernel_reads_amax(d) ? d->amax_dev_out : NULL, dev));
    return NVL_OK;
  }
  if (needs_amax(d) && (kernel_reads_amax(d) || amax_out)) { /* else no reduction, no read-back */
    NVL_TRY(ctx->scratch(ctx, sizeof(uint32_t), (void **)&bits));
    NVL_TRY(launch_amax(d, bits, dev));
  }
  NVL_TRY(launch_quant(d, kernel_reads_amax(d) ? bits : NULL, dev));
  if (amax_out) {
    if (bits) {
      uint32_t b = 0;
      NVL_CUDA_CHECK(cudaMemcpy(&b, bits, sizeof b, cudaMemcpyDeviceToHost));
      memcpy(amax_out, &b, sizeof b);
    } else {
      *amax_out = d->amax;
    }
  }
  return NVL_OK;
}

static nvl_status quantize_pair(nvl_kctx *ctx, const nvl_cuda_quant_desc *row, const nvl_cuda_quant_desc *col,
                                float *amax_row, float *amax_col) {
  const int dev = ctx->dev;
  NVL_TRY(check_desc(row, __func__));
  NVL_TRY(check_desc(col, __func__));
  const int64_t R = row->B, C = row->K;
  if (row->C != 1 || col->B != 1 || col->K != R || col->C != C || row->x != col->x || row->kind != col->kind ||
      row->x_bf16 != col->x_bf16)
    return nvl_error(NVL_EINVAL, "%s: row must be x (R, C) blocked along C and col the same x blocked along R", __func__);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const int U = row->kind == KIND_MX ? 32 : 16;
  const bool fused = row->kind != KIND_VALUES && R % U == 0 && C % U == 0 && ((uintptr_t)row->x & 15) == 0 &&
                     R > 0 && C > 0 && (R / TILE + 1) * (C / TILE + 1) < ((int64_t)1 << 31);
  /* a copy given a device amax (the producer's fused one) reads it: no reduction of its own */
  const uint32_t *in_r = row->amax_dev_in, *in_c = col->amax_dev_in;
  uint32_t *bits_r = NULL, *bits_c = NULL;
  /* an amax only where a kernel reads it or the caller asks for it (none for bf16 or mx: no sync);
   * into the copies' own device words when they keep it there (amax_dev_out), else scratch */
  const bool want_r = !in_r && needs_amax(row) && (kernel_reads_amax(row) || amax_row || row->amax_dev_out);
  const bool want_c = !in_c && needs_amax(col) && (kernel_reads_amax(col) || amax_col || col->amax_dev_out);
  if (want_r || want_c) {
    NVL_TRY(ctx->scratch(ctx, 2 * sizeof(uint32_t), (void **)&bits_r));
    bits_c = bits_r + 1;
    if (row->amax_dev_out) bits_r = row->amax_dev_out;
    if (col->amax_dev_out) bits_c = col->amax_dev_out;
  }
  /* amax: without the RHT both copies see max |x|: one reduction serves both (copied on the
   * device into the column copy's word when it has one) */
  const bool shared_amax = want_r && want_c && !row->rht && !col->rht;
  if (want_r) NVL_TRY(launch_amax(row, bits_r, dev));
  if (want_c) {
    if (shared_amax && col->amax_dev_out) {
      NVL_CUDA_CHECK(cudaMemcpyAsync(bits_c, bits_r, sizeof(uint32_t), cudaMemcpyDeviceToDevice, 0));
    } else if (shared_amax) {
      bits_c = bits_r;
    } else {
      NVL_TRY(launch_amax(col, bits_c, dev));
    }
  }
  const uint32_t *ar = in_r ? in_r : want_r && kernel_reads_amax(row) ? bits_r : NULL;
  const uint32_t *ac = in_c ? in_c : want_c && kernel_reads_amax(col) ? bits_c : NULL;
  if (fused) {
    if (row->kind == KIND_NVFP4 || row->kind == KIND_MX) {
      NVL_TRY(clear_swizzled(row));
      NVL_TRY(clear_swizzled(col));
    }
    QParams pr = make_params(row), pc = make_params(col);
    pr.nb = C / U; /* fp8 without the RHT has no units of its own: the pair kernel uses 16 */
    pc.nb = R / U;
    pr.amax_bits = ar;
    pc.amax_bits = ac;
    const int64_t tiles = ((R + TILE - 1) / TILE) * ((C + TILE - 1) / TILE);
    if (row->x_bf16) launch_pair_t<uint16_t>(row->kind, tiles, pr, pc, R, C);
    else launch_pair_t<float>(row->kind, tiles, pr, pc, R, C);
    char what[200];
    snprintf(what, sizeof what, "quant_pair_kernel<%s, %s> (R=%lld, C=%lld, %lld tiles)", row->x_bf16 ? "bf16" : "f32",
             kind_name(row->kind), (long long)R, (long long)C, (long long)tiles);
    NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  } else {
    NVL_TRY(launch_quant(row, ar, dev));
    NVL_TRY(launch_quant(col, ac, dev));
  }
  uint32_t b[2] = {0, 0};
  if (want_r && amax_row) NVL_CUDA_CHECK(cudaMemcpy(&b[0], bits_r, 4, cudaMemcpyDeviceToHost));
  if (want_c && amax_col) NVL_CUDA_CHECK(cudaMemcpy(&b[1], bits_c, 4, cudaMemcpyDeviceToHost));
  if (amax_row) {
    if (want_r) memcpy(amax_row, &b[0], 4);
    else *amax_row = row->amax;
  }
  if (amax_col) {
    if (want_c) memcpy(amax_col, &b[1], 4);
    else *amax_col = col->amax;
  }
  return NVL_OK;
}

/* ---- the table entries ------------------------------------------------------------------------ */

namespace {

/* The kernels' description of a quantization, from the table's: the kind from the format's scale
 * kind, the element codec from its traits row. */
nvl_status to_cuda_desc(const nvl_qdesc *q, nvl_cuda_quant_desc *d) {
  static const int kinds[NVL_SCALE_KIND_COUNT] = {KIND_VALUES, KIND_FP8, KIND_NVFP4, KIND_MX};
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  memset(d, 0, sizeof *d);
  if (q->x_dtype != NVL_F32 && q->x_dtype != NVL_BF16)
    return nvl_error(NVL_EINVAL, "nvl_cuda_quantize: x must be f32 or bf16, got %s", nvl_dtypes[q->x_dtype].name);
  d->x = q->x;
  d->x_bf16 = q->x_dtype == NVL_BF16;
  d->B = q->B;
  d->K = q->K;
  d->C = q->C;
  d->kind = kinds[f->scale];
  d->values_bf16 = q->format == NVL_BF16;
  d->elem = f->elem;
  d->rule = (int)q->rule;
  d->block2d = q->block2d;
  d->rht = q->rht;
  memcpy(d->signs, q->signs, sizeof d->signs);
  d->sr = q->sr;
  d->seed = q->seed;
  d->offset = q->offset;
  d->sr_row_offset = q->sr_row_offset;
  d->sr_k_offset = q->sr_k_offset;
  d->sr_k_total = q->sr_k_total;
  d->has_amax = q->has_amax;
  d->amax = q->amax;
  d->amax_dev_out = reinterpret_cast<uint32_t *>(q->amax_dev_out);
  d->amax_dev_in = reinterpret_cast<const uint32_t *>(q->amax_dev_in);
  d->amax_only = q->amax_only;
  if (d->amax_only && !d->amax_dev_out)
    return nvl_error(NVL_EINVAL, "nvl_cuda_quantize: an amax-only call needs the device word to write it into");
  if (d->amax_dev_in && (d->has_amax || d->amax_dev_out))
    return nvl_error(NVL_EINVAL, "nvl_cuda_quantize: a device amax to use excludes a given or an output one");
  d->codes = q->codes;
  d->scales = q->scales;
  d->scales_swz = q->scales_swz;
  return NVL_OK;
}

} /* namespace */

extern "C" nvl_status nvl_cuda_quantize(nvl_kctx *ctx, const nvl_qdesc *q) {
  nvl_cuda_quant_desc d;
  NVL_TRY(to_cuda_desc(q, &d));
  return quantize_one(ctx, &d, q->amax_out);
}

extern "C" nvl_status nvl_cuda_quantize_pair(nvl_kctx *ctx, const nvl_qdesc *row, const nvl_qdesc *col) {
  nvl_cuda_quant_desc dr, dc;
  NVL_TRY(to_cuda_desc(row, &dr));
  NVL_TRY(to_cuda_desc(col, &dc));
  return quantize_pair(ctx, &dr, &dc, row->amax_out, col->amax_out);
}

/* ---- the standalone RHT --------------------------------------------------------------------- *
 * The rht entry (core/backend.h): common.cuh's rht16 on every 16-chunk of an f32 (rows, K), or its
 * inverse (rht16 with unit signs, then the signs: x R^T), the CPU's arithmetic bit for bit; what
 * dequantize uses to move an RHT operand's values back on the device (core/quant.c). */

namespace {

struct Signs16 {
  float s[16];
};

/* One thread per 16-chunk; y may alias x (each chunk is read whole before it is written). */
__global__ void __launch_bounds__(256) rht_kernel(float *y, const float *x, int64_t chunks, Signs16 s, int inverse) {
  const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += stride) {
    float t[16];
NVL_UNROLL
    for (int i = 0; i < 16; i++) t[i] = x[16 * c + i];
    rht16(t, inverse ? ones : s.s);
NVL_UNROLL
    for (int i = 0; i < 16; i++) y[16 * c + i] = inverse ? f_mul(s.s[i], t[i]) : t[i];
  }
}

} /* namespace */

extern "C" nvl_status nvl_cuda_rht(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K,
                                   const float *signs, int inverse) {
  const int dev = ctx->dev;
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "%s: K = %lld is not a multiple of 16 (rows %lld)", __func__, (long long)K,
                     (long long)rows);
  const int64_t chunks = rows * K / 16;
  if (chunks == 0) return NVL_OK;
  Signs16 s;
  memcpy(s.s, signs ? signs : nvl_rht16_default_signs, sizeof s.s);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  NVL_LAUNCH(nvl_cuda_grid(chunks, 256, dev), 256, 0, 0, rht_kernel)(y, x, chunks, s, inverse);
  char what[96];
  snprintf(what, sizeof what, "rht_kernel (rows=%lld, K=%lld%s)", (long long)rows, (long long)K,
           inverse ? ", inverse" : "");
  return nvl_cuda_check_launch(dev, __func__, what);
}

/* ---- scales assembled from pieces, and the transposed 16x16 copy ------------------------------ *
 * The swizzle_scales and transpose_tiles entries (core/backend.h): the quantized all-gather
 * (core/qgather.c) gathers row-major scales and swizzles them after; q:t() of a device nvfp4 16x16
 * tensor moves its codes and re-reads each tile's scale, then swizzles those. */

namespace {

__global__ void __launch_bounds__(256) swizzle_scales_kernel(uint8_t *__restrict__ swz, const uint8_t *__restrict__ s,
                                                             int64_t rows, int64_t nb) {
  const int64_t n = rows * nb, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    swz[swizzle_offset(i / nb, i % nb, nb)] = s[i];
}

/* One block per 64x64 tile of codes (i rows of x, k columns): the tile's codes unpacked into shared
 * memory from coalesced reads of its 64 rows, written out as 64 rows of x^T (coalesced too); the
 * block also writes the tile's 64 x 4 transposed scale bytes. */
__global__ void __launch_bounds__(256) transpose_tiles_kernel(uint8_t *__restrict__ codes_t,
                                                              uint8_t *__restrict__ scales_t,
                                                              const uint8_t *__restrict__ codes,
                                                              const uint8_t *__restrict__ scales, int64_t R,
                                                              int64_t K) {
  NVL_SHARED(uint8_t, tile, [64][65]); /* [i][k]: one code per byte */
  const int64_t tk = (K + 63) / 64;
  const int64_t i0 = (int64_t)(blockIdx.x / tk) * 64, k0 = (int64_t)(blockIdx.x % tk) * 64;
  for (int e = threadIdx.x; e < 64 * 32; e += blockDim.x) {
    const int li = e / 32, lb = e % 32;
    const int64_t i = i0 + li, kb = k0 / 2 + lb;
    const uint8_t b = i < R && kb < K / 2 ? codes[i * (K / 2) + kb] : 0;
    tile[li][2 * lb] = b & 15;
    tile[li][2 * lb + 1] = b >> 4;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < 64 * 32; e += blockDim.x) {
    const int lk = e / 32, lb = e % 32;
    const int64_t k = k0 + lk, ib = i0 / 2 + lb;
    if (k < K && ib < R / 2) codes_t[k * (R / 2) + ib] = (uint8_t)(tile[2 * lb][lk] | tile[2 * lb + 1][lk] << 4);
  }
  for (int e = threadIdx.x; e < 64 * 4; e += blockDim.x) {
    const int lk = e / 4, lj = e % 4;
    const int64_t k = k0 + lk, j = i0 / 16 + lj;
    if (k < K && j < R / 16) scales_t[k * (R / 16) + j] = scales[(16 * j) * (K / 16) + k / 16];
  }
}

} /* namespace */

extern "C" nvl_status nvl_cuda_swizzle_scales(nvl_kctx *ctx, uint8_t *swz, const uint8_t *scales, int64_t rows,
                                              int64_t nb) {
  const int dev = ctx->dev;
  if (rows <= 0 || nb <= 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  if (rows % 128 || nb % 4) NVL_CUDA_CHECK(cudaMemsetAsync(swz, 0, nvl_swizzled_bytes(rows, nb), 0)); /* the padding */
  const int blocks = nvl_cuda_grid(rows * nb, 256, dev);
  NVL_LAUNCH(blocks, 256, 0, 0, swizzle_scales_kernel)(swz, scales, rows, nb);
  char what[96];
  snprintf(what, sizeof what, "swizzle_scales_kernel (rows=%lld, nb=%lld)", (long long)rows, (long long)nb);
  return nvl_cuda_check_launch(dev, __func__, what);
}

extern "C" nvl_status nvl_cuda_transpose_tiles(nvl_kctx *ctx, uint8_t *codes_t, uint8_t *scales_t,
                                               const uint8_t *codes, const uint8_t *scales, int64_t R, int64_t K) {
  const int dev = ctx->dev;
  if (R <= 0 || K <= 0) return NVL_OK;
  const int64_t tiles = ((R + 63) / 64) * ((K + 63) / 64);
  if (tiles >= ((int64_t)1 << 31)) return nvl_error(NVL_EINVAL, "%s: %lld tiles is more than one launch takes", __func__, (long long)tiles);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  NVL_LAUNCH((unsigned)tiles, 256, 0, 0, transpose_tiles_kernel)(codes_t, scales_t, codes, scales, R, K);
  char what[96];
  snprintf(what, sizeof what, "transpose_tiles_kernel (R=%lld, K=%lld)", (long long)R, (long long)K);
  return nvl_cuda_check_launch(dev, __func__, what);
}
