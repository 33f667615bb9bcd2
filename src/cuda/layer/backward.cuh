/*
 * layer/backward.cuh - the backward's own steps (include/comet.h,
 * "Backward"), on the SIMT tiles of simt_gemm.cuh (tile_mac), in chain
 * order: k_bwd_g (G = dy W2, the activation's backward into dH, each row's
 * <G, a> per 64-column tile), k_dw_rows (those tiles summed in ascending
 * order into dwr, which the home ranks read), k_scale_dy (the gathered dy
 * rows become bf16(w dy)), k_wgrad (the k-grouped weight gradients: dW2 =
 * sum bf16(w dy)^T a, dW1 = sum dH^T x, per local expert, the expert's rows
 * in plan order as the reduction), k_bwd_dx (dX = dH W1 into o, which the
 * forward's combine then sums home with weights 1), k_dtopkw (d_topk_w of my
 * tokens from the slots' dwr on every TP rank, ascending); and the training
 * forward's k_save (gu and h into the caller's saved state, the header
 * last).
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers. Needs flags.cuh
 * and simt_gemm.cuh.
 */

/* Column tiles of k_bwd_g, each a partial of a row's <G, a> in c.dwp. */
__host__ __device__ static inline int64_t bwd_g_tiles(const comet_dims_t *d) { return (d->ffn_local + TILE - 1) / TILE; }

/* The call's gu and a (= h): the saved state's, or (recomputed) dh and h. */
__device__ static inline const comet_bf16_t *bwd_gu(const comet_cuda_ctx_t &c) {
    const comet_cuda_call_t *a = &c.state->call;
    return a->save == COMET_SAVE_ACTIVATIONS ? (const comet_bf16_t *)(a->saved + comet_saved_gu_offset(&c.d)) : c.dh;
}
__device__ static inline const comet_bf16_t *bwd_h(const comet_cuda_ctx_t &c) {
    const comet_cuda_call_t *a = &c.state->call;
    return a->save == COMET_SAVE_ACTIVATIONS ? (const comet_bf16_t *)(a->saved + comet_saved_h_offset(&c.d)) : c.h;
}

/* G[r, n] = sum_c dy[r, c] W2_e[c, n] for columns [n0, n0 + 64) of F_local
 * (dy: the gathered rows in o); then, per element, dA = w G and the
 * activation's backward from gu's bf16 values (comet.h step 4) into dH
 * (c.dh; in place of gu when recomputed: each element is read and written
 * by one thread), and the row's <G, a> over the tile (the 16 threads of a
 * row, their columns ascending, then a fixed shuffle tree) into dwp. */
__global__ void k_bwd_g(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, fl = c.d.ffn_local, r1 = c.d.w1_rows, n0 = (int64_t)blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, gated = c.d.activation == 0;
    const int cols = (int)(fl - n0 < TILE ? fl - n0 : TILE);
    const comet_bf16_t *gu = bwd_gu(c), *ha = bwd_h(c);
    for (int bi = blockIdx.y; bi < p.totals->num_blocks; bi += gridDim.y) {
        const comet_plan_block_t blk = p.blocks[bi];
        const comet_bf16_t *w2 = c.w2 + (int64_t)blk.expert * hd * fl;
        for (int r0 = 0; r0 < blk.num_rows; r0 += TILE) {
            const int rows = blk.num_rows - r0 < TILE ? blk.num_rows - r0 : TILE;
            float acc[4][4] = {{0}};
            tile_mac(c.o + (int64_t)(blk.row_start + r0) * hd, hd, 1, rows, w2 + n0, 1, fl, cols, hd, acc);
            for (int i = 0; i < 4; i++) {
                const int r = ty * 4 + i;
                const int64_t row = blk.row_start + r0 + r;
                const float w = r < rows ? p.rows[row].weight : 0.0f;
                float part = 0.0f;
                for (int j = 0; j < 4; j++) {
                    const int64_t n = n0 + tx * 4 + j;
                    if (r >= rows || tx * 4 + j >= cols) continue;
                    const float G = acc[i][j], dA = w * G, g = comet_bf16_to_f32(gu[row * r1 + n]);
                    part += G * comet_bf16_to_f32(ha[row * fl + n]);
                    if (gated) {
                        float dg, du;
                        comet_silu_gated_backward(g, comet_bf16_to_f32(gu[row * r1 + fl + n]), dA, &dg, &du);
                        c.dh[row * r1 + n] = comet_f32_to_bf16(dg);
                        c.dh[row * r1 + fl + n] = comet_f32_to_bf16(du);
                    } else {
                        c.dh[row * r1 + n] = comet_f32_to_bf16(dA * comet_gelu_grad(g));
                    }
                }
                for (int off = 8; off > 0; off /= 2) part += __shfl_xor_sync(0xffffffffu, part, off, 16);
                if (tx == 0 && r < rows) c.dwp[row * bwd_g_tiles(&c.d) + blockIdx.x] = part;
            }
        }
    }
}

/* Each valid row's <G, a>: its nt tiles' partials (k_bwd_g's, or the Hopper
 * G's) summed in ascending order from 0, into my dwr (read by the token's
 * home rank). */
__global__ void k_dw_rows(comet_cuda_ctx_t c, int64_t nt) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t n = p.totals->num_rows_padded;
    float *dwr = (float *)(c.sym + c.lay.dwr);
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += (int64_t)gridDim.x * blockDim.x) {
        if (p.rows[r].src_rank < 0) continue;
        float s = 0.0f;
        for (int64_t t = 0; t < nt; t++) s += c.dwp[r * nt + t];
        dwr[r] = s;
    }
}

/* The gathered dy rows (in o) become bf16(w dy), dW2's left operand: a warp
 * a row, each lane 8 columns an access, four accesses in flight (the
 * chain launches it with SCALE_DY_BLOCKS_PER_SM blocks a multiprocessor:
 * bandwidth, not latency; one thread an element read 0.69 ms on Mixtral's
 * 8192 rows of an H100, the bytes take ~0.05 ms). */
#define SCALE_DY_BLOCKS_PER_SM 8
__global__ void k_scale_dy(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, rows = p.totals->num_rows_padded;
    const int vec = hd % 8 == 0, lane = threadIdx.x % 32;
    const int64_t nw = (int64_t)gridDim.x * blockDim.x / 32;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw) {
        const comet_plan_row_t pr = p.rows[r];
        if (pr.src_rank < 0) continue;
        comet_bf16_t *row = c.o + r * hd;
        for (int64_t j0 = (int64_t)lane * 8; j0 < hd; j0 += 4 * 256) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t j = j0 + u * 256;
                v[u] = j < hd ? ld8_bf16(row + j, (int)(hd - j < 8 ? hd - j : 8), vec) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t j = j0 + u * 256;
                if (j >= hd) break;
                float f[8];
#pragma unroll
                for (int i = 0; i < 8; i++) f[i] = pr.weight * bf16_at(v[u], i);
                st8_bf16(row + j, f, (int)(hd - j < 8 ? hd - j : 8), vec);
            }
        }
    }
}

/* One weight gradient, k-grouped: for local expert blockIdx.z, out[m, n] =
 * sum over the expert's valid rows r (plan order, ascending) of A[r, m]
 * B[r, n] (A (rows, m_dim), B (rows, n_dim), row-major), fp32, then stored
 * bf16 or fp32, or added to fp32 (accumulate; an expert without rows keeps
 * its values). dw2 (which 0): A = bf16(w dy) (in o), B = a; dw1 (which 1):
 * A = dH, B = the gathered x rows. Tiles of 64 x 64 over (blockIdx.x: m,
 * blockIdx.y: n). */
__global__ void k_wgrad(comet_cuda_ctx_t c, int which) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const comet_cuda_call_t *call = &c.state->call;
    const comet_bf16_t *a = which ? c.dh : c.o, *b = which ? c.a : bwd_h(c);
    const int64_t m_dim = which ? c.d.w1_rows : c.d.hidden, n_dim = which ? c.d.hidden : c.d.ffn_local;
    void *out = which ? call->dw1 : call->dw2;
    const int fp32 = call->wgrad_fp32 >> which & 1;
    const int e = blockIdx.z, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int64_t m0 = (int64_t)blockIdx.x * TILE, n0 = (int64_t)blockIdx.y * TILE;
    const int rows = (int)(m_dim - m0 < TILE ? m_dim - m0 : TILE), cols = (int)(n_dim - n0 < TILE ? n_dim - n0 : TILE);
    const int64_t start = p.expert_start[e], count = p.expert_count[e];
    if (count == 0 && call->accumulate) return;
    float acc[4][4] = {{0}};
    tile_mac(a + start * m_dim + m0, 1, m_dim, rows, b + start * n_dim + n0, 1, n_dim, cols, count, acc);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            const int r = ty * 4 + i, n = tx * 4 + j;
            if (r >= rows || n >= cols) continue;
            const int64_t at = ((int64_t)e * m_dim + m0 + r) * n_dim + n0 + n;
            if (call->accumulate)
                ((float *)out)[at] += acc[i][j];
            else if (fp32)
                ((float *)out)[at] = acc[i][j];
            else
                ((comet_bf16_t *)out)[at] = comet_f32_to_bf16(acc[i][j]);
        }
}

/* dX[r, c] = sum_k dH[r, k] W1_e[k, c] for columns [c0, c0 + 64) of H, into
 * o as bf16 (pulled home by the combine). */
__global__ void k_bwd_dx(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const int64_t hd = c.d.hidden, r1 = c.d.w1_rows, c0 = (int64_t)blockIdx.x * TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int cols = (int)(hd - c0 < TILE ? hd - c0 : TILE);
    for (int bi = blockIdx.y; bi < p.totals->num_blocks; bi += gridDim.y) {
        const comet_plan_block_t blk = p.blocks[bi];
        const comet_bf16_t *w1 = c.w1 + (int64_t)blk.expert * r1 * hd;
        for (int r0 = 0; r0 < blk.num_rows; r0 += TILE) {
            const int rows = blk.num_rows - r0 < TILE ? blk.num_rows - r0 : TILE;
            float acc[4][4] = {{0}};
            tile_mac(c.dh + (int64_t)(blk.row_start + r0) * r1, r1, 1, rows, w1 + c0, 1, hd, cols, r1, acc);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    const int r = ty * 4 + i, n = tx * 4 + j;
                    if (r < rows && n < cols)
                        c.o[(int64_t)(blk.row_start + r0 + r) * hd + c0 + n] = comet_f32_to_bf16(acc[i][j]);
                }
        }
    }
}

/* d_topk_w of my tokens (after the combine, which waited for every rank's
 * o_ready: so every rank's dwr is complete; each CTA acquires it again):
 * slot j of token t sums the <G, a> slices of the TP ranks of its expert's
 * EP group in ascending tp, from 0 (comet.h step 3). */
__global__ void k_dtopkw(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    const uint64_t e = c.state->epoch;
    comet_sym_flags_t *mine = flags_of(&c, c.d.rank);
    if (threadIdx.x == 0)
        for (int q = 0; q < c.d.world_size; q++) wait_geq(&mine->o_ready[q], e, &c, "d_topk_w: dwr of rank", q);
    __syncthreads();
    const comet_cuda_call_t *call = &c.state->call;
    const int64_t k = c.d.topk, n = call->num_tokens * k, el = c.d.experts_local;
    const int32_t *idx = (const int32_t *)(c.sym + c.lay.topk_idx);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int g = (int)(idx[i] / el);
        float s = 0.0f;
        for (int tpi = 0; tpi < c.d.tp; tpi++) {
            const int q = g * c.d.tp + tpi;
            comet_plan_t pq;
            comet_plan_carve(&c.d, c.peers[q] + c.lay.plan, &pq);
            const int32_t row = pq.row_of_slot[(int64_t)c.d.rank * c.d.max_tokens * k + i];
            if (row >= 0) s += ((const float *)(c.peers[q] + c.lay.dwr))[row]; /* a slot's group has its row */
        }
        call->d_topk_w[i] = s;
    }
}

/* Training forward: gu (c.dh) and h of every plan row into the caller's
 * saved state (src/core/saved.h), whole padded rows. */
__global__ void k_save(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    unsigned char *sv = c.state->call.saved;
    const size_t rows = (size_t)p.totals->num_rows_padded;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (size_t)gridDim.x * blockDim.x;
    copy_wide(sv + comet_saved_gu_offset(&c.d), c.dh, rows * (size_t)c.d.w1_rows * 2, tid, nth);
    copy_wide(sv + comet_saved_h_offset(&c.d), c.h, rows * (size_t)c.d.ffn_local * 2, tid, nth);
}

/* The saved state's header, after its rows (the kernel before). */
__global__ void k_save_header(comet_cuda_ctx_t c) {
    if (c.state->skip) return;
    comet_plan_t p;
    comet_plan_carve(&c.d, c.plan_ws, &p);
    const comet_cuda_call_t *call = &c.state->call;
    comet_saved_header_t *hd = (comet_saved_header_t *)call->saved;
    hd->layer_id = call->layer_id;
    hd->tokens = call->num_tokens;
    hd->rows = p.totals->num_rows;
    __threadfence();
    hd->magic = COMET_SAVED_MAGIC;
}
