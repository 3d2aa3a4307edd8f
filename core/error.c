/* error.c: the per-thread error message and status behind nvl_error / nvl_last_error / nvl_last_status. */
#include <stdarg.h>
#include <stdio.h>
#include "nvl.h"

static _Thread_local char nvl_msg[1024];
static _Thread_local nvl_status nvl_st;

nvl_status nvl_error(nvl_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(nvl_msg, sizeof nvl_msg, fmt, ap);
  va_end(ap);
  nvl_st = st;
  return st;
}

const char *nvl_last_error(void) { return nvl_msg; }

nvl_status nvl_last_status(void) { return nvl_st; }
