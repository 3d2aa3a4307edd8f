/* crc32c.h: CRC-32C (Castagnoli: the reflected polynomial 0x82F63B78, initial value and final xor
 * 0xFFFFFFFF; RFC 3720 B.4), the checksum of TFRecord framing (TensorBoard event files). A table-driven
 * byte-at-a-time loop: what it checks is small (event records); not the SSE4.2 instruction. */
#ifndef NVL_CRC32C_H
#define NVL_CRC32C_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The CRC-32C of n bytes at p, continuing crc (the value returned for the bytes before; 0 to start). */
uint32_t nvl_crc32c(uint32_t crc, const void *p, size_t n);

#ifdef __cplusplus
}
#endif
#endif
