/* What the one-token recurrent decode kernels share (mamba1_decode.c, mamba2_decode.c,
 * gdn_decode.c). Included, not built alone: native_cpu.py hashes every header of this folder
 * into each library's name, so an edit here rebuilds them all. */
#ifndef HYBRIDKV_DECODE_COMMON_H
#define HYBRIDKV_DECODE_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 0 when every slot is in [0, num_slots) and none repeats; 2 (out of range) or 1 (repeated, or
 * no memory for the check) otherwise: the caller then runs the torch path, which defines those
 * cases. Checked before anything is written. */
static int check_slots(const int32_t *slots, int64_t nb, int64_t num_slots) {
    for (int64_t i = 0; i < nb; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return 2;
    if (nb <= 64) {
        for (int64_t i = 0; i < nb; i++)
            for (int64_t j = i + 1; j < nb; j++)
                if (slots[i] == slots[j]) return 1;
        return 0;
    }
    unsigned char *seen = calloc((size_t)num_slots, 1);
    if (!seen) return 1;
    int rc = 0;
    for (int64_t i = 0; i < nb && !rc; i++) {
        if (seen[slots[i]]) rc = 1;
        seen[slots[i]] = 1;
    }
    free(seen);
    return rc;
}

/* exp in a form the compiler vectorizes (libm's expf is a call per element): e^x = 2^n e^r,
 * n = round(x / ln 2), |r| <= ln 2 / 2, e^r by Cephes' degree-6 polynomial; relative error ~1e-7
 * on [-87, 88]; 0 below (never a denormal), e^88 above. */
static inline float exp_vec(float x) {
    const float below = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * below;
}

#endif
