// Probe: how fast can a ring of shared-memory stages filled by cp.async.bulk stream HBM?
// nvcc -O3 -std=c++17 -arch=sm_90 -Icyext/src scripts/probe_bulk.cu -o /tmp/probe_bulk
// Each CTA reads a contiguous range in chunks of `chunk` bytes (one or `split` copies each)
// into `stages` stages; `warps` consumer warps own the stages (warp w: stages w, w+warps, ..)
// and either only release them (mode 0) or read every byte with 16-byte shared loads (mode 1).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "strata_bulk.cuh"

using namespace strata::bulk;

__global__ void __launch_bounds__(544, 1)
    probe(const uint8_t* src, int64_t per_cta, int chunk, int split, int stages, int warps,
          int mode, float* sink) {
#if defined(__CUDA_ARCH__)
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + 64;
  uint8_t* ring = smem + 1024;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const uint8_t* base = src + per_cta * blockIdx.x;
  const int n = (int)(per_cta / chunk);
  if (warp == 16) {
    if (lane == 0) {
      const uint64_t pol = l2_evict_first();
      const int piece = chunk / split;
      for (int i = 0; i < n; ++i) {
        const int s = i % stages, r = i / stages;
        if (r) mbar_wait(empty + s, (r - 1) & 1);
        mbar_expect_tx(full + s, chunk);
        for (int k = 0; k < split; ++k)
          load(ring + (int64_t)s * chunk + k * piece, base + (int64_t)i * chunk + k * piece, piece,
               full + s, pol);
      }
    }
    return;
  }
  if (warp >= warps) return;
  float acc = 0.f;
  for (int i = warp; i < n; i += warps) {
    const int s = i % stages;
    mbar_wait(full + s, (i / stages) & 1);
    if (mode) {
      const uint4* p = (const uint4*)(ring + (int64_t)s * chunk);
      for (int j = lane; j < chunk / 16; j += 32) {
        const uint4 v = p[j];
        acc += __uint_as_float(v.x) + __uint_as_float(v.y) + __uint_as_float(v.z) +
               __uint_as_float(v.w);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + s);
  }
  if (acc == 1234.5f) sink[0] = acc;
#endif
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int64_t total = (int64_t)2 << 30;
  uint8_t* src;
  float* sink;
  cudaMalloc(&src, total);
  cudaMalloc(&sink, 4);
  cudaMemset(src, 1, total);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  struct Cfg { int chunk, split, stages, warps, mode, ctas_per_sm; int64_t bytes; };
  std::vector<Cfg> cfgs;
  for (int64_t bytes : {(int64_t)64 << 20, (int64_t)1 << 30})
    for (int mode : {0, 1})
      for (int chunk : {4096, 8192, 16384, 32768})
        for (int stages : {8, 16, 24}) {
          if ((int64_t)stages * chunk > 200 * 1024) continue;
          int warps = stages >= 16 ? stages / 2 : stages;
          warps = warps > 16 ? 16 : warps;
          cfgs.push_back({chunk, 1, stages, warps, mode, 1, bytes});
          if (chunk == 8192) cfgs.push_back({chunk, 2, stages, warps, mode, 1, bytes});
        }
  for (const Cfg& c : cfgs) {
    const int grid = sms * c.ctas_per_sm;
    int64_t per_cta = c.bytes / grid / c.chunk * c.chunk;
    const int smem = 1024 + c.stages * c.chunk;
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
      // rotate the source so that small cases come from HBM, not L2
      const uint8_t* s = src + ((rep * (int64_t)97 << 20) % (total - per_cta * grid));
      s = (const uint8_t*)(((uintptr_t)s) & ~(uintptr_t)4095);
      cudaEventRecord(a);
      probe<<<grid, 544, smem>>>(s, per_cta, c.chunk, c.split, c.stages, c.warps, c.mode, sink);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      if (rep && ms < best) best = ms;
    }
    const cudaError_t e = cudaGetLastError();
    printf("bytes %5lld MB mode %d chunk %5d split %d stages %2d warps %2d: %8.1f us  %6.0f GB/s %s\n",
           (long long)(per_cta * grid >> 20), c.mode, c.chunk, c.split, c.stages, c.warps,
           best * 1e3, per_cta * grid / (best * 1e-3) / 1e9, e ? cudaGetErrorString(e) : "");
  }
  return 0;
}
