/* The one-token decode of a gated delta rule layer (Qwen3-Next GDN) on the CPU (fp32).
 *
 * gdn_state_update: per slot and value head h, with the state S [K, V] where it lives in the pool:
 *     S' = e^g S ;  delta = beta (v - S'^T k) ;  S'' = S' + k delta^T ;  o = S''^T q
 * computed as two passes over S instead of torch's five: a read for S^T k and S^T q together,
 * then S <- e^g S + k delta^T, with o = e^g S^T q + delta (k . q).
 * q and k come prepared by the caller (l2-normalised, scaled, one row per value head).
 * Returns 1 (a slot repeated) or 2 (a slot outside the pool) before writing anything, and the
 * caller runs its torch path; 0 on success. Called from kernels/gdn_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_common.h"  /* check_slots, exp_vec */

int gdn_state_update(float *state, int64_t num_slots, const int32_t *slots, int64_t nb, int64_t HV,
                     int64_t K, int64_t V, const float *q, const float *k, const float *v,
                     int64_t v_row, const float *g, int64_t g_row, const float *beta,
                     int64_t beta_row, float *o, float *scratch /* [2 V] */) {
    int rc = check_slots(slots, nb, num_slots);
    if (rc) return rc;
    float *sk = scratch, *sq = scratch + V;
    for (int64_t r = 0; r < nb; r++) {
        for (int64_t h = 0; h < HV; h++) {
            float *S = state + ((int64_t)slots[r] * HV + h) * K * V;
            const float *qh = q + (r * HV + h) * K, *kh = k + (r * HV + h) * K;
            const float *vh = v + r * v_row + h * V;
            const float decay = expf(g[r * g_row + h]), b = beta[r * beta_row + h];
            float *oh = o + (r * HV + h) * V;
            for (int64_t j = 0; j < V; j++) sk[j] = sq[j] = 0.0f;
            float kq = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                const float ki = kh[i], qi = qh[i];
                const float *Si = S + i * V;
                kq += ki * qi;
#pragma omp simd
                for (int64_t j = 0; j < V; j++) {
                    sk[j] += Si[j] * ki;
                    sq[j] += Si[j] * qi;
                }
            }
#pragma omp simd
            for (int64_t j = 0; j < V; j++) {
                const float delta = b * (vh[j] - decay * sk[j]);
                sk[j] = delta;
                oh[j] = decay * sq[j] + delta * kq;
            }
            for (int64_t i = 0; i < K; i++) {
                const float ki = kh[i];
                float *Si = S + i * V;
#pragma omp simd
                for (int64_t j = 0; j < V; j++) Si[j] = Si[j] * decay + ki * sk[j];
            }
        }
    }
    return 0;
}
