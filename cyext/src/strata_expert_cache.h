// strata cyext: the expert cache's arguments of moe_experts (strata/engine/expert_cache.py;
// semantics: strata/kernels/reference.py moe_experts). Plain C, shared by the CPU and GPU APIs.
//
// With a cache, the weight and scale stacks handed to moe_experts are the device slots
// (n_slots, ...) and expert e (0 <= e < E, E = the length of slot_of) is read from slot
// slot_of[e] when slot_of[e] >= 0, else (a miss) from row e of the host store (n_host rows,
// same row layout as the slots). On a GPU the host store is pinned host memory read through
// its device-visible (UVA) address, so a captured graph stays valid whichever experts miss.
//
// Counting (optional: routed_counts NULL = none), for the layer l = *count_layer (read where the
// kernel runs, so one compiled or captured call serves every layer) of n_layers. The call adds,
// for every distinct routed expert e (e < n_host; a folded shared expert past the host store is
// not counted), its rows' pairs to routed_counts[l][e]; and, the first time the window sees
// (l, e) (its seen flag window_state[2 + l * n_host + e] goes 0 -> 1: an atomic exchange on a
// GPU, so a window split into several calls counts each expert once), 1 to window_state[0]
// (a hit: slot_of[e] >= 0) or window_state[1] (a miss). The caller zeroes window_state (one op)
// when a window starts.
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
  float* routed_counts;           // (n_layers, n_host) cumulative routed pairs, or NULL
  int32_t* window_state;          // (2 + n_layers * n_host,) hits, misses, seen flags
  const int32_t* count_layer;     // (1,) this call's layer l
  int64_t n_layers;
} StrataExpertCache;
