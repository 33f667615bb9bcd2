/*
 * layer/exit.cuh - the chain's last step and its trace marks: k_exit (my done
 * flag for the epoch, which the next k_enter of every rank waits for) and
 * k_mark (trace intervals of the steps whose kernels record nothing
 * themselves: the GEMMs, the weight gradients and the plan builder).
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers (one unit, not
 * relocatable device code, so that device functions shared between steps
 * still inline and the kernels compile as they did in one file).
 * Not here either: the launches of the marks (layer_chain.cu's host side).
 * Needs flags.cuh.
 */

/* Trace: mark where a step starts (end 0) or record it (end 1) as one
 * interval, by which step (enum mark_step): the GEMMs on their own lanes
 * (GEMM0, and the backward's recompute, G and dW2 on the first; GEMM1, dX
 * and dW1 on the second), the plan on the stream's lane (index: 0 the
 * routing copy, 1 and 2 the builder's count and fill-and-finish kernels,
 * each with the launch gap before it; 2 the whole builder where the
 * sequential one runs). The kernels of those steps record nothing
 * themselves. */
enum mark_step { MARK_GEMM0, MARK_GEMM1, MARK_PLAN, MARK_BWD_G, MARK_BWD_DX, MARK_DW2, MARK_DW1, MARK_STEPS };

__global__ void k_mark(comet_cuda_ctx_t c, int which, int end, int index) {
    static_assert(MARK_STEPS <= sizeof c.state->mark_begin / sizeof c.state->mark_begin[0], "a begin slot a step");
    if (!end) {
        c.state->mark_begin[which] = globaltimer();
        return;
    }
    const uint64_t t0 = c.state->mark_begin[which];
    switch (which) {
    case MARK_PLAN: trace_rec(&c, 0, COMET_TRACE_HOST, 0, COMET_TRACE_PLAN, index, -1, t0); break;
    case MARK_GEMM0: trace_rec(&c, 9, COMET_TRACE_GEMM, 0, COMET_TRACE_GEMM0, -1, -1, t0); break;
    case MARK_GEMM1: trace_rec(&c, 10, COMET_TRACE_GEMM, 1, COMET_TRACE_GEMM1, -1, -1, t0); break;
    case MARK_BWD_G: trace_rec(&c, 9, COMET_TRACE_GEMM, 0, COMET_TRACE_BGEMM0, -1, -1, t0); break;
    case MARK_BWD_DX: trace_rec(&c, 10, COMET_TRACE_GEMM, 1, COMET_TRACE_BGEMM1, -1, -1, t0); break;
    case MARK_DW2: trace_rec(&c, 9, COMET_TRACE_GEMM, 0, COMET_TRACE_WGRAD, -1, 2, t0); break; /* aux: dW2 */
    default: trace_rec(&c, 10, COMET_TRACE_GEMM, 1, COMET_TRACE_WGRAD, -1, 1, t0); break;       /* dW1 */
    }
}

__global__ void k_exit(comet_cuda_ctx_t c) {
    __threadfence_system();
    st_release_sys(&flags_of(&c, c.d.rank)->done, c.state->epoch);
}
