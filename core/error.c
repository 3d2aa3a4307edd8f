/* error.c: the per-thread error message behind nvl_error / nvl_last_error. */
#include <stdarg.h>
#include <stdio.h>
#include "nvl.h"

static _Thread_local char nvl_msg[1024];

nvl_status nvl_error(nvl_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(nvl_msg, sizeof nvl_msg, fmt, ap);
  va_end(ap);
  return st;
}

const char *nvl_last_error(void) { return nvl_msg; }
