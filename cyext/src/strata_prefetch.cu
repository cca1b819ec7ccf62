// strata cyext: L2 prefetch of weights ahead of the kernels that read them.
//
// Why: a decode window at Qwen3-Next shapes is a chain of short kernels, many of them bound by
// latency rather than bytes (the router's top-k, the conv, the gated delta rule, the norms), and
// HBM sits idle through them. A weight does not depend on the window's activations, so its bytes
// can be on their way into L2 while those kernels run, and the kernel that reads it then streams
// from L2. One thread issues a bulk prefetch (`cp.async.bulk.prefetch.L2`, sm_90+) of a whole
// piece, so a few CTAs cover tens of megabytes without holding an SM for long.
//
// Two forms: a byte range (a dense weight), and rows of a stacked tensor picked by ids on the
// device (the experts a router chose), so both stay capturable in a CUDA graph. On GPUs without
// the bulk prefetch (before sm_90, and HIP) the kernels do nothing: a prefetch is only a hint.
//
// Layout: by default the pieces are spread over as many CTAs of one warp as there are SMs, not
// packed 128 to a CTA: a CTA's bulk prefetches go through its SM's one TMA unit in turn, so a
// launch packed onto 13 SMs took about as long as reading its bytes (25 MB, 10 us on an H100)
// before the kernel after it could start.
//
// Ordering: the kernel writes nothing, so it never breaks a dependency. It is launched
// stream-ordered (not as a programmatic dependent): a kernel after it that waits on its
// predecessor through griddepcontrol.wait then still waits on the kernel before the prefetch.

#include "hip_compat.h"
#include "strata_common.h"
#include "strata_gpu_internal.h"
#include "strata_kernels.h"

#include <stdint.h>

using namespace strata;

namespace {

constexpr int64_t PF_PIECE = 16 * 1024;  // bytes per bulk prefetch
constexpr int PF_THREADS = 32;      // the default layout's threads per CTA
constexpr int PF_MAX_THREADS = 128;
constexpr int PF_MAX_CTAS = 132;
constexpr int PF_MAX_RANGES = 4;

struct PrefetchParams {
  const char* base[PF_MAX_RANGES];
  int64_t bytes[PF_MAX_RANGES];  // the range's bytes, or with ids a row's
  int64_t nrows[PF_MAX_RANGES];  // with ids: the rows of the stacked tensor
  int n;
  const int64_t* ids;            // null: whole ranges
  int64_t nids;
};

__device__ __forceinline__ void prefetch_l2(const char* p, uint32_t bytes) {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

int64_t pieces_of(int64_t bytes) { return (bytes + PF_PIECE - 1) / PF_PIECE; }

// Piece i of the call from thread i of the grid, then i + grid size, ...: the ranges one after
// another, each whole, or with ids each listed row of it (ids out of range skipped: a prefetch
// must never touch another buffer). Threads are numbered CTA-fastest, so a call of fewer pieces
// than threads still reaches every CTA's SM.
__global__ void __launch_bounds__(PF_MAX_THREADS) l2_prefetch_kernel(PrefetchParams p) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)threadIdx.x * gridDim.x + blockIdx.x;
  int64_t first = 0;  // the first piece of range j
  for (int j = 0; j < p.n; ++j) {
    const int64_t per = (p.bytes[j] + PF_PIECE - 1) / PF_PIECE;  // a range's or a row's pieces
    const int64_t count = p.ids ? per * p.nids : per;
    for (; i < first + count; i += stride) {
      const int64_t q = i - first;
      int64_t row = 0, piece = q;
      if (p.ids) {
        row = p.ids[q / per];
        piece = q % per;
        if (row < 0 || row >= p.nrows[j]) continue;
      }
      const int64_t off = piece * PF_PIECE;
      const int64_t len = p.bytes[j] - off < PF_PIECE ? p.bytes[j] - off : PF_PIECE;
      prefetch_l2(p.base[j] + row * p.bytes[j] + off, (uint32_t)len);
    }
    first += count;
  }
}

int invalid_call(const char* what) {
  gpu_set_last_kernel(what);
  return (int)cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

int strata_gpu_l2_prefetch(const void* const* bases, const int64_t* bytes, const int64_t* nrows,
                           int n, const int64_t* ids, int64_t nids, int ctas, int threads,
                           int device, uintptr_t stream) {
  int rc = gpu_use_device(device);
  if (rc) return rc;
  if (n < 0 || n > PF_MAX_RANGES) return invalid_call("l2_prefetch (0 to 4 tensors a call)");
  if (ctas < 0 || ctas > 65535 || threads < 0 || threads > PF_MAX_THREADS || threads % 32)
    return invalid_call("l2_prefetch (ctas 0-65535, threads a multiple of 32 up to 128; 0: default)");
  PrefetchParams p = {};
  int64_t pieces = 0;
  for (int j = 0; j < n; ++j) {
    if (((uintptr_t)bases[j] & 15u) || (bytes[j] & 15) || bytes[j] < 0)
      return invalid_call("l2_prefetch (ranges and rows must be 16-byte aligned)");
    p.base[j] = (const char*)bases[j];
    p.bytes[j] = bytes[j];
    p.nrows[j] = ids ? nrows[j] : 1;
    pieces += pieces_of(bytes[j]) * (ids ? nids : 1);
  }
  p.n = n;
  p.ids = ids;
  p.nids = ids ? nids : 0;
  if (pieces == 0) return 0;
  // default: a CTA of one warp per piece, up to one per SM (see the layout note above)
  if (!threads) threads = PF_THREADS;
  const int64_t grid = ctas ? ctas : (pieces < PF_MAX_CTAS ? pieces : PF_MAX_CTAS);
  l2_prefetch_kernel<<<(unsigned)grid, (unsigned)threads, 0, (cudaStream_t)stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    gpu_set_last_kernel("l2_prefetch: l2_prefetch_kernel");
    return (int)e;
  }
  return 0;
}

}  // extern "C"
