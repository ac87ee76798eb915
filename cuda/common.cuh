// sharpi CUDA kernels: shared definitions.
//
// Every .cu in this directory is self-contained apart from `#include "*.cuh"` lines naming files in
// this directory; sharpi_core/backends/cuda.py pastes those in before handing the source to NVRTC
// (so CuPy's compile cache keys on the full text), and nvcc finds them next to the .cu.
//
// The same sources also compile as plain C++ against tests/simt/simt.hpp (included first), which runs
// whole kernels on the CPU, every GPU thread a fiber, so that they are tested without a GPU.
// No system headers are included: NVRTC has none.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SH_HD __host__ __device__ __forceinline__
#define SH_D __device__ __forceinline__
#define SH_CHECK_ALIGNED(p, a) ((void)0)
#elif defined(SHARPI_SIMT_EMU)  // tests/simt: the host compiler, threadIdx & co. from the emulator
#define SH_HD inline
#define SH_D inline
// a misaligned vector access faults on a GPU ("misaligned address"); x86 would not notice
#define SH_CHECK_ALIGNED(p, a) ::simt::check_aligned((const void*)(p), (a))
struct alignas(16) float4 { float x, y, z, w; };  // the CUDA vector types, with their alignment
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
#else
#error "common.cuh: compile with nvcc / NVRTC, or with tests/simt/simt.hpp included first"
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

SH_HD float sh_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}

SH_HD int imin(int a, int b) { return a < b ? a : b; }
SH_HD int imax(int a, int b) { return a > b ? a : b; }

// ---- programmatic dependent launch (sm_90+) ------------------------------------------------------
// sharpi_core/backends/cuda.py may launch a kernel with CUDA's programmatic stream serialization
// attribute: it can then start while the kernel before it in the stream is still running, and
// griddepcontrol.wait is what waits for that kernel to finish (its writes visible). So every kernel
// begins with KERNEL_BEGIN(): the wait, then the signal that lets the next kernel start early (its
// blocks become resident and wait in their own KERNEL_BEGIN, so its launch latency hides behind this
// kernel's work). Nothing may touch memory another kernel writes before the wait. Without the
// attribute (or before sm_90, or in the emulator, where launches run one after another) both are no-ops.
SH_D void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
SH_D void grid_dep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define KERNEL_BEGIN()                  \
    do {                                \
        grid_dep_wait();                \
        grid_dep_launch_dependents();   \
    } while (0)

// the 128-byte line holding p into the L2 (a hint, no data dependence)
SH_D void prefetch_line(const void* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#elif defined(SHARPI_SIMT_EMU)
    ::simt::check_prefetch(p);  // (the emulator: inside a live allocation)
#else
    (void)p;
#endif
}
// Ask the L2 for bytes [p, p + n): what a kernel may do before KERNEL_BEGIN with memory no kernel
// writes (weights), so their DRAM latency overlaps the previous kernel's tail.
SH_D void prefetch_l2(const void* p, i64 n) {
    for (i64 off = (i64)threadIdx.x * 128; off < n; off += (i64)blockDim.x * 128) prefetch_line((const char*)p + off);
}
// Ask the L2 for the n byte ranges of `ranges` (pairs: address, bytes), line by line in their order, worker
// `w` of `workers` taking lines w, w + workers, ...: weights that kernels later in the pass read (memory no
// kernel writes), fetched while kernels that wait on latency rather than on DRAM run (before KERNEL_BEGIN).
SH_D void prefetch_ranges(const i64* __restrict__ ranges, int n, i64 w, i64 workers) {
    i64 line = w;  // this worker's next line, counted from the start of range r
    for (int r = 0; r < n; r++) {
        const char* p = (const char*)ranges[2 * r];
        const i64 lines = (ranges[2 * r + 1] + 127) / 128;
        for (; line < lines; line += workers) prefetch_line(p + line * 128);
        line -= lines;
    }
}

// ---- loads (read-only path on the device) ------------------------------------------------------
template <class T>
SH_HD T ldg(const T* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(p);
#else
    SH_CHECK_ALIGNED(p, alignof(T));
    return *p;
#endif
}

// a load through the L2 only (no L1): for data that other blocks of the same launch wrote
SH_HD float ld_cg(const float* p) {
#if defined(__CUDA_ARCH__)
    return __ldcg(p);
#else
    return *p;
#endif
}

template <class T>
SH_HD void st(T* p, T v) {  // a store of T, at T's alignment
    SH_CHECK_ALIGNED(p, alignof(T));
    *p = v;
}

SH_HD u16 ld_u16(const u8* p) { return ldg((const u16*)p); }  // p 2-byte aligned
// 32 bits from a 2-byte aligned address (blocks of 18, 22, 34 and 210 bytes are only 2-aligned)
SH_HD u32 ld_u32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)ldg(q) | ((u32)ldg(q + 1) << 16);
}
SH_HD u32 ld_u32(const u8* p) { return ldg((const u32*)p); }       // p 4-byte aligned
SH_HD uint2 ld_u64(const u8* p) { return ldg((const uint2*)p); }   // p 8-byte aligned
SH_HD uint4 ld_u128(const u8* p) { return ldg((const uint4*)p); }  // p 16-byte aligned
SH_HD float4 ld_f4(const float* p) { return ldg((const float4*)p); }  // p 16-byte aligned

// ---- 8-bit integer dot products -----------------------------------------------------------------
// c + the dot product of the four signed bytes of a and of b (one DP4A instruction on sm_61 and later). The
// instruction itself, as the __dp4a intrinsic's header writes it: NVRTC 12.1 declares __dp4a but leaves it
// undefined under -arch=sm_80 / sm_90 (ptxas: "Unresolved extern function '_Z6__dp4aiii'").
SH_HD int dp4a(u32 a, u32 b, int c) {
#if defined(__CUDA_ARCH__)
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    for (int i = 0; i < 4; i++) c += (int)(i8)(u8)(a >> (8 * i)) * (int)(i8)(u8)(b >> (8 * i));
    return c;
#endif
}
// each byte of v (0..127) minus o (0..128) as signed bytes, with no borrow between bytes: the byte's
// top bit set first keeps it >= o, and flipping it back gives v - o mod 256 (3 operations a word)
SH_HD u32 bytes_sub(u32 v, u32 o4) { return ((v | 0x80808080u) - o4) ^ 0x80808080u; }

// ---- float conversions ---------------------------------------------------------------------------
SH_HD float bits_f32(u32 u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
#endif
}

SH_HD u32 f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    u32 u;
    __builtin_memcpy(&u, &f, 4);
    return u;
#endif
}

// IEEE half (as stored in GGUF) -> float, exact.
SH_HD float h2f(u16 h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 s = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0) {
        if (m == 0) {
            u = s;
        } else {  // subnormal: normalise
            u32 k = 0;
            while (!(m & 0x400u)) { m <<= 1; k++; }
            u = s | ((113u - k) << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        u = s | 0x7f800000u | (m << 13);
    } else {
        u = s | ((e + 112u) << 23) | (m << 13);
    }
    return bits_f32(u);
#endif
}

SH_HD float bf2f(u16 h) { return bits_f32((u32)h << 16); }

// float -> IEEE half, round to nearest even (what numpy's astype(float16) and ggml do).
SH_HD u16 f2h(float f) {
#if defined(__CUDA_ARCH__)
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 x = f32_bits(f);
    const u32 s = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return (u16)(s | 0x7e00u);  // nan
    if (x >= 0x47800000u) return (u16)(s | 0x7c00u);  // >= 65536 (or inf): inf
    if (x < 0x38800000u) {  // below 2^-14: a multiple of 2^-24 (subnormal) or zero
        if (x < 0x33000000u) return (u16)s;  // <= 2^-25 rounds to zero (2^-25 is a tie to even 0)
        const u32 m = (x & 0x7fffffu) | 0x800000u, shift = 126u - (x >> 23);
        u32 r = m >> shift;
        const u32 rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (u16)(s | r);
    }
    u32 r = (x - 0x38000000u) >> 13;  // exponent rebiased 127 -> 15; a carry may reach inf
    const u32 rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (u16)(s | r);
#endif
}

SH_D float neg_inf() { return bits_f32(0xff800000u); }

// ---- warp / block reductions (blockDim.x a multiple of 32, at most 1024) -------------------------
SH_D float warp_sum(float v) {
#ifdef SHARPI_SIMT_WARP_REDUCE  // the CPU emulator's shortcut: these five exchanges in one (tests/simt/simt.hpp)
    return ::simt::warp_butterfly(v, [](float a, float b) { return a + b; });
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
#endif
}

SH_D float warp_max(float v) {
#ifdef SHARPI_SIMT_WARP_REDUCE
    return ::simt::warp_butterfly(v, [](float a, float b) { return fmaxf(a, b); });
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

// Every thread of the block must call these; `red` is __shared__ float[32]. All threads get the result.
// nt: the threads reduced together (a multiple of 32 dividing the block; each group of nt threads gets its
// own result, `red` its own: attention's blocks of several heads)
SH_D float block_sum(float v, float* red, int nt = blockDim.x) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x % nt) >> 5, nw = nt >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = 0.0f;
    for (int i = 0; i < nw; i++) r += red[i];
    __syncthreads();  // red may be reused right after
    return r;
}

SH_D float block_max(float v, float* red, int nt = blockDim.x) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x % nt) >> 5, nw = nt >> 5;
    v = warp_max(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < nw; i++) r = fmaxf(r, red[i]);
    __syncthreads();
    return r;
}
