// Quantized matrix-vector products on raw GGUF blocks: Y[q, n] = sum_k W[n, k] * X[q, k], fp32 accumulate.
//
// Kernels (all extern "C"; <t> is f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k):
//
//   qmv_<t>_q<NQ>_r<R>(const u8* W, i64 row_bytes, int N, int K,
//                      const float* X, i64 ldx, float* Y, i64 ldy, int nq, const float* bias, int has_bias,
//                      int ws)
//       (NQ, R) in {(1,1), (1,4), (2,2), (4,2), (8,2), (8,4), (16,4)}; 1 <= nq <= NQ rows of X are used.
//       block = 128 threads (4 warps), grid.x = ceil(N / (4/ws * R)). ws (1, 2 or 4) warps share a
//       group of R rows, each taking every ws-th slice of K (more loads in flight for a matrix of few
//       long rows: one warp per row leaves a GPU mostly waiting on memory there); the group's warps
//       then add up their totals in warp order. Group g of block b computes rows (4/ws*b + g)*R .. +R
//       for all nq activation rows, reading each weight byte once. A row's arithmetic depends on ws
//       and not on NQ, R or nq: a row of a T-row product is the one-row product's bit for bit (what
//       speculative verification relies on), given the same ws.
//       W: N rows of row_bytes = K/BS*TS bytes, the allocation 16-byte aligned.
//       X: fp32, 16-byte aligned, ldx % 4 == 0; K must be a multiple of the block size
//       (32 for legacy quants, 256 for K-quants, 8 for f16/bf16, 4 for f32).
//       Y[q*ldy + n] is written for q < nq, n < N; with has_bias, the sum + bias[n] (one rounding, as a
//       separate add would give).
//
//   qmvi_<t>_q<NQ>_r<R>(const u8* W, i64 row_bytes, int N, int K,
//                       const u8* X, i64 ldx, float* Y, i64 ldy, int nq, const float* bias, int has_bias, int ws)
//       (<t> in q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k) the integer matvecs: qmv's launch, rows and
//       batch invariance, with the activations as q8 rows X + q*ldx (bytes; 16-byte aligned: int8 codes
//       [K] | float d [K/32] | s [K/32], cuda/ops.cu writes them) instead of floats: weight codes
//       times activation codes by DP4A, each (sub-)block's integer sum scaled once (quant_blocks.cuh's
//       IQ* blocks). For a weight type's 8-bit activation kind (Q8_0 / Q8_1 for the legacy types, Q8_K
//       for the K-quants) the product of the rounded activations, exact up to fp32 rounding (Q4_1 / Q5_1:
//       their min times Q8_1's f16 s where the sum of the activations would be, as ggml's vec_dot_q4_1_q8_1).
//
//   Before KERNEL_BEGIN (common.cuh) a block asks the L2 for its weight rows: the launch may come while the
//   kernel before is still running, and weights are the one input no kernel writes.
//
//   deq_rows_<t>(const u8* W, i64 row_bytes, const int* ids, int K, float* out, i64 ldo)
//       out[i*ldo + k] = dequant(W[ids[i], k]); block = 128 threads, grid.x = number of ids;
//       out 16-byte aligned, ldo % 4 == 0 (embedding lookup; also the prefill path's weight tiles).
#include "common.cuh"
#include "quant_blocks.cuh"

#define QMV_WARPS 4
// Blocks per SM to reserve registers for: the many-row variants would otherwise take up to 254
// registers (2 blocks = 8 warps per SM); 3 caps them at 168 (tiny or no spills, per ptxas -v).
// QMV_MINB_HI / QMV_MINB_MID: the same for 8..16 / 2..4 rows (-D overrides build the variants
// scripts/bench_cuda_kernels.py --defs compares).
#ifndef QMV_MINB_HI
#define QMV_MINB_HI 3
#endif
#ifndef QMV_MINB_MID
#define QMV_MINB_MID 1
#endif
#define QMV_MINB(NQ) ((NQ) >= 8 ? QMV_MINB_HI : (NQ) >= 2 ? QMV_MINB_MID : 1)

template <class B, int NQ, int R, bool INT>
__device__ __forceinline__ void qmv_kernel(const u8* __restrict__ W, i64 row_bytes, int N, int K,
                                           const void* __restrict__ X, i64 ldx, float* __restrict__ Y,
                                           i64 ldy, int nq, const float* __restrict__ bias, int has_bias,
                                           int ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = warp / ws, sub = warp % ws;
    const int row0 = (blockIdx.x * (QMV_WARPS / ws) + grp) * R;
    __shared__ float part[QMV_WARPS * R * NQ];  // the warps' totals [warp][r*NQ + q], when ws > 1
    if (ws == 1 && row0 >= N) return;  // uniform over the warp (with ws > 1 every warp meets the barrier)
    float acc[R][NQ];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int q = 0; q < NQ; q++) acc[r][q] = 0.0f;
    if (row0 < N) {
        if constexpr (INT)
            qmvi_lane<B, NQ, R>(W, row_bytes, row0, N, K, (const u8*)X, ldx, nq, 32 * sub + lane, 32 * ws, acc);
        else
            qmv_lane<B, NQ, R>(W, row_bytes, row0, N, K, (const float*)X, ldx, nq, 32 * sub + lane, 32 * ws, acc);
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int q = 0; q < NQ; q++) acc[r][q] = warp_sum(acc[r][q]);
    if (ws > 1) {  // uniform over the block
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int q = 0; q < NQ; q++)
                if (lane == ((r * NQ + q) & 31)) part[warp * R * NQ + r * NQ + q] = acc[r][q];
        __syncthreads();
        if (sub != 0 || row0 >= N) return;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int q = 0; q < NQ; q++)
                if (lane == ((r * NQ + q) & 31)) {
                    float a = part[warp * R * NQ + r * NQ + q];
                    for (int w = 1; w < ws; w++) a += part[(warp + w) * R * NQ + r * NQ + q];
                    acc[r][q] = a;
                }
    }
    // every lane holds every total now (ws == 1), or lane (r*NQ + q) & 31 holds total (r, q): the
    // stores are spread over the lanes
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int q = 0; q < NQ; q++)
            if (lane == ((r * NQ + q) & 31) && q < nq && row0 + r < N)
                Y[(i64)q * ldy + row0 + r] = has_bias ? acc[r][q] + bias[row0 + r] : acc[r][q];
}

// this block's weight rows (contiguous: `rows` per block) into the L2, before KERNEL_BEGIN
__device__ __forceinline__ void qmv_prefetch(const u8* W, i64 row_bytes, int N, int rows) {
    const int first = blockIdx.x * rows;
    if (first < N) prefetch_l2(W + (i64)first * row_bytes, (i64)imin(rows, N - first) * row_bytes);
}

template <class B>
__device__ __forceinline__ void deq_rows_kernel(const u8* __restrict__ W, i64 row_bytes, const int* __restrict__ ids,
                                                int K, float* __restrict__ out, i64 ldo) {
    const i64 row = ids[blockIdx.x];
    deq_row_thread<B>(W + row * row_bytes, K, out + (i64)blockIdx.x * ldo, threadIdx.x, blockDim.x);
}

// the matvec kernels' parameters: X of type XT (float activations, or u8 q8 rows with ldx in bytes);
// ahead: n_ahead (address, bytes) pairs, weights the pass reads after this one (prefetch_ranges)
#define QMV_ARGS(XT)                                                                                   \
    const u8 *__restrict__ W, i64 row_bytes, int N, int K, const XT *__restrict__ X, i64 ldx,         \
        float *__restrict__ Y, i64 ldy, int nq, const float *__restrict__ bias, int has_bias, int ws, \
        const i64 *__restrict__ ahead, int n_ahead

// kernel kind_<tname>_q<NQ>_r<R>: kind qmv (float activations, INT false) or qmvi (q8 rows, INT true)
#define QMV_KERNEL(kind, XT, INT, tname, B, NQ, R)                                                     \
    extern "C" __global__ void __launch_bounds__(QMV_WARPS * 32, QMV_MINB(NQ)) kind##_##tname##_q##NQ##_r##R(QMV_ARGS(XT)) { \
        qmv_prefetch(W, row_bytes, N, QMV_WARPS / ws * R);                                            \
        prefetch_ranges(ahead, n_ahead, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x); \
        KERNEL_BEGIN();                                                                                \
        qmv_kernel<B, NQ, R, INT>(W, row_bytes, N, K, X, ldx, Y, ldy, nq, bias, has_bias, ws);        \
    }
#define QMV(tname, B, NQ, R) QMV_KERNEL(qmv, float, false, tname, B, NQ, R)
#define QMVI(tname, B, NQ, R) QMV_KERNEL(qmvi, u8, true, tname, B, NQ, R)

// every (NQ, R) variant of one weight type's kernels (M = QMV or QMVI)
#define QMV_VARIANTS(M, tname, B)                                                                      \
    M(tname, B, 1, 1)                                                                                  \
    M(tname, B, 1, 4)                                                                                  \
    M(tname, B, 2, 2)                                                                                  \
    M(tname, B, 4, 2)                                                                                  \
    M(tname, B, 8, 2)                                                                                  \
    M(tname, B, 8, 4)                                                                                  \
    M(tname, B, 16, 4)

#define QMVI_TYPE(tname, B) QMV_VARIANTS(QMVI, tname, B)

#define QMV_TYPE(tname, B)                                                                             \
    QMV_VARIANTS(QMV, tname, B)                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                  \
        deq_rows_##tname(const u8* __restrict__ W, i64 row_bytes, const int* __restrict__ ids, int K,  \
                         float* __restrict__ out, i64 ldo) {                                           \
        KERNEL_BEGIN();                                                                                \
        deq_rows_kernel<B>(W, row_bytes, ids, K, out, ldo);                                            \
    }

// -DQMV_ONLY=<gguf type number> builds the kernels of one weight type only (the CuPy wrapper compiles
// one module per type a model uses: seconds instead of most of a minute for all of them).
#if !defined(QMV_ONLY)
#define QMV_WANT(id) 1
#else
#define QMV_WANT(id) (QMV_ONLY == (id))
#endif
#if QMV_WANT(0)
QMV_TYPE(f32, BF32x4)
#endif
#if QMV_WANT(1)
QMV_TYPE(f16, BF16x8)
#endif
#if QMV_WANT(30)
QMV_TYPE(bf16, BBF16x8)
#endif
#if QMV_WANT(2)
QMV_TYPE(q4_0, BQ4_0)
QMVI_TYPE(q4_0, IQ4_0)
#endif
#if QMV_WANT(3)
QMV_TYPE(q4_1, BQ4_1)
QMVI_TYPE(q4_1, IQ4_1)
#endif
#if QMV_WANT(6)
QMV_TYPE(q5_0, BQ5_0)
QMVI_TYPE(q5_0, IQ5_0)
#endif
#if QMV_WANT(7)
QMV_TYPE(q5_1, BQ5_1)
QMVI_TYPE(q5_1, IQ5_1)
#endif
#if QMV_WANT(8)
QMV_TYPE(q8_0, BQ8_0)
QMVI_TYPE(q8_0, IQ8_0)
#endif
#if QMV_WANT(20)
QMV_TYPE(iq4_nl, BIQ4_NL)
#endif
#if QMV_WANT(10)
QMV_TYPE(q2_k, BQ2_K)
#endif
#if QMV_WANT(11)
QMV_TYPE(q3_k, BQ3_K)
#endif
#if QMV_WANT(12)
QMV_TYPE(q4_k, BQ4_K)
QMVI_TYPE(q4_k, IQ4_K)
#endif
#if QMV_WANT(13)
QMV_TYPE(q5_k, BQ5_K)
QMVI_TYPE(q5_k, IQ5_K)
#endif
#if QMV_WANT(14)
QMV_TYPE(q6_k, BQ6_K)
QMVI_TYPE(q6_k, IQ6_K)
#endif
#if QMV_WANT(23)
QMV_TYPE(iq4_xs, BIQ4_XS)
#endif
