/* info.h: build and runtime facts for `nvlua -v` and nv.info(). */
#ifndef NVL_INFO_H
#define NVL_INFO_H
/* The BLAS library in use and its configuration. */
const char *nvl_blas_info(void);
#endif
