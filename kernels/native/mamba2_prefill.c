/* The elementwise steps of a Mamba2 prefill on the CPU in C (fp32): each is one pass over memory
 * where torch makes several (masks, exp, multiply, pad, gather, copy). The matmuls stay in torch.
 *
 * Chunked SSD over the packed chunks of kernels/chunk_layout.py (nc chunks of cs rows; padded row
 * c * cs + l of chunk c; src[row] the packed token row there, or -1 in the padding):
 *   ssd_inputs:  acum [nc, cs, H] = cumsum over l of dt A (in double, as torch's cumsum),
 *                xdt [nc, H, cs, P] = x dt (heads first: the operand of the intra-chunk matmul),
 *                xend [nc * cs, H, P] = x dt exp(acum[c, cs-1] - acum) (carried to
 *                the chunk end), zeros in the padding.
 *   ssd_scores:  out [nc, H, cs, cs] = exp(acum[c, l, h] - acum[c, s, h]) cb[c, g, l, s] for s <= l,
 *                0 above the diagonal (the causal mask, the decay and the C.B product in one pass).
 *   ssd_chain:   the chunk-to-chunk recurrence E_c = exp(acum[c, cs-1]) E_(c-1) + ends_c per
 *                request, in place: ends becomes the state entering each chunk, finals the state
 *                after the request's last chunk.
 *   ssd_output:  out [T, H, P] = exp(acum) y_in + y_intra + D x for each output row (D x alone on a
 *                row no request covers).
 * causal_conv:   the varlen depthwise causal conv (+ bias, + silu) from each request's window,
 *                and the new windows, in one pass over the tokens.
 *
 * Every exp of a decay below CUT is an exact 0, as in the torch path (denormals are ~15x slower).
 * Row strides are in elements. Called from kernels/mamba2_prefill_native.py, which checks dtypes,
 * shapes and layouts.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The exps run on GCC/Clang vector types (8 floats): under the ISO C flags of native_cpu.py the
 * compiler will not vectorize a loop with a float compare-and-select, and a libm call per element
 * is ~10x slower. Selects are bit masks. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VL 8

static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2 and e^r by its Taylor series to r^7
 * (truncation < 6e-9 relative; measured 1.2e-7 against exp in double, as torch's exp). x is
 * clamped to [-86, 88], where 2^n stays a normal float. */
static inline vf vexp(vf x) {
    const vf zero = {0}, lo = zero - 86.0f, hi = zero + 88.0f;
    x = vsel(x < lo, lo, x);
    x = vsel(x > hi, hi, x);
    const vf n = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf r = x - n * 0.693145751953125f;                                   /* ln 2, high bits */
    r = r - n * 1.4286068203094172e-06f;                                 /* ln 2, low bits */
    vf p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n */
    return p * (vf)bits;
}

/* v[i] = exp(v[i]), exactly 0 where v[i] < cut (cut > -86) */
static inline vf vdecay(vf x, float cut) {
    const vf zero = {0};
    return vsel(x < cut, zero, vexp(x));
}

/* v[i] = v[i] / (1 + exp(-v[i])), as torch's silu */
static inline vf vsilu(vf x) { return x / (1.0f + vexp(-x)); }

#define MAP_IN_PLACE(name, op)                                                   \
    static void name(float *v, int64_t n, float cut) {                           \
        (void)cut;                                                               \
        int64_t i = 0;                                                           \
        for (; i + VL <= n; i += VL) {                                           \
            vf x;                                                                \
            memcpy(&x, v + i, sizeof x);                                         \
            x = op;                                                              \
            memcpy(v + i, &x, sizeof x);                                         \
        }                                                                        \
        if (i < n) { /* the tail through a zero-filled vector */                 \
            vf x = {0};                                                          \
            memcpy(&x, v + i, (size_t)(n - i) * sizeof(float));                 \
            x = op;                                                              \
            memcpy(v + i, &x, (size_t)(n - i) * sizeof(float));                  \
        }                                                                        \
    }
MAP_IN_PLACE(decay_n, vdecay(x, cut))
MAP_IN_PLACE(silu_n, vsilu(x))

void ssd_inputs(const float *x, int64_t x_row, const float *dt, const float *A, const int64_t *src,
                int64_t nc, int64_t cs, int64_t H, int64_t P, float cut, float *acum, float *xdt,
                float *xend) {
    double *run = malloc((size_t)H * sizeof(double));
    float *carry = malloc((size_t)H * sizeof(float));
    for (int64_t c = 0; c < nc; c++) {
        float *ac = acum + c * cs * H;
        for (int64_t h = 0; h < H; h++) run[h] = 0.0;
        for (int64_t l = 0; l < cs; l++) {
            const int64_t t = src[c * cs + l];
            for (int64_t h = 0; h < H; h++) {
                run[h] += t >= 0 ? (double)(dt[t * H + h] * A[h]) : 0.0;
                ac[l * H + h] = (float)run[h];
            }
        }
        for (int64_t l = 0; l < cs; l++) {
            const int64_t t = src[c * cs + l];
            float *xd = xdt + (c * H * cs + l) * P, *xe = xend + (c * cs + l) * H * P;
            if (t < 0) {
                for (int64_t h = 0; h < H; h++) memset(xd + h * cs * P, 0, (size_t)P * sizeof(float));
                memset(xe, 0, (size_t)(H * P) * sizeof(float));
                continue;
            }
            for (int64_t h = 0; h < H; h++) carry[h] = ac[(cs - 1) * H + h] - ac[l * H + h];
            decay_n(carry, H, cut);
            const float *xr = x + t * x_row;
            for (int64_t h = 0; h < H; h++) {
                const float d = dt[t * H + h], e = carry[h];
#pragma omp simd
                for (int64_t p = 0; p < P; p++) {
                    const float v = xr[h * P + p] * d;
                    xd[h * cs * P + p] = v;
                    xe[h * P + p] = v * e;
                }
            }
        }
    }
    free(run);
    free(carry);
}

void ssd_scores(const float *acum, const float *cb, int64_t nc, int64_t cs, int64_t H, int64_t G,
                float cut, float *out) {
    const int64_t hpg = H / G;
    float *a = malloc((size_t)cs * sizeof(float)), *e = malloc((size_t)cs * sizeof(float));
    for (int64_t c = 0; c < nc; c++)
        for (int64_t h = 0; h < H; h++) {
            for (int64_t l = 0; l < cs; l++) a[l] = acum[(c * cs + l) * H + h];
            const float *cbh = cb + (c * G + h / hpg) * cs * cs;
            float *o = out + (c * H + h) * cs * cs;
            for (int64_t l = 0; l < cs; l++) {
                const float al = a[l];
                const float *cbr = cbh + l * cs;
                float *orow = o + l * cs;
                for (int64_t s = 0; s <= l; s++) e[s] = al - a[s];
                decay_n(e, l + 1, cut);
                for (int64_t s = 0; s <= l; s++) orow[s] = e[s] * cbr[s];
                for (int64_t s = l + 1; s < cs; s++) orow[s] = 0.0f;
            }
        }
    free(a);
    free(e);
}

void ssd_chain(float *ends, const float *acum, const float *h0, const uint8_t *init,
               const int64_t *first, const int64_t *count, int64_t R, int64_t cs, int64_t H,
               int64_t PN, float cut, float *finals) {
    const int64_t F = H * PN;
    float *d = malloc((size_t)H * sizeof(float));
    for (int64_t r = 0; r < R; r++) {
        float *prev = finals + r * F;
        if (h0 && init[r])
            memcpy(prev, h0 + r * F, (size_t)F * sizeof(float));
        else
            memset(prev, 0, (size_t)F * sizeof(float));
        for (int64_t c = first[r]; c < first[r] + count[r]; c++) {
            memcpy(d, acum + (c * cs + cs - 1) * H, (size_t)H * sizeof(float));
            decay_n(d, H, cut);  /* the chunk's whole decay per head */
            for (int64_t h = 0; h < H; h++) {
                const float dh = d[h];
                float *e = ends + c * F + h * PN, *ph = prev + h * PN;
#pragma omp simd
                for (int64_t i = 0; i < PN; i++) {
                    const float own = e[i];
                    e[i] = ph[i];
                    ph[i] = dh * ph[i] + own;
                }
            }
        }
    }
    free(d);
}

void ssd_output(const float *y_in, const float *y_intra, const float *acum, const float *x,
                int64_t x_row, const float *D, const int64_t *dest, int64_t T, int64_t cs,
                int64_t H, int64_t P, int64_t G, float cut, float *out) {
    const int64_t hpg = H / G;
    float *ea = malloc((size_t)H * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = dest[t];
        if (row >= 0) {
            memcpy(ea, acum + row * H, (size_t)H * sizeof(float));
            decay_n(ea, H, cut);  /* decay from the chunk start to this row, per head */
        }
        const float *xr = x + t * x_row;
        for (int64_t h = 0; h < H; h++) {
            const float d = D ? D[h] : 0.0f;
            float *o = out + (t * H + h) * P;
            const float *xh = xr + h * P;
            if (row < 0) {
#pragma omp simd
                for (int64_t p = 0; p < P; p++) o[p] = d * xh[p];
                continue;
            }
            const int64_t c = row / cs, l = row % cs;
            const float e = ea[h];
            const float *yi = y_in + ((c * G + h / hpg) * cs + l) * hpg * P + (h % hpg) * P;
            const float *ya = y_intra + ((c * H + h) * cs + l) * P;
#pragma omp simd
            for (int64_t p = 0; p < P; p++) o[p] = e * yi[p] + ya[p] + d * xh[p];
        }
    }
    free(ea);
}

void causal_conv(const float *x, int64_t x_row, float *conv_state, const int64_t *start,
                 const int64_t *end, const int64_t *slot, const uint8_t *init, int64_t R,
                 int64_t dim, int64_t k, const float *weight, const float *bias, int act,
                 float *out) {
    const int64_t w = k - 1;
    float *taps = malloc((size_t)(k * dim) * sizeof(float));      /* [k, dim]: tap-major */
    float *win = malloc((size_t)(w * dim + 1) * sizeof(float));   /* [w, dim]: the window, token-major */
    const float **rows = malloc((size_t)k * sizeof(float *));
    for (int64_t ch = 0; ch < dim; ch++)
        for (int64_t j = 0; j < k; j++) taps[j * dim + ch] = weight[ch * k + j];
    for (int64_t r = 0; r < R; r++) {
        float *state = conv_state + slot[r] * dim * w;
        for (int64_t j = 0; j < w; j++)
            for (int64_t ch = 0; ch < dim; ch++) win[j * dim + ch] = init[r] ? state[ch * w + j] : 0.0f;
        const int64_t s = start[r], e = end[r];
        for (int64_t t = s; t < e; t++) {
            for (int64_t j = 0; j < k; j++) {  /* input row t - w + j: a token, or the window */
                const int64_t i = t - w + j;
                rows[j] = i >= s ? x + i * x_row : win + (i - s + w) * dim;
            }
            float *o = out + t * dim;
            const float *r0 = rows[0];
#pragma omp simd
            for (int64_t ch = 0; ch < dim; ch++) o[ch] = r0[ch] * taps[ch];
            for (int64_t j = 1; j < k; j++) {
                const float *rj = rows[j], *tj = taps + j * dim;
#pragma omp simd
                for (int64_t ch = 0; ch < dim; ch++) o[ch] = o[ch] + rj[ch] * tj[ch];
            }
            if (bias) {
#pragma omp simd
                for (int64_t ch = 0; ch < dim; ch++) o[ch] = o[ch] + bias[ch];
            }
            if (act) silu_n(o, dim, 0.0f);
        }
        for (int64_t j = 0; j < w; j++) {  /* the new window: the last w input rows */
            const int64_t i = e - w + j;
            const float *src = i >= s ? x + i * x_row : win + (i - s + w) * dim;
            for (int64_t ch = 0; ch < dim; ch++) state[ch * w + j] = src[ch];
        }
    }
    free(taps);
    free(win);
    free(rows);
}
