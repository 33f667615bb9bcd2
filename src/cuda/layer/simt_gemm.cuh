/*
 * layer/simt_gemm.cuh - the SIMT fallback of the expert GEMMs, correct for
 * any shape: simple grouped GEMM tiles, 64 rows x 64 columns per block, 256
 * threads, 4x4 outputs per thread, fp32 accumulation, out = A (rows, K) *
 * B (N, K)^T (tile_mac, any strides). k_gemm0 (h = act(a W1^T)) and k_gemm1
 * (o = h W2^T), used by the sequential chain where the Hopper GEMM is not
 * (comet_gemm_check rejects the shapes, the GPU is not sm_90, or the SIMT
 * path is forced: backend.c); the backward's tiles (backward.cuh) share
 * tile_mac.
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers (one unit, not
 * relocatable device code, so that device functions shared between steps
 * still inline and the kernels compile as they did in one file).
 * Not here either: the Hopper grouped GEMM (gemm.cu), which runs wherever
 * it can.
 */

#define TILE 64
#define TK 32

/* acc[i][j] += sum_k A(ty*4 + i, k) * B(tx*4 + j, k), k ascending, with A(r, k)
 * at a[r * ars + k * aks] (r < rows) and B(n, k) at b[n * bns + k * bks] (n <
 * cols): the forward's operands are K-major (aks = bks = 1), the backward's
 * transposed weights and its weight gradients' row operands are not. Tiles
 * load along whichever index is contiguous. */
__device__ static void tile_mac(const comet_bf16_t *a, int64_t ars, int64_t aks, int rows, const comet_bf16_t *b,
                                int64_t bns, int64_t bks, int cols, int64_t kdim, float acc[4][4]) {
    __shared__ float as[TK][TILE + 1], bs[TK][TILE + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int64_t k0 = 0; k0 < kdim; k0 += TK) {
        for (int i = threadIdx.x; i < TILE * TK; i += blockDim.x) {
            const int ra = aks == 1 ? i / TK : i % TILE, ka = aks == 1 ? i % TK : i / TILE;
            const int rb = bks == 1 ? i / TK : i % TILE, kb = bks == 1 ? i % TK : i / TILE;
            as[ka][ra] = ra < rows && k0 + ka < kdim ? comet_bf16_to_f32(a[ra * ars + (k0 + ka) * aks]) : 0.0f;
            bs[kb][rb] = rb < cols && k0 + kb < kdim ? comet_bf16_to_f32(b[rb * bns + (k0 + kb) * bks]) : 0.0f;
        }
        __syncthreads();
        for (int k = 0; k < TK; k++)
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] += as[k][ty * 4 + i] * bs[k][tx * 4 + j];
        __syncthreads();
    }
}

/* h = act(a W1^T): columns [n0, n0+64) of the activation; gated uses W1 rows
 * n (gate) and F_local + n (up). With c.store_gu (training) also the
 * pre-activation, rounded to bf16, into c.dh: [g|u] (gated) or g. */
__global__ void k_gemm0(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, fl = c.d.ffn_local, n0 = (int64_t)blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, gated = c.d.activation == 0;
    const int cols = (int)(fl - n0 < TILE ? fl - n0 : TILE);
    for (int bi = blockIdx.y; bi < p.totals->num_blocks; bi += gridDim.y) {
        const comet_plan_block_t blk = p.blocks[bi];
        const comet_bf16_t *w1 = c.w1 + (int64_t)blk.expert * c.d.w1_rows * hd;
        for (int r0 = 0; r0 < blk.num_rows; r0 += TILE) {
            const int rows = blk.num_rows - r0 < TILE ? blk.num_rows - r0 : TILE;
            const comet_bf16_t *a = c.a + (int64_t)(blk.row_start + r0) * hd;
            float g[4][4] = {{0}}, u[4][4] = {{0}};
            tile_mac(a, hd, 1, rows, w1 + n0 * hd, hd, 1, cols, hd, g);
            if (gated) tile_mac(a, hd, 1, rows, w1 + (fl + n0) * hd, hd, 1, cols, hd, u);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    int r = ty * 4 + i, n = tx * 4 + j;
                    if (r >= rows || n >= cols) continue;
                    const int64_t row = blk.row_start + r0 + r;
                    float v = gated ? comet_silu(g[i][j]) * u[i][j] : comet_gelu(g[i][j]);
                    c.h[row * fl + n0 + n] = comet_f32_to_bf16(v);
                    if (c.store_gu) {
                        c.dh[row * c.d.w1_rows + n0 + n] = comet_f32_to_bf16(g[i][j]);
                        if (gated) c.dh[row * c.d.w1_rows + fl + n0 + n] = comet_f32_to_bf16(u[i][j]);
                    }
                }
        }
    }
}

/* o = h W2^T: columns [c0, c0+64) of hidden. */
__global__ void k_gemm1(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, fl = c.d.ffn_local, c0 = (int64_t)blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int cols = (int)(hd - c0 < TILE ? hd - c0 : TILE);
    for (int bi = blockIdx.y; bi < p.totals->num_blocks; bi += gridDim.y) {
        const comet_plan_block_t blk = p.blocks[bi];
        const comet_bf16_t *w2 = c.w2 + (int64_t)blk.expert * hd * fl;
        for (int r0 = 0; r0 < blk.num_rows; r0 += TILE) {
            const int rows = blk.num_rows - r0 < TILE ? blk.num_rows - r0 : TILE;
            float acc[4][4] = {{0}};
            tile_mac(c.h + (int64_t)(blk.row_start + r0) * fl, fl, 1, rows, w2 + c0 * fl, fl, 1, cols, fl, acc);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    int r = ty * 4 + i, n = tx * 4 + j;
                    if (r < rows && n < cols) c.o[(int64_t)(blk.row_start + r0 + r) * hd + c0 + n] = comet_f32_to_bf16(acc[i][j]);
                }
        }
    }
}
