
// ---- Tensor-core attention forward (FlashAttention-2 algorithm), bf16 in, f32 accumulation, bf16 out
// plus f32 LSE; head dim 64 or 128, and 256/384/512 with the output split over blocks (below); sm_80 and
// later (mma.sync m16n8k16, ldmatrix, cp.async).
//
// Block = WARPS warps, each owning MT m16 tiles = 16·MT query rows (BR = 16·MT·WARPS rows) of one
// (batch, head); K/V blocks of BC keys. Shared memory: Q [BR × D], then 2 stages of K [BC × D] and
// V [BC × D], all bf16 with the 16-byte chunks of a row XOR-swizzled (chunk c of row r at c ^ (r & 7))
// so cp.async writes and ldmatrix reads are bank-conflict free. Q's A-fragments stay in registers
// (QREG) or are reloaded from shared memory per k-step; with MT = 2 each K/V fragment read by ldmatrix
// feeds two MMAs, halving shared-memory traffic per MMA. Per K/V block j:
//   wait block j (cp.async) → barrier → issue the cp.async of block j+1 into the other stage →
//   S = Q·Kᵀ (mma.sync, f32) → mask keys ≥ kv_len (last block only) → online softmax in base 2 on raw
//   scores (m = running row max, p = 2^(s·c − m·c), c = scale·log2 e, thread-partial row sums l) →
//   O = O·α (skipped when no row of the warp has a new max: α = 1 exactly) → O += P·V with P rounded
//   to bf16 (the S accumulator layout is the A-fragment layout of P).
// End: quad-sum l, out = O / l (0 when l = 0), lse = m·scale + ln l (−∞ when l = 0).
// Requires scale > 0 (the max is taken on raw scores) and 16-byte aligned rows (D·H·2 % 16 == 0).
//
// Wide heads (D > 128, e.g. the Wan VAE's one head of 384): the O accumulator of all D columns would need
// MT·D/2 registers per thread (192 at D = 384, MT = 1) on top of S, so a block computes only DV = 128 of
// the output columns: blockIdx.y = head·(D/DV) + slice, the block streams V's columns
// [slice·DV, slice·DV + DV) only, and S = Q·Kᵀ over the full D is recomputed by each of the D/DV slices.
// That costs (D/DV − 1) extra Q·Kᵀ products (1.5× the FLOPs of a fused kernel at D = 384), but keeps the
// register footprint near the D = 128 variants' (ptxas: 212–255 registers, no spills, for the four
// wide variants below); the VAE runs this once per frame, a few ms per video.
// Every slice computes the same m and l; slice 0 writes the LSE. DV = D is the ordinary kernel.

#if __CUDA_ARCH__ >= 800

namespace flash {


// c += a·b, m16n8k16, bf16 operands, f32 accumulator.
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled tile of ROWB-byte rows.
template <int ROWB>
__device__ __forceinline__ unsigned swz(int r, int c) {
    return (unsigned)(r * ROWB + ((c ^ (r & 7)) << 4));
}

// Issues the cp.async of rows [row0, row0 + ROWS) of a [rows, H, D] slice (token stride `tok`) into a
// swizzled tile at `dst`; rows ≥ limit are zero-filled.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(unsigned dst, const bf16* base, int row0, int limit, i64 tok) {
    constexpr int CH = D / 8;
    static_assert((ROWS * CH) % THREADS == 0, "tile chunks must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CH / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS;
        const int r = idx / CH, c = idx % CH;
        const int g = row0 + r;
        const bool ok = g < limit;
        cp_async16(dst + swz<D * 2>(r, c), base + (i64)(ok ? g : 0) * tok + c * 8, ok);
    }
}

template <int D, int DV, int WARPS, int MT, int BC, bool QREG>
__device__ __forceinline__ void fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                    const bf16* __restrict__ v, bf16* __restrict__ out, float* __restrict__ lse,
                                    int seq_q, int seq_k, int heads, int kv_len, float scale) {
    static_assert(D % DV == 0 && DV % 16 == 0, "the output slices must tile the head dim");
    constexpr int WR = 16 * MT;  // query rows per warp (MT m16 tiles)
    constexpr int BR = WR * WARPS, THREADS = 32 * WARPS, ROWB = D * 2;
    constexpr int VROWB = DV * 2;  // bytes of one key's V slice
    constexpr int KT = D / 16;   // k-steps of Q·Kᵀ
    constexpr int NT = BC / 8;   // 8-key column tiles of S
    constexpr int DT = DV / 8;   // 8-wide column tiles of this block's O slice
    constexpr int SLICES = D / DV;
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned sq = smem_addr(smem);
    const unsigned sk = sq + BR * ROWB;      // 2 stages of K
    const unsigned sv = sk + 2 * BC * ROWB;  // 2 stages of V's slice

    const int b = blockIdx.z, h = blockIdx.y / SLICES, q0 = blockIdx.x * BR;
    const int col0 = (blockIdx.y % SLICES) * DV;  // first output column of this block
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 tok = (i64)heads * D;
    const bf16* qb = q + (i64)b * seq_q * tok + (i64)h * D;
    const bf16* kb = k + (i64)b * seq_k * tok + (i64)h * D;
    const bf16* vb = v + (i64)b * seq_k * tok + (i64)h * D + col0;
    const float c = scale * 1.4426950408889634f;  // scale·log2 e
    const int nblk = (kv_len + BC - 1) / BC;

    load_tile<D, BR, THREADS>(sq, qb, q0, seq_q, tok);
    cp_commit();
    if (nblk > 0) {
        load_tile<D, BC, THREADS>(sk, kb, 0, kv_len, tok);
        load_tile<DV, BC, THREADS>(sv, vb, 0, kv_len, tok);
    }
    cp_commit();

    // Q A-fragments: m-tile mt, k-step kk. Kept in registers (QREG) or reloaded from shared memory.
    auto q_frag = [&](int mt, int kk, unsigned* a) {
        const int r = warp * WR + mt * 16 + (lane & 15), ch = 2 * kk + (lane >> 4);
        ldsm_x4(sq + swz<ROWB>(r, ch), a[0], a[1], a[2], a[3]);
    };
    cp_wait<1>();
    __syncthreads();
    unsigned qf[QREG ? MT : 1][QREG ? KT : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) q_frag(mt, kk, qf[mt][kk]);
    }

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    // Row statistics of rows g and g + 8 of each m-tile: m[2mt + half], l likewise.
    float m[2 * MT], l[2 * MT];
#pragma unroll
    for (int i = 0; i < 2 * MT; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }

    for (int j = 0; j < nblk; ++j) {
        const int stage = j & 1;
        cp_wait<0>();
        __syncthreads();  // block j is in; every warp is done with block j − 1 (the other stage)
        if (j + 1 < nblk) {
            load_tile<D, BC, THREADS>(sk + (stage ^ 1) * BC * ROWB, kb, (j + 1) * BC, kv_len, tok);
            load_tile<DV, BC, THREADS>(sv + (stage ^ 1) * BC * VROWB, vb, (j + 1) * BC, kv_len, tok);
        }
        cp_commit();
        const unsigned kt = sk + stage * BC * ROWB, vt = sv + stage * BC * VROWB;

        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NT; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            unsigned qa[MT][4];
            if constexpr (!QREG) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) q_frag(mt, kk, qa[mt]);
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int key = np * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int ch = 2 * kk + ((lane >> 3) & 1);
                unsigned b0, b1, b2, b3;
                ldsm_x4(kt + swz<ROWB>(key, ch), b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const unsigned* a = QREG ? qf[QREG ? mt : 0][QREG ? kk : 0] : qa[mt];
                    mma(s[mt][2 * np], a, b0, b1);
                    mma(s[mt][2 * np + 1], a, b2, b3);
                }
            }
        }

        if ((j + 1) * BC > kv_len) {  // the partial last block: mask keys ≥ kv_len
            const int lim = kv_len - j * BC;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (nt * 8 + 2 * (lane & 3) + (e & 1) >= lim) s[mt][nt][e] = -INFINITY;
        }

        // Online softmax. Key j·BC < kv_len, so each row has a finite score and the new max is finite.
        float alpha[2 * MT];
        bool rescale = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = 2 * mt + hf;
                float mx = m[i];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                alpha[i] = ex2((m[i] - mx) * c);  // 0 on the first block (m = −∞), 1 when the max stays
                rescale |= mx != m[i];
                m[i] = mx;
                const float mc = mx * c;
                float rs = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    s[mt][nt][2 * hf] = ex2(fmaf(s[mt][nt][2 * hf], c, -mc));
                    s[mt][nt][2 * hf + 1] = ex2(fmaf(s[mt][nt][2 * hf + 1], c, -mc));
                    rs += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
                }
                l[i] = l[i] * alpha[i] + rs;
            }
        }
        // O·α only when some row of the warp has a new max (α = 1 exactly otherwise).
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o[mt][dt][0] *= alpha[2 * mt];
                    o[mt][dt][1] *= alpha[2 * mt];
                    o[mt][dt][2] *= alpha[2 * mt + 1];
                    o[mt][dt][3] *= alpha[2 * mt + 1];
                }
        }

        // O += P·V: P's A fragment for keys 16kk..16kk+15 is S tiles 2kk and 2kk+1.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < DV / 16; ++dp) {
                const int key = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                const int ch = 2 * dp + (lane >> 4);
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(vt + swz<VROWB>(key, ch), b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma(o[mt][2 * dp], a[mt], b0, b1);
                    mma(o[mt][2 * dp + 1], a[mt], b2, b3);
                }
            }
        }
    }
    cp_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = 2 * mt + hf;
            float sum = l[i];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int r = q0 + warp * WR + mt * 16 + hf * 8 + (lane >> 2);
            if (r < seq_q) {
                bf16* orow = out + ((i64)b * seq_q + r) * tok + (i64)h * D + col0 + 2 * (lane & 3);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    *(unsigned*)(orow + dt * 8) = pack_bf16(o[mt][dt][2 * hf] * inv, o[mt][dt][2 * hf + 1] * inv);
                if ((lane & 3) == 0 && col0 == 0)
                    lse[((i64)b * heads + h) * seq_q + r] = sum > 0.0f ? m[i] * scale + logf(sum) : -INFINITY;
            }
        }
    }
}

}  // namespace flash

#define FLASH_BODY(D, DV, W, MT, BC, QR) \
    flash::fwd<D, DV, W, MT, BC, QR != 0>(q, k, v, out, lse, seq_q, seq_k, heads, kv_len, scale);
#else
#define FLASH_BODY(D, DV, W, MT, BC, QR)
#endif

// flash_fwd_d<D>_w<WARPS>_m<MT>_bc<BC>_q<QREG>_mb<MIN_BLOCKS> (whole head per block), and
// flash_fwd_d<D>_v<DV>_w…: output sliced into D/DV blocks per head (grid.y = heads·D/DV). The variants
// are listed in kernels/src/cuda/attention_kernel.rs (FLASH_VARIANTS), which also gives the dynamic
// shared memory: (16·MT·WARPS + 2·BC)·D·2 + 2·BC·DV·2 bytes.
#define FLASH_KERNEL(NAME, D, DV, W, MT, BC, QR, MB) \
    extern "C" __global__ void __launch_bounds__(32 * W, MB) NAME( \
        const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int seq_q, int seq_k, int heads, \
        int kv_len, float scale) { \
        FLASH_BODY(D, DV, W, MT, BC, QR) \
    }
#define FLASH(D, W, MT, BC, QR, MB) \
    FLASH_KERNEL(flash_fwd_d##D##_w##W##_m##MT##_bc##BC##_q##QR##_mb##MB, D, D, W, MT, BC, QR, MB)
#define FLASH_SLICED(D, DV, W, MT, BC, QR, MB) \
    FLASH_KERNEL(flash_fwd_d##D##_v##DV##_w##W##_m##MT##_bc##BC##_q##QR##_mb##MB, D, DV, W, MT, BC, QR, MB)
FLASH(128, 8, 2, 64, 0, 1)
FLASH(128, 4, 2, 64, 0, 2)
FLASH(128, 8, 2, 32, 0, 1)
FLASH(128, 4, 2, 32, 0, 2)
FLASH(128, 8, 2, 32, 1, 1)
FLASH(128, 8, 1, 128, 1, 1)
FLASH(128, 8, 1, 64, 1, 1)
FLASH(64, 4, 2, 64, 1, 2)
FLASH(64, 8, 2, 64, 1, 1)
FLASH(64, 4, 1, 64, 1, 2)
FLASH_SLICED(256, 128, 4, 2, 32, 0, 1)
FLASH_SLICED(384, 128, 4, 2, 32, 0, 1)
FLASH_SLICED(384, 128, 8, 1, 64, 0, 1)
FLASH_SLICED(512, 128, 8, 1, 32, 0, 1)
