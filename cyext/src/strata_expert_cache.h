// strata cyext: the expert cache's arguments of moe_experts (strata/engine/expert_cache.py;
// semantics: strata/kernels/reference.py moe_experts). Plain C, shared by the CPU and GPU APIs.
//
// With a cache, the weight and scale stacks handed to moe_experts are the device slots
// (n_slots, ...) and expert e (0 <= e < E, E = the length of slot_of) is read from slot
// slot_of[e] when slot_of[e] >= 0, else (a miss) from row e of the host store (n_host rows,
// same row layout as the slots). On a GPU the host store is pinned host memory read through
// its device-visible (UVA) address, so a captured graph stays valid whichever experts miss.
#pragma once
#include <stdint.h>

typedef struct StrataExpertCache {
  const int32_t* slot_of;         // (E,) slot of each expert, -1 = not resident
  int64_t n_slots;                // rows of the device slot stacks
  const void* host_gate_up;       // (n_host, 2I, H) in the weights' dtype
  const void* host_down;          // (n_host, H, I)
  const float* host_gu_scale;     // FP8 only: (n_host, 2*ceil(I/bo), ceil(H/bi))
  const float* host_down_scale;   // FP8 only: (n_host, ceil(H/bo), ceil(I/bi))
  int64_t n_host;                 // rows of the host store (<= E; experts past it are resident)
} StrataExpertCache;
