/* Pieces of llama.cpp's (ggml's x86) float arithmetic shared by qmatmul.c and ops.c. */
#ifndef SHARPI_GGML_ORDER_H
#define SHARPI_GGML_ORDER_H
#include "x86simd.h"
#include <stdint.h>

/* ggml's hsum_float_8 / llamafile's hsum(__m256) (also in ggml_vec_soft_max_f32):
 * ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)) */
static inline float hsum8(const __m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* _mm512_reduce_add_ps as GCC's avx512fintrin.h computes it (llama.cpp's AVX-512 build reduces
 * vectors with it): halves of 8 added, then of 4, then lanes (0+2) and (1+3), then those two.
 * Spelled out so that another compiler's reduction tree cannot change the result. */
static inline float reduce16(const __m512 v) {
    const __m256 t3 = _mm256_add_ps(_mm512_extractf32x8_ps(v, 1), _mm512_castps512_ps256(v));
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

/* IQ4_NL / IQ4_XS: the 16 values a 4-bit code stands for (ggml's kvalues_iq4nl) */
static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#endif
