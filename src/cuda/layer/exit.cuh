/*
 * layer/exit.cuh - the chain's last step and its trace marks: k_exit (my done
 * flag for the epoch, which the next k_enter of every rank waits for) and
 * k_mark (trace intervals of the steps whose kernels record nothing
 * themselves: GEMM0, GEMM1 and the plan builder).
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
 * interval: which 0 and 1 are GEMM0 and GEMM1 (their own lanes), 2 the plan
 * (the stream's lane; index: 0 the routing copy, 1 and 2 the builder's
 * count and fill-and-finish kernels, each with the launch gap before it; 2
 * the whole builder where the sequential one runs). The kernels
 * of those steps record nothing themselves. */
__global__ void k_mark(comet_cuda_ctx_t c, int which, int end, int index) {
    if (!end) {
        c.state->mark_begin[which] = globaltimer();
        return;
    }
    if (which == 2)
        trace_rec(&c, 0, COMET_TRACE_HOST, 0, COMET_TRACE_PLAN, index, -1, c.state->mark_begin[2]);
    else
        trace_rec(&c, 9 + which, COMET_TRACE_GEMM, which, which ? COMET_TRACE_GEMM1 : COMET_TRACE_GEMM0, -1, -1,
                  c.state->mark_begin[which]);
}

__global__ void k_exit(comet_cuda_ctx_t c) {
    __threadfence_system();
    st_release_sys(&flags_of(&c, c.d.rank)->done, c.state->epoch);
}
