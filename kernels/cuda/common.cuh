/* common.cuh: what the CUDA backend's .cu files share — the host-side checking helpers
 * (defined in device.cu) and the device-side numerics of core/NUMERICS.md: IEEE fp32 arithmetic that
 * no compiler flag can change, the element encoders, Philox4x32-10 and the 16-point RHT.
 *
 * Every device function here is the twin of a CPU function, and says which. The CPU fast
 * encoders (kernels/cpu/quant_cpu.c) are branch-free rewrites proven equal to the scalar
 * references (kernels/cpu/ref/formats_ref.c) and tested exhaustively; these are the same
 * rewrites, line for line, so they inherit that proof. Every fp32 operation that rounds is
 * written as an explicit non-.ftz PTX instruction (f_add, f_mul, ...): nvcc cannot contract
 * them into an fma, flush their subnormals, or approximate a division, whatever -fmad, -ftz,
 * -prec-div or --use_fast_math say, so -fmad=false is not needed. Products the references compute
 * exactly (by a power of two, by +-1) are also written this way. What is left to the compiler is
 * exact (integer ops, comparisons, fabsf, int->float of bytes), which stays exact only with
 * nvcc's default -ftz=false: never build these files with --use_fast_math or -ftz=true (a .ftz
 * compare or abs would flush subnormal inputs). The host branches exist so that the numerics can
 * be checked on a machine without a GPU against the CPU references (compile with
 * -ffp-contract=off); that check passed over 3.3e8 fp32 inputs when this file was written.
 *
 * Not here: kernels (quant.cu, gemm.cu), allocation. */
#ifndef NVL_CUDA_COMMON_CUH
#define NVL_CUDA_COMMON_CUH
#include <stdint.h>

#include "cuda/cuda.h"

/* NVL_CUDA_SOURCE: compiled as CUDA, by nvcc or by the host compiler for the CPU emulation of CUDA
 * (-DNVLUA_CUDA=EMU: NVL_CUDA_EMU, kernels/cuda/emu supplies <cuda_runtime.h>).
 * NVL_HD: the numerics below are __host__ __device__ so that a plain host build can check them
 * (the host branch of each pinned operation is the same IEEE operation in C++; compile such a
 * check with -ffp-contract=off). Without either this header gives just those functions. */
#if defined(__CUDACC__) || defined(NVL_CUDA_EMU)
#define NVL_CUDA_SOURCE 1
#include <cuda_runtime.h>
#define NVL_HD __host__ __device__ __forceinline__
#else
#define NVL_HD static inline
#endif
/* #pragma unroll in the device pass only (a host compiler warns about it) */
#ifdef __CUDA_ARCH__
#define NVL_UNROLL _Pragma("unroll")
#else
#define NVL_UNROLL
#endif
#include <math.h>
#include <string.h>

#ifdef NVL_CUDA_SOURCE
/* ---- launches and shared memory, one source for nvcc and the emulator ------------------------ *
 * NVL_LAUNCH(grid, block, smem, stream, kernel)(args...) is kernel<<<grid, block, smem, stream>>>(args...)
 * (the kernel last: a template argument list may hold commas). NVL_SHARED(type, name, dims) declares
 * `__shared__ type name dims` (dims: "[32]", "[8][33]" or empty), NVL_SHARED_DYNAMIC(type, name) the
 * dynamic shared memory `extern __shared__ type name[]`. Under the emulator they are per-block
 * storage it can size, check against the device's limits, and fill with 0xFF at each block start. */
#ifdef NVL_CUDA_EMU
#define NVL_LAUNCH NVL_EMU_LAUNCH
#define NVL_SHARED NVL_EMU_SHARED
#define NVL_SHARED_DYNAMIC NVL_EMU_SHARED_DYNAMIC
#else
#define NVL_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define NVL_SHARED(type, name, dims) __shared__ type name dims
#define NVL_SHARED_DYNAMIC(type, name) extern __shared__ type name[]
#endif

/* ---- host side (device.cu) ------------------------------------------------------------------ */

/* Check dev is usable and make it current; fn names the public caller. */
nvl_status nvl_cuda_use_device(int dev, const char *fn);
/* After a kernel launch: the launch error, then (in sync mode) the stream's; what names the
 * kernel and its shape for the message. */
nvl_status nvl_cuda_check_launch(int dev, const char *fn, const char *what);
/* Multiprocessor count of dev (cached), and compute capability as 10*major + minor. */
int nvl_cuda_sm_count(int dev);
int nvl_cuda_cc(int dev);
/* A blocks-per-grid count for n work items at `threads` per block, capped at a few waves
 * (grid-stride loops cover the rest). */
int nvl_cuda_grid(int64_t n, int threads, int dev);
/* dev's non-finite flag word (backend.h NVL_NONFINITE_*): 4 bytes of device memory made (zeroed) at
 * the first call, outside the caching allocator, for the process's life; NULL if that failed (the
 * kernels then skip the flag). dev must be current. */
uint32_t *nvl_cuda_nonfinite_word(int dev);

/* Evaluate a CUDA runtime call; on failure clear the (non-sticky) error so a later
 * cudaGetLastError does not report it again, and return NVL_EDEVICE naming the call. */
#define NVL_CUDA_CHECK(call)                                                          \
  do {                                                                                \
    cudaError_t nvl_ce_ = (call);                                                     \
    if (nvl_ce_ != cudaSuccess) {                                                     \
      (void)cudaGetLastError();                                                       \
      return nvl_error(NVL_EDEVICE, "%s: %s failed: %s (%s)", __func__, #call,        \
                       cudaGetErrorString(nvl_ce_), cudaGetErrorName(nvl_ce_));       \
    }                                                                                 \
  } while (0)
#endif

/* ---- fp32 arithmetic, pinned (round to nearest even, subnormals kept, never fused) ---------- */

NVL_HD float f_add(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a + b;
#endif
}
NVL_HD float f_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a - b;
#endif
}
NVL_HD float f_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a * b;
#endif
}
NVL_HD float f_div(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a / b;
#endif
}
NVL_HD double d_add(double a, double b) {
#ifdef __CUDA_ARCH__
  double r;
  asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
  return r;
#else
  return a + b;
#endif
}
NVL_HD double d_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  double r;
  asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
  return r;
#else
  return a * b;
#endif
}
#ifdef __CUDA_ARCH__
NVL_HD uint32_t f2u(float f) { return __float_as_uint(f); }
NVL_HD float u2f(uint32_t u) { return __uint_as_float(u); }
#else
NVL_HD uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
NVL_HD float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
#endif

#define NVL_FLT_MAX 3.40282346638528859812e+38f
/* 1.0f / 6.0f as C rounds it (0x3E2AAAAB), written as bits so no front end can differ. */
#define NVL_ONE_SIXTH_BITS 0x3E2AAAABu

/* bf16 bits -> f32 (exact). */
NVL_HD float bf16_bits_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }
/* f32 -> bf16 bits, RNE; NaN stays a quiet NaN with its sign (core/dtype.c nvl_f32_to_bf16). */
NVL_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* ---- max |x| in the integer domain (quant_cpu.c abs_bits) ------------------------------------ *
 * Bits of |x| order like |x|; NaN bits (above inf's) are cleared, so a max never sees a NaN:
 * the result is the max of the non-NaN |x_i|, as the references' fmaxf fold gives. */
NVL_HD uint32_t abs_bits(float x) {
  int32_t b = (int32_t)(f2u(x) & 0x7FFFFFFFu);
  return (uint32_t)(b & ~((0x7F800000 - b) >> 31));
}

/* ---- non-finite flags (backend.h NVL_NONFINITE_*) -------------------------------------------- *
 * raw_bits: |x|'s bits with NaN kept, >= 0x7F800000 exactly for a NaN or an infinity. A kernel keeps
 * the max of its elements' raw bits beside its own work and calls flag_nonfinite once at its end,
 * where every lane of every warp arrives: one vote per warp, one atomicOr per warp that saw one. */
NVL_HD uint32_t raw_bits(float x) { return f2u(x) & 0x7FFFFFFFu; }
#ifdef NVL_CUDA_SOURCE
__device__ __forceinline__ void flag_nonfinite(uint32_t raw, uint32_t *flags, uint32_t bit) {
  const bool any = __any_sync(0xFFFFFFFFu, raw >= 0x7F800000u);
  if (any && (threadIdx.x & 31) == 0 && flags) atomicOr(flags, bit);
}
#endif

/* ---- fp8 encoders (quant_cpu.c fp8_encode) -------------------------------------------------- *
 * RNE, satfinite, NaN -> 0x7F | sign. M mantissa bits, bias B, largest finite maxv (code maxcode). */
template <int M, int B>
NVL_HD uint32_t fp8_encode(float x, float maxv, uint32_t maxcode) {
  uint32_t u = f2u(x);
  uint32_t sign = (u >> 24) & 0x80u;
  float a = fabsf(x);
  uint32_t au = f2u(a);
  const int sh = 23 - M;
  uint32_t norm = ((au + ((1u << (sh - 1)) - 1u) + ((au >> sh) & 1u)) >> sh) - ((uint32_t)(127 - B) << M);
  const float sub_scale = u2f((uint32_t)(127 + M + B - 1) << 23); /* 2^(M - emin) */
  const float min_normal = u2f((uint32_t)(127 + 1 - B) << 23);    /* 2^emin */
  uint32_t sub = f2u(f_add(f_mul(a, sub_scale), 8388608.0f)) - 0x4B000000u;
  uint32_t mag = a < min_normal ? sub : norm;
  mag = a >= maxv ? maxcode : mag;
  mag = x != x ? 0x7Fu : mag;
  return mag | sign;
}
NVL_HD uint32_t e4m3_encode(float x) { return fp8_encode<3, 7>(x, 448.0f, 0x7Eu); }
NVL_HD uint32_t e5m2_encode(float x) { return fp8_encode<2, 15>(x, 57344.0f, 0x7Bu); }

/* fp8 code -> f32 (formats_ref.c minifloat_decode): e4m3 0x7F/0xFF NaN; e5m2 IEEE-like. */
NVL_HD float e4m3_decode(uint32_t c) {
  uint32_t field = (c >> 3) & 0xF, mant = c & 7;
  float v;
  if (field == 0xF && mant == 7) v = u2f(0x7FC00000u);
  else if (field == 0) v = (float)mant * 0.001953125f; /* mant * 2^-9, exact */
  else v = u2f(((field + 120u) << 23) | (mant << 20));
  return (c & 0x80) ? -v : v;
}
NVL_HD float e5m2_decode(uint32_t c) {
  uint32_t field = (c >> 2) & 0x1F, mant = c & 3;
  float v;
  if (field == 0x1F) v = mant ? u2f(0x7FC00000u) : u2f(0x7F800000u);
  else if (field == 0) v = (float)mant * 1.52587890625e-05f; /* mant * 2^-16, exact */
  else v = u2f(((field + 112u) << 23) | (mant << 21));
  return (c & 0x80) ? -v : v;
}

/* ---- e2m1 encoders (quant_cpu.c e2m1_encode / e2m1_encode_sr) ------------------------------- */

/* RNE with NUMERICS §1's thresholds; NaN -> 6; sign of v in bit 3 (so -0 -> 8). */
NVL_HD uint32_t e2m1_encode(float v) {
  float a = fabsf(v);
  uint32_t au = f2u(a);
  uint32_t norm = ((au + 0x1FFFFFu + ((au >> 22) & 1u)) >> 22) - (126u << 1);
  uint32_t sub = f2u(f_add(f_mul(a, 2.0f), 8388608.0f)) - 0x4B000000u;
  uint32_t m = a < 1.0f ? sub : norm;
  m = a >= 6.0f ? 7u : m;
  uint32_t c = ((f2u(v) >> 28) & 8u) | m;
  return v != v ? 6u : c;
}

/* SR with random byte r (NUMERICS §3). t = r/256 * step + a: the product is exact, the sum the
 * only rounding, so f_mul then f_add is the reference's fmaf bit for bit. */
NVL_HD uint32_t e2m1_encode_sr(float v, uint32_t r) {
  float a = fabsf(v);
  float step = u2f(0x3F000000u + (((uint32_t)(a >= 2.0f) + (uint32_t)(a >= 4.0f)) << 23));
  float t = f_add(f_mul(f_mul((float)r, 0.00390625f), step), a);
  uint32_t norm = (f2u(t) >> 22) - (126u << 1);
  uint32_t m = t < 1.0f ? (uint32_t)(t >= 0.5f) : norm;
  m = m < 7u ? m : 7u;
  uint32_t c = ((f2u(v) >> 28) & 8u) | m;
  return v != v ? 6u : c;
}

/* e2m1 code (low 4 bits) -> value. */
NVL_HD float e2m1_decode(uint32_t c) {
  const float mag = (c & 4) ? ((c & 2) ? ((c & 1) ? 6.0f : 4.0f) : ((c & 1) ? 3.0f : 2.0f))
                            : ((c & 2) ? ((c & 1) ? 1.5f : 1.0f) : ((c & 1) ? 0.5f : 0.0f));
  return (c & 8) ? -mag : mag;
}

/* ---- NVFP4 scales (formats_ref.c nvl_nvfp4_enc_scale_ref, quant_cpu.c nvfp4_scale) ---------- */

/* s_enc = 2688 / amax with the §2 guards. */
NVL_HD float nvfp4_enc_scale(float amax) {
  if (!(amax > 0.0f) || amax == u2f(0x7F800000u)) return 1.0f;
  float s = f_div(2688.0f, amax);
  return s < NVL_FLT_MAX ? s : NVL_FLT_MAX; /* fminf: s is never NaN here */
}
/* The global decode factor (formats_ref.c nvl_nvfp4_dec_scale_ref): amax / 2688, or 1 / s_enc
 * where that quotient would overflow or the guards of s_enc apply. */
NVL_HD float nvfp4_dec_scale(float amax) {
  if (!(amax > 0.0f) || amax == u2f(0x7F800000u) || !(f_div(2688.0f, amax) <= NVL_FLT_MAX))
    return f_div(1.0f, nvfp4_enc_scale(amax));
  return f_div(amax, 2688.0f);
}
/* Stored ue4m3 block scale for block max bmax: e4m3(min(bmax * s_enc6, FLT_MAX)). */
NVL_HD uint32_t nvfp4_block_scale(float bmax, float s_enc6) {
  float y = f_mul(bmax, s_enc6);
  return e4m3_encode(y < NVL_FLT_MAX ? y : NVL_FLT_MAX);
}
/* Element encode scale from the stored byte: min(1 / (float(sd) * s_dec), FLT_MAX). */
NVL_HD float nvfp4_elem_scale(uint32_t sd, float s_dec) {
  float e = f_div(1.0f, f_mul(e4m3_decode(sd), s_dec));
  return e < NVL_FLT_MAX ? e : NVL_FLT_MAX; /* 1/0 = inf -> FLT_MAX; never NaN (sd <= 0x7E) */
}

/* ---- FP8 per-tensor scale (formats_ref.c nvl_fp8_tensor_scale_ref) -------------------------- */
NVL_HD float fp8_tensor_scale(float amax, float elem_max) {
  if (amax == 0.0f || !(fabsf(amax) < u2f(0x7F800000u))) return 1.0f; /* 0, inf, nan */
  float s = f_div(elem_max, amax);
  return s == u2f(0x7F800000u) ? NVL_FLT_MAX : s;
}

/* ---- e8m0 (quant_cpu.c e8m0_rceil / e8m0_floor / e8m0_inverse) ------------------------------ */
NVL_HD uint32_t e8m0_rceil(float bmax, float elem_max) {
  float q = f_div(bmax, elem_max);
  if (q != q) return 0xFF;
  if (!(q > 0.0f)) return 0;
  if (q == u2f(0x7F800000u)) return 254;
  uint32_t b = f2u(q), exp = b >> 23, mant = b & 0x7FFFFFu;
  if (exp == 0) return mant <= 0x400000u ? 0 : 1;
  uint32_t e = exp + (mant != 0);
  return e > 254 ? 254 : e;
}
NVL_HD uint32_t e8m0_floor(float bmax, int emax_elem) {
  if (bmax != bmax) return 0xFF;
  if (!(bmax > 0.0f)) return 0;
  if (bmax == u2f(0x7F800000u)) return 254;
  int code = (int)(f2u(bmax) >> 23) - emax_elem;
  return (uint32_t)(code < 0 ? 0 : code > 254 ? 254 : code);
}
/* 2^(127 - e), NaN for 0xFF (2^-127 is a subnormal for e = 254). */
NVL_HD float e8m0_inverse(uint32_t e) {
  if (e == 0xFF) return u2f(0x7FC00000u);
  return e == 254 ? u2f(1u << 22) : u2f((254 - e) << 23);
}
/* 2^(e - 127) (formats_ref.c nvl_e8m0_decode_ref); NaN for 0xFF. */
NVL_HD float e8m0_decode(uint32_t e) {
  if (e == 0xFF) return u2f(0x7FC00000u);
  return e == 0 ? u2f(1u << 22) : u2f(e << 23);
}

/* ---- Philox4x32-10 (core/philox.c) ---------------------------------------------------------- *
 * key = (seed lo, seed hi); counter = (g lo, offset lo, offset hi, g hi). */
NVL_HD void philox_words(uint64_t seed, uint64_t offset, uint64_t g, uint32_t w[4]) {
  uint32_t c0 = (uint32_t)g, c1 = (uint32_t)offset, c2 = (uint32_t)(offset >> 32), c3 = (uint32_t)(g >> 32);
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
NVL_UNROLL
  for (int round = 0; round < 10; round++) {
#ifdef __CUDA_ARCH__
    uint32_t hi0 = __umulhi(0xD2511F53u, c0), hi1 = __umulhi(0xCD9E8D57u, c2);
#else
    uint32_t hi0 = (uint32_t)(((uint64_t)0xD2511F53u * c0) >> 32), hi1 = (uint32_t)(((uint64_t)0xCD9E8D57u * c2) >> 32);
#endif
    uint32_t lo0 = 0xD2511F53u * c0, lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}

/* ---- RHT (formats_ref.c nvl_rht16_ref) ------------------------------------------------------ *
 * In place on t (16): t_i = s_i * t_i; butterflies h = 1, 2, 4, 8 over pairs (j, j+h) with
 * j mod 2h < h: (t_j, t_j+h) <- (t_j + t_j+h, t_j - t_j+h); then t *= 0.25. */
NVL_HD void rht16(float t[16], const float s[16]) {
NVL_UNROLL
  for (int i = 0; i < 16; i++) t[i] = f_mul(s[i], t[i]);
NVL_UNROLL
  for (int h = 1; h < 16; h *= 2) {
NVL_UNROLL
    for (int j = 0; j < 16; j++) {
      if ((j & h) == 0) {
        float a = t[j], b = t[j + h];
        t[j] = f_add(a, b);
        t[j + h] = f_sub(a, b);
      }
    }
  }
NVL_UNROLL
  for (int i = 0; i < 16; i++) t[i] = f_mul(t[i], 0.25f);
}

/* rht16, then the result rounded to the operand's dtype (NUMERICS §5): T = uint16_t holds bf16, and a
 * bf16 operand's transform is bf16 (TE's wgrad path); an f32 operand keeps the f32 result. */
template <typename T> NVL_HD void rht16_as(float t[16], const float s[16]) {
  rht16(t, s);
  if (sizeof(T) == 2) {
NVL_UNROLL
    for (int i = 0; i < 16; i++) t[i] = bf16_bits_to_f32(f32_to_bf16_bits(t[i]));
  }
}

/* Offset of scale (r, j) in the 128x4 swizzled layout for nb scales per row (core/backend.h nvl_swizzled_bytes). */
NVL_HD int64_t swizzle_offset(int64_t r, int64_t j, int64_t nb) {
  int64_t ncb = (nb + 3) / 4;
  return ((r / 128) * ncb + j / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + (j % 4);
}

#endif
