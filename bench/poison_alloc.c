// LD_PRELOAD shim: fill large heap allocations with 0xFF bytes (NaN in f32, bf16 and f16), so that a
// compiled module that reads memory nobody wrote returns NaN instead of the zeros or stale values the
// allocator happened to hold. For llvm-cpu runs of an export (docs/real-size.md, session 16):
//   gcc -O2 -shared -fPIC -o /tmp/poison_alloc.so bench/poison_alloc.c -ldl
//   POISON_REPORT=1 LD_PRELOAD=/tmp/poison_alloc.so python bench/nonfinite_probe.py OUT --device local-task --zero-state
// POISON_MIN (bytes, default 65536): smaller allocations are left alone. calloc is poisoned only when
// IREE's runtime library calls it (its heap buffers come zeroed from calloc); everyone else's calloc
// keeps its zeros.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
static size_t min_bytes(void) {
  static size_t m = 0;
  if (!m) { const char *e = getenv("POISON_MIN"); m = e ? strtoull(e, 0, 10) : (1 << 16); }
  return m;
}
static unsigned long long n_poisoned = 0, bytes_poisoned = 0;
static void fill(void *p, size_t n) {
  if (p && n >= min_bytes()) { memset(p, 0xFF, n); n_poisoned++; bytes_poisoned += n; }
}
void *malloc(size_t n) {
  static void *(*real)(size_t) = 0;
  if (!real) real = dlsym(RTLD_NEXT, "malloc");
  void *p = real(n); fill(p, n); return p;
}
void *aligned_alloc(size_t a, size_t n) {
  static void *(*real)(size_t, size_t) = 0;
  if (!real) real = dlsym(RTLD_NEXT, "aligned_alloc");
  void *p = real(a, n); fill(p, n); return p;
}
int posix_memalign(void **out, size_t a, size_t n) {
  static int (*real)(void **, size_t, size_t) = 0;
  if (!real) real = dlsym(RTLD_NEXT, "posix_memalign");
  int r = real(out, a, n); if (!r) fill(*out, n); return r;
}
void *memalign(size_t a, size_t n) {
  static void *(*real)(size_t, size_t) = 0;
  if (!real) real = dlsym(RTLD_NEXT, "memalign");
  void *p = real(a, n); fill(p, n); return p;
}
// calloc too, but only for the IREE runtime's own large allocations (its heap buffers come zeroed
// from calloc, which would hide a read of memory the program never wrote).
void *calloc(size_t k, size_t n) {
  static void *(*real)(size_t, size_t) = 0;
  static int resolving = 0;
  static char arena[1 << 16]; static size_t used = 0;
  if (!real) {
    if (resolving) { void *p = arena + used; used += (k * n + 15) & ~(size_t)15; return p; }  // dlsym's own calloc
    resolving = 1; real = dlsym(RTLD_NEXT, "calloc"); resolving = 0;
  }
  void *p = real(k, n);
  if (p && k * n >= min_bytes()) {
    Dl_info info;
    if (dladdr(__builtin_return_address(0), &info) && info.dli_fname && strstr(info.dli_fname, "_runtime_libs"))
      fill(p, k * n);
  }
  return p;
}
__attribute__((destructor)) static void report(void) {
  if (getenv("POISON_REPORT")) fprintf(stderr, "poison: %llu allocations, %llu MB filled\n", n_poisoned, bytes_poisoned >> 20);
}
