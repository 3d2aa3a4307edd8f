/* emu_device.h: the device side of CUDA as the .cu files of kernels/cuda use it, for the emulation build: the
 * qualifiers, vector types, built-in variables, shared memory, barriers, warp shuffles and votes,
 * atomics, intrinsics, and the launch (NVL_LAUNCH, kernels/cuda/common.cuh). C++ only; the
 * scheduler behind it is kernels/cuda/emu/launch.cpp.
 *
 * Model: every CUDA thread is a fiber; a block's threads run one at a time until each finishes or
 * waits (__syncthreads, a warp function), so code that needs a barrier and lacks one sees the
 * other threads' writes missing (NVLUA_EMU_ORDER=reverse|shuffle changes who runs first). A warp
 * function completes when every lane of its mask waits at the same call with the same mask; a
 * lane of the mask that has exited, does not exist, or waits elsewhere is an error, as is a
 * __syncthreads that not every thread of the block reaches at the same call. Each error ends the
 * kernel and is reported at the next synchronising call (and on stderr at once).
 *
 * Kernel arguments are checked at launch: a pointer must be NULL or point into a live device
 * allocation of the current device (a host pointer is an error); device pointers inside a struct
 * argument are found by value (they lie in the emulator's device address range). Shared memory:
 * NVL_SHARED / NVL_SHARED_DYNAMIC (common.cuh) give per-block storage, filled with 0xFF at every
 * block start; static + dynamic bytes are held to 48 KiB, or to the opt-in limit the kernel was
 * given with cudaFuncSetAttribute. __launch_bounds__(n) is kept with the kernel (as n/32 no-op
 * instructions at its entry, read back at launch): a launch with more threads per block fails.
 *
 * The warp matrix functions (nvcuda::wmma, bf16 16x16x16) are in mma.h, built on the warp functions here.
 *
 * Not modelled: warp-synchronous execution (lanes never run in lockstep), memory consistency
 * between blocks (blocks run one after another), texture/constant memory, cooperative groups,
 * __activemask. Using any of them does not compile here. */
#ifndef NVL_EMU_DEVICE_H
#define NVL_EMU_DEVICE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...) NVL_EMU_BOUNDS_(__VA_ARGS__, 0)
#define NVL_EMU_BOUNDS_(n, ...) __attribute__((patchable_function_entry(((n) + 31) / 32, 0)))
#define warpSize 32

/* ---- vector types ------------------------------------------------------------------------ */

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace nvl_emu {

/* ---- the running thread (launch.cpp) ------------------------------------------------------- */

struct Thread {
  uint3 idx;
};
extern Thread *cur_thread;
extern uint3 cur_block;
extern dim3 cur_block_dim, cur_grid_dim;

enum WarpKind {
  W_SHFL_IDX, W_SHFL_XOR, W_SHFL_UP, W_SHFL_DOWN, W_BALLOT, W_ANY, W_ALL, W_SYNC, W_REDUCE_MAX,
  /* the warp-wide matrix functions of mma.h: every lane passes the same value and param (pointer, ldm) */
  W_WMMA_LOAD, W_WMMA_STORE, W_WMMA_MMA, W_WMMA_FILL
};
/* One warp function of the running lane: waits for the lanes of mask, returns this lane's result. */
uint64_t warp_op(int kind, unsigned mask, uint64_t value, int param, int width, const char *file, int line);
void syncthreads(const char *file, int line);
/* A rule of a device function broken by the running thread (mma.h's argument checks): ends the kernel
 * with a fault naming the call site; never returns. */
[[noreturn]] void device_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Per-block shared memory: the variable of declaration `key` (bytes, align), and the dynamic part. */
void *shared_static(const void *key, size_t bytes, size_t align, const char *name);
void *shared_dynamic();

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp functions move up to 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof v);
  return b;
}
template <class T>
T from_bits(uint64_t b) {
  T v;
  memcpy(&v, &b, sizeof v);
  return v;
}

}  // namespace nvl_emu

#define threadIdx (::nvl_emu::cur_thread->idx)
#define blockIdx (::nvl_emu::cur_block)
#define blockDim (::nvl_emu::cur_block_dim)
#define gridDim (::nvl_emu::cur_grid_dim)

/* call site of a barrier or warp function, for the error messages */
#define NVL_EMU_SITE const char *nvl_file = __builtin_FILE(), int nvl_line = __builtin_LINE()

inline void __syncthreads(NVL_EMU_SITE) { ::nvl_emu::syncthreads(nvl_file, nvl_line); }
inline void __syncwarp(unsigned mask = 0xffffffffu, NVL_EMU_SITE) {
  (void)::nvl_emu::warp_op(::nvl_emu::W_SYNC, mask, 0, 0, 32, nvl_file, nvl_line);
}

#define NVL_EMU_SHFL(fn, kind)                                                                         \
  template <class T>                                                                                   \
  inline T fn(unsigned mask, T v, int param, int width = 32, NVL_EMU_SITE) {                           \
    return ::nvl_emu::from_bits<T>(                                                                    \
        ::nvl_emu::warp_op(::nvl_emu::kind, mask, ::nvl_emu::to_bits(v), param, width, nvl_file, nvl_line)); \
  }
NVL_EMU_SHFL(__shfl_sync, W_SHFL_IDX)
NVL_EMU_SHFL(__shfl_xor_sync, W_SHFL_XOR)
NVL_EMU_SHFL(__shfl_up_sync, W_SHFL_UP)
NVL_EMU_SHFL(__shfl_down_sync, W_SHFL_DOWN)
#undef NVL_EMU_SHFL

inline unsigned __ballot_sync(unsigned mask, int pred, NVL_EMU_SITE) {
  return (unsigned)::nvl_emu::warp_op(::nvl_emu::W_BALLOT, mask, pred != 0, 0, 32, nvl_file, nvl_line);
}
inline int __any_sync(unsigned mask, int pred, NVL_EMU_SITE) {
  return (int)::nvl_emu::warp_op(::nvl_emu::W_ANY, mask, pred != 0, 0, 32, nvl_file, nvl_line);
}
inline int __all_sync(unsigned mask, int pred, NVL_EMU_SITE) {
  return (int)::nvl_emu::warp_op(::nvl_emu::W_ALL, mask, pred != 0, 0, 32, nvl_file, nvl_line);
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v, NVL_EMU_SITE) {
  return (unsigned)::nvl_emu::warp_op(::nvl_emu::W_REDUCE_MAX, mask, v, 0, 32, nvl_file, nvl_line);
}

/* ---- atomics (blocks run on one host thread, but the operations are atomic all the same) -------- */

inline unsigned atomicOr(unsigned *p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicMax(unsigned *p, unsigned v) {
  unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <class F, class U>
inline F nvl_emu_atomic_add_float(F *p, F v) {
  U old = __atomic_load_n(reinterpret_cast<U *>(p), __ATOMIC_RELAXED), upd;
  do {
    F f, r;
    memcpy(&f, &old, sizeof f);
    r = f + v;
    memcpy(&upd, &r, sizeof r);
  } while (!__atomic_compare_exchange_n(reinterpret_cast<U *>(p), &old, upd, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
  F prev;
  memcpy(&prev, &old, sizeof prev);
  return prev;
}
inline float atomicAdd(float *p, float v) { return nvl_emu_atomic_add_float<float, uint32_t>(p, v); }
inline double atomicAdd(double *p, double v) { return nvl_emu_atomic_add_float<double, uint64_t>(p, v); }

/* ---- intrinsics and the device overloads of max/min ------------------------------------------ */

inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __double2float_rn(double x) { return (float)x; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline unsigned __float_as_uint(float f) { return ::nvl_emu::to_bits(f) & 0xffffffffu; }
inline float __uint_as_float(unsigned u) { return ::nvl_emu::from_bits<float>(u); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }

#define NVL_EMU_MINMAX(T)                              \
  inline T max(T a, T b) { return a > b ? a : b; }    \
  inline T min(T a, T b) { return a < b ? a : b; }
NVL_EMU_MINMAX(int)
NVL_EMU_MINMAX(unsigned int)
NVL_EMU_MINMAX(long long)
NVL_EMU_MINMAX(unsigned long long)
#undef NVL_EMU_MINMAX
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }

/* ---- shared memory (NVL_SHARED in common.cuh) --------------------------------------------------- */

namespace nvl_emu {
template <class T>
using ref_to = T &;
template <class T>
using ptr_to = T *;
}  // namespace nvl_emu
#define NVL_EMU_SHARED(type, name, dims)                                                          \
  static char nvl_shkey_##name;                                                                  \
  ::nvl_emu::ref_to<type dims> name = *reinterpret_cast<::nvl_emu::ptr_to<type dims>>(           \
      ::nvl_emu::shared_static(&nvl_shkey_##name, sizeof(type dims), alignof(type), #name))
#define NVL_EMU_SHARED_DYNAMIC(type, name) type *const name = reinterpret_cast<type *>(::nvl_emu::shared_dynamic())

/* ---- launches ---------------------------------------------------------------------------------- */

template <class T>
cudaError_t cudaFuncSetAttribute(T *entry, cudaFuncAttribute attr, int value) {
  return nvl_emu_func_set_attribute(reinterpret_cast<const void *>(entry), attr, value);
}

namespace nvl_emu {

struct LaunchCfg {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  const char *file;
  int line;
};

/* launch.cpp: validate the configuration (false: the launch is refused, cudaGetLastError says why),
 * check and translate each argument, run every block, and close the launch. */
bool launch_begin(const void *kernel, const char *name, const LaunchCfg &c, size_t param_bytes);
bool arg_pointer(int i, void **p, bool written);
bool arg_struct(int i, void *bytes, size_t n);
void launch_run(void (*thread_main)(void *), void *ctx);
void launch_end();
const char *pretty_kernel_name(const char *pretty, const void *key);

template <class T>
bool check_arg(int i, T &v) {
  if constexpr (std::is_pointer<T>::value) {
    void *p = const_cast<void *>(reinterpret_cast<const void *>(v));
    bool ok = arg_pointer(i, &p, !std::is_const<typename std::remove_pointer<T>::type>::value);
    v = reinterpret_cast<T>(p);
    return ok;
  } else if constexpr (std::is_class<T>::value) {
    static_assert(std::is_trivially_copyable<T>::value, "kernel arguments are copied bytewise");
    return arg_struct(i, &v, sizeof v);
  } else {
    static_assert(std::is_arithmetic<T>::value || std::is_enum<T>::value, "unsupported kernel argument type");
    return true;
  }
}

template <class... P>
struct Launcher {
  void (*fn)(P...);
  const char *name;
  LaunchCfg cfg;
  using Params = std::tuple<typename std::decay<P>::type...>;
  struct Ctx {
    void (*fn)(P...);
    Params *params;
  };
  template <size_t... I>
  static bool check_all(Params &p, std::index_sequence<I...>) {
    bool ok = true;
    ((ok = ok && check_arg((int)I, std::get<I>(p))), ...);
    return ok;
  }
  static void thread_main(void *c) {
    Ctx *x = static_cast<Ctx *>(c);
    std::apply(x->fn, *x->params);
  }
  template <class... A>
  void operator()(A &&...a) const {
    static_assert(sizeof...(A) == sizeof...(P), "a kernel launched with the wrong number of arguments");
    Params params(static_cast<typename std::decay<P>::type>(std::forward<A>(a))...);
    if (!launch_begin(reinterpret_cast<const void *>(fn), name, cfg, sizeof(Params))) return;
    if (check_all(params, std::index_sequence_for<P...>{})) {
      Ctx ctx{fn, &params};
      launch_run(thread_main, &ctx);
    }
    launch_end();
  }
};

template <auto F>
const char *kernel_name() {
  return pretty_kernel_name(__PRETTY_FUNCTION__, reinterpret_cast<const void *>(F));
}

template <class... P>
Launcher<P...> launcher_of(void (*fn)(P...), const char *name, const LaunchCfg &c) {
  return Launcher<P...>{fn, name, c};
}

}  // namespace nvl_emu

#define NVL_EMU_LAUNCH(grid, block, smem, stream, ...)                                 \
  ::nvl_emu::launcher_of(__VA_ARGS__, ::nvl_emu::kernel_name<&__VA_ARGS__>(),           \
                         ::nvl_emu::LaunchCfg{dim3(grid), dim3(block), (size_t)(smem),  \
                                              (cudaStream_t)(stream), __FILE__, __LINE__})

#endif
