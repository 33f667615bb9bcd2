"""test_distributed.py - comet.torch.world_from_group without GPUs: three
gloo processes (torch.multiprocessing, a file rendezvous) check

  1. the unique id's broadcast: rank 0 of the group makes the bytes, every
     rank of the group gets them; in a sub-group (global ranks 1 and 2) its
     rank 0 (global 1) makes them and rank 0 of the world takes no part;
  2. a failure to make the id on the group's rank 0 reaches every rank of
     the group (no rank waits in the broadcast);
  3. world_from_group on a machine without GPUs (or a CPU-only comet):
     RuntimeError saying a world over processes needs GPUs, before any
     communication;
  4. without torch.distributed initialized: RuntimeError.
The world itself (NCCL, GPUs): python/tests/gpu/run_ep.py under torchrun.
Skipped as a whole without torch."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: comet.torch is not tested")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available")

import comet.torch as ct  # noqa: E402

WORLD = 3


def _worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=WORLD)
    try:
        out = {}
        made = {}

        def make(tag):
            def f():
                made[tag] = bytes((tag * 31 + i) % 256 for i in range(128))
                return made[tag]
            return f

        out["world"] = ct._broadcast_id(None, make(1))
        sub = dist.new_group([1, 2])  # collective over the whole world
        if rank in (1, 2):
            out["sub"] = ct._broadcast_id(sub, make(2))

            def fail():
                raise OSError("no id here")
            try:
                ct._broadcast_id(sub, fail)
            except Exception as e:  # noqa: BLE001 - its type and message are the result
                out["fail"] = "%s: %s" % (type(e).__name__, e)
        out["made"] = sorted(made)
        if not torch.cuda.is_available():
            try:
                ct.world_from_group(sub if rank in (1, 2) else None)
            except RuntimeError as e:
                out["no_gpu"] = str(e)
        dist.barrier()
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_unique_id_broadcast_over_groups(tmp_path):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=WORLD, join=True,
                       start_method="spawn")
    want_world = bytes((31 + i) % 256 for i in range(128))
    want_sub = bytes((62 + i) % 256 for i in range(128))
    for rank in range(WORLD):
        assert results[rank]["world"] == want_world
    assert results[0]["made"] == [1] and results[1]["made"] == [2] and results[2]["made"] == []
    assert "sub" not in results[0]
    assert results[1]["sub"] == results[2]["sub"] == want_sub
    assert results[1]["fail"] == "OSError: no id here"
    assert results[2]["fail"].startswith("RuntimeError: world_from_group: rank 0 of the group could not make")
    if not torch.cuda.is_available():
        for rank in range(WORLD):
            assert "runs comet's CUDA backend, one GPU per rank" in results[rank]["no_gpu"]
            assert "torch sees no GPU" in results[rank]["no_gpu"]


def test_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ct.world_from_group()
