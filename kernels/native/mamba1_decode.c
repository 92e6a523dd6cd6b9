/* The one-token decode of a Mamba1 (selective scan) layer on the CPU, one pass over each state (fp32).
 *
 * mamba1_state_update: per slot and channel c (dt = softplus(dt + dt_bias) when asked):
 *     s_n = s_n exp(dt A_cn) + (dt x_c) B_n ;  y_c = s . C + D_c x_c ;  y_c *= silu(z_c)
 * the state [d, N] read and written once, where it lives in the pool (slots index it directly).
 * Returns 1 (a slot repeated) or 2 (a slot outside the pool) before writing anything, and the
 * caller runs its torch path; 0 on success. Called from kernels/mamba1_native.py.
 */
#pragma GCC optimize("no-trapping-math")  /* compares do not trap: the clamps vectorize */
#pragma GCC target("prefer-vector-width=256")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_common.h"  /* check_slots, exp_vec */

/* log(1 + t) for t in [0, 1], vectorizable: 2 atanh(s), s = t / (2 + t) <= 1/3, by its series */
static inline float log1p_unit(float t) {
    const float s = t / (2.0f + t), s2 = s * s;
    float p = 1.0f / 15.0f;
    p = p * s2 + 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return 2.0f * s * p;
}

/* torch's softplus (threshold 20) as max(v, 0) + log(1 + e^-|v|), vectorizable */
static inline float softplus(float v) {
    const float a = v < 0.0f ? -v : v;
    const float sp = (v > 0.0f ? v : 0.0f) + log1p_unit(exp_vec(-a));
    return v > 20.0f ? v : sp;
}

int mamba1_state_update(float *state, int64_t num_slots, const int32_t *slots, int64_t nb,
                        int64_t d, int64_t N, const float *x, int64_t x_row, const float *dt,
                        int64_t dt_row, const float *A, const float *B, int64_t B_row,
                        const float *C, int64_t C_row, const float *D, const float *z,
                        int64_t z_row, const float *dt_bias, int dt_softplus, float *y) {
    int rc = check_slots(slots, nb, num_slots);
    if (rc) return rc;
    for (int64_t r = 0; r < nb; r++) {
        float *s0 = state + (int64_t)slots[r] * d * N;
        const float *xr = x + r * x_row, *dtr = dt + r * dt_row;
        const float *Br = B + r * B_row, *Cr = C + r * C_row;
        float *yr = y + r * d;
        /* the discretised dt of every channel first, in yr (a pass the compiler vectorizes) */
#pragma omp simd
        for (int64_t c = 0; c < d; c++) {
            const float v = dtr[c] + (dt_bias ? dt_bias[c] : 0.0f);
            yr[c] = dt_softplus ? softplus(v) : v;
        }
        for (int64_t c = 0; c < d; c++) {
            const float dtc = yr[c];
            const float xdt = dtc * xr[c];
            const float *Ac = A + c * N;
            float *s = s0 + c * N;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < N; n++) {
                const float v = s[n] * exp_vec(dtc * Ac[n]) + xdt * Br[n];
                s[n] = v;
                acc += v * Cr[n];
            }
            yr[c] = acc + (D ? D[c] * xr[c] : 0.0f);
        }
        if (z) {
            const float *zr = z + r * z_row;
#pragma omp simd
            for (int64_t c = 0; c < d; c++) yr[c] *= zr[c] / (1.0f + exp_vec(-zr[c]));
        }
    }
    return 0;
}
