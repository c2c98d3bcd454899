"""parallel.ac_keep_attention: checkpointed blocks keep their attention's output and log-sum-exp from forward to
backward, and the recompute runs no attention kernel. Training computes what it computes without (the same
kernels, called through their own ops), eager and compiled, with activation offload and tiled MLPs, at world
size 1 and 2; anything the kept path does not take (a padding mask) falls back to transformers' attention."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import free_port, spawn

from qshard.config import resolve
from qshard.errors import QShardError
from qshard.parallel import kept_attention

STEPS = 2
MICRO_BATCHES = 2


class _Counted:
    """The CPU kernel pair, counting forward and backward calls."""

    def __init__(self) -> None:
        self.forward = self.backward = 0
        self._pair = kept_attention._CPU_KERNELS

    def pair(self):
        def forward(*args):
            self.forward += 1
            return self._pair[0](*args)

        def backward(*args):
            self.backward += 1
            return self._pair[1](*args)

        return forward, backward


def _trainer(model_dir: str, env, keep: bool, padded: bool = False, train_type: str = "qlora", **parallel):
    from qshard.build import build_model
    from qshard.data import Example
    from qshard.train.loop import Trainer

    options = [("train.train_type", train_type), ("train.precision", "fp32"), ("optim.lr", "1e-2"),
               ("train.micro_batch_size", "2"), ("train.grad_accum", str(MICRO_BATCHES)),
               ("train.max_steps", str(STEPS)), ("parallel.ac_keep_attention", str(keep).lower())]
    options += [(f"parallel.{k}", str(v).lower()) for k, v in parallel.items()]
    model, _ = build_model(resolve(None, options), env, model_dir)
    g = torch.Generator().manual_seed(0)
    # Rows of one length, so no padding mask (the kept path's case), or of two (a mask: transformers' attention).
    lengths = [24, 17] if padded else [24]
    examples = [Example(ids := torch.randint(3, 200, (lengths[i % len(lengths)],), generator=g).tolist(), ids)
                for i in range(16)]
    return Trainer(resolve(None, options), env, model, examples, [], 0)


def _trained(model_dir: str, env, keep: bool, padded: bool = False, train_type: str = "qlora", **parallel) -> dict:
    from torch.distributed.tensor import DTensor

    trainer = _trainer(model_dir, env, keep, padded, train_type, **parallel)
    losses = [trainer.step(s)["loss"] for s in range(STEPS)]
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    local = [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in params]
    torch._dynamo.reset()
    return {"losses": losses, "params": local}


def _same(a: dict, b: dict, exact: bool = True) -> None:
    if exact:
        assert a["losses"] == b["losses"]
        assert len(a["params"]) == len(b["params"]) and all(map(torch.equal, a["params"], b["params"]))
        return
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"], strict=True):
        # Three AdamW steps at lr 1e-2 amplify round-off: with transformers 5.24 a few of 2,048 moved 8.5e-6 apart;
        # since the plain compiled path joins the B factors to the base's matmul (fp32 sums in another order) and the
        # kept one does not, one of 2,048 moved 3.0e-5. A wrong gradient moves weights by steps of the order of lr.
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("parallel", [
    {},
    {"activation_offload": True, "mlp_tile_tokens": 16},
    {"compile": True, "compile_backend": "aot_eager"},
    {"cpu_offload": True, "quant_sharding": "dtensor"},
], ids=["eager", "offload-tiles", "compiled", "cpu-offload"])
def test_kept_attention_trains_bit_for_bit_and_skips_the_recompute(tiny_models, dist_env, monkeypatch, parallel):
    model_dir = str(tiny_models("llama"))
    plain = _trained(model_dir, dist_env, False, **parallel)
    counted = _Counted()
    monkeypatch.setattr(kept_attention, "_CPU_KERNELS", counted.pair())
    kept = _trained(model_dir, dist_env, True, **parallel)
    # Eager, the same kernels in the same order: bit for bit. Compiled, the plain path's attention is traced into
    # the block's graph (aot_eager runs its decomposition) where the kept one is a graph break: close.
    _same(kept, plain, exact="compile" not in parallel)
    layers = 2  # the tiny model's
    # One attention forward per block and micro-batch, none in the recompute; one backward each.
    assert counted.forward == counted.backward == layers * MICRO_BATCHES * STEPS


def test_a_padding_mask_falls_back_to_transformers_attention(tiny_models, dist_env, monkeypatch, caplog):
    model_dir = str(tiny_models("llama"))
    plain = _trained(model_dir, dist_env, False, padded=True)
    counted = _Counted()
    monkeypatch.setattr(kept_attention, "_CPU_KERNELS", counted.pair())
    monkeypatch.setattr(kept_attention, "_said", False)
    with caplog.at_level(logging.WARNING, logger="qshard"):
        kept = _trained(model_dir, dist_env, True, padded=True)
    _same(kept, plain)
    said = [r for r in caplog.records if "ac_keep_attention" in r.getMessage()]
    assert len(said) == 1, said  # once, however many blocks and steps fell back
    # Micro-batches of rows of one length take the kept path, those with a padding mask transformers' attention.
    assert counted.forward == counted.backward < 2 * MICRO_BATCHES * STEPS


def test_a_recompute_takes_its_own_forwards_record(tiny_models, dist_env, monkeypatch):
    """Two forwards of a checkpointed block before one backward: each recompute takes the attention its own forward
    recorded (the records are per forward, not per block), so the gradients are those of the plain path."""
    from qshard.build import build_model

    results = []
    counted = _Counted()
    monkeypatch.setattr(kept_attention, "_CPU_KERNELS", counted.pair())
    for keep in (False, True):
        cfg = resolve(None, [("train.train_type", "qlora"), ("train.precision", "fp32"),
                             ("parallel.ac_keep_attention", str(keep).lower())])
        model, _ = build_model(cfg, dist_env, str(tiny_models("llama")))
        model.train()
        g = torch.Generator().manual_seed(0)
        first, second = (torch.randint(3, 200, (1, 12), generator=g) for _ in range(2))
        loss = sum(w * model(input_ids=ids, labels=ids, use_cache=False).loss for w, ids in ((1, first), (2, second)))
        loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, kept = results
    assert counted.forward == counted.backward == 2 * 2  # kept: two forwards of two blocks, none recomputed
    assert plain.keys() == kept.keys() and plain
    assert all(torch.equal(plain[n], kept[n]) for n in plain)


@pytest.mark.parametrize("option", [
    ("parallel.activation_checkpointing", "false"), ("parallel.ac_reentrant", "true"),
    ("model.attn_implementation", "eager"), ("data.packing", "true"), ("train.objective", "dpo"),
])
def test_refused_where_no_attention_would_be_kept(option):
    with pytest.raises(QShardError, match="parallel.ac_keep_attention"):
        resolve(None, [("parallel.ac_keep_attention", "true"), option])


def _worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    plain = _trained(model_dir, env, False)
    counted = _Counted()
    kept_attention._CPU_KERNELS = counted.pair()  # this process's own
    kept = _trained(model_dir, env, True)
    _same(kept, plain)
    assert counted.forward == counted.backward == 2 * MICRO_BATCHES * STEPS
    torch.save(kept["losses"], f"{result_dir}/rank{rank}.pt")
    shutdown()


def test_kept_attention_world_size_2(tmp_path, tiny_models):
    """In FSDP2 units on two ranks: each rank's shards train as without; the ranks agree on the losses."""
    spawn(_worker, (2, free_port(), str(tiny_models("llama")), str(tmp_path)))
    assert torch.load(tmp_path / "rank0.pt") == torch.load(tmp_path / "rank1.pt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's GPU kernels")
def test_gpu_kernels_give_sdpas_gradients():
    """On a GPU, in bf16 at a length where SDPA picks a fused kernel: the kept path's output and gradients are
    SDPA's (the kernel SDPA chooses, called through its ops), with the keys and values of fewer heads."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    module = torch.nn.Module()
    out = kept_attention.kept_attention(module, q, k, v, None)
    assert out is not None, "no fused kernel taken"
    grad = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    want_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_out = want_out.transpose(1, 2)
    want = [want_out, *torch.autograd.grad(want_out, (q, k, v), grad)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_a_call_no_kernel_takes_is_transformers_in_forward_and_recompute(tiny_models, dist_env, monkeypatch):
    """Heads of 12 values, which SDPA's flash kernel takes only padded: left to transformers' attention in the
    forward and, by the forward's record, in the recompute; the run trains as without the option."""
    q = torch.randn(1, 2, 8, 12)
    assert kept_attention._kernels(q, q, q, None) is None
    assert kept_attention._kernels(torch.randn(1, 2, 8, 16), *(torch.randn(1, 2, 8, 16),) * 2, None) is not None
    model_dir = str(tiny_models("llama", hidden_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=12,
                                intermediate_size=128))
    plain = _trained(model_dir, dist_env, False, train_type="lora")
    counted = _Counted()
    monkeypatch.setattr(kept_attention, "_CPU_KERNELS", counted.pair())
    kept = _trained(model_dir, dist_env, True, train_type="lora")
    _same(kept, plain)
    assert counted.forward == counted.backward == 0
