/* The one-token decode of a Mamba2 layer on the CPU, in one pass over each state (fp32).
 *
 * conv1d_update:        the depthwise conv window of each slot shifted by the new column, the
 *                       k taps summed (oldest first, then the bias), optionally silu.
 * mamba2_state_update:  per slot, head h (group g = h / (H / G)) and row p of the head:
 *                         s = s * exp(dt A_h) + (dt x_p) B_g ;  y_p = s . C_g + D_h x_p
 *                       (dt = clamp(softplus(dt + dt_bias))), state read and written once.
 * mamba2_mixer_decode:  both of the above and the gated RMSNorm, request by request, from the
 *                       in_proj output row [z | xBC | dt] to the input row of out_proj; over
 *                       float pools, or quantized ones (int8 / fp8 codes and scales), each slot
 *                       decoded into scratch, updated and encoded back in the same pass.
 * conv1d_update_q:      conv1d_update over a quantized pool the same way (the GDN's conv; the
 *                       null slot 0 is read, never written back, as in the mixer).
 *
 * Slots index the pools directly (in place). Every function first checks the slots (in range,
 * none repeated) and returns 1 (repeated) or 2 (out of range) before writing anything: the
 * caller then runs the torch path, which defines those cases. Returns 0 on success.
 * Row strides are in elements; inside a row the data is contiguous. Called from
 * kernels/mamba2_native.py, which checks dtypes and layouts.
 */
/* Floating-point compares do not trap here, so the clamps below are selects that vectorize. */
#pragma GCC optimize("no-trapping-math")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_common.h"  /* check_slots, exp_vec */
#include "quant_rows.h"     /* decode_item, encode_item: quantized pools read and written in place */

static inline float silu(float v) { return v / (1.0f + exp_vec(-v)); }

/* softplus as torch's F.softplus (beta 1, threshold 20) */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* one request's window win [dim, k-1] shifted by x [dim]; y [dim] = taps . weight + bias */
static void conv_row(float *win, const float *x, const float *w, const float *bias, int64_t dim,
                     int64_t k, int act, float *y) {
    const int64_t km1 = k - 1;
    if (k == 4) {  /* the usual d_conv: unrolled, ~4x faster than the general loop below */
        for (int64_t c = 0; c < dim; c++) {
            float *wc = win + 3 * c;
            const float *tap = w + 4 * c;
            const float w0 = wc[0], w1 = wc[1], w2 = wc[2], xc = x[c];
            float acc = w0 * tap[0];
            acc += w1 * tap[1];
            acc += w2 * tap[2];
            acc += xc * tap[3];
            y[c] = bias ? acc + bias[c] : acc;
            wc[0] = w1;
            wc[1] = w2;
            wc[2] = xc;
        }
    } else for (int64_t c = 0; c < dim; c++) {
        float *wc = win + c * km1;
        const float *tap = w + c * k;
        const float xc = x[c];
        float acc = km1 ? wc[0] * tap[0] : xc * tap[0];
        for (int64_t j = 1; j < km1; j++) acc += wc[j] * tap[j];
        if (km1) acc += xc * tap[km1];
        if (bias) acc += bias[c];
        for (int64_t j = 0; j + 1 < km1; j++) wc[j] = wc[j + 1];
        if (km1) wc[km1 - 1] = xc;
        y[c] = acc;
    }
    if (act) {
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) y[c] = silu(y[c]);
    }
}

/* A conv window kept as one quantized item (quant_rows.h: [A][L][B] with its rows, the time steps,
 * along L) updated in place: decoded into win [dim, k-1] scratch, conv_row, encoded back (write 0:
 * left as it was: the null slot). */
struct quantized_window {
    int64_t code_bytes, A, L, B;
    const float *fp8_values;  /* the e4m3fn codes' values (fp8), or NULL (int8) */
};

static void conv_row_codes(uint8_t *item, const struct quantized_window *qw, float *win, const float *x,
                           const float *w, const float *bias, int64_t dim, int64_t k, int act, float *y, int write) {
    decode_item(item, win, qw->A, qw->L, qw->B, qw->code_bytes, qw->fp8_values);
    conv_row(win, x, w, bias, dim, k, act, y);
    if (write)
        encode_item(win, item, qw->A, qw->L, qw->B, qw->code_bytes, qw->fp8_values != NULL,
                    qw->fp8_values ? 448.0f : 127.0f);
}

int conv1d_update(float *conv_state, int64_t num_slots, const int32_t *slots, int64_t nb,
                  int64_t dim, int64_t k, const float *x, int64_t x_row, const float *weight,
                  const float *bias, int act, float *y, int64_t y_row) {
    int rc = check_slots(slots, nb, num_slots);
    if (rc) return rc;
    for (int64_t r = 0; r < nb; r++)
        conv_row(conv_state + (int64_t)slots[r] * dim * (k - 1), x + r * x_row, weight, bias, dim,
                 k, act, y + r * y_row);
    return 0;
}

/* conv1d_update over a quantized pool [num_slots, nbytes] (each slot one item of the window's codes
 * and scales, as conv_row_codes reads it): the slot 0, the null slot, is read but never written.
 * window: [dim (k-1)] scratch. */
int conv1d_update_q(uint8_t *pool, int64_t num_slots, const int32_t *slots, int64_t nb, int64_t dim, int64_t k,
                    int64_t nbytes, int64_t code_bytes, int64_t A, int64_t L, int64_t B, const float *fp8_values,
                    const float *x, int64_t x_row, const float *weight, const float *bias, int act, float *y,
                    int64_t y_row, float *window) {
    int rc = check_slots(slots, nb, num_slots);
    if (rc) return rc;
    const struct quantized_window qw = {code_bytes, A, L, B, fp8_values};
    for (int64_t r = 0; r < nb; r++)
        conv_row_codes(pool + (int64_t)slots[r] * nbytes, &qw, window, x + r * x_row, weight, bias, dim, k, act,
                       y + r * y_row, slots[r] != 0);
    return 0;
}

/* one state row s [N] stepped in place: s = s dA + xdt B; returns s . C (the float and the quantized
 * paths share it, so a quantized row is summed as its decoded row would be in float) */
static inline float ssm_step(float *s, int64_t N, float dA, float xdt, const float *B, const float *C) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < N; n++) {
        const float v = s[n] * dA + xdt * B[n];
        s[n] = v;
        acc += v * C[n];
    }
    return acc;
}

/* A quantized state item read and written in place (quant_rows.h): its codes [H P][N] (rows along N)
 * from `codes`, then a float32 scale per row at `codes + code_bytes`; NULL codes: a float state. */
struct quantized_rows {
    uint8_t *codes;
    int64_t code_bytes;
    const float *fp8_values;  /* the e4m3fn codes' values (fp8), or NULL (int8) */
    int write;                /* 0: the rows are decoded and stepped, their codes left as they were */
};

/* The rows [row0, row0 + n) of a quantized state (n <= ENCODE_ROWS_MAX) stepped as ssm_step steps a
 * float row, in scratch rows [n][N] that stay in L1: each decoded, stepped (y [n]) and its max taken,
 * then all encoded back (quant_rows.h encode_rows), so the codes are read and written once and no
 * float copy of the whole state is made. */
static void step_quantized_rows(const struct quantized_rows *q, int64_t row0, int64_t n, int64_t N, float *rows,
                                float dA, float dt, const float *x, const float *B, const float *C, float *y) {
    uint8_t *codes = q->codes + row0 * N, *scales_at = q->codes + q->code_bytes + 4 * row0;
    float scales[ENCODE_ROWS_MAX];
    uint32_t max_bits[ENCODE_ROWS_MAX];
    memcpy(scales, scales_at, (size_t)(4 * n));
    /* in sweeps over the rows, so that consecutive steps' sums overlap as in the float loop */
    for (int64_t r = 0; r < n; r++) {
        if (N == 32 && !q->fp8_values)  /* the usual d_state: copies compiled for it */
            decode_contiguous_row(codes + r * 32, scales[r], rows + r * 32, 32, NULL);
        else
            decode_contiguous_row(codes + r * N, scales[r], rows + r * N, N, q->fp8_values);
    }
    for (int64_t r = 0; r < n; r++) y[r] = ssm_step(rows + r * N, N, dA, dt * x[r], B, C);
    for (int64_t r = 0; r < n; r++) max_bits[r] = N == 32 ? row_max_bits(rows + r * 32, 32) : row_max_bits(rows + r * N, N);
    if (q->write) {
        encode_rows(rows, max_bits, codes, scales, n, N, q->fp8_values != NULL, q->fp8_values ? 448.0f : 127.0f);
        memcpy(scales_at, scales, (size_t)(4 * n));
    }
}

/* one request: state [H, P, N] updated in place; y [H, P]:
 *     s = s exp(dt A) + (dt x) B ;  y = s . C + D x   (row by row)
 * With q's codes, `state` is scratch of ENCODE_ROWS_MAX rows [N] (step_quantized_rows). */
static void ssm_row(float *state, const struct quantized_rows *q, int64_t H, int64_t P, int64_t N, int64_t G,
                    const float *x, const float *dt_in, const float *B, const float *C, const float *A,
                    const float *dt_bias, const float *D, int dt_softplus, int has_limit,
                    float dt_min, float dt_max, float *y) {
    const int64_t hpg = H / G;
    for (int64_t h = 0; h < H; h++) {
        float dt = dt_in[h] + (dt_bias ? dt_bias[h] : 0.0f);
        if (dt_softplus) dt = softplus(dt);
        if (has_limit) dt = fminf(fmaxf(dt, dt_min), dt_max);
        const float dA = expf(dt * A[h]);
        const float d = D ? D[h] : 0.0f;
        const float *Bg = B + (h / hpg) * N, *Cg = C + (h / hpg) * N;
        const float *xh = x + h * P;
        float *yh = y + h * P;
        if (q) {
            for (int64_t p0 = 0; p0 < P; p0 += ENCODE_ROWS_MAX)
                step_quantized_rows(q, h * P + p0, P - p0 < ENCODE_ROWS_MAX ? P - p0 : ENCODE_ROWS_MAX, N, state,
                                    dA, dt, xh + p0, Bg, Cg, yh + p0);
        } else {
            for (int64_t p = 0; p < P; p++) yh[p] = ssm_step(state + (h * P + p) * N, N, dA, dt * xh[p], Bg, Cg);
        }
        for (int64_t p = 0; p < P; p++) yh[p] += d * xh[p];
    }
}

int mamba2_state_update(float *state, int64_t num_slots, const int32_t *slots, int64_t nb,
                        int64_t H, int64_t P, int64_t N, int64_t G, const float *x, int64_t x_row,
                        const float *dt, int64_t dt_row, const float *B, int64_t B_row,
                        const float *C, int64_t C_row, const float *z, int64_t z_row,
                        const float *A, const float *dt_bias, const float *D, int dt_softplus,
                        int has_limit, float dt_min, float dt_max, float *y) {
    int rc = check_slots(slots, nb, num_slots);
    if (rc) return rc;
    const int64_t HP = H * P;
    for (int64_t r = 0; r < nb; r++) {
        float *yr = y + r * HP;
        ssm_row(state + (int64_t)slots[r] * HP * N, NULL, H, P, N, G, x + r * x_row, dt + r * dt_row,
                B + r * B_row, C + r * C_row, A, dt_bias, D, dt_softplus, has_limit, dt_min,
                dt_max, yr);
        if (z) {
            const float *zr = z + r * z_row;
#pragma omp simd
            for (int64_t i = 0; i < HP; i++) yr[i] *= silu(zr[i]);
        }
    }
    return 0;
}

/* y [dim] in place: norm_mode 1: norm(y silu(z)) w; 2: norm(y) w silu(z); 0: y silu(z).
 * The RMS is taken over consecutive groups of `group` elements. */
static void gated_norm_row(float *y, const float *z, const float *w, int64_t dim, int64_t group,
                           float eps, int norm_mode) {
    if (norm_mode != 2) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) y[i] *= silu(z[i]);
    }
    if (norm_mode == 0) return;
    for (int64_t g0 = 0; g0 < dim; g0 += group) {
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = g0; i < g0 + group; i++) ss += y[i] * y[i];
        const float inv = 1.0f / sqrtf(ss / (float)group + eps);
#pragma omp simd
        for (int64_t i = g0; i < g0 + group; i++) y[i] = w[i] * (y[i] * inv);
    }
    if (norm_mode == 2) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) y[i] *= silu(z[i]);
    }
}

/* The arguments of mamba2_mixer_decode: set once per layer and pools by the caller (ctypes
 * Structure in kernels/mamba2_native.py, same field order), except the per-step ones. */
struct mamba2_mixer_args {
    const float *proj;      /* [nb, proj_row...]: in_proj's rows [z (H P) | xBC (conv_dim) | dt (H)] */
    int64_t proj_row, nb;
    const int32_t *slots;   /* [nb] */
    float *y;               /* [nb, H P] out_proj's input */
    float *conv_state;      /* [num_slots, conv_dim, k-1] */
    float *ssm_state;       /* [num_slots, H, P, N] */
    int64_t num_slots, H, P, N, G, k;
    const float *conv_w;    /* [conv_dim, k] */
    const float *conv_b;    /* [conv_dim] or NULL */
    const float *A_log;     /* [H]: A = -exp(A_log) */
    const float *dt_bias, *D;  /* [H] or NULL */
    const float *norm_w;    /* [H P] or NULL (norm_mode 0) */
    int64_t norm_group;
    float eps;
    int32_t norm_mode;
    float *xbc;             /* [conv_dim] scratch */
    float *A;               /* [H] scratch */
    /* Quantized pools (quant_rows.h: a slot is one item of codes and scales), or NULL: then
     * conv_state / ssm_state above are one slot of float scratch, each request's slot decoded
     * into it, updated and encoded back (not the null slot 0, which is never kept). */
    uint8_t *conv_q;        /* [num_slots, conv_nbytes] */
    uint8_t *ssm_q;         /* [num_slots, ssm_nbytes] */
    int64_t conv_nbytes, conv_code_bytes, conv_A, conv_L, conv_B;  /* the item as [A][L][B], rows along L */
    int64_t ssm_nbytes, ssm_code_bytes;  /* the state's rows along N (quantized_rows) */
    int32_t conv_fp8, ssm_fp8;
    const float *fp8_values;  /* [256] the e4m3fn codes' values, when either is fp8 */
};

int mamba2_mixer_decode(const struct mamba2_mixer_args *a) {
    int rc = check_slots(a->slots, a->nb, a->num_slots);
    if (rc) return rc;
    const int64_t H = a->H, P = a->P, N = a->N, G = a->G, k = a->k;
    const int64_t HP = H * P, conv_dim = HP + 2 * G * N;
    for (int64_t h = 0; h < H; h++) a->A[h] = -expf(a->A_log[h]);
    for (int64_t r = 0; r < a->nb; r++) {
        const float *row = a->proj + r * a->proj_row;
        const int64_t slot = a->slots[r];
        float *win = a->conv_q ? a->conv_state : a->conv_state + slot * conv_dim * (k - 1);
        float *st = a->ssm_q ? a->ssm_state : a->ssm_state + slot * HP * N;
        uint8_t *cq = a->conv_q ? a->conv_q + slot * a->conv_nbytes : NULL;
        const struct quantized_rows sq = {a->ssm_q ? a->ssm_q + slot * a->ssm_nbytes : NULL, a->ssm_code_bytes,
                                          a->ssm_fp8 ? a->fp8_values : NULL, slot != 0};
        const struct quantized_window qw = {a->conv_code_bytes, a->conv_A, a->conv_L, a->conv_B,
                                            a->conv_fp8 ? a->fp8_values : NULL};
        if (cq)
            conv_row_codes(cq, &qw, win, row + HP, a->conv_w, a->conv_b, conv_dim, k, 1, a->xbc, slot != 0);
        else
            conv_row(win, row + HP, a->conv_w, a->conv_b, conv_dim, k, 1, a->xbc);
        float *yr = a->y + r * HP;
        ssm_row(st, sq.codes ? &sq : NULL, H, P, N, G, a->xbc, row + HP + conv_dim, a->xbc + HP, a->xbc + HP + G * N,
                a->A, a->dt_bias, a->D, 1, 0, 0.0f, 0.0f, yr);
        gated_norm_row(yr, row, a->norm_w, HP, a->norm_group, a->eps, a->norm_mode);
    }
    return 0;
}
