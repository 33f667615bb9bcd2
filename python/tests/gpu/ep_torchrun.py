"""ep_torchrun.py - comet.torch over a torch.distributed group, one GPU a
process (needs a CUDA build of comet and >= 2 GPUs):

    torchrun --standalone --nproc-per-node 2 python/tests/gpu/ep_torchrun.py

For each EP size in (world size, 1) - the whole group, then the sub-groups
of a DP x EP mesh (consecutive ranks, ranks outside a sub-group take no
part in its world) - and each save mode ("activations", "recompute"):
every rank makes its comet world with comet.torch.world_from_group(ep
group), holds experts [r*E/EP, (r+1)*E/EP) of one set of full weights (the
same seed everywhere) in a MoEExperts, and runs its own tokens (T differs
per rank). Checked against the pure-torch semantics on the full weights:

  - y: within one bf16 step of h and o, |y - y_ref| <= 2^-6 |y_ref| + 2^-8
    (the GEMMs add in another order; as test_torch.py's CUDA test);
  - the backward (x, topk_w, w1, w2 gradients of sum(y * r)): against
    float64 autograd of the exact model, the expert weights' gradients
    summed over the EP group's tokens (an all_reduce of the references),
    within 8 bf16 ulps of each row's scale (4 for topk_w, over the whole
    tensor; test_autograd.py's bounds).
  - with transformers installed: patch_model(tiny Mixtral, ep group) against
    the unpatched model on the same tokens (logits within 2^-8 of their
    max, as test_hf.py).

Prints one line per check and "ep_torchrun: N passed, N failed, N skipped"
on rank 0; exits 1 on a failure. A build whose CUDA backend has no backward
yet (comet.Unsupported) counts the backward checks as skipped."""

import os
import sys

import torch
import torch.distributed as dist

import comet
import comet.torch as ct

H, F, E, TOPK = 256, 128, 8, 2
counts = {"passed": 0, "failed": 0, "skipped": 0}


def report(rank, what, ok, detail=""):
    state = "passed" if ok is True else "skipped" if ok is None else "failed"
    counts[state] += 1
    print("rank %d: %s: %s%s" % (rank, what, state.upper(), " (%s)" % detail if detail else ""), flush=True)


def full_weights(device):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.empty(E, 2 * F, H).uniform_(-1, 1, generator=g) * 0.1).bfloat16()
    down = (torch.empty(E, H, F).uniform_(-1, 1, generator=g) * 0.1).bfloat16()
    return gate_up.to(device), down.to(device)


def tokens(rank, device):
    g = torch.Generator().manual_seed(100 + rank)
    T = 96 + 37 * rank
    x = torch.empty(T, H).uniform_(-1, 1, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]).int()
    w = torch.empty(T, TOPK).uniform_(0.1, 1, generator=g)
    r = torch.empty(T, H).uniform_(-1, 1, generator=g)
    return [t.to(device) for t in (x, idx, w, r)]


def semantics(x, idx, w, w1, w2, dtype):
    """y of comet.h's layer in `dtype` (float32: with its bf16 rounding
    points; float64: exact), differentiable."""
    y = torch.zeros(x.shape, dtype=dtype, device=x.device)
    rnd = (lambda t: t.bfloat16().to(dtype)) if dtype == torch.float32 else (lambda t: t)
    for j in range(idx.shape[1]):
        e = idx[:, j].long()
        gu = torch.einsum("trh,th->tr", w1[e].to(dtype), x.to(dtype))
        h = rnd(torch.nn.functional.silu(gu[:, :F]) * gu[:, F:])
        o = rnd(torch.einsum("thf,tf->th", w2[e].to(dtype), h))
        y = y + w[:, j:j + 1].to(dtype) * o
    return y


def within_ulps(got, exact, ulps, per_row):
    exact = exact.double()
    scale = exact.pow(2).mean(dim=-1, keepdim=True).sqrt() if per_row else exact.pow(2).mean().sqrt()
    err = (got.double() - exact).abs() / (2.0 ** -7 * scale).clamp_min(1e-300)
    worst = float(err.max())
    return worst <= ulps, "worst %.3g bf16 ulps of the row's scale, bound %d" % (worst, ulps)


def check_experts(rank, ep, group, save, device):
    world = ct.world_from_group(group)
    r_ep = dist.get_rank(group)
    gate_up, down = full_weights(device)
    module = ct.MoEExperts.from_fused(gate_up, down, ep=ep, rank=r_ep, world=world, topk=TOPK,
                                      max_tokens_per_rank=256, save=save).requires_grad_()
    x, idx, w, r = tokens(rank, device)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    tag = "EP=%d save=%s" % (ep, save)
    y = module(xl, idx, wl)
    ct.synchronize()
    ref = semantics(x, idx, w, gate_up, down, torch.float32).bfloat16().float()
    err = (y.detach().float() - ref).abs() - (2 ** -6 * ref.abs() + 2 ** -8)
    report(rank, tag + ": forward vs pure torch", bool((err <= 0).all()),
           "max |y - ref| %.3g" % float((y.detach().float() - ref).abs().max()))
    try:
        (y.float() * r).sum().backward()
        torch.cuda.synchronize()
        ct.synchronize()
        backward = True
    except comet.Unsupported as e:
        report(rank, tag + ": backward", None, "this build's CUDA backend has no backward: %s" % e.message)
        backward = False
    if backward:
        leaves = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
        y64 = semantics(leaves[0], idx, leaves[1], leaves[2], leaves[3], torch.float64)
        (y64 * r.double()).sum().backward()
        dw1, dw2 = leaves[2].grad, leaves[3].grad
        dist.all_reduce(dw1, group=group)
        dist.all_reduce(dw2, group=group)
        El = E // ep
        mine = slice(r_ep * El, (r_ep + 1) * El)
        for name, got, exact, ulps, per_row in (("dx", xl.grad, leaves[0].grad, 8, True),
                                                 ("d_topk_w", wl.grad, leaves[1].grad, 4, False),
                                                 ("dw1", module.w1.grad, dw1[mine], 8, True),
                                                 ("dw2", module.w2.grad, dw2[mine], 8, True)):
            ok, detail = within_ulps(got, exact, ulps, per_row)
            report(rank, "%s: %s vs float64 autograd" % (tag, name), ok, detail)
    module.close()
    world.close()


def check_patch_model(rank, ep, group, device):
    try:
        import transformers
    except ImportError:
        report(rank, "patch_model EP=%d" % ep, None, "transformers is not installed")
        return
    import copy

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=128, num_local_experts=E,
                                     num_experts_per_tok=TOPK, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    patched = ct.patch_model(copy.deepcopy(model), group, max_tokens_per_rank=64)
    ids = torch.randint(0, 128, (2, 16 + 4 * rank), generator=torch.Generator().manual_seed(rank)).to(device)
    with torch.no_grad():
        ref, out = model(input_ids=ids).logits, patched(input_ids=ids).logits
    err = float((out - ref).abs().max())
    report(rank, "patch_model EP=%d: logits vs the unpatched model" % ep, err <= 2 ** -8 * float(ref.abs().max()),
           "max |diff| %.3g" % err)
    for m in patched.modules():
        if isinstance(m, ct.MoEExperts):
            m.close()


def main():
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    if comet.device_count() == 0:
        print("ep_torchrun: skipped (this comet has no CUDA backend: %s)" % comet.build_info().get("reason"))
        dist.destroy_process_group()
        return 0
    for ep in sorted({size, 1}, reverse=True):
        # the EP groups of a DP x EP mesh: consecutive ranks; every rank creates every group
        groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, size, ep)]
        group = groups[rank // ep]
        for save in ("activations", "recompute"):
            check_experts(rank, ep, group, save, device)
        check_patch_model(rank, ep, group, device)
        dist.barrier()
    total = torch.tensor([counts["passed"], counts["failed"], counts["skipped"]], device=device)
    dist.all_reduce(total)
    if rank == 0:
        print("ep_torchrun: %d passed, %d failed, %d skipped" % tuple(total.tolist()), flush=True)
    dist.destroy_process_group()
    return 1 if int(total[1]) else 0


if __name__ == "__main__":
    sys.exit(main())
