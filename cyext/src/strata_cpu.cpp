// strata cyext: C++ CPU twins of the grouped-decode kernels. Semantics: strata/kernels/reference.py.
// Accumulation is float32 throughout, like the reference. Optional OpenMP over independent work.
#include "strata_cpu.h"
#include "strata_common.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace strata;

namespace {

thread_local char g_err[512] = "";

int fail(const char* fmt, long long a = 0, long long b = 0, long long c = 0) {
  snprintf(g_err, sizeof(g_err), fmt, a, b, c);
  return -1;
}

// Index checks: the CPU path validates indices (cheap here), the GPU path clamps instead.
int check_slots(const int64_t* group_slot, int64_t ng, int64_t nslots) {
  for (int64_t n = 0; n < ng; ++n)
    if (group_slot[n] < 0 || group_slot[n] >= nslots)
      return fail("group_slot[%lld] = %lld is out of range [0, %lld)", n, group_slot[n], nslots);
  return 0;
}

inline void load_row(const void* p, int dtype, int64_t off, int64_t n, float* dst) {
  if (dtype == STRATA_DTYPE_F32) {
    memcpy(dst, (const float*)p + off, n * sizeof(float));
  } else if (dtype == STRATA_DTYPE_BF16) {
    const uint16_t* s = (const uint16_t*)p + off;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  } else {
    const uint16_t* s = (const uint16_t*)p + off;
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
  }
}

inline void store_row(void* p, int dtype, int64_t off, int64_t n, const float* src) {
  if (dtype == STRATA_DTYPE_F32) {
    memcpy((float*)p + off, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) store_from_float(p, dtype, off + i, src[i]);
  }
}

}  // namespace

extern "C" {

const char* strata_cpu_last_error(void) { return g_err; }

int strata_cpu_has_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int strata_cpu_write_kv(void* k_cache, void* v_cache, int cache_dtype, const int64_t* kcs,
                        const int64_t* vcs, int64_t nslots, int64_t T, const void* k,
                        const void* v, int kv_dtype, const int64_t* group_slot,
                        const int64_t* group_pos, int64_t ng, int64_t g, int64_t hkv, int64_t d) {
  if (check_slots(group_slot, ng, nslots)) return -1;
  std::vector<float> buf(d);
  for (int64_t n = 0; n < ng; ++n) {
    for (int64_t j = 0; j < g; ++j) {
      int64_t pos = group_pos[n] + j;
      if (pos > T - 1) pos = T - 1;  // rows past the context are padding (reference clamps)
      if (pos < 0) return fail("group_pos[%lld] + %lld = %lld is negative", n, j, pos);
      for (int64_t hh = 0; hh < hkv; ++hh) {
        int64_t src = ((n * g + j) * hkv + hh) * d;
        load_row(k, kv_dtype, src, d, buf.data());
        store_row(k_cache, cache_dtype, group_slot[n] * kcs[0] + pos * kcs[1] + hh * kcs[2], d,
                  buf.data());
        load_row(v, kv_dtype, src, d, buf.data());
        store_row(v_cache, cache_dtype, group_slot[n] * vcs[0] + pos * vcs[1] + hh * vcs[2], d,
                  buf.data());
      }
    }
  }
  return 0;
}

int strata_cpu_attention(const void* q, int q_dtype, const void* k_cache, const void* v_cache,
                         int cache_dtype, const int64_t* kcs, const int64_t* vcs, int64_t nslots,
                         int64_t T, const int64_t* group_slot, const int64_t* group_pos,
                         int64_t ng, int64_t g, int64_t hq, int64_t hkv, int64_t d, int64_t ctx,
                         float scale, void* out) {
  if (check_slots(group_slot, ng, nslots)) return -1;
  if (ctx < 1 || ctx > T) return fail("ctx = %lld must be in [1, T = %lld]", ctx, T);
  const int64_t rep = hq / hkv;
  const int64_t rows = rep * g;  // rows sharing one (group, kv head): r = j * rep + ri
  const int64_t units = ng * hkv;
#pragma omp parallel for schedule(dynamic, 1) if (units * rows * ctx * d > (1 << 16))
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n = u / hkv, hh = u % hkv;
    const int64_t slot = group_slot[n], pos0 = group_pos[n];
    std::vector<float> qf(rows * d), acc(rows * d, 0.f), m(rows, -INFINITY), l(rows, 0.f);
    std::vector<float> kf(d), vf(d), s(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t j = r / rep, ri = r % rep;
      load_row(q, q_dtype, ((n * g + j) * hq + hh * rep + ri) * d, d, &qf[r * d]);
    }
    int64_t kend = std::min<int64_t>(ctx, pos0 + g);  // last row sees keys <= pos0 + g - 1
    for (int64_t key = 0; key < kend; ++key) {
      load_row(k_cache, cache_dtype, slot * kcs[0] + key * kcs[1] + hh * kcs[2], d, kf.data());
      load_row(v_cache, cache_dtype, slot * vcs[0] + key * vcs[1] + hh * vcs[2], d, vf.data());
      for (int64_t r = 0; r < rows; ++r) {
        if (key > pos0 + r / rep) continue;  // causal: row (j) sits at pos0 + j
        const float* qr = &qf[r * d];
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot += qr[i] * kf[i];
        float sc = dot * scale;
        float* ar = &acc[r * d];
        if (sc > m[r]) {
          float corr = expf(m[r] - sc);  // m = -inf -> 0
          l[r] = l[r] * corr + 1.f;
          for (int64_t i = 0; i < d; ++i) ar[i] = ar[i] * corr + vf[i];
          m[r] = sc;
        } else {
          float p = expf(sc - m[r]);
          l[r] += p;
          for (int64_t i = 0; i < d; ++i) ar[i] += p * vf[i];
        }
      }
    }
    std::vector<float> o(d);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t j = r / rep, ri = r % rep;
      float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no visible key (negative position): zeros
      for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
      store_row(out, q_dtype, ((n * g + j) * hq + hh * rep + ri) * d, d, o.data());
    }
  }
  return 0;
}

int strata_cpu_causal_conv(const void* x, int x_dtype, const void* conv_state, int state_dtype,
                           int64_t sss, int64_t nslots, const void* weight, int w_dtype,
                           const int64_t* group_slot, int64_t ng, int64_t g, int64_t c,
                           int64_t kw, void* out, void* snaps) {
  if (check_slots(group_slot, ng, nslots)) return -1;
  const int64_t km1 = kw - 1;
#pragma omp parallel for if (ng * c * g * kw > (1 << 16))
  for (int64_t nc = 0; nc < ng * c; ++nc) {
    const int64_t n = nc / c, ch = nc % c;
    std::vector<float> ext(km1 + g), w(kw);
    for (int64_t i = 0; i < kw; ++i) w[i] = load_as_float(weight, w_dtype, ch * kw + i);
    for (int64_t i = 0; i < km1; ++i)  // the state is cast to x's dtype first (reference)
      ext[i] = round_through(
          load_as_float(conv_state, state_dtype, group_slot[n] * sss + ch * km1 + i), x_dtype);
    for (int64_t j = 0; j < g; ++j) ext[km1 + j] = load_as_float(x, x_dtype, (n * g + j) * c + ch);
    for (int64_t j = 0; j < g; ++j) {
      float acc = 0.f;
      for (int64_t i = 0; i < kw; ++i) acc += ext[j + i] * w[i];
      float y = acc / (1.f + expf(-acc));
      store_from_float(out, x_dtype, (n * g + j) * c + ch, y);
      for (int64_t i = 0; i < km1; ++i)
        store_from_float(snaps, x_dtype, ((n * g + j) * c + ch) * km1 + i, ext[j + 1 + i]);
    }
  }
  return 0;
}

int strata_cpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype, const void* v,
                           int v_dtype, const void* gate, int g_dtype, const void* beta,
                           int b_dtype, const float* rec_state, int64_t sss, int64_t nslots,
                           const int64_t* group_slot, int64_t ng, int64_t g, int64_t h,
                           int64_t dk, int64_t dv, float* out, float* snaps, int mode) {
  if (check_slots(group_slot, ng, nslots)) return -1;
  const bool final_only = mode == STRATA_GDN_FINAL;
  const int64_t fw = dk + dv + 1;  // STRATA_GDN_FACTORS: a row's [k | delta | decay]
#pragma omp parallel for if (ng * h * g * dk * dv > (1 << 16))
  for (int64_t u = 0; u < ng * h; ++u) {
    const int64_t n = u / h, hh = u % h;
    std::vector<float> s(dk * dv), qf(dk), kf(dk), vf(dv), kv(dv);
    memcpy(s.data(), rec_state + group_slot[n] * sss + hh * dk * dv, dk * dv * sizeof(float));
    for (int64_t j = 0; j < g; ++j) {
      const int64_t row = (n * g + j) * h + hh;
      load_row(q, q_dtype, row * dk, dk, qf.data());
      load_row(k, k_dtype, row * dk, dk, kf.data());
      load_row(v, v_dtype, row * dv, dv, vf.data());
      const float decay = expf(load_as_float(gate, g_dtype, row));
      const float b = load_as_float(beta, b_dtype, row);
      std::fill(kv.begin(), kv.end(), 0.f);
      for (int64_t a = 0; a < dk; ++a) {
        float* sr = &s[a * dv];
        for (int64_t c = 0; c < dv; ++c) {
          sr[c] *= decay;
          kv[c] += kf[a] * sr[c];
        }
      }
      for (int64_t c = 0; c < dv; ++c) kv[c] = (vf[c] - kv[c]) * b;  // delta
      if (mode == STRATA_GDN_FACTORS) {  // the update's own values (strata_cpu_commit replays it)
        float* f = snaps + row * fw;
        memcpy(f, kf.data(), dk * sizeof(float));
        memcpy(f + dk, kv.data(), dv * sizeof(float));
        f[dk + dv] = decay;
      }
      float* o = out + row * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] = 0.f;
      for (int64_t a = 0; a < dk; ++a) {
        float* sr = &s[a * dv];
        for (int64_t c = 0; c < dv; ++c) {
          sr[c] += kf[a] * kv[c];
          o[c] += qf[a] * sr[c];
        }
      }
      if (mode == STRATA_GDN_SNAPS)
        memcpy(snaps + row * dk * dv, s.data(), dk * dv * sizeof(float));
    }
    if (final_only) memcpy(snaps + u * dk * dv, s.data(), dk * dv * sizeof(float));
  }
  return 0;
}

int strata_cpu_commit(const int64_t* accept, const int64_t* group_slot, const int64_t* group_pos,
                      int64_t ng, int64_t g, int64_t L, const float* rec_factors, int64_t h,
                      int64_t dk, int64_t dv, const void* conv_snaps, int snap_dtype,
                      int64_t conv_inner, float* rec_state, const int64_t* rs, void* conv_state,
                      int state_dtype, const int64_t* cs, int64_t nslots, int64_t* slot_pos) {
  if (check_slots(group_slot, ng, nslots)) return -1;
  for (int64_t n = 0; n < ng; ++n)
    if (accept[n] < 0 || accept[n] >= g)
      return fail("accept[%lld] = %lld is out of range [0, G = %lld)", n, accept[n], g);
  // A group whose slot a later group also names commits nothing (only padding groups share a
  // slot, the scratch one): the last one's rows are replayed onto the state all of them read.
  std::vector<char> last(ng, 1);
  for (int64_t n = 0; n < ng; ++n)
    for (int64_t m = n + 1; m < ng; ++m)
      if (group_slot[m] == group_slot[n]) last[n] = 0;
  const int64_t fw = dk + dv + 1;
#pragma omp parallel for if (L * ng * h * dk * dv * g > (1 << 16))
  for (int64_t u = 0; u < L * ng * h; ++u) {
    const int64_t l = u / (ng * h), n = (u / h) % ng, hh = u % h;
    if (!last[n]) continue;
    float* s = rec_state + l * rs[0] + group_slot[n] * rs[1] + hh * dk * dv;
    // rows 0..accept[n], each strata_cpu_gated_delta's update statement for statement (its two
    // passes: the decay stored, then k delta added) on the values it used: the state it had
    // after row accept[n], bit for bit, whatever a compiler may contract
    for (int64_t j = 0; j <= accept[n]; ++j) {
      const float* f = rec_factors + (((l * ng + n) * g + j) * h + hh) * fw;
      const float* kf = f;
      const float* delta = f + dk;
      const float decay = f[dk + dv];
      for (int64_t a = 0; a < dk; ++a) {
        float* sr = &s[a * dv];
        for (int64_t c = 0; c < dv; ++c) sr[c] *= decay;
      }
      for (int64_t a = 0; a < dk; ++a) {
        float* sr = &s[a * dv];
        for (int64_t c = 0; c < dv; ++c) sr[c] += kf[a] * delta[c];
      }
    }
  }
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t n = 0; n < ng; ++n) {
      if (!last[n]) continue;
      const int64_t src = ((l * ng + n) * g + accept[n]) * conv_inner;
      const int64_t dst = l * cs[0] + group_slot[n] * cs[1];
      for (int64_t i = 0; i < conv_inner; ++i)
        store_from_float(conv_state, state_dtype, dst + i, load_as_float(conv_snaps, snap_dtype, src + i));
    }
  }
  for (int64_t n = 0; n < ng; ++n)
    if (last[n]) slot_pos[group_slot[n]] = group_pos[n] + accept[n] + 1;
  return 0;
}

}  // extern "C"

#include "strata_cpu_moe.inc"  // routed experts and the FP8 linear (same translation unit)
