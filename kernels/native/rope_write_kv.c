/* An attention layer's step after its fused q/k/v projection, in one pass: rotary on q and k
 * (neox / rotate-half layout, the first `rot` dims of each head), q into a new [T, Hq, D] tensor,
 * k and v into the paged pool at each token's slot (-1: not written).
 *
 * Same arithmetic as models/rotary.apply_rotary and transformers' apply_rotary_pos_emb:
 * y1 = x1 * cos - x2 * sin, y2 = x2 * cos + x1 * sin, each product rounded on its own (ISO C:
 * no contraction into FMAs). Called from kernels/write_kv_cpu.py, which checks dtypes and shapes.
 */
#include <stdint.h>
#include <string.h>

static inline void rotate(const float *x, const float *c, const float *s, int64_t rot, int64_t d,
                          float *y) {
    const int64_t half = rot / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] - x[i + half] * s[i];
#pragma omp simd
    for (int64_t i = half; i < rot; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
    if (rot < d) memcpy(y + rot, x + rot, (size_t)(d - rot) * sizeof(float));
}

/* qkv: [T, (Hq + 2 Hkv) * D] rows (row stride qkv_stride): q heads, then k heads, then v heads.
 * cos, sin: [T, rot] rows (stride cs_stride); rot 0: no rotary.
 * q_out: [T, Hq, D] contiguous. kv: the pool, element (block, part, offset, head, :) at
 * block * s_block + part * s_part + offset * s_off + head * s_head (part 0: K, 1: V).
 * slots: [T] flat slots block * block_size + offset, below num_blocks * block_size.
 * Returns -1, or the first token whose slot lies past the pool (nothing written for it or after). */
int64_t rope_write_kv_f32(const float *qkv, int64_t qkv_stride, int64_t T, int64_t Hq, int64_t Hkv,
                          int64_t D, int64_t rot, const float *cos, const float *sin, int64_t cs_stride,
                          float *q_out, float *kv, int64_t s_block, int64_t s_part, int64_t s_off,
                          int64_t s_head, const int64_t *slots, int64_t block_size, int64_t num_blocks) {
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * qkv_stride;
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < Hq; h++) rotate(row + h * D, c, s, rot, D, q_out + (t * Hq + h) * D);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_blocks * block_size) return t;
        float *k_dst = kv + (slot / block_size) * s_block + (slot % block_size) * s_off;
        float *v_dst = k_dst + s_part;
        const float *k = row + Hq * D, *v = row + (Hq + Hkv) * D;
        for (int64_t h = 0; h < Hkv; h++) {
            rotate(k + h * D, c, s, rot, D, k_dst + h * s_head);
            memcpy(v_dst + h * s_head, v + h * D, (size_t)D * sizeof(float));
        }
    }
    return -1;
}
