/* sharpi CPU kernels: y[T, N] = x[T, K] @ dequant(W)[N, K]^T with W kept in its GGUF block format.
 *
 * Activations stay fp32. Each weight block is expanded to fp32 in registers (the value
 * gguf.quants.dequantize produces, up to one rounding where a K-quant / Q4_1 / Q5_1 table entry is
 * built with an FMA instead of numpy's separate multiply and add) and multiplied with FMAs.
 * Every block is read from memory once per call and used for up to 8 activation rows; larger T
 * loop over groups of 8 while the rows are still in L1.
 *
 * 4/5-bit codes become floats through a 16-entry table of dequantized values per (sub)block:
 * vpermps uses only the low 4 bits of each 32-bit lane, so a byte zero-extended to 32 bits indexes
 * its low nibble without masking and (byte >> 4) its high nibble. The 5th bit of Q5 types selects a
 * second table through a mask register (merge-masked vpermps). Q6_K codes are assembled as bytes
 * (64 at a time) and converted; Q8_0 / F16 / BF16 are converted directly.
 *
 * Register tiles: R weight rows x TT activation rows (R*TT <= 16 accumulators). Each (row, token)
 * pair has one accumulator and a fixed FMA order, so its result does not depend on T, R or the
 * thread count (a speculative verify pass reproduces single-token decoding bit for bit).
 * Rows are split over OpenMP threads in chunks taken from an atomic counter, and the next rows
 * are software-prefetched (the hardware streamers lose track of R interleaved row streams).
 *
 * dequant_rows() dequantizes bit-exactly (embedding lookups, and the tiles that cpu.py hands to
 * torch's sgemm for long inputs).
 *
 * On CPUs with AMX-INT8 the integer dot products of prompt passes on repacked Q4_K and on Q6_K weights
 * come from the tile unit instead (the AMX sections below): the same integers, so the same bits.
 *
 * Built with -O3 -march=native -fopenmp -ffp-contract=off: AVX-512F/BW/VL, or AVX2 + FMA + F16C + BMI2, where
 * x86simd.h computes the 512-bit intrinsics on 256-bit halves with the same results (cpu.py checks).
 * When torch is loaded first, the libgomp torch bundles has the soname libgomp.so.1, so this
 * library shares torch's OpenMP thread pool instead of starting a second one.
 */
#ifdef SHARPI_PYEXT /* also a CPython extension module (calls cost ~0.2 us instead of ctypes' ~3 us) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include "x86simd.h"
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_order.h"

#define INL static inline __attribute__((always_inline))

/* GGML type ids (gguf.GGMLQuantizationType values) */
enum {
    TY_F32 = 0, TY_F16 = 1, TY_Q4_0 = 2, TY_Q4_1 = 3, TY_Q5_0 = 6, TY_Q5_1 = 7, TY_Q8_0 = 8,
    TY_Q2_K = 10, TY_Q3_K = 11, TY_Q4_K = 12, TY_Q5_K = 13, TY_Q6_K = 14, TY_IQ4_NL = 20, TY_IQ4_XS = 23, TY_BF16 = 30, TY_MXFP4 = 39,
    /* (names of the kernel tables of llama.cpp's other orders: repacked weights, prompt processing) */
    TY_Q4_0_R8 = 1002, TY_IQ4_NL_R8 = 1020, TY_MXFP4_R8 = 1039, TY_IQ4_XS_TILED = 1023, TY_Q5_K_TILED = 1013, TY_Q2_K_GEMM = 1010, TY_Q3_K_TILED = 1011, TY_Q4_K_GEMM = 1012, TY_Q6_K_TILED = 1014,
    /* Q4_K repacked in groups of 4 rows (sharpi_repack_q4k; no GGML type has this id) */
    TY_Q4_KR = 212,
    /* Q4_1 repacked in groups of 4 rows */
    TY_Q4_1R = 203,
    TY_Q5_0R = 206,
};

/* fp16 -> fp32 for block scales: a table lookup is a plain load (vcvtph2ps costs 2 ALU uops). */
static float f16tab[65536];

/* MXFP4: twice the E2M1 value of each 4-bit code (ggml's kvalues_mxfp4); the block's E8M0 exponent e scales
 * them by 2^(e - 128) (GGML_E8M0_TO_FP32_HALF: the half makes up for the doubling) */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

__attribute__((constructor)) static void init_tables(void) {
    for (int i = 0; i < 65536; i++) f16tab[i] = _cvtsh_ss((unsigned short)i);
}

INL float f16at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16tab[h];
}

/* an MXFP4 block's scale: 2^(e - 128), exact in fp32 (the denormal 2^-128 and 2^-127 for e < 2) */
INL float e8m0_half(const uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* the scale of a 32-element legacy-layout block (d in fp16, or MXFP4's exponent byte) */
INL float block_d(const int ty, const uint8_t *b) { return ty == TY_MXFP4 ? e8m0_half(b[0]) : f16at(b); }
/* IQ4_NL / MXFP4: the table a 4-bit code indexes */
INL const __m128i *nl_values(const int ty) { return (const __m128i *)(ty == TY_MXFP4 ? KVALUES_MXFP4 : KVALUES_IQ4NL); }

INL __m512i ld16u8(const uint8_t *p) { /* 16 bytes -> 16 x u32 */
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* Make a local array "escape" (compiler-only barrier): values stored to it before are really in
 * memory after it, so later uses become memory operands / broadcast loads instead of registers.
 * Used for the K-quant tables and scales, which would otherwise take registers from the
 * accumulators or turn into vpermd broadcasts on the already busy shuffle port. */
#define ESCAPE(p) __asm__ volatile("" : : "r"(p) : "memory")

#define IOTA _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* a*b + c: fused in the matmul, rounded like numpy (mul, then add) when dequantizing */
INL __m512 madd(const int exact, __m512 a, __m512 b, __m512 c) {
    return exact ? _mm512_add_ps(_mm512_mul_ps(a, b), c) : _mm512_fmadd_ps(a, b, c);
}
INL __m512 msub(const int exact, __m512 a, __m512 b, __m512 c) {
    return exact ? _mm512_sub_ps(_mm512_mul_ps(a, b), c) : _mm512_fmsub_ps(a, b, c);
}

/* ---------------------------------------------------------------------------------------------
 * Per type: UE elements / UB bytes per unit (block or super-block), NP pieces per unit, each piece
 * NV vectors of 16 weights. prep() builds the unit's tables, piece() expands piece p into w[] and
 * tells at which element offsets (within the unit) the vectors go.
 * ------------------------------------------------------------------------------------------- */
#define MAXTAB 16
#define MAXNV 4

typedef struct {
    __m512 t[MAXTAB];
    /* Q6_K / Q3_K: 16 scales d*sc, then 16 times -32*d*sc / -4*d*sc; Q2_K: 16 d*sc, then 16 dmin*m */
    float s[32];
    uint8_t q6[256] __attribute__((aligned(64))); /* Q6_K / Q3_K / Q2_K: the codes, one byte per element */
    int exact;
} Prep;

/* the K-quants with 16-element sub-blocks, IQ4_XS and Q5_K (codes prepared as bytes, activations in plain order) */
INL int k16(const int ty) { return ty == TY_Q6_K || ty == TY_Q3_K || ty == TY_Q2_K || ty == TY_IQ4_XS || ty == TY_Q5_K; }

INL int unit_elems(const int ty) {
    switch (ty) {
    case TY_Q2_K: case TY_Q3_K: case TY_Q4_K: case TY_Q5_K: case TY_Q6_K: case TY_IQ4_XS: return 256;
    default: return 32;
    }
}
INL int unit_bytes(const int ty) {
    switch (ty) {
    case TY_F16: case TY_BF16: return 64;
    case TY_Q4_0: case TY_IQ4_NL: return 18;
    case TY_MXFP4: return 17;
    case TY_Q4_1: return 20;
    case TY_Q5_0: return 22;
    case TY_Q5_1: return 24;
    case TY_Q8_0: return 34;
    case TY_Q2_K: return 84;
    case TY_Q3_K: return 110;
    case TY_Q4_K: return 144;
    case TY_Q5_K: return 176;
    case TY_Q6_K: return 210;
    case TY_IQ4_XS: return 136;
    default: return 0;
    }
}
INL int n_pieces(const int ty) {
    switch (ty) {
    case TY_Q2_K: case TY_Q3_K: case TY_Q4_K: case TY_Q5_K: case TY_Q6_K: case TY_IQ4_XS: return 8;
    default: return 1;
    }
}
INL int n_vecs(const int ty) { (void)ty; return 2; }

/* element offset (within the unit) of vector v of piece p */
INL int xoff(const int ty, const int p, const int v) {
    switch (ty) {
    case TY_Q4_K: case TY_Q5_K: /* chunk j = p/2 (32 qs bytes), half h = p%2; v=0 low nibbles, v=1 high */
        return 64 * (p >> 1) + 32 * v + 16 * (p & 1);
    default: /* Q6_K, Q3_K, Q2_K, IQ4_XS: pieces of 32 elements in order */
        return 32 * p + 16 * v;
    }
}

/* Q4_K / Q5_K: the 8 6-bit scales (bytes 0-7) and mins (bytes 8-15), packed in 12 bytes at b + 4 */
INL __m128i k4_scales_mins(const uint8_t *b) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t sc03 = u[0] & 0x3f3f3f3fu, m03 = u[1] & 0x3f3f3f3fu;
    const uint32_t sc47 = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
    const uint32_t m47 = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
    return _mm_setr_epi32((int)sc03, (int)sc47, (int)m03, (int)m47);
}

/* Q4_K / Q5_K: [d*sc_0..7, dmin*m_0..7] */
INL __m512 kquant_scales(const uint8_t *b) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scales_mins(b)));
    const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16at(b)), _mm512_set1_ps(f16at(b + 2)));
    return _mm512_mul_ps(f, dd);
}

/* [a >> s0 | a >> s1] per 16-bit lane: 32 bytes shifted into the two halves of a zmm (two uniform
 * shifts: also cheap where vpsrlvw is emulated) */
INL __m512i srli2_epi16(const __m256i a, const int s0, const int s1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(a, s0)), _mm256_srli_epi16(a, s1), 1);
}

/* Q6_K super-block b, half hf: its 128 6-bit codes as bytes, elements [128 hf, 128 hf + 64) in lo
 * and the next 64 in hi (see prep()). */
INL void q6k_codes(const uint8_t *b, int hf, __m512i *lo, __m512i *hi) {
    const __m512i m0f = _mm512_set1_epi8(0x0f), m33 = _mm512_set1_epi8(0x33);
    const __m512i L = _mm512_loadu_si512((const void *)(b + 64 * hf));
    const __m512i H2 = _mm512_and_si512(srli2_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * hf)), 0, 2), m33); /* bits 0-1 and 4-5 */
    /* vpternlogd imm 0xE4 = (a & c) | (b & ~c): low nibble from a, bits 4-7 from b */
    *lo = _mm512_ternarylogic_epi32(L, _mm512_slli_epi16(H2, 4), m0f, 0xE4);
    *hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(L, 4), H2, m0f, 0xE4);
}

/* Q3_K / Q2_K: the 2-bit codes of elements [128 hf, 128 hf + 128) from the 32 qs bytes q: element
 * 128 hf + 32 j + l is (q[l] >> 2j) & 3; lo = j 0, 1 and hi = j 2, 3 (64 each, plain order). Q3_K
 * (hm: its 32 hmask bytes) adds 4 where bit 4 hf + j of hm[l] is set: the code is then q + 4 with
 * the value d * sc * q. */
INL void k2bit_codes(const uint8_t *q, const uint8_t *hm, const int hf, __m512i *lo, __m512i *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    const __m512i m3 = _mm512_set1_epi8(3);
    /* 16-bit shifts: the bits that cross into a byte from its neighbour land above the 2 kept */
    *lo = _mm512_and_si512(srli2_epi16(v, 0, 2), m3);
    *hi = _mm512_and_si512(srli2_epi16(v, 4, 6), m3);
    if (hm) {
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)hm));
        const char b0 = (char)(1 << (4 * hf)), b1 = (char)(1 << (4 * hf + 1));
        const char b2 = (char)(1 << (4 * hf + 2)), b3 = (char)(1 << (4 * hf + 3));
        const __m512i t01 = _mm512_inserti64x4(_mm512_set1_epi8(b0), _mm256_set1_epi8(b1), 1);
        const __m512i t23 = _mm512_inserti64x4(_mm512_set1_epi8(b2), _mm256_set1_epi8(b3), 1);
        const __m512i four = _mm512_set1_epi8(4);
        *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(h, t01), *lo, four);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(h, t23), *hi, four);
    }
}

/* Q3_K: the 16 6-bit sub-block scales (12 bytes at b + 96) minus 32 */
INL void q3k_scales(const uint8_t *b, int8_t sc[16]) {
    uint32_t a[4];
    memcpy(a, b + 96, 12);
    const uint32_t t = a[2], m2 = 0x03030303u, m4 = 0x0f0f0f0fu;
    a[2] = ((a[0] >> 4) & m4) | (((t >> 4) & m2) << 4);
    a[3] = ((a[1] >> 4) & m4) | (((t >> 6) & m2) << 4);
    a[0] = (a[0] & m4) | ((t & m2) << 4);
    a[1] = (a[1] & m4) | (((t >> 2) & m2) << 4);
    _mm_storeu_si128((__m128i *)sc, _mm_sub_epi8(_mm_loadu_si128((const __m128i *)a), _mm_set1_epi8(32)));
}

/* IQ4_XS super-block b: its 256 weights' table values kvalues_iq4nl[q] (signed bytes) in plain order,
 * elements 64i .. 64i + 63 in v[i]; sub-block j (32 elements) has its low nibbles in qs[16j .. 16j + 16)
 * (elements 32j + l) and its high nibbles there too (elements 32j + 16 + l). */
INL void iq4xs_values(const uint8_t *b, __m512i v[4]) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i kv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL));
    const __m512i i0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), i1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { /* sub-blocks 4h .. 4h + 3 */
        const __m512i q = _mm512_loadu_si512((const void *)(b + 8 + 64 * h));
        const __m512i lo = _mm512_and_si512(q, m0f), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m0f);
        v[2 * h] = _mm512_shuffle_epi8(kv, _mm512_permutex2var_epi64(lo, i0, hi));
        v[2 * h + 1] = _mm512_shuffle_epi8(kv, _mm512_permutex2var_epi64(lo, i1, hi));
    }
}

/* IQ4_XS: the 8 6-bit sub-block scales minus 32 as bytes (byte j: sub-block j) */
INL uint64_t iq4xs_scales8(const uint8_t *b) {
    uint16_t h;
    uint32_t l;
    memcpy(&h, b + 2, 2);
    memcpy(&l, b + 4, 4);
    const uint64_t v = _pdep_u64(l, 0x0F0F0F0F0F0F0F0FULL) | (_pdep_u64(h, 0x0303030303030303ULL) << 4); /* 0..63 */
    return ((v | 0x8080808080808080ULL) - 0x2020202020202020ULL) ^ 0x8080808080808080ULL; /* bytewise - 32 */
}

/* codes of a Q3_K (hmask at b, qs at b + 32) or Q2_K (qs at b + 16) super-block into q[256] */
INL void k2bit_store(const int ty, const uint8_t *b, uint8_t *q) {
#pragma GCC unroll 2
    for (int hf = 0; hf < 2; hf++) {
        __m512i lo, hi;
        k2bit_codes(b + (ty == TY_Q3_K ? 32 : 16) + 32 * hf, ty == TY_Q3_K ? b : NULL, hf, &lo, &hi);
        _mm512_store_si512((void *)(q + 128 * hf), lo);
        _mm512_store_si512((void *)(q + 128 * hf + 64), hi);
    }
}

INL void prep(const int ty, const int exact, const uint8_t *b, Prep *P) {
    P->exact = exact;
    switch (ty) {
    case TY_Q4_0: {
        const __m512 d = _mm512_set1_ps(f16at(b));
        P->t[0] = _mm512_mul_ps(d, _mm512_sub_ps(IOTA, _mm512_set1_ps(8.f)));
        break;
    }
    case TY_IQ4_NL: case TY_MXFP4: /* w = d * kvalues[q] */
        P->t[0] = _mm512_mul_ps(_mm512_set1_ps(block_d(ty, b)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(nl_values(ty)))));
        break;
    case TY_Q4_1: { /* exact == 2: without the min (d * q, for the fp16 s term of Q8_1 activations) */
        const __m512 d = _mm512_set1_ps(f16at(b)), m = _mm512_set1_ps(exact == 2 ? 0.f : f16at(b + 2));
        P->t[0] = madd(exact, d, IOTA, m);
        break;
    }
    case TY_Q5_0: {
        const __m512 d = _mm512_set1_ps(f16at(b));
        P->t[0] = _mm512_mul_ps(d, _mm512_sub_ps(IOTA, _mm512_set1_ps(16.f)));
        P->t[1] = _mm512_mul_ps(d, IOTA);
        break;
    }
    case TY_Q5_1: {
        const __m512 d = _mm512_set1_ps(f16at(b)), m = _mm512_set1_ps(exact == 2 ? 0.f : f16at(b + 2));
        P->t[0] = madd(exact, d, IOTA, m);
        P->t[1] = madd(exact, d, _mm512_add_ps(IOTA, _mm512_set1_ps(16.f)), m);
        break;
    }
    case TY_Q4_K: {
        float dm[16] __attribute__((aligned(64)));
        _mm512_store_ps(dm, kquant_scales(b));
        ESCAPE(dm);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            P->t[j] = msub(exact, IOTA, _mm512_set1_ps(dm[j]), _mm512_set1_ps(dm[8 + j]));
        break;
    }
    case TY_Q5_K: {
        float dm[16] __attribute__((aligned(64)));
        _mm512_store_ps(dm, kquant_scales(b));
        ESCAPE(dm);
        const __m512 hi = _mm512_add_ps(IOTA, _mm512_set1_ps(16.f));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            P->t[2 * j] = msub(exact, IOTA, _mm512_set1_ps(dm[j]), _mm512_set1_ps(dm[8 + j]));
            P->t[2 * j + 1] = msub(exact, hi, _mm512_set1_ps(dm[j]), _mm512_set1_ps(dm[8 + j]));
        }
        break;
    }
    case TY_Q6_K: {
        /* 6-bit codes of all 256 elements as bytes, 64 at a time: for half hf, element l < 64 is
         * (ql[l] & 15) | ((qh[l % 32] >> 2*(l / 32)) & 3) << 4 and element 64 + l is
         * (ql[l] >> 4) | ((qh[l % 32] >> (4 + 2*(l / 32))) & 3) << 4. 16-bit shifts leak bits across
         * the bytes of a word only into bit positions that the masks / selects below drop. */
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; hf++) {
            __m512i lo, hi;
            q6k_codes(b, hf, &lo, &hi);
            _mm512_store_si512((void *)(P->q6 + 128 * hf), lo);
            _mm512_store_si512((void *)(P->q6 + 128 * hf + 64), hi);
        }
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
        const __m512 D = _mm512_mul_ps(_mm512_set1_ps(f16at(b + 208)), sc);
        _mm512_store_ps(P->s, D);
        _mm512_store_ps(P->s + 16, _mm512_mul_ps(D, _mm512_set1_ps(-32.f)));
        break;
    }
    case TY_Q3_K: { /* w = d * (sc - 32) * (q - 4), q the 3-bit code: fma(q, d_s, -4 d_s) as for Q6_K */
        k2bit_store(ty, b, P->q6);
        int8_t sc[16];
        q3k_scales(b, sc);
        const __m512 D = _mm512_mul_ps(_mm512_set1_ps(f16at(b + 108)),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
        _mm512_store_ps(P->s, D);
        _mm512_store_ps(P->s + 16, _mm512_mul_ps(D, _mm512_set1_ps(-4.f)));
        break;
    }
    case TY_IQ4_XS: { /* w = (d * (ls - 32)) * kv[q]: codes kv + 128, fma(code, d_s, -128 d_s) as for Q6_K */
        __m512i v[4];
        iq4xs_values(b, v);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) _mm512_store_si512((void *)(P->q6 + 64 * i), _mm512_xor_si512(v[i], _mm512_set1_epi8((char)0x80)));
        const float d = f16at(b);
        const uint64_t s8 = iq4xs_scales8(b);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            P->s[2 * j] = P->s[2 * j + 1] = d * (float)(int8_t)(s8 >> (8 * j));
            P->s[16 + 2 * j] = P->s[16 + 2 * j + 1] = -128.f * P->s[2 * j];
        }
        break;
    }
    case TY_Q2_K: { /* w = (d * sc) * q - dmin * m, sc / m the low / high nibble of scales[j] */
        k2bit_store(ty, b, P->q6);
        const __m512i sm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(15)));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4));
        _mm512_store_ps(P->s, _mm512_mul_ps(_mm512_set1_ps(f16at(b + 80)), sc));
        _mm512_store_ps(P->s + 16, _mm512_mul_ps(_mm512_set1_ps(f16at(b + 82)), mn));
        break;
    }
    default:
        break;
    }
}

/* Q6_K: 6-bit code q -> d_s * (q - 32) via one FMA; exact since -32*d_s is exact. */
INL __m512 q6val(__m512i q, const float *s, int is) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s[is]), _mm512_set1_ps(s[16 + is]));
}

INL void piece(const int ty, const int p, const uint8_t *b, const Prep *P, __m512 *w) {
    switch (ty) {
    case TY_F16:
        w[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        w[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        break;
    case TY_BF16:
        w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16));
        w[1] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32))), 16));
        break;
    case TY_Q4_0: case TY_Q4_1: case TY_IQ4_NL: case TY_MXFP4: {
        const __m512i q = ld16u8(b + (ty == TY_Q4_1 ? 4 : ty == TY_MXFP4 ? 1 : 2));
        w[0] = _mm512_permutexvar_ps(q, P->t[0]);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), P->t[0]);
        break;
    }
    case TY_Q5_0: case TY_Q5_1: {
        const int o = ty == TY_Q5_0 ? 2 : 4;
        /* the 32 high bits are the lane masks; kmovw from memory is a load, from a GPR a p5 uop */
        const __mmask16 k0 = _load_mask16((__mmask16 *)(b + o)), k1 = _load_mask16((__mmask16 *)(b + o + 2));
        const __m512i q = ld16u8(b + o + 4);
        const __m512i q1 = _mm512_srli_epi32(q, 4);
        w[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q, P->t[0]), k0, q, P->t[1]);
        w[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q1, P->t[0]), k1, q1, P->t[1]);
        break;
    }
    case TY_Q8_0: {
        const __m512 d = _mm512_set1_ps(f16at(b));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
        break;
    }
    case TY_Q4_K: {
        const int j = p >> 1, h = p & 1;
        const __m512i q = ld16u8(b + 16 + 32 * j + 16 * h);
        w[0] = _mm512_permutexvar_ps(q, P->t[2 * j]);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), P->t[2 * j + 1]);
        break;
    }
    case TY_Q5_K: {
        const int j = p >> 1, h = p & 1;
        const __m512i q = ld16u8(b + 48 + 32 * j + 16 * h);
        const __m512i q1 = _mm512_srli_epi32(q, 4);
        const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 16 + 16 * h));
        const __mmask16 k0 = _mm_test_epi8_mask(qh, _mm_set1_epi8((char)(1 << (2 * j))));
        const __mmask16 k1 = _mm_test_epi8_mask(qh, _mm_set1_epi8((char)(1 << (2 * j + 1))));
        w[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q, P->t[4 * j]), k0, q, P->t[4 * j + 1]);
        w[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q1, P->t[4 * j + 2]), k1, q1, P->t[4 * j + 3]);
        break;
    }
    case TY_Q6_K: case TY_Q3_K: case TY_IQ4_XS: {
        const __m512i q0 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(P->q6 + 32 * p)));
        const __m512i q1 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(P->q6 + 32 * p + 16)));
        w[0] = q6val(q0, P->s, 2 * p);
        w[1] = q6val(q1, P->s, 2 * p + 1);
        break;
    }
    case TY_Q2_K: { /* exactly numpy's (d * sc) * q - dmin * m when dequantizing */
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(P->q6 + 32 * p + 16 * v))));
            w[v] = msub(P->exact, q, _mm512_set1_ps(P->s[2 * p + v]), _mm512_set1_ps(P->s[16 + 2 * p + v]));
        }
        break;
    }
    default:
        break;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Register-tiled kernel: R weight rows x TT activation rows over the whole K. One accumulator per
 * (row, activation row) and a fixed FMA order: the result for a (row, token) pair is bitwise the
 * same whatever T, R and the thread count are (batch invariance: a speculative verify pass
 * reproduces single-token decoding exactly). R = 4 rows keep >= 4 FMA chains in flight at T = 1.
 * ------------------------------------------------------------------------------------------- */
#define MAXR 4
#define MAXT 8

/* software prefetch distance in bytes ahead of each row stream (0: off); into L2, the L1
 * prefetchers take it from there. sharpi_set_prefetch() is for tuning experiments. */
static long pf_dist = 4096;
void sharpi_set_prefetch(long bytes) { pf_dist = bytes; }

INL void kern(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nu,
              const float *x, const long ldx, float *y, const long ldy, const long pfo) {
    const int UE = unit_elems(ty), UB = unit_bytes(ty), NP = n_pieces(ty), NV = n_vecs(ty);
    __m512 acc[MAXR][MAXT];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();

    for (long u = 0; u < nu; u++) {
        if (pfo) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const char *pf = (const char *)rows[r] + pfo + u * UB;
#pragma GCC unroll 4
                for (int o = 0; o < UB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T1);
            }
        }
        Prep P[MAXR];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) prep(ty, 0, rows[r] + u * UB, &P[r]);
        if (NP > 1) ESCAPE(P); /* K-quant tables: read from L1 by vpermps, not held in registers */
        const float *xu = x + u * UE;
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) {
            __m512 w[MAXR][MAXNV];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) piece(ty, p, rows[r] + u * UB, &P[r], w[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
#pragma GCC unroll 8
                for (int t = 0; t < TT; t++) {
                    const __m512 xv = _mm512_loadu_ps(xu + t * ldx + xoff(ty, p, v));
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r][v], xv, acc[r][t]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

typedef void (*kern_fn)(const uint8_t *const *rows, long nu, const float *x, long ldx, float *y, long ldy, long pfo);

#define KDEF(TY, R, TT) \
    static void k_##TY##_##R##_##TT(const uint8_t *const *rows, long nu, const float *x, long ldx, float *y, long ldy, long pfo) { \
        kern(TY, R, TT, rows, nu, x, ldx, y, ldy, pfo); \
    }
/* (R, TT) shapes: TT = 1..8 activation rows; R weight rows chosen to fit 32 zmm registers */
#define KSET(TY) \
    KDEF(TY, 4, 1) KDEF(TY, 4, 2) KDEF(TY, 4, 3) KDEF(TY, 4, 4) \
    KDEF(TY, 2, 5) KDEF(TY, 2, 6) KDEF(TY, 2, 7) KDEF(TY, 2, 8) \
    static const kern_fn ktab_##TY[9] = {0, k_##TY##_4_1, k_##TY##_4_2, k_##TY##_4_3, k_##TY##_4_4, \
                                          k_##TY##_2_5, k_##TY##_2_6, k_##TY##_2_7, k_##TY##_2_8};
static const int kern_rows[9] = {0, 4, 4, 4, 4, 2, 2, 2, 2};

KSET(TY_F16)
KSET(TY_BF16)
KSET(TY_Q4_0)
KSET(TY_Q4_1)
KSET(TY_Q5_0)
KSET(TY_Q5_1)
KSET(TY_Q8_0)
KSET(TY_Q4_K)
KSET(TY_Q5_K)
KSET(TY_Q6_K)
KSET(TY_Q3_K)
KSET(TY_Q2_K)
KSET(TY_IQ4_NL)
KSET(TY_IQ4_XS)
KSET(TY_MXFP4)

static const kern_fn *ktab_for(int ty) {
    switch (ty) {
    case TY_F16: return ktab_TY_F16;
    case TY_BF16: return ktab_TY_BF16;
    case TY_Q4_0: return ktab_TY_Q4_0;
    case TY_Q4_1: return ktab_TY_Q4_1;
    case TY_Q5_0: return ktab_TY_Q5_0;
    case TY_Q5_1: return ktab_TY_Q5_1;
    case TY_Q8_0: return ktab_TY_Q8_0;
    case TY_Q4_K: return ktab_TY_Q4_K;
    case TY_Q5_K: return ktab_TY_Q5_K;
    case TY_Q6_K: return ktab_TY_Q6_K;
    case TY_Q3_K: return ktab_TY_Q3_K;
    case TY_Q2_K: return ktab_TY_Q2_K;
    case TY_IQ4_NL: return ktab_TY_IQ4_NL;
    case TY_IQ4_XS: return ktab_TY_IQ4_XS;
    case TY_MXFP4: return ktab_TY_MXFP4;
    default: return 0;
    }
}

/* elements / bytes per unit of the types qmatmul takes (the repacked layouts included), 0 for others */
static int ub_of(int ty) {
    return ty == TY_Q4_KR ? 148 /* R4B / 4 rows */ : ty == TY_Q4_1R ? 20 /* L4B / 4 rows */ : ty == TY_Q5_0R ? 22 /* L5B / 4 */
         : unit_bytes(ty);
}
static int ue_of(int ty) { return !ub_of(ty) ? 0 : ty == TY_Q4_KR ? 256 : ty == TY_Q4_1R || ty == TY_Q5_0R ? 32 : unit_elems(ty); }

/* =============================================================================================
 * Integer path: activations quantized the way ggml's x86 CPU backend quantizes them for the
 * weight's vec_dot_type, then integer dot products per block, as llama.cpp computes them.
 *
 *   Q4_0, Q5_0, Q8_0, IQ4_NL -> Q8_0; Q4_1, Q5_1 -> Q8_1 (ggml quantize_row_q8_0 / q8_1, AVX2 branch):
 *     amax = max |x| over 32, d = amax / 127 (stored as fp16), codes = round-half-even(x * (127 / amax));
 *     Q8_1 also s = fp16(d * sum(codes)) with the fp32 d.
 *   Q2_K .. Q6_K, IQ4_XS -> Q8_K (quantize_row_q8_K_ref; the x86 build has no SIMD version):
 *     max = the element of largest magnitude (first one), iscale = -127 / max,
 *     codes = min(127, round-half-even(iscale * x)), d = 1 / iscale (fp32), sums of 16 codes.
 *   F16 -> activations rounded to fp16; BF16 -> bf16 (then the fp32 kernel above).
 *
 * Per block the integer sums are exact; they become floats exactly in the order of llama.cpp's
 * x86 code (its AVX2 paths for the legacy types, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, which its AVX-512 builds take
 * too, and its AVX-512 Q2_K: see their sections below), so the results are the same bits as
 * llama.cpp's. mode 1 (decoding) gives a (row, token) the same bits for every T, tile shape and
 * thread count; mode 2 (prompt processing) follows llama.cpp where its order depends on T (Q4_K and
 * Q2_K repacked: groups of 4 tokens; Q6_K, Q5_K, Q3_K, IQ4_XS: the tiled matmul from 8 tokens on).
 *
 * Weight codes are unsigned bytes (Q4_0 / Q5_0 codes before their -8 / -16 offset, Q8_0 codes + 128),
 * activation codes signed: vpdpbusd (AVX512-VNNI) sums 4 products per 32-bit lane. The offsets are
 * taken out exactly by starting each lane's sum at -offset * (sum of its 4 activation codes),
 * precomputed with the activations. K-quants: vpmaddubsw (pairs, no saturation: codes <= 63) then
 * vpdpwssd with the 16-bit sub-block scales (an AVX2 CPU with AVX-VNNI: x86simd.h's pairs of 256-bit vpdpbusd /
 * vpdpwssd, and SHARPI_VNNI as with AVX512-VNNI). Without VNNI (most AVX2 CPUs) the same integers come
 * from vpmaddubsw + vpmaddwd where the codes cannot saturate it (dpbusd_u7, dpbusd_legacy, r4_tokens),
 * else from an exact emulation with vpmaddwd.
 *
 * The activations are quantized once per call into a per-thread scratch buffer, laid out per
 * weight type so that the weight side needs no shuffles:
 *   legacy types: per 64 elements (2 blocks, natural order) 192 bytes: codes[64], d_x per lane
 *     (16 f32: 8 x block 0, 8 x block 1), then 16 int32 offset starts or 16 f32 with s_x in lanes 0 and 8;
 *   K-quants, IQ4_XS: per 256 elements 384 bytes: codes[256] (Q4_K: the 32-element sub-blocks in the
 *     order 0 2 1 3 4 6 5 7, matching the nibble halves of their 64-byte code loads), 32 int16
 *     sums (per 16 elements; Q4_K: per 32, then zeros), d_x (f32).
 * ============================================================================================= */
#if defined(__AVX512VNNI__) || defined(SHARPI_AVX_VNNI)
#define SHARPI_VNNI 1
INL __m512i dpbusd(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
INL __m512i dpwssd(__m512i acc, __m512i a, __m512i b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
#define SHARPI_VNNI 0
/* exact emulation: even / odd bytes widened to 16 bits, vpmaddwd (no saturation for these ranges) */
INL __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
    const __m512i ue = _mm512_and_si512(u, _mm512_set1_epi16(0x00ff)), uo = _mm512_srli_epi16(u, 8);
    const __m512i se = _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8), so = _mm512_srai_epi16(s, 8);
    return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ue, se), _mm512_madd_epi16(uo, so)));
}
INL __m512i dpwssd(__m512i acc, __m512i a, __m512i b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif

/* dpbusd for weight codes u <= 127 (the 4- and 5-bit types): without VNNI vpmaddubsw, which cannot
 * saturate here (2 * 127 * 128 < 2^15), then vpmaddwd with ones: the same integers in 2 instructions. */
INL __m512i dpbusd_u7(__m512i acc, __m512i u, __m512i s) {
#if SHARPI_VNNI
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

int sharpi_has_vnni(void) { return SHARPI_VNNI; }

INL float f16round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

#define ABSF(v) _mm512_andnot_ps(_mm512_set1_ps(-0.0f), (v))
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* ggml quantize_row_q8_0 / q8_1 on one block of L (multiple of 16) values */
INL void q8_32_quant(const float *x, const int L, int8_t *q, float *d16, float *s16) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < L; i += 16) m = _mm512_max_ps(m, ABSF(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(m);
    const float d = amax / 127.f;
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < L; i += 16) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(id)), RNE));
        sum = _mm512_add_epi32(sum, c);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(c));
    }
    *d16 = f16round(d);
    if (s16) *s16 = f16round(d * (float)_mm512_reduce_add_epi32(sum));
}

/* ggml quantize_row_q8_K_ref on one block of L (multiple of 16) values; bsums per 16 */
INL void q8K_quant(const float *x, const int L, int8_t *q, float *dout, int16_t *bsums) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < L; i += 16) m = _mm512_max_ps(m, ABSF(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(m);
    if (!(amax > 0.f)) { /* ggml: !amax -> d = 0, codes 0 */
        memset(q, 0, (size_t)L);
        for (int i = 0; i < L / 16; i++) bsums[i] = 0;
        *dout = 0.f;
        return;
    }
    float mx = amax;
    for (int i = 0; i < L; i += 16) { /* the first element whose magnitude is amax, with its sign */
        const __mmask16 e = _mm512_cmp_ps_mask(ABSF(_mm512_loadu_ps(x + i)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
        if (e) {
            mx = x[i + __builtin_ctz((unsigned)e)];
            break;
        }
    }
    const float iscale = -127.f / mx;
    for (int i = 0; i < L; i += 16) {
        __m512i c = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_set1_ps(iscale), _mm512_loadu_ps(x + i)), RNE));
        c = _mm512_min_epi32(c, _mm512_set1_epi32(127));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(c));
        bsums[i / 16] = (int16_t)_mm512_reduce_add_epi32(c);
    }
    *dout = 1.f / iscale;
}

enum { VD_F32 = 0, VD_Q8_0 = 1, VD_Q8_1 = 2, VD_Q8_K = 3, VD_F16 = 4, VD_BF16 = 5 };
static int vd_kind(int ty) {
    switch (ty) {
    case TY_Q4_0: case TY_Q5_0: case TY_Q8_0: case TY_IQ4_NL: case TY_MXFP4: case TY_Q5_0R: return VD_Q8_0;
    case TY_Q4_1: case TY_Q5_1: case TY_Q4_1R: return VD_Q8_1;
    case TY_Q2_K: case TY_Q3_K: case TY_Q4_K: case TY_Q5_K: case TY_Q6_K: case TY_IQ4_XS: case TY_Q4_KR: return VD_Q8_K;
    case TY_F16: return VD_F16;
    case TY_BF16: return VD_BF16;
    default: return VD_F32;
    }
}

#define LCH 96 /* scratch bytes per block of 32 activations, legacy types */
/* scratch bytes per 256 activations, K-quants: codes 256, sums 64, d_x 64, and for Q4_K the
 * min-term group of 4 tokens (filled in rows t % 4 == 0): their 4 x 8 sums (64), their d_x x 4 (64) */
INL int kch(const int ty) { return k16(ty) ? 384 : 512; }

static int legacy_offset(int ty) { return ty == TY_Q4_0 ? 8 : ty == TY_Q5_0 || ty == TY_Q5_0R ? 16 : ty == TY_Q8_0 || ty == TY_IQ4_NL || ty == TY_MXFP4 ? 128 : 0; }

/* dpbusd(st, u, s) of a legacy type's block: st is the lanes' offset start (act_legacy_row). With
 * Q8_0's offset (codes u = w + 128, st = -128 * the lane's 4 activation codes) the result is w.s, which
 * an AVX2 CPU without VNNI gets as ggml's mul_sum_i8_pairs does: |w| times s with w's sign (2 * 128 * 127 < 2^15). */
#if defined(SHARPI_AVX512_EMULATED)
/* signed weights w times signed activations x, 4 products a 32-bit lane: |w| times x with w's sign (ggml's
 * mul_sum_i8_pairs; vpdpbusd takes unsigned u) */
INL __m256i sdot_avx2(const __m256i w, const __m256i x) {
    return sx_dpbusd8(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
#endif

INL __m512i dpbusd_legacy(const int ty, __m512i st, __m512i u, __m512i s) {
    if (legacy_offset(ty) != 128) return dpbusd_u7(st, u, s);
#if defined(SHARPI_AVX512_EMULATED) && !SHARPI_VNNI
    const __m256i m80 = _mm256_set1_epi8((char)0x80);
    return sx_si(sdot_avx2(_mm256_xor_si256(u.lo, m80), s.lo), sdot_avx2(_mm256_xor_si256(u.hi, m80), s.hi));
#else
    return dpbusd(st, u, s);
#endif
}

/* 256 codes of 8 blocks of 32 (plain order, q) -> the "octet" layout: 4 vectors of 64 bytes,
 * byte 8b + i of vector v = element 8v + i of block b. The dpbusd lanes 2b and 2b+1 of all four
 * vectors then belong to block b (16 products each). */
INL void to_octets(const int8_t *q, uint8_t *dst) {
    for (int v = 0; v < 4; v++)
        for (int b = 0; b < 8; b++) memcpy(dst + 64 * v + 8 * b, q + 32 * b + 8 * v, 8);
}

/* activation codes of one super-block in the order of the repacked weight vectors: chunk v = 4i + p
 * (16 bytes) = codes 64i + 8p .. +7, then 64i + 32 + 8p .. +7 */
INL void to_r4_order(const int8_t *q, uint8_t *dst) {
    for (int v = 0; v < 16; v++) {
        memcpy(dst + 16 * v, q + 64 * (v / 4) + 8 * (v % 4), 8);
        memcpy(dst + 16 * v + 8, q + 64 * (v / 4) + 32 + 8 * (v % 4), 8);
    }
}

/* one activation row for a legacy weight type (K = 32 * nb): per block LCH bytes: its 32 codes
 * (plain order), the 8 lane starts -offset * (sum of the lane's 4 codes) as int32 (zeros without an
 * offset), d_x (f32) and s_x (f32, Q8_1). */
static void act_legacy_row(const int ty, const float *x, const long nb, uint8_t *dst) {
    const int off = legacy_offset(ty), has_s = vd_kind(ty) == VD_Q8_1;
    for (long b = 0; b < nb; b++) {
        uint8_t *ch = dst + b * LCH;
        float dx = 0.f, s = 0.f;
        q8_32_quant(x + 32 * b, 32, (int8_t *)ch, &dx, has_s ? &s : NULL);
        __m256i start = _mm256_setzero_si256();
        if (off) {
            const __m256i c = _mm256_load_si256((const __m256i *)ch);
            const __m256i lane = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), c), _mm256_set1_epi16(1));
            start = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(lane, __builtin_ctz((unsigned)off)));
        }
        _mm256_store_si256((__m256i *)(ch + 32), start);
        memcpy(ch + 64, &dx, 4);
        memcpy(ch + 68, &s, 4);
    }
}

/* one activation row for a K-quant weight type (K = 256 * nu): per super-block the codes (Q6_K in
 * plain order, Q4_K in octets of its 32-element sub-blocks), 32 int16 sums (per 16 elements;
 * Q4_K: per 32, then zeros), d_x (f32) */
static void act_k_row(const int ty, const float *x, const long nu, uint8_t *dst) {
    for (long u = 0; u < nu; u++) {
        uint8_t *sb = dst + u * kch(ty);
        int8_t q[256] __attribute__((aligned(64)));
        int16_t bs[16];
        float d;
        q8K_quant(x + 256 * u, 256, q, &d, bs);
        int16_t *b16 = (int16_t *)(sb + 256);
        memset(b16, 0, 64);
        if (k16(ty)) {
            memcpy(sb, q, 256);
            for (int j = 0; j < 16; j++) b16[j] = bs[j];
        } else {
            if (ty == TY_Q4_KR) to_r4_order(q, sb);
            else to_octets(q, sb);
            for (int j = 0; j < 8; j++) b16[j] = (int16_t)(bs[2 * j] + bs[2 * j + 1]);
        }
        memset(sb + 320, 0, 64);
        memcpy(sb + 320, &d, 4);
    }
}

INL __m512 round_f16_16(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, RNE)); }
INL __m512 round_bf16_16(__m512 v) { /* round half to even to the top 16 bits (finite values) */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* bytes of one quantized activation row in the scratch layout of weight type ty */
static long act_row_bytes(int ty, long k) {
    switch (vd_kind(ty)) {
    case VD_Q8_0: case VD_Q8_1: return k / 32 * LCH;
    case VD_Q8_K: return k / 256 * kch(ty);
    default: return k * 4;
    }
}

static void act_row(const int ty, const float *x, const long k, uint8_t *dst) {
    switch (vd_kind(ty)) {
    case VD_Q8_0: case VD_Q8_1: act_legacy_row(ty, x, k / 32, dst); break;
    case VD_Q8_K: act_k_row(ty, x, k / 256, dst); break;
    case VD_F16: case VD_BF16: {
        float *o = (float *)dst;
        const int f16 = vd_kind(ty) == VD_F16;
        for (long i = 0; i < k; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            _mm512_store_ps(o + i, f16 ? round_f16_16(v) : round_bf16_16(v));
        }
        break;
    }
    default: memcpy(dst, x, (size_t)k * 4); break;
    }
}

/* ---- legacy types, in ggml's order -----------------------------------------------------------
 * ggml (AVX2 vec_dot for T = 1 and Q4_1 / Q5_1, llamafile's tinyBLAS_Q0_AVX for Q4_0 / Q5_0 / Q8_0
 * at T >= 2: the same arithmetic) sums each block's 32 products in 8 integer lanes of 4 consecutive
 * elements, converts them to float and accumulates acc_j = fma(d_w * d_x, lane_j, acc_j) block after
 * block; the row's value is hsum_float_8(acc) (+ the fp32 sum of fma(m_w, s_x, .) for Q4_1 / Q5_1).
 * Q4_0 and IQ4_NL tensors with rows a multiple of 8 are repacked by llama.cpp on AVX2 CPUs and take
 * another order (TY_Q4_0_R8, below), and so are MXFP4's (TY_MXFP4_R8); IQ4_NL's and MXFP4's vec_dot (rows
 * not a multiple of 8) alternate two accumulators, which sharpi does not copy (its 8-lane order is used:
 * not bit-exact there).
 * A zmm holds two weight rows (lanes 0-7, 8-15) against one token's block, broadcast to both halves.
 * IQ4_NL codes are its table's values + 128, with Q8_0's offset. */

INL __m512 pair_ps(const float a, const float b) { return _mm512_mask_mov_ps(_mm512_set1_ps(a), 0xff00, _mm512_set1_ps(b)); }

/* weight codes of one block of rows A (bytes 0-31) and B (32-63) as unsigned bytes; d_w (and m_w) per half */
INL void gprep(const int ty, const uint8_t *bA, const uint8_t *bB, __m512i *w, __m512 *dw, __m512 *mw) {
    *dw = pair_ps(block_d(ty, bA), block_d(ty, bB));
    if (ty == TY_Q4_1 || ty == TY_Q5_1) *mw = pair_ps(f16at(bA + 2), f16at(bB + 2));
    if (ty == TY_Q8_0) {
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(bA + 2))),
                                             _mm256_loadu_si256((const __m256i *)(bB + 2)), 1);
        *w = _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80));
        return;
    }
    const int qo = ty == TY_MXFP4 ? 1 : ty == TY_Q4_0 || ty == TY_IQ4_NL ? 2 : ty == TY_Q4_1 ? 4 : ty == TY_Q5_0 ? 6 : 8;
    /* [qs_A, qs_A, qs_B, qs_B] >> [0, 4, 0, 4]: low nibbles are elements 0-15, high ones 16-31 */
    const __m512i z = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(bA + qo)))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(bB + qo))), 1);
    *w = _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0f));
    if (ty == TY_IQ4_NL || ty == TY_MXFP4) /* the table's values + 128 (unsigned, like Q8_0's codes) */
        *w = _mm512_shuffle_epi8(_mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(nl_values(ty))),
                                                  _mm512_set1_epi8((char)0x80)), *w);
    if (ty == TY_Q5_0 || ty == TY_Q5_1) { /* bit i of qh: 5th bit of element i */
        uint32_t hA, hB;
        memcpy(&hA, bA + qo - 4, 4);
        memcpy(&hB, bB + qo - 4, 4);
        *w = _mm512_mask_add_epi8(*w, (__mmask64)hA | (__mmask64)hB << 32, *w, _mm512_set1_epi8(16));
    }
}

/* block b of R rows (even): prefetch ahead (every other block), then gprep per pair of rows */
INL void gblock(const int ty, const int R, const uint8_t *const *rows, const long b, const long pfo, __m512i *w,
                __m512 *dw, __m512 *mw) {
    const int BB = unit_bytes(ty);
    if (pfo && !(b & 1)) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)rows[r] + pfo + b * BB, _MM_HINT_T1);
    }
#pragma GCC unroll 2
    for (int p = 0; p < R / 2; p++) gprep(ty, rows[2 * p] + b * BB, rows[2 * p + 1] + b * BB, &w[p], &dw[p], &mw[p]);
}

/* R rows (even) x TT tokens over nb blocks */
INL void gkern_legacy(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nb,
                      const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
    const int RP = R / 2, off = legacy_offset(ty) != 0, has_m = vd_kind(ty) == VD_Q8_1;
    __m512 acc[MAXR / 2][MAXT], sm[MAXR / 2][MAXT];
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[p][t] = sm[p][t] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        __m512i w[MAXR / 2];
        __m512 dw[MAXR / 2], mw[MAXR / 2];
        gblock(ty, R, rows, b, pfo, w, dw, mw);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = a + t * lda + b * LCH;
            const __m512i xa = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)at));
            const __m512i st = off ? _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32))) : _mm512_setzero_si512();
            const __m512 dx = _mm512_set1_ps(*(const float *)(at + 64));
#pragma GCC unroll 2
            for (int p = 0; p < RP; p++) {
                acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(dw[p], dx), _mm512_cvtepi32_ps(dpbusd_legacy(ty, st, w[p], xa)), acc[p][t]);
                if (has_m) sm[p][t] = _mm512_fmadd_ps(mw[p], _mm512_set1_ps(*(const float *)(at + 68)), sm[p][t]);
            }
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            float vA = hsum8(_mm512_castps512_ps256(acc[p][t])), vB = hsum8(_mm512_extractf32x8_ps(acc[p][t], 1));
            if (has_m) {
                vA += _mm512_cvtss_f32(sm[p][t]);
                vB += _mm_cvtss_f32(_mm512_extractf32x4_ps(sm[p][t], 2));
            }
            y[t * ldy + 2 * p] = vA;
            y[t * ldy + 2 * p + 1] = vB;
        }
}
/* TY_Q4_0_R8 / TY_IQ4_NL_R8: the order of llama.cpp's repacked Q4_0 / IQ4_NL (q4_0_8x8 / iq4_nl_8x8 on
 * AVX2 CPUs, for tensors whose rows are a multiple of 8: gemv_q4_b32_8x8_q8_0_lut_avx and its gemm):
 * one float chain per row and token, y = fma(float(I_b), d_w * d_x, y), I_b the block's exact integer
 * dot product. The 8-lane sums of 4 dot products come out of one transposing reduction (chain_sums):
 * from 4 tokens' (TT >= 2, padded to a multiple of 4; the chains of 4 tokens x 2 rows then run in the
 * lanes 0-3 and 8-11 of one vector) or, for one token, from 4 consecutive blocks' (then 4 scalar FMAs
 * in block order). */
INL __m512i chain_sums(const __m512i is[4]) { /* lanes 0-3: sums of lanes 0-7 of is[0..3]; 8-11: of 8-15 */
    const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(is[0], is[1]), _mm512_unpackhi_epi32(is[0], is[1]));
    const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(is[2], is[3]), _mm512_unpackhi_epi32(is[2], is[3]));
    const __m512i l4 = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23));
    return _mm512_add_epi32(l4, _mm512_shuffle_i64x2(l4, l4, _MM_SHUFFLE(2, 3, 0, 1)));
}

INL void gkern_chain_blocks(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nb,
                            const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
    const int BB = unit_bytes(ty), RP = R / 2;
    float ys[MAXR][MAXT] = {{0}};
    for (long b0 = 0; b0 < nb; b0 += 4) {
        const int nq = nb - b0 < 4 ? (int)(nb - b0) : 4;
        if (pfo) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)rows[r] + pfo + b0 * BB, _MM_HINT_T1);
        }
        __m512i w[4][MAXR / 2];
        float dwf[MAXR][4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 2
            for (int p = 0; p < RP; p++) {
                __m512 dw, mw;
                if (i < nq) {
                    gprep(ty, rows[2 * p] + (b0 + i) * BB, rows[2 * p + 1] + (b0 + i) * BB, &w[i][p], &dw, &mw);
                    dwf[2 * p][i] = _mm512_cvtss_f32(dw);
                    dwf[2 * p + 1][i] = _mm_cvtss_f32(_mm512_extractf32x4_ps(dw, 2));
                } else {
                    w[i][p] = _mm512_setzero_si512();
                    dwf[2 * p][i] = dwf[2 * p + 1][i] = 0.f;
                }
            }
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) {
            __m512i xa[4], st[4];
            float dxs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                if (i < nq) {
                    const uint8_t *at = a + t * lda + (b0 + i) * LCH;
                    xa[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)at));
                    st[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32)));
                    dxs[i] = *(const float *)(at + 64);
                } else {
                    xa[i] = st[i] = _mm512_setzero_si512();
                }
            }
#pragma GCC unroll 2
            for (int p = 0; p < RP; p++) {
                __m512i is[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) is[i] = dpbusd_legacy(ty, st[i], w[i][p], xa[i]);
                int32_t I[16] __attribute__((aligned(64)));
                _mm512_store_si512((void *)I, chain_sums(is));
                for (int i = 0; i < nq; i++) {
                    ys[2 * p][t] = fmaf((float)I[i], dwf[2 * p][i] * dxs[i], ys[2 * p][t]);
                    ys[2 * p + 1][t] = fmaf((float)I[8 + i], dwf[2 * p + 1][i] * dxs[i], ys[2 * p + 1][t]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++)
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) {
            y[t * ldy + 2 * p] = ys[2 * p][t];
            y[t * ldy + 2 * p + 1] = ys[2 * p + 1][t];
        }
}

#if defined(SHARPI_AVX512_EMULATED)
/* A few tokens in the chain order on AVX2, block by block: each row's codes in one 256-bit vector (gprep's half),
 * per token the rows' 8-lane sums reduced together by three vphaddd and one add into [I_b of rows 0-3], then one
 * 128-bit y = fma(float(I_b), d_w * d_x, y) for the 4 rows: the chains of gkern_chain_blocks / gkern_chain (the
 * same integers, the same fmaf per block), without their transposes of 512-bit halves and scalar FMAs. */
/* the tokens it takes: Q4_0 / IQ4_NL 1.4-1.8x gkern_chain at 1-2 (measured), slower from 3 (its sums spill) */
#ifndef CHAIN_AVX2_MAXT
#define CHAIN_AVX2_MAXT 2
#endif
INL void chain_avx2(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nb, const uint8_t *a,
                    const long lda, float *y, const long ldy, const long pfo) {
    const int BB = unit_bytes(ty), off = legacy_offset(ty); /* Q4_0 / IQ4_NL: d (fp16), then the codes */
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128(nl_values(ty)));
    __m128 y4[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) y4[t] = _mm_setzero_ps();
    for (long b = 0; b < nb; b++) {
        if (pfo && !(b & 3)) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)rows[r] + pfo + b * BB, _MM_HINT_T1);
        }
        __m256i w[4];
        float dw[4] = {0.f, 0.f, 0.f, 0.f};
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const uint8_t *br = rows[r < R ? r : R - 1] + b * BB;
            const __m128i q = _mm_loadu_si128((const __m128i *)(br + 2));
            w[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m0f);
            if (off == 128) /* IQ4_NL: the signed table values */
                w[r] = _mm256_shuffle_epi8(tab, w[r]);
            if (r < R) dw[r] = block_d(ty, br);
        }
        const __m128 dw4 = _mm_loadu_ps(dw);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = a + t * lda + b * LCH;
            const __m256i x = _mm256_load_si256((const __m256i *)at);
            __m256i is[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                if (off == 128)
                    is[r] = sdot_avx2(w[r], x);
                else /* Q4_0: codes w + 8 against the lane starts -8 * (sum of the lane's 4 codes) */
                    is[r] = sx_dpbusd8(_mm256_load_si256((const __m256i *)(at + 32)), w[r], x);
            }
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(is[0], is[1]), _mm256_hadd_epi32(is[2], is[3]));
            const __m128i I4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            y4[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(I4), _mm_mul_ps(dw4, _mm_set1_ps(*(const float *)(at + 64))), y4[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        float v[4];
        _mm_storeu_ps(v, y4[t]);
        for (int r = 0; r < R; r++) y[t * ldy + r] = v[r];
    }
}
#endif

INL void gkern_chain(const int tyk, const int R, const int TT, const uint8_t *const *rows, const long nb,
                     const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
    const int ty = tyk == TY_Q4_0_R8 ? TY_Q4_0 : tyk == TY_MXFP4_R8 ? TY_MXFP4 : TY_IQ4_NL;
#if defined(SHARPI_AVX512_EMULATED)
    if (TT <= CHAIN_AVX2_MAXT && ty != TY_MXFP4) { /* (MXFP4's measured 1.15x slower at one token: its E8M0 scales) */
        chain_avx2(ty, R, TT, rows, nb, a, lda, y, ldy, pfo);
        return;
    }
#endif
    if (TT == 1) { /* (2 or 3 tokens: padding the token group costs less than the scalar FMAs) */
        gkern_chain_blocks(ty, R, TT, rows, nb, a, lda, y, ldy, pfo);
        return;
    }
    const int RP = R / 2, NG = (TT + 3) / 4;
    __m512 acc[MAXR / 2][MAXT / 4];
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++)
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) acc[p][g] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        __m512i w[MAXR / 2];
        __m512 dw[MAXR / 2], mw[MAXR / 2];
        gblock(ty, R, rows, b, pfo, w, dw, mw);
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            float dxs[4] = {0.f, 0.f, 0.f, 0.f};
            __m512i xa[4], st[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                if (4 * g + i < TT) {
                    const uint8_t *at = a + (4 * g + i) * lda + b * LCH;
                    xa[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)at));
                    st[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32)));
                    dxs[i] = *(const float *)(at + 64);
                } else {
                    xa[i] = st[i] = _mm512_setzero_si512();
                }
            }
            const __m512 dx4 = _mm512_broadcast_f32x4(_mm_loadu_ps(dxs)); /* lane 4j + i: token 4g + i */
#pragma GCC unroll 2
            for (int p = 0; p < RP; p++) {
                __m512i is[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) is[i] = dpbusd_legacy(ty, st[i], w[p], xa[i]);
                acc[p][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain_sums(is)), _mm512_mul_ps(dw[p], dx4), acc[p][g]);
            }
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++)
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            float v[16] __attribute__((aligned(64)));
            _mm512_store_ps(v, acc[p][g]);
            for (int i = 0; i < 4 && 4 * g + i < TT; i++) {
                y[(4 * g + i) * ldy + 2 * p] = v[i];
                y[(4 * g + i) * ldy + 2 * p + 1] = v[8 + i];
            }
        }
}
/* ---- weight side, Q4_K: one super-block per step, prepared into L1 (its order is below) ---- */
typedef struct {
    __m512i q[4];  /* codes of the four 64-byte vectors (activation layout) */
    __m512i sc[1]; /* the scale of each 32-bit lane's sub-block in its low 16 bits */
    __m512i mn;    /* the 8 mins in each 128-bit lane */
    float d, dmin;
} KPrep;

INL void kprep(const int ty, const uint8_t *b, KPrep *P) {
    const __m512i v = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(k4_scales_mins(b)));
    /* 32-bit lanes 2j, 2j+1: sc_j in the low 16 bits, 0 in the high ones (vpmaddwd with int16 sums) */
    P->sc[0] = _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_srli_epi16(_mm512_setr_epi64(
        0x0003000200010000LL, 0x0007000600050004LL, 0x000b000a00090008LL, 0x000f000e000d000cLL,
        0x0013001200110010LL, 0x0017001600150014LL, 0x001b001a00190018LL, 0x001f001e001d001cLL), 2), v);
    P->mn = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16(8), _mm512_set_epi64(
        0x0007000600050004LL, 0x0003000200010000LL, 0x0007000600050004LL, 0x0003000200010000LL,
        0x0007000600050004LL, 0x0003000200010000LL, 0x0007000600050004LL, 0x0003000200010000LL)), v); /* 4 x m0..m7 */
    P->d = f16at(b);
    P->dmin = f16at(b + 2);
    /* sub-block j = nibble j % 2 of the 32-byte chunk j / 2; octet v takes its bytes 8v..8v+7 */
    const uint8_t *qs = b + 16;
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i L0 = _mm512_loadu_si512((const void *)qs), L1 = _mm512_loadu_si512((const void *)(qs + 64));
    const __m512i sh = _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4);
#pragma GCC unroll 4
    for (int o = 0; o < 4; o++) {
        const __m512i idx = _mm512_setr_epi64(o, o, 4 + o, 4 + o, 8 + o, 8 + o, 12 + o, 12 + o);
        P->q[o] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutex2var_epi64(L0, idx, L1), sh), m0f);
    }
}

INL void kprefetch(const int ty, const int R, const uint8_t *const *rows, const long u, const long pfo) {
    const int UB = unit_bytes(ty);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const char *pf = (const char *)rows[r] + pfo + u * UB;
#pragma GCC unroll 4
        for (int o = 0; o < UB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T1);
    }
}

/* ---- Q6_K, Q5_K, Q3_K, Q2_K, IQ4_XS in ggml's orders -------------------------
 * Q6_K (ggml_vec_dot_q6_K_q8_K, AVX2). Per super-block, 8 integer lanes: lane j sums sc * q * x over
 * the elements 4j..4j+3 of each 32-element chunk (q the unsigned 6-bit code), minus
 * 32 * (bsum_2j sc_2j + bsum_2j+1 sc_2j+1) (the -32 offset folded in per pair of 16-element
 * sub-blocks), then acc = fma(d_x * d_w, float(lane), acc) per super-block and hsum_float_8 at the
 * end. Two weight rows per zmm as for the legacy types.
 * Q3_K (ggml_vec_dot_q3_K_q8_K, AVX2): the same lanes, but the -4 offset is taken out per pair of
 * products before the scale (maddubs(q, x) - maddubs(4, x)), so it stays in each element's lane.
 * IQ4_XS (ggml_vec_dot_iq4_xs_q8_K, AVX2): the same lanes of signed table values times x (|w| and x
 * with w's sign, as ggml's mul_add_epi8), one scale per 32-element chunk.
 * Q5_K (ggml_vec_dot_q5_K_q8_K, AVX2): the lanes of sc * q * x (one scale per chunk), and apart the min
 * term M = sum_j m_j * bsum_j: summs = fma(-(d_x * dmin_w), float(M), summs) (ggml's build contracts
 * its summs += dmin * M), the row's value hsum_float_8(acc) + summs; tiled:
 * y = fma(fma(-dmin_w, float(M), d_w * float(I)), d_x, y).
 * llama.cpp's tiled K-quant matmul (ggml-cpu/tiled, passes of >= 8 tokens: Q6_K, Q3_K, IQ4_XS) instead sums
 * the super-block's lanes into one integer I and accumulates y = fma(d_w * float(I), d_x, y).
 * Q2_K: llama.cpp's AVX-512 builds repack it (q2_K_8x8, rows a multiple of 8): per super-block the
 * exact integers I = sum_j sc_j * dot_j and M = sum_j m_j * bsum_j, then (gemv, one token)
 * acc = fma(float(I), d_w * d_x, acc), accm = fma(float(M), dmin_w * d_x, accm) and acc - accm at
 * the end; its gemm (groups of 4 tokens: the first T - T % 4 rows of a prompt pass) does the same
 * once per half super-block (128 elements) with the half's I and M. */
typedef struct {
    __m512i w[8];  /* chunk c of rows A | B (unsigned codes) */
    __m512i sc[8]; /* chunk c: the int16 scale of each code pair's sub-block */
    __m512i sc16;  /* scales A[0..15] | B[0..15] as int16 (Q2_K: its mins) */
    __m512 d;
    __m512 dmin;   /* Q2_K */
    __mmask64 neg[8]; /* IQ4_XS: w[c] holds |value|, neg[c] where the value is negative */
} Q6Pair;

INL int k16_base(const int ty) {
    return ty == TY_Q6_K_TILED ? TY_Q6_K : ty == TY_Q3_K_TILED ? TY_Q3_K : ty == TY_Q2_K_GEMM ? TY_Q2_K
         : ty == TY_IQ4_XS_TILED ? TY_IQ4_XS : ty == TY_Q5_K_TILED ? TY_Q5_K : ty;
}

/* Q5_K super-block b: its 5-bit codes in plain order, elements 64i .. 64i + 63 in v[i] (chunk i of qs:
 * low nibbles = sub-block 2i, high = 2i + 1; 5th bit of element l of sub-block j: bit j of qh[l]) */
INL void q5k_codes(const uint8_t *b, __m512i v[4]) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * i))), _mm256_set1_epi8((char)(1 << (2 * i + 1))), 1);
        v[i] = _mm512_and_si512(srli2_epi16(_mm256_loadu_si256((const __m256i *)(b + 48 + 32 * i)), 0, 4), m0f);
        v[i] = _mm512_mask_add_epi8(v[i], _mm512_test_epi8_mask(h, bits), v[i], _mm512_set1_epi8(16));
    }
}

INL void q6prep(const int ty, const uint8_t *bA, const uint8_t *bB, Q6Pair *P) {
    __m512i qa[4], qb[4];
    __m512i s16;
    if (ty == TY_Q6_K) {
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; hf++) {
            q6k_codes(bA, hf, &qa[2 * hf], &qa[2 * hf + 1]);
            q6k_codes(bB, hf, &qb[2 * hf], &qb[2 * hf + 1]);
        }
        s16 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(bA + 192)))),
                                 _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(bB + 192))), 1);
        P->sc16 = s16;
        P->d = pair_ps(f16at(bA + 208), f16at(bB + 208));
    } else if (ty == TY_Q5_K) {
        q5k_codes(bA, qa);
        q5k_codes(bB, qb);
        /* int16: A's scales 0-7, mins 0-7, then B's */
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_set_m128i(k4_scales_mins(bB), k4_scales_mins(bA)));
        /* as 16-element scales and mins: each sub-block's twice */
        const __m512i dup = _mm512_set_epi16(23, 23, 22, 22, 21, 21, 20, 20, 19, 19, 18, 18, 17, 17, 16, 16,
                                             7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        s16 = _mm512_permutexvar_epi16(dup, v);
        P->sc16 = _mm512_permutexvar_epi16(_mm512_add_epi16(dup, _mm512_set1_epi16(8)), v);
        P->d = pair_ps(f16at(bA), f16at(bB));
        P->dmin = pair_ps(f16at(bA + 2), f16at(bB + 2));
    } else if (ty == TY_IQ4_XS) {
        iq4xs_values(bA, qa);
        iq4xs_values(bB, qb);
        /* as 16-element scales: each sub-block's twice */
        const __m512i v = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_set_epi64x((long long)iq4xs_scales8(bB), (long long)iq4xs_scales8(bA))));
        s16 = _mm512_permutexvar_epi16(_mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                                        7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
        P->d = pair_ps(f16at(bA), f16at(bB));
    } else {
        const int q3 = ty == TY_Q3_K;
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; hf++) {
            k2bit_codes(bA + (q3 ? 32 : 16) + 32 * hf, q3 ? bA : NULL, hf, &qa[2 * hf], &qa[2 * hf + 1]);
            k2bit_codes(bB + (q3 ? 32 : 16) + 32 * hf, q3 ? bB : NULL, hf, &qb[2 * hf], &qb[2 * hf + 1]);
        }
        if (q3) {
            int8_t sa[16], sb[16];
            q3k_scales(bA, sa);
            q3k_scales(bB, sb);
            s16 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sa))),
                                     _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sb)), 1);
            P->d = pair_ps(f16at(bA + 108), f16at(bB + 108));
        } else {
            const __m512i sm = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)bA))),
                                                  _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)bB)), 1);
            s16 = _mm512_and_si512(sm, _mm512_set1_epi16(15));
            P->sc16 = _mm512_srli_epi16(sm, 4); /* the mins */
            P->d = pair_ps(f16at(bA + 80), f16at(bB + 80));
            P->dmin = pair_ps(f16at(bA + 82), f16at(bB + 82));
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) P->w[c] = _mm512_shuffle_i64x2(qa[c >> 1], qb[c >> 1], (c & 1) ? 0xEE : 0x44);
    if (ty == TY_IQ4_XS) /* signed values: vpmaddubsw takes |w| and x with w's sign (ggml's mul_add_epi8) */
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            P->neg[c] = _mm512_movepi8_mask(P->w[c]);
            P->w[c] = _mm512_abs_epi8(P->w[c]);
        }
    /* int16 lane l of chunk c: row l / 16, sub-block 2c + (l % 16) / 8: from s16's 128-bit lanes [0, 0, 2, 2]
     * (chunks 0-3) or [1, 1, 3, 3], the scale's two bytes in every int16 (vpshufb, within each lane) */
    const __m512i s16h[2] = {_mm512_shuffle_i64x2(s16, s16, 0xA0), _mm512_shuffle_i64x2(s16, s16, 0xF5)};
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const long long e0 = (4 * c) % 16, e1 = (4 * c + 2) % 16; /* bytes of sub-blocks 2c, 2c + 1 in their lane */
        const long long q0 = (e0 | (e0 + 1) << 8) * 0x0001000100010001LL, q1 = (e1 | (e1 + 1) << 8) * 0x0001000100010001LL;
        P->sc[c] = _mm512_shuffle_epi8(s16h[c >> 2], _mm512_set_epi64(q1, q1, q0, q0, q1, q1, q0, q0));
    }
}

#if defined(SHARPI_AVX512_EMULATED)
/* Q6_K, Q5_K, Q3_K and IQ4_XS on AVX2: row by row and chunk by chunk, each 32-code chunk built in a register,
 * multiplied by every token's activations and dropped. gkern_q6k's layout (two rows a vector, the super-block
 * prepared into L1 for the token loop) suits AVX-512's 32 registers; emulated on 16 it spent a third or more of
 * its instructions storing and reloading that preparation (Q6_K decoding was compute-bound at ~23 GB/s, Q5_K /
 * Q3_K / IQ4_XS at 8-13). Each row's 8 integer lanes (sums of exact products) and its float chains are those of
 * gkern_q6k's half of a vector for that row: the same bits. */

/* chunk j (0-3) of half hf of row b's super-block: w = the unsigned codes (IQ4_XS: |value|), sg (IQ4_XS) = the
 * signed values, for the sign of the activations */
INL __m256i k16_chunk_avx2(const int ty, const uint8_t *b, const int hf, const int j, __m256i *sg) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    if (ty == TY_Q6_K) {
        /* ql[64 hf + l (+ 32 for odd j)] nibble j / 2, bits 2j, 2j + 1 of qh[32 hf + l] as bits 4, 5 (16-bit
         * shifts: the bits crossing from the neighbouring byte are masked off) */
        const __m256i lq = _mm256_loadu_si256((const __m256i *)(b + 64 * hf + 32 * (j & 1)));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * hf));
        const __m256i hb = j == 0 ? _mm256_slli_epi16(H, 4) : j == 1 ? _mm256_slli_epi16(H, 2) : j == 2 ? H : _mm256_srli_epi16(H, 2);
        return _mm256_or_si256(_mm256_and_si256(j & 2 ? _mm256_srli_epi16(lq, 4) : lq, m0f), _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
    }
    if (ty == TY_Q5_K) { /* sub-block c = 4 hf + j: nibble c % 2 of qs[32 (c / 2) + l], 5th bit: bit c of qh[l] */
        const int c = 4 * hf + j;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (c >> 1)));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i hb = c <= 4 ? _mm256_slli_epi16(H, 4 - c) : _mm256_srli_epi16(H, c - 4);
        return _mm256_or_si256(_mm256_and_si256(c & 1 ? _mm256_srli_epi16(q, 4) : q, m0f), _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
    }
    if (ty == TY_Q3_K) { /* (qs[32 hf + l] >> 2j) & 3, + 4 where bit 4 hf + j of hmask[l] is set */
        const int c = 4 * hf + j;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * hf));
        const __m256i H = _mm256_loadu_si256((const __m256i *)b);
        const __m256i hb = c >= 2 ? _mm256_srli_epi16(H, c - 2) : _mm256_slli_epi16(H, 2 - c);
        return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)), _mm256_and_si256(hb, _mm256_set1_epi8(4)));
    }
    /* IQ4_XS sub-block c: low nibbles of qs[16c .. 16c + 16) then its high ones, through the table */
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * (4 * hf + j)));
    const __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m0f);
    *sg = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL)), n);
    return _mm256_abs_epi8(*sg);
}

/* 8 int16 values as 16, each twice (the 32-element sub-blocks' scales / mins per 16 elements) */
INL __m256i dup16_avx2(const __m128i v) { return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v)); }

INL void k16_avx2(const int ty, const int tiled, const int R, const int TT, const uint8_t *const *rows, const long nu,
                  const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
    const int q5 = ty == TY_Q5_K;
    __m256 acc[MAXR][MAXT];
    float ys[MAXR][MAXT], sm[MAXR][MAXT]; /* tiled: the scalar chains; Q5_K: its summs */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            acc[r][t] = _mm256_setzero_ps();
            ys[r][t] = sm[r][t] = 0.f;
        }
    for (long u = 0; u < nu; u++) {
        if (pfo) kprefetch(ty, R, rows, u, pfo);
        const uint8_t *au = a + u * kch(ty);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *b = rows[r] + u * unit_bytes(ty);
            /* s16: the scale of each 16 elements; m16 (Q5_K): the min */
            __m256i s16, m16 = _mm256_setzero_si256();
            float dws, dms = 0.f;
            if (ty == TY_Q6_K) {
                s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
                dws = f16at(b + 208);
            } else if (ty == TY_Q5_K) {
                const __m128i sm8 = k4_scales_mins(b);
                s16 = dup16_avx2(_mm_cvtepu8_epi16(sm8));
                m16 = dup16_avx2(_mm_cvtepu8_epi16(_mm_srli_si128(sm8, 8)));
                dws = f16at(b);
                dms = f16at(b + 2);
            } else if (ty == TY_Q3_K) {
                int8_t sc[16];
                q3k_scales(b, sc);
                s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
                dws = f16at(b + 108);
            } else {
                s16 = dup16_avx2(_mm_cvtepi8_epi16(_mm_cvtsi64_si128((long long)iq4xs_scales8(b))));
                dws = f16at(b);
            }
            __m256i is[MAXT];
#pragma GCC unroll 8
            for (int t = 0; t < TT; t++) is[t] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int hf = 0; hf < 2; hf++) {
                const __m256i sh = _mm256_permute2x128_si256(s16, s16, hf ? 0x11 : 0x00); /* s16[8hf .. 8hf + 7] in both lanes */
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    __m256i sg = _mm256_setzero_si256();
                    const __m256i w = k16_chunk_avx2(ty, b, hf, j, &sg);
                    /* int16 lanes 0-7: s16[2c], 8-15: s16[2c + 1] (c = 4 hf + j) */
                    const long long e0 = 4 * j, e1 = 4 * j + 2;
                    const long long q0 = (e0 | (e0 + 1) << 8) * 0x0001000100010001LL, q1 = (e1 | (e1 + 1) << 8) * 0x0001000100010001LL;
                    const __m256i sc = _mm256_shuffle_epi8(sh, _mm256_set_epi64x(q1, q1, q0, q0));
#pragma GCC unroll 8
                    for (int t = 0; t < TT; t++) {
                        __m256i x = _mm256_load_si256((const __m256i *)(au + t * lda + 32 * (4 * hf + j)));
                        if (ty == TY_IQ4_XS) x = _mm256_sign_epi8(x, sg);
                        __m256i p = _mm256_maddubs_epi16(w, x);
                        if (ty == TY_Q3_K) p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi8(4), x)); /* its -4, pair by pair */
                        is[t] = sx_dpwssd8(is[t], p, sc);
                    }
                }
            }
            const __m256 dw = _mm256_set1_ps(dws);
#pragma GCC unroll 8
            for (int t = 0; t < TT; t++) {
                const uint8_t *at = au + t * lda;
                const __m256i bs = _mm256_load_si256((const __m256i *)(at + 256));
                /* Q6_K's -32 through the block sums */
                const __m256i i = ty == TY_Q6_K ? _mm256_sub_epi32(is[t], _mm256_slli_epi32(_mm256_madd_epi16(bs, s16), 5)) : is[t];
                const float dx = *(const float *)(at + 320);
                const float M = q5 ? (float)sx_hsum_epi32(_mm256_madd_epi16(bs, m16)) : 0.f;
                if (tiled) /* the super-block's integer: y = fma(d_w * float(I), d_x, y) (Q5_K: d_w * I - dmin_w * M fused) */
                    ys[r][t] = fmaf(q5 ? fmaf(-dms, M, dws * (float)sx_hsum_epi32(i)) : dws * (float)sx_hsum_epi32(i), dx, ys[r][t]);
                else {
                    acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(i), acc[r][t]);
                    if (q5) sm[r][t] = fmaf(-(dx * dms), M, sm[r][t]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) y[t * ldy + r] = tiled ? ys[r][t] : q5 ? hsum8(acc[r][t]) + sm[r][t] : hsum8(acc[r][t]);
}
#endif

INL void gkern_q6k(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nu,
                   const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
#if defined(SHARPI_AVX512_EMULATED)
    if (k16_base(ty) != TY_Q2_K) {
        k16_avx2(k16_base(ty), ty != k16_base(ty), R, TT, rows, nu, a, lda, y, ldy, pfo);
        return;
    }
#endif
    const int bt = k16_base(ty), UB = unit_bytes(bt), RP = R / 2;
    const int tiled = ty == TY_Q6_K_TILED || ty == TY_Q3_K_TILED || ty == TY_IQ4_XS_TILED || ty == TY_Q5_K_TILED;
    const int q2 = bt == TY_Q2_K, q5 = bt == TY_Q5_K;
    const int gemm = ty == TY_Q2_K_GEMM;
    __m512 acc[MAXR / 2][MAXT];
    __m512 accm[MAXR / 2][MAXT / 4]; /* Q5_K's summs: 4 tokens x 2 rows in lanes 0-3, 8-11 */
    float ys[MAXR][MAXT] = {{0}}, yms[MAXR][MAXT] = {{0}}; /* scalar chains: tiled; Q2_K (and its mins) */
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++) {
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[p][t] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int g = 0; g < MAXT / 4; g++) accm[p][g] = _mm512_setzero_ps();
    }
    for (long u = 0; u < nu; u++) {
        if (pfo) kprefetch(bt, R, rows, u, pfo);
        Q6Pair P[MAXR / 2];
#pragma GCC unroll 2
        for (int p = 0; p < RP; p++) q6prep(bt, rows[2 * p] + u * UB, rows[2 * p + 1] + u * UB, &P[p]);
        ESCAPE(P); /* read from L1 by the token loop, not held in registers */
        const uint8_t *au = a + u * kch(bt);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = au + t * lda;
            const __m512i bs = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 256)));
            const float dxs = *(const float *)(at + 320);
            const __m512 dx = _mm512_set1_ps(dxs);
#pragma GCC unroll 2
            for (int p = 0; p < RP; p++) {
                if (q2) { /* I per half super-block (chunks 0-3, 4-7), M per half (lanes 0-3, 4-7 of each row) */
                    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) {
                        i0 = dpwssd(i0, _mm512_maddubs_epi16(P[p].w[c], _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32 * c)))), P[p].sc[c]);
                        i1 = dpwssd(i1, _mm512_maddubs_epi16(P[p].w[c + 4], _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32 * (c + 4))))), P[p].sc[c + 4]);
                    }
                    const __m512i im = _mm512_madd_epi16(bs, P[p].sc16); /* lane j: m_2j bsum_2j + m_2j+1 bsum_2j+1 */
                    const __m512i isum = _mm512_add_epi32(i0, i1);
#pragma GCC unroll 2
                    for (int ab = 0; ab < 2; ab++) { /* rows A (lanes 0-7), B (8-15) */
                        const __mmask16 rm = ab ? 0xff00 : 0x00ff;
                        const float dd = (ab ? _mm_cvtss_f32(_mm512_extractf32x4_ps(P[p].d, 2)) : _mm512_cvtss_f32(P[p].d)) * dxs;
                        const float dm = (ab ? _mm_cvtss_f32(_mm512_extractf32x4_ps(P[p].dmin, 2)) : _mm512_cvtss_f32(P[p].dmin)) * dxs;
                        float *ya = &ys[2 * p + ab][t], *ym = &yms[2 * p + ab][t];
                        if (gemm) { /* halves: sub-blocks 0-7 (lanes 0-3 of im), 8-15 (lanes 4-7) */
                            *ya = fmaf((float)_mm512_mask_reduce_add_epi32(rm, i0), dd, *ya);
                            *ym = fmaf((float)_mm512_mask_reduce_add_epi32(rm & 0x0f0f, im), dm, *ym);
                            *ya = fmaf((float)_mm512_mask_reduce_add_epi32(rm, i1), dd, *ya);
                            *ym = fmaf((float)_mm512_mask_reduce_add_epi32(rm & 0xf0f0, im), dm, *ym);
                        } else {
                            *ya = fmaf((float)_mm512_mask_reduce_add_epi32(rm, isum), dd, *ya);
                            *ym = fmaf((float)_mm512_mask_reduce_add_epi32(rm, im), dm, *ym);
                        }
                    }
                    continue;
                }
                __m512i is = _mm512_setzero_si512();
                if (q5) {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++)
                        is = dpwssd(is, _mm512_maddubs_epi16(P[p].w[c], _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32 * c)))), P[p].sc[c]);
                    if (!tiled) { /* (the min term below, 4 tokens at a time) */
                        acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(dx, P[p].d), _mm512_cvtepi32_ps(is), acc[p][t]);
                        continue;
                    }
                    const __m512i im = _mm512_madd_epi16(bs, P[p].sc16);
#pragma GCC unroll 2
                    for (int ab = 0; ab < 2; ab++) { /* rows A (lanes 0-7), B (8-15): y = fma(d_w * I - dmin_w * M (fused), d_x, y) */
                        const __mmask16 rm = ab ? 0xff00 : 0x00ff;
                        const float M = (float)_mm512_mask_reduce_add_epi32(rm, im);
                        const float dw = ab ? _mm_cvtss_f32(_mm512_extractf32x4_ps(P[p].d, 2)) : _mm512_cvtss_f32(P[p].d);
                        const float dm = ab ? _mm_cvtss_f32(_mm512_extractf32x4_ps(P[p].dmin, 2)) : _mm512_cvtss_f32(P[p].dmin);
                        ys[2 * p + ab][t] = fmaf(fmaf(-dm, M, dw * (float)_mm512_mask_reduce_add_epi32(rm, is)), dxs, ys[2 * p + ab][t]);
                    }
                    continue;
                }
                if (bt == TY_IQ4_XS) {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        const __m512i xc = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32 * c)));
                        const __m512i xs = _mm512_mask_sub_epi8(xc, P[p].neg[c], _mm512_setzero_si512(), xc);
                        is = dpwssd(is, _mm512_maddubs_epi16(P[p].w[c], xs), P[p].sc[c]);
                    }
                } else if (bt == TY_Q3_K) {
                    const __m512i four = _mm512_set1_epi8(4);
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        const __m512i xc = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32 * c)));
                        is = dpwssd(is, _mm512_sub_epi16(_mm512_maddubs_epi16(P[p].w[c], xc), _mm512_maddubs_epi16(four, xc)), P[p].sc[c]);
                    }
                } else {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++)
                        is = dpwssd(is, _mm512_maddubs_epi16(P[p].w[c], _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32 * c)))), P[p].sc[c]);
                    is = _mm512_sub_epi32(is, _mm512_slli_epi32(_mm512_madd_epi16(bs, P[p].sc16), 5));
                }
                if (tiled) { /* the super-block's integer per row: y = fma(d_w * float(I), d_x, y) */
                    const int32_t IA = _mm512_mask_reduce_add_epi32(0x00ff, is), IB = _mm512_mask_reduce_add_epi32(0xff00, is);
                    ys[2 * p][t] = fmaf(_mm512_cvtss_f32(P[p].d) * (float)IA, dxs, ys[2 * p][t]);
                    ys[2 * p + 1][t] = fmaf(_mm_cvtss_f32(_mm512_extractf32x4_ps(P[p].d, 2)) * (float)IB, dxs, ys[2 * p + 1][t]);
                } else {
                    acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(P[p].d, dx), _mm512_cvtepi32_ps(is), acc[p][t]);
                }
            }
        }
        if (q5 && !tiled) { /* summs = fma(-(d_x * dmin_w), float(M), summs): M of 4 tokens in one reduction */
#pragma GCC unroll 2
            for (int g = 0; g < (TT + 3) / 4; g++) {
                float dxs[4] = {0.f, 0.f, 0.f, 0.f};
                __m512i bs4[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    if (4 * g + i < TT) {
                        const uint8_t *at = au + (4 * g + i) * lda;
                        bs4[i] = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 256)));
                        dxs[i] = *(const float *)(at + 320);
                    } else {
                        bs4[i] = _mm512_setzero_si512();
                    }
                }
                const __m512 dx4 = _mm512_broadcast_f32x4(_mm_loadu_ps(dxs));
#pragma GCC unroll 2
                for (int p = 0; p < RP; p++) {
                    __m512i im[4];
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) im[i] = _mm512_madd_epi16(bs4[i], P[p].sc16);
                    const __m512 dm = _mm512_xor_ps(_mm512_mul_ps(dx4, P[p].dmin), _mm512_set1_ps(-0.f)); /* -(d_x * dmin_w) */
                    accm[p][g] = _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(chain_sums(im)), accm[p][g]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < RP; p++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            if (q2) {
                y[t * ldy + 2 * p] = ys[2 * p][t] - yms[2 * p][t];
                y[t * ldy + 2 * p + 1] = ys[2 * p + 1][t] - yms[2 * p + 1][t];
            } else if (q5 && !tiled) { /* hsum_float_8(acc) + summs */
                float m[16] __attribute__((aligned(64)));
                _mm512_store_ps(m, accm[p][t >> 2]);
                y[t * ldy + 2 * p] = hsum8(_mm512_castps512_ps256(acc[p][t])) + m[t & 3];
                y[t * ldy + 2 * p + 1] = hsum8(_mm512_extractf32x8_ps(acc[p][t], 1)) + m[8 + (t & 3)];
            } else {
                y[t * ldy + 2 * p] = tiled ? ys[2 * p][t] : hsum8(_mm512_castps512_ps256(acc[p][t]));
                y[t * ldy + 2 * p + 1] = tiled ? ys[2 * p + 1][t] : hsum8(_mm512_extractf32x8_ps(acc[p][t], 1));
            }
        }
}

/* ---- Q4_K in ggml's order (llama.cpp repacks Q4_K weights on AVX2 CPUs: q4_K_8x8) ------------
 * Per weight row and token, the integer dot product of a super-block scaled by the sub-block
 * scales, I, and of its mins, M = sum_j m_j * bsum_j, are exact; ggml_gemv_q4_K_8x8_q8_K (one token)
 * accumulates acc = fma(float(I), d_w * d_x, acc) and accm = fma(float(M), dmin_w * d_x, accm) once
 * per super-block, ggml_gemm_q4_K_8x8_q8_K (tokens in groups of 4: the first T - T % 4 rows of a
 * pass) once per pair of sub-blocks with the pair's partial I and M; the value is acc - accm. The
 * integers come from the octet kernel above (lanes 2j, 2j+1: sub-block j). */
/* The token loop of one super-block for up to 4 rows P[0..R-1]: the float chains run in the lanes
 * of acc[t] / accm[t] (lane r: row r), each lane exactly the scalar chain described above. */
INL void q4k_tokens(const int R, const int TT, const int gemm, const KPrep *P, const uint8_t *au, const long lda,
                    __m128 acc[MAXT], __m128 accm[MAXT]) {
    const __m128 d4 = _mm_setr_ps(P[0].d, R > 1 ? P[1].d : 0.f, R > 2 ? P[2].d : 0.f, R > 3 ? P[3].d : 0.f);
    const __m128 m4 = _mm_setr_ps(P[0].dmin, R > 1 ? P[1].dmin : 0.f, R > 2 ? P[2].dmin : 0.f, R > 3 ? P[3].dmin : 0.f);
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        const uint8_t *at = au + t * lda;
        const __m128 dx = _mm_set1_ps(*(const float *)(at + 320));
        const __m128i bs = _mm_load_si128((const __m128i *)(at + 256)); /* 8 sums of 32 codes */
        __m512i is[4];
        __m128i im[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (r >= R) {
                is[r] = _mm512_setzero_si512();
                im[r] = _mm_setzero_si128();
                continue;
            }
            __m512i t0 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) t0 = dpbusd_u7(t0, P[r].q[p], _mm512_load_si512((const void *)(at + 64 * p)));
            is[r] = _mm512_madd_epi16(t0, P[r].sc[0]); /* lanes 2j, 2j+1: sub-block j */
            im[r] = _mm_madd_epi16(bs, _mm512_castsi512_si128(P[r].mn)); /* lane i: M of sub-block pair i */
        }
        /* u: lane 4i + r = I of sub-block pair i (128-bit lane i) of row r */
        const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(is[0], is[1]), _mm512_unpackhi_epi32(is[0], is[1]));
        const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(is[2], is[3]), _mm512_unpackhi_epi32(is[2], is[3]));
        const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23));
        /* M transposed: mt[i] lane r = M of pair i of row r */
        const __m128i t01l = _mm_unpacklo_epi32(im[0], im[1]), t01h = _mm_unpackhi_epi32(im[0], im[1]);
        const __m128i t23l = _mm_unpacklo_epi32(im[2], im[3]), t23h = _mm_unpackhi_epi32(im[2], im[3]);
        const __m128i mt[4] = {_mm_unpacklo_epi64(t01l, t23l), _mm_unpackhi_epi64(t01l, t23l),
                               _mm_unpacklo_epi64(t01h, t23h), _mm_unpackhi_epi64(t01h, t23h)};
        const __m128 dd = _mm_mul_ps(d4, dx), dm = _mm_mul_ps(m4, dx);
        if (gemm) {
            const __m128i u0 = _mm512_castsi512_si128(u), u1 = _mm512_extracti32x4_epi32(u, 1);
            const __m128i u2 = _mm512_extracti32x4_epi32(u, 2), u3 = _mm512_extracti32x4_epi32(u, 3);
            acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(u0), dd, acc[t]);
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(mt[0]), dm, accm[t]);
            acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(u1), dd, acc[t]);
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(mt[1]), dm, accm[t]);
            acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(u2), dd, acc[t]);
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(mt[2]), dm, accm[t]);
            acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(u3), dd, acc[t]);
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(mt[3]), dm, accm[t]);
        } else {
            const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
            const __m128i I = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            const __m128i M = _mm_add_epi32(_mm_add_epi32(mt[0], mt[1]), _mm_add_epi32(mt[2], mt[3]));
            acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(I), dd, acc[t]);
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(M), dm, accm[t]);
        }
    }
}

INL void q4k_store(const int R, const int TT, const __m128 acc[MAXT], const __m128 accm[MAXT], float *y, const long ldy) {
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        float v[4];
        _mm_storeu_ps(v, _mm_sub_ps(acc[t], accm[t]));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) y[t * ldy + r] = v[r];
    }
}

INL void gkern_q4k(const int R, const int TT, const uint8_t *const *rows, const long nu, const uint8_t *a,
                   const long lda, float *y, const long ldy, const long pfo, const int gemm) {
    __m128 acc[MAXT], accm[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t] = accm[t] = _mm_setzero_ps();
    for (long u = 0; u < nu; u++) {
        if (pfo) kprefetch(TY_Q4_K, R, rows, u, pfo);
        KPrep P[MAXR];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) kprep(TY_Q4_K, rows[r] + u * 144, &P[r]);
        ESCAPE(P);
        q4k_tokens(R, TT, gemm, P, a + u * kch(TY_Q4_K), lda, acc, accm);
    }
    q4k_store(R, TT, acc, accm, y, ldy);
}
INL void gkern_q4k_gemv(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nu,
                        const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
    (void)ty;
    gkern_q4k(R, TT, rows, nu, a, lda, y, ldy, pfo, 0);
}
INL void gkern_q4k_gemm(const int ty, const int R, const int TT, const uint8_t *const *rows, const long nu,
                        const uint8_t *a, const long lda, float *y, const long ldy, const long pfo) {
    (void)ty;
    gkern_q4k(R, TT, rows, nu, a, lda, y, ldy, pfo, 1);
}
/* prepared path: KPrep[super-block][4 rows] (starting at this kernel's first row) */
INL void pkern_q4k(const int ty, const int R, const int TT, const uint8_t *prep, const long nu, const uint8_t *a,
                   const long lda, float *y, const long ldy) {
    __m128 acc[MAXT], accm[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t] = accm[t] = _mm_setzero_ps();
    const KPrep *P = (const KPrep *)prep;
    for (long u = 0; u < nu; u++) q4k_tokens(R, TT, ty == TY_Q4_K_GEMM, P + 4 * u, a + u * kch(TY_Q4_K), lda, acc, accm);
    q4k_store(R, TT, acc, accm, y, ldy);
}

/* ---- Q4_K repacked for the CPU: 4 rows interleaved per super-block (TY_Q4_KR) ----------------
 * llama.cpp repacks Q4_K for its x86 CPU backend too (q4_K_8x8). Here a group of 4 consecutive rows
 * becomes, per super-block, R4B = 592 bytes: codes[512], d[4] (fp16), dmin[4] (fp16), sc[4][8] and
 * m[4][8] (the 6-bit scales and mins, unpacked to bytes). The codes are 16 weight vectors W[v] of 64
 * bytes, v = 4i + p (i: the pair of sub-blocks 2i, 2i+1; p: a quarter of each): the 16-byte lane r
 * of W[v] holds row r's codes 64i + 8p .. +7 and 64i + 32 + 8p .. +7. Stored vector m (64 bytes) has
 * W[m] in its low nibbles and W[m + 8] in its high ones, so unpacking a super-block is 16 ALU
 * operations for 4 rows, and one vpdpbusd against a broadcast 16-byte activation chunk serves all
 * 4 rows: dword lanes 0-1 of lane r collect sub-block 2i, lanes 2-3 sub-block 2i + 1 (16 products
 * over p, which fit int16, as vpdpwssd with the 16-bit scales needs), and no horizontal reduction
 * is needed until the end of the super-block. The integer sums are the ones of the Q4_K kernels
 * above, and they become floats in the same order (ggml's gemv, or its gemm per pair of sub-blocks),
 * so the results are the same bits. The activations take the matching order (act_k_row). */
#define R4B 592

/* the code (0..255, within a row's super-block) in byte e of row lane of weight vector v = 4i + p */
INL int r4_code(const int v, const int e) {
    const int i = v / 4, p = v % 4;
    return 64 * i + 8 * p + (e < 8 ? e : 32 + e - 8);
}

static void repack_q4k_group(const uint8_t *const rows[4], long nu, uint8_t *dst) {
    for (long u = 0; u < nu; u++) {
        uint8_t *o = dst + u * R4B;
        uint8_t code[4][256];
        for (int r = 0; r < 4; r++) {
            const uint8_t *b = rows[r] + u * 144, *q = b + 4, *qs = b + 16;
            memcpy(o + 512 + 2 * r, b, 2);
            memcpy(o + 520 + 2 * r, b + 2, 2);
            for (int j = 0; j < 8; j++) { /* ggml get_scale_min_k4 */
                o[528 + 8 * r + j] = j < 4 ? q[j] & 63 : (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
                o[560 + 8 * r + j] = j < 4 ? q[j + 4] & 63 : (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
            }
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    code[r][64 * c + l] = qs[32 * c + l] & 0xF;
                    code[r][64 * c + 32 + l] = qs[32 * c + l] >> 4;
                }
        }
        uint8_t W[16][64]; /* the unpacked weight vectors; lane r = its two runs of 8 codes */
        for (int v = 0; v < 16; v++)
            for (int r = 0; r < 4; r++) {
                memcpy(&W[v][16 * r], &code[r][r4_code(v, 0)], 8);
                memcpy(&W[v][16 * r + 8], &code[r][r4_code(v, 8)], 8);
            }
        for (int m = 0; m < 8; m++)
            for (int j = 0; j < 64; j++) o[64 * m + j] = (uint8_t)(W[m][j] | (W[m + 8][j] << 4));
    }
}

static void unpack_q4k_group(const uint8_t *src, long nu, uint8_t *const rows[4]) {
    for (long u = 0; u < nu; u++) {
        const uint8_t *o = src + u * R4B;
        uint8_t code[4][256], W[16][64];
        for (int m = 0; m < 8; m++)
            for (int j = 0; j < 64; j++) {
                W[m][j] = o[64 * m + j] & 0xF;
                W[m + 8][j] = o[64 * m + j] >> 4;
            }
        for (int v = 0; v < 16; v++)
            for (int r = 0; r < 4; r++) {
                memcpy(&code[r][r4_code(v, 0)], &W[v][16 * r], 8);
                memcpy(&code[r][r4_code(v, 8)], &W[v][16 * r + 8], 8);
            }
        for (int r = 0; r < 4; r++) {
            uint8_t *b = rows[r] + u * 144, *q = b + 4, *qs = b + 16;
            const uint8_t *sc = o + 528 + 8 * r, *mn = o + 560 + 8 * r;
            memcpy(b, o + 512 + 2 * r, 2);
            memcpy(b + 2, o + 520 + 2 * r, 2);
            for (int j = 0; j < 4; j++) {
                q[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
                q[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
                q[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
            }
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) qs[32 * c + l] = (uint8_t)(code[r][64 * c + l] | (code[r][64 * c + 32 + l] << 4));
        }
    }
}


/* the products of sub-block pair i of the 4 rows with token at's activations: dword (lane r, l) of the 4 quarters' sums
 * (VNNI: dwords; without: int16 pair sums over p (|sum| <= 4 * 2 * 15 * 128 < 2^15), the two halves of each dword
 * adding up to the VNNI dword, and SC holding the scale in both, so vpmaddwd gives the same integers) */
INL __m512i r4_pair(const __m512i *W, const int i, const uint8_t *at) {
#if SHARPI_VNNI
    __m512i tp = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
        tp = dpbusd(tp, W[4 * i + p], _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)(at + 64 * i + 16 * p))));
#else
    __m512i tp = _mm512_maddubs_epi16(W[4 * i], _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)(at + 64 * i))));
#pragma GCC unroll 3
    for (int p = 1; p < 4; p++)
        tp = _mm512_add_epi16(tp, _mm512_maddubs_epi16(W[4 * i + p], _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)(at + 64 * i + 16 * p)))));
#endif
    return tp;
}

/* The token loop of one super-block of a group: W[16] codes, SC[4] the pair scales (16-bit, in the
 * low half of each dword), MN the mins (lane r: row r's 8, int16), dm8 = [d x 4, dmin x 4].
 * acc[t]: lanes 0-3 the d-chain of rows 0-3, lanes 4-7 the dmin-chain. */
INL void r4_tokens(const int TT, const int gemm, const __m512i *W, const __m512i *SC, const __m512i MN,
                   const __m256 dm8, const uint8_t *au, const long lda, __m256 acc[MAXT]) {
#if defined(SHARPI_AVX512_EMULATED)
    /* AVX2 has 16 registers and W alone takes 32 halves: token by token every product reloaded all of W from the
     * stack (~2 loads a vpmaddubsw). Pair by pair over the tokens, W[4i..4i+3] stay in registers and only the
     * products go through the stack; the same integers, and the floats below in the same order */
    __m512i PT[MAXT][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) PT[t][i] = _mm512_madd_epi16(r4_pair(W, i, au + t * lda), SC[i]);
    }
#endif
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        const uint8_t *at = au + t * lda;
        const __m256 dd = _mm256_mul_ps(dm8, _mm256_set1_ps(*(const float *)(at + 320)));
        /* lane r, dword l: M of sub-block pair l of row r */
        const __m512i M = _mm512_madd_epi16(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)(at + 256))), MN);
#if defined(SHARPI_AVX512_EMULATED)
        const __m512i *P = PT[t];
#else
        __m512i tp[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) tp[i] = r4_pair(W, i, at);
#endif
        if (!gemm) {
#if defined(SHARPI_AVX512_EMULATED)
            const __m512i I = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(P[0], P[1]), P[2]), P[3]);
#else
            __m512i I = _mm512_madd_epi16(tp[0], SC[0]);
            I = dpwssd(I, tp[1], SC[1]);
            I = dpwssd(I, tp[2], SC[2]);
            I = dpwssd(I, tp[3], SC[3]);
#endif
            __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi64(I, M), _mm512_unpackhi_epi64(I, M));
            a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB)); /* lane r: I, I, M, M */
            const __m512i c = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), a);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(c)), dd, acc[t]);
        } else {
#if !defined(SHARPI_AVX512_EMULATED)
            __m512i P[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) P[i] = _mm512_madd_epi16(tp[i], SC[i]);
#endif
            const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(P[0], P[1]), _mm512_unpackhi_epi32(P[0], P[1]));
            const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(P[2], P[3]), _mm512_unpackhi_epi32(P[2], P[3]));
            /* lane r: I of the pairs 0..3 of row r */
            const __m512i X = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23));
#if defined(SHARPI_AVX512_EMULATED)
            /* per pair j: [I_j of rows 0-3, M_j of rows 0-3] (as below) from 256-bit unpacks, rows 0 2 0 2 1 3 1 3,
             * put in order by one vpermd (an emulated vpermt2d costs ~20 instructions) */
            const __m256i i02 = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            const __m256i a = _mm256_unpacklo_epi32(X.lo, X.hi), b = _mm256_unpacklo_epi32(M.lo, M.hi);
            const __m256i c = _mm256_unpackhi_epi32(X.lo, X.hi), d = _mm256_unpackhi_epi32(M.lo, M.hi);
            const __m256i pj[4] = {_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b), _mm256_unpacklo_epi64(c, d),
                                   _mm256_unpackhi_epi64(c, d)};
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(pj[j], i02)), dd, acc[t]);
#else
            /* [I_0 of rows 0-3, M_0 of rows 0-3, I_1 .., M_1 ..] and the same for pairs 2, 3 */
            const __m512 f01 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(X, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29), M));
            const __m512 f23 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(X, _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31), M));
            acc[t] = _mm256_fmadd_ps(_mm512_castps512_ps256(f01), dd, acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(f01, 1), dd, acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm512_castps512_ps256(f23), dd, acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(f23, 1), dd, acc[t]);
#endif
        }
    }
}

/* rows[0]: the group's first byte; R is always 4 (rows past N do not exist: N % 4 == 0) */
INL void r4kern(const int TT, const int gemm, const uint8_t *const *rows, const long nu, const uint8_t *a,
                const long lda, float *y, const long ldy, const long pfo) {
    __m256 acc[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    __m512i sc_sel[4]; /* the bytes of sc_{2i}, sc_{2i + 1} for SC[i] (vpshufb: within each 128-bit lane) */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const unsigned long long lo = (4 * i) | (4 * i + 1) << 8, hi = SHARPI_VNNI ? 0x8080 : lo;
        const unsigned long long a = lo | hi << 16, c = a + 0x02020202u;
        const long long A = (long long)(a | a << 32), C = (long long)(c | c << 32);
        sc_sel[i] = _mm512_set_epi64(C, A, C, A, C, A, C, A);
    }
    for (long u = 0; u < nu; u++) {
        const uint8_t *b = rows[0] + u * R4B;
        if (pfo) {
#pragma GCC unroll 10
            for (int o = 0; o < R4B; o += 64) _mm_prefetch((const char *)b + pfo + o, _MM_HINT_T1);
        }
        __m512i W[16], SC[4];
#pragma GCC unroll 8
        for (int m = 0; m < 8; m++) {
            const __m512i s = _mm512_loadu_si512((const void *)(b + 64 * m));
            W[m] = _mm512_and_si512(s, m0f);
            W[m + 8] = _mm512_and_si512(_mm512_srli_epi16(s, 4), m0f);
        }
        /* int16 element 8r + j (128-bit lane r): sc_j of row r; SC[i] dword (lane r, l): sc_{2i + l / 2} of
         * row r in its low 16 bits, and in its high ones 0 (VNNI: tp holds dwords) or the same scale */
        const __m512i s16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 528)));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) SC[i] = _mm512_shuffle_epi8(s16, sc_sel[i]);
        const __m512i MN = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 560)));
        const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 512)));
        r4_tokens(TT, gemm, W, SC, MN, dm8, a + u * 512, lda, acc);
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        float v[8];
        _mm256_storeu_ps(v, acc[t]);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) y[t * ldy + r] = v[r] - v[4 + r];
    }
}

#define R4DEF(TT, G) \
    static void r4k_##G##_##TT(const uint8_t *const *rows, long nu, const float *x, long ldx, float *y, long ldy, long pfo) { \
        r4kern(TT, G, rows, nu, (const uint8_t *)x, 4 * ldx, y, ldy, pfo); \
    }
#define R4SET(G, NAME) \
    R4DEF(1, G) R4DEF(2, G) R4DEF(3, G) R4DEF(4, G) R4DEF(5, G) R4DEF(6, G) R4DEF(7, G) R4DEF(8, G) \
    static const kern_fn NAME[9] = {0, r4k_##G##_1, r4k_##G##_2, r4k_##G##_3, r4k_##G##_4, r4k_##G##_5, r4k_##G##_6, \
                                    r4k_##G##_7, r4k_##G##_8};
R4SET(0, r4tab_gemv)
R4SET(1, r4tab_gemm)
static const int r4_rows[9] = {0, 4, 4, 4, 4, 4, 4, 4, 4};

/* ---- AMX: prompt passes of repacked Q4_K (TY_Q4_KR) in ggml's gemm order --------------------
 * On CPUs with AMX-INT8 (Sapphire Rapids and later) the tile unit computes each sub-block's integer
 * dot product for 16 weight rows x 16 tokens at a time (tdpbusd: the unsigned 4-bit codes times the
 * signed 8-bit activation codes, exact int32 sums). A sub-block pair's I = sc_2i * S_2i + sc_2i+1 *
 * S_2i+1 is then formed in fp32, exactly: |S| <= 32 * 15 * 127 and sc <= 63, so each product and the
 * sum are integers below 2^24. M comes from vpmaddwd of the activation sums with the mins, as in
 * r4_tokens. From there each (row, token) runs r4kern's gemm chains, acc = fma(I, d_w * d_x, acc) and
 * accm = fma(M, dmin_w * d_x, accm) per pair, y = acc - accm: the same bits as the other kernels.
 * Only the first T - T % 4 tokens of a prompt pass (the gemm order) and whole groups of 16 rows take
 * it; the rest goes through r4kern. Linux hands out the tile state only on request (arch_prctl).
 * Measured here (2 cores, Sapphire Rapids class; scripts/bench_amx.py), Qwen 1.5B's matrices at 128 tokens: 1.9-2.0x r4kern's speed;
 * 16 tokens 1.0-1.4x, 8 tokens 0.6x (the weights' unpacking is paid per call): hence AMX_MIN_T. The
 * S tiles' stores and the per-pair float chains bound it (Q6_K's path below needs one store per super-block
 * instead of eight, and runs 5.5-5.9x its vector kernel at 128 tokens). */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && !defined(SHARPI_AVX512_EMULATED) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define SHARPI_AMX 1
#else
#define SHARPI_AMX 0
#endif

static int amx_state = -1; /* -1: not asked yet, 0: off (unavailable or SHARPI_AMX=0), 1: on */
static long amx_passes; /* calls that took the tile unit (tests check that it ran) */
long sharpi_amx_passes(void) { return __atomic_load_n(&amx_passes, __ATOMIC_RELAXED); }

static int amx_request(void) {
#if SHARPI_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) { /* (SHARPI_AMX=0 is read by Python's switches, which turn it off at load) */
        s = amx_request();
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* on = 0: stop using AMX; 1: use it when the CPU and the kernel allow; < 0: leave as is.
 * Returns whether prompt passes use it now. */
int sharpi_amx(int on) {
    if (on == 0) __atomic_store_n(&amx_state, 0, __ATOMIC_RELEASE);
    else if (on > 0) __atomic_store_n(&amx_state, amx_request(), __ATOMIC_RELEASE);
    return amx_ready();
}

/* a buffer *p of *have bytes (64-byte aligned) grown to hold bytes; NULL when out of memory */
static uint8_t *grow(uint8_t **p, size_t *have, size_t bytes) {
    if (bytes > *have) {
        void *q = NULL;
        const size_t want = bytes + bytes / 4 + 4096;
        if (posix_memalign(&q, 64, want)) return NULL;
        free(*p);
        *p = q;
        *have = want;
    }
    return *p;
}

#if SHARPI_AMX
#define AMX_MIN_T 16 /* tokens in the gemm order from which the tiles pay (fewer: the weights are unpacked for too little) */
/* per super-block of 16 rows: the codes of sub-block j at 512 j ([row][32], unsigned), sc as floats
 * [row][8] at 4096, the mins as int16 pairs [row][pair] at 4608, d [16] at 4864, dmin [16] at 4928 */
#define AMX_WU 4992
/* per super-block of 16 tokens: the codes of sub-block j at 512 j in the tiles' VNNI layout ([32 / 4][token][4]),
 * the activation sums of each pair as int16 pairs [pair][token] at 4096, d_x [16] at 4352 */
#define AMX_XU 4416
/* Q6_K (its section below) */
#define AMX6_MIN_T 8 /* (the tiled order's own start) */
#define AMX6_WU 8256 /* per super-block of 16 rows: chunk c's low bytes [row][64] at 2048 c, high bytes at
                      * 2048 c + 1024; d_w [16] at 8192 */
#define AMX6_XU 4160 /* per super-block of 16 tokens: chunk c's codes [64 / 4][token][4] at 1024 c; d_x [16] at 4096 */


typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_cfg;

/* the tiles of a q6 = 0 (Q4_K) or q6 = 1 (Q6_K) pass */
static void amx_config(const int q6) {
    /* Q4_K: S 16 rows x 16 tokens (int32) in 0, 1; weights 16 rows x a sub-block's 32 codes in 2, 3;
     * activations 32 codes / 4 x 16 tokens x 4 in 4, 5. Q6_K: S_lo, S_hi; w' low, high bytes; activations */
    static const uint8_t rows[2][6] = {{16, 16, 16, 16, 8, 8}, {16, 16, 16, 16, 16, 0}};
    static const uint16_t colsb[2][6] = {{64, 64, 32, 32, 64, 64}, {64, 64, 64, 64, 64, 0}};
    amx_cfg c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = rows[q6][t], c.colsb[t] = colsb[q6][t];
    _tile_loadconfig(&c);
}

/* rows row0 .. row0 + 15 of a TY_Q4_KR weight (4 groups of 4) -> nu x AMX_WU bytes */
static void amx_weights(const uint8_t *w, const long rb, const long row0, const long nu, uint8_t *dst) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    for (int q = 0; q < 4; q++) {
        const uint8_t *grp = w + (row0 + 4 * q) * rb;
        for (long u = 0; u < nu; u++) {
            const uint8_t *b = grp + u * R4B;
            uint8_t *o = dst + u * AMX_WU;
            /* W[v], v = 4i + p (r4kern's weight vectors): qword 2r + h holds row r's codes 8p .. 8p + 7 of sub-block
             * 2i + h. Two rounds of vpermt2q give the rows' 32 codes of a sub-block, 2 rows per vector. */
            __m512i W[16];
            for (int m = 0; m < 8; m++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * m));
                W[m] = _mm512_and_si512(v, m0f);
                W[m + 8] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
            }
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++) {
                    const __m512i e = _mm512_setr_epi64(h, 8 + h, 2 + h, 10 + h, 4 + h, 12 + h, 6 + h, 14 + h);
                    const __m512i t01 = _mm512_permutex2var_epi64(W[4 * i], e, W[4 * i + 1]);
                    const __m512i t23 = _mm512_permutex2var_epi64(W[4 * i + 2], e, W[4 * i + 3]);
                    uint8_t *a = o + (2 * i + h) * 512 + 4 * q * 32;
                    _mm512_storeu_si512((void *)a, _mm512_permutex2var_epi64(t01, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), t23));
                    _mm512_storeu_si512((void *)(a + 64), _mm512_permutex2var_epi64(t01, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), t23));
                }
            float *scf = (float *)(o + 4096), *d = (float *)(o + 4864), *dmin = (float *)(o + 4928);
            int32_t *mnp = (int32_t *)(o + 4608);
            for (int r = 0; r < 4; r++) {
                const uint8_t *sc = b + 528 + 8 * r, *mn = b + 560 + 8 * r;
                for (int j = 0; j < 8; j++) scf[(4 * q + r) * 8 + j] = (float)sc[j];
                for (int i = 0; i < 4; i++) mnp[(4 * q + r) * 4 + i] = (int32_t)mn[2 * i] | (int32_t)mn[2 * i + 1] << 16;
                d[4 * q + r] = f16at(b + 512 + 2 * r);
                dmin[4 * q + r] = f16at(b + 520 + 2 * r);
            }
        }
    }
}

/* tokens t0 .. t0 + nt - 1 (nt <= 16) of the quantized activation rows a (quantize_rows' scratch, rows of
 * rbytes) -> nu x AMX_XU (Q4_K) or AMX6_XU (q6: Q6_K) bytes: the codes of each super-block in the tiles'
 * layout (4 of them per row of 64 bytes, 16 tokens), for Q4_K the pairs' activation sums, d_x; absent tokens
 * have zero codes, sums and d_x */
static void amx_acts(const uint8_t *a, const long rbytes, const long nu, const long t0, const int nt, uint8_t *dst,
                     const int q6) {
    const long xu = q6 ? AMX6_XU : AMX_XU;
    memset(dst, 0, (size_t)(nu * xu));
    for (int t = 0; t < nt; t++)
        for (long u = 0; u < nu; u++) {
            const uint8_t *sb = a + (t0 + t) * rbytes + u * (q6 ? 384 : 512); /* act_k_row's super-block */
            uint8_t *o = dst + u * xu;
            if (q6) { /* codes in plain order */
                for (int e = 0; e < 64; e++) memcpy(o + 64 * e + 4 * t, sb + 4 * e, 4);
            } else { /* codes in to_r4_order: plain code c sits at 16 (4 (c / 64) + c % 32 / 8) + 8 (c % 64 / 32) + c % 8 */
                for (int e = 0; e < 64; e++) {
                    const int c = 4 * e;
                    memcpy(o + 64 * e + 4 * t, sb + 16 * (4 * (c / 64) + c % 32 / 8) + 8 * (c % 64 / 32) + c % 8, 4);
                }
                const int16_t *b16 = (const int16_t *)(sb + 256); /* the 8 sub-blocks' sums */
                int32_t *bsp = (int32_t *)(o + 4096);
                for (int i = 0; i < 4; i++) /* sub-blocks 2i, 2i + 1 */
                    bsp[16 * i + t] = (int32_t)(uint16_t)b16[2 * i] | (int32_t)((uint32_t)(uint16_t)b16[2 * i + 1] << 16);
            }
            memcpy(o + (q6 ? 4096 : 4352) + 4 * t, sb + 320, 4);
        }
}

/* the accumulators [G][16 rows][16 tokens] (mins: each group's second half, its min terms, subtracted)
 * -> y rows row0 .. row0 + 15 of tokens 0 .. T - 1 */
static void amx_store(const float *acc, const int mins, const long G, const long T, float *y, const long ldy,
                      const long row0) {
    for (long g = 0; g < G; g++) {
        const float *ac = acc + g * (mins ? 512 : 256);
        for (int t = 0; t < 16 && 16 * g + t < T; t++)
            for (int r = 0; r < 16; r++)
                y[(16 * g + t) * ldy + row0 + r] = mins ? ac[16 * r + t] - ac[256 + 16 * r + t] : ac[16 * r + t];
    }
}

/* one group of 16 rows (weights A, prepared) against all G token groups X: y rows row0 .. row0 + 15 of tokens 0 .. T - 1 */
static void amx_rows(const uint8_t *A, const uint8_t *X, const long nu, const long G, const long T, float *acc,
                     float *y, const long ldy, const long row0) {
    int32_t S[2][256] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)G * 512 * sizeof(float)); /* per token group: acc [16 rows][16 tokens], then accm */
    for (long u = 0; u < nu; u++) {
        const uint8_t *Au = A + u * AMX_WU;
        const float *scf = (const float *)(Au + 4096), *d = (const float *)(Au + 4864), *dmin = (const float *)(Au + 4928);
        const int32_t *mnp = (const int32_t *)(Au + 4608);
        for (int i = 0; i < 4; i++) {
            _tile_loadd(2, Au + 2 * i * 512, 32);
            _tile_loadd(3, Au + (2 * i + 1) * 512, 32);
            for (long g = 0; g < G; g++) {
                const uint8_t *Xg = X + (g * nu + u) * AMX_XU;
                _tile_loadd(4, Xg + 2 * i * 512, 64);
                _tile_loadd(5, Xg + (2 * i + 1) * 512, 64);
                _tile_zero(0);
                _tile_zero(1);
                _tile_dpbusd(0, 2, 4);
                _tile_dpbusd(1, 3, 5);
                _tile_stored(0, S[0], 64);
                _tile_stored(1, S[1], 64);
                const __m512 dx = _mm512_load_ps((const float *)(Xg + 4352));
                const __m512i bs = _mm512_load_si512((const void *)(Xg + 4096 + 64 * i));
                float *ac = acc + g * 512, *am = ac + 256;
#pragma GCC unroll 4
                for (int r = 0; r < 16; r++) {
                    const __m512 s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(S[0] + 16 * r))),
                                                    _mm512_set1_ps(scf[8 * r + 2 * i]));
                    const __m512 I = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(S[1] + 16 * r))),
                                                     _mm512_set1_ps(scf[8 * r + 2 * i + 1]), s0);
                    const __m512 M = _mm512_cvtepi32_ps(_mm512_madd_epi16(bs, _mm512_set1_epi32(mnp[4 * r + i])));
                    _mm512_store_ps(ac + 16 * r, _mm512_fmadd_ps(I, _mm512_mul_ps(_mm512_set1_ps(d[r]), dx),
                                                                 _mm512_load_ps(ac + 16 * r)));
                    _mm512_store_ps(am + 16 * r, _mm512_fmadd_ps(M, _mm512_mul_ps(_mm512_set1_ps(dmin[r]), dx),
                                                                 _mm512_load_ps(am + 16 * r)));
                }
            }
        }
    }
    amx_store(acc, 1, G, T, y, ldy, row0);
}

/* ---- AMX: prompt passes of Q6_K in ggml's tiled order ----------------------------------------
 * The tiled matmul (passes of >= 8 tokens) takes each super-block's whole integer I = sum_j sc_j * sum
 * (q - 32) * x per row and token, then y = fma(d_w * float(I), d_x, y). The scales fold into the weights:
 * w' = (q - 32) * sc_j is an int16 (|w'| <= 32 * 128), split into its low byte (unsigned) and high byte
 * (signed), so that I = S_lo + 256 * S_hi where S_lo (tdpbusd) and S_hi (tdpbssd) are dot products over
 * the whole super-block, 4 tile steps of 64 codes each: exact int32 sums, the same I. */
/* rows row0 .. row0 + 15 of a Q6_K weight -> nu x AMX6_WU bytes */
static void amx6_weights(const uint8_t *w, const long rb, const long row0, const long nu, uint8_t *dst) {
    const __m256i m0f = _mm256_set1_epi8(0x0f), m03 = _mm256_set1_epi8(0x03), o32 = _mm256_set1_epi8(32);
    for (int r = 0; r < 16; r++)
        for (long u = 0; u < nu; u++) {
            const uint8_t *b = w + (row0 + r) * rb + u * 210;
            uint8_t *o = dst + u * AMX6_WU;
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int h = 0; h < 2; h++) { /* ggml's dequantize_row_q6_K: elements 128 h .. 128 h + 127 */
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(l0, m0f), _mm256_slli_epi16(_mm256_and_si256(qh, m03), 4)),
                    _mm256_or_si256(_mm256_and_si256(l1, m0f), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m03), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m0f), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m03), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m0f), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m03), 4))};
                for (int v = 0; v < 4; v++) { /* elements e0 .. e0 + 31: sub-blocks e0 / 16, e0 / 16 + 1 */
                    const int e0 = 128 * h + 32 * v, c = e0 / 64, off = e0 % 64;
                    const __m512i s = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(sc[e0 / 16])),
                                                         _mm256_set1_epi16(sc[e0 / 16 + 1]), 1);
                    const __m512i wv = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_sub_epi8(q[v], o32)), s);
                    _mm256_storeu_si256((__m256i *)(o + 2048 * c + 64 * r + off), _mm512_cvtepi16_epi8(wv));
                    _mm256_storeu_si256((__m256i *)(o + 2048 * c + 1024 + 64 * r + off), _mm512_cvtepi16_epi8(_mm512_srai_epi16(wv, 8)));
                }
            }
            ((float *)(o + 8192))[r] = f16at(b + 208);
        }
}

static void amx6_rows(const uint8_t *A, const uint8_t *X, const long nu, const long G, const long T, float *acc,
                      float *y, const long ldy, const long row0) {
    int32_t S[2][256] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)G * 256 * sizeof(float)); /* per token group: y [16 rows][16 tokens] */
    for (long u = 0; u < nu; u++) {
        const uint8_t *Au = A + u * AMX6_WU;
        const float *d = (const float *)(Au + 8192);
        for (long g = 0; g < G; g++) {
            const uint8_t *Xg = X + (g * nu + u) * AMX6_XU;
            _tile_zero(0);
            _tile_zero(1);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                _tile_loadd(2, Au + 2048 * c, 64);
                _tile_loadd(3, Au + 2048 * c + 1024, 64);
                _tile_loadd(4, Xg + 1024 * c, 64);
                _tile_dpbusd(0, 2, 4);
                _tile_dpbssd(1, 3, 4);
            }
            _tile_stored(0, S[0], 64);
            _tile_stored(1, S[1], 64);
            const __m512 dx = _mm512_load_ps((const float *)(Xg + 4096));
            float *ac = acc + g * 256;
#pragma GCC unroll 4
            for (int r = 0; r < 16; r++) {
                const __m512i I = _mm512_add_epi32(_mm512_load_si512((const void *)(S[0] + 16 * r)),
                                                   _mm512_slli_epi32(_mm512_load_si512((const void *)(S[1] + 16 * r)), 8));
                _mm512_store_ps(ac + 16 * r, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), _mm512_cvtepi32_ps(I)), dx,
                                                             _mm512_load_ps(ac + 16 * r)));
            }
        }
    }
    amx_store(acc, 0, G, T, y, ldy, row0);
}

static __thread uint8_t *amx_wbuf_p, *amx_acc_p;
static __thread size_t amx_wbuf_n, amx_acc_n;
static __thread uint8_t *amx_xbuf_p; /* the calling thread's: every thread of its team reads it */
static __thread size_t amx_xbuf_n;

/* y [T, n] rows 0 .. n - n % 16 of tokens 0 .. T - 1 of the activation rows a (quantized, rows of rbytes) @ a
 * TY_Q4_KR (q6 = 0, gemm order) or Q6_K (q6 = 1, tiled order) weight [n, k] with rows of rb bytes.
 * Returns 0, -2 when out of memory. */
static int amx_matmul(const int q6, const uint8_t *w, const long rb, const long n, const long k, const uint8_t *a,
                      const long rbytes, const long T, float *y, const int nth) {
    const long nu = k / 256, G = (T + 15) / 16, ngroups = n / 16;
    const long wu = q6 ? AMX6_WU : AMX_WU, xu = q6 ? AMX6_XU : AMX_XU, accg = q6 ? 256 : 512;
    uint8_t *X = grow(&amx_xbuf_p, &amx_xbuf_n, (size_t)(G * nu * xu));
    if (!X) return -2;
    __atomic_fetch_add(&amx_passes, 1, __ATOMIC_RELAXED);
#pragma omp parallel for num_threads(nth) schedule(static) if (nth > 1 && G > 1)
    for (long g = 0; g < G; g++) {
        const int nt = (int)(T - 16 * g < 16 ? T - 16 * g : 16);
        amx_acts(a, rbytes, nu, 16 * g, nt, X + g * nu * xu, q6);
    }
    long next = 0;
    int oom = 0;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        uint8_t *A = grow(&amx_wbuf_p, &amx_wbuf_n, (size_t)(nu * wu));
        float *acc = (float *)grow(&amx_acc_p, &amx_acc_n, (size_t)(G * accg) * sizeof(float));
        if (!A || !acc) {
            __atomic_store_n(&oom, 1, __ATOMIC_RELAXED);
        } else {
            amx_config(q6);
            for (;;) {
                const long c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
                if (c >= ngroups || __atomic_load_n(&oom, __ATOMIC_RELAXED)) break;
                if (q6) {
                    amx6_weights(w, rb, 16 * c, nu, A);
                    amx6_rows(A, X, nu, G, T, acc, y, n, 16 * c);
                } else {
                    amx_weights(w, rb, 16 * c, nu, A);
                    amx_rows(A, X, nu, G, T, acc, y, n, 16 * c);
                }
            }
            _tile_release();
        }
    }
    return oom ? -2 : 0;
}
#endif

/* ---- Q4_1 repacked for the CPU: 4 rows interleaved per block (TY_Q4_1R) ----------------------
 * A group of 4 consecutive rows becomes, per block of 32, 80 bytes (4 x 20, the same size):
 * codes[64], then d[4] and m[4] (fp16). Code byte j holds in its low nibble element j % 32 of row
 * j / 32 and in its high nibble the same element of row 2 + j / 32, so one load, an and and a shift
 * give the two zmm of gkern_legacy (rows 0-1 and rows 2-3 against the block broadcast to both
 * halves), and one cvtph gives all d and m. The arithmetic per (row, token) is gkern_legacy's. */
#define L4B 80

/* the 4 rows' 16 bytes of 4-bit codes of a block (GGUF order: element i low nibble of byte i, 16 + i high) <->
 * the 64-byte code plane of TY_Q4_1R / TY_Q5_0R (byte j: element j % 32 of row j / 32, and of row 2 + j / 32) */
static void codes4_pack(const uint8_t *const qs[4], uint8_t *o) {
    uint8_t code[4][32];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 16; i++) {
            code[r][i] = qs[r][i] & 0xF;
            code[r][16 + i] = qs[r][i] >> 4;
        }
    for (int j = 0; j < 64; j++) o[j] = (uint8_t)(code[j / 32][j % 32] | (code[2 + j / 32][j % 32] << 4));
}

static void codes4_unpack(const uint8_t *o, uint8_t *const qs[4]) {
    uint8_t code[4][32];
    for (int j = 0; j < 64; j++) {
        code[j / 32][j % 32] = o[j] & 0xF;
        code[2 + j / 32][j % 32] = o[j] >> 4;
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 16; i++) qs[r][i] = (uint8_t)(code[r][i] | (code[r][16 + i] << 4));
}

static void repack_q41_group(const uint8_t *const rows[4], long nb, uint8_t *dst) {
    for (long b = 0; b < nb; b++) {
        uint8_t *o = dst + b * L4B;
        const uint8_t *qs[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = rows[r] + b * 20;
            memcpy(o + 64 + 2 * r, blk, 2);
            memcpy(o + 72 + 2 * r, blk + 2, 2);
            qs[r] = blk + 4;
        }
        codes4_pack(qs, o);
    }
}

static void unpack_q41_group(const uint8_t *src, long nb, uint8_t *const rows[4]) {
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = src + b * L4B;
        uint8_t *qs[4];
        for (int r = 0; r < 4; r++) {
            uint8_t *blk = rows[r] + b * 20;
            memcpy(blk, o + 64 + 2 * r, 2);
            memcpy(blk + 2, o + 72 + 2 * r, 2);
            qs[r] = blk + 4;
        }
        codes4_unpack(o, qs);
    }
}

#if defined(SHARPI_AVX512_EMULATED)
/* l4kern on AVX2 in its own 256-bit vectors, one a row (see l5_avx2): the same bits */
INL void l4_avx2(const int TT, const uint8_t *const *rows, const long nb, const uint8_t *a, const long lda, float *y,
                 const long ldy, const long pfo) {
    __m256 acc[MAXT][4];
    __m128 sm[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_ps();
        sm[t] = _mm_setzero_ps();
    }
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    for (long b = 0; b < nb; b++) {
        const uint8_t *g = rows[0] + b * L4B;
        if (pfo && !(b & 3)) {
#pragma GCC unroll 5
            for (int o = 0; o < 4 * L4B; o += 64) _mm_prefetch((const char *)g + pfo + o, _MM_HINT_T1);
        }
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)g), s1 = _mm256_loadu_si256((const __m256i *)(g + 32));
        const __m256i w[4] = {_mm256_and_si256(s0, m0f), _mm256_and_si256(s1, m0f),
                              _mm256_and_si256(_mm256_srli_epi16(s0, 4), m0f), _mm256_and_si256(_mm256_srli_epi16(s1, 4), m0f)};
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 64))); /* d0..d3, m0..m3 */
        const __m128 m4 = _mm256_extractf128_ps(dm, 1);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = a + t * lda + b * LCH;
            const __m256i x = _mm256_load_si256((const __m256i *)at);
            const __m256 dd = _mm256_mul_ps(dm, _mm256_broadcast_ss((const float *)(at + 64))); /* d_w[r] * d_x in 0-3 */
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                acc[t][r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(r)),
                                            _mm256_cvtepi32_ps(sx_dpbusd8(_mm256_setzero_si256(), w[r], x)), acc[t][r]);
            sm[t] = _mm_fmadd_ps(m4, _mm_broadcast_ss((const float *)(at + 68)), sm[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        float v[4];
        _mm_storeu_ps(v, sm[t]);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) y[t * ldy + r] = hsum8(acc[t][r]) + v[r];
    }
}
#endif

INL void l4kern(const int TT, const uint8_t *const *rows, const long nb, const uint8_t *a, const long lda, float *y,
                const long ldy, const long pfo) {
#if defined(SHARPI_AVX512_EMULATED) /* (1.0-1.4x the emulated code below at 1-8 tokens, measured) */
    l4_avx2(TT, rows, nb, a, lda, y, ldy, pfo);
    return;
#endif
    __m512 accA[MAXT], accB[MAXT];
    __m128 sm[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        accA[t] = accB[t] = _mm512_setzero_ps();
        sm[t] = _mm_setzero_ps();
    }
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i iA = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i iB = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    for (long b = 0; b < nb; b++) {
        const uint8_t *g = rows[0] + b * L4B;
        if (pfo && !(b & 3)) {
#pragma GCC unroll 5
            for (int o = 0; o < 4 * L4B; o += 64) _mm_prefetch((const char *)g + pfo + o, _MM_HINT_T1);
        }
        const __m512i s = _mm512_loadu_si512((const void *)g);
        const __m512i wA = _mm512_and_si512(s, m0f), wB = _mm512_and_si512(_mm512_srli_epi16(s, 4), m0f);
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 64))); /* d0..d3, m0..m3 */
        const __m512 dwA = _mm512_permutexvar_ps(iA, _mm512_castps256_ps512(dm));
        const __m512 dwB = _mm512_permutexvar_ps(iB, _mm512_castps256_ps512(dm));
        const __m128 m4 = _mm256_extractf128_ps(dm, 1);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = a + t * lda + b * LCH;
            const __m512i xa = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)at));
            const __m512 dx = _mm512_set1_ps(*(const float *)(at + 64));
            accA[t] = _mm512_fmadd_ps(_mm512_mul_ps(dwA, dx), _mm512_cvtepi32_ps(dpbusd_u7(_mm512_setzero_si512(), wA, xa)), accA[t]);
            accB[t] = _mm512_fmadd_ps(_mm512_mul_ps(dwB, dx), _mm512_cvtepi32_ps(dpbusd_u7(_mm512_setzero_si512(), wB, xa)), accB[t]);
            sm[t] = _mm_fmadd_ps(m4, _mm_set1_ps(*(const float *)(at + 68)), sm[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        float v[4];
        _mm_storeu_ps(v, sm[t]);
        y[t * ldy + 0] = hsum8(_mm512_castps512_ps256(accA[t])) + v[0];
        y[t * ldy + 1] = hsum8(_mm512_extractf32x8_ps(accA[t], 1)) + v[1];
        y[t * ldy + 2] = hsum8(_mm512_castps512_ps256(accB[t])) + v[2];
        y[t * ldy + 3] = hsum8(_mm512_extractf32x8_ps(accB[t], 1)) + v[3];
    }
}

#define L4DEF(TT) \
    static void l4k_##TT(const uint8_t *const *rows, long nu, const float *x, long ldx, float *y, long ldy, long pfo) { \
        l4kern(TT, rows, nu, (const uint8_t *)x, 4 * ldx, y, ldy, pfo); \
    }
L4DEF(1) L4DEF(2) L4DEF(3) L4DEF(4) L4DEF(5) L4DEF(6) L4DEF(7) L4DEF(8)
static const kern_fn l4tab[9] = {0, l4k_1, l4k_2, l4k_3, l4k_4, l4k_5, l4k_6, l4k_7, l4k_8};

/* ---- Q5_0 repacked for the CPU: 4 rows interleaved per block (TY_Q5_0R) ----------------------
 * A group of 4 consecutive rows becomes, per block of 32, 88 bytes (4 x 22, the same size): the low 4 bits
 * of the codes as TY_Q4_1R's [64], then the 5th bits [16] (byte l: bit r = row r's element l, bit 4 + r its
 * element 16 + l), then d[4] (fp16). The 5th bits reach bit 4 of each code byte by two shifts and an and per
 * pair of rows (GGUF's qh word takes a spread of its 32 bits into bytes per row and block), and one cvtph
 * gives the 4 d. The arithmetic per (row, token) is gkern_legacy's: the same bits. */
#define L5B 88

static void repack_q50_group(const uint8_t *const rows[4], long nb, uint8_t *dst) {
    for (long b = 0; b < nb; b++) {
        uint8_t *o = dst + b * L5B;
        const uint8_t *qs[4];
        memset(o + 64, 0, 16);
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = rows[r] + b * 22;
            uint32_t qh;
            memcpy(o + 80 + 2 * r, blk, 2);
            memcpy(&qh, blk + 2, 4);
            for (int i = 0; i < 16; i++) o[64 + i] |= (uint8_t)(((qh >> i) & 1) << r | ((qh >> (16 + i)) & 1) << (4 + r));
            qs[r] = blk + 6;
        }
        codes4_pack(qs, o);
    }
}

static void unpack_q50_group(const uint8_t *src, long nb, uint8_t *const rows[4]) {
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = src + b * L5B;
        uint8_t *qs[4];
        for (int r = 0; r < 4; r++) {
            uint8_t *blk = rows[r] + b * 22;
            uint32_t qh = 0;
            memcpy(blk, o + 80 + 2 * r, 2);
            for (int i = 0; i < 16; i++)
                qh |= (uint32_t)((o[64 + i] >> r) & 1) << i | (uint32_t)((o[64 + i] >> (4 + r)) & 1) << (16 + i);
            memcpy(blk + 2, &qh, 4);
            qs[r] = blk + 6;
        }
        codes4_unpack(o, qs);
    }
}

/* [a << s0, a << s1] (16-bit lanes) */
INL __m512i slli2_epi16(const __m256i a, const int s0, const int s1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(a, s0)), _mm256_slli_epi16(a, s1), 1);
}

#if defined(SHARPI_AVX512_EMULATED)
/* l5kern on AVX2 in its own 256-bit vectors, one a row (the emulated 512-bit code pairs rows 0-1 / 2-3 and pays for
 * permutexvar's emulation and per-token doubled d products): the same integers, the same d_w * d_x per row and token,
 * the same lane-wise FMAs and final hsum8, so the same bits. */
INL void l5_avx2(const int TT, const uint8_t *const *rows, const long nb, const uint8_t *a, const long lda, float *y,
                 const long ldy, const long pfo) {
    __m256 acc[MAXT][4];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_ps();
    const __m256i m0f = _mm256_set1_epi8(0x0f), m10 = _mm256_set1_epi8(0x10);
    for (long b = 0; b < nb; b++) {
        const uint8_t *g = rows[0] + b * L5B;
        if (pfo && !(b & 3)) {
#pragma GCC unroll 6
            for (int o = 0; o < 4 * L5B; o += 64) _mm_prefetch((const char *)g + pfo + o, _MM_HINT_T1);
        }
        /* bytes 0-31: row 0 (low nibbles), row 2 (high); 32-63: rows 1 and 3 */
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)g), s1 = _mm256_loadu_si256((const __m256i *)(g + 32));
        /* the 5th bits of elements 0-15 | 16-31, row r's in bit r of each byte (the 16-bit shift right brings the
         * next byte's low bits into bits 4-7 only; a shift left by 4 - r then takes bit 4 from bit r of the same byte) */
        const __m128i h = _mm_loadu_si128((const __m128i *)(g + 64));
        const __m256i hv = _mm256_set_m128i(_mm_srli_epi16(h, 4), h);
        __m256i w[4];
        w[0] = _mm256_or_si256(_mm256_and_si256(s0, m0f), _mm256_and_si256(_mm256_slli_epi16(hv, 4), m10));
        w[1] = _mm256_or_si256(_mm256_and_si256(s1, m0f), _mm256_and_si256(_mm256_slli_epi16(hv, 3), m10));
        w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(s0, 4), m0f), _mm256_and_si256(_mm256_slli_epi16(hv, 2), m10));
        w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(s1, 4), m0f), _mm256_and_si256(_mm256_slli_epi16(hv, 1), m10));
        const __m256 d4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(g + 80))));
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = a + t * lda + b * LCH;
            const __m256i x = _mm256_load_si256((const __m256i *)at), st = _mm256_load_si256((const __m256i *)(at + 32));
            const __m256 dd = _mm256_mul_ps(d4, _mm256_broadcast_ss((const float *)(at + 64))); /* d_w[r] * d_x */
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m256i I = sx_dpbusd8(st, w[r], x);
                acc[t][r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(r)), _mm256_cvtepi32_ps(I), acc[t][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++)
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) y[t * ldy + r] = hsum8(acc[t][r]);
}
#endif

INL void l5kern(const int TT, const uint8_t *const *rows, const long nb, const uint8_t *a, const long lda, float *y,
                const long ldy, const long pfo) {
#if defined(SHARPI_AVX512_EMULATED) /* (1.0-1.15x the emulated code below at 1-8 tokens, measured) */
    l5_avx2(TT, rows, nb, a, lda, y, ldy, pfo);
    return;
#endif
    __m512 accA[MAXT], accB[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) accA[t] = accB[t] = _mm512_setzero_ps();
    const __m512i m0f = _mm512_set1_epi8(0x0f), m10 = _mm512_set1_epi8(0x10);
    const __m512i iA = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i iB = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    for (long b = 0; b < nb; b++) {
        const uint8_t *g = rows[0] + b * L5B;
        if (pfo && !(b & 3)) {
#pragma GCC unroll 6
            for (int o = 0; o < 4 * L5B; o += 64) _mm_prefetch((const char *)g + pfo + o, _MM_HINT_T1);
        }
        const __m512i s = _mm512_loadu_si512((const void *)g);
        /* the 5th bits of elements 0-15 | 16-31, row r's in bit r; moved to bit 4 (16-bit shifts by <= 4: bit 4 of
         * each byte comes from the same byte) */
        const __m128i h = _mm_loadu_si128((const __m128i *)(g + 64));
        const __m256i hv = _mm256_set_m128i(_mm_srli_epi16(_mm_and_si128(h, _mm_set1_epi8((char)0xf0)), 4), _mm_and_si128(h, _mm_set1_epi8(0x0f)));
        const __m512i wA = _mm512_or_si512(_mm512_and_si512(s, m0f), _mm512_and_si512(slli2_epi16(hv, 4, 3), m10));
        const __m512i wB = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(s, 4), m0f), _mm512_and_si512(slli2_epi16(hv, 2, 1), m10));
        const __m256 d4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(g + 80))));
        const __m512 dwA = _mm512_permutexvar_ps(iA, _mm512_castps256_ps512(d4));
        const __m512 dwB = _mm512_permutexvar_ps(iB, _mm512_castps256_ps512(d4));
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *at = a + t * lda + b * LCH;
            const __m512i xa = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)at));
            const __m512i st = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(at + 32)));
            const __m512 dx = _mm512_set1_ps(*(const float *)(at + 64));
            accA[t] = _mm512_fmadd_ps(_mm512_mul_ps(dwA, dx), _mm512_cvtepi32_ps(dpbusd_u7(st, wA, xa)), accA[t]);
            accB[t] = _mm512_fmadd_ps(_mm512_mul_ps(dwB, dx), _mm512_cvtepi32_ps(dpbusd_u7(st, wB, xa)), accB[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
        y[t * ldy + 0] = hsum8(_mm512_castps512_ps256(accA[t]));
        y[t * ldy + 1] = hsum8(_mm512_extractf32x8_ps(accA[t], 1));
        y[t * ldy + 2] = hsum8(_mm512_castps512_ps256(accB[t]));
        y[t * ldy + 3] = hsum8(_mm512_extractf32x8_ps(accB[t], 1));
    }
}

#define L5DEF(TT) \
    static void l5k_##TT(const uint8_t *const *rows, long nu, const float *x, long ldx, float *y, long ldy, long pfo) { \
        l5kern(TT, rows, nu, (const uint8_t *)x, 4 * ldx, y, ldy, pfo); \
    }
L5DEF(1) L5DEF(2) L5DEF(3) L5DEF(4) L5DEF(5) L5DEF(6) L5DEF(7) L5DEF(8)
static const kern_fn l5tab[9] = {0, l5k_1, l5k_2, l5k_3, l5k_4, l5k_5, l5k_6, l5k_7, l5k_8};

/* Rows of a Q4_K (ty 12), Q4_1 (ty 3) or Q5_0 (ty 6) weight [N, row bytes] <-> its groups of 4 rows (TY_Q4_KR /
 * TY_Q4_1R / TY_Q5_0R, the same bytes per row but Q4_K's 4 more per super-block) (inverse = 1); N % 4 == 0.
 * Returns 0, -1 for a bad type or shape. */
int sharpi_repack(int ty, const uint8_t *src, long n, long k, uint8_t *dst, int inverse, int nthreads) {
    const int q4k = ty == TY_Q4_K, q50 = ty == TY_Q5_0, ue = q4k ? 256 : 32;
    if ((ty != TY_Q4_K && ty != TY_Q4_1 && ty != TY_Q5_0) || n % 4 || k % ue || n <= 0) return -1;
    const long nu = k / ue, rb = nu * (q4k ? 144 : q50 ? 22 : 20), gb = nu * (q4k ? R4B : q50 ? L5B : L4B);
    const int nth = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel for num_threads(nth) schedule(static) if (nth > 1 && n >= 64)
    for (long g = 0; g < n / 4; g++) {
        if (!inverse) {
            const uint8_t *rows[4] = {src + 4 * g * rb, src + (4 * g + 1) * rb, src + (4 * g + 2) * rb, src + (4 * g + 3) * rb};
            if (q4k) repack_q4k_group(rows, nu, dst + g * gb);
            else if (q50) repack_q50_group(rows, nu, dst + g * gb);
            else repack_q41_group(rows, nu, dst + g * gb);
        } else {
            uint8_t *rows[4] = {dst + 4 * g * rb, dst + (4 * g + 1) * rb, dst + (4 * g + 2) * rb, dst + (4 * g + 3) * rb};
            if (q4k) unpack_q4k_group(src + g * gb, nu, rows);
            else if (q50) unpack_q50_group(src + g * gb, nu, rows);
            else unpack_q41_group(src + g * gb, nu, rows);
        }
    }
    return 0;
}

/* Integer kernels share the kern_fn signature: x is the scratch (bytes), ldx its row stride / 4,
 * nu the number of blocks (legacy) or super-blocks (K-quants). */
#define IKDEF(TY, R, TT, BODY) \
    static void IKNAME(TY, R, TT)(const uint8_t *const *rows, long nu, const float *x, long ldx, float *y, long ldy, long pfo) { \
        BODY(TY, R, TT, rows, nu, (const uint8_t *)x, 4 * ldx, y, ldy, pfo); \
    }
/* weight rows per tile for TT = 1..8 tokens (legacy L*, K-quants K*) */
#ifndef LR1
#define LR1 4
#define LR2 4
#define LR3 2
#define LR4 2
#define LR5 2
#define LR6 2
#define LR7 2
#define LR8 2
#endif
#ifndef KR1
#define KR1 4
#define KR2 4
#define KR3 4
#define KR4 4
#define KR5 2
#define KR6 2
#define KR7 2
#define KR8 2
#endif
#define IKDEF_(TY, R, TT, BODY) IKDEF(TY, R, TT, BODY)
#define IKSET(TY, BODY, P) \
    IKDEF_(TY, P##R1, 1, BODY) IKDEF_(TY, P##R2, 2, BODY) IKDEF_(TY, P##R3, 3, BODY) IKDEF_(TY, P##R4, 4, BODY) \
    IKDEF_(TY, P##R5, 5, BODY) IKDEF_(TY, P##R6, 6, BODY) IKDEF_(TY, P##R7, 7, BODY) IKDEF_(TY, P##R8, 8, BODY) \
    static const kern_fn iktab_##TY[9] = {0, IKNAME(TY, P##R1, 1), IKNAME(TY, P##R2, 2), IKNAME(TY, P##R3, 3), \
        IKNAME(TY, P##R4, 4), IKNAME(TY, P##R5, 5), IKNAME(TY, P##R6, 6), IKNAME(TY, P##R7, 7), IKNAME(TY, P##R8, 8)};
#define IKNAME_(TY, R, TT) ik_##TY##_##R##_##TT
#define IKNAME(TY, R, TT) IKNAME_(TY, R, TT)

IKSET(TY_Q4_0, gkern_legacy, L)
IKSET(TY_Q4_1, gkern_legacy, L)
IKSET(TY_Q5_0, gkern_legacy, L)
IKSET(TY_Q5_1, gkern_legacy, L)
IKSET(TY_Q8_0, gkern_legacy, L)
IKSET(TY_IQ4_NL, gkern_legacy, L)
IKSET(TY_Q4_0_R8, gkern_chain, L)
IKSET(TY_IQ4_NL_R8, gkern_chain, L)
IKSET(TY_MXFP4, gkern_legacy, L)
IKSET(TY_MXFP4_R8, gkern_chain, L)
/* Q4_K: 4 rows for every TT (their float chains share vector lanes) */
#define QR1 4
#define QR2 4
#define QR3 4
#define QR4 4
#define QR5 4
#define QR6 4
#define QR7 4
#define QR8 4
IKSET(TY_Q4_K, gkern_q4k_gemv, Q)
IKSET(TY_Q4_K_GEMM, gkern_q4k_gemm, Q)
IKSET(TY_Q5_K, gkern_q6k, K)
IKSET(TY_Q5_K_TILED, gkern_q6k, K)
IKSET(TY_Q6_K, gkern_q6k, K)
IKSET(TY_Q6_K_TILED, gkern_q6k, K)
IKSET(TY_Q3_K, gkern_q6k, K)
IKSET(TY_Q3_K_TILED, gkern_q6k, K)
IKSET(TY_Q2_K, gkern_q6k, K)
IKSET(TY_Q2_K_GEMM, gkern_q6k, K)
IKSET(TY_IQ4_XS, gkern_q6k, K)
IKSET(TY_IQ4_XS_TILED, gkern_q6k, K)

static const kern_fn *iktab_for(int ty) {
    switch (ty) {
    case TY_Q4_0: return iktab_TY_Q4_0;
    case TY_Q4_1: return iktab_TY_Q4_1;
    case TY_Q5_0: return iktab_TY_Q5_0;
    case TY_Q5_1: return iktab_TY_Q5_1;
    case TY_Q8_0: return iktab_TY_Q8_0;
    case TY_IQ4_NL: return iktab_TY_IQ4_NL;
    case TY_MXFP4: return iktab_TY_MXFP4;
    case TY_Q4_K: return iktab_TY_Q4_K;
    case TY_Q5_K: return iktab_TY_Q5_K;
    case TY_Q6_K: return iktab_TY_Q6_K;
    case TY_Q3_K: return iktab_TY_Q3_K;
    case TY_Q2_K: return iktab_TY_Q2_K;
    case TY_IQ4_XS: return iktab_TY_IQ4_XS;
    case TY_Q4_KR: return r4tab_gemv;
    default: return 0;
    }
}
static const int lkern_rows[9] = {0, LR1, LR2, LR3, LR4, LR5, LR6, LR7, LR8};
static const int kkern_rows[9] = {0, KR1, KR2, KR3, KR4, KR5, KR6, KR7, KR8};
static const int qkern_rows[9] = {0, QR1, QR2, QR3, QR4, QR5, QR6, QR7, QR8};

/* Prepared path (T > 8): every row of a tile of 4 is unpacked once (prep_fn) into a buffer of
 * [step][4 rows] slots, then the groups of up to 8 tokens run pkern_fn over it. */
typedef void (*pkern_fn)(const uint8_t *prep, long nsteps, const uint8_t *a, long lda, float *y, long ldy);
typedef void (*prep_fn)(const uint8_t *row, long n, uint8_t *dst, long pfo); /* n: blocks / super-blocks */

#define PKDEF(TY, R, TT, BODY) \
    static void PKNAME(TY, R, TT)(const uint8_t *prep, long ns, const uint8_t *a, long lda, float *y, long ldy) { \
        BODY(TY, R, TT, prep, ns, a, lda, y, ldy); \
    }
#define PKDEF_(TY, R, TT, BODY) PKDEF(TY, R, TT, BODY)
#define PKNAME_(TY, R, TT) pk_##TY##_##R##_##TT
#define PKNAME(TY, R, TT) PKNAME_(TY, R, TT)
#define PKSET(TY, BODY, P) \
    PKDEF_(TY, P##R1, 1, BODY) PKDEF_(TY, P##R2, 2, BODY) PKDEF_(TY, P##R3, 3, BODY) PKDEF_(TY, P##R4, 4, BODY) \
    PKDEF_(TY, P##R5, 5, BODY) PKDEF_(TY, P##R6, 6, BODY) PKDEF_(TY, P##R7, 7, BODY) PKDEF_(TY, P##R8, 8, BODY) \
    static const pkern_fn pktab_##TY[9] = {0, PKNAME(TY, P##R1, 1), PKNAME(TY, P##R2, 2), PKNAME(TY, P##R3, 3), \
        PKNAME(TY, P##R4, 4), PKNAME(TY, P##R5, 5), PKNAME(TY, P##R6, 6), PKNAME(TY, P##R7, 7), PKNAME(TY, P##R8, 8)};

#define KPREPDEF(TY) \
    static void prep_##TY(const uint8_t *row, long nu, uint8_t *dst, long pfo) { \
        for (long u = 0; u < nu; u++) { \
            if (pfo) kprefetch(TY, 1, &row, u, pfo); \
            kprep(TY, row + u * unit_bytes(TY), (KPrep *)dst + 4 * u); \
        } \
    }

PKSET(TY_Q4_K, pkern_q4k, Q) KPREPDEF(TY_Q4_K)
PKSET(TY_Q4_K_GEMM, pkern_q4k, Q)

typedef struct {
    const pkern_fn *kt; /* NULL: no prepared path */
    prep_fn prep;
    long slot;          /* bytes of one prepared (step, row) slot */
    long nsteps;        /* steps per row */
} PrepPath;

static PrepPath prep_path(int ty, long k) {
    PrepPath p = {0, 0, 0, 0};
    switch (ty) {
#define PCASE(TY) case TY: p.kt = pktab_##TY; p.prep = prep_##TY; p.slot = (long)sizeof(KPrep); p.nsteps = k / 256; break;
    PCASE(TY_Q4_K)
#undef PCASE
    default: break;
    }
    return p;
}

/* per-thread scratch for the quantized activations (grown, never shrunk) */
static __thread uint8_t *scratch_p;
static __thread size_t scratch_n;

static uint8_t *scratch(size_t bytes) { return grow(&scratch_p, &scratch_n, bytes); }

/* Q4_K's min-term groups of activation rows dst [T] (stride act_row_bytes): tokens 4g..4g+3 (absent ones zero) */
static void q4k_groups(uint8_t *dst, long T, long k) {
    const long rbytes = act_row_bytes(TY_Q4_K, k);
    for (long g = 0; g < (T + 3) / 4; g++)
        for (long u = 0; u < k / 256; u++) {
            uint8_t *gb = dst + 4 * g * rbytes + u * 512;
            float dx4[16] = {0};
            memset(gb + 384, 0, 64);
            for (int j = 0; j < 4 && 4 * g + j < T; j++) {
                const uint8_t *tb = dst + (4 * g + j) * rbytes + u * 512;
                memcpy(gb + 384 + 16 * j, tb + 256, 16); /* its 8 int16 sums */
                float d;
                memcpy(&d, tb + 320, 4);
                for (int i = 0; i < 4; i++) dx4[4 * j + i] = d;
            }
            memcpy(gb + 448, dx4, 64);
        }
}

/* x [T, k] -> scratch rows (stride act_row_bytes) in the layout of weight type ty */
static void quantize_rows(int ty, const float *x, long T, long k, uint8_t *dst, int nthreads) {
    const long rbytes = act_row_bytes(ty, k);
    const int nth = (T > 1 && T * k >= (1L << 16)) ? (nthreads < 1 ? 1 : nthreads) : 1;
#pragma omp parallel for num_threads(nth) schedule(static) if (nth > 1)
    for (long t = 0; t < T; t++) act_row(ty, x + t * k, k, dst + t * rbytes);
    if (ty == TY_Q4_K) q4k_groups(dst, T, k);
}

/* Test / reference export: the activation codes and scales in plain order.
 * codes int8 [T, k]; d f32 [T, k / block] (Q8_0 / Q8_1: the fp16 value); s f32 [T, k / 32] (Q8_1,
 * else untouched; may be NULL); bsums int16 [T, k / 16] (Q8_K, else untouched; may be NULL).
 * Returns the vec_dot kind (1 = Q8_0, 2 = Q8_1, 3 = Q8_K), or -1. */
int sharpi_quantize_act(int ty, const float *x, long T, long k, int8_t *codes, float *d, float *s, int16_t *bsums) {
    const int vk = vd_kind(ty);
    const int blk = vk == VD_Q8_K ? 256 : 32;
    if ((vk != VD_Q8_0 && vk != VD_Q8_1 && vk != VD_Q8_K) || k % blk) return -1;
    const long nb = k / blk;
    for (long t = 0; t < T; t++)
        for (long b = 0; b < nb; b++) {
            const long i = t * nb + b;
            const float *xb = x + t * k + b * blk;
            int8_t *qb = codes + t * k + b * blk;
            if (vk == VD_Q8_K) {
                int16_t tmp[16];
                q8K_quant(xb, 256, qb, &d[i], tmp);
                if (bsums) memcpy(bsums + i * 16, tmp, sizeof tmp);
            } else {
                float sv = 0.f;
                q8_32_quant(xb, 32, qb, &d[i], vk == VD_Q8_1 ? &sv : NULL);
                if (s && vk == VD_Q8_1) s[i] = sv;
            }
        }
    return vk;
}

/* A q8_0 KV cache write: nb blocks of 32 floats -> codes [nb * 32] and fp16 scales [nb] (stored
 * apart, kv_cache.py's layout), by ggml's x86 quantize_row_q8_0 like the activations. */
void sharpi_store_q8_0(const float *x, long nb, int8_t *codes, uint16_t *d) {
    for (long b = 0; b < nb; b++) {
        float db;
        q8_32_quant(x + b * 32, 32, codes + b * 32, &db, NULL);
        d[b] = _cvtss_sh(db, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  /* exact: db is an fp16 value */
    }
}

/* x rounded through 8-bit blocks of `block` (multiple of 16) values and returned dequantized:
 * f16_scale: ggml's Q8_0 rules (y = code * fp16(d)); else Q8_K's (y = code * d). n % block == 0. */
void sharpi_round_act(const float *x, long n, int block, int f16_scale, float *y) {
    int8_t q[4096];
    int16_t bs[256];
    if (block <= 0 || block % 16 || block > 4096) return;
    for (long b = 0; b < n; b += block) {
        float d;
        if (f16_scale) q8_32_quant(x + b, block, q, &d, NULL);
        else q8K_quant(x + b, block, q, &d, bs);
        const __m512 vd = _mm512_set1_ps(d);
        for (int i = 0; i < block; i += 16)
            _mm512_storeu_ps(y + b + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i)))), vd));
    }
}

/* per-thread buffer for prepared weight rows (grown, never shrunk) */
static __thread uint8_t *prepbuf_p;
static __thread size_t prepbuf_n;

/* Prepared path (T > 8): blocks of RB consecutive rows are unpacked once into a per-thread buffer
 * (tiles of 4 rows, each [step][4 rows] slots; about 768 KB, in L2), then every group of up to 8
 * tokens runs over all the block's tiles while its activations stay in L1. */
static void mm_rows_prepared(const PrepPath *pp, const int *krows, const uint8_t *w, long rb, long n0, long n1,
                             long nu, const uint8_t *a, long lda, long T, float *y, long ldy, uint8_t *buf, long RB) {
    const long tile_bytes = 4 * pp->slot * pp->nsteps;
    for (long b0 = n0; b0 < n1; b0 += RB) {
        const long nbr = (n1 - b0 < RB) ? n1 - b0 : RB, ntiles = (nbr + 3) / 4;
        for (long i = 0; i < ntiles; i++)
            for (int r = 0; r < 4; r++) {
                const long row = b0 + ((4 * i + r < nbr) ? 4 * i + r : nbr - 1); /* pad: repeat the last row */
                pp->prep(w + row * rb, nu, buf + i * tile_bytes + r * pp->slot, pf_dist);
            }
        for (long t0 = 0; t0 < T; t0 += MAXT) {
            const int TT = (T - t0 < MAXT) ? (int)(T - t0) : MAXT;
            const int KR = krows[TT];
            for (long i = 0; i < ntiles; i++)
                for (int m = 0; m < 4; m += KR) {
                    float tmp[MAXT * MAXR];
                    pp->kt[TT](buf + i * tile_bytes + m * pp->slot, pp->nsteps, a + t0 * lda, lda, tmp, MAXR);
                    for (int t = 0; t < TT; t++)
                        for (int r = 0; r < KR && 4 * i + m + r < nbr; r++) y[(t0 + t) * ldy + b0 + 4 * i + m + r] = tmp[t * MAXR + r];
                }
        }
    }
}

/* Rows [n0, n1) of W for all T activation rows. The range is cut into 4 contiguous quarters and each
 * tile of 4 rows takes one row from every quarter: 4 sequential streams (which the prefetchers
 * follow) instead of 4 interleaved ones. The 4 rows stay in L1 across the groups of 8 tokens. */
static void mm_rows(const kern_fn *kt, const int *krows, const PrepPath *pp, const uint8_t *w, long rb, long n0,
                    long n1, long nu, const float *x, long ldx, long T, float *y, long ldy) {
    if (pp && pp->kt && T > MAXT) {
        const long row_bytes = pp->slot * pp->nsteps;
        long RB = (768L << 10) / row_bytes / 4 * 4;
        RB = RB < 4 ? 4 : RB > 64 ? 64 : RB;
        const size_t need = (size_t)(RB * row_bytes);
        if (need > prepbuf_n) {
            void *p = NULL;
            if (!posix_memalign(&p, 64, need)) {
                free(prepbuf_p);
                prepbuf_p = p;
                prepbuf_n = need;
            }
        }
        if (need <= prepbuf_n) {
            mm_rows_prepared(pp, krows, w, rb, n0, n1, nu, (const uint8_t *)x, 4 * ldx, T, y, ldy, prepbuf_p, RB);
            return;
        }
    }
    const long q = (n1 - n0 + 3) / 4;
    for (long g = 0; g < q; g++) {
        long idx[4];
        int nr = 0;
        for (int r = 0; r < 4; r++) {
            const long row = n0 + g + r * q;
            if (row < n1) idx[nr++] = row;
        }
        for (int r = nr; r < 4; r++) idx[r] = idx[nr - 1]; /* tail: duplicate a row, drop its output */
        for (long t0 = 0; t0 < T; t0 += MAXT) {
            const int TT = (T - t0 < MAXT) ? (int)(T - t0) : MAXT;
            const int KR = krows[TT];
            /* software prefetch ahead in each row stream while the rows come from memory */
            const long pfo = t0 ? 0 : pf_dist;
            for (int m = 0; m < 4; m += KR) {
                const uint8_t *rows[MAXR];
                for (int r = 0; r < KR; r++) rows[r] = w + idx[m + r] * rb;
                float tmp[MAXT * MAXR];
                kt[TT](rows, nu, x + t0 * ldx, ldx, tmp, MAXR, pfo);
                for (int t = 0; t < TT; t++)
                    for (int r = 0; r < KR && m + r < nr; r++) y[(t0 + t) * ldy + idx[m + r]] = tmp[t * MAXR + r];
            }
        }
    }
}

/* Rows [n0, n1) (multiples of 4) of a repacked Q4_K weight: its groups are one sequential stream.
 * Tokens go in blocks whose activations stay in L2 (all of them for short passes); within a block,
 * each group's codes stay in L1 across the kernel's passes of up to 8 tokens. */
static void mm_rows_r4(const kern_fn *kt, const uint8_t *w, long rb, long n0, long n1, long nu, const uint8_t *a,
                       long lda, long T, float *y, long ldy) {
    long TB = (512L << 10) / lda / MAXT * MAXT;
    TB = TB < MAXT ? MAXT : TB;
    for (long tb = 0; tb < T; tb += TB) {
        const long te = tb + TB < T ? tb + TB : T;
        for (long row = n0; row < n1; row += 4) {
            const uint8_t *rows[1] = {w + row * rb};
            for (long t0 = tb; t0 < te; t0 += MAXT) {
                const int TT = (te - t0 < MAXT) ? (int)(te - t0) : MAXT;
                kt[TT](rows, nu, (const float *)(a + t0 * lda), lda / 4, y + t0 * ldy + row, ldy, t0 == tb && tb == 0 ? pf_dist : 0);
            }
        }
    }
}

/* The kernels of a quantized weight type in the decoding order (on quantized activations: mode 1): the
 * register kernels kt, the rows they take per call for each token count, the prepared path (if any). */
static void decode_kernels(int ty, long n, long k, const kern_fn **kt, const int **krows, PrepPath *pp) {
    if (iktab_for(ty)) {
        *kt = iktab_for(ty);
        *krows = ty == TY_Q4_K ? qkern_rows : vd_kind(ty) == VD_Q8_K ? kkern_rows : lkern_rows;
        *pp = prep_path(ty, k);
    }
    if ((ty == TY_Q4_0 || ty == TY_IQ4_NL || ty == TY_MXFP4) && n % 8 == 0) /* repacked by llama.cpp: its order, every T */
        *kt = ty == TY_Q4_0 ? iktab_TY_Q4_0_R8 : ty == TY_MXFP4 ? iktab_TY_MXFP4_R8 : iktab_TY_IQ4_NL_R8;
    if (ty == TY_Q4_1R || ty == TY_Q5_0R) {
        *kt = ty == TY_Q4_1R ? l4tab : l5tab;
        *krows = r4_rows;
    } else if (ty == TY_Q4_KR) {
        *krows = r4_rows;
    }
}

static int pick_threads(int nthreads, long n, long bytes) {
    if (nthreads < 1) nthreads = 1;
    if (bytes < (48 << 10)) return 1; /* a tiny matrix costs less than waking a thread */
    if (nthreads > n / 4) nthreads = (int)(n / 4) > 0 ? (int)(n / 4) : 1;
    return nthreads;
}

/* ---------------------------------------------------------------------------------------------
 * Exported entry points. Return 0 on success, -1 for an unsupported type or shape.
 * ------------------------------------------------------------------------------------------- */
/* ty_mode = type | mode << 8. mode 0: x used as given (fp32); mode 1: x quantized to the weight
 * type's ggml vec_dot_type first (integer dot products for the quantized types, fp16 / bf16 rounding
 * for F16 / BF16). Returns 0, -1 for an unsupported type or shape, -2 when out of memory. */
void sharpi_float_rows(const void *w, int wtype, long n0, long n1, long k, const float *x, const uint16_t *xb, long ldx,
                       long T, float *y, long ldy, int tiny); /* ops.c */

int sharpi_qmatmul(int ty_mode, const uint8_t *w, long rb, long n, long k, const float *x, long T, float *y,
                   int nthreads) {
    const int ty = ty_mode & 0xff, mode = ty_mode >> 8;
    /* F32: only in ggml's orders (sharpi_float_rows), which take rows of 64s */
    const int ue = ty == TY_F32 ? 64 : ue_of(ty), ub = ty == TY_F32 ? 256 : ub_of(ty);
    if (!ue || k % ue || rb != (k / ue) * ub || T < 1 || n < 1 || mode < 0 || mode > 2) return -1;
    if ((ty == TY_Q4_KR || ty == TY_Q4_1R || ty == TY_Q5_0R) && (mode == 0 || n % 4)) return -1; /* integer kernels only */
    long nu = k / ue, ldx = k;
    const kern_fn *kt = ktab_for(ty), *kt4 = NULL;
    const int *krows = kern_rows;
    PrepPath pp = {0, 0, 0, 0}, pp4 = {0, 0, 0, 0};
    long T4 = 0; /* rows [0, T4) in kt4's order (prompt processing), the rest in kt's */
    const uint16_t *xb = NULL; /* BF16: the rounded activations as bf16 codes too (ggml's bf16 dot products) */
    if (mode >= 1 && vd_kind(ty) != VD_F32) {
        const long rbytes = act_row_bytes(ty, k);
        const size_t codes = ty == TY_BF16 ? (size_t)(T * k) * 2 : 0;
        uint8_t *a = scratch((size_t)(T * rbytes) + codes);
        if (!a) return -2;
        quantize_rows(ty, x, T, k, a, nthreads);
        x = (const float *)a;
        ldx = rbytes / 4;
        if (codes) { /* exact: the floats are rounded to bf16 already */
            uint16_t *b = (uint16_t *)(a + T * rbytes);
            for (long i = 0; i < T * k; i++) {
                uint32_t u;
                memcpy(&u, x + i / k * ldx + i % k, 4);
                b[i] = (uint16_t)(u >> 16);
            }
            xb = b;
        }
        decode_kernels(ty, n, k, &kt, &krows, &pp);
        if (mode == 2 && ty == TY_Q4_KR) { /* ggml_gemm_q4_K_8x8_q8_K's order on groups of 4 tokens */
            kt4 = r4tab_gemm;
            T4 = T - T % 4;
        } else if (mode == 2 && ty == TY_Q4_K) { /* repacked: ggml_gemm_q4_K_8x8_q8_K on groups of 4 tokens */
            kt4 = iktab_TY_Q4_K_GEMM;
            pp4 = pp;
            pp4.kt = pktab_TY_Q4_K_GEMM;
            T4 = T - T % 4;
        } else if (mode == 2 && (ty == TY_Q6_K || ty == TY_Q3_K || ty == TY_IQ4_XS || ty == TY_Q5_K) && T >= 8) { /* the tiled matmul takes passes of >= 8 */
            kt4 = ty == TY_Q6_K ? iktab_TY_Q6_K_TILED : ty == TY_Q3_K ? iktab_TY_Q3_K_TILED
                : ty == TY_IQ4_XS ? iktab_TY_IQ4_XS_TILED : iktab_TY_Q5_K_TILED;
            T4 = T;
        } else if (mode == 2 && ty == TY_Q2_K) { /* repacked: ggml_gemm_q2_K_8x8_q8_K on groups of 4 tokens */
            kt4 = iktab_TY_Q2_K_GEMM;
            T4 = T - T % 4;
        }
    }
    const int nth = pick_threads(nthreads, n, n * rb * (T < 8 ? T : 8)); /* ~ work of the call */
    long n_amx = 0; /* rows [0, n_amx) of tokens [0, T4) are done by the tile unit */
#if SHARPI_AMX
    if (((ty == TY_Q4_KR && T4 >= AMX_MIN_T) || (ty == TY_Q6_K && T4 >= AMX6_MIN_T)) && n >= 16 && amx_ready()) {
        if (amx_matmul(ty == TY_Q6_K, w, rb, n, k, (const uint8_t *)x, 4 * ldx, T4, y, nth)) return -2;
        n_amx = n - n % 16;
    }
#endif
    /* Chunks of rows handed out through an atomic counter: a thread that is slowed down (another
     * process on its core) holds back at most one chunk instead of half the matrix. Row results do
     * not depend on the chunking. */
    long chunk = (n + nth * 8 - 1) / (nth * 8);
    chunk = nth == 1 ? n : (chunk + 3) / 4 * 4;
    const long nchunks = (n + chunk - 1) / chunk;
    long next = 0;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        for (;;) {
            const long c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (c >= nchunks) break;
            const long n0 = c * chunk, n1 = (n0 + chunk < n) ? n0 + chunk : n;
            /* ggml's own summation orders (vec_dot, tinyBLAS); BF16 on activations rounded to bf16 (mode >= 1).
             * llamafile's tinyBLAS takes a prompt pass only when the weight's rows are a multiple of 4 (its
             * tiles); ggml's mul_mat runs the others (qwen2moe's one-row shared-expert gate) by vec_dot */
            if (ty == TY_F32 || ty == TY_F16 || (ty == TY_BF16 && mode >= 1)) {
                sharpi_float_rows(w, ty == TY_F32 ? 0 : ty == TY_F16 ? 1 : 2, n0, n1, k, x, xb, ldx, T, y, n,
                                  mode == 2 && T >= 2 && n % 4 == 0);
                continue;
            }
            if (ty == TY_Q4_KR || ty == TY_Q4_1R || ty == TY_Q5_0R) {
                if (T4 && n1 > n_amx) mm_rows_r4(kt4, w, rb, n0 > n_amx ? n0 : n_amx, n1, nu, (const uint8_t *)x, 4 * ldx, T4, y, n);
                if (T > T4) mm_rows_r4(kt, w, rb, n0, n1, nu, (const uint8_t *)(x + T4 * ldx), 4 * ldx, T - T4, y + T4 * n, n);
                continue;
            }
            if (T4 && n1 > n_amx) mm_rows(kt4, krows, &pp4, w, rb, n0 > n_amx ? n0 : n_amx, n1, nu, x, ldx, T4, y, n);
            if (T > T4) mm_rows(kt, krows, &pp, w, rb, n0, n1, nu, x + T4 * ldx, ldx, T - T4, y + T4 * n, n);
        }
    }
    return 0;
}

/* ggml's mul_mat_id (mixture-of-experts matmuls) in the decoding order: pair p of np multiplies activation
 * row xrow[p] of x (row stride ldx floats) by expert ids[p]'s weight [n, k] (a quantized type ty, at wptrs[e],
 * rows of rb bytes) into row p of y (stride ldy), plus bias[ids[p] * n ..] when bias is given (ggml_add_id).
 * Each expert's pairs are one pass of the mode-1 kernels over those rows (so every row has the bits of a
 * one-token qmatmul); the activations are quantized once per pair and all experts' row chunks run in one
 * parallel region. Returns 0, -1 for an unsupported type, shape or expert id, -2 when out of memory. */
int sharpi_qmatmul_id(int ty, const int64_t *wptrs, long n_exp, long rb, long n, long k, const float *x, long ldx,
                      long np, const int32_t *ids, const int32_t *xrow, const float *bias, float *y, long ldy,
                      int nthreads) {
    const int ue = ue_of(ty), ub = ub_of(ty);
    if (!ue || k % ue || rb != (k / ue) * ub || n < 1 || np < 0 || n_exp < 1 || ldy < n
        || ty == TY_F32 || ty == TY_F16 || ty == TY_BF16 || vd_kind(ty) == VD_F32)
        return -1;
    if ((ty == TY_Q4_KR || ty == TY_Q4_1R || ty == TY_Q5_0R) && n % 4) return -1;
    for (long p = 0; p < np; p++)
        if (ids[p] < 0 || ids[p] >= n_exp || xrow[p] < 0) return -1;
    if (np == 0) return 0;
    const kern_fn *kt = ktab_for(ty);
    const int *krows = kern_rows;
    PrepPath pp = {0, 0, 0, 0};
    decode_kernels(ty, n, k, &kt, &krows, &pp);
    const int r4 = ty == TY_Q4_KR || ty == TY_Q4_1R || ty == TY_Q5_0R;
    const long nu = k / ue, rbytes = act_row_bytes(ty, k);
    /* the pairs by expert (stable): order[start[e] .. start[e + 1]) */
    long *start = calloc((size_t)n_exp + 1, sizeof(long)), *order = malloc((size_t)np * sizeof(long));
    uint8_t *a = scratch((size_t)(np * rbytes) + (size_t)(np * n) * 4);
    if (!start || !order || !a) {
        free(start);
        free(order);
        return -2;
    }
    float *ys = (float *)(a + np * rbytes); /* [np, n]: results in `order`'s order */
    for (long p = 0; p < np; p++) start[ids[p] + 1]++;
    long na = 0, most = 0;
    for (long e = 0; e < n_exp; e++) {
        na += start[e + 1] > 0;
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
    }
    long *act = malloc((size_t)na * sizeof(long)), *fill = malloc((size_t)n_exp * sizeof(long));
    if (!act || !fill) {
        free(start);
        free(order);
        free(act);
        free(fill);
        return -2;
    }
    for (long e = 0, j = 0; e < n_exp; e++) {
        fill[e] = start[e];
        if (start[e + 1] > start[e]) act[j++] = e;
    }
    for (long p = 0; p < np; p++) order[fill[ids[p]]++] = p;
    const int nth = pick_threads(nthreads, n * na, n * rb * na * (most < 8 ? most : 8));
    long chunk = (n * na + nth * 8 - 1) / (nth * 8);
    chunk = nth == 1 ? n : (chunk + 3) / 4 * 4;
    chunk = chunk > n ? n : chunk;
    const long per = (n + chunk - 1) / chunk, ntasks = na * per;
    long next = 0;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
#pragma omp for schedule(static)
        for (long s = 0; s < np; s++) act_row(ty, x + xrow[order[s]] * ldx, k, a + s * rbytes);
        if (ty == TY_Q4_K) {
#pragma omp for schedule(static)
            for (long j = 0; j < na; j++) q4k_groups(a + start[act[j]] * rbytes, start[act[j] + 1] - start[act[j]], k);
        }
        for (;;) {
            const long c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (c >= ntasks) break;
            const long e = act[c / per], s0 = start[e], T = start[e + 1] - s0;
            const long n0 = (c % per) * chunk, n1 = (n0 + chunk < n) ? n0 + chunk : n;
            const uint8_t *w = (const uint8_t *)(intptr_t)wptrs[e];
            if (r4) mm_rows_r4(kt, w, rb, n0, n1, nu, a + s0 * rbytes, rbytes, T, ys + s0 * n, n);
            else mm_rows(kt, krows, &pp, w, rb, n0, n1, nu, (const float *)(a + s0 * rbytes), rbytes / 4, T, ys + s0 * n, n);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long s = 0; s < np; s++) {
            const long p = order[s];
            float *yp = y + p * ldy;
            const float *src = ys + s * n;
            if (bias) {
                const float *b = bias + (long)ids[p] * n;
                for (long j = 0; j < n; j++) yp[j] = src[j] + b[j];
            } else {
                memcpy(yp, src, (size_t)n * 4);
            }
        }
    }
    free(start);
    free(order);
    free(act);
    free(fill);
    return 0;
}

/* exact dequantization of one row (bit-identical to gguf.quants.dequantize); exact == 2: Q4_1 / Q5_1
 * without their mins */
INL void dq_row(const int ty, const int exact, const uint8_t *row, long nu, float *out) {
    const int UE = unit_elems(ty), UB = unit_bytes(ty), NP = n_pieces(ty), NV = n_vecs(ty);
    for (long u = 0; u < nu; u++) {
        Prep P;
        const uint8_t *b = row + u * UB;
        prep(ty, exact, b, &P);
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) {
            __m512 w[MAXNV];
            piece(ty, p, b, &P, w);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + u * UE + xoff(ty, p, v), w[v]);
        }
    }
}

typedef void (*dq_fn)(const uint8_t *row, long nu, float *out);
#define DQDEF(TY) static void dq_##TY(const uint8_t *row, long nu, float *out) { dq_row(TY, 1, row, nu, out); }
static void dq_nomin_Q4_1(const uint8_t *row, long nu, float *out) { dq_row(TY_Q4_1, 2, row, nu, out); }
static void dq_nomin_Q5_1(const uint8_t *row, long nu, float *out) { dq_row(TY_Q5_1, 2, row, nu, out); }
DQDEF(TY_F16)
DQDEF(TY_BF16)
DQDEF(TY_Q4_0)
DQDEF(TY_Q4_1)
DQDEF(TY_Q5_0)
DQDEF(TY_Q5_1)
DQDEF(TY_Q8_0)
DQDEF(TY_Q4_K)
DQDEF(TY_Q5_K)
DQDEF(TY_Q6_K)
DQDEF(TY_Q3_K)
DQDEF(TY_Q2_K)
DQDEF(TY_IQ4_NL)
DQDEF(TY_IQ4_XS)
DQDEF(TY_MXFP4)

static dq_fn dq_for(int ty) {
    switch (ty) {
    case TY_F16: return dq_TY_F16;
    case TY_BF16: return dq_TY_BF16;
    case TY_Q4_0: return dq_TY_Q4_0;
    case TY_Q4_1: return dq_TY_Q4_1;
    case TY_Q5_0: return dq_TY_Q5_0;
    case TY_Q5_1: return dq_TY_Q5_1;
    case TY_Q8_0: return dq_TY_Q8_0;
    case TY_Q4_K: return dq_TY_Q4_K;
    case TY_Q5_K: return dq_TY_Q5_K;
    case TY_Q6_K: return dq_TY_Q6_K;
    case TY_Q3_K: return dq_TY_Q3_K;
    case TY_Q2_K: return dq_TY_Q2_K;
    case TY_IQ4_NL: return dq_TY_IQ4_NL;
    case TY_IQ4_XS: return dq_TY_IQ4_XS;
    case TY_MXFP4: return dq_TY_MXFP4;
    default: return 0;
    }
}

/* out[i, :] = dequant(W[rows[i]]) (rows == NULL: rows r0 .. r0+nrows-1). ty_flags = type | 256:
 * Q4_1 / Q5_1 without their mins (d * q). */
int sharpi_dequant_rows(int ty_flags, const uint8_t *w, long rb, const int64_t *rows, long r0, long nrows, long k,
                        float *out, int nthreads) {
    const int ty = ty_flags & 0xff, nomin = (ty_flags >> 8) & 1;
    const int ue = ue_of(ty);
    if (!ue || k % ue || rb != (k / ue) * ub_of(ty) || (ty_flags >> 9)) return -1;
    const dq_fn f = !nomin ? dq_for(ty) : ty == TY_Q4_1 ? dq_nomin_Q4_1 : ty == TY_Q5_1 ? dq_nomin_Q5_1 : dq_for(ty);
    const long nu = k / ue;
    const int nth = pick_threads(nthreads, nrows, nrows * rb);
#pragma omp parallel for num_threads(nth) schedule(dynamic, 16) if (nth > 1)
    for (long i = 0; i < nrows; i++) f(w + (rows ? rows[i] : r0 + i) * rb, nu, out + i * k);
    return 0;
}

int sharpi_abi_version(void) { return 18; }

#ifdef SHARPI_PYEXT
/* _sharpi_qmatmul.qmatmul(type, w, rb, n, k, x, T, y, nthreads) and
 * _sharpi_qmatmul.dequant_rows(type, w, rb, rows, r0, nrows, k, out, nthreads): the entry points
 * above with pointers passed as Python ints (tensor.data_ptr()); the GIL is released meanwhile. */
/* args -> n longs in a; -1 with a TypeError / OverflowError set (also used by ops.c) */
int sharpi_py_nlongs(PyObject *const *args, Py_ssize_t nargs, long *a, int n, const char *name) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", name, n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        a[i] = PyLong_AsLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int py_longs(PyObject *const *args, Py_ssize_t nargs, long *a, const char *name) {
    return sharpi_py_nlongs(args, nargs, a, 9, name);
}

static PyObject *py_qmatmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[9];
    int rc;
    if (py_longs(args, nargs, a, "qmatmul")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_qmatmul((int)a[0], (const uint8_t *)a[1], a[2], a[3], a[4], (const float *)a[5], a[6], (float *)a[7],
                        (int)a[8]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* qmatmul_id(type, wptrs, n_exp, rb, n, k, x, ldx, np, ids, xrow, bias (0: none), y, ldy, nthreads) */
static PyObject *py_qmatmul_id(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[15];
    int rc;
    if (sharpi_py_nlongs(args, nargs, a, 15, "qmatmul_id")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_qmatmul_id((int)a[0], (const int64_t *)a[1], a[2], a[3], a[4], a[5], (const float *)a[6], a[7], a[8],
                           (const int32_t *)a[9], (const int32_t *)a[10], (const float *)a[11], (float *)a[12], a[13],
                           (int)a[14]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_dequant_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[9];
    int rc;
    if (py_longs(args, nargs, a, "dequant_rows")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_dequant_rows((int)a[0], (const uint8_t *)a[1], a[2], (const int64_t *)a[3], a[4], a[5], a[6],
                             (float *)a[7], (int)a[8]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* quantize_act(type, x, T, k, codes, d, s, bsums) -> vec_dot kind; round_act(x, n, block, f16_scale, y) */
static PyObject *py_quantize_act(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[8];
    int rc;
    if (sharpi_py_nlongs(args, nargs, a, 8, "quantize_act")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_quantize_act((int)a[0], (const float *)a[1], a[2], a[3], (int8_t *)a[4], (float *)a[5], (float *)a[6],
                             (int16_t *)a[7]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_round_act(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[5];
    if (sharpi_py_nlongs(args, nargs, a, 5, "round_act")) return NULL;
    sharpi_round_act((const float *)a[0], a[1], (int)a[2], (int)a[3], (float *)a[4]);
    Py_RETURN_NONE;
}

/* store_q8_0(x, nb, codes, d) */
static PyObject *py_store_q8_0(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[4];
    if (sharpi_py_nlongs(args, nargs, a, 4, "store_q8_0")) return NULL;
    sharpi_store_q8_0((const float *)a[0], a[1], (int8_t *)a[2], (uint16_t *)a[3]);
    Py_RETURN_NONE;
}

/* repack(type, src, n, k, dst, inverse, nthreads) */
static PyObject *py_repack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long a[7];
    int rc;
    if (sharpi_py_nlongs(args, nargs, a, 7, "repack")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_repack((int)a[0], (const uint8_t *)a[1], a[2], a[3], (uint8_t *)a[4], (int)a[5], (int)a[6]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_has_vnni(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    (void)nargs;
    return PyLong_FromLong(sharpi_has_vnni());
}

PyObject *sharpi_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* ops.c */
PyObject *sharpi_py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */
PyObject *sharpi_py_round_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */
PyObject *sharpi_py_glu(PyObject *self, PyObject *const *args, Py_ssize_t nargs);        /* ops.c */
PyObject *sharpi_py_rope_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* ops.c */
PyObject *sharpi_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs);       /* ops.c */
PyObject *sharpi_py_hadamard(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */
PyObject *sharpi_py_kv_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */
PyObject *sharpi_py_softcap(PyObject *self, PyObject *const *args, Py_ssize_t nargs);    /* ops.c */
PyObject *sharpi_py_soft_max(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */
PyObject *sharpi_py_short_conv(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* ops.c */
PyObject *sharpi_py_f16_mm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);     /* ops.c */
PyObject *sharpi_py_moe_route(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* ops.c */
PyObject *sharpi_py_moe_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs);    /* ops.c */
PyObject *sharpi_py_shexp_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* ops.c */
PyObject *sharpi_py_gdn(PyObject *self, PyObject *const *args, Py_ssize_t nargs);        /* ops.c */
PyObject *sharpi_py_gdn_gates(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* ops.c */
PyObject *sharpi_py_sigmoid(PyObject *self, PyObject *const *args, Py_ssize_t nargs);    /* ops.c */
PyObject *sharpi_py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* ops.c */

static PyMethodDef py_methods[] = {
    {"attention", (PyCFunction)(void (*)(void))sharpi_py_attention, METH_FASTCALL, "softmax(q K^T) V over the cache"},
    {"rms_norm", (PyCFunction)(void (*)(void))sharpi_py_rms_norm, METH_FASTCALL, "ggml's RMS norm"},
    {"rope_table", (PyCFunction)(void (*)(void))sharpi_py_rope_table, METH_FASTCALL, "ggml's rope cache"},
    {"rope", (PyCFunction)(void (*)(void))sharpi_py_rope, METH_FASTCALL, "rotate adjacent pairs"},
    {"glu", (PyCFunction)(void (*)(void))sharpi_py_glu, METH_FASTCALL, "silu / gelu(g) * u as ggml computes them"},
    {"round_q8", (PyCFunction)(void (*)(void))sharpi_py_round_q8, METH_FASTCALL, "8-bit block rounding"},
    {"hadamard", (PyCFunction)(void (*)(void))sharpi_py_hadamard, METH_FASTCALL, "Walsh-Hadamard chunks, in place"},
    {"softcap", (PyCFunction)(void (*)(void))sharpi_py_softcap, METH_FASTCALL, "tanh logit softcapping, in place"},
    {"soft_max", (PyCFunction)(void (*)(void))sharpi_py_soft_max, METH_FASTCALL, "ggml_soft_max of rows, in place"},
    {"short_conv", (PyCFunction)(void (*)(void))sharpi_py_short_conv, METH_FASTCALL, "ggml_ssm_conv (LFM2)"},
    {"f16_mm", (PyCFunction)(void (*)(void))sharpi_py_f16_mm, METH_FASTCALL, "f16 matmul of any width (LoRA)"},
    {"moe_route", (PyCFunction)(void (*)(void))sharpi_py_moe_route, METH_FASTCALL, "MoE expert choice and weights"},
    {"moe_sum", (PyCFunction)(void (*)(void))sharpi_py_moe_sum, METH_FASTCALL, "MoE experts' weighted sum"},
    {"shexp_add", (PyCFunction)(void (*)(void))sharpi_py_shexp_add, METH_FASTCALL, "gated shared expert, added"},
    {"gdn", (PyCFunction)(void (*)(void))sharpi_py_gdn, METH_FASTCALL, "Gated DeltaNet recurrence (Qwen3.5)"},
    {"gdn_gates", (PyCFunction)(void (*)(void))sharpi_py_gdn_gates, METH_FASTCALL, "Gated DeltaNet decay and beta"},
    {"sigmoid", (PyCFunction)(void (*)(void))sharpi_py_sigmoid, METH_FASTCALL, "ggml_sigmoid, in place"},
    {"decode_layers", (PyCFunction)(void (*)(void))sharpi_py_decode_layers, METH_FASTCALL, "a decoding pass's layers"},
    {"qmatmul_id", (PyCFunction)(void (*)(void))py_qmatmul_id, METH_FASTCALL, "mul_mat_id: one expert per row"},
    {"store_q8_0", (PyCFunction)(void (*)(void))py_store_q8_0, METH_FASTCALL, "q8_0 KV cache write"},
    {"kv_store", (PyCFunction)(void (*)(void))sharpi_py_kv_store, METH_FASTCALL, "KV cache write in a block type"},
    {"qmatmul", (PyCFunction)(void (*)(void))py_qmatmul, METH_FASTCALL, "y = x @ dequant(w).T"},
    {"quantize_act", (PyCFunction)(void (*)(void))py_quantize_act, METH_FASTCALL, "ggml activation quantization"},
    {"round_act", (PyCFunction)(void (*)(void))py_round_act, METH_FASTCALL, "ggml activation rounding, dequantized"},
    {"has_vnni", (PyCFunction)(void (*)(void))py_has_vnni, METH_FASTCALL, "built with VNNI (AVX512-VNNI, or AVX-VNNI in the AVX2 build)"},
    {"dequant_rows", (PyCFunction)(void (*)(void))py_dequant_rows, METH_FASTCALL, "dequantize rows"},
    {"repack", (PyCFunction)(void (*)(void))py_repack, METH_FASTCALL, "Q4_K / Q4_1 rows <-> groups of 4"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef py_module = {PyModuleDef_HEAD_INIT, "_sharpi_qmatmul", NULL, -1, py_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sharpi_qmatmul(void) { return PyModule_Create(&py_module); }
#endif
