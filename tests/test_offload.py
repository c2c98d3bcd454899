"""`parallel.cpu_offload` on the DTensor path: the quantized storage (NF4 and HQQ) lives in host memory, is
loaded there, is never registered where `to_empty` or a state dict would see it, and training computes
exactly what it computes with the storage on the device. World size 1 in this process, world size 2 in two
spawned gloo processes."""

from __future__ import annotations

import os

import torch
from conftest import free_port, spawn

from qshard.config import resolve

STEPS = 2


# The quantized storage kinds offloaded: NF4 (with fp32 or double-quantized scales) and HQQ.
METHODS = ("nf4", "nf4-dq", "hqq")


def _build(model_dir: str, env, method: str, offload: bool, *extra: tuple[str, str]):
    from qshard.build import build_model

    quant = [("quant.method", "nf4"), ("quant.double_quant", "true")] if method == "nf4-dq" else \
        [("quant.method", method)]
    cfg = resolve(None, [("train.train_type", "qlora"), *quant, ("train.precision", "fp32"),
                         ("parallel.quant_sharding", "dtensor"), ("parallel.cpu_offload", str(offload).lower()),
                         *extra])
    model, _ = build_model(cfg, env, model_dir)
    return model


def _quantized(model):
    from qshard.quant import QuantizedLinear as QUANTIZED_LINEARS

    return [m for m in model.modules() if isinstance(m, QUANTIZED_LINEARS)]


def _train(model, steps: int) -> list[float]:
    """A few AdamW steps on the adapters on fixed batches (the same on every rank: the losses are compared
    as they are, and FSDP2 averages the identical gradients)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _check_offloaded(model) -> None:
    layers = _quantized(model)
    assert layers
    for layer in layers:
        assert layer.offloaded is not None
        for name in layer.STORAGE:
            host = getattr(layer, name)
            assert type(host) is torch.Tensor and host.device.type == "cpu"  # this rank's shard, not a DTensor
            assert host.is_pinned() == torch.cuda.is_available()
            assert host.data_ptr() == layer.offloaded.host[layer.STORAGE.index(name)].data_ptr()
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_buffers()}
    # Out of to_empty's and the state dict's reach.
    assert not names & {name for layer in layers for name in layer.STORAGE}


def _check_embedding_and_head_stay(model, world_size: int) -> None:
    """The frozen embedding and head are not offloaded: used in place on one device (plain tensors, no unit),
    in units without an offload policy on several; the blocks' units offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    def policy(module):
        return module._get_fsdp_state()._fsdp_param_group.offload_policy

    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if world_size == 1:
            assert not isinstance(module, FSDPModule) and type(module.weight) is torch.nn.Parameter
        else:
            assert isinstance(module, FSDPModule) and not isinstance(policy(module), CPUOffloadPolicy)
    assert isinstance(policy(model.model.layers[0]), CPUOffloadPolicy)


def test_host_adamw_is_fused_and_steps_as_foreach_does():
    """AdamW on the host (cpu_offload, CPU runs) takes the fused kernel: no temporary the size of the second
    moments, one pass over the state; its step is foreach's within float rounding."""
    from qshard.config import OptimConfig
    from qshard.train.optim import build_optimizer

    def stepped(fused: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1), torch.device("cpu"))
        assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]
        if not fused:
            optimizer.defaults["fused"] = False
            for group in optimizer.param_groups:
                group["fused"], group["foreach"] = False, True
        for _ in range(3):
            model(torch.randn(4, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach() for p in model.parameters()]

    for got, want in zip(stepped(True), stepped(False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_host_gradient_norm_splits_the_work_and_finds_the_same_norm():
    """Host gradients (cpu_offload, CPU runs) are normed by several threads at once: every tensor in exactly one
    share, the shares about equal, the norm torch's within float rounding and the same bits for any number of
    threads; a non-finite gradient still shows in it; clipping with it scales as clipping with torch's norm does."""
    from qshard.train.optim import HOST_NORM_WORKERS, HostNorm, _norm, _shares, clip_grad_norm, grad_norm

    g = torch.Generator().manual_seed(0)
    sizes = [(64, 512), (512, 64), (64, 96), (96, 64), (7,), (3, 3), (64, 512)] + [(i + 1, 33) for i in range(40)]
    grads = [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate(sizes)] + [torch.randn(40).bfloat16()]
    shares = _shares(grads, 3)
    assert len(shares) == 3 and sorted(id(t) for s in shares for t in s) == sorted(id(t) for t in grads)
    loads = [sum(t.numel() for t in s) for s in shares]
    assert max(loads) - min(loads) <= max(t.numel() for t in grads)
    found = HostNorm(3)(grads)
    assert all(torch.equal(found, HostNorm(workers)(grads)) for workers in (1, 2, 5))
    torch.testing.assert_close(found, _norm([t.float() for t in grads]), rtol=1e-6, atol=0)
    assert not torch.isfinite(HostNorm(2)(grads[:-1] + [torch.tensor([float("inf")])]))

    def clipped(how) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float32)) for t in grads[:-1]]
        for p, t in zip(params, grads):
            p.grad = t.clone()
        clip_grad_norm(params, 1.0, how)
        return [p.grad for p in params]

    for got, want in zip(clipped(HostNorm(3)), clipped(None)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    threads = torch.get_num_threads()
    try:  # chosen by where the gradients live; threads up to a cap
        torch.set_num_threads(64)
        assert grad_norm(torch.device("cpu")).workers == HOST_NORM_WORKERS and grad_norm(torch.device("cuda")) is _norm
        torch.set_num_threads(1)
        assert grad_norm(torch.device("cpu")).workers == 1
    finally:
        torch.set_num_threads(threads)


def _watch_staged(window) -> list[int]:
    """How many blocks `window` holds staged after each fetch, recorded from here on (its layers call
    `window.fetch`, and only a fetch changes what is staged)."""
    counts = []
    fetch = window.fetch

    def counted(block: int, index: int):
        local = fetch(block, index)
        counts.append(len(window.staged))
        return local

    window.fetch = counted
    return counts


def _compare(model_dir: str, env, method: str) -> dict:
    """Both runs, checked; returns what the parent compares across ranks."""
    plain = _build(model_dir, env, method, offload=False)
    expected = _train(plain, STEPS)
    reference = [layer.dequantized_weight(torch.float32) for layer in _quantized(plain)]
    del plain

    model = _build(model_dir, env, method, offload=True)
    _check_offloaded(model)
    window = _quantized(model)[0].offloaded.window
    staged = _watch_staged(window)
    # Loaded into the host shards: the gathered weights are the non-offloaded model's, bit for bit.
    for layer, weight in zip(_quantized(model), reference):
        assert torch.equal(layer.dequantized_weight(torch.float32), weight)
    _check_embedding_and_head_stay(model, env.world_size)
    found = _train(model, STEPS)
    _check_offloaded(model)
    torch.testing.assert_close(torch.tensor(found), torch.tensor(expected), rtol=1e-6, atol=1e-6)
    _check_host_norm(model)
    assert len(window.blocks) == model.config.num_hidden_layers
    assert staged and max(staged) <= 2  # the block running and the one prefetched, never more
    first = _quantized(model)[0]
    return {"losses": found, "shard_rows": first.packed.shape[0], "rows": first.out_features}


def _check_host_norm(model) -> None:
    """The threaded host norm of the offloaded gradients (DTensors holding this rank's host shards) is the
    norm over every rank's shards, as torch's is."""
    from torch.distributed.tensor import DTensor

    from qshard.train.optim import HostNorm, _norm

    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None and isinstance(p.grad, DTensor)]
    assert grads and all(g.to_local().device.type == "cpu" for g in grads)
    torch.testing.assert_close(HostNorm(2)(grads).cpu(), _norm(grads).cpu(), rtol=1e-6, atol=0)
    model.zero_grad(set_to_none=True)


def test_offloaded_storage_world_size_1(tiny_models, dist_env):
    for method in METHODS:
        result = _compare(str(tiny_models("llama")), dist_env, method)
        assert result["shard_rows"] == result["rows"]



def test_resident_blocks_stay_on_the_device_and_train_as_offloaded_ones(tiny_models, dist_env):
    """parallel.resident_blocks 1: the first block's storage buffer is on the compute device and never staged
    through a copy; the other blocks' are offloaded; the losses are the non-offloaded run's."""
    import pytest

    from qshard.errors import QShardError

    model_dir = str(tiny_models("llama"))
    expected = _train(_build(model_dir, dist_env, "nf4", False), STEPS)
    model = _build(model_dir, dist_env, "nf4", True, ("parallel.resident_blocks", "1"))
    window = _quantized(model)[0].offloaded.window
    assert [b.resident for b in window.blocks] == [True, False]
    assert window.blocks[0].host.device == dist_env.device and window._stage(0).copied is None
    found = _train(model, STEPS)
    torch.testing.assert_close(torch.tensor(found), torch.tensor(expected), rtol=1e-6, atol=1e-6)
    with pytest.raises(QShardError, match="parallel.resident_blocks: only has an effect with parallel.cpu_offload"):
        resolve(None, [("parallel.resident_blocks", "2")])


def _worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    results = {method: _compare(model_dir, env, method) for method in METHODS}
    torch.save(results, f"{result_dir}/rank{rank}.pt")
    shutdown()


def test_offloaded_storage_world_size_2(tmp_path, tiny_models):
    model_dir = tiny_models("llama")
    spawn(_worker, (2, free_port(), str(model_dir), str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for method in METHODS:
        assert results[0][method]["losses"] == results[1][method]["losses"]
        # Each rank's host shard holds half the rows.
        assert results[0][method]["shard_rows"] == results[1][method]["shard_rows"] == results[0][method]["rows"] // 2


def _watch_stages(window) -> list[int]:
    """The blocks `window` stages from here on."""
    staged = []
    stage = window._stage
    window._stage = lambda block: staged.append(block) or stage(block)
    return staged


def test_storage_to_device_operator_returns_a_copy_of_its_shard():
    """qshard::storage_to_device, which compiled blocks call for each offloaded shard: torch's operator checks
    pass (schema, no aliasing of its input, its fake implementation against the real one); its fake result is an
    empty tensor of the shard's shape and dtype on the device asked for (a GPU's, though none is here); a shard
    of a block's host buffer is fetched through that buffer's window (staged, then copied out: on the CPU the
    staged tensor is the host shard itself), any other tensor copied as it is; and the window's shards are
    forgotten when it goes."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensorMode

    from qshard.parallel import storage_offload as offload

    cpu = torch.device("cpu")
    window = offload.StorageWindow(cpu)
    layout = [[(0, torch.uint8, torch.Size([4, 8])), (128, torch.int32, torch.Size([4, 2]))]]
    window.blocks.append(offload._BlockStorage(layout, 160, pin=False))
    offload._register_shards(window, 0)
    packed, scales = window.blocks[0].host_views[0]
    packed.copy_(torch.arange(32, dtype=torch.uint8).view(4, 8))
    scales.copy_(torch.arange(8, dtype=torch.int32).view(4, 2))
    staged = _watch_stages(window)
    for host in (packed, scales):
        got = offload.storage_to_device(host, cpu, None)
        assert torch.equal(got, host) and got.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    assert staged == [0]  # one block, staged once for both of its shards
    other = torch.ones(3, 5)
    assert torch.equal(offload.storage_to_device(other, cpu, None), other) and staged == [0]
    for after in (None, torch.ones(2)):
        result = torch.library.opcheck(offload.storage_to_device, (packed, cpu, after))
        assert set(result.values()) == {"SUCCESS"}, result
    with FakeTensorMode():
        fake = offload.storage_to_device(torch.empty(4, 8, dtype=torch.uint8), torch.device("cuda", 0), None)
    assert (fake.shape, fake.dtype, fake.device, fake.stride()) == ((4, 8), torch.uint8, torch.device("cuda:0"), (8, 1))
    keys = [packed.data_ptr(), scales.data_ptr()]
    assert all(key in offload._SHARDS for key in keys)
    del window
    gc.collect()
    assert not any(key in offload._SHARDS for key in keys)


def test_window_restages_a_layer_a_graph_owns_for_an_eager_fetch_dropping_the_old_copy_first():
    """A layer's staged tensors that `fetch_owned` handed to a compiled graph (which may write over them) are not
    what a later eager `fetch` of that layer in the same pass gets: the block is staged again, its old copy dropped
    before the new one is made (so no more than two blocks' copies are held). Other layers, and the last block of
    a pass (whose graphs get copies, not the staged tensors), are not staged again."""
    from qshard.parallel import storage_offload as offload

    window = offload.StorageWindow(torch.device("cpu"))
    layout = [[(0, torch.uint8, torch.Size([4, 8])), (128, torch.int32, torch.Size([4, 2]))]] * 2
    for _ in range(3):
        window.blocks.append(offload._BlockStorage(layout, 160, pin=False))
    stages = []
    stage = window._stage
    window._stage = lambda block: stages.append((block, sorted(window.staged))) or stage(block)
    window.fetch_owned(1, 0, 0, backward=False)
    assert stages == [(1, []), (2, [1])] and window.paths == {"staged": 1}
    window.fetch(1, 1)  # another layer: its tensors are clean
    assert len(stages) == 2
    window.fetch(1, 0)
    assert stages[2:] == [(1, [2])]  # block 1 again, its old copy gone first
    window.fetch(1, 0)
    assert len(stages) == 3  # the new copy is the eager fetch's: not staged a third time
    window.fetch_owned(2, 0, 0, backward=False)
    assert window.paths == {"staged": 1, "clone": 1}
    window.fetch(2, 0)
    assert len(stages) == 3
