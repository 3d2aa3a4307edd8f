/* cuda_bf16.h (emulation): the part of CUDA's bf16 header that the .cu files of kernels/cuda use in the
 * emulation build: the storage type __nv_bfloat16 (2 bytes, the bits of a bf16) and its conversions
 * (round to nearest even, as __float2bfloat16_rn; NaN stays a quiet NaN). C++ only.
 * Not here: bf16 arithmetic (kernels compute in fp32 and convert). */
#ifndef NVL_EMU_CUDA_BF16_H
#define NVL_EMU_CUDA_BF16_H
#include <stdint.h>
#include <string.h>

struct alignas(2) __nv_bfloat16 {
  uint16_t __x;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = (uint32_t)h.__x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}
#endif
