/* sharpi CPU ops besides the matmuls: RMS norm, and attention over the KV cache.
 *
 * sharpi_rms_norm: y = x / sqrt(mean(x^2) + eps) * w, computed as ggml does (float squares summed
 * in double in index order, scale = 1/sqrtf(mean + eps), then (x * scale) * w).
 *
 * sharpi_round_q8: activations rounded through 8-bit blocks (returned dequantized, fp32), bit for
 * bit the torch expression in quants.quantize_q8_blocks (one call instead of eight torch ops).
 *
 * sharpi_attention: out[T, H, Dv] = softmax(cap(q K^T) * scale + mask) V, cap the identity or, with a
 * logit softcap c > 0 (Gemma 2), c * tanhf(s / c) where llama.cpp computes it: flash attention folds
 * the 1/c into its scale (s * (scale / c), then c * tanhf, libm's), the other path scales by 1/c,
 * tanhf, times c, then the softmax's scale. With sinks (gpt-oss: one logit per head, NULL for none) the
 * softmax's denominator has one more term, exp(sink - max), as ggml adds it: flash attention folds it into
 * the first KV chunk's state at that chunk's end (fa_sink), the other path puts the sink into the max and
 * its exp into the double sum.
 *
 * One (query row, head) pair is computed by one thread in a fixed order, so its result does not
 * depend on T or on the thread count: a speculative verify pass of k+1 rows reproduces k+1
 * single-token passes bit for bit (greedy parity), with one call per layer instead of one per row.
 * Flash attention's one-chunk kernel runs up to 4 such pairs side by side in one loop (fa_chunks):
 * each keeps its own operations in its own order, and the core overlaps their latency (SmolLM2's
 * attention 20-28% faster a token, 12-15% in a 5-row verify pass).
 *
 * Numerics follow llama.cpp's CPU backend as built natively on an AVX-512 machine (the build that
 * made the fixtures: it reproduces all of them), operation for operation.
 * With flash attention (llama.cpp's CPU default; modes FA_PROMPT / FA_DECODE): q is rounded to fp16
 * against an f16 K, quantized by quantize_row_q8_0 against a q8_0 K (scores: ggml_vec_dot_q8_0_q8_0);
 * one-row passes and passes of < 64 rows take ggml's one-chunk kernel (per
 * position: ggml_vec_dot_f16 score, online softmax with libm's expf (glibc's, computed here 4 lanes at a time:
 * expf4_glibc), the V accumulator rounded to
 * fp16 at every step, S = fma(S, ms, vs) as GCC contracts it); a one-row pass whose KV length
 * (positions padded to 256) reaches 512 splits it into one chunk per thread (2) and merges them;
 * passes of >= 64 rows take its tiled kernel (KV tiles of 64, fp32 scores and accumulator, the
 * tile's exps summed by ggml_vec_soft_max_f32).
 * Without it (-fa off; ORDER_TINYBLAS / ORDER_VEC_DOT): q arrives rounded to the K cache's vec_dot
 * type for an f32 / f16 K (the caller does that), in fp32 for the others (quantized here as ggml quantizes
 * it, each K type scored by its vec_dot or tinyBLAS kernel); KQ and KQV (f32 / f16 K and V) are llamafile's
 * tinyBLAS dot products (one 16-lane fp32 FMA accumulator per output stepping 16 along the reduced axis, then _mm512_reduce_add_ps) for
 * passes of >= 2 rows, ggml_vec_dot_f16 (4 x 16 lanes, 64 a step, GGML_F32x16_REDUCE) for one row;
 * the reduced axis is the head dims for KQ and the cache positions counted from 0 for KQV; softmax is
 * ggml_vec_soft_max_f32: ggml's AVX-512 expf, each group of 16 positions reduced into a double; the
 * probabilities are rounded to fp16 when V is f16 (ggml converts them to V's vec_dot type); a bf16 V takes
 * them rounded to bf16 into ggml_vec_dot_bf16 / tinyBLAS's bf16 kernel per output element.
 *
 * sharpi_rope_table / sharpi_rope: ggml's rope cache (theta_scale = powf(base, -2 / n_rot), theta
 * multiplied by it in float from the position, divided by the pair's frequency factor when the model
 * has them (rope_freqs, Llama 3.1+), times freq_scale, YaRN's ramp and magnitude when the context has its
 * mix on, libm cosf / sinf) and rotation of adjacent pairs
 * (x0 c - x1 s, x0 s + x1 c, each as one FMA of x0's product with the other product rounded, the
 * way GCC contracts ggml's rotate_pairs).
 *
 * sharpi_glu: silu(g) * u (ggml_vec_swiglu_f32: x / (1 + expf(-x)) with ggml's vectorized expf) or
 * gelu(g) * u through ggml's fp16 GELU table (GGML_GELU_FP16: g rounded to fp16, the tanh GELU of
 * that rounded to fp16), as llama.cpp's fused swiglu / geglu ops compute them.
 *
 * sharpi_softcap: x = tanhf(x * (1 / cap)) * cap in place, as llama.cpp's graphs cap final logits
 * (Gemma 2: ggml_scale, ggml_tanh with libm's tanhf element by element, ggml_scale).
 *
 * sharpi_soft_max: each row of n floats -> its softmax in place, as ggml_soft_max (scale 1, no mask) computes
 * it in an AVX-512 build: the max, then exps by groups of 16 through ggml's vectorized expf, each group
 * reduced (_mm512_reduce_add_ps) into a double sum, the last n % 16 through libm's expf one by one;
 * every value times (float)(1.0 / sum) (ggml_vec_soft_max_f32, ggml_vec_scale_f32). MoE routing.
 *
 * sharpi_short_conv: LFM2's causal depthwise convolution, as ggml_ssm_conv computes it: out[t, c] = the taps
 * w[c, 0..width) times positions t .. t + width - 1 of ext [T + width - 1, D] (the state's width - 1 rows,
 * then the pass's), summed oldest first in float, each product added with an FMA (GCC contracts ggml's
 * `sumf += s * c` loop so; its vectorized branches are for widths of 8 and more).
 *
 * sharpi_gdn: the Gated DeltaNet recurrence (Qwen3.5's linear attention) as ggml_gated_delta_net computes it on the
 * CPU: per value head and token, the state S [S, S] (row j = column j of the paper's S) times expf(g), delta[j] =
 * (v[j] - S_j . k) * beta, S_j += k * delta[j] (FMAs), out[j] = (S_j . q) * (1 / sqrtf(S)), the dots as
 * ggml_vec_dot_f32; value head h reads key head h % Hk (ggml's broadcast). States live in a ring of R slots, the
 * state after n tokens in slot n % R: a pass reads slot0 and writes the next T slots, so the states before each of
 * its tokens stay there for speculative rollbacks. sharpi_gdn_gates: softplus(alpha + dt) * a (libm's expf and
 * logf; x itself above 20) and sigmoid(beta), in place; sharpi_sigmoid: 1 / (1 + expf(-x)) in place (ggml_sigmoid).
 *
 * sharpi_float_rows: y = x w^T for an f32, f16 or bf16 weight (qmatmul.c's F32 / F16 / BF16 types), as ggml's
 * mul_mat sums it in an AVX-512 build: one-row passes through ggml_vec_dot_f32 / _f16 (4 accumulators of 16
 * lanes over 64 elements a step, (a0 + a2) + (a1 + a3), _mm512_reduce_add_ps, an f16 row's elements past a
 * multiple of 64 added in double) / _bf16 (AVX512-BF16 dot products where the CPU has them, as ggml built
 * natively uses them), prompt passes of T >= 2 through llamafile's tinyBLAS (one accumulator per output over
 * the whole row, then _mm512_reduce_add_ps); verify rows as one-row passes.
 *
 * sharpi_hadamard: every chunk of n floats times the orthonormal Walsh-Hadamard matrix H_n, in place,
 * bit for bit kv_cache.rotate's torch arithmetic (scale by 1/sqrtf(n) first, then butterflies of width
 * 1, 2, 4, ...: each an fp32 a + b / a - b, nothing to contract).
 *
 * Cache layout of one layer (kv_cache.py): K [capacity, Hkv, D] as f32 / f16 / int8 codes with
 * q8_0 scales [capacity, Hkv, D/32] in fp16; V likewise with Dv. Query row t sits at position
 * start + t and sees keys [lo, start + t], lo = start + t - window + 1 with a sliding window.
 * Needs AVX-512F (D and Dv multiples of 16, of 32 for q8_0).
 */
#include "x86simd.h"
#include <float.h>
#include <math.h>
#include <omp.h>

#include "ggml_order.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* KV cache types (llama.cpp's -ctk / -ctv): f32, f16, bf16 as values; q8_0 as int8 codes with its fp16 scales apart;
 * q4_0, q4_1, iq4_nl, q5_0, q5_1 as ggml's blocks of 32 (their bytes as they are, d and m first, qs last) */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2, KV_BF16 = 3, KV_Q4_0 = 4, KV_Q4_1 = 5, KV_IQ4_NL = 6, KV_Q5_0 = 7, KV_Q5_1 = 8 };
/* How a pass computes attention, as llama.cpp's CPU backend does it (see sharpi_attention).
 * Without flash attention (-fa off): tinyBLAS dot products for passes of >= 2 query rows (prompt
 * processing), ggml_vec_dot_f16 for one row (decoding). With flash attention (-fa on, llama.cpp's
 * default on the CPU): FA_PROMPT for a pass of several rows (its tiled kernel from 64 rows on, else
 * its one-chunk kernel), FA_DECODE for rows that each reproduce a one-row pass (one chunk, or two
 * chunks of the KV range merged once llama.cpp's padded KV length reaches 512). */
enum { ORDER_TINYBLAS = 0, ORDER_VEC_DOT = 1, FA_PROMPT = 2, FA_DECODE = 3 };
#ifndef PV_BF16_COPY_ROWS
#define PV_BF16_COPY_ROWS 2 /* -fa off, bf16 V: passes of this many rows or more transpose V once (sharpi_attention) */
#endif
enum { FA_TILE_Q = 64, FA_TILE_KV = 64, FA_SPLIT_MIN_KV = 512, FA_SPLIT_THREADS = 2, KV_PAD = 256 };

/* ggml_rope_yarn_corr_dim: the pair index at which a frequency turns beta times over n_ctx_orig positions */
static float yarn_corr_dim(int n_rot, int n_ctx_orig, float beta, float base) {
    return (float)n_rot * logf((float)n_ctx_orig / (beta * 2 * 3.14159265358979323846f)) / (2 * logf(base));
}

/* cs [n, n_rot / 2, 2]: (cos, sin) of position p and frequency i, as ggml's rope cache (rope_yarn):
 * theta_extrap = theta / ff[i], theta_interp = freq_scale * theta_extrap; with YaRN (ext_factor != 0)
 * the pairs between the correction dims [low, high] (ggml_rope_yarn_corr_dims over beta_fast /
 * beta_slow turns in n_ctx_orig positions) mix the two by a ramp, one FMA as GCC contracts ggml's
 * theta_interp * (1 - mix) + theta_extrap * mix, and mscale grows by 1 + 0.1 ln(1 / freq_scale)
 * (an FMA too); then cosf(theta) * mscale, sinf(theta) * mscale (mscale: the context's attention factor) */
void sharpi_rope_table(float base, float freq_scale, long n, int n_rot, const float *ff, float mscale,
                       float ext_factor, int n_ctx_orig, float beta_fast, float beta_slow, float *cs) {
    const float ts = powf(base, -2.0f / (float)n_rot);
    float low = 0.0f, high = 0.0f;
    if (ext_factor != 0.0f) {
        low = fmaxf(0.0f, floorf(yarn_corr_dim(n_rot, n_ctx_orig, beta_fast, base)));
        high = fminf((float)(n_rot - 1), ceilf(yarn_corr_dim(n_rot, n_ctx_orig, beta_slow, base)));
        mscale *= fmaf(0.1f, logf(1.0f / freq_scale), 1.0f);
    }
    for (long p = 0; p < n; p++) {
        float theta = (float)p;
        for (int i = 0; i < n_rot / 2; i++) {
            const float ex = ff ? theta / ff[i] : theta, in = freq_scale * ex;
            float th = in;
            if (ext_factor != 0.0f) {
                const float y = ((float)i - low) / fmaxf(0.001f, high - low);
                const float mix = (1 - fminf(1, fmaxf(0, y))) * ext_factor;
                th = fmaf(in, 1 - mix, ex * mix);
            }
            cs[(p * (n_rot / 2) + i) * 2] = cosf(th) * mscale;
            cs[(p * (n_rot / 2) + i) * 2 + 1] = sinf(th) * mscale;
            theta *= ts;
        }
    }
}

/* x [T, nh, hd] in place: the first n_rot dims of every head rotated by cs [T, n_rot / 2, 2] */
void sharpi_rope(float *x, long T, long nh, long hd, int n_rot, const float *cs) {
    for (long t = 0; t < T; t++)
        for (long h = 0; h < nh; h++) {
            float *p = x + (t * nh + h) * hd;
            const float *c = cs + t * n_rot;
            for (int i = 0; i < n_rot; i += 2) {
                const float x0 = p[i], x1 = p[i + 1];
                p[i] = fmaf(x0, c[i], -(x1 * c[i + 1]));
                p[i + 1] = fmaf(x0, c[i + 1], x1 * c[i]);
            }
        }
}

/* x: n_chunks chunks of n (a power of two) floats, each rotated by H_n in place (see the top) */
void sharpi_hadamard(float *x, long n_chunks, int n) {
    const float s = 1.0f / sqrtf((float)n);
    for (long c = 0; c < n_chunks; c++) {
        float *y = x + c * n;
        for (int i = 0; i < n; i++) y[i] *= s;
        for (int w = 1; w < n; w *= 2)
            for (int g = 0; g < n; g += 2 * w)
                for (int i = g; i < g + w; i++) {
                    const float a = y[i], b = y[i + w];
                    y[i] = a + b;
                    y[i + w] = a - b;
                }
    }
}

void sharpi_rms_norm(const float *x, const float *w, long T, long D, float eps, float *y) {
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *yr = y + t * D;
        double sum = 0.0;
        for (long i = 0; i < D; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)D);
        const float scale = 1.0f / sqrtf(mean + eps);
        if (w)
            for (long i = 0; i < D; i++) yr[i] = (xr[i] * scale) * w[i];
        else
            for (long i = 0; i < D; i++) yr[i] = xr[i] * scale;
    }
}

/* y = x rounded through blocks of `block` (32 or 256) values: d = amax / 127, codes
 * nearbyint(x * (1 / d)), d rounded to fp16 when f16_scale; y = code * d. n is a multiple of block. */
void sharpi_round_q8(const float *x, long n, int block, int f16_scale, float *y) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (long b = 0; b < n; b += block) {
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < block; i += 16) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + b + i)));
        float d = _mm512_reduce_max_ps(m) / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        if (f16_scale) d = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        const __m512 vi = _mm512_set1_ps(inv), vd = _mm512_set1_ps(d);
        for (int i = 0; i < block; i += 16) {
            const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + b + i), vi),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm512_storeu_ps(y + b + i, _mm512_mul_ps(q, vd));
        }
    }
}

/* ---- the block types ----
 * A block of 32 as ggml's vec_dot sees its codes: signed for q4_0 (nibble - 8), q5_0 (5 bits - 16) and iq4_nl (its
 * table's value), unsigned for q4_1 (nibble) and q5_1 (5 bits) with the block's minimum m apart; element j < 16 in
 * the low nibble of qs[j], element j + 16 in its high nibble, bit j of qh element j's fifth bit. */
static inline int kv_blocked(int t) { return t >= KV_Q4_0; }
static inline int kv_has_min(int t) { return t == KV_Q4_1 || t == KV_Q5_1; }
static inline long kv_block_bytes(int t) { return t == KV_Q4_1 ? 20 : t == KV_Q5_0 ? 22 : t == KV_Q5_1 ? 24 : 18; }
static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i kv_codes(int t, const uint8_t *b) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + kv_block_bytes(t) - 16)), m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    if (t == KV_IQ4_NL) {
        const __m128i tab = _mm_loadu_si128((const __m128i *)KVALUES_IQ4NL);
        return _mm256_set_m128i(_mm_shuffle_epi8(tab, hi), _mm_shuffle_epi8(tab, lo));
    }
    __m256i c = _mm256_set_m128i(hi, lo);
    if (t == KV_Q4_0) return _mm256_sub_epi8(c, _mm256_set1_epi8(8));
    if (t == KV_Q4_1) return c;
    uint32_t qh; /* q5: byte j of the 32 gets bit j of qh (as 16) */
    memcpy(&qh, b + (t == KV_Q5_1 ? 4 : 2), 4);
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                            _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(16)));
    return t == KV_Q5_0 ? _mm256_sub_epi8(c, _mm256_set1_epi8(16)) : c;
}

/* 16 values of a block (half 0: elements 0-15, 1: 16-31) as ggml's to_float gives them (dequantize_row_*, built
 * without FMA: code * d, then + m for q4_1 / q5_1) */
static inline __m512 kv_dequant16(int t, const uint8_t *b, long half) {
    const __m256i c = kv_codes(t, b);
    const __m128i h = half ? _mm256_extracti128_si256(c, 1) : _mm256_castsi256_si128(c);
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h)), _mm512_set1_ps(f16_at(b)));
    return kv_has_min(t) ? _mm512_add_ps(v, _mm512_set1_ps(f16_at(b + 2))) : v;
}

/* 16 cache values of row `row` (elements [d, d+16)) as fp32 */
static inline __m512 load16(const void *base, const uint16_t *scales, int type, long row, long width, long d) {
    if (type == KV_F32) return _mm512_loadu_ps((const float *)base + row * width + d);
    if (type == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + row * width + d)));
    if (type == KV_BF16) /* exact: the high half of each float */
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + row * width + d))), 16));
    if (kv_blocked(type))
        return kv_dequant16(type, (const uint8_t *)base + (row * (width / 32) + d / 32) * kv_block_bytes(type), (d >> 4) & 1);
    const __m128i c = _mm_loadu_si128((const __m128i *)((const int8_t *)base + row * width + d));
    const float s = _cvtsh_ss(scales[(row * width + d) / 32]);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), _mm512_set1_ps(s));
}

/* ggml's vectorized expf of its AVX-512 builds (ggml_v_expf in ggml-cpu/vec.h, the __AVX512F__ &&
 * __AVX512DQ__ variant): the polynomial carries the 1 inside, exp(b) * 2^n through vscalefps. */
static inline __m512 ggml_expf16(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 d = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (!d) return res;
    const __m512 zero = _mm512_setzero_ps();
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, zero, _CMP_LE_OQ), _mm512_set1_ps(INFINITY), zero);
    return _mm512_mask_blend_ps(d, res, alt);
}

/* glibc's expf (2.27 on: sysdeps/ieee754/flt-32/e_expf.c, what the fixtures' llama.cpp called through libm) as
 * its x86-64 FMA build computes it, on 4 lanes in double: k = round(32 x / ln 2) by adding 1.5 * 2^52 (one FMA),
 * r = 32 x / ln 2 - k (one FMA), s = 2^(k / 32) as a table entry's bits (2^(i / 32)'s bits less i << 47, i = k mod 32)
 * plus k << 47, then ((C0 r + C1) r^2 + (C2 r + 1)) s rounded to float, in that FMA order. Lanes with |x| >= 88,
 * infinities and NaN take libm's own special cases (expf16 sends them to expf). Whether libm's expf is this one is
 * checked when the library loads (expf_vec_check: otherwise every call goes to libm); tests compare the two over
 * every float of [-104, 0] (tests/test_ops.py). */
static const uint64_t EXPF_TAB[32] = {
    0x3ff0000000000000ULL, 0x3fefd9b0d3158574ULL, 0x3fefb5586cf9890fULL, 0x3fef9301d0125b51ULL,
    0x3fef72b83c7d517bULL, 0x3fef54873168b9aaULL, 0x3fef387a6e756238ULL, 0x3fef1e9df51fdee1ULL,
    0x3fef06fe0a31b715ULL, 0x3feef1a7373aa9cbULL, 0x3feedea64c123422ULL, 0x3feece086061892dULL,
    0x3feebfdad5362a27ULL, 0x3feeb42b569d4f82ULL, 0x3feeab07dd485429ULL, 0x3feea47eb03a5585ULL,
    0x3feea09e667f3bcdULL, 0x3fee9f75e8ec5f74ULL, 0x3feea11473eb0187ULL, 0x3feea589994cce13ULL,
    0x3feeace5422aa0dbULL, 0x3feeb737b0cdc5e5ULL, 0x3feec49182a3f090ULL, 0x3feed503b23e255dULL,
    0x3feee89f995ad3adULL, 0x3feeff76f2fb5e47ULL, 0x3fef199bdd85529cULL, 0x3fef3720dcef9069ULL,
    0x3fef5818dcfba487ULL, 0x3fef7c97337b9b5fULL, 0x3fefa4afa2a490daULL, 0x3fefd0765b6e4540ULL,
};

static inline __m128 expf4_glibc(__m128 x) {
    const __m256d xd = _mm256_cvtps_pd(x), inv = _mm256_set1_pd(0x1.71547652b82fep+5), shift = _mm256_set1_pd(0x1.8p+52);
    const __m256d kds = _mm256_fmadd_pd(inv, xd, shift), kd = _mm256_sub_pd(kds, shift);
    const __m256d r = _mm256_fmsub_pd(inv, xd, kd);
    const __m256i ki = _mm256_castpd_si256(kds);
    const __m256i t = _mm256_add_epi64(_mm256_i64gather_epi64((const long long *)EXPF_TAB, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8),
                                       _mm256_slli_epi64(ki, 47));
    const __m256d z = _mm256_fmadd_pd(r, _mm256_set1_pd(0x1.c6af84b912394p-20), _mm256_set1_pd(0x1.ebfce50fac4f3p-13));
    const __m256d y = _mm256_fmadd_pd(r, _mm256_set1_pd(0x1.62e42ff0c52d6p-6), _mm256_set1_pd(1.0));
    return _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y), _mm256_castsi256_pd(t)));
}

static int expf_ok = 0;  /* expf4_glibc is libm's expf here (the check when the library loads) */
static int expf_vec = 0; /* and serves the kernels (expf_ok unless a test switched it off) */

static inline int expf_special(float x) { /* |x| >= 88, an infinity or NaN: libm's special cases */
    uint32_t u;
    memcpy(&u, &x, 4);
    return ((u >> 20) & 0x7ff) >= 0x42a;
}

/* y[i] = expf(x[i]) for 16 lanes, libm's bits: through expf4_glibc (vec) or libm's expf */
static inline void expf16_by(const float *x, float *y, int vec) {
    if (!vec) {
        for (int i = 0; i < 16; i++) y[i] = expf(x[i]);
        return;
    }
    for (int i = 0; i < 16; i += 4) _mm_storeu_ps(y + i, expf4_glibc(_mm_loadu_ps(x + i)));
    for (int i = 0; i < 16; i++)
        if (expf_special(x[i])) y[i] = expf(x[i]);
}

static inline void expf16(const float *x, float *y) { expf16_by(x, y, expf_vec); }

/* Floats of bit patterns lo, lo + step, ... < hi where expf16 and libm's expf differ (bit for bit, NaN equal to NaN) */
long sharpi_expf_mismatches(uint32_t lo, uint32_t hi, uint32_t step, int vec, int nthreads) {
    long bad = 0;
    const long n = ((long)hi - (long)lo + (long)step - 1) / (long)step;
#pragma omp parallel for num_threads(nthreads) reduction(+ : bad) schedule(static)
    for (long b = 0; b < (n + 15) / 16; b++) {
        float x[16], y[16];
        for (int i = 0; i < 16; i++) {
            const long j = b * 16 + i < n ? b * 16 + i : n - 1;
            const uint32_t u = (uint32_t)(lo + (uint32_t)j * step);
            memcpy(x + i, &u, 4);
        }
        expf16_by(x, y, vec);
        for (int i = 0; i < 16 && b * 16 + i < n; i++) {
            const float w = expf(x[i]);
            if (memcmp(&w, y + i, 4) && !(isnan(w) && isnan(y[i]))) bad++;
        }
    }
    return bad;
}

/* At load: expf4_glibc against libm's expf on ~2^20 floats spread over [-104, 0] and [0, 89] (a libm with another
 * expf differs on a good share of them); any difference: libm's expf everywhere */
__attribute__((constructor)) static void expf_vec_check(void) {
    expf_ok = expf_vec = sharpi_expf_mismatches(0x80000000u, 0xC2D00000u, 1031, 1, 1) == 0 &&
                         sharpi_expf_mismatches(0x00000000u, 0x42B20000u, 4099, 1, 1) == 0;
}

/* Whether expf4_glibc serves (1) or libm's expf does (0); sharpi_expf_set: tests switch it (on only where the
 * check at load passed) */
int sharpi_expf_vec(void) { return expf_vec; }
void sharpi_expf_set(int v) { expf_vec = v && expf_ok; }

/* ggml_vec_dot_f16 / ggml_vec_dot_f32 of an AVX-512 build: 4 accumulators of 16 lanes over 64
 * elements a step, GGML_F32x16_REDUCE ((a0 + a2) + (a1 + a3), then _mm512_reduce_add_ps), the
 * elements past a multiple of 64 added one by one (in double for f16, as ggml does) */
static inline float dot_vec_dot(const void *k, const uint16_t *kd, int k_type, long row, long D, const float *q) {
    const long np = D & ~63L;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (long d = 0; d < np; d += 64)
        for (int u = 0; u < 4; u++)
            acc[u] = _mm512_fmadd_ps(load16(k, kd, k_type, row, D, d + 16 * u), _mm512_loadu_ps(q + d + 16 * u), acc[u]);
    const float r = reduce16(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
    if (np == D) return r;
    double sd = r;
    float kt[16];
    for (long d = np; d < D; d += 16) {
        _mm512_storeu_ps(kt, load16(k, kd, k_type, row, D, d));
        for (int i = 0; i < 16; i++) sd += (double)(kt[i] * q[d + i]);
    }
    return (float)sd;
}

/* tinyBLAS's dot product of an AVX-512 build: one 16-lane FMA accumulator over the row (D a multiple of
 * 16), then its hsum (_mm512_reduce_add_ps) */
static inline float dot_tinyblas(const void *k, const uint16_t *kd, int k_type, long row, long D, const float *q) {
    __m512 acc = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load16(k, kd, k_type, row, D, d), _mm512_loadu_ps(q + d), acc);
    return reduce16(acc);
}

/* qmatmul.c: activations quantized as ggml does for a weight type's vec_dot type (ty 8 = Q8_0:
 * quantize_row_q8_0, codes and fp16 scales returned as fp32) */
int sharpi_quantize_act(int ty, const float *x, long T, long k, int8_t *codes, float *d, float *s, int16_t *bsums);
enum { GGML_TYPE_Q4_1 = 3, GGML_TYPE_Q8_0 = 8 };

/* ggml_vec_dot_q8_0_q8_0 (its AVX2 code, which AVX-512 builds run): per block of 32 the exact integer
 * sums of 4 consecutive products in 8 lanes, acc = fma(d_k * d_q, float(lane), acc), hsum_float_8 */
static inline float dot_q8_0(const int8_t *kc, const uint16_t *kd, const int8_t *qc, const float *qd, long D) {
    __m256 acc = _mm256_setzero_ps();
    for (long b = 0; b < D; b += 32) {
        const __m256i k8 = _mm256_loadu_si256((const __m256i *)(kc + b)), q8 = _mm256_loadu_si256((const __m256i *)(qc + b));
        /* |k| * sign(q, k), as ggml's mul_sum_i8_pairs_float: products summed 4 a lane, exactly */
        const __m256i lanes = sx_dpbusd8(_mm256_setzero_si256(), _mm256_sign_epi8(k8, k8), _mm256_sign_epi8(q8, k8));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(kd[b / 32]) * qd[b / 32]), _mm256_cvtepi32_ps(lanes), acc);
    }
    return hsum8(acc);
}

/* ggml's vec_dot of a K row in a block type against q in its vec_dot type (q8_0 codes and fp16 scales; q8_1 for
 * q4_1 / q5_1, with the blocks' sums s = fp16(d * sum of codes)): the AVX2 code AVX-512 builds run. Per block the 32
 * products summed exactly in 8 lanes of 4, acc = fma(d_k * d_q, float(lane), acc), then hsum_float_8; q4_1 / q5_1
 * add the fp32 sum of fma(m_k, s_q, .) over the blocks; iq4_nl alternates two accumulators (blocks in pairs, an odd
 * last block added as fma(d, float(its integer sum), total)). */
static inline __m256i kv_lanes(int t, __m256i k, __m256i q) {
    /* (|k| <= 127, |q| <= 127: no pair saturates int16) */
    if (kv_has_min(t)) return sx_dpbusd8(_mm256_setzero_si256(), k, q);
    return sx_dpbusd8(_mm256_setzero_si256(), _mm256_sign_epi8(k, k), _mm256_sign_epi8(q, k));
}

static inline float dot_blocks(int t, const uint8_t *row, const int8_t *qc, const float *qd, const float *qs, long D,
                               int tinyblas) {
    const long nb = D / 32, bb = kv_block_bytes(t);
    const int paired = t == KV_IQ4_NL && !tinyblas; /* (llamafile's tinyBLAS_Q0_AVX: one accumulator for iq4_nl too) */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float summs = 0.0f;
    long ib = 0;
    for (; ib < (paired ? nb & ~1L : nb); ib++) {
        const uint8_t *b = row + ib * bb;
        const __m256i l = kv_lanes(t, kv_codes(t, b), _mm256_loadu_si256((const __m256i *)(qc + 32 * ib)));
        if (kv_has_min(t)) summs = fmaf(f16_at(b + 2), qs[ib], summs);
        const int a = paired ? (int)(ib & 1) : 0;
        acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * qd[ib]), _mm256_cvtepi32_ps(l), acc[a]);
    }
    if (!paired) return kv_has_min(t) ? hsum8(acc[0]) + summs : hsum8(acc[0]);
    float s = hsum8(_mm256_add_ps(acc[0], acc[1]));
    if (ib < nb) {
        const uint8_t *b = row + ib * bb;
        int32_t l[8], sum = 0;
        _mm256_storeu_si256((__m256i *)l, kv_lanes(t, kv_codes(t, b), _mm256_loadu_si256((const __m256i *)(qc + 32 * ib))));
        for (int i = 0; i < 8; i++) sum += l[i];
        s = fmaf(qd[ib] * f16_at(b), (float)sum, s);
    }
    return s;
}

/* ggml_cpu_fp32_to_bf16 (GGML_FP32_TO_BF16): round to nearest even, a NaN made quiet */
static inline uint16_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

static inline int iq4nl_index(float x) { /* ggml's best_index_int8 over the iq4_nl table */
    const int8_t *v = KVALUES_IQ4NL;
    if (x <= v[0]) return 0;
    if (x >= v[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (x < v[mid]) hi = mid;
        else lo = mid;
    }
    return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

/* A KV cache write in a block type: nb blocks of 32 floats -> ggml's blocks, as llama.cpp's CPU backend quantizes
 * a cache row (quantize_row_q4_0_ref etc.: its reference quantizers, built without FMA; iq4_nl's with ntry = -1: one
 * pass at d = max / -127 and weights x^2, then d = sum(w q x) / sum(w q^2)). dst holds nb blocks. */
void sharpi_kv_store(int t, const float *x, long nb, uint8_t *dst) {
    const long bb = kv_block_bytes(t);
    for (long ib = 0; ib < nb; ib++, x += 32, dst += bb) {
        uint8_t L[32] = {0};
        float d, m = 0.0f;
        if (t == KV_Q4_1 || t == KV_Q5_1) {
            float min = FLT_MAX, max = -FLT_MAX;
            for (int j = 0; j < 32; j++) {
                if (x[j] < min) min = x[j];
                if (x[j] > max) max = x[j];
            }
            d = (max - min) / (t == KV_Q4_1 ? 15 : 31);
            m = min;
            const float id = d ? 1.0f / d : 0.0f;
            for (int j = 0; j < 32; j++) {
                const float v = (x[j] - min) * id + 0.5f;
                if (t == KV_Q4_1) {
                    const int8_t c = (int8_t)v;
                    L[j] = (uint8_t)(c < 15 ? c : 15);
                } else {
                    L[j] = (uint8_t)v;
                }
            }
        } else {
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 32; j++)
                if (amax < fabsf(x[j])) {
                    amax = fabsf(x[j]);
                    max = x[j];
                }
            if (t == KV_IQ4_NL) {
                d = 0.0f;
                if (amax >= 1e-15f) { /* GROUP_MAX_EPS (below it: d = 0, the codes do not matter) */
                    const float id = 1.0f / (max / (float)KVALUES_IQ4NL[0]);
                    float sumqx = 0.0f, sumq2 = 0.0f;
                    for (int j = 0; j < 32; j++) {
                        L[j] = (uint8_t)iq4nl_index(id * x[j]);
                        const float q = (float)KVALUES_IQ4NL[L[j]], w = x[j] * x[j];
                        sumqx += w * q * x[j];
                        sumq2 += w * q * q;
                    }
                    d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
                }
            } else {
                const int half = t == KV_Q4_0 ? 8 : 16;
                d = max / (float)-half;
                const float id = d ? 1.0f / d : 0.0f, off = (float)half + 0.5f;
                for (int j = 0; j < 32; j++) {
                    const int8_t c = (int8_t)(x[j] * id + off);
                    L[j] = (uint8_t)(c < 2 * half - 1 ? c : 2 * half - 1);
                }
            }
        }
        const uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        memcpy(dst, &dh, 2);
        if (kv_has_min(t)) {
            const uint16_t mh = _cvtss_sh(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            memcpy(dst + 2, &mh, 2);
        }
        uint8_t *qs = dst + bb - 16;
        for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((L[j] & 15) | ((L[j + 16] & 15) << 4));
        if (t == KV_Q5_0 || t == KV_Q5_1) {
            uint32_t qh = 0;
            for (int j = 0; j < 32; j++) qh |= (uint32_t)((L[j] >> 4) & 1) << j;
            memcpy(dst + (t == KV_Q5_1 ? 4 : 2), &qh, 4);
        }
    }
}

static inline float dot_bf16_vec_dot(const uint16_t *w, const uint16_t *xb, const float *xf, long k);  /* below */
static inline float dot_bf16_tinyblas(const uint16_t *w, const uint16_t *xb, const float *xf, long k); /* below */

/* q in K's vec_dot type as ggml converts it for the scores: q8_0 blocks (codes qc, scales qd) for a q8_0 / q4_0 /
 * q5_0 / iq4_nl K, q8_1 (also the blocks' sums qs) for q4_1 / q5_1, bf16 bits qb for bf16 (and their values in qf
 * unless it is NULL); an f32 / f16 K takes q as it comes (rounded by the caller) */
static inline void kq_prepare(int k_type, const float *q, long D, int8_t *qc, float *qd, float *qs, uint16_t *qb, float *qf) {
    if (k_type == KV_Q8_0 || kv_blocked(k_type))
        sharpi_quantize_act(kv_has_min(k_type) ? GGML_TYPE_Q4_1 : GGML_TYPE_Q8_0, q, 1, D, qc, qd, qs, NULL);
    if (k_type == KV_BF16)
        for (long d = 0; d < D; d++) {
            qb[d] = bf16_bits(q[d]);
            if (qf) {
                const uint32_t u = (uint32_t)qb[d] << 16;
                memcpy(qf + d, &u, 4);
            }
        }
}

/* The score of cache row `row` (of width D) against q prepared by kq_prepare: K's vec_dot, as flash attention and a
 * one-row mul_mat compute it, or (tinyblas) llamafile's kernel of a prompt pass's mul_mat (the same arithmetic for
 * the quantized types but iq4_nl's single accumulator; q4_1 / q5_1 have none: vec_dot). qf: q's values (f32 / f16 K:
 * as the caller rounded them; bf16: its bf16 values). */
static inline float kq_dot(int k_type, const void *k, const uint16_t *kd, long row, long D, const int8_t *qc,
                           const float *qd, const float *qs, const uint16_t *qb, const float *qf, int tinyblas) {
    if (k_type == KV_Q8_0) return dot_q8_0((const int8_t *)k + row * D, kd + row * D / 32, qc, qd, D);
    if (kv_blocked(k_type))
        return dot_blocks(k_type, (const uint8_t *)k + row * (D / 32) * kv_block_bytes(k_type), qc, qd, qs, D, tinyblas);
    if (k_type == KV_BF16)
        return tinyblas ? dot_bf16_tinyblas((const uint16_t *)k + row * D, qb, qf, D)
                        : dot_bf16_vec_dot((const uint16_t *)k + row * D, qb, qf, D);
    /* (an f32 K meets q as ggml permuted it, not contiguous: mul_mat then takes vec_dot, not llamafile's kernel, which
     * only runs on the contiguous copy that converting q to an f16 K's vec_dot type makes) */
    return tinyblas && k_type != KV_F32 ? dot_tinyblas(k, kd, k_type, row, D, qf) : dot_vec_dot(k, kd, k_type, row, D, qf);
}

/* One chain of flash attention: one query row and head (q, KV head g) over cache positions [c0, c1)
 * but the hole [h0, h1) (those outside the row's visible range [lo, pos] and in its hole, other sequences'
 * cells, are masked: skipped, as ggml's one-chunk kernel skips a -inf mask). fa_chunks leaves in it the
 * running max m, the sum and the accumulator as fp32 in acc[Dv]. */
typedef struct {
    const float *q;
    long g, c0, c1, h0, h1;
    float m, sum;
    float *acc;
} fa_chain;

enum { FA_CHAINS = 4 }; /* chains run side by side by one thread */

/* ggml_compute_forward_flash_attn_ext_f16_one_chunk for nc <= FA_CHAINS chains at once. Each chain is
 * one (row, head)'s chunk exactly as ggml computes it alone: q is already in K's vec_dot type (fp16
 * values for an f16 K); online softmax position by position with libm's expf; an f16 V accumulates in
 * fp16 (each step rounded: ggml_vec_scale_f16 / ggml_vec_mad_f16), other V types in fp32. The chains
 * share nothing but the walk over positions: one chain's work never waits for another's, so the
 * core overlaps their latency-bound steps (the expf, the fp16 round trips), and each chain's
 * operations and their order are those of a chain computed alone (same bits). */
static inline __attribute__((always_inline)) void fa_chunks_of(fa_chain *ch, int nc, const void *k, const uint16_t *kd,
                                                               const int k_type, const void *v, const uint16_t *vd,
                                                               const int v_type, long Hkv, long D, long Dv, float scale,
                                                               float softcap) {
    /* q in K's vec_dot type as ggml converts it: q8_0 blocks for a q8_0 / q4_0 / q5_0 / iq4_nl K, q8_1 (with the
     * blocks' sums) for q4_1 / q5_1, bf16 for bf16 (the caller rounded q: its bits here) */
    int8_t qc[FA_CHAINS][512];
    float qd[FA_CHAINS][16], qs[FA_CHAINS][16];
    uint16_t acc16[FA_CHAINS][512], qb[FA_CHAINS][512];
    long first = ch[0].c0, last = ch[0].c1;
    for (int j = 0; j < nc; j++) {
        fa_chain *c = &ch[j];
        kq_prepare(k_type, c->q, D, qc[j], qd[j], qs[j], qb[j], NULL);
        c->m = -INFINITY;
        c->sum = 0.0f;
        for (long d = 0; d < Dv; d += 16) {
            _mm512_storeu_ps(c->acc + d, _mm512_setzero_ps());
            if (v_type == KV_F16) _mm256_storeu_si256((__m256i *)(acc16[j] + d), _mm256_setzero_si256());
        }
        first = c->c0 < first ? c->c0 : first;
        last = c->c1 > last ? c->c1 : last;
    }
    /* a V of a block type: each block's rows of each KV head the chains read decoded once into vbuf (the fp32
     * values load16 gives each chain), vslot[j] chain j's KV head's place there (q8_0's decoding, a multiply,
     * costs less than the copy) */
    const int vq = kv_blocked(v_type);
    int vslot[FA_CHAINS], ng = 0;
    long gs[FA_CHAINS], glo[FA_CHAINS], ghi[FA_CHAINS];
    for (int j = 0; vq && j < nc; j++) {
        int sl = 0;
        while (sl < ng && gs[sl] != ch[j].g) sl++;
        if (sl == ng) {
            gs[ng] = ch[j].g;
            glo[ng] = ch[j].c0;
            ghi[ng++] = ch[j].c1;
        }
        glo[sl] = ch[j].c0 < glo[sl] ? ch[j].c0 : glo[sl];
        ghi[sl] = ch[j].c1 > ghi[sl] ? ch[j].c1 : ghi[sl];
        vslot[j] = sl;
    }
    float *vbuf = vq ? malloc(sizeof(float) * (size_t)(ng * 16 * Dv)) : NULL;
    /* by blocks of 16 positions: each chain's scores and its running max first (they need no accumulator), the
     * exps of the block's 16 steps at once (expf16: libm's bits), then the accumulators position by position */
    for (long b0 = first; b0 < last; b0 += 16) {
        const long b1 = b0 + 16 < last ? b0 + 16 : last;
        float e[FA_CHAINS][16];
        uint32_t newmax[FA_CHAINS];
        for (int sl = 0; vbuf && sl < ng; sl++)
            for (long ic = glo[sl] > b0 ? glo[sl] : b0; ic < ghi[sl] && ic < b1; ic++)
                for (long d = 0; d < Dv; d += 16)
                    _mm512_storeu_ps(vbuf + ((long)sl * 16 + ic - b0) * Dv + d, load16(v, vd, v_type, ic * Hkv + gs[sl], Dv, d));
        for (int j = 0; j < nc; j++) {
            fa_chain *c = &ch[j];
            const long a = c->c0 > b0 ? c->c0 : b0, b = c->c1 < b1 ? c->c1 : b1;
            float x[16];
            uint32_t nm = 0;
            _mm512_storeu_ps(x, _mm512_setzero_ps());
            for (long ic = a; ic < b; ic++) {
                if (ic >= c->h0 && ic < c->h1) continue;
                const long row = ic * Hkv + c->g;
                float s = kq_dot(k_type, k, kd, row, D, qc[j], qd[j], qs[j], qb[j], c->q, 0) * scale;
                if (softcap != 0.0f) s = softcap * tanhf(s);
                s += 0.0f; /* the mask's 0 */
                if (s > c->m) { /* a new max: the accumulator and sum scale by expf(m - s), V's weight 1 */
                    x[ic - b0] = c->m - s;
                    c->m = s;
                    nm |= 1u << (ic - b0);
                } else { /* else V's weight expf(s - m) */
                    x[ic - b0] = s - c->m;
                }
            }
            newmax[j] = nm;
            if (a < b) expf16(x, e[j]);
        }
        for (long ic = b0; ic < b1; ic++) {
            for (int j = 0; j < nc; j++) {
                fa_chain *c = &ch[j];
                if (ic < c->c0 || ic >= c->c1 || (ic >= c->h0 && ic < c->h1)) continue;
                const long row = ic * Hkv + c->g;
                const int new_max = (newmax[j] >> (ic - b0)) & 1;
                const float ms = new_max ? e[j][ic - b0] : 1.0f, vs = new_max ? 1.0f : e[j][ic - b0];
                for (long d = 0; d < Dv; d += 16) {
                    if (v_type == KV_F16) {
                        __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(acc16[j] + d)));
                        if (new_max) a = _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(a, _mm512_set1_ps(ms)), _MM_FROUND_TO_NEAREST_INT));
                        a = _mm512_fmadd_ps(load16(v, vd, v_type, row, Dv, d), _mm512_set1_ps(vs), a);
                        _mm256_storeu_si256((__m256i *)(acc16[j] + d), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
                    } else {
                        __m512 a = _mm512_loadu_ps(c->acc + d);
                        if (new_max) a = _mm512_mul_ps(a, _mm512_set1_ps(ms));
                        const __m512 vv = vbuf ? _mm512_loadu_ps(vbuf + ((long)vslot[j] * 16 + ic - b0) * Dv + d) : load16(v, vd, v_type, row, Dv, d);
                        _mm512_storeu_ps(c->acc + d, _mm512_fmadd_ps(vv, _mm512_set1_ps(vs), a));
                    }
                }
                c->sum = fmaf(c->sum, ms, vs);
            }
        }
    }
    free(vbuf);
    if (v_type == KV_F16)
        for (int j = 0; j < nc; j++)
            for (long d = 0; d < Dv; d += 16)
                _mm512_storeu_ps(ch[j].acc + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(acc16[j] + d))));
}

/* fa_chunks_of compiled for f16 K and V (the default cache) and for q8_0 K and V apart from the other types, so that
 * no type's code depends on another's */
static void fa_chunks(fa_chain *ch, int nc, const void *k, const uint16_t *kd, int k_type, const void *v,
                      const uint16_t *vd, int v_type, long Hkv, long D, long Dv, float scale, float softcap) {
    if (k_type == KV_F16 && v_type == KV_F16)
        fa_chunks_of(ch, nc, k, kd, KV_F16, v, vd, KV_F16, Hkv, D, Dv, scale, softcap);
    else if (k_type == KV_Q8_0 && v_type == KV_Q8_0)
        fa_chunks_of(ch, nc, k, kd, KV_Q8_0, v, vd, KV_Q8_0, Hkv, D, Dv, scale, softcap);
    else
        fa_chunks_of(ch, nc, k, kd, k_type, v, vd, v_type, Hkv, D, Dv, scale, softcap);
}

/* A flash-attention row task: query row q (K's vec_dot type), KV head g, visible positions [lo, pos] but
 * the hole [h0, h1), n_kv llama.cpp's KV length for it (FA_DECODE; 0: one chunk, FA_PROMPT), output row
 * out[Dv], sink its head's attention sink logit (NULL: none). */
typedef struct {
    const float *q;
    long g, lo, pos, h0, h1, n_kv;
    float *out;
    const float *sink;
} fa_row;

/* An attention sink (gpt-oss): one more logit s in the softmax's denominator, with no value. ggml adds it
 * to the first KV chunk's state once its positions are done (the accumulator in fp32 then): a new max
 * rescales the accumulator and the sum by expf(m - s), else the sum gains expf(s - m). S * ms + vs: a
 * multiply, then an add in the one-chunk kernel, one FMA in the tiled one (fused), as GCC compiled them
 * (read from the fixtures' build: libllama's logits match so, bit for bit). */
static void fa_sink(float s, float *m, float *sum, float *acc, long Dv, int fused) {
    float ms = 1.0f, vs = 1.0f;
    if (s > *m) {
        ms = expf(*m - s);
        *m = s;
        for (long d = 0; d < Dv; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(ms)));
    } else {
        vs = expf(s - *m);
    }
    *sum = fused ? fmaf(*sum, ms, vs) : *sum * ms + vs;
}

/* Flash attention of nr <= FA_CHAINS rows, each as llama.cpp computes it alone. A decoding row (its
 * one-row pass) whose KV length n_kv (positions padded to 256, at most the cache size) reaches 512
 * has its KV range split into one chunk per thread (2 here, as the fixtures were made) and the
 * chunks' (max, sum, accumulator) merged with expf rescaling (ggml_flash_attn_ext_reduce_partials);
 * other rows are one chunk. The rows' chunks run as chains of one fa_chunks call per chunk index. */
static void fa_rows(const fa_row *rows, int nr, const void *k, const uint16_t *kd, int k_type, const void *v,
                    const uint16_t *vd, int v_type, long Hkv, long D, long Dv, float scale, float softcap) {
    float part[FA_SPLIT_THREADS][FA_CHAINS][512], acc[FA_CHAINS][512], m[FA_CHAINS], sum[FA_CHAINS];
    int split[FA_CHAINS], any_split = 0;
    for (int j = 0; j < nr; j++) {
        split[j] = rows[j].n_kv >= FA_SPLIT_MIN_KV && k_type <= KV_F16 && k_type == v_type; /* f32 / f16 only */
        any_split |= split[j];
        if (split[j]) { /* the merged state before its first chunk */
            m[j] = -INFINITY;
            sum[j] = 0.0f;
            for (long d = 0; d < Dv; d++) acc[j][d] = 0.0f;
        }
    }
    for (long c = 0; c < (any_split ? FA_SPLIT_THREADS : 1); c++) {
        fa_chain ch[FA_CHAINS];
        int idx[FA_CHAINS], nc = 0;
        for (int j = 0; j < nr; j++) {
            const fa_row *r = &rows[j];
            long a = r->lo, b = r->pos + 1;
            if (split[j]) {
                const long cs = (r->n_kv + FA_SPLIT_THREADS - 1) / FA_SPLIT_THREADS;
                a = c * cs > r->lo ? c * cs : r->lo;
                b = (c + 1) * cs < r->pos + 1 ? (c + 1) * cs : r->pos + 1;
                if (a >= b && !(c == 0 && r->sink)) continue; /* no visible position: S = 0, skipped */
                if (a > b) a = b; /* (the first chunk with a sink: empty, then the sink alone) */
            } else if (c > 0) {
                continue;
            }
            ch[nc] = (fa_chain){r->q, r->g, a, b, r->h0, r->h1, 0.0f, 0.0f, split[j] ? part[c][j] : acc[j]};
            idx[nc++] = j;
        }
        if (nc) fa_chunks(ch, nc, k, kd, k_type, v, vd, v_type, Hkv, D, Dv, scale, softcap);
        for (int i = 0; i < nc; i++) {
            const int j = idx[i];
            if (c == 0 && rows[j].sink) fa_sink(*rows[j].sink, &ch[i].m, &ch[i].sum, ch[i].acc, Dv, 0);
            if (!split[j]) {
                m[j] = ch[i].m;
                sum[j] = ch[i].sum;
                continue;
            }
            if (ch[i].sum == 0.0f) continue;
            const float mn = fmaxf(m[j], ch[i].m), so = expf(m[j] - mn), sn = expf(ch[i].m - mn);
            for (long d = 0; d < Dv; d++) acc[j][d] = fmaf(acc[j][d], so, part[c][j][d] * sn);
            sum[j] = fmaf(sum[j], so, ch[i].sum * sn);
            m[j] = mn;
        }
    }
    for (int j = 0; j < nr; j++) {
        const float inv = sum[j] == 0.0f ? 0.0f : 1.0f / sum[j];
        for (long d = 0; d < Dv; d += 16)
            _mm512_storeu_ps(rows[j].out + d, _mm512_mul_ps(_mm512_loadu_ps(acc[j] + d), _mm512_set1_ps(inv)));
    }
}

/* Flash attention of a pass of >= 64 query rows: ggml_compute_forward_flash_attn_ext_tiled, each (row, head)
 * as it computes it. KV tiles of 64 positions from 0; scores as its simd_gemm computes them (one fp32 FMA
 * chain over the head dims, q in fp32), scaled, masked to -inf; per tile the max, an expf rescale when it
 * grows, the tile's exps summed by ggml_vec_soft_max_f32 (groups of 16) into the float sum, and the fp32
 * accumulator gains the tile's probabilities times V, one FMA per position in order (a masked position's
 * probability is 0: an FMA that changes nothing, as in ggml's simd_gemm over the whole tile). kt: this KV
 * head's K as fp32, transposed: kt[d * ldk + position] (ggml packs each tile so too).
 *
 * FA_TC (row, head) pairs of one KV head run together, as simd_gemm runs its rows: each K load serves
 * every pair's score chain and each V load every pair's accumulator (GQA heads of one row, or rows of
 * one head), so that the loads and the FMA latency are shared while each pair keeps its own operations
 * in its own order (Qwen 1.5B's attention 1024 positions deep, 128 rows: 13.3 ms a layer before, one
 * pair at a time). */
#ifdef SHARPI_AVX512_EMULATED
enum { FA_TC = 2, FA_SK = 2, FA_PVJ = 2 }; /* 256-bit halves: the blocks below fit 16 ymm registers */
#else
enum { FA_TC = 4, FA_SK = 4, FA_PVJ = 4 }; /* pairs, 16-position score chunks, 16-dim V chunks per block */
#endif

typedef struct {
    const float *q;    /* [D] fp32 */
    long lo, pos;      /* visible positions */
    long h0, h1;       /* but these: [h0, h1) (other sequences' cells; empty: h0 = h1) */
    const float *sink; /* or NULL */
    float *out;        /* [Dv] */
} fa_trow;

/* p[c][i] = the raw score of pair c at position t0 + i, for FA_SK chunks of 16 positions from chunk k0 */
static inline __attribute__((always_inline)) void fa_scores(const float *const *q, const float *kt, long ldk, long t0,
                                                            int k0, long D, float (*p)[FA_TILE_KV]) {
    __m512 s[FA_TC][FA_SK];
    for (int c = 0; c < FA_TC; c++)
        for (int i = 0; i < FA_SK; i++) s[c][i] = _mm512_setzero_ps();
    const float *kp = kt + t0 + 16 * k0;
    for (long d = 0; d < D; d++, kp += ldk) {
        __m512 kv[FA_SK];
        for (int i = 0; i < FA_SK; i++) kv[i] = _mm512_loadu_ps(kp + 16 * i);
        for (int c = 0; c < FA_TC; c++) {
            const __m512 qb = _mm512_set1_ps(q[c][d]);
            for (int i = 0; i < FA_SK; i++) s[c][i] = _mm512_fmadd_ps(kv[i], qb, s[c][i]);
        }
    }
    for (int c = 0; c < FA_TC; c++)
        for (int i = 0; i < FA_SK; i++) _mm512_storeu_ps(p[c] + 16 * (k0 + i), s[c][i]);
}

/* acc[c][d0 .. d0 + 16 nj) += sum over positions t0 + [i0, i1] of p[c][i] V[position][d], in position order */
static inline __attribute__((always_inline)) void fa_pv(float (*acc)[512], const float (*p)[FA_TILE_KV], const void *v,
                                                        const int f16, long Hkv, long g, long Dv, long t0, long i0,
                                                        long i1, long d0, const int nj) {
    __m512 a[FA_TC][FA_PVJ];
    for (int c = 0; c < FA_TC; c++)
        for (int j = 0; j < nj; j++) a[c][j] = _mm512_loadu_ps(acc[c] + d0 + 16 * j);
    for (long i = i0; i <= i1; i++) {
        const long off = ((t0 + i) * Hkv + g) * Dv + d0;
        __m512 vv[FA_PVJ];
        for (int j = 0; j < nj; j++)
            vv[j] = f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + off + 16 * j)))
                        : _mm512_loadu_ps((const float *)v + off + 16 * j);
        for (int c = 0; c < FA_TC; c++) {
            const __m512 pb = _mm512_set1_ps(p[c][i]);
            for (int j = 0; j < nj; j++) a[c][j] = _mm512_fmadd_ps(vv[j], pb, a[c][j]);
        }
    }
    for (int c = 0; c < FA_TC; c++)
        for (int j = 0; j < nj; j++) _mm512_storeu_ps(acc[c] + d0 + 16 * j, a[c][j]);
}

static inline __attribute__((always_inline)) void fa_pv_all(float (*acc)[512], const float (*p)[FA_TILE_KV], const void *v,
                                                            const int f16, long Hkv, long g, long Dv, long t0, long i0, long i1) {
    long d0 = 0;
    for (; d0 + 16 * FA_PVJ <= Dv; d0 += 16 * FA_PVJ) fa_pv(acc, p, v, f16, Hkv, g, Dv, t0, i0, i1, d0, FA_PVJ);
    for (; d0 < Dv; d0 += 16) fa_pv(acc, p, v, f16, Hkv, g, Dv, t0, i0, i1, d0, 1);
}

/* the bits of the 16 positions c0 + [0, 16) that lie in [a, b) */
static inline __mmask16 cells16(long c0, long a, long b) {
    a = a < c0 ? c0 : a;
    b = b > c0 + 16 ? c0 + 16 : b;
    return a >= b ? 0 : (__mmask16)((((1u << (b - c0)) - 1) >> (a - c0)) << (a - c0));
}

/* nc <= FA_TC pairs of KV head g (their unused places compute the first pair's scores again, unread) */
static void fa_tiled_rows(const fa_trow *r, int nc, const float *kt, long ldk, const void *v, int v_f16, long Hkv,
                          long g, long D, long Dv, float scale, float softcap) {
    float acc[FA_TC][512], p[FA_TC][FA_TILE_KV], m[FA_TC], sum[FA_TC];
    const float *q[FA_TC];
    long lo = r[0].lo, hi = r[0].pos;
    for (int c = 0; c < FA_TC; c++) {
        q[c] = r[c < nc ? c : 0].q;
        m[c] = -INFINITY;
        sum[c] = 0.0f;
        for (long d = 0; d < Dv; d += 16) _mm512_storeu_ps(acc[c] + d, _mm512_setzero_ps());
        if (c < nc) {
            lo = r[c].lo < lo ? r[c].lo : lo;
            hi = r[c].pos > hi ? r[c].pos : hi;
        }
    }
    for (long t0 = lo / FA_TILE_KV * FA_TILE_KV; t0 <= hi; t0 += FA_TILE_KV) {
        for (int k0 = 0; k0 < FA_TILE_KV / 16; k0 += FA_SK) fa_scores(q, kt, ldk, t0, k0, D, p);
        for (int c = 0; c < FA_TC; c++) {
            float tmax = -INFINITY;
            for (int i = 0; c < nc && i < FA_TILE_KV; i += 16) {
                const long c0 = t0 + i;
                const __mmask16 vis = cells16(c0, r[c].lo, r[c].pos + 1) & (__mmask16)~cells16(c0, r[c].h0, r[c].h1);
                if (!vis) {
                    _mm512_storeu_ps(p[c] + i, _mm512_set1_ps(-INFINITY));
                    continue;
                }
                __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(p[c] + i), _mm512_set1_ps(scale));
                if (softcap != 0.0f) { /* ggml_vec_tanh_f32 (libm's tanhf, element by element), then times the cap */
                    float t[16];
                    _mm512_storeu_ps(t, sc);
                    for (int u = 0; u < 16; u++) t[u] = tanhf(t[u]);
                    sc = _mm512_mul_ps(_mm512_loadu_ps(t), _mm512_set1_ps(softcap));
                }
                sc = _mm512_add_ps(sc, _mm512_setzero_ps()); /* + the mask's 0 */
                sc = _mm512_mask_blend_ps(vis, _mm512_set1_ps(-INFINITY), sc);
                _mm512_storeu_ps(p[c] + i, sc);
                const float mx = _mm512_reduce_max_ps(sc);
                tmax = mx > tmax ? mx : tmax;
            }
            if (tmax == -INFINITY) { /* nothing visible in this tile (or an unused place): no change */
                for (int i = 0; i < FA_TILE_KV; i += 16) _mm512_storeu_ps(p[c] + i, _mm512_setzero_ps());
                continue;
            }
            const float mn = fmaxf(m[c], tmax);
            if (mn > m[c]) {
                const float ms = expf(m[c] - mn);
                for (long d = 0; d < Dv; d += 16)
                    _mm512_storeu_ps(acc[c] + d, _mm512_mul_ps(_mm512_loadu_ps(acc[c] + d), _mm512_set1_ps(ms)));
                sum[c] *= ms;
            }
            m[c] = mn;
            double ts = 0.0;
            for (int i = 0; i < FA_TILE_KV; i += 16) {
                const __m512 e = ggml_expf16(_mm512_sub_ps(_mm512_loadu_ps(p[c] + i), _mm512_set1_ps(mn)));
                _mm512_storeu_ps(p[c] + i, e);
                ts += (double)reduce16(e);
            }
            sum[c] = (float)((double)sum[c] + ts);
        }
        /* the positions any pair sees (within the cache's written rows) */
        const long i0 = (lo > t0 ? lo : t0) - t0, i1 = (hi < t0 + FA_TILE_KV - 1 ? hi : t0 + FA_TILE_KV - 1) - t0;
        if (v_f16) fa_pv_all(acc, (const float(*)[FA_TILE_KV])p, v, 1, Hkv, g, Dv, t0, i0, i1);
        else fa_pv_all(acc, (const float(*)[FA_TILE_KV])p, v, 0, Hkv, g, Dv, t0, i0, i1);
    }
    for (int c = 0; c < nc; c++) {
        if (r[c].sink) fa_sink(*r[c].sink, &m[c], &sum[c], acc[c], Dv, 1);
        const float inv = sum[c] == 0.0f ? 0.0f : 1.0f / sum[c];
        for (long d = 0; d < Dv; d += 16)
            _mm512_storeu_ps(r[c].out + d, _mm512_mul_ps(_mm512_loadu_ps(acc[c] + d), _mm512_set1_ps(inv)));
    }
}

void sharpi_softcap(float *x, long n, float cap) {
    const float inv = 1.0f / cap;
    for (long i = 0; i < n; i++) x[i] = tanhf(x[i] * inv) * cap;
}

/* 16 bf16 values as fp32 (exact: the high half of each float) */
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* ggml_vec_dot_bf16 (w a bf16 row, xb the activations as bf16, xf the same as fp32): with AVX512-BF16 (and
 * on AVX2, whose x86simd.h computes vdpbf16ps exactly: the fixtures' build had it) two dpbf16 accumulators
 * over 64 a step, without it two 16-lane accumulators of mul-then-add over 32 a step;
 * each accumulator's _mm512_reduce_add_ps added in double, then the rest one by one in double */
static inline float dot_bf16_vec_dot(const uint16_t *w, const uint16_t *xb, const float *xf, long k) {
    long i = 0;
    double sd = 0;
#if defined(__AVX512BF16__) || defined(SHARPI_AVX512_EMULATED)
    __m512 c1 = _mm512_setzero_ps(), c2 = c1;
    for (; i + 64 <= k; i += 64) {
        c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(xb + i));
        c2 = _mm512_dpbf16_ps(c2, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(xb + i + 32));
    }
#else
    (void)xb;
    __m512 c1 = _mm512_setzero_ps(), c2 = c1;
    for (; i + 32 <= k; i += 32) {
        c1 = _mm512_add_ps(_mm512_mul_ps(bf16x16(w + i), _mm512_loadu_ps(xf + i)), c1);
        c2 = _mm512_add_ps(_mm512_mul_ps(bf16x16(w + i + 16), _mm512_loadu_ps(xf + i + 16)), c2);
    }
#endif
    sd += (double)reduce16(c1);
    sd += (double)reduce16(c2);
    for (; i < k; i++) {
        float wi;
        const uint32_t b = (uint32_t)w[i] << 16;
        memcpy(&wi, &b, 4);
        sd += (double)(wi * xf[i]);
    }
    return (float)sd;
}

/* tinyBLAS's bf16 dot product: one accumulator, dpbf16 over 32 a step with AVX512-BF16, else FMAs of 16 */
static inline float dot_bf16_tinyblas(const uint16_t *w, const uint16_t *xb, const float *xf, long k) {
    __m512 acc = _mm512_setzero_ps();
#if defined(__AVX512BF16__) || defined(SHARPI_AVX512_EMULATED)
    (void)xf;
    for (long d = 0; d < k; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + d), (__m512bh)_mm512_loadu_si512(xb + d));
#else
    (void)xb;
    for (long d = 0; d < k; d += 16) acc = _mm512_fmadd_ps(bf16x16(w + d), _mm512_loadu_ps(xf + d), acc);
#endif
    return reduce16(acc);
}

/* reduce16 of 16 vectors at once: lane l of the result is reduce16 of the vector (y[0][l], ..., y[15][l]) */
static inline __m512 reduce16_lanes(const __m512 *y) {
    __m512 t3[8];
    for (int i = 0; i < 8; i++) t3[i] = _mm512_add_ps(y[8 + i], y[i]);
    const __m512 t60 = _mm512_add_ps(t3[4], t3[0]), t61 = _mm512_add_ps(t3[5], t3[1]);
    const __m512 t62 = _mm512_add_ps(t3[6], t3[2]), t63 = _mm512_add_ps(t3[7], t3[3]);
    return _mm512_add_ps(_mm512_add_ps(t60, t62), _mm512_add_ps(t61, t63));
}

/* P V for one (row, head) against a bf16 V without V's transposed copy: o[d] = dot_bf16_vec_dot (vec_dot) or
 * dot_bf16_tinyblas of V's column d over positions [i0, i0 + len) (len a multiple of 64, V taken as 0 from
 * position `last` on, as the copy holds it) with pb / pf (the probabilities, index position - i0), the same
 * operations: each accumulator lane of those dot products is here a vector of 16 output elements, fed one
 * position (with vdpbf16ps, a pair: V's rows p and p + 1 interleaved as its lanes' bf16 pairs) at a time,
 * then the lanes' reduce16 as reduce16_lanes. A decoding row costs its positions once instead of the whole
 * cache's transposition. */
static void pv_bf16_rows(const uint16_t *v, long Hkv, long g, long Dv, const uint16_t *pb, const float *pf,
                         long i0, long len, long last, int vec_dot, float *o) {
    const __m256i z = _mm256_setzero_si256();
    for (long d0 = 0; d0 < Dv; d0 += 16) {
        __m512 a[32];
        for (int r = 0; r < 32; r++) a[r] = _mm512_setzero_ps();
#if defined(__AVX512BF16__) || defined(SHARPI_AVX512_EMULATED)
        (void)pf;
        const long lanes = vec_dot ? 63 : 31; /* c1 / c2's lanes over 64 positions, or tinyBLAS's over 32 */
        for (long j = 0; j < len; j += 2) {
            const long p = i0 + j;
            const __m256i r0 = p < last ? _mm256_loadu_si256((const __m256i *)(v + (p * Hkv + g) * Dv + d0)) : z;
            const __m256i r1 = p + 1 < last ? _mm256_loadu_si256((const __m256i *)(v + ((p + 1) * Hkv + g) * Dv + d0)) : z;
            const __m512i x = _mm512_xor_si512(_mm512_cvtepu16_epi32(r0), _mm512_slli_epi32(_mm512_cvtepu16_epi32(r1), 16));
            const __m512i w = _mm512_set1_epi32((int)((uint32_t)pb[j] | (uint32_t)pb[j + 1] << 16));
            const int r = (int)((j & lanes) >> 1);
            a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)x, (__m512bh)w);
        }
#else
        (void)pb;
        const long lanes = vec_dot ? 31 : 15; /* c1 / c2's lanes over 32 positions, or tinyBLAS's over 16 */
        for (long j = 0; j < len; j++) {
            const long p = i0 + j;
            const __m512 x = p < last ? bf16x16(v + (p * Hkv + g) * Dv + d0) : _mm512_setzero_ps();
            const int r = (int)(j & lanes);
            a[r] = vec_dot ? _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(pf[j])), a[r])
                           : _mm512_fmadd_ps(x, _mm512_set1_ps(pf[j]), a[r]);
        }
#endif
        const __m512 r1 = reduce16_lanes(a);
        if (!vec_dot) {
            _mm512_storeu_ps(o + d0, r1);
            continue;
        }
        float c1[16], c2[16];
        _mm512_storeu_ps(c1, r1);
        _mm512_storeu_ps(c2, reduce16_lanes(a + 16));
        for (int l = 0; l < 16; l++) o[d0 + l] = (float)((double)c1[l] + (double)c2[l]);
    }
}

/* Rows [n0, n1) of y[T, ldy] = x[T, ldx] w[n, k]^T for an f32 (type 0), f16 (1) or bf16 (2) weight (x then
 * holds the activations rounded to fp16 / bf16, as ggml converts them to the weight's vec_dot type, and for
 * bf16 xb [T, k] the same as bf16 codes), k a multiple of 64 for f32 and of 32 otherwise, in ggml's mul_mat
 * order: one-row passes (and verify rows) through ggml_vec_dot_f32 / _f16 / _bf16, prompt passes of T >= 2
 * (tiny) through tinyBLAS, in tiles of 4 rows x 4 tokens (16 independent accumulators, each output in the
 * single dot product's order; the rows and tokens past the tiles one by one). qmatmul.c calls it for its
 * F32 / F16 / BF16 weights, a chunk of rows per thread. */
void sharpi_float_rows(const void *w, int wtype, long n0, long n1, long k, const float *x, const uint16_t *xb, long ldx,
                       long T, float *y, long ldy, int tiny) {
    const int type = wtype == 1 ? KV_F16 : KV_F32;
    const uint16_t *wb = w;
    const long T4 = tiny ? T - T % 4 : 0;
    long r0 = n0;
    if (tiny)
        for (; r0 + 4 <= n1; r0 += 4)
            for (long t = 0; t < T4; t += 4) {
                __m512 a[4][4];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
                if (wtype != 2)
                    for (long d = 0; d < k; d += 16) {
                        __m512 xv[4];
                        for (int j = 0; j < 4; j++) xv[j] = _mm512_loadu_ps(x + (t + j) * ldx + d);
                        for (int i = 0; i < 4; i++) {
                            const __m512 wv = load16(w, NULL, type, r0 + i, k, d);
                            for (int j = 0; j < 4; j++) a[i][j] = _mm512_fmadd_ps(wv, xv[j], a[i][j]);
                        }
                    }
                else
#if defined(__AVX512BF16__) || defined(SHARPI_AVX512_EMULATED)
                    for (long d = 0; d < k; d += 32) {
                        __m512bh xv[4];
                        for (int j = 0; j < 4; j++) xv[j] = (__m512bh)_mm512_loadu_si512(xb + (t + j) * k + d);
                        for (int i = 0; i < 4; i++) {
                            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + (r0 + i) * k + d);
                            for (int j = 0; j < 4; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], wv, xv[j]);
                        }
                    }
#else
                    for (long d = 0; d < k; d += 16) {
                        __m512 xv[4];
                        for (int j = 0; j < 4; j++) xv[j] = _mm512_loadu_ps(x + (t + j) * ldx + d);
                        for (int i = 0; i < 4; i++) {
                            const __m512 wv = bf16x16(wb + (r0 + i) * k + d);
                            for (int j = 0; j < 4; j++) a[i][j] = _mm512_fmadd_ps(wv, xv[j], a[i][j]);
                        }
                    }
#endif
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) y[(t + j) * ldy + r0 + i] = reduce16(a[i][j]);
            }
    for (long r = n0; r < n1; r++)
        for (long t = r < r0 ? T4 : 0; t < T; t++) {
            const float *xr = x + t * ldx;
            y[t * ldy + r] = wtype == 2 ? (tiny ? dot_bf16_tinyblas(wb + r * k, xb + t * k, xr, k)
                                                : dot_bf16_vec_dot(wb + r * k, xb + t * k, xr, k))
                             : tiny ? dot_tinyblas(w, NULL, type, r, k, xr) : dot_vec_dot(w, NULL, type, r, k, xr);
        }
}

/* y[T, n] = x[T, k] w[n, k]^T for an f16 weight of any width k (a LoRA adapter's small factors), x already
 * rounded to fp16 (as floats), in ggml's mul_mat order: llamafile's tinyBLAS where it takes the pass (tiny:
 * a prompt pass of T >= 2; and k % 16 == 0, n % 4 == 0), else ggml_vec_dot_f16 (4 accumulators over 64
 * elements a step, reduced, then the elements past the multiple of 64 added one by one in double). */
void sharpi_f16_mm(const uint16_t *w, long n, long k, const float *x, long T, float *y, int tiny) {
    const long np = k & ~63L;
    tiny = tiny && T >= 2 && k % 16 == 0 && n % 4 == 0;
    for (long t = 0; t < T; t++)
        for (long r = 0; r < n; r++) {
            const uint16_t *wr = w + r * k;
            const float *xr = x + t * k;
            if (tiny) {
                __m512 acc = _mm512_setzero_ps();
                for (long d = 0; d < k; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wr + d))),
                                          _mm512_loadu_ps(xr + d), acc);
                y[t * n + r] = reduce16(acc);
                continue;
            }
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (long d = 0; d < np; d += 64)
                for (int u = 0; u < 4; u++)
                    acc[u] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wr + d + 16 * u))),
                                             _mm512_loadu_ps(xr + d + 16 * u), acc[u]);
            double sd = reduce16(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
            for (long d = np; d < k; d++) sd += (double)(_cvtsh_ss(wr[d]) * xr[d]);
            y[t * n + r] = (float)sd;
        }
}

void sharpi_short_conv(const float *ext, const float *w, float *out, long T, long D, int width) {
    for (long t = 0; t < T; t++)
        for (long c = 0; c < D; c++) {
            float sum = 0.0f;
            for (int j = 0; j < width; j++) sum = fmaf(ext[(t + j) * D + c], w[c * width + j], sum);
            out[t * D + c] = sum;
        }
}

void sharpi_soft_max(float *x, long T, long n) {
    for (long t = 0; t < T; t++) {
        float *r = x + t * n;
        float mx = -INFINITY;
        for (long i = 0; i < n; i++) mx = mx > r[i] ? mx : r[i]; /* ggml_vec_max_f32's MAX */
        double sum = 0.0;
        long i = 0;
        for (; i + 15 < n; i += 16) {
            const __m512 e = ggml_expf16(_mm512_sub_ps(_mm512_loadu_ps(r + i), _mm512_set1_ps(mx)));
            _mm512_storeu_ps(r + i, e);
            sum += (double)reduce16(e);
        }
        for (; i < n; i++) {
            const float e = expf(r[i] - mx);
            sum += (double)e;
            r[i] = e;
        }
        const float inv = (float)(1.0 / sum);
        for (i = 0; i < n; i++) r[i] *= inv;
    }
}

/* Mixture-of-experts routing as llama.cpp's build_moe_ffn: logits [T, n_exp] (the router's; plus bias [n_exp]
 * when given, ggml_add) -> ids [T, k] and weights w [T, k]. gating 0 (softmax): sharpi_soft_max over all experts,
 * the k most probable in descending order (ties: the lower index first, as a stable sort), with norm (norm_w) each
 * over their sum (added in order in double, ggml_vec_sum_f32) clamped below at 2^-14, without it (qwen2moe) as they
 * are; gating 1 (softmax_weight, gpt-oss): the k largest logits, sharpi_soft_max over those. logits is overwritten. */
void sharpi_moe_route(float *logits, long T, long n_exp, int k, int gating, int norm, const float *bias, int32_t *ids,
                      float *w) {
    for (long t = 0; t < T; t++) {
        float *r = logits + t * n_exp, *wt = w + t * k;
        int32_t *it = ids + t * k;
        if (bias)
            for (long e = 0; e < n_exp; e++) r[e] += bias[e];
        if (gating == 0) sharpi_soft_max(r, 1, n_exp);
        for (int j = 0; j < k; j++) {
            long best = -1;
            for (long e = 0; e < n_exp; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= it[i] == e;
                if (!taken && (best < 0 || r[e] > r[best])) best = e;
            }
            it[j] = (int32_t)best;
            wt[j] = r[best];
        }
        if (gating == 0 && norm) {
            double sum = wt[0];
            for (int j = 1; j < k; j++) sum += (double)wt[j];
            float s = (float)sum;
            s = s < 6.103515625e-5f ? 6.103515625e-5f : s;
            for (int j = 0; j < k; j++) wt[j] = wt[j] / s;
        } else if (gating == 1) {
            sharpi_soft_max(wt, 1, k);
        }
    }
}

/* y [T, D] = the sum over j of d[t, j] * w[t, j] for d [T, k, D]: each product rounded, then added in j order
 * (build_moe_ffn: ggml_mul by the weights, the experts' views added one by one) */
void sharpi_moe_sum(const float *d, const float *w, long T, int k, long D, float *y) {
    for (long t = 0; t < T; t++)
        for (long i = 0; i < D; i++) {
            float acc = d[(t * k) * D + i] * w[t * k];
            for (int j = 1; j < k; j++) {
                const float pj = d[(t * k + j) * D + i] * w[t * k + j];
                acc = acc + pj;
            }
            y[t * D + i] = acc;
        }
}

/* y[t, :] += sh[t, :] * sigmoid(gx[t]) for y, sh [T, D]: qwen2moe's shared expert, its gate as that graph computes
 * it on a [1, T] tensor: ggml_silu one element per row (ggml_silu_f32, libm's expf), divided by gx; the product
 * rounded, then added */
void sharpi_shexp_add(const float *gx, const float *sh, long T, long D, float *y, int plain) {
    for (long t = 0; t < T; t++) {
        /* qwen2moe: ggml_silu(x) / x; qwen35moe: ggml_sigmoid (1 / (1 + expf(-x))) */
        const float x = gx[t], gate = plain ? 1.0f / (1.0f + expf(-x)) : x / (1.0f + expf(-x)) / x;
        for (long i = 0; i < D; i++) {
            const float p = sh[t * D + i] * gate;
            y[t * D + i] = y[t * D + i] + p;
        }
    }
}

/* ggml_vec_dot_f32 of an AVX-512 build on two float rows (dot_vec_dot's float case; n % 64 == 0 past the
 * vectors: the rest added in double, which only float rows of other lengths reach) */
static inline float vec_dot_f32(const float *a, const float *b, long n) {
    return dot_vec_dot(a, NULL, KV_F32, 0, n, b);
}

void sharpi_gdn(const float *q, const float *k, const float *v, const float *g, const float *beta, float *ring,
                long R, long slot0, float *out, long T, long Hv, long Hk, long S, int nthreads) {
    const float scale = 1.0f / sqrtf((float)S);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && Hv > 1)
    for (long h = 0; h < Hv; h++) {
        float *delta = malloc(S * sizeof(float));
        const long hk = h % Hk;
        for (long t = 0; t < T; t++) {
            const float *src = ring + (((slot0 + t) % R) * Hv + h) * S * S;
            float *st = ring + (((slot0 + t + 1) % R) * Hv + h) * S * S;
            const float eg = expf(g[t * Hv + h]), b = beta[t * Hv + h];
            const float *kt = k + (t * Hk + hk) * S, *qt = q + (t * Hk + hk) * S, *vt = v + (t * Hv + h) * S;
            for (long i = 0; i < S * S; i++) st[i] = src[i] * eg; /* ggml_vec_scale_f32 */
            for (long j = 0; j < S; j++) delta[j] = (vt[j] - vec_dot_f32(st + j * S, kt, S)) * b;
            for (long j = 0; j < S; j++) { /* ggml_vec_mad_f32: y = fma(x, v, y) */
                float *row = st + j * S;
                const float dj = delta[j];
                for (long i = 0; i < S; i++) row[i] = fmaf(kt[i], dj, row[i]);
            }
            for (long j = 0; j < S; j++) out[(t * Hv + h) * S + j] = vec_dot_f32(st + j * S, qt, S) * scale;
        }
        free(delta);
    }
}

void sharpi_gdn_gates(float *alpha, float *beta, const float *dt, const float *a, long T, long Hv) {
    for (long t = 0; t < T; t++)
        for (long h = 0; h < Hv; h++) {
            const float x = alpha[t * Hv + h] + dt[h];
            const float sp = x > 20.0f ? x : logf(1.0f + expf(x));
            alpha[t * Hv + h] = sp * a[h];
            beta[t * Hv + h] = 1.0f / (1.0f + expf(-beta[t * Hv + h]));
        }
}

void sharpi_sigmoid(float *x, long n) {
    for (long i = 0; i < n; i++) x[i] = 1.0f / (1.0f + expf(-x[i]));
}

static float gelu_table[65536]; /* ggml_table_gelu_f16, as fp32 values of its fp16 entries */
static int gelu_ready;

static void gelu_init(void) {
    for (int i = 0; i < 65536; i++) {
        const float x = _cvtsh_ss((unsigned short)i);
        /* ggml_gelu_f32 as gcc contracts it by default (-ffp-contract=fast): the inner a*x*x + 1 is one fma */
        const float y = 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * fmaf(0.044715f * x, x, 1.0f)));
        gelu_table[i] = _cvtsh_ss(_cvtss_sh(y, _MM_FROUND_TO_NEAREST_INT));
    }
    __atomic_store_n(&gelu_ready, 1, __ATOMIC_RELEASE);
}

/* y[t, i] = act(gu[t, i]) * gu[t, n + i] for T rows of gu [T, 2n]; act 0: silu, 1: gelu (tanh), 2: gpt-oss's
 * SwiGLU-OAI as ggml_swiglu_oai computes it (alpha 1.702, limit 7: x = min(g, 7), element by element
 * x / (1 + expf(alpha * -x)) with libm's expf, times clamp(u, -7, 7) + 1). Returns 1 when n is not a
 * multiple of 16. */
int sharpi_glu(const float *gu, long T, long n, int act, float *y, int nthreads) {
    if (n % 16) return 1;
    if (act == 1 && !__atomic_load_n(&gelu_ready, __ATOMIC_ACQUIRE)) {
#pragma omp critical(sharpi_gelu_init)
        if (!gelu_ready) gelu_init();
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T * n >= 32768)
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * 2 * n, *u = g + n;
        float *yr = y + t * n;
        if (act == 2) {
            const float alpha = 1.702f, limit = 7.0f;
            for (long i = 0; i < n; i++) {
                const float x = fminf(g[i], limit), y = fminf(fmaxf(u[i], -limit), limit);
                yr[i] = x / (1.0f + expf(alpha * (-x))) * (y + 1.0f);
            }
        } else if (act == 0) {
            for (long i = 0; i < n; i += 16) {
                const __m512 x = _mm512_loadu_ps(g + i);
                const __m512 e = ggml_expf16(_mm512_sub_ps(_mm512_setzero_ps(), x));
                const __m512 si = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                _mm512_storeu_ps(yr + i, _mm512_mul_ps(si, _mm512_loadu_ps(u + i)));
            }
        } else {
            for (long i = 0; i < n; i++) {
                const float x = g[i];
                if (x <= -10.0f) yr[i] = 0.0f;
                else if (x >= 10.0f) yr[i] = x * u[i];
                else yr[i] = gelu_table[_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)] * u[i];
            }
        }
    }
    return 0;
}

/* Row t's visible cache positions: [lo, pos] but the hole [h0, h1). vis (several sequences in one pass, as
 * llama.cpp's unified cache holds them: a task's shared prefix, then each continuation's cells) gives them,
 * 4 a row; else the causal pass's: pos = start + t, lo its sliding window's first, no hole. */
static inline void row_range(const long *vis, long t, long start, long window, long *lo, long *pos, long *h0, long *h1) {
    if (vis) {
        *lo = vis[4 * t], *pos = vis[4 * t + 1], *h0 = vis[4 * t + 2], *h1 = vis[4 * t + 3];
        return;
    }
    *pos = start + t;
    *lo = (window > 0 && *pos - window + 1 > 0) ? *pos - window + 1 : 0;
    *h0 = *h1 = 0;
}

int sharpi_attention(const float *q, long T, long H, long Hkv, long D, long Dv,
                     const void *k, const uint16_t *kd, int k_type, const void *v, const uint16_t *vd, int v_type,
                     long start, long window, float scale, float softcap, int round_p_f16, int order, long n_ctx,
                     const float *sinks, float *out, int nthreads, const long *vis) {
    if (T <= 0) return 0;
    if (D % 16 || Dv % 16 || H % Hkv || ((k_type == KV_Q8_0 || kv_blocked(k_type)) && D % 32) ||
        ((v_type == KV_Q8_0 || kv_blocked(v_type)) && Dv % 32) || k_type < 0 || k_type > KV_Q5_1 || v_type < 0 || v_type > KV_Q5_1)
        return 1;
    if (D > 512 || Dv > 512) return 1; /* (q's stack buffers below, and flash attention's) */
    const long G = H / Hkv;
    long Lmax = start + T; /* the cache positions the pass reads: below its rows' last */
    if (vis) {
        Lmax = 0;
        for (long t = 0; t < T; t++) Lmax = vis[4 * t + 1] + 1 > Lmax ? vis[4 * t + 1] + 1 : Lmax;
    }
    const int fa = order == FA_PROMPT || order == FA_DECODE;
    /* flash attention: s * (scale / cap), then cap * tanhf; otherwise s * (1 / cap), tanhf, times cap,
     * then the softmax's s * scale */
    const float fa_scale = fa && softcap != 0.0f ? scale / softcap : scale, inv_cap = softcap != 0.0f ? 1.0f / softcap : 0.0f;
    int bad = 0;
    /* tiled flash attention (f32 / f16 caches): K of every KV head transposed to fp32 [Hkv][D][positions]
     * once per pass, by blocks of 16 positions (whole cache lines); then the (row, head) pairs, ordered by KV
     * head, row, head, in runs of FA_TC sharing a KV head, handed out one run at a time (a causal pass's
     * late rows cost more than its early ones) */
    if (order == FA_PROMPT && T >= FA_TILE_Q && k_type <= KV_F16 && k_type == v_type) {
        const long ldk = (Lmax + FA_TILE_KV - 1) / FA_TILE_KV * FA_TILE_KV + 16, nb16 = (Lmax + 15) / 16;
        const size_t bytes = ((size_t)(Hkv * D * ldk) * sizeof(float) + 63) / 64 * 64;
        float *kt = aligned_alloc(64, bytes);
        if (!kt) return 2;
        const long nbg = (T * G + FA_TC - 1) / FA_TC; /* runs per KV head */
#pragma omp parallel num_threads(nthreads)
        {
            float row[512];
#pragma omp for schedule(static)
            for (long blk = 0; blk < Hkv * nb16; blk++) {
                const long g = blk / nb16, ic0 = blk % nb16 * 16;
                for (long ic = ic0; ic < ic0 + 16; ic++) {
                    if (ic < Lmax)
                        for (long d = 0; d < D; d += 16) _mm512_storeu_ps(row + d, load16(k, kd, k_type, ic * Hkv + g, D, d));
                    else
                        memset(row, 0, sizeof(float) * (size_t)D);
                    for (long d = 0; d < D; d++) kt[(g * D + d) * ldk + ic] = row[d];
                }
                if (ic0 + 16 == nb16 * 16) /* the row's padding past the last block */
                    for (long d = 0; d < D; d++) memset(kt + (g * D + d) * ldk + nb16 * 16, 0, sizeof(float) * (size_t)(ldk - nb16 * 16));
            }
#pragma omp for schedule(dynamic, 1)
            for (long run = 0; run < Hkv * nbg; run++) {
                const long g = run / nbg, u0 = run % nbg * FA_TC;
                fa_trow rows[FA_TC];
                int nc = 0;
                for (long u = u0; u < u0 + FA_TC && u < T * G; u++, nc++) {
                    const long t = u / G, h = g * G + u % G;
                    long lo, pos, h0, h1;
                    row_range(vis, t, start, window, &lo, &pos, &h0, &h1);
                    rows[nc] = (fa_trow){q + (t * H + h) * D, lo, pos, h0, h1, sinks ? sinks + h : NULL, out + (t * H + h) * Dv};
                }
                fa_tiled_rows(rows, nc, kt + g * D * ldk, ldk, v, v_type == KV_F16, Hkv, g, D, Dv, fa_scale, softcap);
            }
        }
        free(kt);
        return 0;
    }
    /* -fa off with a bf16 V: a pass of several rows makes V's columns [Hkv * Dv][ldv] (positions contiguous,
     * as llama.cpp's transposed V cache holds them), zeros past the pass's last position, once for all rows and
     * heads (ldv an odd number of 64-position blocks: columns 2^k bytes apart shared cache sets, which made
     * the copy 3-9x slower at 1024 positions); a one-row pass reads V's rows as they are (pv_bf16_rows, the
     * same operations: 1.6x faster with 64-wide heads, as fast with 128-wide ones; from 2 rows on the copy
     * pays for itself with 128-wide heads) */
    const long ldv = ((Lmax + 63) & ~63L) | 64;
    const int v_bf16 = !fa && v_type == KV_BF16, v_cols = v_bf16 && T >= PV_BF16_COPY_ROWS;
    uint16_t *vt = v_cols ? malloc(sizeof(uint16_t) * (size_t)(Hkv * Dv * ldv)) : NULL;
    if (v_cols && !vt) return 2;
    /* flash attention's one-chunk kernel: each thread takes a contiguous run of (row, head) tasks
     * (rows in order, heads in order within a row: neighbours mostly share a KV head) and computes
     * them FA_CHAINS at a time side by side (fa_rows) */
#pragma omp parallel num_threads(nthreads)
    if (fa) {
        const long n_tasks = T * H, nt = omp_get_num_threads(), id = omp_get_thread_num();
        const long a = n_tasks * id / nt, b = n_tasks * (id + 1) / nt;
        float q16[FA_CHAINS][512]; /* q rounded to fp16 / bf16 for such a K (fa_chunks quantizes it for the others) */
        for (long t0 = a; t0 < b; t0 += FA_CHAINS) {
            fa_row rows[FA_CHAINS];
            int nr = 0;
            for (long task = t0; task < b && task < t0 + FA_CHAINS; task++, nr++) {
                const long t = task / H, h = task % H;
                long lo, pos, h0, h1;
                row_range(vis, t, start, window, &lo, &pos, &h0, &h1);
                const float *qr = q + (t * H + h) * D;
                for (long d = 0; d < D; d += 16) {
                    const __m512 x = _mm512_loadu_ps(qr + d);
                    _mm512_storeu_ps(q16[nr] + d, k_type == KV_F16 ? _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)) : x);
                }
                if (k_type == KV_BF16)
                    for (long d = 0; d < D; d++) {
                        const uint32_t u = (uint32_t)bf16_bits(qr[d]) << 16;
                        memcpy(q16[nr] + d, &u, 4);
                    }
                long n_kv = 0; /* FA_PROMPT: one chunk */
                if (order == FA_DECODE) {
                    n_kv = (pos + 1 + KV_PAD - 1) / KV_PAD * KV_PAD;
                    n_kv = n_kv > n_ctx ? n_ctx : n_kv;
                }
                rows[nr] = (fa_row){q16[nr], h / G, lo, pos, h0, h1, n_kv, out + (t * H + h) * Dv, sinks ? sinks + h : NULL};
            }
            fa_rows(rows, nr, k, kd, k_type, v, vd, v_type, Hkv, D, Dv, fa_scale, softcap);
        }
    } else {
        if (vt) { /* blocks of 64 positions of one KV head: rows read whole, each column written 64 in a row */
            const uint16_t *vv = (const uint16_t *)v;
            const long nblk = ldv / 64, last = Lmax;
#pragma omp for schedule(static)
            for (long bg = 0; bg < Hkv * nblk; bg++) {
                const long g = bg / nblk, p0 = bg % nblk * 64;
                uint16_t *c = vt + g * Dv * ldv;
                for (long p = p0; p < p0 + 64; p++)
                    for (long d = 0; d < Dv; d++) c[d * ldv + p] = p < last ? vv[(p * Hkv + g) * Dv + d] : 0;
            }
        }
        float *s = malloc(sizeof(float) * (size_t)(Lmax + 16));
        /* a bf16 V: the probabilities as bf16 (bits and values) over whole blocks of 64 positions */
        uint16_t *pb = v_bf16 ? malloc(sizeof(uint16_t) * (size_t)(Lmax + 128)) : NULL;
        float *pf = v_bf16 ? malloc(sizeof(float) * (size_t)(Lmax + 128)) : NULL;
        if (!s || (v_bf16 && (!pb || !pf))) {
#pragma omp atomic write
            bad = 1;
            free(s);
            s = NULL;
        }
#pragma omp for schedule(static)
        for (long task = 0; task < T * H; task++) {
            if (!s) continue;
            const long t = task / H, h = task % H, g = h / G;
            long lo, pos, h0, h1;
            row_range(vis, t, start, window, &lo, &pos, &h0, &h1);
            const long n = pos + 1 - lo;
            const float *qr = q + (t * H + h) * D;
            /* scores: per key, the 16-lane FMA accumulators of ggml_vec_dot_f16 (4 of them, 64 dims a
             * step, GGML_F32Cx16_REDUCE, dims past a multiple of 64 summed in double) or of tinyBLAS
             * (one, 16 dims a step, then its hsum); a quantized K: its vec_dot (or tinyBLAS_Q0_AVX, the same
             * arithmetic but for iq4_nl's single accumulator; q4_1 / q5_1 have no tinyBLAS kernel) on q
             * quantized here (q arrives in fp32 for these: q8_1's block sums are those of the unrounded scale);
             * bf16: ggml's bf16 vec_dot / tinyBLAS on q rounded to bf16 here */
            int8_t qc[512];
            float qd[16], qs[16], qf[512];
            uint16_t qb[512];
            kq_prepare(k_type, qr, D, qc, qd, qs, qb, qf);
            float mx = -INFINITY;
            for (long j = 0; j < n; j++) {
                const long row = (lo + j) * Hkv + g; /* row of width D in the [capacity * Hkv, D] view */
                if (lo + j >= h0 && lo + j < h1) { /* another sequence's cell: masked (its exp 0, V's weight 0) */
                    s[j] = -INFINITY;
                    continue;
                }
                float sc = kq_dot(k_type, k, kd, row, D, qc, qd, qs, qb, k_type == KV_BF16 ? qf : qr, order == ORDER_TINYBLAS);
                if (softcap != 0.0f) sc = tanhf(sc * inv_cap) * softcap;
                sc *= scale;
                s[j] = sc;
                mx = sc > mx ? sc : mx;
            }
            if (sinks) mx = sinks[h] > mx ? sinks[h] : mx; /* ggml_soft_max_ext: the sink joins the max */
            /* softmax over groups of 16 cache positions counted from 0 (masked ones are exp(-inf) = 0),
             * each group reduced as _mm512_reduce_add_ps into a double */
            const long pad = lo & 15; /* group slot of position lo */
            double sum = 0.0;
            const __m512 vmx = _mm512_set1_ps(mx);
            for (long j = 0; j < n; j += 16) {
                const __mmask16 m = (n - j >= 16) ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
                _mm512_mask_storeu_ps(s + j, m, ggml_expf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx)));
            }
            for (long a = 0; a < pad + n; a += 16) {
                float grp[16];
                for (int i = 0; i < 16; i++) grp[i] = (a + i >= pad && a + i < pad + n) ? s[a + i - pad] : 0.0f;
                sum += (double)reduce16(_mm512_loadu_ps(grp));
            }
            if (sinks) sum += (double)expf(sinks[h] - mx); /* and its exp the sum */
            const float inv = (float)(1.0 / sum);
            for (long j = 0; j < n; j++) {
                float p = s[j] * inv;
                if (round_p_f16) p = _cvtsh_ss(_cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT));
                s[j] = p;
            }
            float *o = out + (t * H + h) * Dv;
            if (v_bf16) {
                /* P V with a bf16 V: ggml converts the probabilities to bf16 (V's vec_dot type) and takes, per
                 * output element, ggml_vec_dot_bf16 (decoding rows) or tinyBLAS's bf16 kernel (prompt rows) of
                 * V's column over the cache positions. Those outside [lo, pos] have p = 0 there (masked), which
                 * adds nothing: the dot runs over the blocks of 64 positions (counted from 0) that hold [lo, pos] */
                const long i0 = lo & ~63L, len = ((pos + 64) & ~63L) - i0;
                for (long j = 0; j < len; j++) {
                    const long at = i0 + j - lo;
                    pb[j] = (at >= 0 && at < n) ? bf16_bits(s[at]) : 0;
                    const uint32_t u = (uint32_t)pb[j] << 16;
                    memcpy(pf + j, &u, 4);
                }
                if (!vt) {
                    pv_bf16_rows((const uint16_t *)v, Hkv, g, Dv, pb, pf, i0, len, Lmax, order == ORDER_VEC_DOT, o);
                    continue;
                }
                const uint16_t *col = vt + g * Dv * ldv + i0;
                for (long d = 0; d < Dv; d++)
                    o[d] = order == ORDER_VEC_DOT ? dot_bf16_vec_dot(col + d * ldv, pb, pf, len)
                                                  : dot_bf16_tinyblas(col + d * ldv, pb, pf, len);
                continue;
            }
            /* P V: per output element, one partial sum per cache position mod nl (counted from 0):
             * ggml_vec_dot_f16's 4 accumulators x 16 lanes (nl = 64) or tinyBLAS's 16 lanes, then their
             * reduction trees (GGML_F32Cx16_REDUCE, _mm512_reduce_add_ps) */
            const int nl = order == ORDER_VEC_DOT ? 64 : 16;
            for (long d0 = 0; d0 < Dv; d0 += 16) {
                __m512 a[64];
                for (int r = 0; r < nl; r++) a[r] = _mm512_setzero_ps();
                for (long j = 0; j < n; j++) {
                    const long row = (lo + j) * Hkv + g;
                    const int r = (int)((lo + j) & (nl - 1));
                    a[r] = _mm512_fmadd_ps(load16(v, vd, v_type, row, Dv, d0), _mm512_set1_ps(s[j]), a[r]);
                }
                __m512 y[16]; /* y[l]: lane l of the vector that _mm512_reduce_add_ps sums */
                for (int l = 0; l < 16; l++)
                    y[l] = nl == 64 ? _mm512_add_ps(_mm512_add_ps(a[l], a[32 + l]), _mm512_add_ps(a[16 + l], a[48 + l])) : a[l];
                _mm512_storeu_ps(o + d0, reduce16_lanes(y));
            }
        }
        free(s);
        free(pb);
        free(pf);
    }
    free(vt);
    return bad ? 2 : 0;
}

/* ---- llama-perplexity's log-probabilities: --kl-divergence-base files and --kl-divergence -------------------
 * Its code's arithmetic (tools/perplexity/perplexity.cpp, no FMA contraction in that build, as here): max and min
 * as std::max / std::min, the exps of libm's expf summed in double in vocabulary order, log in double. */

static inline int ppl_nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* One row's log-probabilities as a --kl-divergence-base file keeps them: the floats scale and min_log_prob in
 * log_prob[0..3], then each token's as a 16-bit step of scale above min_log_prob (0 for those 16 or more below the
 * max); returns the token tok's negative log-likelihood (in float arithmetic, as that variant computes it). */
double sharpi_ppl_logprobs(const float *logits, long n_vocab, int tok, uint16_t *log_prob) {
    float max_logit = logits[0], min_logit = logits[0];
    for (long i = 1; i < n_vocab; ++i) {
        max_logit = max_logit < logits[i] ? logits[i] : max_logit;
        min_logit = logits[i] < min_logit ? logits[i] : min_logit;
    }
    min_logit = min_logit < max_logit - 16 ? max_logit - 16 : min_logit;
    double sum_exp = 0.0;
    for (long i = 0; i < n_vocab; ++i) sum_exp += expf(logits[i] - max_logit);
    const float log_sum_exp = (float)log(sum_exp);
    const float min_log_prob = min_logit - max_logit - log_sum_exp;
    const float scale = (max_logit - min_logit) / 65535.f;
    memcpy(log_prob, &scale, sizeof(float));
    memcpy(log_prob + 2, &min_log_prob, sizeof(float));
    log_prob += 4;
    if (scale) {
        const float inv_scale = 1 / scale;
        for (long i = 0; i < n_vocab; ++i)
            log_prob[i] = (uint16_t)(logits[i] > min_logit ? ppl_nearest_int(inv_scale * (logits[i] - min_logit)) : 0);
    } else {
        memset(log_prob, 0, sizeof(uint16_t) * (size_t)n_vocab);
    }
    return max_logit + log_sum_exp - logits[tok];
}

/* The multiple-choice scores' log-probabilities, as llama-perplexity's --hellaswag, --winogrande and
 * --multiple-choice compute them: out[r] = row r's log-probability of token toks[r] (compute_logprobs: a float sum
 * of expf, the result in float), for n rows of n_vocab logits. */
void sharpi_choice_logprobs(const float *rows, long n, long n_vocab, const int *toks, float *out) {
    for (long r = 0; r < n; ++r) {
        const float *logits = rows + r * n_vocab;
        float max_logit = logits[0];
        for (long j = 1; j < n_vocab; ++j) max_logit = max_logit < logits[j] ? logits[j] : max_logit;
        float sum_p = 0.f;
        for (long j = 0; j < n_vocab; ++j) sum_p += expf(logits[j] - max_logit);
        out[r] = logits[toks[r]] - max_logit - logf(sum_p);
    }
}

/* The log of token tok's probability as llama-perplexity's softmax() gives it (a double sum of float exps, the
 * probability rounded to float), its log in float: how those scores take the shared prefix's last row. */
float sharpi_softmax_logprob(const float *logits, long n_vocab, int tok) {
    float max_logit = logits[0];
    for (long j = 1; j < n_vocab; ++j) max_logit = max_logit < logits[j] ? logits[j] : max_logit;
    double sum_exp = 0.0;
    for (long j = 0; j < n_vocab; ++j) sum_exp += expf(logits[j] - max_logit);
    return logf((float)(expf(logits[tok] - max_logit) / sum_exp));
}

/* y[i] = expf(x[i]) with libm's bits, for the samplers' float softmaxes (llama_sampler_softmax_impl's expf: numpy's
 * float32 exp is an ulp off it on a good share of floats, and top-p's or typical's cut can hang on one); x and y must
 * not overlap (expf16 reads x again for its special cases) */
void sharpi_expf_array(const float *x, long n, float *y) {
    long i = 0;
    for (; i + 16 <= n; i += 16) expf16(x + i, y + i);
    for (; i < n; i++) y[i] = expf(x[i]);
}

/* y[i] = logf(x[i]) with libm's bits, for typical's surprises -logf(p) (numpy's float32 log is an ulp off it for a
 * fifth of the floats in (0, 1], and typical's order of near-equal surprises can hang on one) */
void sharpi_logf_array(const float *x, long n, float *y) {
    for (long i = 0; i < n; i++) y[i] = logf(x[i]);
}

/* Top-n-sigma's cut, max - nsig * std over the finite logits x[0..n) in their order, in llama.cpp's arithmetic
 * (llama_sampler_top_n_sigma_apply): the logits summed one by one in float, the mean a float, each square
 * (a double: its pow) added to a float accumulator, the deviation a float square root. A float64 mean and
 * deviation move the cut by ~1e-4 at n = 10, enough to keep or drop a logit next to it. */
float sharpi_top_n_sigma_cut(const float *x, long n, float nsig) {
    float max = x[0], sum = 0.0f;
    long count = 0;
    for (long i = 0; i < n; i++)
        if (x[i] != -INFINITY) {
            max = max < x[i] ? x[i] : max;
            sum += x[i];
            count++;
        }
    const float mean = count > 0 ? sum / (float)count : 0.0f;
    float acc = 0.0f;
    for (long i = 0; i < n; i++)
        if (x[i] != -INFINITY) {
            const double d = (double)(x[i] - mean);
            acc = (float)((double)acc + d * d);
        }
    const float sd = count > 0 ? sqrtf(acc / (float)count) : 0.0f;
    return max - nsig * sd;
}

/* One row against a base file's row (kl_divergence's log_softmax): acc[13] gains the row's terms in its order
 * (sums of nll, nll^2, nll_base, nll_base^2, nll * nll_base, KLD, KLD^2, dp, dp^2, dp^4, then max |dp|, same top,
 * count), out[2] = (KLD, dp) of the row. */
void sharpi_kld_row(const float *logits, long n_vocab, const uint16_t *base_log_prob, int tok, double *acc, double *out) {
    float max_logit = logits[0];
    long imax = 0;
    for (long i = 1; i < n_vocab; ++i)
        if (logits[i] > max_logit) {
            max_logit = logits[i];
            imax = i;
        }
    double sum_exp = 0.0;
    for (long i = 0; i < n_vocab; ++i) sum_exp += expf(logits[i] - max_logit);
    const float log_sum_exp = (float)log(sum_exp);
    float scale, min_log_prob;
    memcpy(&scale, base_log_prob, sizeof(float));
    memcpy(&min_log_prob, base_log_prob + 2, sizeof(float));
    base_log_prob += 4;
    const float nll = max_logit + log_sum_exp - logits[tok];
    acc[0] += nll;
    acc[1] += nll * nll;
    const float nll_base = -(scale * base_log_prob[tok] + min_log_prob);
    acc[2] += nll_base;
    acc[3] += nll_base * nll_base;
    acc[4] += nll * nll_base;
    max_logit += log_sum_exp;
    double sum = 0;
    long imax_base = -1;
    float p_log_base_max = 0;
    for (long i = 0; i < n_vocab; ++i) {
        const float p_log_base = scale * base_log_prob[i] + min_log_prob;
        if (i == 0 || p_log_base > p_log_base_max) {
            p_log_base_max = p_log_base;
            imax_base = i;
        }
        if (p_log_base > -16.f) {
            const float p_base = expf(p_log_base);
            sum += p_base * (p_log_base - logits[i] + max_logit);
        }
    }
    acc[5] += sum;
    acc[6] += sum * sum;
    acc[11] += imax == imax_base;
    acc[12] += 1;
    const float p_base = expf(-nll_base), p = expf(-nll), p_diff = p - p_base;
    acc[7] += p_diff;
    const double p_diff2 = p_diff * p_diff;
    acc[8] += p_diff2;
    acc[9] += p_diff2 * p_diff2;
    acc[10] = acc[10] > fabsf(p_diff) ? acc[10] : fabsf(p_diff); /* std::max(max_p_diff, |dp|) in float */
    out[0] = sum;
    out[1] = p_diff;
}

/* ---- the decoding layer loop (models/fast_decode.py's DecodePath.run, for attention layers) ----
 *
 * A one-token pass of a small model is mostly glue between ~15 kernel calls a layer (SmolLM2: 0.7 of its 3.6 ms in
 * Python and torch's small ops). sharpi_decode_layers runs the loop of DecodePath.run for layers of attention and a
 * dense FFN: the same kernel calls with the same arguments in the same order, and its small steps (bias and residual
 * adds, scalings, K / V copies into an f32 / f16 / bf16 cache) as the element-wise operations torch computes (one
 * IEEE operation per element, fp32 -> f16 / bf16 round to nearest even), so the same bits.
 *
 * plan: the model's int64 header DL_* then per layer a record of DL_REC int64: norms, biases, the q/k norm weights
 * as pointers (0: none; olmo2's over all heads: q's and k's weights in GGUF order), the layer's rope table index
 * (-1: no RoPE), its KV cache layer, window, sinks, and five matmul slots (wqk, wv, wo, w_gu, w_down), each up to 3
 * parts (a StackedWeight's) of (code, pointer, row bytes, n, k). ropes: per table (pointer to [T, n_rot / 2] complex
 * cos / sin, n_rot). kv: per store (K, V) its code, base, layer stride and position stride in bytes, its q8_0
 * scales' base, layer and position strides. bufs: h, qk, v, q, k, o, ao, gu, g, f, stacked, qkn (DecodePath's
 * buffers for at least T rows; qkn: olmo2's, else 0). Returns 0, or 10 * step + 1 when a kernel rejected its
 * arguments (steps 1-7: the q/k and v matmuls, attention, the output matmul, gate/up, the GLU, down). */
enum { DL_NLAYER, DL_H, DL_HKV, DL_HD, DL_HDV, DL_D, DL_NFF, DL_GLU, DL_SCALE_Q, DL_UNPERM, DL_PERM, DL_EPS, DL_RS,
       DL_SOFTCAP, DL_HEADER };
enum { L_ATTN_NORM, L_BQK, L_BV, L_QK_NORM, L_Q_NORM_ALL, L_K_NORM_ALL, L_ROPE, L_KV, L_WINDOW, L_SINKS, L_BO,
       L_POST_ATTN, L_FFN_NORM, L_POST_FFN, L_MM };
enum { DL_PARTS = 3, DL_SLOT = 1 + 5 * DL_PARTS, DL_REC = L_MM + 5 * DL_SLOT };
enum { MM_QK, MM_V, MM_O, MM_GU, MM_DOWN };
enum { KV_CODE, KV_Q, KV_QL, KV_QP, KV_D, KV_DL, KV_DP, KV_DESC };
enum { B_H, B_QK, B_V, B_Q, B_K, B_O, B_AO, B_GU, B_G, B_F, B_STK, B_QKN };

int sharpi_qmatmul(int ty_mode, const uint8_t *w, long rb, long n, long k, const float *x, long T, float *y,
                   int nthreads);                                              /* qmatmul.c */
void sharpi_store_q8_0(const float *x, long nb, int8_t *codes, uint16_t *d); /* qmatmul.c */

static float bits_f32(int64_t v) {
    const uint32_t u = (uint32_t)v;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* y [T, sum of the parts' n] = x [T, k] times a slot's parts; several rows: each part's rows through stk, then its
 * columns (as DecodePath._mm_parts) */
static int dl_mm(const int64_t *s, const float *x, long T, float *y, float *stk, int nth) {
    const long np = s[0];
    if (np == 1)
        return sharpi_qmatmul((int)s[1], (const uint8_t *)s[2], s[3], s[4], s[5], x, T, y, nth);
    long cols = 0, col = 0;
    for (long p = 0; p < np; p++) cols += s[1 + 5 * p + 3];
    for (long p = 0; p < np; p++) {
        const int64_t *w = s + 1 + 5 * p;
        const long n = w[3];
        float *dst = T == 1 ? y + col : stk;
        if (sharpi_qmatmul((int)w[0], (const uint8_t *)w[1], w[2], n, w[4], x, T, dst, nth)) return 1;
        if (T > 1)
            for (long t = 0; t < T; t++) memcpy(y + t * cols + col, stk + t * n, sizeof(float) * (size_t)n);
        col += n;
    }
    return 0;
}

static void dl_add(float *x, const float *a, long n) {
    for (long i = 0; i < n; i++) x[i] += a[i];
}

static void dl_add_rows(float *x, const float *a, long T, long n) { /* x [T, n] += a [n] */
    for (long t = 0; t < T; t++) dl_add(x + t * n, a, n);
}

static void dl_scale(float *x, float s, long n) {
    for (long i = 0; i < n; i++) x[i] *= s;
}

/* olmo2's q / k norms on qk [T, H + Hkv, hd] (rope-pair order) in place, as DecodePath._qk_norm_full: each row's
 * heads [lo, hi) into tmp in the GGUF's element order (unperm), RMS-normed over all of them times w, then back */
static void dl_qk_norm_all(float *qk, long T, long nqk, long lo, long hi, long hd, const int64_t *unperm,
                           const int64_t *perm, const float *w, float eps, float *tmp) {
    const long n = (hi - lo) * hd;
    for (long t = 0; t < T; t++) {
        float *row = qk + (t * nqk + lo) * hd;
        for (long h = 0; h < hi - lo; h++)
            for (long j = 0; j < hd; j++) tmp[h * hd + j] = row[h * hd + (unperm ? unperm[j] : j)];
        sharpi_rms_norm(tmp, w, 1, n, eps, tmp);
        for (long h = 0; h < hi - lo; h++)
            for (long j = 0; j < hd; j++) row[h * hd + j] = tmp[h * hd + (perm ? perm[j] : j)];
    }
}

/* x [T, Hkv, hd] fp32 into positions [start, start + T) of one layer of a cache store (DecodePath._write); the
 * layer's q8_0 scales' pointer for attention (NULL if none) into *d */
static void dl_write(const int64_t *kv, long layer, long start, const float *x, long T, long row, const uint16_t **d) {
    const int code = (int)kv[KV_CODE];
    uint8_t *q = (uint8_t *)kv[KV_Q] + layer * kv[KV_QL] + start * kv[KV_QP];
    *d = NULL;
    if (code == KV_F32) {
        memcpy(q, x, sizeof(float) * (size_t)(T * row));
    } else if (code == KV_F16) {
        uint16_t *h = (uint16_t *)q;
        for (long i = 0; i < T * row; i++) h[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else if (code == KV_BF16) { /* c10::BFloat16's: round to nearest even (as ggml's), a NaN as 0x7fc0 */
        uint16_t *h = (uint16_t *)q;
        for (long i = 0; i < T * row; i++) h[i] = x[i] != x[i] ? 0x7fc0 : bf16_bits(x[i]);
    } else if (code == KV_Q8_0) {
        uint8_t *dl = (uint8_t *)kv[KV_D] + layer * kv[KV_DL];
        sharpi_store_q8_0(x, T * row / 32, (int8_t *)q, (uint16_t *)(dl + start * kv[KV_DP]));
        *d = (const uint16_t *)dl;
    } else {
        sharpi_kv_store(code, x, T * row / 32, q);
    }
}

int sharpi_decode_layers(const int64_t *plan, long n_layers, float *x, long T, long start, long last_n,
                         const int64_t *ropes, float kq_scale, float q_scale, const int64_t *kv, int rot_k, int rot_v,
                         int round_p, long n_ctx, const int64_t *bufs, int nth) {
    const long H = plan[DL_H], Hkv = plan[DL_HKV], hd = plan[DL_HD], hdv = plan[DL_HDV], D = plan[DL_D];
    const long n_ff = plan[DL_NFF], n_layer = plan[DL_NLAYER], nqk = H + Hkv;
    const int glu_act = (int)plan[DL_GLU], scale_q = (int)plan[DL_SCALE_Q];
    const int64_t *unperm = (const int64_t *)plan[DL_UNPERM], *perm = (const int64_t *)plan[DL_PERM];
    const float eps = bits_f32(plan[DL_EPS]), rs = bits_f32(plan[DL_RS]), softcap = bits_f32(plan[DL_SOFTCAP]);
    float *h = (float *)bufs[B_H], *qk = (float *)bufs[B_QK], *v = (float *)bufs[B_V], *q = (float *)bufs[B_Q];
    float *k = (float *)bufs[B_K], *o = (float *)bufs[B_O], *ao = (float *)bufs[B_AO], *gu = (float *)bufs[B_GU];
    float *g = (float *)bufs[B_G], *f = (float *)bufs[B_F], *stk = (float *)bufs[B_STK], *qkn = (float *)bufs[B_QKN];
    const int64_t *kst = kv, *vst = kv + KV_DESC;
    for (long i = 0; i < n_layers; i++) {
        const int64_t *L = plan + DL_HEADER + i * DL_REC;
        const int64_t *mm = L + L_MM;
        const float *hin = x;
        if (L[L_ATTN_NORM]) {
            sharpi_rms_norm(x, (const float *)L[L_ATTN_NORM], T, D, eps, h);
            hin = h;
        }
        /* attention: q and k, v; biases; per-head q / k norms; RoPE; q and k apart (NeoX: back in GGUF order) */
        if (dl_mm(mm + MM_QK * DL_SLOT, hin, T, qk, stk, nth)) return 10 * 1 + 1;
        if (dl_mm(mm + MM_V * DL_SLOT, hin, T, v, stk, nth)) return 10 * 2 + 1;
        if (L[L_BQK]) {
            dl_add_rows(qk, (const float *)L[L_BQK], T, nqk * hd);
            dl_add_rows(v, (const float *)L[L_BV], T, Hkv * hdv);
        }
        if (L[L_QK_NORM]) {
            const float *w = (const float *)L[L_QK_NORM]; /* [H + Hkv, hd] */
            sharpi_rms_norm(qk, NULL, T * nqk, hd, eps, qk);
            for (long t = 0; t < T; t++)
                for (long j = 0; j < nqk * hd; j++) qk[t * nqk * hd + j] *= w[j];
        }
        if (L[L_Q_NORM_ALL]) {
            dl_qk_norm_all(qk, T, nqk, 0, H, hd, unperm, perm, (const float *)L[L_Q_NORM_ALL], eps, qkn);
            dl_qk_norm_all(qk, T, nqk, H, nqk, hd, unperm, perm, (const float *)L[L_K_NORM_ALL], eps, qkn);
        }
        if (L[L_ROPE] >= 0) {
            const int64_t *r = ropes + 2 * L[L_ROPE];
            sharpi_rope(qk, T, nqk, hd, (int)r[1], (const float *)r[0]);
        }
        for (long t = 0; t < T; t++)
            for (long hh = 0; hh < nqk; hh++) {
                const float *src = qk + (t * nqk + hh) * hd;
                float *dst = hh < H ? q + (t * H + hh) * hd : k + (t * Hkv + hh - H) * hd;
                if (unperm)
                    for (long j = 0; j < hd; j++) dst[j] = src[unperm[j]];
                else
                    memcpy(dst, src, sizeof(float) * (size_t)hd);
            }
        if (scale_q) dl_scale(q, q_scale, T * H * hd);
        if (rot_k) {
            sharpi_hadamard(q, T * H * hd / rot_k, rot_k);
            sharpi_hadamard(k, T * Hkv * hd / rot_k, rot_k);
        }
        if (rot_v) sharpi_hadamard(v, T * Hkv * hdv / rot_v, rot_v);
        const long kvl = L[L_KV];
        const uint16_t *kd, *vd;
        dl_write(kst, kvl, start, k, T, Hkv * hd, &kd);
        dl_write(vst, kvl, start, v, T, Hkv * hdv, &vd);
        const void *kq = (const uint8_t *)kst[KV_Q] + kvl * kst[KV_QL], *vq = (const uint8_t *)vst[KV_Q] + kvl * vst[KV_QL];
        if (sharpi_attention(q, T, H, Hkv, hd, hdv, kq, kd, (int)kst[KV_CODE], vq, vd, (int)vst[KV_CODE], start,
                             L[L_WINDOW], kq_scale, softcap, round_p, FA_DECODE, n_ctx, (const float *)L[L_SINKS], o,
                             nth, NULL))
            return 10 * 3 + 1;
        if (rot_v) sharpi_hadamard(o, T * H * hdv / rot_v, rot_v);
        if (dl_mm(mm + MM_O * DL_SLOT, o, T, ao, stk, nth)) return 10 * 4 + 1;
        if (L[L_BO]) dl_add_rows(ao, (const float *)L[L_BO], T, D);
        if (L[L_POST_ATTN]) sharpi_rms_norm(ao, (const float *)L[L_POST_ATTN], T, D, eps, ao);
        if (rs != 0.0f) dl_scale(ao, rs, T * D);
        dl_add(x, ao, T * D);
        /* the FFN; the model's last layer on the output rows only */
        long Tf = T;
        if (last_n > 0 && last_n < T && i == n_layer - 1) {
            x += (T - last_n) * D;
            Tf = last_n;
        }
        const float *hf = x;
        if (L[L_FFN_NORM]) {
            sharpi_rms_norm(x, (const float *)L[L_FFN_NORM], Tf, D, eps, h);
            hf = h;
        }
        if (dl_mm(mm + MM_GU * DL_SLOT, hf, Tf, gu, stk, nth)) return 10 * 5 + 1;
        if (sharpi_glu(gu, Tf, n_ff, glu_act, g, nth)) return 10 * 6 + 1;
        if (dl_mm(mm + MM_DOWN * DL_SLOT, g, Tf, f, stk, nth)) return 10 * 7 + 1;
        if (L[L_POST_FFN]) sharpi_rms_norm(f, (const float *)L[L_POST_FFN], Tf, D, eps, f);
        if (rs != 0.0f) dl_scale(f, rs, Tf * D);
        dl_add(x, f, Tf * D);
    }
    return 0;
}

#ifdef SHARPI_PYEXT
/* attention(q, T, H, Hkv, D, Dv, k, kd, k_type, v, vd, v_type, start, window, scale, softcap, round_p_f16,
 * order, n_ctx, out, nthreads) for the _sharpi_qmatmul module (qmatmul.c lists it): pointers as Python
 * ints, scale and softcap (0: none) floats; the GIL is released meanwhile. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

int sharpi_py_nlongs(PyObject *const *args, Py_ssize_t nargs, long *a, int n, const char *name); /* qmatmul.c */

/* round_q8(x, n, block, f16_scale, y) */
PyObject *sharpi_py_round_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[5];
    if (sharpi_py_nlongs(args, nargs, a, 5, "round_q8")) return NULL;
    sharpi_round_q8((const float *)a[0], a[1], (int)a[2], (int)a[3], (float *)a[4]);
    Py_RETURN_NONE;
}

/* kv_store(type, x, nb, dst) */
PyObject *sharpi_py_kv_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[4];
    if (sharpi_py_nlongs(args, nargs, a, 4, "kv_store")) return NULL;
    sharpi_kv_store((int)a[0], (const float *)a[1], a[2], (uint8_t *)a[3]);
    Py_RETURN_NONE;
}

/* hadamard(x, n_chunks, n) */
PyObject *sharpi_py_hadamard(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[3];
    if (sharpi_py_nlongs(args, nargs, a, 3, "hadamard")) return NULL;
    sharpi_hadamard((float *)a[0], a[1], (int)a[2]);
    Py_RETURN_NONE;
}

/* softcap(x, n, cap) */
PyObject *sharpi_py_softcap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "softcap() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    const long x = PyLong_AsLong(args[0]), n = PyLong_AsLong(args[1]);
    const double cap = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) return NULL;
    sharpi_softcap((float *)x, n, (float)cap);
    Py_RETURN_NONE;
}

/* gdn(q, k, v, g, beta, ring, R, slot0, out, T, Hv, Hk, S, nthreads); the GIL is released meanwhile */
PyObject *sharpi_py_gdn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[14];
    if (sharpi_py_nlongs(args, nargs, a, 14, "gdn")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    sharpi_gdn((const float *)a[0], (const float *)a[1], (const float *)a[2], (const float *)a[3], (const float *)a[4],
               (float *)a[5], a[6], a[7], (float *)a[8], a[9], a[10], a[11], a[12], (int)a[13]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gdn_gates(alpha, beta, dt, a, T, Hv) */
PyObject *sharpi_py_gdn_gates(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[6];
    if (sharpi_py_nlongs(args, nargs, a, 6, "gdn_gates")) return NULL;
    sharpi_gdn_gates((float *)a[0], (float *)a[1], (const float *)a[2], (const float *)a[3], a[4], a[5]);
    Py_RETURN_NONE;
}

/* sigmoid(x, n) */
PyObject *sharpi_py_sigmoid(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[2];
    if (sharpi_py_nlongs(args, nargs, a, 2, "sigmoid")) return NULL;
    sharpi_sigmoid((float *)a[0], a[1]);
    Py_RETURN_NONE;
}

/* short_conv(ext, w, out, T, D, width) */
PyObject *sharpi_py_short_conv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[6];
    if (sharpi_py_nlongs(args, nargs, a, 6, "short_conv")) return NULL;
    sharpi_short_conv((const float *)a[0], (const float *)a[1], (float *)a[2], a[3], a[4], (int)a[5]);
    Py_RETURN_NONE;
}

/* f16_mm(w, n, k, x, T, y, tiny) */
PyObject *sharpi_py_f16_mm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[7];
    if (sharpi_py_nlongs(args, nargs, a, 7, "f16_mm")) return NULL;
    sharpi_f16_mm((const uint16_t *)a[0], a[1], a[2], (const float *)a[3], a[4], (float *)a[5], (int)a[6]);
    Py_RETURN_NONE;
}

/* soft_max(x, T, n) */
PyObject *sharpi_py_soft_max(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[3];
    if (sharpi_py_nlongs(args, nargs, a, 3, "soft_max")) return NULL;
    sharpi_soft_max((float *)a[0], a[1], a[2]);
    Py_RETURN_NONE;
}

/* moe_route(logits, T, n_exp, k, gating, norm, bias (0: none), ids, w), moe_sum(d, w, T, k, D, y) and
 * shexp_add(gx, sh, T, D, y, plain) */
PyObject *sharpi_py_moe_route(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[9];
    if (sharpi_py_nlongs(args, nargs, a, 9, "moe_route")) return NULL;
    sharpi_moe_route((float *)a[0], a[1], a[2], (int)a[3], (int)a[4], (int)a[5], (const float *)a[6], (int32_t *)a[7],
                     (float *)a[8]);
    Py_RETURN_NONE;
}

PyObject *sharpi_py_shexp_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[6];
    if (sharpi_py_nlongs(args, nargs, a, 6, "shexp_add")) return NULL;
    sharpi_shexp_add((const float *)a[0], (const float *)a[1], a[2], a[3], (float *)a[4], (int)a[5]);
    Py_RETURN_NONE;
}

PyObject *sharpi_py_moe_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[6];
    if (sharpi_py_nlongs(args, nargs, a, 6, "moe_sum")) return NULL;
    sharpi_moe_sum((const float *)a[0], (const float *)a[1], a[2], (int)a[3], a[4], (float *)a[5]);
    Py_RETURN_NONE;
}

/* rope_table(base, freq_scale, n, n_rot, ff (0: none), mscale, ext_factor, n_ctx_orig, beta_fast, beta_slow,
 * cs) and rope(x, T, nh, hd, n_rot, cs) */
PyObject *sharpi_py_rope_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "rope_table() takes 11 arguments (%zd given)", nargs);
        return NULL;
    }
    const double base = PyFloat_AsDouble(args[0]), fs = PyFloat_AsDouble(args[1]), ms = PyFloat_AsDouble(args[5]),
                 ext = PyFloat_AsDouble(args[6]), bf = PyFloat_AsDouble(args[8]), bs = PyFloat_AsDouble(args[9]);
    const long n = PyLong_AsLong(args[2]), n_rot = PyLong_AsLong(args[3]), ff = PyLong_AsLong(args[4]),
               orig = PyLong_AsLong(args[7]), cs = PyLong_AsLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    sharpi_rope_table((float)base, (float)fs, n, (int)n_rot, (const float *)ff, (float)ms, (float)ext, (int)orig,
                      (float)bf, (float)bs, (float *)cs);
    Py_RETURN_NONE;
}

PyObject *sharpi_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[6];
    if (sharpi_py_nlongs(args, nargs, a, 6, "rope")) return NULL;
    sharpi_rope((float *)a[0], a[1], a[2], a[3], (int)a[4], (const float *)a[5]);
    Py_RETURN_NONE;
}

/* rms_norm(x, w (0: none), T, D, eps, y) */
PyObject *sharpi_py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "rms_norm() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    long a[6];
    for (int i = 0; i < 6; i++) {
        if (i == 4) continue;
        a[i] = PyLong_AsLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return NULL;
    }
    const double eps = PyFloat_AsDouble(args[4]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    sharpi_rms_norm((const float *)a[0], (const float *)a[1], a[2], a[3], (float)eps, (float *)a[5]);
    Py_RETURN_NONE;
}

/* glu(gu, T, n, act, y, nthreads) -> 0, or 1 when n is not a multiple of 16 */
PyObject *sharpi_py_glu(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[6];
    if (sharpi_py_nlongs(args, nargs, a, 6, "glu")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_glu((const float *)a[0], a[1], a[2], (int)a[3], (float *)a[4], (int)a[5]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* args -> n values: the floats at i0 and i0 + 1 into f, the others (ints) into a; -1 with a Python error set */
static int py_longs_2f(PyObject *const *args, Py_ssize_t nargs, long *a, int n, int i0, double *f, const char *name) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", name, n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (i == i0 || i == i0 + 1) {
            f[i - i0] = PyFloat_AsDouble(args[i]);
            if (f[i - i0] == -1.0 && PyErr_Occurred()) return -1;
            continue;
        }
        a[i] = PyLong_AsLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

PyObject *sharpi_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[23];
    double f[2] = {0.0, 0.0}; /* scale, softcap */
    if (py_longs_2f(args, nargs, a, 23, 14, f, "attention")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_attention((const float *)a[0], a[1], a[2], a[3], a[4], a[5], (const void *)a[6], (const uint16_t *)a[7],
                          (int)a[8], (const void *)a[9], (const uint16_t *)a[10], (int)a[11], a[12], a[13], (float)f[0],
                          (float)f[1], (int)a[16], (int)a[17], a[18], (const float *)a[19], (float *)a[20], (int)a[21],
                          (const long *)a[22]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* decode_layers(plan, n_layers, x, T, start, last_n, ropes, kq_scale, q_scale, kv, rot_k, rot_v, round_p, n_ctx, bufs,
 * nthreads): sharpi_decode_layers */
PyObject *sharpi_py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[16];
    double f[2] = {0.0, 0.0}; /* kq_scale, q_scale */
    if (py_longs_2f(args, nargs, a, 16, 7, f, "decode_layers")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_decode_layers((const int64_t *)a[0], a[1], (float *)a[2], a[3], a[4], a[5], (const int64_t *)a[6],
                              (float)f[0], (float)f[1], (const int64_t *)a[9], (int)a[10], (int)a[11], (int)a[12], a[13],
                              (const int64_t *)a[14], (int)a[15]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}
#endif
