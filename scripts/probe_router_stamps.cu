// Probe: where the MoE router's time goes on the GPU. Builds cyext/src/strata_router.cu with its
// stamp hooks (STRATA_ROUTER_STAMPS): the last CTA's phase 2 in clock64 cycles (the ticket, the
// logits' loads and max, the softmax, each argmax round, the writes), each CTA's start and ticket
// in globaltimer ns, and the kernel's span. Each launch follows a spin kernel (so the router
// starts on idle SMs, as in a window after a dependent kernel) with rotating weights (cold in L2).
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icyext/src scripts/probe_router_stamps.cu -o /tmp/probe_router
// ("bits" lines hash the picks over 64 weight copies: compare them between builds of other forms)
//   /tmp/probe_router [rows ...]   (default 1 2 16; k = 10 and 1, E = 512, H = 2048, shared gate)
#define STRATA_ROUTER_STAMPS 1
#include "../cyext/src/strata_router.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace strata {  // the extension's own definitions live in strata_kernels.cu
int gpu_use_device(int device) { return cudaSetDevice(device) == cudaSuccess ? 0 : 1; }
void gpu_set_last_kernel(const char*) {}
}  // namespace strata

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<int> rows_list;
  for (int i = 1; i < argc; ++i) rows_list.push_back(std::atoi(argv[i]));
  if (rows_list.empty()) rows_list = {1, 2, 16};
  const int E = 512, R = 513, H = 2048, copies = 64, iters = 40;
  int clock_khz = 0;
  check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0), "clock");
  std::vector<uint16_t> hw((size_t)R * H * copies), hx(32 * H);
  uint32_t s = 12345;
  auto rnd = [&]() {
    s = s * 1664525u + 1013904223u;
    // a bf16 in about [-1, 1): sign, exponent 118..127, random mantissa
    return (uint16_t)(((s >> 31) << 15) | ((118 + ((s >> 20) % 10)) << 7) | ((s >> 8) & 127));
  };
  for (auto& v : hw) v = rnd();
  for (auto& v : hx) v = rnd();
  uint16_t *w, *x;
  float *logits, *weights;
  int64_t* ids;
  int32_t* ticket;
  check(cudaMalloc(&w, hw.size() * 2), "w");
  check(cudaMalloc(&x, hx.size() * 2), "x");
  check(cudaMalloc(&logits, 32 * R * 4), "logits");
  check(cudaMalloc(&weights, 32 * 16 * 4), "weights");
  check(cudaMalloc(&ids, 32 * 16 * 8), "ids");
  check(cudaMalloc(&ticket, 4), "ticket");
  check(cudaMemset(ticket, 0, 4), "ticket");
  check(cudaMemcpy(w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice), "w");
  check(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice), "x");
  cudaStream_t st;
  check(cudaStreamCreate(&st), "stream");
  std::printf("clock %d MHz (stamps in cycles at that rate; us = cycles / MHz)\n", clock_khz / 1000);
  for (int k : {10, 1}) {
    for (int m : rows_list) {
      const int grid = (R + RT_ROWS_PER_CTA - 1) / RT_ROWS_PER_CTA;
      std::vector<double> span, first_ticket, last_ticket, start_spread;
      std::vector<std::vector<double>> ph(64);
      for (int it = 0; it < iters; ++it) {
        spin_kernel<<<132, 32, 0, st>>>(20000);
        const uint16_t* wc = w + (size_t)(it % copies) * R * H;
        if (strata_gpu_moe_route(x, m, H, wc, R, E, nullptr, k, 1, E, logits, weights, ids,
                                 ticket, 0, (uintptr_t)st))
          return 1;
        check(cudaStreamSynchronize(st), "sync");
        long long stamps[64];
        std::vector<unsigned long long> ns(2 * grid);
        check(cudaMemcpyFromSymbol(stamps, router_stamps, sizeof(stamps)), "stamps");
        check(cudaMemcpyFromSymbol(ns.data(), router_cta_ns, ns.size() * 8), "ns");
        if (it < 4) continue;  // warm
        unsigned long long s0 = ~0ull, s1 = 0, t0 = ~0ull, t1 = 0;
        for (int c = 0; c < grid; ++c) {
          s0 = std::min(s0, ns[2 * c]);
          s1 = std::max(s1, ns[2 * c]);
          t0 = std::min(t0, ns[2 * c + 1]);
          t1 = std::max(t1, ns[2 * c + 1]);
        }
        start_spread.push_back((s1 - s0) / 1000.0);
        first_ticket.push_back((t0 - s0) / 1000.0);
        last_ticket.push_back((t1 - s0) / 1000.0);
        // the last CTA: its entry (0), phase 1's end (7), the ticket (1, 2), row 0's loads and
        // max (3), softmax (4), probabilities (5), rounds (8..), the end (6)
        const double mhz = clock_khz / 1000.0;
        auto us = [&](int a, int b) { return (stamps[b] - stamps[a]) / mhz; };
        ph[0].push_back(us(0, 7));
        ph[1].push_back(us(7, 1));
        ph[2].push_back(us(1, 2));
        ph[3].push_back(us(2, 3));
        ph[4].push_back(us(3, 4));
        ph[5].push_back(us(4, 5));
        ph[6].push_back(us(5, 8 + k - 1));
        ph[7].push_back(us(8 + k - 1, 6));
        ph[8].push_back(us(0, 6));
        if (k > 1) ph[9].push_back(us(5, 8));
      }
      std::printf(
          "k=%d rows=%d: CTA starts spread %.2f us; tickets at %.2f .. %.2f us after the first "
          "start\n  last CTA (us): phase 1 %.2f, fence+ticket %.2f, fence+reset %.2f, loads+max "
          "%.2f, softmax %.2f, probs %.2f, rounds %.2f (first %.2f), writes %.2f; entry->end "
          "%.2f\n",
          k, m, median(start_spread), median(first_ticket), median(last_ticket), median(ph[0]),
          median(ph[1]), median(ph[2]), median(ph[3]), median(ph[4]), median(ph[5]),
          median(ph[6]), k > 1 ? median(ph[9]) : 0.0, median(ph[7]), median(ph[8]));
    }
  }
  // the picks' bits, hashed per row count (compare between builds of other phase 2 forms)
  for (int m : rows_list) {
    uint64_t h = 1469598103934665603ull;
    for (int it = 0; it < copies; ++it) {
      const uint16_t* wc = w + (size_t)it * R * H;
      if (strata_gpu_moe_route(x, m, H, wc, R, E, nullptr, 10, 1, E, logits, weights, ids,
                               ticket, 0, (uintptr_t)st))
        return 1;
      std::vector<float> hwt(m * 11);
      std::vector<int64_t> hid(m * 11);
      check(cudaMemcpy(hwt.data(), weights, hwt.size() * 4, cudaMemcpyDeviceToHost), "w");
      check(cudaMemcpy(hid.data(), ids, hid.size() * 8, cudaMemcpyDeviceToHost), "ids");
      const unsigned char* b = (const unsigned char*)hwt.data();
      for (size_t i = 0; i < hwt.size() * 4; ++i) h = (h ^ b[i]) * 1099511628211ull;
      b = (const unsigned char*)hid.data();
      for (size_t i = 0; i < hid.size() * 8; ++i) h = (h ^ b[i]) * 1099511628211ull;
    }
    std::printf("bits rows=%d: %016llx\n", m, (unsigned long long)h);
  }
  return 0;
}
