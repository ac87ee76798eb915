/* sharpi CPU ops besides the matmuls: RMS norm, and attention over the KV cache.
 *
 * sharpi_rms_norm: y = x / sqrt(mean(x^2) + eps) * w, computed as ggml does (float squares summed
 * in double in index order, scale = 1/sqrtf(mean + eps), then (x * scale) * w).
 *
 * sharpi_round_q8: activations rounded through 8-bit blocks (returned dequantized, fp32), bit for
 * bit the torch expression in quants.quantize_q8_blocks (one call instead of eight torch ops).
 *
 * sharpi_attention: out[T, H, Dv] = softmax(q K^T * scale + mask) V.
 *
 * One (query row, head) pair is computed by one thread in a fixed order, so its result does not
 * depend on T or on the thread count: a speculative verify pass of k+1 rows reproduces k+1
 * single-token passes bit for bit (greedy parity), with one call per layer instead of one per row.
 *
 * Numerics follow llama.cpp's CPU path without flash attention on an AVX2 build (the build that
 * reproduces the fixtures best, README "Correctness"), operation for operation: q arrives rounded
 * to the K cache's vec_dot type (the caller does that); KQ and KQV are llamafile's tinyBLAS dot
 * products: one 8-lane fp32 FMA accumulator per output element stepping 8 along the reduced axis
 * (head dims for KQ, cache positions counted from 0 for KQV), then its horizontal-sum tree
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)); softmax is ggml_vec_soft_max_f32: ggml's vectorized expf,
 * each group of 8 positions summed by the same tree into a double; the probabilities are rounded
 * to fp16 when V is f16 (ggml converts them to V's vec_dot type).
 *
 * sharpi_rope_table / sharpi_rope: ggml's rope cache (theta_scale = powf(base, -2 / n_rot), theta
 * multiplied by it in float from the position, libm cosf / sinf) and rotation of adjacent pairs
 * (x0 c - x1 s, x0 s + x1 c, each as one FMA of x0's product with the other product rounded, the
 * way GCC contracts ggml's rotate_pairs).
 *
 * sharpi_glu: silu(g) * u (ggml_vec_swiglu_f32: x / (1 + expf(-x)) with ggml's vectorized expf) or
 * gelu(g) * u through ggml's fp16 GELU table (GGML_GELU_FP16: g rounded to fp16, the tanh GELU of
 * that rounded to fp16), as llama.cpp's fused swiglu / geglu ops compute them.
 *
 * Cache layout of one layer (kv_cache.py): K [capacity, Hkv, D] as f32 / f16 / int8 codes with
 * q8_0 scales [capacity, Hkv, D/32] in fp16; V likewise with Dv. Query row t sits at position
 * start + t and sees keys [lo, start + t], lo = start + t - window + 1 with a sliding window.
 * Needs AVX-512F (D and Dv multiples of 16, of 32 for q8_0).
 */
#include <immintrin.h>
#include <math.h>

#include "ggml_order.h"
#include <stdint.h>
#include <stdlib.h>

enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2 };
/* summation order of the KQ and KQV dot products: llama.cpp uses tinyBLAS for passes of >= 2 query
 * rows (prompt processing) and ggml_vec_dot_f16 for one row (decoding) */
enum { ORDER_TINYBLAS = 0, ORDER_VEC_DOT = 1 };

/* cs [n, n_rot / 2, 2]: (cos, sin) of position p and frequency i */
void sharpi_rope_table(float base, float freq_scale, long n, int n_rot, float *cs) {
    const float ts = powf(base, -2.0f / (float)n_rot);
    for (long p = 0; p < n; p++) {
        float theta = (float)p;
        for (int i = 0; i < n_rot / 2; i++) {
            const float th = freq_scale * theta;
            cs[(p * (n_rot / 2) + i) * 2] = cosf(th);
            cs[(p * (n_rot / 2) + i) * 2 + 1] = sinf(th);
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

/* 16 cache values of row `row` (elements [d, d+16)) as fp32 */
static inline __m512 load16(const void *base, const uint16_t *scales, int type, long row, long width, long d) {
    if (type == KV_F32) return _mm512_loadu_ps((const float *)base + row * width + d);
    if (type == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + row * width + d)));
    const __m128i c = _mm_loadu_si128((const __m128i *)((const int8_t *)base + row * width + d));
    const float s = _cvtsh_ss(scales[(row * width + d) / 32]);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), _mm512_set1_ps(s));
}

/* ggml's vectorized expf for AVX2 (ggml_v_expf in ggml-cpu/vec.h), lane for lane, in 16 lanes:
 * the same operations on each element, so the same bits as its 8-lane original. */
static inline __m512 ggml_expf16(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(z), 23);
    const __m512 k = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_castps_si512(_mm512_set1_ps(1))));
    const __m512 an = _mm512_abs_ps(n);
    const __mmask16 c = _mm512_cmp_ps_mask(an, _mm512_set1_ps(126), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_mul_ps(_mm512_set1_ps(0x1.ffffecp-1f), b));
    const __m512 res = _mm512_fmadd_ps(j, k, k);
    if (!c) return res;
    const __mmask16 le = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ);
    const __m512i g = _mm512_maskz_mov_epi32(le, _mm512_set1_epi32((int)0x82000000u));
    const __m512 s1 = _mm512_castsi512_ps(_mm512_add_epi32(g, _mm512_set1_epi32(0x7f000000)));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_sub_epi32(e, g));
    const __mmask16 d = _mm512_cmp_ps_mask(an, _mm512_set1_ps(192), _CMP_GT_OQ);
    __m512 out = _mm512_mask_blend_ps(c, res, _mm512_mul_ps(_mm512_fmadd_ps(s2, j, s2), s1));
    return _mm512_mask_blend_ps(d, out, _mm512_mul_ps(s1, s1));
}

/* 8 cache values of row `row` (elements [d, d+8)) as fp32 */
static inline __m256 load8(const void *base, const uint16_t *scales, int type, long row, long width, long d) {
    if (type == KV_F32) return _mm256_loadu_ps((const float *)base + row * width + d);
    if (type == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + row * width + d)));
    const __m128i c = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + row * width + d));
    const float s = _cvtsh_ss(scales[(row * width + d) / 32]);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), _mm256_set1_ps(s));
}

/* GGML_F32x8_REDUCE's final horizontal sum (of the vec_dot accumulators already added pairwise):
 * ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)), via two hadds */
static inline float vec_dot_reduce(__m256 v) {
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
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

/* y[t, i] = act(gu[t, i]) * gu[t, n + i] for T rows of gu [T, 2n]; act 0: silu, 1: gelu (tanh).
 * Returns 1 when n is not a multiple of 16. */
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
        if (act == 0) {
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

int sharpi_attention(const float *q, long T, long H, long Hkv, long D, long Dv,
                     const void *k, const uint16_t *kd, int k_type, const void *v, const uint16_t *vd, int v_type,
                     long start, long window, float scale, int round_p_f16, int order, float *out, int nthreads) {
    if (T <= 0) return 0;
    if (D % 16 || Dv % 16 || H % Hkv || (k_type == KV_Q8_0 && D % 32) || (v_type == KV_Q8_0 && Dv % 32)) return 1;
    const long G = H / Hkv, Lmax = start + T;
    int bad = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *s = malloc(sizeof(float) * (size_t)(Lmax + 16));
        if (!s) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)
        for (long task = 0; task < T * H; task++) {
            if (!s) continue;
            const long t = task / H, h = task % H, g = h / G, pos = start + t;
            const long lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0, n = pos + 1 - lo;
            const float *qr = q + (t * H + h) * D;
            /* scores: one 8-lane accumulator per key over the head dims, tinyBLAS's order */
            float mx = -INFINITY;
            for (long j = 0; j < n; j++) {
                const long row = (lo + j) * Hkv + g; /* row of width D in the [capacity * Hkv, D] view */
                float sc;
                if (order == ORDER_VEC_DOT && D % 32 == 0) {
                    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                    for (long d = 0; d < D; d += 32)
                        for (int u = 0; u < 4; u++)
                            acc[u] = _mm256_fmadd_ps(load8(k, kd, k_type, row, D, d + 8 * u), _mm256_loadu_ps(qr + d + 8 * u), acc[u]);
                    sc = vec_dot_reduce(_mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
                } else {
                    __m256 acc = _mm256_setzero_ps();
                    for (long d = 0; d < D; d += 8)
                        acc = _mm256_fmadd_ps(load8(k, kd, k_type, row, D, d), _mm256_loadu_ps(qr + d), acc);
                    sc = hsum8(acc);
                }
                sc *= scale;
                s[j] = sc;
                mx = sc > mx ? sc : mx;
            }
            /* softmax over groups of 8 cache positions counted from 0 (masked ones are exp(-inf) = 0) */
            const long pad = lo & 7; /* group slot of position lo */
            double sum = 0.0;
            const __m512 vmx = _mm512_set1_ps(mx);
            for (long j = 0; j < n; j += 16) {
                const __mmask16 m = (n - j >= 16) ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
                _mm512_mask_storeu_ps(s + j, m, ggml_expf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx)));
            }
            for (long a = 0; a < pad + n; a += 8) {
                float grp[8];
                for (int i = 0; i < 8; i++) grp[i] = (a + i >= pad && a + i < pad + n) ? s[a + i - pad] : 0.0f;
                sum += (double)hsum8(_mm256_loadu_ps(grp));
            }
            const float inv = (float)(1.0 / sum);
            for (long j = 0; j < n; j++) {
                float p = s[j] * inv;
                if (round_p_f16) p = _cvtsh_ss(_cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT));
                s[j] = p;
            }
            /* P V: per output element, 8 partial sums by cache position mod 8, then the same tree */
            float *o = out + (t * H + h) * Dv;
            const int nl = order == ORDER_VEC_DOT ? 32 : 8; /* partial sums per output element */
            for (long d0 = 0; d0 < Dv; d0 += 16) {
                __m512 a[32];
                for (int r = 0; r < nl; r++) a[r] = _mm512_setzero_ps();
                for (long j = 0; j < n; j++) {
                    const long row = (lo + j) * Hkv + g;
                    const int r = (int)((lo + j) & (nl - 1));
                    a[r] = _mm512_fmadd_ps(load16(v, vd, v_type, row, Dv, d0), _mm512_set1_ps(s[j]), a[r]);
                }
                __m512 res;
                if (nl == 32) { /* a[8u + l]: accumulator u, lane l of ggml_vec_dot_f16; then GGML_F32x8_REDUCE */
                    __m512 x[8];
                    for (int l = 0; l < 8; l++)
                        x[l] = _mm512_add_ps(_mm512_add_ps(a[l], a[16 + l]), _mm512_add_ps(a[8 + l], a[24 + l]));
                    res = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(x[0], x[4]), _mm512_add_ps(x[1], x[5])),
                                        _mm512_add_ps(_mm512_add_ps(x[2], x[6]), _mm512_add_ps(x[3], x[7])));
                } else {
                    const __m512 r0 = _mm512_add_ps(_mm512_add_ps(a[4], a[0]), _mm512_add_ps(a[6], a[2]));
                    const __m512 r1 = _mm512_add_ps(_mm512_add_ps(a[5], a[1]), _mm512_add_ps(a[7], a[3]));
                    res = _mm512_add_ps(r0, r1);
                }
                _mm512_storeu_ps(o + d0, res);
            }
        }
        free(s);
    }
    return bad ? 2 : 0;
}

#ifdef SHARPI_PYEXT
/* attention(q, T, H, Hkv, D, Dv, k, kd, k_type, v, vd, v_type, start, window, scale, round_p_f16, out,
 * nthreads) for the _sharpi_qmatmul module (qmatmul.c lists it): pointers as Python ints, scale a
 * float; the GIL is released meanwhile. */
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

/* rope_table(base, freq_scale, n, n_rot, cs) and rope(x, T, nh, hd, n_rot, cs) */
PyObject *sharpi_py_rope_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "rope_table() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    const double base = PyFloat_AsDouble(args[0]), fs = PyFloat_AsDouble(args[1]);
    const long n = PyLong_AsLong(args[2]), n_rot = PyLong_AsLong(args[3]), cs = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    sharpi_rope_table((float)base, (float)fs, n, (int)n_rot, (float *)cs);
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

PyObject *sharpi_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 19) {
        PyErr_Format(PyExc_TypeError, "attention() takes 19 arguments (%zd given)", nargs);
        return NULL;
    }
    long a[19];
    double scale = 0.0;
    for (int i = 0; i < 19; i++) {
        if (i == 14) {
            scale = PyFloat_AsDouble(args[i]);
            if (scale == -1.0 && PyErr_Occurred()) return NULL;
            continue;
        }
        a[i] = PyLong_AsLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sharpi_attention((const float *)a[0], a[1], a[2], a[3], a[4], a[5], (const void *)a[6], (const uint16_t *)a[7],
                          (int)a[8], (const void *)a[9], (const uint16_t *)a[10], (int)a[11], a[12], a[13], (float)scale,
                          (int)a[15], (int)a[16], (float *)a[17], (int)a[18]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}
#endif
