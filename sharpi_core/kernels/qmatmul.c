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
 * Built with -O3 -march=native -fopenmp -ffp-contract=off (needs AVX-512F/BW/VL; cpu.py checks).
 * When torch is loaded first, the libgomp torch bundles has the soname libgomp.so.1, so this
 * library shares torch's OpenMP thread pool instead of starting a second one.
 */
#ifdef SHARPI_PYEXT /* also a CPython extension module (calls cost ~0.2 us instead of ctypes' ~3 us) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define INL static inline __attribute__((always_inline))

/* GGML type ids (gguf.GGMLQuantizationType values) */
enum {
    TY_F32 = 0, TY_F16 = 1, TY_Q4_0 = 2, TY_Q4_1 = 3, TY_Q5_0 = 6, TY_Q5_1 = 7, TY_Q8_0 = 8,
    TY_Q4_K = 12, TY_Q5_K = 13, TY_Q6_K = 14, TY_BF16 = 30,
};

/* fp16 -> fp32 for block scales: a table lookup is a plain load (vcvtph2ps costs 2 ALU uops). */
static float f16tab[65536];

__attribute__((constructor)) static void init_tables(void) {
    for (int i = 0; i < 65536; i++) f16tab[i] = _cvtsh_ss((unsigned short)i);
}

INL float f16at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16tab[h];
}

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
    float s[32];                             /* Q6_K: 16 scales d*sc, then 16 times -32*d*sc */
    uint8_t q6[256] __attribute__((aligned(64))); /* Q6_K: the 6-bit codes, one byte per element */
} Prep;

INL int unit_elems(const int ty) {
    switch (ty) {
    case TY_Q4_K: case TY_Q5_K: case TY_Q6_K: return 256;
    default: return 32;
    }
}
INL int unit_bytes(const int ty) {
    switch (ty) {
    case TY_F16: case TY_BF16: return 64;
    case TY_Q4_0: return 18;
    case TY_Q4_1: return 20;
    case TY_Q5_0: return 22;
    case TY_Q5_1: return 24;
    case TY_Q8_0: return 34;
    case TY_Q4_K: return 144;
    case TY_Q5_K: return 176;
    case TY_Q6_K: return 210;
    default: return 0;
    }
}
INL int n_pieces(const int ty) {
    switch (ty) {
    case TY_Q4_K: case TY_Q5_K: case TY_Q6_K: return 8;
    default: return 1;
    }
}
INL int n_vecs(const int ty) { (void)ty; return 2; }

/* element offset (within the unit) of vector v of piece p */
INL int xoff(const int ty, const int p, const int v) {
    switch (ty) {
    case TY_Q4_K: case TY_Q5_K: /* chunk j = p/2 (32 qs bytes), half h = p%2; v=0 low nibbles, v=1 high */
        return 64 * (p >> 1) + 32 * v + 16 * (p & 1);
    default: /* Q6_K: pieces of 32 elements in order */
        return 32 * p + 16 * v;
    }
}

/* Q4_K / Q5_K: [d*sc_0..7, dmin*m_0..7] (6-bit scales and mins packed in 12 bytes at b+4) */
INL __m512 kquant_scales(const uint8_t *b) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t sc03 = u[0] & 0x3f3f3f3fu, m03 = u[1] & 0x3f3f3f3fu;
    const uint32_t sc47 = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
    const uint32_t m47 = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_setr_epi32((int)sc03, (int)sc47, (int)m03, (int)m47)));
    const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16at(b)), _mm512_set1_ps(f16at(b + 2)));
    return _mm512_mul_ps(f, dd);
}

INL void prep(const int ty, const int exact, const uint8_t *b, Prep *P) {
    switch (ty) {
    case TY_Q4_0: {
        const __m512 d = _mm512_set1_ps(f16at(b));
        P->t[0] = _mm512_mul_ps(d, _mm512_sub_ps(IOTA, _mm512_set1_ps(8.f)));
        break;
    }
    case TY_Q4_1: {
        const __m512 d = _mm512_set1_ps(f16at(b)), m = _mm512_set1_ps(f16at(b + 2));
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
        const __m512 d = _mm512_set1_ps(f16at(b)), m = _mm512_set1_ps(f16at(b + 2));
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
        const __m512i m0f = _mm512_set1_epi8(0x0f), m33 = _mm512_set1_epi8(0x33);
        const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; hf++) {
            const __m512i L = _mm512_loadu_si512((const void *)(b + 64 * hf));
            const __m512i Hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * hf)));
            const __m512i H2 = _mm512_and_si512(_mm512_srlv_epi16(Hb, sh), m33); /* bits 0-1 and 4-5 */
            /* vpternlogd imm 0xE4 = (a & c) | (b & ~c): low nibble from a, bits 4-7 from b */
            const __m512i lo = _mm512_ternarylogic_epi32(L, _mm512_slli_epi16(H2, 4), m0f, 0xE4);
            const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(L, 4), H2, m0f, 0xE4);
            _mm512_store_si512((void *)(P->q6 + 128 * hf), lo);
            _mm512_store_si512((void *)(P->q6 + 128 * hf + 64), hi);
        }
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
        const __m512 D = _mm512_mul_ps(_mm512_set1_ps(f16at(b + 208)), sc);
        _mm512_store_ps(P->s, D);
        _mm512_store_ps(P->s + 16, _mm512_mul_ps(D, _mm512_set1_ps(-32.f)));
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
    case TY_Q4_0: case TY_Q4_1: {
        const __m512i q = ld16u8(b + (ty == TY_Q4_0 ? 2 : 4));
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
    case TY_Q6_K: {
        const __m512i q0 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(P->q6 + 32 * p)));
        const __m512i q1 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(P->q6 + 32 * p + 16)));
        w[0] = q6val(q0, P->s, 2 * p);
        w[1] = q6val(q1, P->s, 2 * p + 1);
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
    default: return 0;
    }
}

static int ue_of(int ty) {
    switch (ty) {
    case TY_Q4_K: case TY_Q5_K: case TY_Q6_K: return 256;
    case TY_F16: case TY_BF16: case TY_Q4_0: case TY_Q4_1: case TY_Q5_0: case TY_Q5_1: case TY_Q8_0: return 32;
    default: return 0;
    }
}
static int ub_of(int ty) {
    switch (ty) {
    case TY_F16: case TY_BF16: return 64;
    case TY_Q4_0: return 18;
    case TY_Q4_1: return 20;
    case TY_Q5_0: return 22;
    case TY_Q5_1: return 24;
    case TY_Q8_0: return 34;
    case TY_Q4_K: return 144;
    case TY_Q5_K: return 176;
    case TY_Q6_K: return 210;
    default: return 0;
    }
}

/* Rows [n0, n1) of W for all T activation rows. The range is cut into 4 contiguous quarters and each
 * tile of 4 rows takes one row from every quarter: 4 sequential streams (which the prefetchers
 * follow) instead of 4 interleaved ones. The 4 rows stay in L1 across the groups of 8 tokens. */
static void mm_rows(int ty, const uint8_t *w, long rb, long n0, long n1, long nu, const float *x, long ldx, long T,
                    float *y, long ldy) {
    const kern_fn *kt = ktab_for(ty);
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
            const int KR = kern_rows[TT];
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

static int pick_threads(int nthreads, long n, long bytes) {
    if (nthreads < 1) nthreads = 1;
    if (bytes < (48 << 10)) return 1; /* a tiny matrix costs less than waking a thread */
    if (nthreads > n / 4) nthreads = (int)(n / 4) > 0 ? (int)(n / 4) : 1;
    return nthreads;
}

/* ---------------------------------------------------------------------------------------------
 * Exported entry points. Return 0 on success, -1 for an unsupported type or shape.
 * ------------------------------------------------------------------------------------------- */
int sharpi_qmatmul(int ty, const uint8_t *w, long rb, long n, long k, const float *x, long T, float *y,
                   int nthreads) {
    const int ue = ue_of(ty);
    if (!ue || k % ue || rb != (k / ue) * ub_of(ty) || T < 1 || n < 1) return -1;
    const long nu = k / ue;
    const int nth = pick_threads(nthreads, n, n * rb * (T < 8 ? T : 8)); /* ~ work of the call */
    if (nth == 1) {
        mm_rows(ty, w, rb, 0, n, nu, x, k, T, y, n);
        return 0;
    }
    /* Chunks of rows handed out through an atomic counter: a thread that is slowed down (another
     * process on its core) holds back at most one chunk instead of half the matrix. Row results do
     * not depend on the chunking. */
    long chunk = (n + nth * 8 - 1) / (nth * 8);
    chunk = (chunk + 3) / 4 * 4;
    const long nchunks = (n + chunk - 1) / chunk;
    long next = 0;
#pragma omp parallel num_threads(nth)
    {
        for (;;) {
            const long c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (c >= nchunks) break;
            const long n0 = c * chunk, n1 = (n0 + chunk < n) ? n0 + chunk : n;
            mm_rows(ty, w, rb, n0, n1, nu, x, k, T, y, n);
        }
    }
    return 0;
}

/* exact dequantization of one row (bit-identical to gguf.quants.dequantize) */
INL void dq_row(const int ty, const uint8_t *row, long nu, float *out) {
    const int UE = unit_elems(ty), UB = unit_bytes(ty), NP = n_pieces(ty), NV = n_vecs(ty);
    for (long u = 0; u < nu; u++) {
        Prep P;
        const uint8_t *b = row + u * UB;
        prep(ty, 1, b, &P);
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
#define DQDEF(TY) static void dq_##TY(const uint8_t *row, long nu, float *out) { dq_row(TY, row, nu, out); }
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
    default: return 0;
    }
}

/* out[i, :] = dequant(W[rows[i]]) (rows == NULL: rows r0 .. r0+nrows-1) */
int sharpi_dequant_rows(int ty, const uint8_t *w, long rb, const int64_t *rows, long r0, long nrows, long k,
                        float *out, int nthreads) {
    const int ue = ue_of(ty);
    if (!ue || k % ue || rb != (k / ue) * ub_of(ty)) return -1;
    const dq_fn f = dq_for(ty);
    const long nu = k / ue;
    const int nth = pick_threads(nthreads, nrows, nrows * rb);
#pragma omp parallel for num_threads(nth) schedule(dynamic, 16) if (nth > 1)
    for (long i = 0; i < nrows; i++) f(w + (rows ? rows[i] : r0 + i) * rb, nu, out + i * k);
    return 0;
}

int sharpi_abi_version(void) { return 1; }

#ifdef SHARPI_PYEXT
/* _sharpi_qmatmul.qmatmul(type, w, rb, n, k, x, T, y, nthreads) and
 * _sharpi_qmatmul.dequant_rows(type, w, rb, rows, r0, nrows, k, out, nthreads): the entry points
 * above with pointers passed as Python ints (tensor.data_ptr()); the GIL is released meanwhile. */
static int py_longs(PyObject *const *args, Py_ssize_t nargs, long *a, const char *name) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "%s() takes 9 arguments (%zd given)", name, nargs);
        return -1;
    }
    for (int i = 0; i < 9; i++) {
        a[i] = PyLong_AsLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
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

PyObject *sharpi_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* ops.c */
PyObject *sharpi_py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */
PyObject *sharpi_py_round_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* ops.c */

static PyMethodDef py_methods[] = {
    {"attention", (PyCFunction)(void (*)(void))sharpi_py_attention, METH_FASTCALL, "softmax(q K^T) V over the cache"},
    {"rms_norm", (PyCFunction)(void (*)(void))sharpi_py_rms_norm, METH_FASTCALL, "ggml's RMS norm"},
    {"round_q8", (PyCFunction)(void (*)(void))sharpi_py_round_q8, METH_FASTCALL, "8-bit block rounding"},
    {"qmatmul", (PyCFunction)(void (*)(void))py_qmatmul, METH_FASTCALL, "y = x @ dequant(w).T"},
    {"dequant_rows", (PyCFunction)(void (*)(void))py_dequant_rows, METH_FASTCALL, "dequantize rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef py_module = {PyModuleDef_HEAD_INIT, "_sharpi_qmatmul", NULL, -1, py_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sharpi_qmatmul(void) { return PyModule_Create(&py_module); }
#endif
