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
 * Numerics follow llama.cpp's CPU path without flash attention, as the rest of sharpi does:
 * q arrives already rounded to the K cache's vec_dot type (the caller does that), scores are fp32
 * dot products, softmax in fp32 with a double sum, the probabilities are rounded to fp16 when V is
 * f16 (ggml converts them to V's vec_dot type), and the output accumulates in fp32.
 *
 * Cache layout of one layer (kv_cache.py): K [capacity, Hkv, D] as f32 / f16 / int8 codes with
 * q8_0 scales [capacity, Hkv, D/32] in fp16; V likewise with Dv. Query row t sits at position
 * start + t and sees keys [lo, start + t], lo = start + t - window + 1 with a sliding window.
 * Needs AVX-512F (D and Dv multiples of 16, of 32 for q8_0).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2 };

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

/* e^x for x <= 0 (softmax arguments), ~1 ulp: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

int sharpi_attention(const float *q, long T, long H, long Hkv, long D, long Dv,
                     const void *k, const uint16_t *kd, int k_type, const void *v, const uint16_t *vd, int v_type,
                     long start, long window, float scale, int round_p_f16, float *out, int nthreads) {
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
            /* scores */
            float mx = -INFINITY;
            for (long j = 0; j < n; j++) {
                const long row = (lo + j) * Hkv + g; /* row of width D in the [capacity * Hkv, D] view */
                __m512 acc = _mm512_setzero_ps();
                for (long d = 0; d < D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), load16(k, kd, k_type, row, D, d), acc);
                const float sc = _mm512_reduce_add_ps(acc) * scale;
                s[j] = sc;
                mx = sc > mx ? sc : mx;
            }
            /* softmax: exp in blocks of 16 (tail masked), double sum in a fixed order */
            double sum = 0.0;
            const __m512 vmx = _mm512_set1_ps(mx);
            for (long j = 0; j < n; j += 16) {
                const __mmask16 m = (n - j >= 16) ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx));
                _mm512_mask_storeu_ps(s + j, m, e);
                float tmp[16];
                _mm512_storeu_ps(tmp, _mm512_maskz_mov_ps(m, e));
                for (int i = 0; i < 16; i++) sum += tmp[i];
            }
            const float inv = (float)(1.0 / sum);
            /* P V */
            float *o = out + (t * H + h) * Dv;
            for (long d0 = 0; d0 < Dv; d0 += 64) {
                const int nv = (Dv - d0) >= 64 ? 4 : (int)((Dv - d0) / 16);
                __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (long j = 0; j < n; j++) {
                    float p = s[j] * inv;
                    if (round_p_f16) p = _cvtsh_ss(_cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT));
                    const __m512 pv = _mm512_set1_ps(p);
                    const long row = (lo + j) * Hkv + g;
                    for (int u = 0; u < nv; u++) a[u] = _mm512_fmadd_ps(pv, load16(v, vd, v_type, row, Dv, d0 + 16 * u), a[u]);
                }
                for (int u = 0; u < nv; u++) _mm512_storeu_ps(o + d0 + 16 * u, a[u]);
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

/* round_q8(x, n, block, f16_scale, y) */
PyObject *sharpi_py_round_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "round_q8() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    long a[5];
    for (int i = 0; i < 5; i++) {
        a[i] = PyLong_AsLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return NULL;
    }
    sharpi_round_q8((const float *)a[0], a[1], (int)a[2], (int)a[3], (float *)a[4]);
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

PyObject *sharpi_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 18) {
        PyErr_Format(PyExc_TypeError, "attention() takes 18 arguments (%zd given)", nargs);
        return NULL;
    }
    long a[18];
    double scale = 0.0;
    for (int i = 0; i < 18; i++) {
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
                          (int)a[15], (float *)a[16], (int)a[17]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}
#endif
