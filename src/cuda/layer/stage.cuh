/*
 * layer/stage.cuh - the chain's steps before the plan is built: k_enter (the
 * call's tensors into the state, the next epoch, wait until every rank is done
 * with the last), k_stage (x and the routing, and the backward's dy, into my
 * symmetric stage; the device routing check and the backward's check of its
 * saved state's header), k_plan (publish my entry, wait for every rank's,
 * decide whether the epoch runs) and k_gather_routing (every rank's staged
 * routing copied local for the plan builder; the overlapped dispatch's row
 * counts zeroed).
 *
 * What it is not: a header to include on its own. It is one room of a single
 * translation unit, src/cuda/layer_chain.cu, which includes the rooms in
 * chain order after the plan, context and vector headers (one unit, not
 * relocatable device code, so that device functions shared between steps
 * still inline and the kernels compile as they did in one file).
 * Not here either: the plan builder itself (plan_kernel.cu, launched by
 * layer_chain.cu's host side after k_gather_routing). Needs flags.cuh.
 */

/* Wait until every rank is done with the last epoch, then the call's tensors
 * into the state (every kernel after this one reads them there) and the next
 * epoch. A layer's calls on different streams are ordered on the host
 * (backend.c's order_calls), so the last epoch's k_enter has run. */
__global__ void k_enter(comet_cuda_ctx_t c, comet_cuda_call_t call) {
    comet_cuda_state_t *s = c.state;
    uint64_t e = s->epoch + 1;
    /* every rank done with the last epoch (this one's kernels too), then the call replaces its state */
    for (int q = 0; q < c.d.world_size; q++) wait_geq(&flags_of(&c, q)->done, e - 1, &c, "enter: done of rank", q);
    s->call = call;
    s->epoch = e;
    s->own_status = 0;
}

__global__ void k_stage(comet_cuda_ctx_t c) {
    const comet_cuda_call_t a = c.state->call;
    if (a.host_status) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(&c.state->own_status, a.host_status);
        return;
    }
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (size_t)gridDim.x * blockDim.x;
    const int64_t t = a.num_tokens, k = c.d.topk;
    copy_wide(c.sym + c.lay.x, a.x, (size_t)(t * c.d.hidden) * 2, tid, nth);
    copy_wide(c.sym + c.lay.topk_idx, a.topk_idx, (size_t)(t * k) * 4, tid, nth);
    copy_wide(c.sym + c.lay.topk_w, a.topk_w, (size_t)(t * k) * 4, tid, nth);
    if (a.pass == 1) copy_wide(c.sym + c.lay.dy, a.dy, (size_t)(t * c.d.hidden) * 2, tid, nth);
    if (a.pass == 0 && a.save == COMET_SAVE_ACTIVATIONS && tid == 0) /* valid again once k_save_header runs */
        ((comet_saved_header_t *)a.saved)->magic = 0;
    if (a.pass == 1 && a.save == COMET_SAVE_ACTIVATIONS && tid == 0) { /* the saved state's header */
        const comet_saved_header_t *hd = (const comet_saved_header_t *)a.saved;
        if (hd->magic != COMET_SAVED_MAGIC || hd->layer_id != a.layer_id || hd->tokens != t)
            atomicMax(&c.state->own_status, 1u /* COMET_ERR_INVALID_ARGUMENT */);
    }
    for (size_t i = tid; i < (size_t)t; i += nth) { /* the routing check of include/comet.h */
        const int32_t *row = a.topk_idx + i * k;
        int bad = 0;
        for (int64_t j = 0; j < k; j++) {
            bad |= row[j] < 0 || row[j] >= c.d.num_experts;
            for (int64_t m = 0; m < j; m++) bad |= row[m] == row[j];
        }
        if (bad) atomicMax(&c.state->own_status, 3u /* COMET_ERR_INVALID_ROUTING */);
    }
    __threadfence_system();
}

/* Publish my staged inputs, wait for every rank's; decide whether this
 * epoch runs. */
__global__ void k_plan(comet_cuda_ctx_t c) {
    if (threadIdx.x != 0) return;
    comet_cuda_state_t *s = c.state;
    const uint64_t e = s->epoch, t0 = TRACE_T0;
    const uint64_t mode = c.protocol; /* every rank must run the same (comet_cuda_protocol_word) */
    comet_sym_flags_t *own = flags_of(&c, c.d.rank);
    own->status = s->own_status;
    own->token_count = (uint64_t)s->call.num_tokens;
    own->mode = mode;
    __threadfence_system();
    st_release_sys(&own->entry, e);
    uint32_t bad = 0, other_mode = 0;
    for (int q = 0; q < c.d.world_size; q++) {
        comet_sym_flags_t *f = flags_of(&c, q);
        wait_geq(&f->entry, e, &c, "plan: entry of rank", q);
        bad |= f->status != 0;
        other_mode |= f->mode != mode;
        s->token_count[q] = (int64_t)f->token_count;
    }
    s->skip = bad | other_mode;
    s->last_status = s->own_status ? s->own_status
                     : bad         ? 4u  /* COMET_ERR_PEER_FAILED */
                     : other_mode  ? 1u  /* COMET_ERR_INVALID_ARGUMENT: the ranks' protocols differ */
                                   : 0u;
    trace_rec(&c, 0, COMET_TRACE_HOST, 0, COMET_TRACE_BARRIER, 1, -1, t0);
    /* the plan itself: comet_cuda_plan_build, launched next */
}

/* Every rank's staged routing copied here by all CTAs, so that the plan
 * builder reads local memory instead of waiting on remote loads; and, in the
 * overlapped mode, the dispatch's row counts per block zeroed. */
__global__ void k_gather_routing(comet_cuda_ctx_t c) {
    comet_cuda_state_t *s = c.state;
    if (s->skip) return;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (size_t)gridDim.x * blockDim.x;
    if (c.n_comm > 0) /* the overlapped dispatch counts rows per block from 0 */
        for (size_t b = tid; b < (size_t)c.d.max_blocks; b += nth) c.block_rows[b] = 0;
    for (int q = 0; q < c.d.world_size; q++) {
        const size_t n = (size_t)(s->token_count[q] * c.d.topk) * 4;
        copy_wide(s->route_idx[q], s->peer_idx[q], n, tid, nth);
        copy_wide(s->route_w[q], s->peer_w[q], n, tid, nth);
    }
}
