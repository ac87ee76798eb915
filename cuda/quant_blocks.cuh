// GGUF weight blocks, decoded a lane's share at a time.
//
// Layouts are those of gguf.quants (gguf-py) / ggml-common.h; offsets in bytes from the block start.
// A block of BS weights is split over LPB lanes of a warp; lane t (0 <= t < LPB) owns NG groups of
// 4 *consecutive* weights, group g starting at element off(t, g) of the block, so the matching
// activations are one aligned float4 load. For every type the LPB * NG * 4 elements cover the block
// exactly once (checked on the CPU by tests/test_simt.py: exact dequantization of every type).
//
//   load(b, t)     reads lane t's bytes of the block at b (plus the scales it needs) into registers
//   deq(g, w)      writes the 4 dequantized weights of group g into w[0..3]
//
// Row alignment: weights live in their own device allocation (256-byte aligned) and every row is
// K/BS*TS bytes, so block starts are 16-aligned for Q4_K/Q5_K (144, 176 bytes), 8-aligned for IQ4_XS
// (136), 4-aligned for Q4_1/Q5_1/Q2_K, 2-aligned otherwise; the loads below never assume more than that.
#pragma once
#include "common.cuh"

// ---- small integers to float without a conversion instruction -----------------------------------------
// I2F issues at a quarter of the FP32 rate on sm_80 / sm_90, and one a weight was most of a matvec's issue
// slots. Byte i of w put under the exponent bits of 2^23 is the float 2^23 + byte, exactly (one PRMT);
// then f - (2^23 + o) = byte - o exactly (o small), and fma(a, f, -a 2^23) = round(a * byte) (the product
// is exact inside the FMA and a 2^23 is exact): the bits of the conversion and product they replace.
#define MAGIC 8388608.0f
SH_HD float byte_magic(u32 w, int i) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (u32)i));
#else
    return bits_f32(0x4B000000u | ((w >> (8 * i)) & 0xFFu));
#endif
}
// bits 0..3 of v spread to bit 0 of bytes 0..3
SH_HD u32 spread4(u32 v) { return ((v & 0xFu) * 0x00204081u) & 0x01010101u; }

// ---- legacy 32-weight blocks: lane t owns qs bytes [4t, 4t+4): elements 4t+i (low nibbles) and
// 16+4t+i (high nibbles) ------------------------------------------------------------------------------

struct BQ4_0 {  // d f16 | qs[16]; w = d * (q - 8)
    static constexpr int BS = 32, TS = 18, LPB = 4, NG = 2;
    float d;
    u32 qs;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        qs = ld_u32_a2(b + 2 + 4 * t);
    }
    SH_HD static int off(int t, int g) { return 4 * t + 16 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 v = (qs >> (4 * g)) & 0x0F0F0F0Fu;
        for (int i = 0; i < 4; i++) w[i] = d * (byte_magic(v, i) - (MAGIC + 8.0f));
    }
};

// IQ4_NL: d f16 | qs[16] as Q4_0 (same lanes and loads), w = d * kvalues_iq4nl[q] (ggml's non-linear table)
// kvalues_iq4nl[q] (q < 16), four int8 per word: selects instead of an indexed array (local memory)
SH_HD float iq4nl_value(u32 q) {
    const u32 kv = (q & 8u) ? ((q & 4u) ? 0x71594535u : 0x26190D01u) : ((q & 4u) ? 0xF6EADDCFu : 0xBFAD9881u);
    return (float)(i8)((kv >> (8 * (q & 3u))) & 0xFFu);
}

struct BIQ4_NL : BQ4_0 {
    SH_HD void deq(int g, float* w) const {
        for (int i = 0; i < 4; i++) w[i] = d * iq4nl_value((qs >> (8 * i + 4 * g)) & 0xFu);
    }
};

struct BQ4_1 {  // d f16 | m f16 | qs[16]; w = d * q + m
    static constexpr int BS = 32, TS = 20, LPB = 4, NG = 2;
    float d, m;
    u32 qs;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        m = h2f(ld_u16(b + 2));
        qs = ld_u32_a2(b + 4 + 4 * t);
    }
    SH_HD static int off(int t, int g) { return 4 * t + 16 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 v = (qs >> (4 * g)) & 0x0F0F0F0Fu;
        const float dm = -d * MAGIC;
        for (int i = 0; i < 4; i++) w[i] = sh_fma(d, byte_magic(v, i), dm) + m;
    }
};

struct BQ5_0 {  // d f16 | qh u32 (bit j = 5th bit of element j) | qs[16]; w = d * (q - 16)
    static constexpr int BS = 32, TS = 22, LPB = 4, NG = 2;
    float d;
    u32 qs, qh;  // qh shifted so that bit i is element 4t+i and bit 16+i is element 16+4t+i
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        qh = ld_u32_a2(b + 2) >> (4 * t);
        qs = ld_u32_a2(b + 6 + 4 * t);
    }
    SH_HD static int off(int t, int g) { return 4 * t + 16 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 v = ((qs >> (4 * g)) & 0x0F0F0F0Fu) | (spread4(qh >> (16 * g)) << 4);
        for (int i = 0; i < 4; i++) w[i] = d * (byte_magic(v, i) - (MAGIC + 16.0f));
    }
};

struct BQ5_1 {  // d f16 | m f16 | qh u32 | qs[16]; w = d * q + m
    static constexpr int BS = 32, TS = 24, LPB = 4, NG = 2;
    float d, m;
    u32 qs, qh;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        m = h2f(ld_u16(b + 2));
        qh = ld_u32_a2(b + 4) >> (4 * t);
        qs = ld_u32_a2(b + 8 + 4 * t);
    }
    SH_HD static int off(int t, int g) { return 4 * t + 16 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 v = ((qs >> (4 * g)) & 0x0F0F0F0Fu) | (spread4(qh >> (16 * g)) << 4);
        const float dm = -d * MAGIC;
        for (int i = 0; i < 4; i++) w[i] = sh_fma(d, byte_magic(v, i), dm) + m;
    }
};

struct BQ8_0 {  // d f16 | qs int8[32]; lane t owns elements [8t, 8t+8)
    static constexpr int BS = 32, TS = 34, LPB = 4, NG = 2;
    float d;
    u32 q0, q1;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        q0 = ld_u32_a2(b + 2 + 8 * t);
        q1 = ld_u32_a2(b + 6 + 8 * t);
    }
    SH_HD static int off(int t, int g) { return 8 * t + 4 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 v = (g ? q1 : q0) ^ 0x80808080u;  // byte + 128: 0..255
        for (int i = 0; i < 4; i++) w[i] = d * (byte_magic(v, i) - (MAGIC + 128.0f));
    }
};

// ---- K-quants: 256-weight super-blocks --------------------------------------------------------------

// Q4_K / Q5_K 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes s
// (gguf.quants.Q4_K.get_scale_min; ggml's get_scale_min_k4), read as three 4-byte loads (s is 4-byte
// aligned: the blocks start 16-byte aligned) rather than up to eight byte loads a lane.
SH_HD u32 byte_of(u32 w, int i) { return (w >> (8 * i)) & 0xFFu; }
SH_HD void k4_scale_min(const u8* s, int j, int& sc, int& mn) {
    const u32 s0 = ld_u32(s), s1 = ld_u32(s + 4), s2 = ld_u32(s + 8);
    if (j < 4) {
        sc = (int)(byte_of(s0, j) & 63);
        mn = (int)(byte_of(s1, j) & 63);
    } else {
        sc = (int)((byte_of(s2, j - 4) & 0xF) | ((byte_of(s0, j - 4) >> 6) << 4));
        mn = (int)((byte_of(s2, j - 4) >> 4) | ((byte_of(s1, j - 4) >> 6) << 4));
    }
}

// Q4_K: d f16 | dmin f16 | scales[12] | qs[128]. Sub-block j (32 weights, elements 32j..32j+31):
// w = d*sc_j * q - dmin*m_j, q = nibble (j&1) of qs[32*(j>>1) + l]. Lane t (16 per block) owns
// qs bytes [8t, 8t+8) = 32G + l0 + [0, 8) with G = t>>2, l0 = 8*(t&3): their low nibbles are
// elements 64G + l0 + [0,8) (sub-block 2G), their high nibbles 64G + 32 + l0 + [0,8) (sub-block 2G+1).
struct BQ4_K {
    static constexpr int BS = 256, TS = 144, LPB = 16, NG = 4;
    float dsc0, dmn0, dsc1, dmn1;
    uint2 qs;
    SH_HD void load(const u8* b, int t) {
        const u32 dd = ld_u32(b);
        const float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
        const int G = t >> 2;
        int sc, mn;
        k4_scale_min(b + 4, 2 * G, sc, mn);
        dsc0 = d * (float)sc;
        dmn0 = dmin * (float)mn;
        k4_scale_min(b + 4, 2 * G + 1, sc, mn);
        dsc1 = d * (float)sc;
        dmn1 = dmin * (float)mn;
        qs = ld_u64(b + 16 + 8 * t);
    }
    // g: bit 0 = which 4 of the lane's 8 bytes, bit 1 = low/high nibble (sub-block 2G / 2G+1)
    SH_HD static int off(int t, int g) { return 64 * (t >> 2) + 32 * (g >> 1) + 8 * (t & 3) + 4 * (g & 1); }
    SH_HD void deq(int g, float* w) const {
        const u32 v = (((g & 1) ? qs.y : qs.x) >> (4 * (g >> 1))) & 0x0F0F0F0Fu;
        const float a = (g >> 1) ? dsc1 : dsc0, c = (g >> 1) ? dmn1 : dmn0;
        const float am = -a * MAGIC;
        for (int i = 0; i < 4; i++) w[i] = sh_fma(a, byte_magic(v, i), am) - c;
    }
};

// Q5_K: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]. As Q4_K, plus the 5th bit of element l of
// sub-block j in bit j of qh[l]. Lane t also loads qh[l0 .. l0+8).
struct BQ5_K {
    static constexpr int BS = 256, TS = 176, LPB = 16, NG = 4;
    float dsc0, dmn0, dsc1, dmn1;
    uint2 qs, qh;
    int G;
    SH_HD void load(const u8* b, int t) {
        const u32 dd = ld_u32(b);
        const float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
        G = t >> 2;
        int sc, mn;
        k4_scale_min(b + 4, 2 * G, sc, mn);
        dsc0 = d * (float)sc;
        dmn0 = dmin * (float)mn;
        k4_scale_min(b + 4, 2 * G + 1, sc, mn);
        dsc1 = d * (float)sc;
        dmn1 = dmin * (float)mn;
        qh = ld_u64(b + 16 + 8 * (t & 3));
        qs = ld_u64(b + 48 + 8 * t);
    }
    SH_HD static int off(int t, int g) { return 64 * (t >> 2) + 32 * (g >> 1) + 8 * (t & 3) + 4 * (g & 1); }
    SH_HD void deq(int g, float* w) const {
        const u32 q = (g & 1) ? qs.y : qs.x;
        const u32 h = (g & 1) ? qh.y : qh.x;
        const int hb = 2 * G + (g >> 1);
        const u32 v = ((q >> (4 * (g >> 1))) & 0x0F0F0F0Fu) | (((h >> hb) & 0x01010101u) << 4);
        const float a = (g >> 1) ? dsc1 : dsc0, c = (g >> 1) ? dmn1 : dmn0;
        const float am = -a * MAGIC;
        for (int i = 0; i < 4; i++) w[i] = sh_fma(a, byte_magic(v, i), am) - c;
    }
};

// Q6_K: ql[128] | qh[64] | scales int8[16] | d f16. Element e = 128h + r (h = 0,1; 0 <= r < 128):
// low 4 bits = nibble (r>>6) of ql[64h + (r&63)], high 2 bits = bits 2*(r>>5).. of qh[32h + (r&31)],
// w = d * scales[e>>4] * (q - 32). Lane t (16 per block): h = t>>3, u = t&7 owns r = 32g + 4u + i
// for g = 0..3, i = 0..3, i.e. ql[64h + 4u ..+4], ql[64h + 32 + 4u ..+4], qh[32h + 4u ..+4].
struct BQ6_K {
    static constexpr int BS = 256, TS = 210, LPB = 16, NG = 4;
    u32 qla, qlb, qh;
    float dsc[4];
    SH_HD void load(const u8* b, int t) {
        const int h = t >> 3, u = t & 7;
        qla = ld_u32_a2(b + 64 * h + 4 * u);
        qlb = ld_u32_a2(b + 64 * h + 32 + 4 * u);
        qh = ld_u32_a2(b + 128 + 32 * h + 4 * u);
        const float d = h2f(ld_u16(b + 208));
        for (int g = 0; g < 4; g++) dsc[g] = d * (float)(int)(i8)ldg(b + 192 + 8 * h + 2 * g + (u >> 2));
    }
    SH_HD static int off(int t, int g) { return 128 * (t >> 3) + 32 * g + 4 * (t & 7); }
    SH_HD void deq(int g, float* w) const {
        const u32 l = (g & 1) ? qlb : qla;
        const u32 v = ((l >> (4 * (g >> 1))) & 0x0F0F0F0Fu) | (((qh >> (2 * g)) & 0x03030303u) << 4);
        for (int i = 0; i < 4; i++) w[i] = dsc[g] * (byte_magic(v, i) - (MAGIC + 32.0f));
    }
};

// Q3_K: hmask[32] | qs[64] | scales[12] (16 6-bit values, offset 32) | d f16. Element e = 128h + r
// (h = 0,1; r = 32j + l): low 2 bits = bits 2j.. of qs[32h + l], 3rd bit = bit 4h + j of hmask[l],
// w = d * (sc[e>>4] - 32) * (q - 4) (gguf.quants: the offset is 4 where the hmask bit is clear).
// Lane t (16 per block): h = t>>3, u = t&7 owns r = 32g + 4u + i as for Q6_K.
struct BQ3_K {
    static constexpr int BS = 256, TS = 110, LPB = 16, NG = 4;
    u32 qs, hm;
    int h;
    float dsc[4];
    SH_HD void load(const u8* b, int t) {
        h = t >> 3;
        const int u = t & 7;
        qs = ld_u32_a2(b + 32 + 32 * h + 4 * u);
        hm = ld_u32_a2(b + 4 * u);
        const float d = h2f(ld_u16(b + 108));
        for (int g = 0; g < 4; g++) {
            const int j = 8 * h + 2 * g + (u >> 2);  // sub-block
            const int lo = j < 8 ? (ldg(b + 96 + j) & 0xF) : (ldg(b + 96 + j - 8) >> 4);
            const int hi = (ldg(b + 104 + (j & 3)) >> (2 * (j >> 2))) & 3;
            dsc[g] = d * (float)((lo | (hi << 4)) - 32);
        }
    }
    SH_HD static int off(int t, int g) { return 128 * (t >> 3) + 32 * g + 4 * (t & 7); }
    SH_HD void deq(int g, float* w) const {
        const u32 v = ((qs >> (2 * g)) & 0x03030303u) | (((hm >> (4 * h + g)) & 0x01010101u) << 2);
        for (int i = 0; i < 4; i++) w[i] = dsc[g] * (byte_magic(v, i) - (MAGIC + 4.0f));
    }
};

// Q2_K: scales[16] (low nibble: scale, high: min, per 16 weights) | qs[64] | d f16 | dmin f16.
// Element e = 128h + 32j + l: q = bits 2j.. of qs[32h + l], w = d*sc[e>>4] * q - dmin*m[e>>4].
// Lane t: h = t>>3, u = t&7 as for Q6_K.
struct BQ2_K {
    static constexpr int BS = 256, TS = 84, LPB = 16, NG = 4;
    u32 qs;
    float dsc[4], dmn[4];
    SH_HD void load(const u8* b, int t) {
        const int h = t >> 3, u = t & 7;
        qs = ld_u32_a2(b + 16 + 32 * h + 4 * u);
        const float d = h2f(ld_u16(b + 80)), dmin = h2f(ld_u16(b + 82));
        for (int g = 0; g < 4; g++) {
            const int sm = ldg(b + 8 * h + 2 * g + (u >> 2));
            dsc[g] = d * (float)(sm & 0xF);
            dmn[g] = dmin * (float)(sm >> 4);
        }
    }
    SH_HD static int off(int t, int g) { return 128 * (t >> 3) + 32 * g + 4 * (t & 7); }
    SH_HD void deq(int g, float* w) const {
        const u32 v = (qs >> (2 * g)) & 0x03030303u;
        const float am = -dsc[g] * MAGIC;
        for (int i = 0; i < 4; i++) w[i] = sh_fma(dsc[g], byte_magic(v, i), am) - dmn[g];
    }
};

// IQ4_XS: d f16 | scales_h u16 | scales_l[4] | qs[128]. Sub-block j (32 weights): ls = nibble j&1 of
// scales_l[j/2] | bits 2j.. of scales_h << 4, w = d * (ls - 32) * kvalues_iq4nl[q]; its codes are the low
// nibbles (elements 32j + l) and high nibbles (32j + 16 + l) of qs[16j + l]. Lane t (16 per block):
// sub-block j = t>>1, qs bytes [16j + 8h, +8) with h = t&1: low nibbles = elements 32j + 8h + [0, 8),
// high ones 32j + 16 + 8h + [0, 8).
struct BIQ4_XS {
    static constexpr int BS = 256, TS = 136, LPB = 16, NG = 4;
    float dsc;
    uint2 qs;
    SH_HD void load(const u8* b, int t) {
        const int j = t >> 1;
        const int ls = ((ldg(b + 4 + (j >> 1)) >> (4 * (j & 1))) & 0xF) | (((ld_u16(b + 2) >> (2 * j)) & 3) << 4);
        dsc = h2f(ld_u16(b)) * (float)(ls - 32);
        qs = ld_u64(b + 8 + 8 * t);
    }
    // g: bit 0 = which 4 of the lane's 8 bytes, bit 1 = low / high nibbles
    SH_HD static int off(int t, int g) { return 32 * (t >> 1) + 8 * (t & 1) + 4 * (g & 1) + 16 * (g >> 1); }
    SH_HD void deq(int g, float* w) const {
        const u32 q = (g & 1) ? qs.y : qs.x;
        for (int i = 0; i < 4; i++) w[i] = dsc * iq4nl_value((q >> (8 * i + 4 * (g >> 1))) & 0xFu);
    }
};

// ---- float weights: "blocks" of 8 (F16, BF16: one 16-byte load) or 4 (F32) per lane -----------------

struct BF16x8 {
    static constexpr int BS = 8, TS = 16, LPB = 1, NG = 2;
    uint4 v;
    SH_HD void load(const u8* b, int) { v = ld_u128(b); }
    SH_HD static int off(int, int g) { return 4 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 a = g ? v.z : v.x, c = g ? v.w : v.y;
        w[0] = h2f((u16)(a & 0xFFFFu));
        w[1] = h2f((u16)(a >> 16));
        w[2] = h2f((u16)(c & 0xFFFFu));
        w[3] = h2f((u16)(c >> 16));
    }
};

struct BBF16x8 {
    static constexpr int BS = 8, TS = 16, LPB = 1, NG = 2;
    uint4 v;
    SH_HD void load(const u8* b, int) { v = ld_u128(b); }
    SH_HD static int off(int, int g) { return 4 * g; }
    SH_HD void deq(int g, float* w) const {
        const u32 a = g ? v.z : v.x, c = g ? v.w : v.y;
        w[0] = bits_f32(a << 16);
        w[1] = bits_f32(a & 0xFFFF0000u);
        w[2] = bits_f32(c << 16);
        w[3] = bits_f32(c & 0xFFFF0000u);
    }
};

struct BF32x4 {
    static constexpr int BS = 4, TS = 16, LPB = 1, NG = 1;
    float4 v;
    SH_HD void load(const u8* b, int) { v = ldg((const float4*)b); }
    SH_HD static int off(int, int) { return 0; }
    SH_HD void deq(int, float* w) const {
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    }
};

// ---- integer blocks: weight codes against the activations' 8-bit codes (DP4A) --------------------------
//
// The matvec's activations are llama.cpp's 8-bit blocks (the model rounds them so before every quantized
// matmul), so a block's product is an exact integer sum of weight codes times activation codes, scaled
// once: d_w * d_x * sum(q_w * q_x) (+ the weight block's min times the activations' sum). The activations
// come as a q8 row (written by the kernel that rounds them, cuda/ops.cu): int8 codes [K] | float d [K/32] |
// 32-bit s [K/32], d and s per 32 values (a Q8_K scale repeated for its 8 blocks of 32). s: in a Q8_K row
// the int32 sum of the codes (the K-quants' mins take d_x * sum(q_x), as ggml's Q8_K bsums); in a Q8_0 /
// Q8_1 row the float f16(d' * sum(q_x)), d' the scale before its f16 rounding: llama.cpp's Q8_1 s, which
// its Q4_1 / Q5_1 products take (m_w * s; d_x * sum(q_x) in fp32 moved a top-two margin of SmolLM2 by 4e-2).
// A block of BS weights is split over LPB lanes (lane t < LPB); each lane owns BS / LPB weights:
//   load(b, t)         its weight codes as signed-byte words (offsets applied: 4 codes a dp4a), scales
//   A::load(xq, K, ib, t)   the matching activation codes of q8 row xq for block ib, with its d / sums
//   dot(a)             the lane's part of the block's product with that row, a float
// Where a weight block has a min (Q4_1, Q5_1, Q4_K, Q5_K), one lane per sub-block adds its min times the sum s.
SH_HD const float* q8row_d(const u8* q, int K) { return (const float*)(q + K); }
SH_HD const int* q8row_s(const u8* q, int K) { return (const int*)(q + K + 4 * (K / 32)); }
SH_HD float* q8row_d(u8* q, int K) { return (float*)(q + K); }
SH_HD int* q8row_s(u8* q, int K) { return (int*)(q + K + 4 * (K / 32)); }

SH_HD int dp4a_x2(const u32* w, uint2 a, int c) { return dp4a(w[1], a.y, dp4a(w[0], a.x, c)); }
SH_HD int dp4a_x4(const u32* w, uint4 a, int c) {
    return dp4a(w[3], a.w, dp4a(w[2], a.z, dp4a(w[1], a.y, dp4a(w[0], a.x, c))));
}

// legacy 32-blocks, lane t of 2: qs bytes [8t, 8t+8): low nibbles = elements 8t..8t+7, high ones 16+8t..
// w[0], w[1]: elements 8t + [0,4), [4,8); w[2], w[3]: 16 + 8t + [0,4), [4,8)
struct QA32 {  // a lane's activations of a 32-block (a Q8_0 / Q8_1 row: s is Q8_1's, a float)
    uint2 lo, hi;
    float d, s;
    SH_HD void load(const u8* xq, int K, int ib, int t) {
        lo = ld_u64(xq + 32 * ib + 8 * t);
        hi = ld_u64(xq + 32 * ib + 16 + 8 * t);
        d = q8row_d(xq, K)[ib];
        s = bits_f32((u32)q8row_s(xq, K)[ib]);
    }
};
SH_HD void nibble_words(u32 x, u32 y, u32* w) {
    w[0] = x & 0x0F0F0F0Fu;
    w[1] = y & 0x0F0F0F0Fu;
    w[2] = (x >> 4) & 0x0F0F0F0Fu;
    w[3] = (y >> 4) & 0x0F0F0F0Fu;
}
SH_HD int qa32_dot(const u32* w, const QA32& a) { return dp4a_x2(w + 2, a.hi, dp4a_x2(w, a.lo, 0)); }

// a legacy block's lane part: 16 codes and the scale d (IQ32), plus the min m (IQ32M; lane 0's only, the
// block's min then counted once)
struct IQ32 {
    static constexpr int BS = 32, LPB = 2;
    using A = QA32;
    float d;
    u32 w[4];
    SH_HD float dot(const A& a) const { return a.d * (d * (float)qa32_dot(w, a)); }
};
struct IQ32M : IQ32 {
    float m;
    // (ggml's vec_dot_q4_1_q8_1: d_w d_x sum(q_w q_x) + m_w s_x)
    SH_HD float dot(const A& a) const { return sh_fma(m, a.s, (d * a.d) * (float)qa32_dot(w, a)); }
};

struct IQ4_0 : IQ32 {  // d f16 | qs[16]; w = d * (q - 8)
    static constexpr int TS = 18;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        nibble_words(ld_u32_a2(b + 2 + 8 * t), ld_u32_a2(b + 6 + 8 * t), w);
        for (int i = 0; i < 4; i++) w[i] = bytes_sub(w[i], 0x08080808u);
    }
};

struct IQ4_1 : IQ32M {  // d f16 | m f16 | qs[16]; w = d * q + m
    static constexpr int TS = 20;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        m = t == 0 ? h2f(ld_u16(b + 2)) : 0.0f;
        nibble_words(ld_u32(b + 4 + 8 * t), ld_u32(b + 8 + 8 * t), w);
    }
};

// the 5th bits of the lane's word i (elements 16 (i >> 1) + 8t + 4 (i & 1) + [0, 4): bits of qh) as bit 4
// of its four bytes
SH_HD u32 high_bits4(u32 qh, int t, int i) { return spread4(qh >> (16 * (i >> 1) + 8 * t + 4 * (i & 1))) << 4; }

struct IQ5_0 : IQ32 {  // d f16 | qh u32 | qs[16]; w = d * (q - 16)
    static constexpr int TS = 22;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        const u32 qh = ld_u32_a2(b + 2);
        nibble_words(ld_u32_a2(b + 6 + 8 * t), ld_u32_a2(b + 10 + 8 * t), w);
        for (int i = 0; i < 4; i++) w[i] = bytes_sub(w[i] | high_bits4(qh, t, i), 0x10101010u);
    }
};

struct IQ5_1 : IQ32M {  // d f16 | m f16 | qh u32 | qs[16]; w = d * q + m
    static constexpr int TS = 24;
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        m = t == 0 ? h2f(ld_u16(b + 2)) : 0.0f;
        const u32 qh = ld_u32(b + 4);
        nibble_words(ld_u32(b + 8 + 8 * t), ld_u32(b + 12 + 8 * t), w);
        for (int i = 0; i < 4; i++) w[i] |= high_bits4(qh, t, i);
    }
};

struct IQ8_0 {  // d f16 | qs int8[32]; lane t of 2 owns elements [16t, 16t+16)
    static constexpr int BS = 32, TS = 34, LPB = 2;
    struct A {
        uint4 q;
        float d;
        SH_HD void load(const u8* xq, int K, int ib, int t) {
            q = ld_u128(xq + 32 * ib + 16 * t);
            d = q8row_d(xq, K)[ib];
        }
    };
    float d;
    u32 w[4];
    SH_HD void load(const u8* b, int t) {
        d = h2f(ld_u16(b));
        for (int i = 0; i < 4; i++) w[i] = ld_u32_a2(b + 2 + 16 * t + 4 * i);
    }
    SH_HD float dot(const A& a) const { return a.d * (d * (float)dp4a_x4(w, a.q, 0)); }
};

// Q4_K / Q5_K, lane t of 8: G = t >> 1 (sub-blocks 2G and 2G+1), h = t & 1: qs bytes [32G + 16h, +16),
// whose low nibbles are elements 64G + 16h + [0,16) (sub-block 2G), high ones 64G + 32 + 16h + [0,16).
// sum = d * sum_j sc_j * (q . x)_j - dmin * sum_j m_j * sum(x)_j over the lane's two sub-blocks j (the
// mins from lane h == 0 only), times the row's d_x.
struct QAK4 {
    uint4 lo, hi;
    float d;
    int s0, s1;
    SH_HD void load(const u8* xq, int K, int ib, int t) {
        const int G = t >> 1, e = 256 * ib + 64 * G + 16 * (t & 1);
        lo = ld_u128(xq + e);
        hi = ld_u128(xq + e + 32);
        d = q8row_d(xq, K)[8 * ib];
        const int* s = q8row_s(xq, K) + 8 * ib + 2 * G;
        s0 = s[0];
        s1 = s[1];
    }
};

struct IQ4_K {  // d f16 | dmin f16 | scales[12] | qs[128]
    static constexpr int BS = 256, TS = 144, LPB = 8;
    using A = QAK4;
    float d, dmin;
    int sc0, sc1, mn0, mn1;
    u32 w[8];  // sub-block 2G's 16 codes, then 2G+1's
    SH_HD void scales(const u8* b, int t) {
        const u32 dd = ld_u32(b);
        d = h2f((u16)(dd & 0xFFFFu));
        dmin = h2f((u16)(dd >> 16));
        const int G = t >> 1;
        k4_scale_min(b + 4, 2 * G, sc0, mn0);
        k4_scale_min(b + 4, 2 * G + 1, sc1, mn1);
        if (t & 1) mn0 = mn1 = 0;
    }
    SH_HD void load(const u8* b, int t) {
        scales(b, t);
        const uint4 q = ld_u128(b + 16 + 32 * (t >> 1) + 16 * (t & 1));
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        for (int i = 0; i < 4; i++) {
            w[i] = qw[i] & 0x0F0F0F0Fu;
            w[4 + i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        }
    }
    SH_HD float dot(const A& a) const {
        const int isum = sc0 * dp4a_x4(w, a.lo, 0) + sc1 * dp4a_x4(w + 4, a.hi, 0);
        const int msum = mn0 * a.s0 + mn1 * a.s1;
        return a.d * (d * (float)isum - dmin * (float)msum);
    }
};

struct IQ5_K : IQ4_K {  // d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; 5th bit of element l of sub-block j: bit j of qh[l]
    static constexpr int TS = 176;
    SH_HD void load(const u8* b, int t) {
        scales(b, t);
        const int G = t >> 1;
        const uint4 q = ld_u128(b + 48 + 32 * G + 16 * (t & 1));
        const uint4 h = ld_u128(b + 16 + 16 * (t & 1));
        const u32 qw[4] = {q.x, q.y, q.z, q.w}, hw[4] = {h.x, h.y, h.z, h.w};
        for (int i = 0; i < 4; i++) {
            w[i] = (qw[i] & 0x0F0F0F0Fu) | (((hw[i] >> (2 * G)) & 0x01010101u) << 4);
            w[4 + i] = ((qw[i] >> 4) & 0x0F0F0F0Fu) | (((hw[i] >> (2 * G + 1)) & 0x01010101u) << 4);
        }
    }
};

// Q6_K, lane t of 8: h = t >> 2, l0 = 8 (t & 3): elements 128h + 32s + l0 + [0,8) for s = 0..3, whose
// scale is scales[8h + 2s + (l0 >> 4)]; low 4 bits: nibble s >> 1 of ql[64h + 32(s & 1) + l], high 2
// bits: bits 2s.. of qh[32h + l] (l = l0 + [0,8)); w = d * sc * (q - 32).
struct IQ6_K {  // ql[128] | qh[64] | scales int8[16] | d f16
    static constexpr int BS = 256, TS = 210, LPB = 8;
    struct A {
        uint2 x[4];
        float d;
        SH_HD void load(const u8* xq, int K, int ib, int t) {
            const u8* p = xq + 256 * ib + 128 * (t >> 2) + 8 * (t & 3);
            for (int s = 0; s < 4; s++) x[s] = ld_u64(p + 32 * s);
            d = q8row_d(xq, K)[8 * ib];
        }
    };
    float d;
    int sc[4];
    u32 w[8];  // [s][2]
    SH_HD void load(const u8* b, int t) {
        const int h = t >> 2, l0 = 8 * (t & 3);
        for (int k = 0; k < 2; k++) {
            const u32 A = ld_u32_a2(b + 64 * h + l0 + 4 * k), B = ld_u32_a2(b + 64 * h + 32 + l0 + 4 * k);
            const u32 C = ld_u32_a2(b + 128 + 32 * h + l0 + 4 * k);
            w[0 + k] = (A & 0x0F0F0F0Fu) | ((C & 0x03030303u) << 4);
            w[2 + k] = (B & 0x0F0F0F0Fu) | (((C >> 2) & 0x03030303u) << 4);
            w[4 + k] = ((A >> 4) & 0x0F0F0F0Fu) | (((C >> 4) & 0x03030303u) << 4);
            w[6 + k] = ((B >> 4) & 0x0F0F0F0Fu) | (((C >> 6) & 0x03030303u) << 4);
        }
        for (int i = 0; i < 8; i++) w[i] = bytes_sub(w[i], 0x20202020u);
        for (int s = 0; s < 4; s++) sc[s] = (int)(i8)ldg(b + 192 + 8 * h + 2 * s + ((t & 3) >> 1));
        d = h2f(ld_u16(b + 208));
    }
    SH_HD float dot(const A& a) const {
        int isum = 0;
        for (int s = 0; s < 4; s++) isum += sc[s] * dp4a_x2(w + 2 * s, a.x[s], 0);
        return a.d * (d * (float)isum);
    }
};

// ---- the per-lane part of the matvecs ----------------------------------------------------------------
//
// The walk both kinds of matvec share: lane `lane` of the `width` sharing rows row0 .. row0+R-1 loads
// its part (B::load) of blocks lane/LPB, lane/LPB + width/LPB, ..., of every row, U blocks' loads issued
// before any is used (more bytes in flight per lane), and hands each block's R row parts to
// use(blk, ib, t) in walk order.
template <class B, int R, int U, class F>
SH_HD void qmv_walk(const u8* W, i64 row_bytes, int row0, int N, int K, int lane, int width, F use) {
    const int BPI = width / B::LPB;  // blocks per iteration of the lanes sharing the rows
    const int nb = K / B::BS;
    const int t = lane % B::LPB;
    const u8* rp[R];
#pragma unroll
    for (int r = 0; r < R; r++) rp[r] = W + (i64)imin(row0 + r, N - 1) * row_bytes;
    for (int ib0 = lane / B::LPB; ib0 < nb; ib0 += U * BPI) {
        B blk[U][R];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (ib0 + u * BPI < nb)
#pragma unroll
                for (int r = 0; r < R; r++) blk[u][r].load(rp[r] + (i64)(ib0 + u * BPI) * B::TS, t);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int ib = ib0 + u * BPI;
            if (ib >= nb) break;
            use(blk[u], ib, t);
        }
    }
}

// 2 blocks' loads in flight where the variant has the registers (few activation rows, at most 2 weight
// rows; 4 weight rows are 4 loads in flight already)
template <int NQ, int R>
struct QmvUnroll {
    static constexpr int U = NQ <= 4 && R <= 2 ? 2 : 1;
};

// Rows row0 .. row0+R-1 (rows >= N are clamped to N-1: read, never written) of W [N, K] (row_bytes
// per row) against activation rows X[q*ldx .. +K) for q < nq <= NQ. acc[r][q] receives this lane's
// partial sums; the caller adds them up over the `width` lanes (a multiple of 32) sharing the rows.
// Each weight byte is read once for all nq rows of X; a row's sums run block after block in walk order.
template <class B, int NQ, int R>
SH_HD void qmv_lane(const u8* W, i64 row_bytes, int row0, int N, int K, const float* X, i64 ldx,
                    int nq, int lane, int width, float (&acc)[R][NQ]) {
    qmv_walk<B, R, QmvUnroll<NQ, R>::U>(W, row_bytes, row0, N, K, lane, width, [&](const B (&blk)[R], int ib, int t) {
#pragma unroll
        for (int g = 0; g < B::NG; g++) {
            float w[R][4];
#pragma unroll
            for (int r = 0; r < R; r++) blk[r].deq(g, w[r]);
            const float* xp = X + (i64)ib * B::BS + B::off(t, g);
#pragma unroll
            for (int q = 0; q < NQ; q++) {
                if (q < nq) {
                    const float4 x = ld_f4(xp + q * ldx);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        float a = acc[r][q];
                        a = sh_fma(w[r][0], x.x, a);
                        a = sh_fma(w[r][1], x.y, a);
                        a = sh_fma(w[r][2], x.z, a);
                        a = sh_fma(w[r][3], x.w, a);
                        acc[r][q] = a;
                    }
                }
            }
        }
    });
}

// The integer matvec's lane part (integer blocks IQ*): as qmv_lane over q8 rows XQ + q * qst (bytes) of
// K values; a block's activations are loaded once for the R weight rows.
template <class B, int NQ, int R>
SH_HD void qmvi_lane(const u8* W, i64 row_bytes, int row0, int N, int K, const u8* XQ, i64 qst, int nq, int lane,
                     int width, float (&acc)[R][NQ]) {
    qmv_walk<B, R, QmvUnroll<NQ, R>::U>(W, row_bytes, row0, N, K, lane, width, [&](const B (&blk)[R], int ib, int t) {
#pragma unroll
        for (int q = 0; q < NQ; q++) {
            if (q < nq) {
                typename B::A a;
                a.load(XQ + q * qst, K, ib, t);
#pragma unroll
                for (int r = 0; r < R; r++) acc[r][q] += blk[r].dot(a);
            }
        }
    });
}

// The per-thread part of dequantizing one row: thread `tid` of `nthreads` (a multiple of LPB) writes
// its groups of row `rp` (K weights) to out[0..K).
template <class B>
SH_HD void deq_row_thread(const u8* rp, int K, float* out, int tid, int nthreads) {
    const int nb = K / B::BS, t = tid % B::LPB;
    for (int ib = tid / B::LPB; ib < nb; ib += nthreads / B::LPB) {
        B blk;
        blk.load(rp + (i64)ib * B::TS, t);
        for (int g = 0; g < B::NG; g++) {
            float w[4];
            blk.deq(g, w);
            float4 v;
            v.x = w[0];
            v.y = w[1];
            v.z = w[2];
            v.w = w[3];
            st((float4*)(out + (i64)ib * B::BS + B::off(t, g)), v);
        }
    }
}
