// Absorbed cross-attention over paged encoder states E, one pass per (work item, row tile):
// scores = q' E^T, online softmax, P E (multi-query attention of width d = d_model). Compiled at
// run time by NVRTC (`nvrtc_cubin` in v1/attention/ops/cuda_absorbed.py, the launcher) with these
// macros; the torch reference is absorbed_cross_attention.attend_encoder_states_torch:
//   BF16   1 for bfloat16 operands, 0 for float16     NW      warps; warp w owns columns
//   DW     columns a warp owns (a multiple of 16)             [w * DW, (w + 1) * DW) of d
//   BN     encoder positions per step (16 or 32)      STAGES  cp.async stages per warp
//   M_TILES  16-row m-tiles of (token, head) rows a block computes (2 past 16 heads: a token's
//          20 heads in one block, so E is read once for them; q' then sits in shared memory)
//   SPAN, RPH  the states layout: pool tensors a block spreads over, rows per half-page.
//   FP8    1 for float8_e4m3 states with a float32 scale per position (sm_89+): the tensor
//          cores read a step's fp8 slice from its stage, converted in registers (see
//          partial_scores and update_context); the scale multiplies the position's score and
//          its softmax weight in P E (no [BN, d] multiply).
//
// Why by hand: the Triton kernel cannot keep a step's E tile in shared memory for both of its
// products, so it loads E twice and runs at about half the copy bandwidth. Here each warp
// streams only its own column slice of E into its own shared-memory stages (cp.async, no
// block-wide barrier for loads), multiplies q'[:, slice] by it on the tensor cores (partial
// scores), and the warps add their partial scores through shared memory (two barriers a
// step). Every warp then runs the same softmax and updates its slice of the context with
// P E[:, slice] from the tile it already holds. E goes through HBM once per tile of rows.
//
// Layout (see absorbed_cross_attention.py): states [SPAN, 2, num_blocks, RPH, d]; position p of
// a request is block table entry p / (SPAN * 2 * RPH), offset o = p % (SPAN * 2 * RPH): pool
// tensor o / (2 * RPH), half (o / RPH) % 2, row o % RPH.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define PITCH (DW + 8)         // elements per shared-memory row: 16 bytes of padding (no bank conflicts)
#define KSTEPS (DW / 16)       // k-steps of the score product
#define NT_S (BN / 8)          // 8-position tiles of the scores
#define NT_O (DW / 8)          // 8-column tiles of the context
#define ROWS (16 * M_TILES)    // (token, head) rows a block computes
#define D (NW * DW)            // d_model
#define Q_PITCH (D + 8)        // q' rows in shared memory, padded like E's
#define SC (M_TILES * NT_S * 4)  // score accumulators a thread holds
#define ESIZE (FP8 ? 1 : 2)      // bytes of a stored E element
#define RAW_PITCH (DW * ESIZE + 16)  // bytes per row of a stage as loaded (16 bytes of padding)
#define RAW_CPR (DW * ESIZE / 16)    // 16-byte chunks per row of a warp's slice
#define BLOCK_POS (SPAN * 2 * RPH)
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c += a (16 x 16, row) * b (16 x 8, col), fp32 accumulators.
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
#if BF16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats -> one register of two 16-bit values (lo in the low half).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ i64 join64(int lo, int hi) {
    return (i64)(((unsigned long long)(u32)hi << 32) | (unsigned long long)(u32)lo);
}

// Where a work item's E lives: its block table row and the states' strides (elements).
struct StatesView {
    const unsigned char* __restrict__ base;
    const float* __restrict__ scales;  // FP8: [SPAN, 2, num_blocks, RPH]
    const int* __restrict__ table_row;
    i64 s_tensor, s_half, s_block, s_row;
    i64 sc_tensor, sc_half, sc_block;
    int kv_len;
};

// Queue one step's [BN, DW] slice of E (this warp's columns) into stage `dst` (RAW_PITCH bytes
// a row) and, for fp8, the positions' scales into `scale_dst`. Lane l finds the address of
// position start + l; rows past kv_len are zero-filled (so P E never meets garbage).
__device__ __forceinline__ void load_step(unsigned char* dst, float* scale_dst, const StatesView& e, int start,
                                          int col0, int lane) {
    const int pos = start + lane;
    const bool ok = lane < BN && pos < e.kv_len;
    i64 off = 0;
    if (ok) {
        const int o = pos % BLOCK_POS;
        const i64 block = e.table_row[pos / BLOCK_POS];
        const i64 tensor = o / (2 * RPH), half = (o / RPH) & 1, row = o % RPH;
        off = (tensor * e.s_tensor + half * e.s_half + block * e.s_block + row * e.s_row + col0) * ESIZE;
#if FP8
        const float* src = e.scales + tensor * e.sc_tensor + half * e.sc_half + block * e.sc_block + row;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(scale_dst + lane)), "l"(src));
#endif
    }
#if FP8
    else if (lane < BN) scale_dst[lane] = 0.f;
#endif
#pragma unroll
    for (int i = 0; i < (BN * RAW_CPR + 31) / 32; ++i) {
        const int c = i * 32 + lane;
        const int r = min(c / RAW_CPR, BN - 1), ch = c % RAW_CPR;
        const i64 row_off = __shfl_sync(0xffffffffu, off, r);
        const int row_ok = __shfl_sync(0xffffffffu, (int)ok, r);
        if (c < BN * RAW_CPR)
            cp_async16(smem_addr(dst + r * RAW_PITCH + ch * 16), e.base + (row_ok ? row_off + ch * 16 : 0),
                       row_ok ? 16 : 0);
    }
}

#if FP8
// Four e4m3 values (the bytes of v, low first) as two registers of two 16-bit values of the
// model's type: bytes 0, 1 in lo, bytes 2, 3 in hi.
__device__ __forceinline__ void e4m3x4(u32 v, u32& lo, u32& hi) {
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
        : "=r"(lo), "=r"(hi)
        : "r"(v));
#if BF16
    float f[4];
    asm("{ .reg .f16 a, b, c, d; mov.b32 {a, b}, %4; mov.b32 {c, d}, %5; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b;"
        " cvt.f32.f16 %2, c; cvt.f32.f16 %3, d; }"
        : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3])
        : "r"(lo), "r"(hi));
    lo = pack2(f[0], f[1]);
    hi = pack2(f[2], f[3]);
#endif
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 r;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(addr));
    return r;
}

__device__ __forceinline__ u32 lds16(u32 addr) {
    unsigned short r;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(r) : "r"(addr));
    return r;
}
#endif

// Rows of a tile: row g is token first + g / H, head g % H; rows at or past `rows` are absent.
struct TileRows {
    int first_token, rows, num_heads, stride_t, stride_h;
    __device__ __forceinline__ i64 offset(int g) const {
        return (i64)(first_token + g / num_heads) * stride_t + (g % num_heads) * stride_h;
    }
};

// Copy the tile's q' rows into shared memory (zeros for absent rows), all threads; with fp8
// states each 16 columns in the k order partial_scores reads E in: column pairs (0, 2, 4, 6)
// of the chunk, then (1, 3, 5, 7).
__device__ __forceinline__ void stage_queries(u16* q_s, const u16* __restrict__ q, const TileRows& t, int row0) {
    for (int i = threadIdx.x; i < ROWS * (D / 16); i += NW * 32) {
        const int r = i / (D / 16), ch = i % (D / 16), g = row0 + r;
        uint4 u = make_uint4(0u, 0u, 0u, 0u), v = u;
        if (g < t.rows) {
            u = *(const uint4*)(q + t.offset(g) + ch * 16);
            v = *(const uint4*)(q + t.offset(g) + ch * 16 + 8);
        }
#if FP8
        const uint4 lo = make_uint4(u.x, u.z, v.x, v.z), hi = make_uint4(u.y, u.w, v.y, v.w);
        u = lo;
        v = hi;
#endif
        *(uint4*)(q_s + r * Q_PITCH + ch * 16) = u;
        *(uint4*)(q_s + r * Q_PITCH + ch * 16 + 8) = v;
    }
}

// This warp's partial scores q'[:, slice] E[:, slice]^T: [ROWS, BN] as M_TILES x NT_S tiles.
__device__ __forceinline__ void partial_scores(float (&sc)[M_TILES][NT_S][4], u32 q_addr, u32 e_base, int lane) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int n = 0; n < NT_S; ++n) sc[m][n][0] = sc[m][n][1] = sc[m][n][2] = sc[m][n][3] = 0.f;
#if FP8
    // The B operand straight from the fp8 stage: lane l reads position n * 8 + l / 4, columns
    // 4c .. 4c + 3 of the k-step (c = l % 4) in one word, whose low pair is the fragment's k =
    // 2c, 2c + 1 and high pair k = 8 + 2c, 9 + 2c. A k-step's column k thus stands for column
    // 4 (k / 2) + k % 2 (k < 8) or 4 ((k - 8) / 2) + 2 + k % 2, the order q' is staged in.
    const u32 e_addr = e_base + (lane >> 2) * RAW_PITCH + (lane & 3) * 4;
#else
    // E rows of n-tiles (n, n + 1): lanes 0-15 tile n, 16-31 tile n + 1; k half (lane / 8) % 2.
    const u32 e_addr = e_base + (((lane >> 4) * 8 + (lane & 7)) * PITCH + ((lane >> 3) & 1) * 8) * 2;
#endif
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        u32 a[M_TILES][4];
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
            ldmatrix_x4(a[m][0], a[m][1], a[m][2], a[m][3], q_addr + (m * 16 * Q_PITCH + ks * 16) * 2);
#if FP8
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
            u32 b0, b1;
            e4m3x4(lds32(e_addr + n * 8 * RAW_PITCH + ks * 16), b0, b1);
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) mma16816(sc[m][n], a[m], b0, b1);
        }
#else
#pragma unroll
        for (int n = 0; n < NT_S; n += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, e_addr + (n * 8 * PITCH + ks * 16) * 2);
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                mma16816(sc[m][n], a[m], b0, b1);
                mma16816(sc[m][n + 1], a[m], b2, b3);
            }
        }
#endif
    }
}

// Sum the warps' partial scores into sc (every warp gets the whole sums): write, barrier, each
// thread adds up a share, barrier, read back. One buffer of each suffices: a warp writes the
// next step's partials only after the second barrier (every share is summed by then) and the
// next sums only after the next first barrier (every warp has read these by then).
__device__ __forceinline__ void sum_scores(float (&sc)[M_TILES][NT_S][4], float* partial, float* summed,
                                           int warp, int lane) {
    float* mine = partial + warp * (SC * 32);
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k) mine[((m * NT_S + n) * 4 + k) * 32 + lane] = sc[m][n][k];
    __syncthreads();
    float* total = summed;
    for (int i = threadIdx.x; i < SC * 32; i += NW * 32) {
        const float* src = partial + i;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) s += src[w * (SC * 32)];
        total[i] = s;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k) sc[m][n][k] = total[((m * NT_S + n) * 4 + k) * 32 + lane];
}

// Per-thread online-softmax state of its two rows (lane / 4 and lane / 4 + 8) in each m-tile.
struct RowState {
    float acc[M_TILES][NT_O][4];  // context slice, unnormalized
    float m_run[M_TILES][2];      // running max, log2 domain
    float l_run[M_TILES][2];      // this thread's share of the running sum (the quad adds them)
};

// Online softmax of one step's summed scores (positions n * 8 + tig * 2 + {0, 1} past
// `n_base`; those at or past kv_len are masked): returns P as the A operand of P E (the scores'
// accumulator layout is the A layout of k-step n / 2). The running max moves only when a row's
// step max passes it by more than RESCALE (log2 units), as in FlashAttention 4: P then stays
// below 2^RESCALE (exact in 16 bits, relative to its magnitude; times an fp8 scale of at most
// 65504 / 448, for states written from a 16-bit model, still finite in fp16), and the 4 * NT_O
// accumulators a row are rescaled on the rare steps that move it (a warp-uniform branch).
#define RESCALE 8.f
__device__ __forceinline__ void softmax_step(RowState& st, float (&sc)[M_TILES][NT_S][4],
                                             u32 (&pa)[M_TILES][BN / 16][4], int n_base, int kv_len,
                                             const float* step_scales) {
    // fp8: E[n] = scale[n] * stored[n] multiplies score n and its weight in P E.
    float scale[NT_S][2];
#pragma unroll
    for (int n = 0; n < NT_S; ++n)
#pragma unroll
        for (int k = 0; k < 2; ++k) scale[n][k] = FP8 ? step_scales[n * 8 + (n_base & 7) + k] : 1.f;
    float mx[M_TILES][2];
    bool grows = false;
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
        mx[m][0] = mx[m][1] = NEG_INF;
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float s = n_base + n * 8 + (k & 1) < kv_len ? sc[m][n][k] * scale[n][k & 1] * LOG2E : NEG_INF;
                sc[m][n][k] = s;
                mx[m][k / 2] = fmaxf(mx[m][k / 2], s);
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[m][h] = fmaxf(mx[m][h], __shfl_xor_sync(0xffffffffu, mx[m][h], 1));
            mx[m][h] = fmaxf(mx[m][h], __shfl_xor_sync(0xffffffffu, mx[m][h], 2));
            grows |= mx[m][h] > st.m_run[m][h] + RESCALE;  // always on the first step (-inf)
        }
    }
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_new = fmaxf(st.m_run[m][h], mx[m][h]);  // finite: a step has a key
                const float alpha = exp2_approx(st.m_run[m][h] - m_new);
                st.m_run[m][h] = m_new;
                st.l_run[m][h] *= alpha;
#pragma unroll
                for (int j = 0; j < NT_O; ++j) {
                    st.acc[m][j][2 * h] *= alpha;
                    st.acc[m][j][2 * h + 1] *= alpha;
                }
            }
    }
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
            float p[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) p[k] = exp2_approx(sc[m][n][k] - st.m_run[m][k / 2]);
            st.l_run[m][0] += p[0] + p[1];
            st.l_run[m][1] += p[2] + p[3];
#pragma unroll
            for (int k = 0; k < 4; ++k) p[k] *= scale[n][k & 1];
            pa[m][n / 2][(n % 2) * 2] = pack2(p[0], p[1]);
            pa[m][n / 2][(n % 2) * 2 + 1] = pack2(p[2], p[3]);
        }
}

// Context slice += P E[:, slice]: E rows are the k dimension.
__device__ __forceinline__ void update_context(RowState& st, const u32 (&pa)[M_TILES][BN / 16][4],
                                               u32 e_base, int lane) {
#if FP8
    // P's fragment holds positions 2c, 2c + 1 (k half 0) and 8 + 2c, 9 + 2c (k half 1) of a
    // 16-position k-step (c = lane % 4), so lane l reads those four rows at byte column 4 (l / 4)
    // of each 32-column group and byte-permutes them into the B fragments of four mmas: mma j
    // of group G computes columns 32G + 4n + j (n = the fragment's column). A last group of 16
    // columns (DW % 32) reads two bytes a row into two mmas, columns 32G + 2n + j.
    const int c = lane & 3, n = lane >> 2;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        const u32 row0 = e_base + (kk * 16 + 2 * c) * RAW_PITCH;
        const u32 rows[4] = {row0, row0 + RAW_PITCH, row0 + 8 * RAW_PITCH, row0 + 9 * RAW_PITCH};
#pragma unroll
        for (int g = 0; g < DW / 32; ++g) {
            u32 w[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) w[r] = lds32(rows[r] + g * 32 + n * 4);
            u32 b0[4], b1[4];  // mma j's fragment halves
            e4m3x4(prmt(w[0], w[1], 0x5140), b0[0], b0[1]);
            e4m3x4(prmt(w[0], w[1], 0x7362), b0[2], b0[3]);
            e4m3x4(prmt(w[2], w[3], 0x5140), b1[0], b1[1]);
            e4m3x4(prmt(w[2], w[3], 0x7362), b1[2], b1[3]);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int m = 0; m < M_TILES; ++m) mma16816(st.acc[m][g * 4 + j], pa[m][kk], b0[j], b1[j]);
        }
#if DW % 32
        u32 w[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) w[r] = lds16(rows[r] + (DW / 32) * 32 + n * 2);
        u32 b0[2], b1[2];
        e4m3x4(prmt(w[0], w[1], 0x5140), b0[0], b0[1]);
        e4m3x4(prmt(w[2], w[3], 0x5140), b1[0], b1[1]);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) mma16816(st.acc[m][(DW / 32) * 4 + j], pa[m][kk], b0[j], b1[j]);
#endif
    }
#else
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        // Lanes 0-7 / 8-15 address rows kk*16 + 0-7 / 8-15 of column tile j, 16-31 tile j + 1
        // (ldmatrix .trans).
        const u32 addr = e_base + ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PITCH + (lane >> 4) * 8) * 2;
#pragma unroll
        for (int j = 0; j < NT_O; j += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, addr + j * 8 * 2);
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                mma16816(st.acc[m][j], pa[m][kk], b0, b1);
                mma16816(st.acc[m][j + 1], pa[m][kk], b2, b3);
            }
        }
    }
#endif
}

// Normalize and store this thread's rows of the context slice.
__device__ __forceinline__ void store_rows(const RowState& st, u16* __restrict__ out, const TileRows& t,
                                           int row0, int col0, int lane) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = st.l_run[m][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;  // no keys: zeros
            const int g = row0 + m * 16 + h * 8 + (lane >> 2);
            if (g >= t.rows) continue;
#if FP8
            // Accumulator (g * 4 + j, k) holds column 32g + 8c + 4k + j (update_context): eight
            // consecutive columns a group, four in the last 16-column group.
            u16* o = out + t.offset(g) + col0 + (lane & 3) * 8;
#pragma unroll
            for (int grp = 0; grp < DW / 32; ++grp) {
                u32 v[4];
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int j = 0; j < 4; j += 2)
                        v[k * 2 + j / 2] = pack2(st.acc[m][grp * 4 + j][2 * h + k] * inv,
                                                 st.acc[m][grp * 4 + j + 1][2 * h + k] * inv);
                *(uint4*)(o + grp * 32) = make_uint4(v[0], v[1], v[2], v[3]);
            }
#if DW % 32
            const int last = (DW / 32) * 4;
            *(uint2*)(out + t.offset(g) + col0 + (DW / 32) * 32 + (lane & 3) * 4) =
                make_uint2(pack2(st.acc[m][last][2 * h] * inv, st.acc[m][last + 1][2 * h] * inv),
                           pack2(st.acc[m][last][2 * h + 1] * inv, st.acc[m][last + 1][2 * h + 1] * inv));
#endif
#else
            u16* o = out + t.offset(g) + col0 + (lane & 3) * 2;
#pragma unroll
            for (int j = 0; j < NT_O; ++j)
                *(u32*)(o + j * 8) = pack2(st.acc[m][j][2 * h] * inv, st.acc[m][j][2 * h + 1] * inv);
#endif
        }
}

// One tile of ROWS rows of a work item over all of its E.
__device__ __forceinline__ void attend_tile(unsigned char* smem, const u16* __restrict__ q, u16* __restrict__ out,
                                            const TileRows& qr, const TileRows& orow, const StatesView& e, int row0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col0 = warp * DW;
    // Shared memory: each warp's stages of E as loaded, [fp8: each warp's stages of scales],
    // q', partial and summed scores.
    unsigned char* raw_warp = smem + warp * (STAGES * BN * RAW_PITCH);
    unsigned char* next = smem + NW * STAGES * BN * RAW_PITCH;
#if FP8
    float* scale_warp = (float*)next + warp * (STAGES * BN);
    next += NW * STAGES * BN * 4;
#else
    float* scale_warp = nullptr;
#endif
    u16* q_s = (u16*)next;                            // [ROWS][D + 8]
    float* partial = (float*)(q_s + ROWS * Q_PITCH);  // [NW][SC][32]
    float* summed = partial + NW * SC * 32;           // [SC][32]

    const int num_steps = (e.kv_len + BN - 1) / BN;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_steps) load_step(raw_warp + s * BN * RAW_PITCH, scale_warp + s * BN, e, s * BN, col0, lane);
        cp_async_commit();
    }
    __syncthreads();  // the previous tile's last reads of q' are done
    stage_queries(q_s, q, qr, row0);
    __syncthreads();
    // q' rows m * 16 + lane % 16 at column half lane / 16 (ldmatrix A operand).
    const u32 q_addr = smem_addr(q_s) + ((lane & 15) * Q_PITCH + col0 + (lane >> 4) * 8) * 2;

    RowState st;
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
        for (int j = 0; j < NT_O; ++j) st.acc[m][j][0] = st.acc[m][j][1] = st.acc[m][j][2] = st.acc[m][j][3] = 0.f;
        st.m_run[m][0] = st.m_run[m][1] = NEG_INF;
        st.l_run[m][0] = st.l_run[m][1] = 0.f;
    }
    for (int step = 0; step < num_steps; ++step) {
        const int ahead = step + STAGES - 1;
        if (ahead < num_steps)
            load_step(raw_warp + (ahead % STAGES) * BN * RAW_PITCH, scale_warp + (ahead % STAGES) * BN, e,
                      ahead * BN, col0, lane);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const u32 e_base = smem_addr(raw_warp + (step % STAGES) * BN * RAW_PITCH);
        float sc[M_TILES][NT_S][4];
        partial_scores(sc, q_addr, e_base, lane);
        sum_scores(sc, partial, summed, warp, lane);
        u32 pa[M_TILES][BN / 16][4];
        softmax_step(st, sc, pa, step * BN + (lane & 3) * 2, e.kv_len, scale_warp + (step % STAGES) * BN);
        update_context(st, pa, e_base, lane);
        __syncwarp();  // this stage is refilled next step
    }
    cp_async_wait<0>();
    store_rows(st, out, orow, row0, col0, lane);
}

// Grid: work items x `grid_tiles` blocks; block b of an item takes its row tiles b, b +
// grid_tiles, ... up to the item's rows (known on the device only). Eager launches give each
// tile a block; CUDA graphs, captured for up to 16 query tokens a request but mostly replayed
// with one, give an item one block, so no block of a graph launch is empty.
extern "C" __global__ void __launch_bounds__(NW * 32, 1) absorbed_attention_kernel(
    const u16* __restrict__ q,          // [T, H, d], scale folded in
    const unsigned char* __restrict__ states,  // [SPAN, 2, num_blocks, RPH, d], 16-bit or fp8
    u16* __restrict__ out,              // [T, H, d], zeroed
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ block_table, const int* __restrict__ work_req,
    const int* __restrict__ work_mblock, int stride_qt, int stride_qh, int stride_ot,
    int stride_oh, int s_tensor_lo, int s_tensor_hi, int s_half_lo, int s_half_hi,
    int s_block_lo, int s_block_hi, int s_row,
    const float* __restrict__ scales,   // FP8: [SPAN, 2, num_blocks, RPH], row stride 1
    int sc_tensor_lo, int sc_tensor_hi, int sc_half_lo, int sc_half_hi, int sc_block_lo, int sc_block_hi,
    int stride_bt, int num_heads, int query_block, int grid_tiles) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int item = blockIdx.x / grid_tiles;
    const int req = work_req[item];
    const int q_start = query_start_loc[req];
    const int first_token = work_mblock[item] * query_block;
    const int num_tokens = min(query_start_loc[req + 1] - q_start - first_token, query_block);
    const int rows = num_tokens * num_heads;
    const TileRows qr = {q_start + first_token, rows, num_heads, stride_qt, stride_qh};
    const TileRows orow = {q_start + first_token, rows, num_heads, stride_ot, stride_oh};
    const StatesView e = {states,
                          scales,
                          block_table + (i64)req * stride_bt,
                          join64(s_tensor_lo, s_tensor_hi),
                          join64(s_half_lo, s_half_hi),
                          join64(s_block_lo, s_block_hi),
                          s_row,
                          join64(sc_tensor_lo, sc_tensor_hi),
                          join64(sc_half_lo, sc_half_hi),
                          join64(sc_block_lo, sc_block_hi),
                          seq_lens[req]};
    for (int tile = blockIdx.x % grid_tiles; tile * ROWS < rows; tile += grid_tiles)
        attend_tile(smem, q, out, qr, orow, e, tile * ROWS);
}
