/* crc32c.c: CRC-32C (crc32c.h). The 256-entry table is built once, on first use. */
#include "crc32c.h"
#include <pthread.h>

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

/* table[b]: the remainder of byte b shifted through the reflected polynomial, bit by bit */
static void build_table(void) {
  for (uint32_t b = 0; b < 256; b++) {
    uint32_t r = b;
    for (int k = 0; k < 8; k++) r = (r & 1) ? (r >> 1) ^ 0x82F63B78u : r >> 1;
    table[b] = r;
  }
}

uint32_t nvl_crc32c(uint32_t crc, const void *p, size_t n) {
  pthread_once(&table_once, build_table);
  const unsigned char *s = (const unsigned char *)p;
  uint32_t r = ~crc;
  for (size_t i = 0; i < n; i++) r = table[(r ^ s[i]) & 0xFF] ^ (r >> 8);
  return ~r;
}
