/* One item of a quantized cache row layout (hybridkv/cache_dtype.py) encoded from float32 and
 * decoded back: what quantize.c's functions do per item, and what the decode kernels that keep
 * quantized states in place (mamba2_decode.c) do to a slot. Included, not built alone:
 * native_cpu.py hashes every header of this folder into each library's name. See quantize.c for
 * the arithmetic; compiled with the same flags everywhere, so the same bytes everywhere.
 */
#ifndef HYBRIDKV_QUANT_ROWS_H
#define HYBRIDKV_QUANT_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* float -> float8 e4m3fn (bias 7, no infinities, 0x7F the NaN), round to nearest even; |v| <= 448. */
static inline uint8_t to_e4m3(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(v);
    if (isnan(a)) return sign | 0x7F;
    if (a > 448.0f) a = 448.0f;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormal steps of 2^-9; 8 = 2^-6 */
    int e;
    float f = frexpf(a, &e); /* a = f 2^e, f in [0.5, 1) */
    float mant = nearbyintf((2.0f * f - 1.0f) * 8.0f);
    int biased = e - 1 + 7;
    if (mant == 8.0f) {
        mant = 0.0f;
        biased += 1;
    }
    uint8_t code = (uint8_t)((biased << 3) | (int)mant);
    return sign | (code > 0x7E ? 0x7E : code);
}

/* Round to nearest even for |v| < 2^22 (codes are within +-448): adding and taking away 1.5 x 2^23
 * leaves the integer the float adder rounds to, in a form the compiler vectorises. */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* One row of L values at stride B: its codes at stride B, its scale returned. */
static inline float encode_row(const float *row, uint8_t *codes, int64_t L, int64_t B, int fp8, float top) {
    float m = 0.0f;
    int bad = 0;
    if (B == 1) {
#pragma omp simd reduction(max : m) reduction(| : bad)
        for (int64_t l = 0; l < L; l++) {
            float a = fabsf(row[l]);
            m = a > m ? a : m;
            bad |= !(a <= 3.4028235e38f); /* NaN or infinity */
        }
    } else {
        for (int64_t l = 0; l < L; l++) {
            float a = fabsf(row[l * B]);
            m = a > m ? a : m;
            bad |= !(a <= 3.4028235e38f);
        }
    }
    float scale = bad ? NAN : m / top;
    float inv = (!bad && scale > 0.0f) ? 1.0f / scale : 0.0f;
    if (fp8) {
        for (int64_t l = 0; l < L; l++) {
            float v = row[l * B] * inv;
            v = v > top ? top : (v < -top ? -top : v);
            codes[l * B] = to_e4m3(inv == 0.0f ? 0.0f : v);
        }
    } else if (B == 1) {
        /* through an int32 block of 32: the compiler's direct float -> byte loop packs poorly
         * (~1.5x slower on a Mamba2 state's rows of 32, measured); the same values */
        for (int64_t l0 = 0; l0 < L; l0 += 32) {
            const int64_t n = L - l0 < 32 ? L - l0 : 32;
            int32_t t[32];
#pragma omp simd
            for (int64_t l = 0; l < n; l++) {
                float v = round_even(row[l0 + l] * inv);
                v = v > top ? top : (v < -top ? -top : v);
                t[l] = (int32_t)v;
            }
#pragma omp simd
            for (int64_t l = 0; l < n; l++) codes[l0 + l] = (uint8_t)t[l];
        }
        if (inv == 0.0f) memset(codes, 0, (size_t)L);
    } else {
        for (int64_t l = 0; l < L; l++) {
            float v = inv == 0.0f ? 0.0f : round_even(row[l * B] * inv);
            v = v > top ? top : (v < -top ? -top : v);
            codes[l * B] = (uint8_t)(int8_t)(int32_t)v;
        }
    }
    return scale;
}

/* One item of float32 [A][L][B] into its bytes (codes, padding, scales). */
static inline void encode_item(const float *xi, uint8_t *ri, int64_t A, int64_t L, int64_t B, int64_t code_bytes,
                        int fp8, float top) {
    const int64_t numel = A * L * B;
    if (code_bytes > numel) memset(ri + numel, 0, (size_t)(code_bytes - numel));
    for (int64_t a = 0; a < A; a++) {
        for (int64_t b = 0; b < B; b++) {
            /* rows of 32 (a Mamba2 / GDN state's d_state): a copy compiled for that length */
            float scale = B == 1 && L == 32 && !fp8 ? encode_row(xi + a * L, ri + a * L, 32, 1, 0, top)
                                                    : encode_row(xi + a * L * B + b, ri + a * L * B + b, L, B, fp8, top);
            memcpy(ri + code_bytes + 4 * (a * B + b), &scale, 4);
        }
    }
}

/* One item's bytes into float32 [A][L][B]. fp8_values: the 256 float values of the e4m3fn codes
 * (NULL for int8). */
static inline void decode_item(const uint8_t *ri, float *yi, int64_t A, int64_t L, int64_t B, int64_t code_bytes,
                        const float *fp8_values) {
    for (int64_t a = 0; a < A; a++) {
        for (int64_t b = 0; b < B; b++) {
            float scale;
            memcpy(&scale, ri + code_bytes + 4 * (a * B + b), 4);
            const uint8_t *codes = ri + a * L * B + b;
            float *out = yi + a * L * B + b;
            if (fp8_values) {
                for (int64_t l = 0; l < L; l++) out[l * B] = fp8_values[codes[l * B]] * scale;
            } else if (B == 1) {
                const int8_t *c = (const int8_t *)codes;
#pragma omp simd
                for (int64_t l = 0; l < L; l++) out[l] = (float)c[l] * scale;
            } else {
                for (int64_t l = 0; l < L; l++) out[l * B] = (float)(int8_t)codes[l * B] * scale;
            }
        }
    }
}

#endif
