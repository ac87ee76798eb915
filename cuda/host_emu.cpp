// CPU emulation of the per-lane work of qmatvec.cu (plain C++, no CUDA needed):
//   g++ -O2 -std=c++17 -fno-strict-aliasing -shared -fPIC cuda/host_emu.cpp -o host_emu.so  (any -O level)
// tests/test_cuda_compile.py runs it against gguf.quants so that every block layout, lane mapping,
// row clamping and activation-row guard of the GPU kernels is checked on machines without a GPU.
// The warp is emulated by running the 32 lanes one after the other and adding their partial sums
// (on the GPU a shuffle reduction does the adding, in another order: results agree to fp32 rounding).
#include "quant_blocks.cuh"

namespace {

template <class B, int NQ, int R>
void emu_qmv_t(const u8* W, i64 row_bytes, int N, int K, const float* X, i64 ldx, int nq, float* Y, i64 ldy) {
    for (int row0 = 0; row0 < N; row0 += R) {
        double tot[R][NQ] = {};
        for (int lane = 0; lane < 32; lane++) {
            float acc[R][NQ] = {};
            qmv_lane<B, NQ, R>(W, row_bytes, row0, N, K, X, ldx, nq, lane, acc);
            for (int r = 0; r < R; r++)
                for (int q = 0; q < NQ; q++) tot[r][q] += acc[r][q];
        }
        for (int r = 0; r < R; r++)
            for (int q = 0; q < nq; q++)
                if (row0 + r < N) Y[(i64)q * ldy + row0 + r] = (float)tot[r][q];
    }
}

template <class B>
int emu_qmv_b(int nqt, const u8* W, i64 row_bytes, int N, int K, const float* X, i64 ldx, int nq, float* Y, i64 ldy) {
    if (K % B::BS || nq < 1 || nq > nqt) return -2;
    switch (nqt) {  // the (NQ, R) pairs qmatvec.cu instantiates
        case 1: emu_qmv_t<B, 1, 1>(W, row_bytes, N, K, X, ldx, nq, Y, ldy); return 0;
        case 2: emu_qmv_t<B, 2, 2>(W, row_bytes, N, K, X, ldx, nq, Y, ldy); return 0;
        case 4: emu_qmv_t<B, 4, 2>(W, row_bytes, N, K, X, ldx, nq, Y, ldy); return 0;
        case 8: emu_qmv_t<B, 8, 2>(W, row_bytes, N, K, X, ldx, nq, Y, ldy); return 0;
        case 16: emu_qmv_t<B, 16, 4>(W, row_bytes, N, K, X, ldx, nq, Y, ldy); return 0;
    }
    return -3;
}

template <class B>
int emu_deq_b(const u8* W, i64 row_bytes, const int* ids, int n, int K, float* out, i64 ldo) {
    if (K % B::BS) return -2;
    for (int i = 0; i < n; i++)
        for (int tid = 0; tid < 128; tid++)
            deq_row_thread<B>(W + (i64)ids[i] * row_bytes, K, out + (i64)i * ldo, tid, 128);
    return 0;
}

template <class B>
int emu_layout_b(int* e, int cap) {
    int k = 0;
    for (int t = 0; t < B::LPB; t++)
        for (int g = 0; g < B::NG; g++)
            for (int i = 0; i < 4; i++) {
                if (k >= cap) return -4;
                e[k++] = B::off(t, g) + i;
            }
    return k;
}

}  // namespace

// qtype: gguf.GGMLQuantizationType value
#define EMU_DISPATCH(CALL)                \
    switch (qtype) {                      \
        case 0: return CALL(BF32x4);      \
        case 1: return CALL(BF16x8);      \
        case 30: return CALL(BBF16x8);    \
        case 2: return CALL(BQ4_0);       \
        case 3: return CALL(BQ4_1);       \
        case 6: return CALL(BQ5_0);       \
        case 7: return CALL(BQ5_1);       \
        case 8: return CALL(BQ8_0);       \
        case 12: return CALL(BQ4_K);      \
        case 13: return CALL(BQ5_K);      \
        case 14: return CALL(BQ6_K);      \
    }                                     \
    return -1;

extern "C" int emu_qmv(int qtype, int nqt, const u8* W, i64 row_bytes, int N, int K, const float* X, i64 ldx,
                       int nq, float* Y, i64 ldy) {
#define QMV_CALL(B) emu_qmv_b<B>(nqt, W, row_bytes, N, K, X, ldx, nq, Y, ldy)
    EMU_DISPATCH(QMV_CALL)
}

extern "C" int emu_deq_rows(int qtype, const u8* W, i64 row_bytes, const int* ids, int n, int K, float* out,
                            i64 ldo) {
#define DEQ_CALL(B) emu_deq_b<B>(W, row_bytes, ids, n, K, out, ldo)
    EMU_DISPATCH(DEQ_CALL)
}

// Which element of the block lane t's group g, value i lands on (for the coverage check).
extern "C" int emu_layout(int qtype, int* elems, int cap) {
#define LAYOUT_CALL(B) emu_layout_b<B>(elems, cap)
    EMU_DISPATCH(LAYOUT_CALL)
}
