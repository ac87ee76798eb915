/* The x86 intrinsics the kernels use. On a CPU with AVX-512 (F, BW, VL) they are the compiler's own.
 * On an AVX2 CPU (with FMA, F16C, BMI2) the 512-bit ones the kernels call are defined here on pairs of
 * 256-bit registers, each with the AVX-512 instruction's exact result (lane for lane, bit for bit, the
 * same float operations in the same order), so an AVX2 build computes what the AVX-512 build computes:
 * the same logits, the same tokens, llama.cpp's bits wherever the AVX-512 build has them.
 *
 * Only what qmatmul.c, ops.c and ggml_order.h call is here; a kernel that calls another 512-bit
 * intrinsic fails to build on AVX2 ("target specific option mismatch"): add it here, tested by the
 * same bit-for-bit tests on an AVX2 machine. Masks are plain integers (bit i = lane i). */
#ifndef SHARPI_X86SIMD_H
#define SHARPI_X86SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "sharpi's kernels need AVX-512 (F, BW, VL) or AVX2 with FMA and F16C"
#endif
#define SHARPI_AVX512_EMULATED 1

#define EI static inline __attribute__((always_inline))

typedef struct { __m256 lo, hi; } sx_m512;
typedef struct { __m256i lo, hi; } sx_m512i;
/* the GCC vector types of these names stay declared by immintrin.h; the kernels' uses mean ours */
#define __m512 sx_m512
#define __m512i sx_m512i
#define __mmask16 uint16_t
#define __mmask32 uint32_t
#define __mmask64 uint64_t

/* the compiler declares these (for AVX-512 targets); ours take their names from here on */
#undef _load_mask16
#define _load_mask16 sx_load_mask16
#undef _mm512_abs_epi8
#define _mm512_abs_epi8 sx_mm512_abs_epi8
#undef _mm512_abs_ps
#define _mm512_abs_ps sx_mm512_abs_ps
#undef _mm512_add_epi16
#define _mm512_add_epi16 sx_mm512_add_epi16
#undef _mm512_add_epi32
#define _mm512_add_epi32 sx_mm512_add_epi32
#undef _mm512_add_ps
#define _mm512_add_ps sx_mm512_add_ps
#undef _mm512_and_si512
#define _mm512_and_si512 sx_mm512_and_si512
#undef _mm512_andnot_ps
#define _mm512_andnot_ps sx_mm512_andnot_ps
#undef _mm512_broadcast_f32x4
#define _mm512_broadcast_f32x4 sx_mm512_broadcast_f32x4
#undef _mm512_broadcast_i32x4
#define _mm512_broadcast_i32x4 sx_mm512_broadcast_i32x4
#undef _mm512_broadcast_i64x4
#define _mm512_broadcast_i64x4 sx_mm512_broadcast_i64x4
#undef _mm512_castps256_ps512
#define _mm512_castps256_ps512 sx_mm512_castps256_ps512
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 sx_mm512_castps512_ps256
#undef _mm512_castps_si512
#define _mm512_castps_si512 sx_mm512_castps_si512
#undef _mm512_castsi256_si512
#define _mm512_castsi256_si512 sx_mm512_castsi256_si512
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps sx_mm512_castsi512_ps
#undef _mm512_castsi512_si128
#define _mm512_castsi512_si128 sx_mm512_castsi512_si128
#undef _mm512_castsi512_si256
#define _mm512_castsi512_si256 sx_mm512_castsi512_si256
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps sx_mm512_cvtepi32_ps
#undef _mm512_cvtepi8_epi16
#define _mm512_cvtepi8_epi16 sx_mm512_cvtepi8_epi16
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 sx_mm512_cvtepi8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 sx_mm512_cvtepu16_epi32
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 sx_mm512_cvtepu8_epi16
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 sx_mm512_cvtepu8_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps sx_mm512_cvtph_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 sx_mm512_cvtps_epi32
#undef _mm512_cvtsepi32_epi8
#define _mm512_cvtsepi32_epi8 sx_mm512_cvtsepi32_epi8
#undef _mm512_cvtss_f32
#define _mm512_cvtss_f32 sx_mm512_cvtss_f32
#undef _mm512_div_ps
#define _mm512_div_ps sx_mm512_div_ps
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps sx_mm512_dpbf16_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps sx_mm512_fmadd_ps
#undef _mm512_fmsub_ps
#define _mm512_fmsub_ps sx_mm512_fmsub_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps sx_mm512_fnmadd_ps
#undef _mm512_inserti64x4
#define _mm512_inserti64x4 sx_mm512_inserti64x4
#undef _mm512_load_si512
#define _mm512_load_si512 sx_mm512_load_si512
#undef _mm512_loadu_ps
#define _mm512_loadu_ps sx_mm512_loadu_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 sx_mm512_loadu_si512
#undef _mm512_madd_epi16
#define _mm512_madd_epi16 sx_mm512_madd_epi16
#undef _mm512_maddubs_epi16
#define _mm512_maddubs_epi16 sx_mm512_maddubs_epi16
#undef _mm512_mask_add_epi8
#define _mm512_mask_add_epi8 sx_mm512_mask_add_epi8
#undef _mm512_mask_blend_ps
#define _mm512_mask_blend_ps sx_mm512_mask_blend_ps
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps sx_mm512_mask_mov_ps
#undef _mm512_mask_permutexvar_ps
#define _mm512_mask_permutexvar_ps sx_mm512_mask_permutexvar_ps
#undef _mm512_mask_reduce_add_epi32
#define _mm512_mask_reduce_add_epi32 sx_mm512_mask_reduce_add_epi32
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps sx_mm512_mask_storeu_ps
#undef _mm512_mask_sub_epi8
#define _mm512_mask_sub_epi8 sx_mm512_mask_sub_epi8
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps sx_mm512_maskz_loadu_ps
#undef _mm512_maskz_permutexvar_epi16
#define _mm512_maskz_permutexvar_epi16 sx_mm512_maskz_permutexvar_epi16
#undef _mm512_max_ps
#define _mm512_max_ps sx_mm512_max_ps
#undef _mm512_min_epi32
#define _mm512_min_epi32 sx_mm512_min_epi32
#undef _mm512_movepi8_mask
#define _mm512_movepi8_mask sx_mm512_movepi8_mask
#undef _mm512_mul_ps
#define _mm512_mul_ps sx_mm512_mul_ps
#undef _mm512_permutex2var_epi32
#define _mm512_permutex2var_epi32 sx_mm512_permutex2var_epi32
#undef _mm512_permutex2var_epi64
#define _mm512_permutex2var_epi64 sx_mm512_permutex2var_epi64
#undef _mm512_permutexvar_epi16
#define _mm512_permutexvar_epi16 sx_mm512_permutexvar_epi16
#undef _mm512_permutexvar_epi32
#define _mm512_permutexvar_epi32 sx_mm512_permutexvar_epi32
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps sx_mm512_permutexvar_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 sx_mm512_reduce_add_epi32
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps sx_mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps sx_mm512_reduce_max_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps sx_mm512_scalef_ps
#undef _mm512_set1_epi16
#define _mm512_set1_epi16 sx_mm512_set1_epi16
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 sx_mm512_set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 sx_mm512_set1_epi8
#undef _mm512_set1_ps
#define _mm512_set1_ps sx_mm512_set1_ps
#undef _mm512_set_epi16
#define _mm512_set_epi16 sx_mm512_set_epi16
#undef _mm512_set_epi64
#define _mm512_set_epi64 sx_mm512_set_epi64
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 sx_mm512_setr_epi32
#undef _mm512_setr_epi64
#define _mm512_setr_epi64 sx_mm512_setr_epi64
#undef _mm512_setr_ps
#define _mm512_setr_ps sx_mm512_setr_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps sx_mm512_setzero_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 sx_mm512_setzero_si512
#undef _mm512_shuffle_epi8
#define _mm512_shuffle_epi8 sx_mm512_shuffle_epi8
#undef _mm512_shuffle_i64x2
#define _mm512_shuffle_i64x2 sx_mm512_shuffle_i64x2
#undef _mm512_srlv_epi64
#define _mm512_srlv_epi64 sx_mm512_srlv_epi64
#undef _mm512_store_ps
#define _mm512_store_ps sx_mm512_store_ps
#undef _mm512_store_si512
#define _mm512_store_si512 sx_mm512_store_si512
#undef _mm512_storeu_ps
#define _mm512_storeu_ps sx_mm512_storeu_ps
#undef _mm512_sub_epi16
#define _mm512_sub_epi16 sx_mm512_sub_epi16
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 sx_mm512_sub_epi32
#undef _mm512_sub_ps
#define _mm512_sub_ps sx_mm512_sub_ps
#undef _mm512_ternarylogic_epi32
#define _mm512_ternarylogic_epi32 sx_mm512_ternarylogic_epi32
#undef _mm512_test_epi8_mask
#define _mm512_test_epi8_mask sx_mm512_test_epi8_mask
#undef _mm512_unpackhi_epi32
#define _mm512_unpackhi_epi32 sx_mm512_unpackhi_epi32
#undef _mm512_unpackhi_epi64
#define _mm512_unpackhi_epi64 sx_mm512_unpackhi_epi64
#undef _mm512_unpacklo_epi32
#define _mm512_unpacklo_epi32 sx_mm512_unpacklo_epi32
#undef _mm512_unpacklo_epi64
#define _mm512_unpacklo_epi64 sx_mm512_unpacklo_epi64
#undef _mm512_xor_ps
#define _mm512_xor_ps sx_mm512_xor_ps
#undef _mm512_or_si512
#define _mm512_or_si512 sx_mm512_or_si512
#undef _mm512_xor_si512
#define _mm512_xor_si512 sx_mm512_xor_si512
#undef _mm512_zextsi256_si512
#define _mm512_zextsi256_si512 sx_mm512_zextsi256_si512
#undef _mm_test_epi8_mask
#define _mm_test_epi8_mask sx_mm_test_epi8_mask

EI sx_m512 sx_ps(__m256 lo, __m256 hi) { sx_m512 r = {lo, hi}; return r; }
EI sx_m512i sx_si(__m256i lo, __m256i hi) { sx_m512i r = {lo, hi}; return r; }

/* a mask's 8 bits (from bit `at`) as 8 x 32-bit lanes of all ones / zeros */
EI __m256i sx_mask8x32(uint32_t k, int at) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(k >> at)), bits), bits);
}
/* a mask's 16 bits (from bit `at`) as 16 x 16-bit lanes */
EI __m256i sx_mask16x16(uint32_t k, int at) {
    const __m256i bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, (short)-32768);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)(k >> at)), bits), bits);
}
/* a mask's 32 bits (from bit `at`) as 32 x 8-bit lanes */
EI __m256i sx_mask32x8(uint64_t k, int at) {
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)(uint32_t)(k >> at)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(rep, bits), bits);
}

/* ---- float ---- */
#define SX_PS2(name, op) EI sx_m512 name(sx_m512 a, sx_m512 b) { return sx_ps(op(a.lo, b.lo), op(a.hi, b.hi)); }
SX_PS2(_mm512_add_ps, _mm256_add_ps)
SX_PS2(_mm512_sub_ps, _mm256_sub_ps)
SX_PS2(_mm512_mul_ps, _mm256_mul_ps)
SX_PS2(_mm512_div_ps, _mm256_div_ps)
SX_PS2(_mm512_max_ps, _mm256_max_ps)
SX_PS2(_mm512_andnot_ps, _mm256_andnot_ps)
SX_PS2(_mm512_xor_ps, _mm256_xor_ps)
#define SX_PS3(name, op) \
    EI sx_m512 name(sx_m512 a, sx_m512 b, sx_m512 c) { return sx_ps(op(a.lo, b.lo, c.lo), op(a.hi, b.hi, c.hi)); }
SX_PS3(_mm512_fmadd_ps, _mm256_fmadd_ps)
SX_PS3(_mm512_fmsub_ps, _mm256_fmsub_ps)
SX_PS3(_mm512_fnmadd_ps, _mm256_fnmadd_ps)
EI sx_m512 _mm512_abs_ps(sx_m512 a) { return _mm512_andnot_ps(sx_ps(_mm256_set1_ps(-0.0f), _mm256_set1_ps(-0.0f)), a); }
EI sx_m512 _mm512_setzero_ps(void) { return sx_ps(_mm256_setzero_ps(), _mm256_setzero_ps()); }
EI sx_m512 _mm512_set1_ps(float v) { return sx_ps(_mm256_set1_ps(v), _mm256_set1_ps(v)); }
EI sx_m512 _mm512_setr_ps(float a0, float a1, float a2, float a3, float a4, float a5, float a6, float a7, float a8,
                          float a9, float a10, float a11, float a12, float a13, float a14, float a15) {
    return sx_ps(_mm256_setr_ps(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_ps(a8, a9, a10, a11, a12, a13, a14, a15));
}
EI sx_m512 _mm512_loadu_ps(const void *p) { return sx_ps(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)); }
EI void _mm512_storeu_ps(void *p, sx_m512 a) { _mm256_storeu_ps((float *)p, a.lo); _mm256_storeu_ps((float *)p + 8, a.hi); }
EI void _mm512_store_ps(void *p, sx_m512 a) { _mm256_store_ps((float *)p, a.lo); _mm256_store_ps((float *)p + 8, a.hi); }
/* masked lanes are not read / written (vmaskmovps), as AVX-512's do not fault on them */
EI sx_m512 _mm512_maskz_loadu_ps(uint16_t k, const void *p) {
    return sx_ps(_mm256_maskload_ps((const float *)p, sx_mask8x32(k, 0)), _mm256_maskload_ps((const float *)p + 8, sx_mask8x32(k, 8)));
}
EI void _mm512_mask_storeu_ps(void *p, uint16_t k, sx_m512 a) {
    _mm256_maskstore_ps((float *)p, sx_mask8x32(k, 0), a.lo);
    _mm256_maskstore_ps((float *)p + 8, sx_mask8x32(k, 8), a.hi);
}
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, pred) ((uint16_t)( \
    (unsigned)_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, (pred))) | \
    (unsigned)_mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, (pred))) << 8))
/* lanes whose mask bit is set come from b, the others from a */
EI sx_m512 _mm512_mask_blend_ps(uint16_t k, sx_m512 a, sx_m512 b) {
    return sx_ps(_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(sx_mask8x32(k, 0))),
                 _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(sx_mask8x32(k, 8))));
}
EI sx_m512 _mm512_mask_mov_ps(sx_m512 src, uint16_t k, sx_m512 a) { return _mm512_mask_blend_ps(k, src, a); }
/* r[i] = a[idx[i] & 15] */
EI __m256 sx_perm16_ps(__m256i idx, sx_m512 a) {
    const __m256 fromhi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)); /* bit 3 -> the sign bit */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(a.lo, idx), _mm256_permutevar8x32_ps(a.hi, idx), fromhi);
}
EI sx_m512 _mm512_permutexvar_ps(sx_m512i idx, sx_m512 a) { return sx_ps(sx_perm16_ps(idx.lo, a), sx_perm16_ps(idx.hi, a)); }
EI sx_m512 _mm512_mask_permutexvar_ps(sx_m512 src, uint16_t k, sx_m512i idx, sx_m512 a) {
    return _mm512_mask_blend_ps(k, src, _mm512_permutexvar_ps(idx, a));
}
/* the low 4 bits of the immediate: _mm256_round_ps's encoding (the kernels use scale 0) */
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) sx_ps(_mm256_round_ps((a).lo, (imm) & 15), _mm256_round_ps((a).hi, (imm) & 15))
/* a * 2^floor(b) (vscalefps) for finite a, b: as two exact power-of-two factors, each a normal float for
 * |floor(b)| <= 252, so the result is rounded once, as vscalefps rounds it (denormals included) */
EI __m256 sx_pow2i(__m256 n) { /* 2^n for integral n in [-126, 127] */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
EI __m256 sx_scalef8(__m256 a, __m256 b) {
    const __m256 n = _mm256_floor_ps(b);
    const __m256 n1 = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
    return _mm256_mul_ps(_mm256_mul_ps(a, sx_pow2i(n1)), sx_pow2i(_mm256_sub_ps(n, n1)));
}
EI sx_m512 _mm512_scalef_ps(sx_m512 a, sx_m512 b) { return sx_ps(sx_scalef8(a.lo, b.lo), sx_scalef8(a.hi, b.hi)); }
EI sx_m512 _mm512_cvtepi32_ps(sx_m512i a) { return sx_ps(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
EI sx_m512i _mm512_cvtps_epi32(sx_m512 a) { return sx_si(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)); }
EI sx_m512 _mm512_cvtph_ps(__m256i a) {
    return sx_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
}
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(a, imm) _mm256_set_m128i(_mm256_cvtps_ph((a).hi, (imm)), _mm256_cvtps_ph((a).lo, (imm)))
EI float _mm512_cvtss_f32(sx_m512 a) { return _mm256_cvtss_f32(a.lo); }
/* GCC's orders: (high 256 op low 256), (high 128 op low 128), lanes {0,1} op {2,3}, then lane 0 op lane 1 */
EI float _mm512_reduce_add_ps(sx_m512 a) {
    const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
EI float _mm512_reduce_max_ps(sx_m512 a) {
    const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
#undef _mm512_extractf32x8_ps
#define _mm512_extractf32x8_ps(a, i) ((i) ? (a).hi : (a).lo)
#undef _mm512_extractf32x4_ps
#define _mm512_extractf32x4_ps(a, i) _mm256_extractf128_ps(((i) >> 1) ? (a).hi : (a).lo, (i) & 1)
EI __m256 _mm512_castps512_ps256(sx_m512 a) { return a.lo; }
EI sx_m512 _mm512_castps256_ps512(__m256 a) { return sx_ps(a, _mm256_setzero_ps()); }
EI sx_m512i _mm512_castps_si512(sx_m512 a) { return sx_si(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)); }
EI sx_m512 _mm512_castsi512_ps(sx_m512i a) { return sx_ps(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }
EI sx_m512 _mm512_broadcast_f32x4(__m128 a) { const __m256 v = _mm256_set_m128(a, a); return sx_ps(v, v); }

/* ---- integer ---- */
#define SX_SI2(name, op) EI sx_m512i name(sx_m512i a, sx_m512i b) { return sx_si(op(a.lo, b.lo), op(a.hi, b.hi)); }
SX_SI2(_mm512_add_epi16, _mm256_add_epi16)
SX_SI2(_mm512_add_epi32, _mm256_add_epi32)
SX_SI2(_mm512_sub_epi16, _mm256_sub_epi16)
SX_SI2(_mm512_sub_epi32, _mm256_sub_epi32)
SX_SI2(_mm512_and_si512, _mm256_and_si256)
SX_SI2(_mm512_or_si512, _mm256_or_si256)
SX_SI2(_mm512_xor_si512, _mm256_xor_si256)
SX_SI2(_mm512_madd_epi16, _mm256_madd_epi16)
SX_SI2(_mm512_maddubs_epi16, _mm256_maddubs_epi16)
SX_SI2(_mm512_min_epi32, _mm256_min_epi32)
SX_SI2(_mm512_shuffle_epi8, _mm256_shuffle_epi8)
SX_SI2(_mm512_unpacklo_epi32, _mm256_unpacklo_epi32)
SX_SI2(_mm512_unpackhi_epi32, _mm256_unpackhi_epi32)
SX_SI2(_mm512_unpacklo_epi64, _mm256_unpacklo_epi64)
SX_SI2(_mm512_unpackhi_epi64, _mm256_unpackhi_epi64)
SX_SI2(_mm512_srlv_epi64, _mm256_srlv_epi64)
EI sx_m512i _mm512_abs_epi8(sx_m512i a) { return sx_si(_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)); }
#undef _mm512_slli_epi16
#define _mm512_slli_epi16(a, n) sx_si(_mm256_slli_epi16((a).lo, (n)), _mm256_slli_epi16((a).hi, (n)))
#undef _mm512_slli_epi32
#define _mm512_slli_epi32(a, n) sx_si(_mm256_slli_epi32((a).lo, (n)), _mm256_slli_epi32((a).hi, (n)))
#undef _mm512_srli_epi16
#define _mm512_srli_epi16(a, n) sx_si(_mm256_srli_epi16((a).lo, (n)), _mm256_srli_epi16((a).hi, (n)))
#undef _mm512_srli_epi32
#define _mm512_srli_epi32(a, n) sx_si(_mm256_srli_epi32((a).lo, (n)), _mm256_srli_epi32((a).hi, (n)))
#undef _mm512_srai_epi16
#define _mm512_srai_epi16(a, n) sx_si(_mm256_srai_epi16((a).lo, (n)), _mm256_srai_epi16((a).hi, (n)))
#undef _mm512_shuffle_epi32
#define _mm512_shuffle_epi32(a, imm) sx_si(_mm256_shuffle_epi32((a).lo, (imm)), _mm256_shuffle_epi32((a).hi, (imm)))
EI __m256i sx_ternary(__m256i a, __m256i b, __m256i c, const int imm) {
    if (imm == 0xE4) return _mm256_or_si256(_mm256_and_si256(a, c), _mm256_andnot_si256(c, b)); /* c ? a : b, bitwise */
    const __m256i ones = _mm256_set1_epi32(-1);
    __m256i r = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++)
        if (imm >> i & 1)
            r = _mm256_or_si256(r, _mm256_and_si256(_mm256_and_si256(i & 4 ? a : _mm256_xor_si256(a, ones), i & 2 ? b : _mm256_xor_si256(b, ones)),
                                                    i & 1 ? c : _mm256_xor_si256(c, ones)));
    return r;
}
EI sx_m512i _mm512_ternarylogic_epi32(sx_m512i a, sx_m512i b, sx_m512i c, const int imm) {
    return sx_si(sx_ternary(a.lo, b.lo, c.lo, imm), sx_ternary(a.hi, b.hi, c.hi, imm));
}
EI sx_m512i _mm512_setzero_si512(void) { return sx_si(_mm256_setzero_si256(), _mm256_setzero_si256()); }
EI sx_m512i _mm512_set1_epi8(char v) { return sx_si(_mm256_set1_epi8(v), _mm256_set1_epi8(v)); }
EI sx_m512i _mm512_set1_epi16(short v) { return sx_si(_mm256_set1_epi16(v), _mm256_set1_epi16(v)); }
EI sx_m512i _mm512_set1_epi32(int v) { return sx_si(_mm256_set1_epi32(v), _mm256_set1_epi32(v)); }
EI sx_m512i _mm512_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9, int a10,
                              int a11, int a12, int a13, int a14, int a15) {
    return sx_si(_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15));
}
EI sx_m512i _mm512_setr_epi64(long long a0, long long a1, long long a2, long long a3, long long a4, long long a5,
                              long long a6, long long a7) {
    return sx_si(_mm256_setr_epi64x(a0, a1, a2, a3), _mm256_setr_epi64x(a4, a5, a6, a7));
}
EI sx_m512i _mm512_set_epi64(long long a7, long long a6, long long a5, long long a4, long long a3, long long a2,
                             long long a1, long long a0) {
    return sx_si(_mm256_set_epi64x(a3, a2, a1, a0), _mm256_set_epi64x(a7, a6, a5, a4));
}
EI sx_m512i _mm512_set_epi16(short a31, short a30, short a29, short a28, short a27, short a26, short a25, short a24,
                             short a23, short a22, short a21, short a20, short a19, short a18, short a17, short a16,
                             short a15, short a14, short a13, short a12, short a11, short a10, short a9, short a8,
                             short a7, short a6, short a5, short a4, short a3, short a2, short a1, short a0) {
    return sx_si(_mm256_set_epi16(a15, a14, a13, a12, a11, a10, a9, a8, a7, a6, a5, a4, a3, a2, a1, a0),
                 _mm256_set_epi16(a31, a30, a29, a28, a27, a26, a25, a24, a23, a22, a21, a20, a19, a18, a17, a16));
}
EI sx_m512i _mm512_loadu_si512(const void *p) {
    return sx_si(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
EI sx_m512i _mm512_load_si512(const void *p) {
    return sx_si(_mm256_load_si256((const __m256i *)p), _mm256_load_si256((const __m256i *)p + 1));
}
EI void _mm512_store_si512(void *p, sx_m512i a) { _mm256_store_si256((__m256i *)p, a.lo); _mm256_store_si256((__m256i *)p + 1, a.hi); }
EI sx_m512i _mm512_cvtepi8_epi16(__m256i a) {
    return sx_si(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1)));
}
EI sx_m512i _mm512_cvtepu8_epi16(__m256i a) {
    return sx_si(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1)));
}
EI sx_m512i _mm512_cvtepi8_epi32(__m128i a) { return sx_si(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))); }
EI sx_m512i _mm512_cvtepu8_epi32(__m128i a) { return sx_si(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))); }
EI sx_m512i _mm512_cvtepu16_epi32(__m256i a) {
    return sx_si(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
/* 16 x int32 -> 16 x int8, saturated (through int16: the same clamps) */
EI __m128i _mm512_cvtsepi32_epi8(sx_m512i a) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
EI uint64_t _mm512_movepi8_mask(sx_m512i a) {
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(a.lo) | (uint64_t)(uint32_t)_mm256_movemask_epi8(a.hi) << 32;
}
EI uint64_t _mm512_test_epi8_mask(sx_m512i a, sx_m512i b) {
    const __m256i z = _mm256_setzero_si256();
    const uint32_t lo = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(a.lo, b.lo), z));
    const uint32_t hi = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(a.hi, b.hi), z));
    return (uint64_t)lo | (uint64_t)hi << 32;
}
EI uint16_t _mm_test_epi8_mask(__m128i a, __m128i b) {
    return (uint16_t)~_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(a, b), _mm_setzero_si128()));
}
EI sx_m512i _mm512_mask_add_epi8(sx_m512i src, uint64_t k, sx_m512i a, sx_m512i b) {
    return sx_si(_mm256_blendv_epi8(src.lo, _mm256_add_epi8(a.lo, b.lo), sx_mask32x8(k, 0)),
                 _mm256_blendv_epi8(src.hi, _mm256_add_epi8(a.hi, b.hi), sx_mask32x8(k, 32)));
}
EI sx_m512i _mm512_mask_sub_epi8(sx_m512i src, uint64_t k, sx_m512i a, sx_m512i b) {
    return sx_si(_mm256_blendv_epi8(src.lo, _mm256_sub_epi8(a.lo, b.lo), sx_mask32x8(k, 0)),
                 _mm256_blendv_epi8(src.hi, _mm256_sub_epi8(a.hi, b.hi), sx_mask32x8(k, 32)));
}
/* r[i] = a[idx[i] & 15] over 32-bit lanes */
EI __m256i sx_perm16_epi32(__m256i idx, sx_m512i a) {
    const __m256 fromhi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_permutevar8x32_epi32(a.lo, idx)),
                                                _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(a.hi, idx)), fromhi));
}
EI sx_m512i _mm512_permutexvar_epi32(sx_m512i idx, sx_m512i a) { return sx_si(sx_perm16_epi32(idx.lo, a), sx_perm16_epi32(idx.hi, a)); }
/* r[i] = (idx[i] & 16 ? b : a)[idx[i] & 15] */
EI __m256i sx_perm2x16_epi32(__m256i idx, sx_m512i a, sx_m512i b) {
    const __m256 fromb = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(sx_perm16_epi32(idx, a)),
                                                _mm256_castsi256_ps(sx_perm16_epi32(idx, b)), fromb));
}
EI sx_m512i _mm512_permutex2var_epi32(sx_m512i a, sx_m512i idx, sx_m512i b) {
    return sx_si(sx_perm2x16_epi32(idx.lo, a, b), sx_perm2x16_epi32(idx.hi, a, b));
}
/* 64-bit lane j of a, b (j < 8 of a, else of b) = 32-bit lanes 2j, 2j + 1 of the pair */
EI __m256i sx_idx64to32(__m256i idx) {
    const __m256i j2 = _mm256_slli_epi64(_mm256_and_si256(idx, _mm256_set1_epi64x(15)), 1);
    return _mm256_or_si256(j2, _mm256_slli_epi64(_mm256_add_epi64(j2, _mm256_set1_epi64x(1)), 32));
}
EI sx_m512i _mm512_permutex2var_epi64(sx_m512i a, sx_m512i idx, sx_m512i b) {
    return _mm512_permutex2var_epi32(a, sx_si(sx_idx64to32(idx.lo), sx_idx64to32(idx.hi)), b);
}
/* r[i] = a[idx[i] & 31] over 16-bit lanes: each of a's four 128-bit lanes, broadcast, byte-shuffled, and the
 * one idx names taken */
EI __m256i sx_perm32_epi16(__m256i idx, sx_m512i a) {
    const __m256i i5 = _mm256_and_si256(idx, _mm256_set1_epi16(31));
    /* byte pair (2 (i & 7), 2 (i & 7) + 1) within a 128-bit lane */
    const __m256i w = _mm256_slli_epi16(_mm256_and_si256(i5, _mm256_set1_epi16(7)), 1);
    const __m256i bytes = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_add_epi16(w, _mm256_set1_epi16(1)), 8));
    const __m256i lane = _mm256_srli_epi16(i5, 3);
    const __m256i l0 = _mm256_permute2x128_si256(a.lo, a.lo, 0x00), l1 = _mm256_permute2x128_si256(a.lo, a.lo, 0x11);
    const __m256i l2 = _mm256_permute2x128_si256(a.hi, a.hi, 0x00), l3 = _mm256_permute2x128_si256(a.hi, a.hi, 0x11);
    __m256i r = _mm256_shuffle_epi8(l0, bytes);
    r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(l1, bytes), _mm256_cmpeq_epi16(lane, _mm256_set1_epi16(1)));
    r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(l2, bytes), _mm256_cmpeq_epi16(lane, _mm256_set1_epi16(2)));
    return _mm256_blendv_epi8(r, _mm256_shuffle_epi8(l3, bytes), _mm256_cmpeq_epi16(lane, _mm256_set1_epi16(3)));
}
EI sx_m512i _mm512_permutexvar_epi16(sx_m512i idx, sx_m512i a) { return sx_si(sx_perm32_epi16(idx.lo, a), sx_perm32_epi16(idx.hi, a)); }
EI sx_m512i _mm512_maskz_permutexvar_epi16(uint32_t k, sx_m512i idx, sx_m512i a) {
    const sx_m512i p = _mm512_permutexvar_epi16(idx, a);
    return sx_si(_mm256_and_si256(p.lo, sx_mask16x16(k, 0)), _mm256_and_si256(p.hi, sx_mask16x16(k, 16)));
}
/* 128-bit lane i (0-3) of a */
EI __m128i sx_lane128(sx_m512i a, const int i) {
    const __m256i h = i >> 1 ? a.hi : a.lo;
    return i & 1 ? _mm256_extracti128_si256(h, 1) : _mm256_castsi256_si128(h);
}
/* vperm2i128's selector 0-3 is the 128-bit lane of (lo, hi): one instruction per half */
EI sx_m512i _mm512_shuffle_i64x2(sx_m512i a, sx_m512i b, const int imm) {
    return sx_si(_mm256_permute2x128_si256(a.lo, a.hi, (imm & 3) | (imm >> 2 & 3) << 4),
                 _mm256_permute2x128_si256(b.lo, b.hi, (imm >> 4 & 3) | (imm >> 6 & 3) << 4));
}
#undef _mm512_extracti32x4_epi32
#define _mm512_extracti32x4_epi32(a, i) sx_lane128((a), (i))
#undef _mm512_extracti64x4_epi64
#define _mm512_extracti64x4_epi64(a, i) ((i) ? (a).hi : (a).lo)
EI sx_m512i _mm512_inserti64x4(sx_m512i a, __m256i b, const int i) { return i ? sx_si(a.lo, b) : sx_si(b, a.hi); }
EI sx_m512i _mm512_broadcast_i64x4(__m256i a) { return sx_si(a, a); }
EI sx_m512i _mm512_broadcast_i32x4(__m128i a) { const __m256i v = _mm256_set_m128i(a, a); return sx_si(v, v); }
EI sx_m512i _mm512_castsi256_si512(__m256i a) { return sx_si(a, _mm256_setzero_si256()); }
EI sx_m512i _mm512_zextsi256_si512(__m256i a) { return sx_si(a, _mm256_setzero_si256()); }
EI __m256i _mm512_castsi512_si256(sx_m512i a) { return a.lo; }
EI __m128i _mm512_castsi512_si128(sx_m512i a) { return _mm256_castsi256_si128(a.lo); }
EI int sx_hsum_epi32(__m256i s) {
    __m128i t = _mm_add_epi32(_mm256_extracti128_si256(s, 1), _mm256_castsi256_si128(s));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(t) + _mm_extract_epi32(t, 1);
}
EI int _mm512_reduce_add_epi32(sx_m512i a) { return sx_hsum_epi32(_mm256_add_epi32(a.hi, a.lo)); }
EI int _mm512_mask_reduce_add_epi32(uint16_t k, sx_m512i a) {
    return sx_hsum_epi32(_mm256_add_epi32(_mm256_and_si256(a.hi, sx_mask8x32(k, 8)), _mm256_and_si256(a.lo, sx_mask8x32(k, 0))));
}
/* vdpbf16ps (AVX512-BF16), which ggml's bf16 dot products use where the CPU has it: per 32-bit lane
 * acc + (odd bf16 pair's product), then + (even pair's product), each step one rounding (a product of two
 * bf16 is exact in fp32: the fused multiply-add is that step), denormal inputs read as zero and denormal
 * results flushed to (signed) zero, as the instruction's definition says */
typedef sx_m512i sx_m512bh;
#define __m512bh sx_m512bh
EI __m256 sx_daz(__m256 v) {
    const __m256 e = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)));
    return _mm256_and_ps(v, _mm256_cmp_ps(e, _mm256_setzero_ps(), _CMP_NEQ_UQ));
}
EI __m256 sx_ftz(__m256 v) {
    const __m256 keep = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(0x1p-126f), _CMP_NLT_UQ);
    return _mm256_blendv_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), v, keep);
}
EI __m256 sx_dpbf16(__m256 acc, __m256i a, __m256i b) {
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 ao = sx_daz(_mm256_castsi256_ps(_mm256_and_si256(a, hi16)));
    const __m256 bo = sx_daz(_mm256_castsi256_ps(_mm256_and_si256(b, hi16)));
    const __m256 ae = sx_daz(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)));
    const __m256 be = sx_daz(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    return sx_ftz(_mm256_fmadd_ps(ae, be, sx_ftz(_mm256_fmadd_ps(ao, bo, sx_daz(acc)))));
}
EI sx_m512 _mm512_dpbf16_ps(sx_m512 acc, sx_m512bh a, sx_m512bh b) {
    return sx_ps(sx_dpbf16(acc.lo, a.lo, b.lo), sx_dpbf16(acc.hi, a.hi, b.hi));
}
EI uint16_t _load_mask16(const void *p) { uint16_t k; memcpy(&k, p, 2); return k; }

/* AVX-VNNI (the VEX-encoded vpdpbusd / vpdpwssd of AVX2 CPUs since Intel's Alder Lake, and of AMD's Zen 5): the
 * AVX512-VNNI instructions' integers on each half, in one instruction where the plain AVX2 build needs two to six
 * (qmatmul.c then builds as for VNNI). Not saturating, as AVX512-VNNI's vpdpbusd / vpdpwssd are not. */
#if defined(__AVXVNNI__)
#define SHARPI_AVX_VNNI 1
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 sx_mm512_dpbusd_epi32
#undef _mm512_dpwssd_epi32
#define _mm512_dpwssd_epi32 sx_mm512_dpwssd_epi32
EI sx_m512i _mm512_dpbusd_epi32(sx_m512i acc, sx_m512i u, sx_m512i s) {
    return sx_si(_mm256_dpbusd_avx_epi32(acc.lo, u.lo, s.lo), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, s.hi));
}
EI sx_m512i _mm512_dpwssd_epi32(sx_m512i acc, sx_m512i a, sx_m512i b) {
    return sx_si(_mm256_dpwssd_avx_epi32(acc.lo, a.lo, b.lo), _mm256_dpwssd_avx_epi32(acc.hi, a.hi, b.hi));
}
#endif

#undef SX_PS2
#undef SX_PS3
#undef SX_SI2
#undef EI
#endif /* AVX2 */

/* The 256-bit integer dot products of the kernels' AVX2-shaped code (both builds): per 32-bit lane, acc plus the sum
 * of 4 products of unsigned bytes u and signed bytes s (dpbusd8), or of 2 products of int16 (dpwssd8, modulo 2^32 as
 * vpmaddwd + vpaddd). Without VNNI dpbusd8 is vpmaddubsw + vpmaddwd, whose int16 pair sums saturate: callers pass
 * codes whose pairs cannot (|u| * 128 * 2 < 2^15, or |k| and q's sign trick). With VNNI (AVX512-VNNI with VL, or
 * AVX-VNNI) one instruction gives the same integer. */
static inline __attribute__((always_inline)) __m256i sx_dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline __attribute__((always_inline)) __m256i sx_dpwssd8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif
