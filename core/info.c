/* info.c: build and runtime facts (see info.h). */
#include "cpu/ops_cpu.h"
#include "info.h"

const char *nvl_blas_info(void) { return nvl_blas_config(); }
