/* The one-token decode of a gated delta rule layer (Qwen3-Next GDN) on the CPU (fp32).
 *
 * gdn_state_update: per slot and value head h, with the state S [K, V] where it lives in the pool:
 *     S' = e^g S ;  delta = beta (v - S'^T k) ;  S'' = S' + k delta^T ;  o = S''^T q
 * computed as two passes over S instead of torch's five: a read for S^T k and S^T q together,
 * then S <- e^g S + k delta^T, with o = e^g S^T q + delta (k . q).
 * gdn_state_update_q: the same over a quantized pool (hybridkv/cache_dtype.py: a slot is one item,
 * the codes of S's rows [HV K][V] then a float32 scale per row), read and written in place: a head's
 * rows decoded into scratch (one head: 64 KiB at 128 x 128) as the first pass reads them, stepped
 * there by the second and encoded back a block of rows at a time (quant_rows.h encode_rows). Every
 * value is that of the float function on the decoded rows (the same code per row and column; no sum
 * across a row), and the bytes those of encoding its result; the null slot 0 is read, never written
 * back.
 * q and k come prepared by the caller (l2-normalised, scaled, one row per value head).
 * Returns 1 (a slot repeated) or 2 (a slot outside the pool) before writing anything, and the
 * caller runs its torch path; 0 on success. Called from kernels/recurrent_native.py and
 * kernels/gdn_quantized.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_common.h"  /* check_slots, exp_vec */
#include "quant_rows.h"     /* decode_contiguous_row, row_max_bits, encode_rows */

/* A value head's state kept as codes [K][V] and a scale per row (scales at codes + code_bytes). */
struct quantized_head {
    uint8_t *codes;
    uint8_t *scales;
    const float *fp8_values;  /* the e4m3fn codes' values (fp8), or NULL (int8) */
    int write;                /* 0: stepped, its codes left as they were (the null slot) */
};

/* One value head: S [K][V] (float, in place) or, S NULL, qs's rows decoded into `rows` [K][V]
 * (scratch) by the first pass, stepped there by the second and encoded back a block of rows at a
 * time. qh, kh [K]; vh, oh [V]; sk, sq [V] scratch. */
static void gdn_head(float *S, const struct quantized_head *qs, float *rows, int64_t K, int64_t V, const float *qh,
                     const float *kh, const float *vh, float decay, float b, float *oh, float *sk, float *sq) {
    for (int64_t j = 0; j < V; j++) sk[j] = sq[j] = 0.0f;
    float kq = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float ki = kh[i], qi = qh[i];
        const float *Si = S ? S + i * V : rows + i * V;
        if (!S) {
            float scale;
            memcpy(&scale, qs->scales + 4 * i, 4);
            decode_contiguous_row(qs->codes + i * V, scale, rows + i * V, V, qs->fp8_values);
        }
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
    if (S) {
        for (int64_t i = 0; i < K; i++) {
            const float ki = kh[i];
            float *Si = S + i * V;
#pragma omp simd
            for (int64_t j = 0; j < V; j++) Si[j] = Si[j] * decay + ki * sk[j];
        }
        return;
    }
    for (int64_t i0 = 0; i0 < K; i0 += ENCODE_ROWS_MAX) {
        const int64_t n = K - i0 < ENCODE_ROWS_MAX ? K - i0 : ENCODE_ROWS_MAX;
        uint32_t max_bits[ENCODE_ROWS_MAX];
        for (int64_t r = 0; r < n; r++) {
            const float ki = kh[i0 + r];
            float *Si = rows + (i0 + r) * V;
#pragma omp simd
            for (int64_t j = 0; j < V; j++) Si[j] = Si[j] * decay + ki * sk[j];
            max_bits[r] = row_max_bits(Si, V);
        }
        if (qs->write) {
            float scales[ENCODE_ROWS_MAX];
            encode_rows(rows + i0 * V, max_bits, qs->codes + i0 * V, scales, n, V, qs->fp8_values != NULL,
                        qs->fp8_values ? 448.0f : 127.0f);
            memcpy(qs->scales + 4 * i0, scales, (size_t)(4 * n));
        }
    }
}

/* The pool: float [num_slots, HV, K, V] (state), or quantized [num_slots, nbytes] (pool_q, with
 * code_bytes and fp8_values as quant_rows.h reads an item; state NULL). */
static int gdn_update(float *state, uint8_t *pool_q, int64_t nbytes, int64_t code_bytes, const float *fp8_values,
                      int64_t num_slots, const int32_t *slots, int64_t nb, int64_t HV, int64_t K, int64_t V,
                      const float *q, const float *k, const float *v, int64_t v_row, const float *g, int64_t g_row,
                      const float *beta, int64_t beta_row, float *o, float *scratch) {
    int rc = check_slots(slots, nb, num_slots);
    if (rc) return rc;
    float *sk = scratch, *sq = scratch + V, *rows = scratch + 2 * V;
    for (int64_t r = 0; r < nb; r++) {
        for (int64_t h = 0; h < HV; h++) {
            const int64_t slot = slots[r];
            float *S = state ? state + (slot * HV + h) * K * V : NULL;
            uint8_t *item = pool_q ? pool_q + slot * nbytes : NULL;
            const struct quantized_head qs = {item ? item + h * K * V : NULL, item ? item + code_bytes + 4 * h * K : NULL,
                                              fp8_values, slot != 0};
            const float decay = expf(g[r * g_row + h]), b = beta[r * beta_row + h];
            gdn_head(S, &qs, rows, K, V, q + (r * HV + h) * K, k + (r * HV + h) * K, v + r * v_row + h * V, decay,
                     b, o + (r * HV + h) * V, sk, sq);
        }
    }
    return 0;
}

int gdn_state_update(float *state, int64_t num_slots, const int32_t *slots, int64_t nb, int64_t HV,
                     int64_t K, int64_t V, const float *q, const float *k, const float *v,
                     int64_t v_row, const float *g, int64_t g_row, const float *beta,
                     int64_t beta_row, float *o, float *scratch /* [2 V] */) {
    return gdn_update(state, NULL, 0, 0, NULL, num_slots, slots, nb, HV, K, V, q, k, v, v_row, g, g_row, beta,
                      beta_row, o, scratch);
}

/* scratch: [2 V + K V] (sk, sq and a head's rows: gdn_head) */
int gdn_state_update_q(uint8_t *pool, int64_t num_slots, const int32_t *slots, int64_t nb, int64_t HV, int64_t K,
                       int64_t V, int64_t nbytes, int64_t code_bytes, const float *fp8_values, const float *q,
                       const float *k, const float *v, int64_t v_row, const float *g, int64_t g_row,
                       const float *beta, int64_t beta_row, float *o, float *scratch) {
    return gdn_update(NULL, pool, nbytes, code_bytes, fp8_values, num_slots, slots, nb, HV, K, V, q, k, v, v_row, g,
                      g_row, beta, beta_row, o, scratch);
}
