// Absorbed cross-attention over paged encoder states E, one pass per (work item, 16-row tile):
// scores = q' E^T, online softmax, P E (multi-query attention of width d = d_model). Compiled at
// run time by NVRTC (torch.cuda._compile_kernel) with these macros defined by the launcher
// (v1/attention/ops/cuda_absorbed.py, which also holds the torch reference's name):
//   BF16   1 for bfloat16 operands, 0 for float16     NW      warps; warp w owns columns
//   DW     columns a warp owns (a multiple of 16)             [w * DW, (w + 1) * DW) of d
//   BN     encoder positions per step (16 or 32)      STAGES  cp.async stages per warp
//   SPAN, RPH  the states layout: pool tensors a block spreads over, rows per half-page.
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
#define CPR (DW / 8)           // 16-byte chunks per row of a warp's slice
#define KSTEPS (DW / 16)       // k-steps of the score product
#define NT_S (BN / 8)          // 8-position tiles of the scores
#define NT_O (DW / 8)          // 8-column tiles of the context
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

__device__ __forceinline__ void ldmatrix_x2(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r0), "=r"(r1)
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

// Queue one step's [BN, DW] slice of E (this warp's columns) into stage `dst`. Lane l finds the
// address of position start + l; rows past kv_len are zero-filled (so P E never meets garbage).
__device__ __forceinline__ void load_step(
    u16* dst, const u16* __restrict__ states, const int* __restrict__ table_row, int start,
    int kv_len, int col0, i64 s_tensor, i64 s_half, i64 s_block, i64 s_row, int lane) {
    const int pos = start + lane;
    const bool ok = lane < BN && pos < kv_len;
    i64 off = 0;
    if (ok) {
        const int o = pos % BLOCK_POS;
        off = (i64)(o / (2 * RPH)) * s_tensor + (i64)((o / RPH) & 1) * s_half +
              (i64)table_row[pos / BLOCK_POS] * s_block + (i64)(o % RPH) * s_row + col0;
    }
#pragma unroll
    for (int i = 0; i < BN * CPR / 32; ++i) {
        const int c = i * 32 + lane;
        const int r = c / CPR, ch = c % CPR;
        const i64 row_off = __shfl_sync(0xffffffffu, off, r);
        const int row_ok = __shfl_sync(0xffffffffu, (int)ok, r);
        cp_async16(smem_addr(dst + r * PITCH + ch * 8), states + (row_ok ? row_off + ch * 8 : 0),
                   row_ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(NW * 32, 1) absorbed_attention_kernel(
    const u16* __restrict__ q,          // [T, H, d], scale folded in
    const u16* __restrict__ states,     // [SPAN, 2, num_blocks, RPH, d]
    u16* __restrict__ out,              // [T, H, d], zeroed
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ block_table, const int* __restrict__ work_req,
    const int* __restrict__ work_mblock, int stride_qt, int stride_qh, int stride_ot,
    int stride_oh, int s_tensor_lo, int s_tensor_hi, int s_half_lo, int s_half_hi,
    int s_block_lo, int s_block_hi, int s_row, int stride_bt, int num_heads, int query_block,
    int num_tiles) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, tig = lane & 3;

    // Row tiles of one work item are adjacent blocks: they read the same E, the later from L2.
    const int item = blockIdx.x / num_tiles, tile = blockIdx.x % num_tiles;
    const int req = work_req[item];
    const int q_start = query_start_loc[req];
    const int first_token = work_mblock[item] * query_block;
    const int num_tokens = min(query_start_loc[req + 1] - q_start - first_token, query_block);
    const int rows = num_tokens * num_heads;
    if (tile * 16 >= rows) return;  // fewer (token, head) rows than the grid allows for
    const int kv_len = seq_lens[req];

    // This thread's two rows of the tile: g0 = gid and g1 = gid + 8 (token g / H, head g % H).
    const int g0 = tile * 16 + gid, g1 = g0 + 8;
    const bool v0 = g0 < rows, v1 = g1 < rows;
    const int t0 = q_start + first_token + g0 / num_heads, t1 = q_start + first_token + g1 / num_heads;
    const int col0 = warp * DW;

    // q'[:, slice] as the A operand of every k-step, kept in registers for the whole pass.
    u32 qa[KSTEPS][4];
    {
        const u16* q0 = q + (i64)t0 * stride_qt + (g0 % num_heads) * stride_qh + col0 + tig * 2;
        const u16* q1 = q + (i64)t1 * stride_qt + (g1 % num_heads) * stride_qh + col0 + tig * 2;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            qa[ks][0] = v0 ? *(const u32*)(q0 + ks * 16) : 0u;
            qa[ks][1] = v1 ? *(const u32*)(q1 + ks * 16) : 0u;
            qa[ks][2] = v0 ? *(const u32*)(q0 + ks * 16 + 8) : 0u;
            qa[ks][3] = v1 ? *(const u32*)(q1 + ks * 16 + 8) : 0u;
        }
    }

    u16* e_warp = (u16*)smem + warp * (STAGES * BN * PITCH);
    float* partial = (float*)(smem + NW * STAGES * BN * PITCH * 2);  // [2][NW][NT_S * 4][32]
    float* summed = partial + 2 * NW * NT_S * 4 * 32;                // [2][NT_S * 4][32]
    const int* table_row = block_table + (i64)req * stride_bt;
    const i64 s_tensor = join64(s_tensor_lo, s_tensor_hi), s_half = join64(s_half_lo, s_half_hi);
    const i64 s_block = join64(s_block_lo, s_block_hi);

    float acc[NT_O][4];
#pragma unroll
    for (int j = 0; j < NT_O; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // per row (log2 domain max)

    const int num_steps = (kv_len + BN - 1) / BN;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_steps)
            load_step(e_warp + s * BN * PITCH, states, table_row, s * BN, kv_len, col0, s_tensor,
                      s_half, s_block, s_row, lane);
        cp_async_commit();
    }

    for (int step = 0; step < num_steps; ++step) {
        {
            const int ahead = step + STAGES - 1;
            if (ahead < num_steps)
                load_step(e_warp + (ahead % STAGES) * BN * PITCH, states, table_row, ahead * BN,
                          kv_len, col0, s_tensor, s_half, s_block, s_row, lane);
            cp_async_commit();
        }
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const u16* e = e_warp + (step % STAGES) * BN * PITCH;
        const u32 e_base = smem_addr(e);

        // Partial scores over this warp's columns: [16, BN] as NT_S accumulator tiles.
        float sc[NT_S][4];
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
            // Lane l addresses row n*8 + l%8; columns (l/8)*8 within two k-steps.
            const u32 row_addr = e_base + ((n * 8 + (lane & 7)) * PITCH + (lane >> 3) * 8) * 2;
#pragma unroll
            for (int ks = 0; ks + 1 < KSTEPS; ks += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, row_addr + ks * 16 * 2);
                mma16816(sc[n], qa[ks], b0, b1);
                mma16816(sc[n], qa[ks + 1], b2, b3);
            }
            if (KSTEPS % 2) {
                u32 b0, b1;
                ldmatrix_x2(b0, b1, row_addr + (KSTEPS - 1) * 16 * 2);
                mma16816(sc[n], qa[KSTEPS - 1], b0, b1);
            }
        }

        // Sum the warps' partial scores: write, barrier, each thread sums a share, barrier.
        float* mine = partial + ((step & 1) * NW + warp) * (NT_S * 4 * 32);
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k) mine[(n * 4 + k) * 32 + lane] = sc[n][k];
        __syncthreads();
        float* total = summed + (step & 1) * (NT_S * 4 * 32);
        for (int i = threadIdx.x; i < NT_S * 4 * 32; i += NW * 32) {
            const float* src = partial + (step & 1) * NW * (NT_S * 4 * 32) + i;
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) s += src[w * (NT_S * 4 * 32)];
            total[i] = s;
        }
        __syncthreads();

        // Online softmax (every warp the same, on the same sums), log2 domain.
        const int n_base = step * BN + tig * 2;
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const bool valid = n_base + n * 8 + (k & 1) < kv_len;
                const float s = valid ? total[(n * 4 + k) * 32 + lane] * LOG2E : NEG_INF;
                sc[n][k] = s;
                if (k < 2) mx0 = fmaxf(mx0, s);
                else mx1 = fmaxf(mx1, s);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);  // finite: a step has a key
        const float alpha0 = exp2_approx(m0 - new0), alpha1 = exp2_approx(m1 - new1);
        m0 = new0;
        m1 = new1;
        u32 pa[BN / 16][4];
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
            const float p0 = exp2_approx(sc[n][0] - new0), p1 = exp2_approx(sc[n][1] - new0);
            const float p2 = exp2_approx(sc[n][2] - new1), p3 = exp2_approx(sc[n][3] - new1);
            sum0 += p0 + p1;
            sum1 += p2 + p3;
            // The scores' accumulator layout is the A operand layout of P E's k-step n / 2.
            pa[n / 2][(n % 2) * 2] = pack2(p0, p1);
            pa[n / 2][(n % 2) * 2 + 1] = pack2(p2, p3);
        }
        l0 = l0 * alpha0 + sum0;  // per-thread partial sums; the quad adds them at the end
        l1 = l1 * alpha1 + sum1;
#pragma unroll
        for (int j = 0; j < NT_O; ++j) {
            acc[j][0] *= alpha0;
            acc[j][1] *= alpha0;
            acc[j][2] *= alpha1;
            acc[j][3] *= alpha1;
        }

        // Context slice += P E[:, slice]: E rows are the k dimension (ldmatrix .trans).
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            // Lanes 0-7 / 8-15 address rows kk*16 + 0-7 / 8-15 of column tile j, 16-31 tile j+1.
            const u32 addr = e_base + ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PITCH +
                                       (lane >> 4) * 8) * 2;
#pragma unroll
            for (int j = 0; j < NT_O; j += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, addr + j * 8 * 2);
                mma16816(acc[j], pa[kk], b0, b1);
                mma16816(acc[j + 1], pa[kk], b2, b3);
            }
        }
        __syncwarp();  // this stage is refilled next step
    }
    cp_async_wait<0>();

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    u16* o0 = out + (i64)t0 * stride_ot + (g0 % num_heads) * stride_oh + col0 + tig * 2;
    u16* o1 = out + (i64)t1 * stride_ot + (g1 % num_heads) * stride_oh + col0 + tig * 2;
#pragma unroll
    for (int j = 0; j < NT_O; ++j) {
        if (v0) *(u32*)(o0 + j * 8) = pack2(acc[j][0] * inv0, acc[j][1] * inv0);
        if (v1) *(u32*)(o1 + j * 8) = pack2(acc[j][2] * inv1, acc[j][3] * inv1);
    }
}
