/* RMSNorm rows in one pass each: plain, the pre-norm block's "residual add + RMSNorm" fused, and
 * the gated, grouped form of Mamba2 / GDN outputs.
 *
 * Same arithmetic as the torch paths in fp32: y = (x * rsqrt(mean(x^2) + eps)) * w, or * (1 + w)
 * when plus_one (zero-centred weights); the sum of squares is accumulated in double (torch's
 * vectorised float sum is within an ulp of it). Rows have a stride (elements); the d elements of
 * a row are contiguous. Called from kernels/rms_norm.py, which checks dtypes and shapes.
 */
#include <math.h>
#include <stdint.h>

static inline float inv_rms(const float *x, int64_t d, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; j++) ss += (double)x[j] * (double)x[j];
    return 1.0f / sqrtf((float)(ss / (double)d) + eps);
}

static inline void scale_row(const float *x, float r, const float *w, int plus_one, float *out,
                             int64_t d) {
    if (plus_one) {
#pragma omp simd
        for (int64_t j = 0; j < d; j++) out[j] = (x[j] * r) * (1.0f + w[j]);
    } else {
#pragma omp simd
        for (int64_t j = 0; j < d; j++) out[j] = (x[j] * r) * w[j];
    }
}

/* out[i] = rms_norm(x[i]) * w (or * (1 + w)) for n rows of d. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, int plus_one, float *out,
                  int64_t out_stride, int64_t n, int64_t d, float eps) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * x_stride;
        scale_row(xi, inv_rms(xi, d, eps), w, plus_one, out + i * out_stride, d);
    }
}

/* sum[i] = h[i] + delta[i]; out[i] = rms_norm(sum[i]) * w (or * (1 + w)). sum may alias h. */
void add_rms_norm_f32(const float *h, int64_t h_stride, const float *delta, int64_t delta_stride,
                      const float *w, int plus_one, float *sum, int64_t sum_stride, float *out,
                      int64_t out_stride, int64_t n, int64_t d, float eps) {
    for (int64_t i = 0; i < n; i++) {
        const float *hi = h + i * h_stride, *di = delta + i * delta_stride;
        float *si = sum + i * sum_stride;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) si[j] = hi[j] + di[j];
        scale_row(si, inv_rms(si, d, eps), w, 0 != plus_one, out + i * out_stride, d);
    }
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* Gated RMSNorm over groups of `group` elements of each row of d (d a multiple of group):
 * norm_before_gate 0 (Mamba2): out = rms_norm(y * silu(z)) * w;
 * norm_before_gate 1 (GDN):    out = (rms_norm(y) * w) * silu(z).
 * z may be NULL (no gate). out must not alias y or z. */
void gated_rms_norm_f32(const float *y, int64_t y_stride, const float *z, int64_t z_stride,
                        const float *w, float *out, int64_t out_stride, int64_t n, int64_t d,
                        int64_t group, int norm_before_gate, float eps) {
    for (int64_t i = 0; i < n; i++) {
        const float *yi = y + i * y_stride, *zi = z ? z + i * z_stride : 0;
        float *oi = out + i * out_stride;
        if (zi && !norm_before_gate) {
#pragma omp simd
            for (int64_t j = 0; j < d; j++) oi[j] = yi[j] * silu(zi[j]);
        } else {
#pragma omp simd
            for (int64_t j = 0; j < d; j++) oi[j] = yi[j];
        }
        for (int64_t g = 0; g < d; g += group) {
            const float r = inv_rms(oi + g, group, eps);
#pragma omp simd
            for (int64_t j = g; j < g + group; j++) oi[j] = (oi[j] * r) * w[j];
        }
        if (zi && norm_before_gate) {
#pragma omp simd
            for (int64_t j = 0; j < d; j++) oi[j] = oi[j] * silu(zi[j]);
        }
    }
}
