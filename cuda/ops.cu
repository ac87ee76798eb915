// Decode helpers: RMSNorm, RoPE, gated activations, KV-cache append, attention over an f16 / q8_0 cache.
//
// All extern "C"; fp32 activations; strides in elements unless named *_b (bytes). Every kernel begins
// with KERNEL_BEGIN() (common.cuh: it may be launched before the kernel it depends on has finished).
//
//   rms_norm_f32(x, x_st, nh, a, a_st, has_a, w, w_rows, has_w, y, y_st, n, eps, rmode, q, q_st)
//       grid.x = rows, block = 32..1024 (x32). Row r of x is x + (r / nh)*x_st + (r % nh)*n: nh rows
//       of n per token (heads, for per-head q/k norms; 1 otherwise), token stride x_st; same for a, y.
//       With has_a, first x[r, i] += a[r, i] (the residual add, written back to x), then
//       y[r, i] = x[r, i] / sqrt(mean_i x[r, i]^2 + eps) * w[(r % w_rows), i]   (y may be x),
//       rounded as the next matmul's activations (act_round_q8 / round_half_f32 fused in): rmode 0
//       none, 1 f16, 2 bf16, 3 8-bit blocks of 32 (f16 scale), 4 Q8_K blocks of 256 (n % block == 0);
//       with rmode 3 / 4 and q_st != 0 (nh == 1) also the q8 rows of y at q + r * q_st (see "q8 rows")
//   add_bias_f32(x, x_st, T, n, b)      x[t, i] += b[i]; T*n threads, any 1-D launch
//   scale_f32(x, x_st, T, n, alpha)     x[t, i] *= alpha; T*n threads, any 1-D launch
//   scale_rows_f32(x, x_st, T, n, table, pos)   x[t, i] *= table[pos[t]]; T*n threads, any 1-D launch
//       (a factor per position: mistral3's attention temperatures of q)
//   softcap_f32(x, x_st, T, n, inv, cap)  x[t, i] = tanhf(x[t, i] * inv) * cap (inv = 1/cap rounded to
//       float by the caller; Gemma 2's final logit softcapping); T*n threads, any 1-D launch
//   round_half_f32(x, x_st, T, K, bf16, y, y_st)   y = x rounded to f16 (bf16=0) or bf16 (bf16=1),
//       to nearest even, as float; T*K threads, any 1-D launch (y may be x)
//   hadamard_f32(x, x_st, T, n, blk, scale, y, y_st)   grid.x = T * (n / blk), block = blk / 2,
//       dynamic shared memory blk floats; blk a power of two (2..2048), n % blk == 0. Every chunk of
//       blk values times the orthonormal Hadamard matrix, as sharpi_core.kv_cache.rotate computes it
//       (ggml's order: times scale = 1/sqrt(blk) first, then butterflies (a+b, a-b) of width 1, 2, 4..),
//       so the bits are the CPU path's. y must not overlap x.
//   rope_f32(x, x_st, T, nh, hd, pos, n_rot, neox, cs, has_cs, theta_base, freq_scale, ff, has_ff)
//       in place on x[t*x_st + h*hd + d]; one thread per rotated pair: T*nh*(n_rot/2) threads, any
//       1-D launch. neox=0: pairs (2i, 2i+1) (llama.cpp's NORM); neox=1: pairs (i, i + n_rot/2).
//       Angle of pair i at position p: cs[(p*(n_rot/2) + i)*2 + {0,1}] = (cos, sin) when has_cs
//       (a precomputed table, e.g. the CPU path's), else p*freq_scale*theta_base^(-2i/n_rot) / ff[i].
//   glu_f32(g, g_st, u, u_st, out, o_st, T, F, act)                T*F threads, any 1-D launch
//       out[t, i] = act(g[t, i]) * u[t, i]; act 0 = silu, 1 = gelu (tanh approximation), 2 = that gelu
//       through ggml's fp16 table (llama.cpp's CPU GELU: g rounded to f16, the result rounded to f16,
//       0 for g <= -10 and g for g >= 10)
//   glu_q8_f32(g, g_st, u, u_st, out, o_st, T, F, act, block, f16_scale, q, q_st)   one warp per block of
//       the output: T*(F/block)*32 threads, block a multiple of 32; glu_f32's values, rounded as
//       act_round_q8 (with their q8 rows when q_st != 0)
//   kv_append_f16(T, nkv, pos, src0, s_st0, D0, dst0, d_sp_b0, d_sh_b0, <the same for set 1>, rcs, n_rot, neox)
//       grid.x * block.x >= T*nkv*D threads (D the larger of D0, D1), grid.y = 1 or 2: set y (the K
//       and the V of a layer in one launch): dst + pos[t]*d_sp_b + h*d_sh_b holds D halves =
//       src[t*s_st + h*D + d] rounded to nearest even. n_rot > 0: set 0's heads are read through
//       RoPE at pos[t] with the (cos, sin) table rcs (rope_f32's values bit for bit, src unchanged)
//   kv_append_q8_0(same arguments)   one warp per 32 values, block a multiple of 32; D % 32 == 0; writes
//       D/32 ggml q8_0 blocks (f16 d | int8 qs[32]) exactly as ggml's x86 quantize_row_q8_0
//       (sharpi_core.quants.q8_0_blocks, the CPU cache's) does.
//   act_round_q8(x, x_st, T, K, block, f16_scale, y, y_st, q, q_st)   one warp per block: T*(K/block)*32
//       threads, block a multiple of 32; block = 32 or 256, K % block == 0. y (may be x) = x rounded
//       through llama.cpp's 8-bit activation blocks, dequantized (sharpi_core.quants.q8_parts):
//       f16_scale=1 (Q8_0 / Q8_1, block 32): q = rint(x * (127 / amax)), y = q * f16(amax / 127);
//       f16_scale=0 (Q8_K, block 256): m = the first element of largest magnitude,
//       iscale = -127 / m, q = min(127, rint(iscale * x)), y = q * (1 / iscale).
//       y_st == 0: no y written; q_st != 0: the q8 rows of y written at q + t * q_st.
//   q8 rows (the integer matvecs' activations, qmatvec.cu's qmvi_*): row t of K values (K % 32 == 0) at
//       q + t * q_st bytes, 16-byte aligned: int8 codes [K] | float d [K/32] | 32-bit s [K/32], block b
//       of 32 values being codes * d[b] (a Q8_K scale repeated for its 8 blocks of 32): the codes and
//       scales of the rounding above, for the values y holds. s[b]: Q8_K rows (f16_scale=0), the int32 sum
//       of the block's codes; Q8_0 / Q8_1 rows (f16_scale=1), the float f16((amax / 127) * sum), the
//       unrounded scale times that sum rounded to f16 (llama.cpp's block_q8_1 s, which the Q4_1 / Q5_1 dot
//       products take for the sum of the activations).
//   attn_partial_<k>_<v>(...) / attn_combine(...)   split-KV ("flash-decoding") attention, see below;
//       the partial kernels can read q through RoPE as kv_append reads K (rcs, n_rot, neox), and
//       combine the splits themselves (cnt, O, o_st, rmode: the last block of each group of heads does it;
//       q8, q8_st: with rmode 3 / 4 and q8_st != 0 the output's q8 rows too; attn_combine_r's q, q_st too).
//   argmax_part_f32(x, x_st, n, bias, has_bias, chunk, pv, pi)   grid = (S, rows), block 32..1024 (x32):
//       block (b, r) writes the arg-max of x[r, i] (+ bias[i] with has_bias) over its chunk
//       [b*chunk, min(n, (b+1)*chunk)) to pv[r*S + b] (value) and pi[r*S + b] (index; n when empty)
//   argmax_comb(pv, pi, S, out)   grid.x = rows, block 32..1024 (x32): out[r] = the arg-max of row r's
//       S partials. Together numpy.argmax's answer: the largest value, the lowest index on ties (-0 == +0),
//       a NaN above every number (the first NaN); all -inf gives 0.
#include "common.cuh"
// (quant_blocks.cuh: BF16x8, f16 cache rows decode as F16 weight blocks do)
#include "quant_blocks.cuh"

// ---- shared pieces ---------------------------------------------------------------------------------
// f16 (bf16 = 0) or bf16 (bf16 = 1) rounding to nearest even, as float
SH_D float round_half(float v, int bf16) {
    if (bf16) {  // round to nearest even on the upper 16 bits, as ggml's fp32 -> bf16
        const u32 u = f32_bits(v);
        return bits_f32((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
    }
    return h2f(f2h(v));
}

// (q8 rows: see the top; q8row_d / q8row_s are in quant_blocks.cuh)

// llama.cpp's 8-bit codes of one block of 32 * per values (per <= 8) held by a warp, lane l holding
// elements l + 32 j in v[j] (sharpi_core.quants.q8_parts): c[j] the codes (small integers as floats),
// returned the scale d, the rounded values being c * d:
// f16_scale=1 (Q8_0 / Q8_1): c = rint(x * (127 / amax)), d = f16(amax / 127);
// f16_scale=0 (Q8_K): m = the first element of largest magnitude, iscale = -127 / m,
// c = min(127, rint(iscale * x)), d = 1 / iscale.  (c may be v.)  *raw: f16_scale=1, amax / 127 before
// the f16 rounding (what llama.cpp scales Q8_1's s with); else d.
// (Inlined with a constant per, as glu_q8_block and rms_norm_f32 call it, v stays in registers.)
SH_D float q8_codes_regs(const float* v, float* c, int per, int f16_scale, float* raw) {
    const int lane = threadIdx.x & 31;
    float am = 0.0f;   // largest magnitude seen by this lane
    int ai = 32 * per; // its index (the first one on ties)
    float mv = 0.0f;   // that element (Q8_K's m; carried along rather than read back from v by index, which
                       // would put v in local memory)
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < per) {
            const float a = fabsf(v[j]);
            if (a > am) am = a, ai = lane + 32 * j, mv = v[j];
        }
    // (magnitude, index) arg-max over the warp: larger magnitude wins, the lower index on a tie
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float am2 = __shfl_xor_sync(0xffffffffu, am, o);
        const int ai2 = __shfl_xor_sync(0xffffffffu, ai, o);
        const float mv2 = __shfl_xor_sync(0xffffffffu, mv, o);
        if (am2 > am || (am2 == am && ai2 < ai)) am = am2, ai = ai2, mv = mv2;
    }
    if (am == 0.0f) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < per) c[j] = 0.0f;
        *raw = 0.0f;
        return 0.0f;
    }
    if (f16_scale) {
        const float iscale = 127.0f / am;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < per) c[j] = rintf(v[j] * iscale);
        *raw = am / 127.0f;
        return h2f(f2h(*raw));
    }
    const float iscale = -127.0f / mv;
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < per) c[j] = fminf(127.0f, rintf(iscale * v[j]));
    *raw = 1.0f / iscale;
    return *raw;
}

// one warp writes the codes c (lane l: element e0 + l + 32 j, j < per), the scale d and the s of a block
// into the q8 row q of K values (e0 % 32 == 0; raw: q8_codes_regs's)
// (The per sums' exchanges interleaved: one chain of five waits on the shuffles instead of per chains.)
SH_D void q8_store(const float* c, int per, float d, int f16_scale, float raw, u8* q, int K, int e0) {
    const int lane = threadIdx.x & 31;
    int sum[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < per) {
            sum[j] = (int)c[j];
            q[e0 + lane + 32 * j] = (u8)(i8)sum[j];
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < per) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], o);
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < per) {
                q8row_d(q, K)[e0 / 32 + j] = d;
                q8row_s(q, K)[e0 / 32 + j] = f16_scale ? (int)f32_bits(h2f(f2h(raw * (float)sum[j]))) : sum[j];
            }
}

// v rounded in place through llama.cpp's 8-bit blocks (q8_codes_regs); with q, its codes into the q8 row
// q of K values too (v holding elements e0 + lane + 32 j)
SH_D void round_q8_regs(float* v, int per, int f16_scale, u8* q = nullptr, int K = 0, int e0 = 0) {
    float c[8], raw;
    const float d = q8_codes_regs(v, c, per, f16_scale, &raw);
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < per) v[j] = c[j] * d;
    if (q) q8_store(c, per, d, f16_scale, raw, q, K, e0);
}

// one warp rounds the block of 32 * per values at xb into yb (may be xb; none if null), its codes into
// the q8 row q (if any) of K values at element e0
SH_D void round_q8_block(const float* xb, float* yb, int per, int f16_scale, u8* q = nullptr, int K = 0,
                         int e0 = 0) {
    const int lane = threadIdx.x & 31;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < per) v[j] = xb[lane + 32 * j];  // coalesced, increasing index within the lane
    round_q8_regs(v, per, f16_scale, q, K, e0);
    if (yb)
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < per) yb[lane + 32 * j] = v[j];
}

// ---- RMSNorm ---------------------------------------------------------------------------------------
// A row of n <= 8 * blockDim.x values in registers: thread i holds elements i + blockDim.x * k (k < 8),
// loaded all at once (one wait on memory, where a loop that writes x back between its loads waits once
// an element), summed in the order the strided loop sums them (so the same bits). The 8-bit roundings
// then run in registers (32-blocks: with 256 threads a warp holds whole blocks) or through shared
// memory (Q8_K's 256-blocks span warps), not by reading y back from global memory.
#define RMS_REG_MAX 8
#define RMS_SMEM 2048
// Before KERNEL_BEGIN: the block's row of weights asked of the L2 (memory no kernel writes; a hint, nothing
// read into the SM), so that loading it with x (after the wait) does not go to DRAM.
SH_D void rms_prefetch(const float* w, int w_rows, int has_w, int n) {
    if (has_w) prefetch_l2(w + (i64)(blockIdx.x % w_rows) * n, (i64)n * 4);
}
extern "C" __global__ void rms_norm_f32(float* x, i64 x_st, int nh, const float* __restrict__ a, i64 a_st,
                                        int has_a, const float* __restrict__ w, int w_rows, int has_w, float* y,
                                        i64 y_st, int n, float eps, int rmode, u8* q, i64 q_st) {
    rms_prefetch(w, w_rows, has_w, n);
    KERNEL_BEGIN();
    __shared__ float red[32];
    __shared__ float row[RMS_SMEM];
    const int r = blockIdx.x, t = r / nh, hh = r % nh;
    const int nt = blockDim.x;
    const float* wr = has_w ? w + (i64)(r % w_rows) * n : w;
    float* xr = x + (i64)t * x_st + (i64)hh * n;
    float* yr = y + (i64)t * y_st + (i64)hh * n;
    u8* qr = q_st ? q + (i64)t * q_st : nullptr;  // the row's q8 row, if wanted (rounded rows have nh == 1)
    float ss = 0.0f;
    if (n <= RMS_REG_MAX * nt && (rmode != 4 || n <= RMS_SMEM) && (rmode != 3 || nt % 32 == 0)) {
        float v[RMS_REG_MAX], wv[RMS_REG_MAX];  // (the weights loaded with x: their wait is x's)
#pragma unroll
        for (int k = 0; k < RMS_REG_MAX; k++) {
            const int i = threadIdx.x + nt * k;
            v[k] = i < n ? xr[i] : 0.0f;
            wv[k] = has_w && i < n ? wr[i] : 0.0f;
        }
        if (has_a) {
            const float* ar = a + (i64)t * a_st + (i64)hh * n;
            float u[RMS_REG_MAX];
#pragma unroll
            for (int k = 0; k < RMS_REG_MAX; k++) {
                const int i = threadIdx.x + nt * k;
                u[k] = i < n ? ar[i] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < RMS_REG_MAX; k++) {
                const int i = threadIdx.x + nt * k;
                if (i < n) {
                    v[k] = v[k] + u[k];
                    xr[i] = v[k];
                }
            }
        }
#pragma unroll
        for (int k = 0; k < RMS_REG_MAX; k++)
            if (threadIdx.x + nt * k < n) ss = sh_fma(v[k], v[k], ss);
        ss = block_sum(ss, red);  // synchronises: every read of x happens before any write of y
        const float scale = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
        for (int k = 0; k < RMS_REG_MAX; k++) {
            const int i = threadIdx.x + nt * k;
            if (i < n) {
                const float o = v[k] * scale;
                v[k] = has_w ? o * wv[k] : o;
                if (rmode == 1 || rmode == 2) v[k] = round_half(v[k], rmode == 2);
            }
        }
        if (rmode == 3) {  // a 32-block is a warp's k-th values (n % 32 == 0, nt % 32 == 0)
#pragma unroll
            for (int k = 0; k < RMS_REG_MAX; k++)
                if ((threadIdx.x & ~31) + nt * k < n) round_q8_regs(&v[k], 1, 1, qr, n, (threadIdx.x & ~31) + nt * k);
        }
        if (rmode == 4) {  // Q8_K blocks of 256 span warps: each warp rounds whole blocks from shared memory
#pragma unroll
            for (int k = 0; k < RMS_REG_MAX; k++)
                if (threadIdx.x + nt * k < n) row[threadIdx.x + nt * k] = v[k];
            __syncthreads();
            for (int c = threadIdx.x >> 5; c < n / 256; c += nt >> 5)
                round_q8_block(row + c * 256, yr + c * 256, 8, 0, qr, n, c * 256);
            return;
        }
#pragma unroll
        for (int k = 0; k < RMS_REG_MAX; k++)
            if (threadIdx.x + nt * k < n) yr[threadIdx.x + nt * k] = v[k];
        return;
    }
    // longer rows: through memory
    if (has_a) {
        const float* ar = a + (i64)t * a_st + (i64)hh * n;
        for (int i = threadIdx.x; i < n; i += nt) {
            const float v = xr[i] + ar[i];
            xr[i] = v;  // read back below by this same thread only
            ss = sh_fma(v, v, ss);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += nt) ss = sh_fma(xr[i], xr[i], ss);
    }
    ss = block_sum(ss, red);  // synchronises: every read of x happens before any write of y
    const float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += nt) {
        const float v = xr[i] * scale;
        const float o = has_w ? v * wr[i] : v;
        yr[i] = rmode == 1 || rmode == 2 ? round_half(o, rmode == 2) : o;
    }
    if (rmode >= 3) {  // 8-bit blocks across the row: each warp rounds whole blocks, after every write
        __syncthreads();
        const int block = rmode == 3 ? 32 : 256, nw = nt >> 5;
        for (int c = threadIdx.x >> 5; c < n / block; c += nw)
            round_q8_block(yr + c * block, yr + c * block, block / 32, rmode == 3, qr, n, c * block);
    }
}

// ---- small elementwise steps (what the graph of a decoding pass needs besides the big kernels) ----
extern "C" __global__ void add_bias_f32(float* x, i64 x_st, int T, int n, const float* __restrict__ b) {
    KERNEL_BEGIN();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * n) return;
    const int t = (int)(idx / n), i = (int)(idx % n);
    x[(i64)t * x_st + i] += b[i];
}

extern "C" __global__ void scale_f32(float* x, i64 x_st, int T, int n, float alpha) {
    KERNEL_BEGIN();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * n) return;
    const int t = (int)(idx / n), i = (int)(idx % n);
    x[(i64)t * x_st + i] *= alpha;
}

extern "C" __global__ void scale_rows_f32(float* x, i64 x_st, int T, int n, const float* table, const int* pos) {
    KERNEL_BEGIN();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * n) return;
    const int t = (int)(idx / n), i = (int)(idx % n);
    x[(i64)t * x_st + i] *= table[pos[t]];
}

extern "C" __global__ void softcap_f32(float* x, i64 x_st, int T, int n, float inv, float cap) {
    KERNEL_BEGIN();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * n) return;
    const int t = (int)(idx / n), i = (int)(idx % n);
    float* p = x + (i64)t * x_st + i;
    *p = tanhf(*p * inv) * cap;
}

extern "C" __global__ void round_half_f32(const float* x, i64 x_st, int T, int K, int bf16, float* y, i64 y_st) {
    KERNEL_BEGIN();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * K) return;
    const int t = (int)(idx / K), i = (int)(idx % K);
    y[(i64)t * y_st + i] = round_half(x[(i64)t * x_st + i], bf16);
}

extern "C" __global__ void hadamard_f32(const float* __restrict__ x, i64 x_st, int T, int n, int blk, float scale,
                                        float* __restrict__ y, i64 y_st) {
    KERNEL_BEGIN();
    extern __shared__ float hb[];  // [blk]
    const int per = n / blk;
    const int t = blockIdx.x / per, c = blockIdx.x % per;
    const float* xc = x + (i64)t * x_st + (i64)c * blk;
    for (int i = threadIdx.x; i < blk; i += blockDim.x) hb[i] = xc[i] * scale;
    __syncthreads();
    for (int w = 1; w < blk; w *= 2) {
        for (int p = threadIdx.x; p < blk / 2; p += blockDim.x) {
            const int i0 = (p / w) * 2 * w + p % w, i1 = i0 + w;
            const float a = hb[i0], b = hb[i1];
            hb[i0] = a + b;
            hb[i1] = a - b;
        }
        __syncthreads();
    }
    float* yc = y + (i64)t * y_st + (i64)c * blk;
    for (int i = threadIdx.x; i < blk; i += blockDim.x) yc[i] = hb[i];
}

// ---- RoPE ------------------------------------------------------------------------------------------
// Element d of the head row hp [hd] after RoPE at position p, the angles from the (cos, sin) table cs
// ([p][i][cos, sin]): the value rope_f32 (has_cs) leaves there, bit for bit. kv_append and attention
// read K and q through it, so that a pass needs no launch of rope_f32.
SH_D float rope_elem(const float* hp, int d, int p, const float* __restrict__ cs, int n_rot, int neox) {
    if (d >= n_rot) return hp[d];
    const int half = n_rot / 2;
    const int i = neox ? (d < half ? d : d - half) : d >> 1;
    const bool first = neox ? d < half : (d & 1) == 0;
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    const float c = cs[((i64)p * half + i) * 2], s = cs[((i64)p * half + i) * 2 + 1];
    const float a = hp[i0], b = hp[i1];
    return first ? a * c - b * s : a * s + b * c;
}

extern "C" __global__ void rope_f32(float* x, i64 x_st, int T, int nh, int hd, const int* __restrict__ pos,
                                    int n_rot, int neox, const float* __restrict__ cs, int has_cs,
                                    float theta_base, float freq_scale, const float* __restrict__ ff,
                                    int has_ff) {
    KERNEL_BEGIN();
    const int half = n_rot / 2;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * nh * half) return;
    const int i = (int)(idx % half);
    const int h = (int)((idx / half) % nh);
    const int t = (int)(idx / ((i64)half * nh));
    const int p = pos[t];
    float c, s;
    if (has_cs) {
        c = cs[((i64)p * half + i) * 2];
        s = cs[((i64)p * half + i) * 2 + 1];
    } else {
        float theta = (float)p * freq_scale * powf(theta_base, -2.0f * (float)i / (float)n_rot);
        if (has_ff) theta /= ff[i];
        sincosf(theta, &s, &c);
    }
    float* hp = x + (i64)t * x_st + (i64)h * hd;
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    const float a = hp[i0], b = hp[i1];
    hp[i0] = a * c - b * s;
    hp[i1] = a * s + b * c;
}

// ---- gated activations -----------------------------------------------------------------------------
SH_D float act_fn(float x, int act) {
    if (act == 0) return x / (1.0f + expf(-x));
    if (act == 1) return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    // ggml_gelu_f32 on the f16 value (the inner a*x*x + 1 contracted to an fma, as gcc does)
    const float xh = h2f(f2h(x));
    return h2f(f2h(0.5f * xh * (1.0f + tanhf(0.7978845608028654f * xh * fmaf(0.044715f * xh, xh, 1.0f)))));
}

extern "C" __global__ void glu_f32(const float* g, i64 g_st, const float* u, i64 u_st, float* out, i64 o_st,
                                   int T, int F, int act) {
    KERNEL_BEGIN();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * F) return;
    const int t = (int)(idx / F), i = (int)(idx % F);
    out[(i64)t * o_st + i] = act_fn(g[(i64)t * g_st + i], act) * u[(i64)t * u_st + i];
}

// one warp: a block of 32 * PER gated values, lane l holding elements l + 32 j, rounded (loads first)
template <int PER>
SH_D void glu_q8_block(const float* g, const float* u, float* out, int act, int f16_scale, u8* q, int K, int e0) {
    const int lane = threadIdx.x & 31;
    float gv[PER], uv[PER], v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        gv[j] = g[lane + 32 * j];
        uv[j] = u[lane + 32 * j];
    }
#pragma unroll
    for (int j = 0; j < PER; j++) v[j] = act_fn(gv[j], act) * uv[j];
    round_q8_regs(v, PER, f16_scale, q, K, e0);
#pragma unroll
    for (int j = 0; j < PER; j++) out[lane + 32 * j] = v[j];
}

extern "C" __global__ void glu_q8_f32(const float* g, i64 g_st, const float* u, i64 u_st, float* out, i64 o_st,
                                      int T, int F, int act, int block, int f16_scale, u8* q, i64 q_st) {
    KERNEL_BEGIN();
    const i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nb = F / block, per = block / 32;
    if (gw >= (i64)T * nb) return;  // uniform over the warp
    const int t = (int)(gw / nb);
    const int i0 = (int)(gw % nb) * block;
    u8* qr = q_st ? q + (i64)t * q_st : nullptr;
    if (per == 8)
        glu_q8_block<8>(g + (i64)t * g_st + i0, u + (i64)t * u_st + i0, out + (i64)t * o_st + i0, act, f16_scale,
                        qr, F, i0);
    else
        for (int j = 0; j < per; j++)  // (blocks of 32 the warp rounds one by one)
            glu_q8_block<1>(g + (i64)t * g_st + i0 + 32 * j, u + (i64)t * u_st + i0 + 32 * j,
                            out + (i64)t * o_st + i0 + 32 * j, act, f16_scale, qr, F, i0 + 32 * j);
}

// ---- KV cache append -------------------------------------------------------------------------------
// the arguments of a kv_append launch: set blockIdx.y of two
#define KV_APPEND_ARGS                                                                                   \
    int T, int nkv, const int* __restrict__ pos, const float* __restrict__ src0, i64 s_st0, int D0,     \
        u8* __restrict__ dst0, i64 d_sp_b0, i64 d_sh_b0, const float* __restrict__ src1, i64 s_st1,    \
        int D1, u8* __restrict__ dst1, i64 d_sp_b1, i64 d_sh_b1, const float* __restrict__ rcs, int n_rot, \
        int neox
#define KV_APPEND_PICK                                                                                   \
    const bool one = blockIdx.y == 1;                                                                    \
    const int nr = one ? 0 : n_rot; /* RoPE on set 0 only */                                             \
    const float* src = one ? src1 : src0;                                                                \
    u8* dst = one ? dst1 : dst0;                                                                         \
    const i64 s_st = one ? s_st1 : s_st0, d_sp_b = one ? d_sp_b1 : d_sp_b0, d_sh_b = one ? d_sh_b1 : d_sh_b0; \
    const int D = one ? D1 : D0;

extern "C" __global__ void kv_append_f16(KV_APPEND_ARGS) {
    KERNEL_BEGIN();
    KV_APPEND_PICK
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * nkv * D) return;
    const int d = (int)(idx % D), h = (int)((idx / D) % nkv), t = (int)(idx / ((i64)D * nkv));
    u16* o = (u16*)(dst + (i64)pos[t] * d_sp_b + (i64)h * d_sh_b);
    const float* row = src + (i64)t * s_st + (i64)h * D;
    st(o + d, f2h(nr ? rope_elem(row, d, pos[t], rcs, nr, neox) : row[d]));
}

extern "C" __global__ void kv_append_q8_0(KV_APPEND_ARGS) {
    KERNEL_BEGIN();
    KV_APPEND_PICK
    const int lane = threadIdx.x & 31;
    const i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // one warp per block of 32
    const int nb = D / 32;
    if (gw >= (i64)T * nkv * nb) return;  // uniform over the warp
    const int bi = (int)(gw % nb), h = (int)((gw / nb) % nkv), t = (int)(gw / ((i64)nb * nkv));
    const float* row = src + (i64)t * s_st + (i64)h * D;
    const float v = nr ? rope_elem(row, bi * 32 + lane, pos[t], rcs, nr, neox) : row[bi * 32 + lane];
    const float amax = warp_max(fabsf(v));
    // ggml's x86 quantize_row_q8_0, as the CPU path's cache: codes rint(v * (127 / amax)) (half to
    // even), scale fp16(amax / 127); gguf.quants' reference (roundf(v / d)) differs on a few codes
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = (int)rintf(v * id);
    u8* blk = dst + (i64)pos[t] * d_sp_b + (i64)h * d_sh_b + (i64)bi * 34;
    if (lane == 0) st((u16*)blk, f2h(amax / 127.0f));
    blk[2 + lane] = (u8)(i8)q;
}

// ---- activation rounding ---------------------------------------------------------------------------
// What llama.cpp's CPU backend does to the activations before a quantized matmul (their vec_dot_type):
// the GPU matvecs then multiply the same values in fp32, so greedy output follows the CPU path's.
extern "C" __global__ void act_round_q8(const float* x, i64 x_st, int T, int K, int block, int f16_scale,
                                        float* y, i64 y_st, u8* q, i64 q_st) {
    KERNEL_BEGIN();
    const i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nb = K / block, per = block / 32;
    if (gw >= (i64)T * nb) return;  // uniform over the warp
    const int t = (int)(gw / nb), b = (int)(gw % nb);
    round_q8_block(x + (i64)t * x_st + (i64)b * block, y_st ? y + (i64)t * y_st + (i64)b * block : nullptr, per,
                   f16_scale, q_st ? q + (i64)t * q_st : nullptr, K, b * block);
}

// ---- arg-max (greedy decoding on the device: 4 bytes a row go back to the host, not the logits) ----
// (a, ia) beats (b, ib): numpy.argmax's order. The empty start (-inf, n) loses to every element.
SH_D bool am_beats(float a, int ia, float b, int ib) {
    if (a != a) return b == b || ia < ib;
    return b == b && (a > b || (a == b && ia < ib));
}

// the arg-max of the block's (v, i) pairs, in thread 0; every thread must call it
SH_D void block_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        if (am_beats(v2, i2, v, i)) v = v2, i = i2;
    }
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < nw; w++)
            if (am_beats(sv[w], si[w], v, i)) v = sv[w], i = si[w];
}

extern "C" __global__ void argmax_part_f32(const float* __restrict__ x, i64 x_st, int n,
                                           const float* __restrict__ bias, int has_bias, int chunk,
                                           float* pv, int* pi) {
    KERNEL_BEGIN();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.y, S = gridDim.x;
    const float* xr = x + (i64)r * x_st;
    const int lo = blockIdx.x * chunk, hi = imin(n, lo + chunk);
    float v = neg_inf();
    int vi = n;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {  // increasing i: a later tie never wins
        const float e = has_bias ? xr[i] + bias[i] : xr[i];
        if (am_beats(e, i, v, vi)) v = e, vi = i;
    }
    block_argmax(v, vi, sv, si);
    if (threadIdx.x == 0) pv[(i64)r * S + blockIdx.x] = v, pi[(i64)r * S + blockIdx.x] = vi;
}

extern "C" __global__ void argmax_comb(const float* __restrict__ pv, const int* __restrict__ pi, int S, int* out) {
    KERNEL_BEGIN();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x;
    float v = neg_inf();
    int vi = 0x7fffffff;
    for (int b = threadIdx.x; b < S; b += blockDim.x)
        if (am_beats(pv[(i64)r * S + b], pi[(i64)r * S + b], v, vi)) v = pv[(i64)r * S + b], vi = pi[(i64)r * S + b];
    block_argmax(v, vi, sv, si);
    if (threadIdx.x == 0) out[r] = vi;
}

// ---- sampling on the device (temp > 0: a draft's proposals, a target's steps and verify rows) ----------
// A key orders a (value, id) pair as the sampler chain's top-k does: the larger value first, the lower
// id on a tie (-0 taken as +0); a NaN above everything (its row has no distribution); 0 below every key
// (padding). A row's top-k: its chunks of at most TOPK_SORT values sorted in shared memory, a block each,
// each keeping its first k keys (topk_part_f32); then those of all chunks sorted by one block, whose
// first k are the row's (topk_sample), which also computes the chain's law over them and draws a token.
#define TOPK_SORT 4096
#define TOPK_MAX 64
typedef unsigned long long u64;

SH_D u64 topk_key(float v, int i) {
    u32 b = f32_bits(v == 0.0f ? 0.0f : v);
    b = v != v ? 0xffffffffu : (b & 0x80000000u) ? ~b : b | 0x80000000u;
    return ((u64)b << 32) | (u64)(0xffffffffu - (u32)i);
}
SH_D float topk_value(u64 k) {
    const u32 b = (u32)(k >> 32);
    return bits_f32((b & 0x80000000u) ? b & 0x7fffffffu : ~b);
}
SH_D int topk_id(u64 k) { return (int)(0xffffffffu - (u32)k); }

// the n (a power of 2) keys of s sorted in decreasing order by the block (bitonic; ends synchronised)
SH_D void topk_sort_desc(u64* s, int n) {
    for (int k = 2; k <= n; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const u64 a = s[i], b = s[l];
                    if ((i & k) == 0 ? a < b : a > b) s[i] = b, s[l] = a;
                }
            }
            __syncthreads();
        }
}

SH_D int pow2_at_least(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

// grid (S, T), chunk * S >= n, chunk <= TOPK_SORT, K <= TOPK_MAX: the K first keys of row r's chunk c
// (of x + bias) into keys[(r * S + c) * K ...], padded with 0
extern "C" __global__ void topk_part_f32(const float* __restrict__ x, i64 x_st, int n,
                                         const float* __restrict__ bias, int has_bias, int chunk, int K,
                                         u64* keys) {
    KERNEL_BEGIN();
    __shared__ u64 s[TOPK_SORT];
    const int r = blockIdx.y, lo = blockIdx.x * chunk, m = imax(0, imin(n, lo + chunk) - lo);
    const float* xr = x + (i64)r * x_st;
    const int np2 = pow2_at_least(imax(m, K));
    for (int i = threadIdx.x; i < np2; i += blockDim.x)
        s[i] = i < m ? topk_key(has_bias ? xr[lo + i] + bias[lo + i] : xr[lo + i], lo + i) : 0ull;
    __syncthreads();
    topk_sort_desc(s, np2);
    for (int j = threadIdx.x; j < K; j += blockDim.x) keys[((i64)r * gridDim.x + blockIdx.x) * K + j] = s[j];
}

// grid (T): row r's top K of its S chunks' keys, the sampler chain's law over them (top-k -> top-p ->
// min-p -> temperature, as sampling._plain_candidates computes it, in float32) and a token drawn from it
// with the uniform u[r] in [0, 1): out[r * o_st ...] = the token's id (-1: no distribution: a NaN, or
// nothing above -inf), then the K candidates' ids (-1 past the row), then their probabilities' float bits
// (0 where the chain cut them; they sum to 1 up to rounding); tok[r] = the id (0 for -1), which the next
// pass of a chain reads. The draw: the first candidate whose running sum of probabilities exceeds u times
// their total, so a token's chance is its probability as written, to float32 rounding.
extern "C" __global__ void topk_sample(const u64* __restrict__ keys, int S, int K, float temp, float top_p,
                                       float min_p, int min_keep, const float* __restrict__ u, int* out,
                                       i64 o_st, int* tok) {
    KERNEL_BEGIN();
    __shared__ u64 s[TOPK_SORT];
    __shared__ float p[TOPK_MAX];
    __shared__ int chosen[1];
    const int r = blockIdx.x, m = S * K, np2 = pow2_at_least(m);
    for (int i = threadIdx.x; i < np2; i += blockDim.x) s[i] = i < m ? keys[(i64)r * m + i] : 0ull;
    __syncthreads();
    topk_sort_desc(s, np2);
    if (threadIdx.x == 0) {
        int nv = 0;  // candidates (keys above the padding)
        while (nv < K && s[nv] != 0ull) nv++;
        const float v0 = nv ? topk_value(s[0]) : 0.0f;
        int pick = -1;
        for (int j = 0; j < K; j++) p[j] = 0.0f;
        if (nv && v0 == v0 && v0 != neg_inf()) {
            int n = nv;
            if (v0 == -neg_inf()) {  // +inf logits (a bias): nothing else can be drawn, each as likely
                n = 0;
                while (n < nv && topk_value(s[n]) == v0) n++;
                for (int j = 0; j < n; j++) p[j] = 1.0f / (float)n;
            } else {
                if (top_p < 1.0f && n > 1) {  // the first prefix whose softmax mass reaches top_p
                    float tot = 0.0f;
                    for (int j = 0; j < n; j++) tot += expf(topk_value(s[j]) - v0);
                    float c = 0.0f;
                    for (int j = 0; j < n; j++) {
                        c += expf(topk_value(s[j]) - v0) / tot;
                        if (c >= top_p) {
                            n = imax(j + 1, imin(min_keep, n));
                            break;
                        }
                    }
                }
                if (min_p > 0.0f && n > 1) {
                    const float thr = v0 + logf(min_p);
                    int cnt = 0;
                    for (int j = 0; j < n; j++) cnt += topk_value(s[j]) >= thr;
                    n = imax(1, imin(n, imax(min_keep, cnt)));
                }
                float tot = 0.0f;
                for (int j = 0; j < n; j++) tot += (p[j] = expf((topk_value(s[j]) - v0) / temp));
                for (int j = 0; j < n; j++) p[j] /= tot;
            }
            float tot = 0.0f;
            for (int j = 0; j < n; j++) tot += p[j];
            const float target = u[r] * tot;
            float c = 0.0f;
            for (int j = 0; j < n; j++) {
                c += p[j];
                if (p[j] > 0.0f) pick = j;
                if (p[j] > 0.0f && target < c) break;
            }
        }
        chosen[0] = pick;
    }
    __syncthreads();
    int* o = out + (i64)r * o_st;
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
        o[1 + j] = s[j] != 0ull ? topk_id(s[j]) : -1;
        o[1 + K + j] = (int)f32_bits(p[j]);
    }
    if (threadIdx.x == 0) {
        const int id = chosen[0] >= 0 ? topk_id(s[chosen[0]]) : -1;
        o[0] = id;
        tok[r] = imax(id, 0);
    }
}

// ---- attention -------------------------------------------------------------------------------------
//
// Q [T, H, Dk] fp32 (row t at Q + t*q_st, head h at + h*Dk), already roped. Cache row of position j,
// kv head g at Kc + j*k_sp_b + g*k_sh_b (bytes): Dk halves (f16) or Dk/32 q8_0 blocks; same for V.
// Query t sits at position qpos[t] and sees keys j with j <= qpos[t], j < n_kv and, if window > 0,
// qpos[t] - j < window (llama.cpp's standard sliding window). Query head h reads kv head h / (H/Hkv).
// Score = scale * (softcap > 0 ? softcap*tanh(q.k/softcap) : q.k); softmax over visible keys; out = P V.
//
// attn_partial_<k>_<v> (k, v in f16, q8_0: the K and V cache types): grid (H / hpb, T, S), block hpb *
//     ATT_THREADS: hpb heads a block (1, or the heads of a unit, below), ATT_THREADS threads each, which
//     compute exactly as a block of one head does; dynamic shared memory hpb * (Dk + chunk + 8*ATT_THREADS
//     + 32 + Dv) floats (attn_smem_head: a head's q, scores and reductions; then its finished output).
//     Split s covers the visible keys lo + s*chunk .. + chunk - 1 (lo = first visible key) and writes its
//     unnormalised output Op[(t*H+h)*S + s][Dv] and (max, sum of exp) ML[...][2] (an empty split writes
//     -inf, 0).
//     q_round: 0 = q in fp32; 1 = q rounded to f16; 2 = q rounded through q8_0 blocks of 32 as
//     kv_append_q8_0 rounds (what llama.cpp's CPU backend does to q before multiplying by an f16 /
//     q8_0 K; needs Dk % 32 == 0).
//     p_round (only with S == 1): probabilities normalised in this kernel and rounded to f16 before
//     multiplying by V (llama.cpp CPU, f16 V); then ML = (max, 1).
//     n_rot > 0: q is read through RoPE at qpos[t] with the (cos, sin) table rcs (as kv_append's K).
//     cnt, O, o_st, rmode: with rmode >= 0 the launch also combines: the last block of each unit of heads
//     of row t to finish (attn_finish) writes the unit's O[t*o_st ...] as attn_combine (rmode 0) /
//     attn_combine_r (rmode 1..4) would, bit for bit; cnt[t*H + unit] (int32, 0 before the launch)
//     counts the unit's finished blocks and is 0 again after it. rmode = -1: partials only (cnt and O
//     unused).
// attn_combine(Op, ML, S, H, Dv, O, o_st, qpos, n_kv, window, chunk): grid (H, T), any block (multiple of
//     32): O[t*o_st + h*Dv + d] = sum_s Op*e^(m_s-M) / sum_s l_s*e^(m_s-M)  (0 where no key is visible),
//     over the splits that hold keys (the partials' qpos, n_kv, window, chunk tell which).
// attn_combine_r(..., T, rmode): the same values rounded for the next matmul (rms_norm's rmode), see below.
#define ATT_THREADS 128
#define ATT_MAX_HPB 2  // heads a block at most (4 would cap a thread at 128 registers: the f16 kernels spilled)
// 16-byte loads a thread has in flight at once: of its key's K row (16: a whole row of 128 halves, one wait
// on memory a key where 8 were two), of V rows (8 keys). The sums keep their order, so the bits do not
// depend on these; SHARPI_CUDA_OPS_DEFS="-DATT_K_LOADS=8 -DATT_V_LOADS=4" builds the earlier ones (benchmarks).
#ifndef ATT_K_LOADS
#define ATT_K_LOADS 16
#endif
#ifndef ATT_V_LOADS
#define ATT_V_LOADS 8
#endif

// heads an attention block computes (hpb: 1, or the heads of a rounding unit), ATT_THREADS threads each,
// and the head of this thread's group
SH_D int attn_hpb() { return blockDim.x / ATT_THREADS; }
SH_D int attn_head() { return blockIdx.x * attn_hpb() + threadIdx.x / ATT_THREADS; }

// floats of shared memory a head's group uses before its output (q, scores, reductions)
SH_D int attn_smem_head(int Dk, int chunk) { return Dk + chunk + 8 * ATT_THREADS + 32; }

// the first (lo) and last (hi) key a query at position p sees among n_kv cache rows
SH_D void attn_keys(int p, int n_kv, int window, int& lo, int& hi) {
    hi = imin(p, n_kv - 1);
    lo = window > 0 ? imax(0, p - window + 1) : 0;
}

// how many of a row's S splits hold keys: the rest are empty (l = 0) and add nothing to a combine,
// so it reads only these (the same bits, ~S times fewer loads on a short context)
SH_D int attn_nsplits(const int* __restrict__ qpos, int t, int n_kv, int window, int chunk, int S) {
    int lo, hi;
    attn_keys(qpos[t], n_kv, window, lo, hi);
    return hi < lo ? 0 : imin(S, (hi - lo) / chunk + 1);
}

// the (max, 1 / sum) that combine the S splits of one (row, head) starting at partial part0 (read
// through the L2: in a fused launch other blocks wrote them)
SH_D void attn_norm(const float* ML, i64 part0, int S, float& M, float& inv) {
    M = neg_inf();
    for (int s = 0; s < S; s++)
        if (ld_cg(ML + (part0 + s) * 2 + 1) > 0.0f) M = fmaxf(M, ld_cg(ML + (part0 + s) * 2));
    float L = 0.0f;
    for (int s = 0; s < S; s++) {
        const float l = ld_cg(ML + (part0 + s) * 2 + 1);
        if (l > 0.0f) L += l * expf(ld_cg(ML + (part0 + s) * 2) - M);
    }
    inv = L > 0.0f ? 1.0f / L : 0.0f;
}

// output element d of the (row, head) whose splits start at part0
SH_D float attn_out(const float* Op, const float* ML, i64 part0, int S, int Dv, int d, float M, float inv) {
    float o = 0.0f;
    for (int s = 0; s < S; s++) {
        const float l = ld_cg(ML + (part0 + s) * 2 + 1);
        if (l > 0.0f) o += ld_cg(Op + (part0 + s) * Dv + d) * expf(ld_cg(ML + (part0 + s) * 2) - M);
    }
    return o * inv;
}

// one warp's `block` values v[per] of row t from e0 (lane + 32 j), rounded by rmode (rms_norm's; 0 = not
// rounded) and stored
SH_D void attn_round_store(float* v, int per, int rmode, float* __restrict__ O, i64 o_st, int t, int e0, u8* q,
                            i64 q_st, int K) {
    if (rmode >= 3)
        round_q8_regs(v, per, rmode == 3, q_st ? q + (i64)t * q_st : nullptr, K, e0);
    else if (rmode >= 1)
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < per) v[j] = round_half(v[j], rmode == 2);
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < per) O[(i64)t * o_st + e0 + (threadIdx.x & 31) + 32 * j] = v[j];
}

// one warp: the `block` values of row t starting at e0 (a block of 32, or 256 for Q8_K: such a block
// spans heads), combined from their splits and rounded by rmode
// (ns: the row's splits that hold keys, attn_nsplits)
SH_D void attn_combine_block(const float* Op, const float* ML, int S, int ns, int H, int Dv, float* __restrict__ O,
                             i64 o_st, int t, int e0, int rmode, u8* q, i64 q_st) {
    const int lane = threadIdx.x & 31;
    const int per = (rmode == 4 ? 256 : 32) / 32;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (j >= per) break;
        const int e = e0 + lane + 32 * j, h = e / Dv;
        const i64 part0 = ((i64)t * H + h) * S;
        float M, inv;
        attn_norm(ML, part0, ns, M, inv);
        v[j] = attn_out(Op, ML, part0, ns, Dv, e % Dv, M, inv);
    }
    attn_round_store(v, per, rmode, O, o_st, t, e0, q, q_st, H * Dv);
}

// The fused launch's end (rmode >= 0): every block counts itself done for its unit once its partial is
// visible to the device; the unit's last block (of the hpu / hpb * S blocks holding its heads: a block holds
// hpb heads, 1 or hpu) combines the unit into O (rounded by rmode) and sets the count back to 0 for the
// next launch. Nothing waits on another block. A unit is the
// fewest whole heads that hold whole rounding blocks (32 values; 256 for Q8_K, which can span heads):
// hpu = block / gcd(Dv, block) heads (all H where that does not divide H), so that the combines of a
// row's units run side by side (one block combining a whole row was a decoding step's slowest part).
// The combining block first puts each head's 1/L and split weights e^(m_s - M) in shared memory (sh:
// `room` floats; -1 marks an empty split) and then reads one partial value per split and element:
// attn_out's products and sums in its order, so the same bits. sh[room] holds the block's "last" flag.
SH_D void attn_finish(const float* Op, const float* ML, int S, int H, int Dv, float* __restrict__ O, i64 o_st,
                      int rmode, int* cnt, float* sh, int room, const int* __restrict__ qpos, int n_kv,
                      int window, int chunk, u8* q, i64 q_st) {
    const int t = blockIdx.y;
    const int block = rmode == 4 ? 256 : 32, per = block / 32, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    int gd = block, b2 = Dv;  // gcd(Dv, block)
    while (b2) {
        const int r = gd % b2;
        gd = b2;
        b2 = r;
    }
    int hpu = block / gd;
    if (H % hpu) hpu = H;
    const int hpb = attn_hpb();
    const int h0 = blockIdx.x * hpb / hpu * hpu;  // the unit's first head
    int* c = cnt + (i64)t * H + h0 / hpu;
    float* flag = sh + room;
    __threadfence();  // this thread's partial values, device-wide, before the count below
    __syncthreads();
    if (threadIdx.x == 0) flag[0] = atomicAdd(c, 1) == hpu / hpb * S - 1 ? 1.0f : 0.0f;
    __syncthreads();
    if (flag[0] == 0.0f) return;  // uniform over the block
    __threadfence();
    const int ns = attn_nsplits(qpos, t, n_kv, window, chunk, S);
    const int e_lo = h0 * Dv, nb = hpu * Dv / block;  // the unit's elements of the row, in blocks
    if (hpu * (ns + 1) > room) {  // (a long context in few-key chunks) element by element
        for (int b = threadIdx.x >> 5; b < nb; b += nw)
            attn_combine_block(Op, ML, S, ns, H, Dv, O, o_st, t, e_lo + b * block, rmode, q, q_st);
    } else {
        float* inv_h = sh;       // [hpu]
        float* w = sh + hpu;     // [hpu][ns]
        for (int i = threadIdx.x; i < hpu; i += blockDim.x) {
            const i64 part0 = ((i64)t * H + h0 + i) * S;
            float M, inv;
            attn_norm(ML, part0, ns, M, inv);
            inv_h[i] = inv;
            for (int s = 0; s < ns; s++)
                w[i * ns + s] = ld_cg(ML + (part0 + s) * 2 + 1) > 0.0f ? expf(ld_cg(ML + (part0 + s) * 2) - M) : -1.0f;
        }
        __syncthreads();
        for (int b = threadIdx.x >> 5; b < nb; b += nw) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (j >= per) break;
                const int e = e_lo + b * block + lane + 32 * j, h = e / Dv, i = h - h0;
                const float* op = Op + ((i64)t * H + h) * S * Dv + e % Dv;
                float o = 0.0f;
                for (int s = 0; s < ns; s++) {
                    const float ws = w[i * ns + s];
                    if (ws >= 0.0f) o += ld_cg(op + (i64)s * Dv) * ws;
                }
                v[j] = o * inv_h[i];
            }
            attn_round_store(v, per, rmode, O, o_st, t, e_lo + b * block, q, q_st, H * Dv);
        }
    }
    if (threadIdx.x == 0) *c = 0;
}

// the 8 halves of a 16-byte load, as floats, in memory order (an F16 weight block's decoding)
SH_D void halves8(uint4 v, float* f) {
    BF16x8 b;
    b.v = v;
    b.deq(0, f);
    b.deq(1, f + 4);
}
// p and the stride st both 16-byte aligned (a cache's rows can be read with 16-byte loads)
SH_D bool aligned16(const u8* p, i64 st) { return (((unsigned long long)p | (unsigned long long)st) & 15u) == 0; }

template <int KT>
SH_D float kv_elem(const u8* row, int d) {
    if (KT == 0) return h2f(ldg((const u16*)row + d));
    const u8* blk = row + (d >> 5) * 34;
    return h2f(ld_u16(blk)) * (float)(int)(i8)ldg(blk + 2 + (d & 31));
}

// Whether a fused launch (rmode >= 0) finishes row t's output in the block of its one split that holds
// keys (the others, empty, write nothing), without partials, counters or a combining block: where a
// block's heads hold whole rounding blocks (none, f16, bf16, 8-bit blocks of 32: a head of whole 32s;
// Q8_K's 256, which span heads: a block of hpb heads holding whole 256s, whose warps round them from
// its finished outputs in shared memory). Every block of the row decides the same.
SH_D bool attn_direct(int rmode, int Dv, const int* __restrict__ qpos, int n_kv, int window, int chunk) {
    return rmode >= 0 && Dv % 32 == 0 && (rmode <= 3 || attn_hpb() * Dv % 256 == 0) &&
           attn_nsplits(qpos, blockIdx.y, n_kv, window, chunk, gridDim.z) == 1;
}

template <int KT, int VT>
__device__ __forceinline__ void attn_split(const float* __restrict__ Q, i64 q_st, const u8* __restrict__ Kc,
                                           i64 k_sp_b, i64 k_sh_b, const u8* __restrict__ Vc, i64 v_sp_b,
                                           i64 v_sh_b, const int* __restrict__ qpos, int n_kv, int H, int Hkv,
                                           int Dk, int Dv, float scale, float softcap, int window, int chunk,
                                           int q_round, int p_round, float* Op, float* ML,
                                           const float* __restrict__ rcs, int n_rot, int neox,
                                           float* __restrict__ O, i64 o_st, int rmode, u8* q8, i64 q8_st,
                                           bool direct) {
    extern __shared__ float smem[];
    // a block holds hpb heads, a group of ATT_THREADS threads each, computing as a block of one would;
    // group gr's shared memory, then the block's finished outputs (stage: direct Q8_K rounding)
    const int hpb = attn_hpb(), gr = threadIdx.x / ATT_THREADS;
    float* qs = smem + gr * attn_smem_head(Dk, chunk);  // [Dk]
    float* sc = qs + Dk;           // [chunk]
    float* red2 = sc + chunk;      // [8 * ATT_THREADS]
    float* red = red2 + 8 * ATT_THREADS;  // [32]
    float* stage = smem + hpb * attn_smem_head(Dk, chunk);  // [hpb * Dv]
    const int tid = threadIdx.x % ATT_THREADS, lane = tid & 31, warp = tid >> 5, nw = ATT_THREADS >> 5;
    const int h = attn_head(), t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    const int g = h / (H / Hkv);
    const int p = qpos[t];
    int lo, hi;  // the first and last visible key
    attn_keys(p, n_kv, window, lo, hi);
    const int a = lo + s * chunk;
    const int n = imin(a + chunk, hi + 1) - a;            // keys of this split (may be <= 0)
    const i64 part = ((i64)t * H + h) * S + s;
    // the split's unnormalised output o of element d (d % 32 == lane; whole warps call it): into the
    // partials, or (direct: attn_direct) finished as the combine would finish it, (0 + o * e^0) * (1 / sum),
    // the same bits, rounded and stored by rmode (Q8_K: staged for the block's warps to round, at the end)
    auto emit = [&](int d, float o, float inv) {
        if (direct && rmode == 4) {
            stage[gr * Dv + d] = o * inv;
        } else if (direct) {
            float v = o * inv;
            attn_round_store(&v, 1, rmode, O, o_st, t, h * Dv + (d & ~31), q8, q8_st, H * Dv);
        } else {
            Op[part * Dv + d] = o;
        }
    };
    if (n <= 0) {  // uniform over the block, before any barrier
        if (direct) return;  // another split of the row holds its keys and writes its output
        for (int d = tid; d < Dv; d += ATT_THREADS) Op[part * Dv + d] = 0.0f;
        if (tid == 0) {
            ML[part * 2] = neg_inf();
            ML[part * 2 + 1] = 0.0f;
        }
        return;
    }
    // f16 K read a thread a key in 16-byte loads (below): this thread's first key's first loads are issued
    // before q is staged, so that their wait on memory overlaps q's (and the barrier's)
    const u8* kbase = Kc + (i64)g * k_sh_b;
    const bool kfast = KT == 0 && Dk % 8 == 0 && aligned16(Kc, k_sp_b | k_sh_b);  // (every head of the block alike)
    uint4 kb[ATT_K_LOADS];  // the loads of a key's row (ATT_K_LOADS at a time)
    if (kfast && tid < n)
#pragma unroll
        for (int u = 0; u < ATT_K_LOADS; u++)
            if (u < Dk / 8) kb[u] = ld_u128(kbase + (i64)(a + tid) * k_sp_b + 16 * u);
    const float* qr = Q + (i64)t * q_st + (i64)h * Dk;
    for (int d = tid; d < Dk; d += ATT_THREADS) {
        const float v = n_rot ? rope_elem(qr, d, p, rcs, n_rot, neox) : qr[d];
        qs[d] = q_round == 1 ? h2f(f2h(v)) : v;
    }
    __syncthreads();
    if (q_round == 2) {
        for (int b = warp; b < Dk / 32; b += nw) {
            const float v = qs[b * 32 + lane];
            const float amax = warp_max(fabsf(v));  // the rounding of kv_append_q8_0
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            qs[b * 32 + lane] = rintf(v * id) * h2f(f2h(amax / 127.0f));
        }
        __syncthreads();
    }
    if (kfast) {
        // scores, f16 K: a thread a key, its row in 16-byte loads (all in flight at once), q from shared
        // memory, d in order (a warp per key, summing 2-byte loads, waited on memory once a key)
        for (int j = tid; j < n; j += ATT_THREADS) {
            const u8* kr = kbase + (i64)(a + j) * k_sp_b;
            float acc = 0.0f;
            for (int d0 = 0; d0 < Dk; d0 += 8 * ATT_K_LOADS) {  // the loads issued, then their products in d order
                const int m = imin(ATT_K_LOADS, (Dk - d0) / 8);
                if (j != tid || d0 != 0)  // (the first were loaded before q)
#pragma unroll
                    for (int u = 0; u < ATT_K_LOADS; u++)
                        if (u < m) kb[u] = ld_u128(kr + 2 * (d0 + 8 * u));
#pragma unroll
                for (int u = 0; u < ATT_K_LOADS; u++)
                    if (u < m) {
                        float kv[8];
                        halves8(kb[u], kv);
#pragma unroll
                        for (int i = 0; i < 8; i++) acc = sh_fma(qs[d0 + 8 * u + i], kv[i], acc);
                    }
            }
            if (softcap > 0.0f) acc = softcap * tanhf(acc / softcap);
            sc[j] = acc * scale;
        }
    } else {
        // scores: one warp per key
        for (int j = warp; j < n; j += nw) {
            const u8* kr = kbase + (i64)(a + j) * k_sp_b;
            float acc = 0.0f;
            for (int d = lane; d < Dk; d += 32) acc = sh_fma(qs[d], kv_elem<KT>(kr, d), acc);
            acc = warp_sum(acc);
            if (lane == 0) {
                if (softcap > 0.0f) acc = softcap * tanhf(acc / softcap);
                sc[j] = acc * scale;
            }
        }
    }
    // f16 V read in 16-byte loads (below): this thread's first keys' loads are issued before the softmax,
    // so that their wait on memory overlaps its barriers
    const u8* vbase = Vc + (i64)g * v_sh_b;
    const bool vfast = VT == 0 && Dv % 8 == 0 && Dv <= 8 * ATT_THREADS && aligned16(Vc, v_sp_b | v_sh_b);
    // (groups of Dv/8 threads, a thread 8 dimensions from vd0; group gi of ng8 starts at key gi)
    const int vper = vfast ? Dv / 8 : 1, ng8 = ATT_THREADS / vper, gi = tid / vper, vd0 = 8 * (tid % vper);
    uint4 vb[ATT_V_LOADS];  // the loads of ATT_V_LOADS keys' rows
    if (vfast && gi < ng8)
#pragma unroll
        for (int u = 0; u < ATT_V_LOADS; u++)
            if (gi + u * ng8 < n) vb[u] = ld_u128(vbase + (i64)(a + gi + u * ng8) * v_sp_b + 2 * vd0);
    __syncthreads();
    float mx = neg_inf();
    for (int j = tid; j < n; j += ATT_THREADS) mx = fmaxf(mx, sc[j]);
    mx = block_max(mx, red, ATT_THREADS);  // (the head's group; block_sum's order for ATT_THREADS)
    float sum = 0.0f;
    for (int j = tid; j < n; j += ATT_THREADS) {
        const float e = expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red, ATT_THREADS);  // barrier: sc[] complete
    if (p_round) {
        const float inv = 1.0f / sum;
        for (int j = tid; j < n; j += ATT_THREADS) sc[j] = h2f(f2h(sc[j] * inv));
        sum = 1.0f;
        __syncthreads();
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // the combine's 1 / L (direct)
    // out = P V: thread group gi (of ng) sums keys gi, gi+ng, ... for dimension d
    const int ng = imax(1, ATT_THREADS / Dv);
    if (vfast) {
        // f16 V: a thread 8 dimensions (one 16-byte load a key); groups of Dv/8 threads take every ng8-th
        // key, then their sums are added up in group order
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] = 0.0f;
        if (gi < ng8)
            for (int j0 = gi; j0 < n; j0 += ATT_V_LOADS * ng8) {  // the keys' loads issued, then their sums in key order
                if (j0 != gi)  // (the first were loaded before the softmax)
#pragma unroll
                    for (int u = 0; u < ATT_V_LOADS; u++)
                        if (j0 + u * ng8 < n) vb[u] = ld_u128(vbase + (i64)(a + j0 + u * ng8) * v_sp_b + 2 * vd0);
#pragma unroll
                for (int u = 0; u < ATT_V_LOADS; u++)
                    if (j0 + u * ng8 < n) {
                        float vv[8];
                        halves8(vb[u], vv);
                        const float pj = sc[j0 + u * ng8];
#pragma unroll
                        for (int i = 0; i < 8; i++) acc[i] = sh_fma(pj, vv[i], acc[i]);
                    }
            }
        if (gi < ng8)
#pragma unroll
            for (int i = 0; i < 8; i++) red2[gi * Dv + vd0 + i] = acc[i];
        __syncthreads();
        for (int d = tid; d < Dv; d += ATT_THREADS) {
            float o = 0.0f;
            for (int k = 0; k < ng8; k++) o += red2[k * Dv + d];
            emit(d, o, inv);
        }
    } else if (ng == 1) {
        for (int d = tid; d < Dv; d += ATT_THREADS) {
            float acc = 0.0f;
            for (int j = 0; j < n; j++) acc = sh_fma(sc[j], kv_elem<VT>(vbase + (i64)(a + j) * v_sp_b, d), acc);
            emit(d, acc, inv);
        }
    } else {
        const int gd = tid / Dv, d = tid % Dv;
        float acc = 0.0f;
        if (gd < ng)
            for (int j = gd; j < n; j += ng) acc = sh_fma(sc[j], kv_elem<VT>(vbase + (i64)(a + j) * v_sp_b, d), acc);
        red2[tid] = acc;
        __syncthreads();
        if (tid < Dv) {
            float o = 0.0f;
            for (int k = 0; k < ng; k++) o += red2[k * Dv + tid];
            emit(tid, o, inv);
        }
    }
    if (tid == 0 && !direct) {
        ML[part * 2] = mx;
        ML[part * 2 + 1] = sum;
    }
    if (direct && rmode == 4) {  // the block's hpb heads, whole Q8_K blocks, rounded a warp a block
        __syncthreads();
        const int e0 = blockIdx.x * hpb * Dv;
        for (int b = threadIdx.x >> 5; b < hpb * Dv / 256; b += blockDim.x >> 5)
            round_q8_block(stage + b * 256, O + (i64)t * o_st + e0 + b * 256, 8, 0,
                           q8_st ? q8 + (i64)t * q8_st : nullptr, H * Dv, e0 + b * 256);
    }
}

#define ATTN_ARGS                                                                                          \
    const float *__restrict__ Q, i64 q_st, const u8 *__restrict__ Kc, i64 k_sp_b, i64 k_sh_b,             \
        const u8 *__restrict__ Vc, i64 v_sp_b, i64 v_sh_b, const int *__restrict__ qpos, int n_kv, int H,  \
        int Hkv, int Dk, int Dv, float scale, float softcap, int window, int chunk, int q_round,          \
        int p_round, float *Op, float *ML, const float *__restrict__ rcs, int n_rot, int neox, int *cnt,     \
        float *__restrict__ O, i64 o_st, int rmode, u8 *q8, i64 q8_st
#define ATTN_PASS Q, q_st, Kc, k_sp_b, k_sh_b, Vc, v_sp_b, v_sh_b, qpos, n_kv, H, Hkv, Dk, Dv, scale, softcap, \
                  window, chunk, q_round, p_round, Op, ML, rcs, n_rot, neox, O, o_st, rmode, q8, q8_st

// Before KERNEL_BEGIN: the split's K and V rows (of its kv head) asked of the L2 while the kernels before
// run. Earlier passes wrote them; kv_append may still be writing the newest row, which is harmless for a
// prefetch (the L2 is where writes land; nothing is read into the SM). qpos is the pass's input, which
// the kernel before does not write (attention() may convert it with a CuPy kernel just before; read
// before the wait it may then be stale, which is harmless too: for any value attn_keys keeps the rows
// in [0, n_kv), so every address is inside the cache, and the results read qpos after the wait).
SH_D void attn_prefetch(const u8* Kc, i64 k_sp_b, i64 k_sh_b, int Dk, int kt, const u8* Vc, i64 v_sp_b,
                        i64 v_sh_b, int Dv, int vt, const int* qpos, int n_kv, int H, int Hkv, int window,
                        int chunk) {
    const int g = attn_head() / (H / Hkv);  // (the kv head of this thread's group's head)
    int lo, hi;
    attn_keys(qpos[blockIdx.y], n_kv, window, lo, hi);
    const int a = lo + blockIdx.z * chunk, n = imin(a + chunk, hi + 1) - a;
    const int kb = kt ? Dk / 32 * 34 : 2 * Dk, vb = vt ? Dv / 32 * 34 : 2 * Dv;  // bytes of a row
    const int kl = (kb + 127) / 128, vl = (vb + 127) / 128;                      // 128-byte lines a row
    for (int i = threadIdx.x % ATT_THREADS; i < n * (kl + vl); i += ATT_THREADS) {
        const int j = i / (kl + vl), l = i % (kl + vl);
        prefetch_line(l < kl ? Kc + (i64)(a + j) * k_sp_b + (i64)g * k_sh_b + 128 * l
                             : Vc + (i64)(a + j) * v_sp_b + (i64)g * v_sh_b + 128 * (l - kl));
    }
}

#define ATTN_KERNEL(name, KT, VT)                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_MAX_HPB * ATT_THREADS, 1) name(ATTN_ARGS) { \
        attn_prefetch(Kc, k_sp_b, k_sh_b, Dk, KT, Vc, v_sp_b, v_sh_b, Dv, VT, qpos, n_kv, H, Hkv, window, chunk); \
        KERNEL_BEGIN();                                                                \
        const bool direct = attn_direct(rmode, Dv, qpos, n_kv, window, chunk);          \
        attn_split<KT, VT>(ATTN_PASS, direct);                                         \
        if (rmode >= 0 && !direct) {                                                   \
            extern __shared__ float att_smem[];                                        \
            attn_finish(Op, ML, gridDim.z, H, Dv, O, o_st, rmode, cnt, att_smem, Dk + chunk, \
                        qpos, n_kv, window, chunk, q8, q8_st);                         \
        }                                                                              \
    }
ATTN_KERNEL(attn_partial_f16_f16, 0, 0)
ATTN_KERNEL(attn_partial_f16_q8_0, 0, 1)
ATTN_KERNEL(attn_partial_q8_0_f16, 1, 0)
ATTN_KERNEL(attn_partial_q8_0_q8_0, 1, 1)

extern "C" __global__ void attn_combine(const float* __restrict__ Op, const float* __restrict__ ML, int S, int H,
                                        int Dv, float* __restrict__ O, i64 o_st, const int* __restrict__ qpos,
                                        int n_kv, int window, int chunk) {
    KERNEL_BEGIN();
    const int h = blockIdx.x, t = blockIdx.y;
    const i64 part0 = ((i64)t * H + h) * S;
    const int ns = attn_nsplits(qpos, t, n_kv, window, chunk, S);
    float M, inv;
    attn_norm(ML, part0, ns, M, inv);
    for (int d = threadIdx.x; d < Dv; d += blockDim.x)
        O[(i64)t * o_st + (i64)h * Dv + d] = attn_out(Op, ML, part0, ns, Dv, d, M, inv);
}

// attn_combine's output rounded as the next matmul's input (rms_norm's rmode 1..4): one warp per
// block of `block` values of a row (32, or 256 for Q8_K: such a block spans heads), T*(H*Dv/block)*32
// threads, H*Dv % block == 0; the values are attn_combine's bit for bit before the rounding
extern "C" __global__ void attn_combine_r(const float* __restrict__ Op, const float* __restrict__ ML, int S, int H,
                                          int Dv, float* __restrict__ O, i64 o_st, int T, int rmode,
                                          const int* __restrict__ qpos, int n_kv, int window, int chunk, u8* q,
                                          i64 q_st) {
    KERNEL_BEGIN();
    const int block = rmode == 4 ? 256 : 32, nb = H * Dv / block;
    const i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (gw >= (i64)T * nb) return;  // uniform over the warp
    const int t = (int)(gw / nb);
    attn_combine_block(Op, ML, S, attn_nsplits(qpos, t, n_kv, window, chunk, S), H, Dv, O, o_st, t,
                       (int)(gw % nb) * block, rmode, q, q_st);
}
