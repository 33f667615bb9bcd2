/*
 * layer_chain.cu - the CUDA layer: one forward as a chain of kernels on the
 * caller's stream, with no host synchronisation (cuda_layer.h lists the
 * steps and the flag protocol): the sequential chain, and the overlapped
 * mode (Hopper GEMM): k_dispatch_ov with GEMM0 as its programmatic
 * dependent; GEMM1 on every SM (pushing its rows home with the push
 * combine), then the combine.
 *
 * The expert GEMMs run on the Hopper grouped GEMM (gemm.cu) when the shapes
 * suit it (comet_gemm_check), else on the SIMT tiles of layer/simt_gemm.cuh,
 * which are correct for any shape.
 *
 * This file is the layer's one translation unit: its kernels live in rooms by
 * protocol step under layer/, included below in chain order (the device
 * functions they share inline across them, with no relocatable device code):
 *   layer/flags.cuh      memory-order accesses, waits, trace records, copies
 *   layer/stage.cuh      k_enter, k_stage, k_plan, k_gather_routing
 *   layer/dispatch.cuh   k_dispatch, k_dispatch_ov (row counts, block_ready)
 *   layer/simt_gemm.cuh  k_gemm0, k_gemm1 (the SIMT fallback)
 *   layer/combine.cuh    signal + combine: k_final, k_final_flat
 *   layer/backward.cuh   the backward's steps and the training forward's save
 *   layer/exit.cuh       k_exit, k_mark
 * Here itself: the host side (warm-up, launch_gemm, comet_cuda_forward_launch,
 * forward_chain, comet_cuda_backward_launch, backward_chain). Not here: the plan builder (plan_kernel.cu), the Hopper
 * GEMM (gemm.cu), the buffers and the replay (backend.c, replay.c).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#define COMET_PLAN_DEVICE_ONLY
#define COMET_PLAN_API static __device__
#include "../plan/plan_impl.h"

#include "cuda_layer.h"
#include "gemm.h"
#include "gemm_wgrad.h"
#include "plan_kernel.h"
#include "vec8.h"
#include "../core/saved.h"
#include "../trace/trace.h"
#include "comet.h"

#include "layer/flags.cuh"
#include "layer/stage.cuh"
#include "layer/dispatch.cuh"
#include "layer/simt_gemm.cuh"
#include "layer/combine.cuh"
#include "layer/backward.cuh"
#include "layer/exit.cuh"

/* ---------------------------------------------------------------------------
 * Host side
 * ------------------------------------------------------------------------- */

extern "C" const void *comet_cuda_enter_kernel(void) { return (const void *)k_enter; }

/* Load every kernel of the layer now: with lazy module loading, a kernel
 * loaded for the first time while another spins on a flag can deadlock. */
extern "C" int comet_cuda_layer_warm(void) {
    const void *fns[] = {(const void *)k_enter, (const void *)k_stage, (const void *)k_plan,
                         (const void *)k_gather_routing,
                         (const void *)k_dispatch, (const void *)k_gemm0, (const void *)k_gemm1,
                         (const void *)k_final,
                         (const void *)k_final_flat, (const void *)k_exit,
                         (const void *)k_dispatch_ov,
                         (const void *)k_mark, (const void *)k_bwd_g, (const void *)k_dw_rows,
                         (const void *)k_scale_dy, (const void *)k_wgrad, (const void *)k_bwd_dx,
                         (const void *)k_dtopkw, (const void *)k_save, (const void *)k_save_header};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
        cudaFuncAttributes a;
        cudaError_t e = cudaFuncGetAttributes(&a, fns[i]);
        if (e != cudaSuccess) return (int)e;
    }
    return comet_gemm_warm();
}

/* Trace: step `which` (exit.cuh's mark_step) begins (end 0) or ends (end 1)
 * here on the stream; nothing when not tracing. */
static void mark(const comet_cuda_ctx_t *c, int which, int end, cudaStream_t stream) {
    if (c->tr_events) k_mark<<<1, 1, 0, stream>>>(*c, which, end, -1);
}

/* Hopper GEMM `which` (0 or 1) with hooks, marked for the trace (a launch
 * programmatically dependent on the kernel before it, hooks->pdl, must follow
 * that kernel directly: its begin mark goes before that kernel instead).
 * GEMM0 of a training call (c->store_gu) also stores gu: a saving forward's
 * gu and h straight into the caller's saved state (c->saved; GEMM1 reads h
 * there), the backward's recompute gu into c->dh. */
static int launch_gemm(const comet_cuda_ctx_t *c, int which, const comet_gemm_hooks_t *hooks, cudaStream_t stream) {
    if (!hooks->pdl) mark(c, which, 0, stream);
    const comet_gemm_t *g = (const comet_gemm_t *)c->gemm;
    comet_gemm_train_t t;
    memset(&t, 0, sizeof t);
    t.gu = c->saved ? (comet_bf16_t *)(c->saved + comet_saved_gu_offset(&c->d)) : c->dh, t.sched = c->train_sched;
    t.h = c->saved ? (comet_bf16_t *)(c->saved + comet_saved_h_offset(&c->d)) : NULL;
    const int ge = which         ? (c->saved ? comet_gemm1_train_launch(g, &t, stream, hooks)
                                             : comet_gemm1_launch(g, stream, hooks))
                   : c->store_gu ? comet_gemm0_train_launch(g, &t, stream, hooks)
                                 : comet_gemm0_launch(g, stream, hooks);
    if (ge != cudaSuccess) return ge;
    mark(c, which, 1, stream);
    return cudaSuccess;
}

static int forward_chain(const comet_cuda_ctx_t *ctx, cudaStream_t stream);
static int backward_chain(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, cudaStream_t stream);

/* The sequential SIMT GEMM0 (h, and gu where c.store_gu asks for it). */
static void simt_gemm0(const comet_cuda_ctx_t *c, cudaStream_t stream) {
    const unsigned blocks_y = (unsigned)(c->d.max_blocks < 65535 ? c->d.max_blocks : 65535);
    k_gemm0<<<dim3((unsigned)((c->d.ffn_local + TILE - 1) / TILE), blocks_y), 256, 0, stream>>>(*c);
}

/* A launch's errors are read with cudaGetLastError after the chain: an
 * error the caller's own earlier call left there (not sticky) is not the
 * chain's, and returning early on it would leave the epoch half entered. */
static void drop_earlier_error(void) { (void)cudaGetLastError(); }

/* Every call's entry (forward and backward): the epoch entered with this
 * call's tensors, my inputs staged, the plan's first step. */
static void enter_steps(const comet_cuda_ctx_t &c, const comet_cuda_call_t *call, int grid, cudaStream_t stream) {
    drop_earlier_error();
    k_enter<<<1, 1, 0, stream>>>(c, *call);
    k_stage<<<grid, 256, 0, stream>>>(c);
    k_plan<<<1, 32, 0, stream>>>(c);
}

extern "C" int comet_cuda_forward_launch(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, void *stream_ptr) {
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    const comet_cuda_ctx_t c = *ctx;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    enter_steps(c, call, grid, stream);
    const int e = forward_chain(&c, stream);
    if (e != cudaSuccess) return e;
    if (c.store_gu) { /* training: gu and h in the caller's saved state (the SIMT tiles' copied there) */
        if (!c.saved) k_save<<<grid, 256, 0, stream>>>(c);
        k_save_header<<<1, 1, 0, stream>>>(c);
    }
    k_exit<<<1, 1, 0, stream>>>(c);
    return (int)cudaGetLastError();
}

extern "C" int comet_cuda_backward_launch(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call,
                                          void *stream_ptr) {
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    const comet_cuda_ctx_t c = *ctx;
    enter_steps(c, call, c.num_sms > 0 ? c.num_sms : 132, stream);
    const int e = backward_chain(&c, call, stream);
    if (e != cudaSuccess) return e;
    k_exit<<<1, 1, 0, stream>>>(c);
    return (int)cudaGetLastError();
}

/* Tracing: the plan step `step` ends here and the next begins (the
 * builder's hook between its kernels; arg is the comet_cuda_ctx_t). */
static cudaError_t plan_mark(void *arg, int step, cudaStream_t stream) {
    const comet_cuda_ctx_t *c = (const comet_cuda_ctx_t *)arg;
    k_mark<<<1, 1, 0, stream>>>(*c, MARK_PLAN, 1, step);
    k_mark<<<1, 1, 0, stream>>>(*c, MARK_PLAN, 0, -1);
    return cudaGetLastError();
}

/* Every rank's routing copied here, then my plan built from it. */
static int plan_steps(const comet_cuda_ctx_t *ctx, cudaStream_t stream) {
    const comet_cuda_ctx_t c = *ctx;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    mark(&c, MARK_PLAN, 0, stream);
    k_gather_routing<<<grid, 256, 0, stream>>>(c);
    if (c.tr_events) {
        const cudaError_t me = plan_mark((void *)&c, 0, stream);
        if (me != cudaSuccess) return (int)me;
    }
    comet_plan_input_t in;
    in.token_count = c.state->token_count; /* device addresses inside the state */
    in.topk_idx = (const int32_t *const *)c.state->route_idx;
    in.topk_w = (const float *const *)c.state->route_w;
    cudaError_t pe = comet_cuda_plan_build(&c.d, &in, c.plan_ws, c.plan_scratch, &c.state->skip, stream,
                                           c.tr_events ? plan_mark : NULL, (void *)&c);
    if (pe != cudaSuccess) return (int)pe;
    if (c.tr_events) k_mark<<<1, 1, 0, stream>>>(c, MARK_PLAN, 1, 2);
    return cudaSuccess;
}

static int forward_chain(const comet_cuda_ctx_t *ctx, cudaStream_t stream) {
    const comet_cuda_ctx_t c = *ctx;
    const comet_dims_t *d = &c.d;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    const unsigned blocks_y = (unsigned)(d->max_blocks < 65535 ? d->max_blocks : 65535);
    const int pe = plan_steps(&c, stream);
    if (pe != cudaSuccess) return pe;
    if (c.gemm && c.n_comm > 0) { /* overlapped: n_comm pulling CTAs, then their SMs join GEMM0 */
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms; /* programmatic dependent of the pulls: CTAs start as SMs come free */
        hooks.pdl = 1;
        hooks.timeout_ns = c.timeout_ns;
        hooks.block_ready = c.block_ready;
        hooks.l0_order = 1; /* the pulls complete blocks in this order */
        hooks.epoch = &c.state->epoch; /* device address inside the state */
        hooks.timeout_report = c.gemm_report;
        const int gemm_on = !(c.disable & COMET_DISABLE_GEMM);
        if (gemm_on) mark(&c, MARK_GEMM0, 0, stream);
        k_dispatch_ov<<<grid, COMM_THREADS, 0, stream>>>(c);
        int ge = gemm_on ? launch_gemm(&c, 0, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
        hooks.block_ready = NULL;
        hooks.pdl = 0;
        /* layer 1: GEMM1 on every SM, pushing rows home with the push combine; the combine follows */
        hooks.num_ctas = c.num_sms;
        /* measurement without communication: no pushes either (the pushes ride inside GEMM1, so
         * "comm only" (no GEMMs) has none: there the figure covers layer 0's pulls and the combine) */
        hooks.push = c.push && !(c.disable & COMET_DISABLE_COMM);
        ge = gemm_on ? launch_gemm(&c, 1, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
    } else if (c.gemm) { /* sequential, Hopper grouped GEMM (measurements: one side left out, c.disable) */
        const int gemm_on = !(c.disable & COMET_DISABLE_GEMM), comm_on = !(c.disable & COMET_DISABLE_COMM);
        if (comm_on) k_dispatch<<<grid, COMM_THREADS, 0, stream>>>(c);
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms;
        int ge = gemm_on ? launch_gemm(&c, 0, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
        hooks.push = c.push && comm_on; /* o rows to their home ranks too: the combine then reads local memory */
        ge = gemm_on ? launch_gemm(&c, 1, &hooks, stream) : 0;
        if (ge != cudaSuccess) return ge;
    } else { /* sequential, SIMT tiles */
        k_dispatch<<<grid, COMM_THREADS, 0, stream>>>(c);
        mark(&c, MARK_GEMM0, 0, stream);
        simt_gemm0(&c, stream);
        mark(&c, MARK_GEMM0, 1, stream);
        mark(&c, MARK_GEMM1, 0, stream);
        k_gemm1<<<dim3((unsigned)((d->hidden + TILE - 1) / TILE), blocks_y), 256, 0, stream>>>(c);
        mark(&c, MARK_GEMM1, 1, stream);
    }
    if (final_flat(&c))
        k_final_flat<<<grid, COMM_THREADS, 0, stream>>>(c);
    else
        k_final<<<grid, COMM_THREADS, 0, stream>>>(c);
    return (int)cudaGetLastError();
}

/* The backward's data steps (cuda_layer.h; comet.h's steps in brackets),
 * the sequential chain: x and dy rows pulled (dy into o); gu and h
 * recomputed unless saved [1]; G, dH and the rows' <G, a> per column tile
 * [2, 4]; <G, a> per row into dwr [3]; bf16(w dy) in o; dW2 [7]; dX into o
 * (with push also into its home rank's recv) [5]; signal and combine with
 * weights 1 into dx [6]; d_topk_w [3]; dW1 [7]. G, dX, the recompute and
 * the weight gradients run on the Hopper GEMMs where the forward's does
 * (c.gemm; gemm_wgrad.h takes every shape gemm.h does), else on the SIMT
 * tiles. The SIMT tiles write dH over the recomputed gu (each element read,
 * then written, by the one thread that owns it); the Hopper G does not take
 * that (measured: dH wrong), so its recompute stores gu into c.gu. */
/* The backward's two weight gradients on the Hopper k-grouped GEMM
 * (gemm_wgrad.h), prepared for this call before its chain (host only; the
 * outputs and the saved state move per call): dW2 (0: a = bf16(w dy) in o,
 * b = the activations, saved or recomputed) and dW1 (1: a = dH, b = the
 * gathered x rows). */
extern "C" int comet_cuda_wgrad_prepare(const comet_cuda_ctx_t *c, const comet_cuda_call_t *call, void *out[2],
                                        char *err, size_t err_len) {
    const comet_dims_t *d = &c->d;
    out[0] = out[1] = NULL;
    for (int which = 0; which < 2; which++) {
        comet_wgrad_args_t wa;
        memset(&wa, 0, sizeof wa);
        wa.d = *d, wa.plan_ws = c->plan_ws;
        wa.m = which ? d->w1_rows : d->hidden, wa.n = which ? d->hidden : d->ffn_local;
        wa.a = which ? c->dh : c->o;
        wa.b = which ? c->a
               : call->save == COMET_SAVE_ACTIVATIONS ? (const comet_bf16_t *)(call->saved + comet_saved_h_offset(d))
                                                      : c->h;
        wa.c = which ? call->dw1 : call->dw2;
        wa.out = call->accumulate ? COMET_WGRAD_F32_ADD : call->wgrad_fp32 >> which & 1 ? COMET_WGRAD_F32 : COMET_WGRAD_BF16;
        if (comet_wgrad_prepare(&wa, (comet_wgrad_t **)&out[which], err, err_len) != 0) {
            comet_cuda_wgrad_destroy(out);
            return -1;
        }
    }
    return 0;
}

extern "C" void comet_cuda_wgrad_destroy(void *w[2]) {
    for (int which = 0; which < 2; which++) comet_wgrad_destroy((comet_wgrad_t *)w[which]), w[which] = NULL;
}

static int launch_wgrad(const comet_cuda_ctx_t *c, int which, cudaStream_t stream) {
    comet_wgrad_hooks_t hooks = {&c->state->skip, c->num_sms};
    return comet_wgrad_launch((const comet_wgrad_t *)c->wgrad[which], stream, &hooks); /* maps: launch parameters */
}

static int backward_chain(const comet_cuda_ctx_t *ctx, const comet_cuda_call_t *call, cudaStream_t stream) {
    const comet_cuda_ctx_t c = *ctx;
    const comet_dims_t *d = &c.d;
    const int grid = c.num_sms > 0 ? c.num_sms : 132;
    const unsigned blocks_y = (unsigned)(d->max_blocks < 65535 ? d->max_blocks : 65535);
    const int pe = plan_steps(&c, stream);
    if (pe != cudaSuccess) return pe;
    /* measurements (Hopper GEMM only, c.disable): communication = the pulls of x and dy, the combine and
     * d_topk_w's sum over the TP ranks; the GEMMs = the recompute, G, dW2, dX, dW1 and the row steps
     * between them (k_dw_rows, k_scale_dy) */
    const int gemm_on = !(c.disable & COMET_DISABLE_GEMM), comm_on = !(c.disable & COMET_DISABLE_COMM);
    if (comm_on) k_dispatch<<<grid, COMM_THREADS, 0, stream>>>(c);
    const unsigned el = (unsigned)d->experts_local;
    const unsigned th = (unsigned)((d->hidden + TILE - 1) / TILE), tf = (unsigned)((d->ffn_local + TILE - 1) / TILE);
    const unsigned t1 = (unsigned)((d->w1_rows + TILE - 1) / TILE);
    int64_t dwp_tiles = bwd_g_tiles(d);
    if (c.gemm) {
        const comet_gemm_t *g = (const comet_gemm_t *)c.gemm;
        comet_gemm_hooks_t hooks;
        memset(&hooks, 0, sizeof hooks);
        hooks.skip = &c.state->skip;
        hooks.num_ctas = c.num_sms;
        comet_gemm_train_t t;
        memset(&t, 0, sizeof t);
        t.sched = c.train_sched;
        const int saved = call->save == COMET_SAVE_ACTIVATIONS;
        t.gu = saved ? (comet_bf16_t *)(call->saved + comet_saved_gu_offset(d)) : c.gu;
        t.h = saved ? (comet_bf16_t *)(call->saved + comet_saved_h_offset(d)) : NULL; /* NULL: c.h */
        t.dy = c.o, t.dh = c.dh, t.dwp = c.dwp, t.dx = c.o;
        dwp_tiles = comet_gemm_dwp_tiles(d);
        if (gemm_on) {
            int ge = cudaSuccess;
            if (c.store_gu) { /* the recompute: GEMM0 again */
                mark(&c, MARK_GEMM0, 0, stream);
                ge = comet_gemm0_train_launch(g, &t, stream, &hooks);
                mark(&c, MARK_GEMM0, 1, stream);
            }
            mark(&c, MARK_BWD_G, 0, stream);
            if (ge == cudaSuccess) ge = comet_gemm_g_launch(g, &t, stream, &hooks);
            if (ge != cudaSuccess) return ge;
            mark(&c, MARK_BWD_G, 1, stream);
            k_dw_rows<<<grid, 256, 0, stream>>>(c, dwp_tiles);
            k_scale_dy<<<grid * SCALE_DY_BLOCKS_PER_SM, 256, 0, stream>>>(c);
            mark(&c, MARK_DW2, 0, stream);
            ge = launch_wgrad(&c, 0, stream);
            if (ge != cudaSuccess) return ge;
            mark(&c, MARK_DW2, 1, stream);
            hooks.push = c.push && comm_on;
            mark(&c, MARK_BWD_DX, 0, stream);
            ge = comet_gemm_dx_launch(g, &t, stream, &hooks);
            if (ge != cudaSuccess) return ge;
            mark(&c, MARK_BWD_DX, 1, stream);
        }
    } else {
        if (c.store_gu) simt_gemm0(&c, stream); /* recompute: gu into dh, h into h */
        k_bwd_g<<<dim3((unsigned)dwp_tiles, blocks_y), 256, 0, stream>>>(c);
        k_dw_rows<<<grid, 256, 0, stream>>>(c, dwp_tiles);
        k_scale_dy<<<grid * SCALE_DY_BLOCKS_PER_SM, 256, 0, stream>>>(c);
        k_wgrad<<<dim3(th, tf, el), 256, 0, stream>>>(c, 0);
        k_bwd_dx<<<dim3(th, blocks_y), 256, 0, stream>>>(c);
    }
    if (final_flat(&c))
        k_final_flat<<<grid, COMM_THREADS, 0, stream>>>(c);
    else
        k_final<<<grid, COMM_THREADS, 0, stream>>>(c);
    if (comm_on) k_dtopkw<<<grid, 256, 0, stream>>>(c);
    if (c.gemm) {
        if (gemm_on) mark(&c, MARK_DW1, 0, stream);
        const int ge = gemm_on ? launch_wgrad(&c, 1, stream) : cudaSuccess;
        if (ge != cudaSuccess) return ge;
        if (gemm_on) mark(&c, MARK_DW1, 1, stream);
    } else {
        k_wgrad<<<dim3(t1, th, el), 256, 0, stream>>>(c, 1);
    }
    return (int)cudaGetLastError();
}
