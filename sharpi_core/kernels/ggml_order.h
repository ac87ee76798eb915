/* Pieces of llama.cpp's (ggml's x86) float arithmetic shared by qmatmul.c and ops.c. */
#ifndef SHARPI_GGML_ORDER_H
#define SHARPI_GGML_ORDER_H
#include <immintrin.h>

/* ggml's hsum_float_8 / llamafile's hsum(__m256) (also in ggml_vec_soft_max_f32):
 * ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)) */
static inline float hsum8(const __m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

#endif
