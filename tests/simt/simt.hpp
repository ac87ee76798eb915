// A SIMT emulator for sharpi's CUDA kernels: cuda/*.cu compiled by the host C++ compiler and run on
// the CPU, every GPU thread a fiber, so that the kernels themselves (not a re-statement of them) are
// tested on machines without a GPU. tests/simt/cupy drives it: CuPy's API over numpy arrays, whose
// RawModule builds the kernel source with this header included first.
//
// What it models:
//   * threadIdx / blockIdx / blockDim / gridDim; blocks run one after another, the threads of a
//     block interleave at every __syncthreads and warp shuffle (cooperative fibers on one OS thread):
//     a warp runs until all its threads wait at a barrier, then the next, in increasing or
//     (SHARPI_SIMT_ORDER=reverse) decreasing thread order; the blocks too run in increasing or
//     decreasing order (blockIdx.x fastest, then y, z), so a block that reads what a later block of the
//     same launch writes, or a "last block" that is not counted as such, gives different results in one
//     of the two orders (a GPU runs them in any order, side by side);
//   * __syncthreads: every thread of the block must reach it; a barrier reached after some threads
//     returned is reported as an error (on a GPU: a hang or undefined behaviour); threads at
//     different __syncthreads calls release each other, as on a GPU (barrier 0);
//   * __shfl_sync / __shfl_xor_sync with the full mask: all 32 lanes must take part (a lane that
//     returned, or a warp cut short by blockDim, is an error);
//   * __shared__ memory: allocated per block, filled with 0xff bytes (NaN as floats) when the block
//     starts, so a read before any write shows; dynamic shared memory is exactly the launch's size;
//     each array has guard zones on both sides, checked after every block;
//   * launch limits: at most 1024 threads and the kernel's __launch_bounds__, grid.y/z <= 65535,
//     dynamic shared memory above 48 KiB only when the kernel's max_dynamic_shared_size_bytes allows;
//   * kernel arguments: the caller passes a type code per argument, checked against the kernel's C
//     signature (a numpy int64 for an `int` parameter would be garbage on a GPU).
// What it does not: concurrency between blocks or streams (unsynchronised += from several threads
// never loses an update here), the GPU's memory model, its math library's last-bit results (expf,
// tanhf... are the C library's). Neither side contracts a*b+c into fused multiply-adds beyond the
// kernels' explicit ones: -ffp-contract=off here, --fmad=false in sharpi_core/backends/cuda.py.
#pragma once
#define SHARPI_SIMT_EMU 1

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <tuple>
#include <utility>

struct uint3 { unsigned int x, y, z; };
typedef uint3 dim3;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace simt {

// ---- fibers: a minimal context switch (callee-saved registers; the FP control state is shared, as
// kernels never change it) -----------------------------------------------------------------------
extern "C" void simt_switch(void** save_sp, void* load_sp);
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .globl simt_switch
    .hidden simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");
#elif defined(__aarch64__)
asm(R"(
    .text
    .p2align 4
    .globl simt_switch
    .hidden simt_switch
    .type simt_switch, %function
simt_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size simt_switch, .-simt_switch
)");
#else
#error "simt.hpp: fibers are written for x86-64 and aarch64"
#endif

enum State { RUNNABLE, AT_BARRIER, AT_SHUFFLE, DONE };

struct Fiber {
    void* sp;
    State state;
    uint3 tid;
    int linear;      // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
    unsigned shuf;   // warp operations done (their parity picks the exchange slots)
    int n_shared;    // static __shared__ declarations passed in this block
};

struct Warp {
    uint64_t slot[2][32];
    int arrived[2];
};

constexpr size_t STACK = 256 * 1024;     // per fiber, with a guard page below
constexpr size_t SMEM_GUARD = 256;       // bytes after dynamic shared memory, checked per block
constexpr int MAX_STATIC = 64;           // static __shared__ declarations per kernel

struct Launch {  // from the Python side
    unsigned grid[3], block[3];
    unsigned long long smem, smem_limit;  // dynamic shared memory bytes; the kernel's allowance
};

// ---- per-launch state (launches run one at a time) -----------------------------------------------
inline Fiber* g_fibers;
inline int g_nthreads;
inline Fiber* g_cur;
inline void* g_sched_sp;
inline Warp* g_warps;
inline int g_barrier_arrived;
inline int g_done;
inline uint3 g_block_idx, g_block_dim, g_grid_dim;
inline unsigned char* g_dyn_smem;          // dynamic shared memory of the block (+ guard)
inline unsigned long long g_dyn_bytes;
inline void* g_static_ptr[MAX_STATIC];      // static __shared__ of the block, in declaration order
inline size_t g_static_size[MAX_STATIC];
inline int g_n_static;
inline char g_error[512];
inline bool g_failed;
inline void (*g_entry)(void*);              // the kernel call of the current launch
inline void* g_entry_ctx;
inline char* g_stacks;                      // STACK bytes per fiber, mmap'd
inline int g_stacks_n;
// Between two synchronisation points threads run one after another, warp by warp, by increasing
// thread index, or decreasing with SHARPI_SIMT_ORDER=reverse: a kernel whose result changes with the
// order is missing a barrier (tests/test_simt.py runs the kernel tests both ways).
inline bool g_reverse;

template <class... A>
inline void fail(const char* fmt, A... a) {
    if (!g_failed) snprintf(g_error, sizeof g_error, fmt, a...);
    g_failed = true;
}

inline void yield_to_scheduler() { simt_switch(&g_cur->sp, g_sched_sp); }

// Switch to f if it can run (true: control went there and has come back, or f is the caller).
inline bool run_if_runnable(Fiber* me, Fiber* f) {
    if (f->state != RUNNABLE) return false;
    if (f != me) {
        g_cur = f;
        simt_switch(&me->sp, f->sp);
    }
    return true;
}

// Give the CPU to the next runnable thread: of the same warp first, else of the block in thread
// order; to the scheduler when there is none (all returned, a failure, or a deadlock).
inline void yield_to_next() {
    Fiber* me = g_cur;
    if (!g_failed) {
        const int n = g_nthreads;
        // a warp runs on, through its shuffles, until all of its threads wait at a barrier or have
        // returned: the most skew between warps a GPU may show (a warp overwriting what a slower
        // one has still to read shows); then the next warp, in thread order
        const int w0 = me->linear & ~31, wn = w0 + 32 <= n ? 32 : n - w0, l = me->linear - w0;
        for (int k = 1; k <= wn; k++)
            if (run_if_runnable(me, &g_fibers[w0 + (g_reverse ? (l + wn - k) % wn : (l + k) % wn)])) return;
        for (int k = 1; k <= n; k++)
            if (run_if_runnable(me, &g_fibers[g_reverse ? (me->linear + n - k) % n : (me->linear + k) % n])) return;
    }
    simt_switch(&me->sp, g_sched_sp);
}

// A failing thread never resumes: the scheduler sees g_failed and abandons the launch.
[[noreturn]] inline void abort_thread() {
    g_cur->state = DONE;
    yield_to_scheduler();
    __builtin_unreachable();
}

inline void fiber_main() {
    g_entry(g_entry_ctx);
    g_cur->state = DONE;
    g_done++;
    yield_to_next();
    __builtin_unreachable();
}

inline void* new_fiber_stack(int i) {
    // stacks grow down from the top, the guard page is at the bottom; tops staggered by a few cache
    // lines so that the threads' live frames do not all fall in the same L1 sets
    char* top = g_stacks + (size_t)(i + 1) * STACK - (size_t)(i % 61) * 320;
    void** sp = (void**)((uintptr_t)top & ~(uintptr_t)15);
#if defined(__x86_64__)
    *--sp = nullptr;                  // fiber_main's return address slot (never used)
    *--sp = (void*)&fiber_main;       // simt_switch's ret goes here
    for (int r = 0; r < 6; r++) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
#else
    sp -= 22;  // 176 bytes: x19..x30, d8..d15 (+ padding)
    memset(sp, 0, 176);
    sp[11] = (void*)&fiber_main;      // x30 (link register): ret goes there
#endif
    return (void*)sp;
}

inline bool ensure_stacks(int n) {
    if (n <= g_stacks_n) return true;
    if (g_stacks) munmap(g_stacks, (size_t)g_stacks_n * STACK);
    void* m = mmap(nullptr, (size_t)n * STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        g_stacks = nullptr;
        g_stacks_n = 0;
        return false;
    }
    g_stacks = (char*)m;
    g_stacks_n = n;
    for (int i = 0; i < n; i++) mprotect(g_stacks + (size_t)i * STACK, 4096, PROT_NONE);  // overflow -> SIGSEGV
    return true;
}

// ---- what kernels call ---------------------------------------------------------------------------
inline void syncthreads() {
    if (g_done > 0) {
        fail("__syncthreads in block (%u,%u,%u) after %d of its %d threads returned", g_block_idx.x,
             g_block_idx.y, g_block_idx.z, g_done, g_nthreads);
        abort_thread();
    }
    if (++g_barrier_arrived == g_nthreads) {  // the last one in releases the others
        g_barrier_arrived = 0;
        for (int i = 0; i < g_nthreads; i++)
            if (g_fibers[i].state == AT_BARRIER) g_fibers[i].state = RUNNABLE;
        return;
    }
    g_cur->state = AT_BARRIER;
    yield_to_next();
}

// A full warp (a lane of a warp cut short by blockDim is an error) at the exchange of parity `par`: the
// last lane to arrive runs last(), then releases the others.
inline Warp& full_warp(Fiber* f) {
    const int w = f->linear >> 5;
    if ((w + 1) * 32 > g_nthreads) {
        fail("full-mask shuffle in a warp of %d threads (blockDim %u)", g_nthreads - w * 32, g_block_dim.x);
        abort_thread();
    }
    return g_warps[w];
}

template <class F>
inline void warp_arrive(Fiber* f, Warp& W, int par, F last) {
    if (++W.arrived[par] == 32) {
        W.arrived[par] = 0;
        last();
        const int w0 = f->linear & ~31;
        for (int i = w0; i < w0 + 32; i++)
            if (g_fibers[i].state == AT_SHUFFLE && (g_fibers[i].shuf & 1) == (unsigned)par) g_fibers[i].state = RUNNABLE;
    } else {
        f->state = AT_SHUFFLE;
        yield_to_next();
    }
    f->shuf++;
}

template <class T>
inline T warp_exchange(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 64 bits");
    Fiber* f = g_cur;
    if (mask != 0xffffffffu) {
        fail("shuffle with mask %08x: the emulator supports full warps only", mask);
        abort_thread();
    }
    Warp& W = full_warp(f);
    const int par = f->shuf & 1;
    memcpy(&W.slot[par][f->linear & 31], &v, sizeof(T));
    warp_arrive(f, W, par, [] {});
    T r;
    memcpy(&r, &W.slot[par][src & 31], sizeof(T));
    return r;
}

// The five xor-shuffle steps of a warp reduction (offsets 16, 8, 4, 2, 1; v = op(v, partner's v)) in one
// rendezvous instead of five: the last lane to arrive computes every lane's result with the same
// operations in the same order, so each lane gets the bits the five exchanges give it. cuda/common.cuh's
// warp_sum / warp_max use it when built with SHARPI_SIMT_WARP_REDUCE (tests/test_simt.py: for the
// model-level tests, where those exchanges are most of the emulator's time; the kernel tests run the
// shuffles themselves, and a test checks the two agree bit for bit).
template <class T, class Op>
inline T warp_butterfly(T v, Op op) {
    static_assert(sizeof(T) <= 8, "at most 64 bits a lane");
    Fiber* f = g_cur;
    Warp& W = full_warp(f);
    const int par = f->shuf & 1, lane = f->linear & 31;
    memcpy(&W.slot[par][lane], &v, sizeof(T));
    warp_arrive(f, W, par, [&] {
        T cur[32], nxt[32];
        for (int i = 0; i < 32; i++) memcpy(&cur[i], &W.slot[par][i], sizeof(T));
        for (int o = 16; o > 0; o >>= 1) {
            for (int i = 0; i < 32; i++) nxt[i] = op(cur[i], cur[i ^ o]);
            memcpy(cur, nxt, sizeof cur);
        }
        for (int i = 0; i < 32; i++) memcpy(&W.slot[par][i], &cur[i], sizeof(T));
    });
    T r;
    memcpy(&r, &W.slot[par][lane], sizeof(T));
    return r;
}

inline void* static_shared(size_t bytes) {
    Fiber* f = g_cur;
    const int k = f->n_shared++;
    if (k >= MAX_STATIC) {
        fail("more than %d static __shared__ declarations", MAX_STATIC);
        abort_thread();
    }
    if (k == g_n_static) {  // the first thread to get here allocates it for the block
        unsigned char* raw = (unsigned char*)aligned_alloc(16, (2 * SMEM_GUARD + bytes + 15) & ~(size_t)15);
        memset(raw, 0xff, 2 * SMEM_GUARD + bytes);
        void* p = raw + SMEM_GUARD;
        g_static_ptr[k] = p;
        g_static_size[k] = bytes;
        g_n_static++;
    } else if (g_static_size[k] != bytes) {
        fail("threads of a block disagree on __shared__ declaration %d (%zu vs %zu bytes)", k, bytes,
             g_static_size[k]);
        abort_thread();
    }
    return g_static_ptr[k];
}

inline void* dynamic_shared() { return g_dyn_smem; }

inline void check_aligned(const void* p, size_t a) {
    if ((uintptr_t)p % a) {
        fail("misaligned address: a %zu-byte access at %p (thread %d of block (%u,%u,%u))", a, p,
             g_cur->linear, g_block_idx.x, g_block_idx.y, g_block_idx.z);
        abort_thread();
    }
}

// The live device allocations, [base, end) pairs sorted by base (tests/simt/cupy sets them before a launch
// whenever they changed): an L2 prefetch (prefetch.global.L2) of an address outside them is reported, as
// a GPU might fault on it; without a table nothing is checked.
inline const unsigned long long* g_mem;
inline int g_mem_n;
inline unsigned long long* g_pf_log;  // (tests) where the addresses prefetched go, up to g_pf_cap of them
inline int g_pf_cap, g_pf_n;
inline void check_prefetch(const void* p) {
    const unsigned long long a = (unsigned long long)(uintptr_t)p;
    if (g_pf_log && g_pf_n < g_pf_cap) g_pf_log[g_pf_n++] = a;
    if (!g_mem) return;
    int lo = 0, hi = g_mem_n;  // the first range whose base is above a
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (g_mem[2 * mid] <= a) lo = mid + 1; else hi = mid;
    }
    if (lo == 0 || a >= g_mem[2 * (lo - 1) + 1]) {
        fail("prefetch of %p, outside every live allocation (thread %d of block (%u,%u,%u))", p, g_cur->linear,
             g_block_idx.x, g_block_idx.y, g_block_idx.z);
        abort_thread();
    }
}

// ---- launching -------------------------------------------------------------------------------------
// The SMEM_GUARD bytes before and after a shared allocation still hold their 0xff.
inline bool guards_intact(const unsigned char* p, size_t bytes) {
    for (size_t i = 0; i < SMEM_GUARD; i++)
        if (p[-1 - (ptrdiff_t)i] != 0xff || p[bytes + i] != 0xff) return false;
    return true;
}

// One block: every thread a fiber, run round-robin until each has returned.
inline bool run_block() {
    const int n = g_nthreads;
    for (int i = 0; i < n; i++) {
        Fiber& f = g_fibers[i];
        f.linear = i;
        f.tid = {(unsigned)i % g_block_dim.x, (unsigned)(i / g_block_dim.x) % g_block_dim.y,
                 (unsigned)(i / (g_block_dim.x * g_block_dim.y))};
        f.state = RUNNABLE;
        f.shuf = 0;
        f.n_shared = 0;
        f.sp = new_fiber_stack(i);
    }
    for (int w = 0; w < (n + 31) / 32; w++) g_warps[w].arrived[0] = g_warps[w].arrived[1] = 0;
    g_barrier_arrived = 0;
    g_done = 0;
    g_n_static = 0;
    if (g_dyn_smem) memset(g_dyn_smem - SMEM_GUARD, 0xff, g_dyn_bytes + 2 * SMEM_GUARD);
    // the threads pass control among themselves; it comes back here when none can run
    g_cur = &g_fibers[g_reverse ? n - 1 : 0];
    simt_switch(&g_sched_sp, g_cur->sp);
    bool ok = !g_failed;
    if (ok && g_done < n) {
        int at_bar = 0, at_shuf = 0;
        for (int i = 0; i < n; i++) at_bar += g_fibers[i].state == AT_BARRIER, at_shuf += g_fibers[i].state == AT_SHUFFLE;
        fail("deadlock in block (%u,%u,%u): %d threads at __syncthreads, %d at a shuffle, %d returned",
             g_block_idx.x, g_block_idx.y, g_block_idx.z, at_bar, at_shuf, g_done);
        ok = false;
    }
    for (int k = 0; k < g_n_static; k++) {
        if (ok && !guards_intact((unsigned char*)g_static_ptr[k], g_static_size[k])) {
            fail("block (%u,%u,%u) wrote outside its __shared__ array %d of %zu bytes", g_block_idx.x,
                 g_block_idx.y, g_block_idx.z, k, g_static_size[k]);
            ok = false;
        }
        free((unsigned char*)g_static_ptr[k] - SMEM_GUARD);
    }
    if (ok && g_dyn_smem && !guards_intact(g_dyn_smem, g_dyn_bytes)) {
        fail("block (%u,%u,%u) wrote outside its %llu bytes of dynamic shared memory", g_block_idx.x,
             g_block_idx.y, g_block_idx.z, g_dyn_bytes);
        ok = false;
    }
    return ok;
}

inline int run(const Launch* L, int max_threads) {
    const char* order = getenv("SHARPI_SIMT_ORDER");
    g_reverse = order && strcmp(order, "reverse") == 0;
    g_failed = false;
    g_error[0] = 0;
    const unsigned long long nt = (unsigned long long)L->block[0] * L->block[1] * L->block[2];
    if (nt == 0 || L->grid[0] == 0 || L->grid[1] == 0 || L->grid[2] == 0) {
        fail("empty launch: grid (%u,%u,%u) block (%u,%u,%u)", L->grid[0], L->grid[1], L->grid[2],
             L->block[0], L->block[1], L->block[2]);
        return 1;
    }
    if (nt > 1024 || L->block[2] > 64) {
        fail("block (%u,%u,%u): more than a GPU block can hold", L->block[0], L->block[1], L->block[2]);
        return 1;
    }
    if (max_threads > 0 && nt > (unsigned long long)max_threads) {
        fail("block of %llu threads for a kernel declared __launch_bounds__(%d)", nt, max_threads);
        return 1;
    }
    if (L->grid[0] > 0x7fffffffu || L->grid[1] > 65535 || L->grid[2] > 65535) {
        fail("grid (%u,%u,%u) beyond CUDA's limits", L->grid[0], L->grid[1], L->grid[2]);
        return 1;
    }
    if (L->smem > 48 * 1024 && L->smem > L->smem_limit) {
        fail("%llu bytes of dynamic shared memory without max_dynamic_shared_size_bytes >= that (%llu)",
             L->smem, L->smem_limit);
        return 1;
    }
    if (!ensure_stacks((int)nt)) {
        fail("cannot map fiber stacks");
        return 1;
    }
    g_nthreads = (int)nt;
    g_block_dim = {L->block[0], L->block[1], L->block[2]};
    g_grid_dim = {L->grid[0], L->grid[1], L->grid[2]};
    Fiber fibers[1024];
    Warp warps[32];
    g_fibers = fibers;
    g_warps = warps;
    g_dyn_bytes = L->smem;
    unsigned char* dyn_raw =
        L->smem ? (unsigned char*)aligned_alloc(16, ((L->smem + 2 * SMEM_GUARD) + 15) & ~15ull) : nullptr;
    g_dyn_smem = dyn_raw ? dyn_raw + SMEM_GUARD : nullptr;
    bool ok = true;
    const unsigned long long nb = (unsigned long long)L->grid[0] * L->grid[1] * L->grid[2];
    for (unsigned long long i = 0; i < nb && ok; i++) {
        const unsigned long long b = g_reverse ? nb - 1 - i : i;
        g_block_idx = {(unsigned)(b % L->grid[0]), (unsigned)(b / L->grid[0] % L->grid[1]),
                       (unsigned)(b / ((unsigned long long)L->grid[0] * L->grid[1]))};
        ok = run_block();
    }
    free(dyn_raw);
    g_dyn_smem = nullptr;
    return ok ? 0 : 1;
}

// ---- argument marshalling --------------------------------------------------------------------------
// Codes: i int32, I uint32, l int64, L uint64, f float32, d float64, b bool/char,
//        F float*, N int*, P any other pointer (bytes)
template <class T> struct Code;
template <> struct Code<int> { static constexpr char c = 'i'; };
template <> struct Code<unsigned> { static constexpr char c = 'I'; };
template <> struct Code<long long> { static constexpr char c = 'l'; };
template <> struct Code<unsigned long long> { static constexpr char c = 'L'; };
template <> struct Code<long> { static constexpr char c = 'l'; };
template <> struct Code<unsigned long> { static constexpr char c = 'L'; };
template <> struct Code<float> { static constexpr char c = 'f'; };
template <> struct Code<double> { static constexpr char c = 'd'; };
template <class T> struct Code<T*> { static constexpr char c = 'P'; };
template <> struct Code<float*> { static constexpr char c = 'F'; };
template <> struct Code<const float*> { static constexpr char c = 'F'; };
template <> struct Code<int*> { static constexpr char c = 'N'; };
template <> struct Code<const int*> { static constexpr char c = 'N'; };

template <class... A>
struct Signature {
    static constexpr char codes[sizeof...(A) + 1] = {Code<std::remove_cv_t<A>>::c..., 0};
};

template <class... A>
struct Call {
    void (*kernel)(A...);
    std::tuple<A...> args;
    static void entry(void* self) {
        Call* c = (Call*)self;
        std::apply(c->kernel, c->args);
    }
};

template <class... A, size_t... I>
std::tuple<A...> read_args(void* const* argv, std::index_sequence<I...>) {
    return std::tuple<A...>{*(const std::remove_cv_t<A>*)argv[I]...};
}

template <class... A>
int launch(void (*kernel)(A...), const Launch* L, void* const* argv, int max_threads) {
    Call<A...> c{kernel, read_args<A...>(argv, std::index_sequence_for<A...>{})};
    g_entry = &Call<A...>::entry;
    g_entry_ctx = &c;
    return run(L, max_threads);
}

template <class... A>
const char* signature(void (*)(A...)) { return Signature<A...>::codes; }

}  // namespace simt

#define threadIdx (::simt::g_cur->tid)
#define blockIdx (::simt::g_block_idx)
#define blockDim (::simt::g_block_dim)
#define gridDim (::simt::g_grid_dim)

inline void __syncthreads() { ::simt::syncthreads(); }
// blocks run one after another on one OS thread: an atomic is a plain read-modify-write, a fence a no-op
inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
inline void __threadfence() {}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return ::simt::warp_exchange(mask, v, (int)(::simt::g_cur->linear & 31) ^ lane_mask);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src) { return ::simt::warp_exchange(mask, v, src); }

extern "C" const char* simt_error() { return ::simt::g_error; }
extern "C" void simt_set_memory(const unsigned long long* ranges, int n) {
    ::simt::g_mem = ranges;
    ::simt::g_mem_n = n;
}
// (tests) log the addresses prefetched from now on into buf (at most cap; none with a null buf); -> how many so far
extern "C" int simt_prefetch_log(unsigned long long* buf, int cap) {
    const int n = ::simt::g_pf_n;
    ::simt::g_pf_log = buf;
    ::simt::g_pf_cap = cap;
    ::simt::g_pf_n = 0;
    return n;
}

// One exported launcher and signature per kernel; tests/simt/cupy appends a line per kernel it finds.
#define SIMT_EXPORT(k, max_threads)                                                                 \
    extern "C" int simt_launch_##k(const ::simt::Launch* L, void* const* argv) {                     \
        return ::simt::launch(&k, L, argv, max_threads);                                              \
    }                                                                                                 \
    extern "C" const char* simt_signature_##k() { return ::simt::signature(&k); }
