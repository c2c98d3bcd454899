"""Long context: the sequence-tiled MLP (parallel.mlp_tile_tokens) computes what the plain MLP computes, eager
and compiled, running each tile's forward twice a step in a checkpointed block; its gradients reach FSDP2
(world sizes 1 and 2), and a block saves less for backward with it."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch
import torch.nn as nn
from conftest import LogLines, free_port, spawn
from torch.distributed.tensor import DTensor

from qshard.config import resolve
from qshard.errors import QShardError

TILE = 8  # several tiles of the 2 x 37 tokens below, and a short last one


def _build(model_dir, env, tile: int, *options: tuple[str, str]):
    from qshard.build import build_model

    cfg = resolve(None, [("train.precision", "fp32"), ("parallel.mlp_tile_tokens", str(tile)), *options])
    model, _ = build_model(cfg, env, model_dir)
    model.train()
    return model


def _loss_and_grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _count_tile_forwards(model) -> list[int]:
    """A list that grows by one each time a tile's MLP (eager or compiled) runs, in any block."""
    counted = []
    for layer in model.model.layers:
        tiled = layer.mlp.forward
        tiled.run = functools.partial(lambda run, x: counted.append(1) or run(x), tiled.run)
    return counted


def _compare(model_dir, env, options, ids, plain_options=None) -> dict[str, float]:
    """Loss and every trainable gradient, untiled (with `plain_options`, by default `options`) and tiled; returns
    the largest relative gradient error and how many times each tile's forward ran."""
    from qshard.parallel import tiling

    plain_loss, plain = _loss_and_grads(_build(model_dir, env, 0, *(options if plain_options is None
                                                                      else plain_options)), ids)
    tiled_model = _build(model_dir, env, TILE, *options)
    forwards = _count_tile_forwards(tiled_model)
    calls = []
    backward = tiling._TiledMLP.backward
    tiling._TiledMLP.backward = staticmethod(lambda ctx, g: calls.append(1) or backward(ctx, g))
    try:
        tiled_loss, tiled = _loss_and_grads(tiled_model, ids)
    finally:
        tiling._TiledMLP.backward = staticmethod(backward)
    assert len(calls) == tiled_model.config.num_hidden_layers  # every block's MLP went through the tiles
    assert abs(tiled_loss - plain_loss) <= 1e-5 * abs(plain_loss)
    assert plain.keys() == tiled.keys() and any(".mlp." in n for n in plain)
    errors = {n: float((tiled[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in plain.items()}
    tiles = tiled_model.config.num_hidden_layers * -(-ids.numel() // TILE)
    return {"loss": tiled_loss, "error": max(errors.values()), "forwards per tile": len(forwards) / tiles}


# Each tile's forward: once in forward, once in its backward. A non-reentrant checkpoint's recompute stops
# before the MLP (the tiled MLP saves its input first); a reentrant one reruns the whole block.
@pytest.mark.parametrize("options, forwards", [
    ((("train.train_type", "qlora"),), 2),  # non-reentrant checkpoints
    ((("train.train_type", "qdora"), ("parallel.ac_reentrant", "true")), 3),
    ((("train.train_type", "lora"), ("parallel.activation_checkpointing", "false")), 2),
], ids=["qlora", "qdora-reentrant", "lora-no-checkpoints"])
def test_tiled_mlp_equals_plain(dist_env, tiny_models, options, forwards):
    ids = torch.randint(3, 400, (2, 37), generator=torch.Generator().manual_seed(0))
    result = _compare(tiny_models("llama"), dist_env, options, ids)
    assert result["error"] < 1e-5
    assert result["forwards per tile"] == forwards


def test_compiled_tiled_mlp_equals_eager_plain(dist_env, tiny_models):
    """Compiled blocks (inductor's C++ kernels here) around eagerly tiled MLPs whose tiles run a compiled graph:
    the eager untiled block's loss and gradients, each tile's forward still run twice."""
    import torch._dynamo

    ids = torch.randint(3, 400, (1, 37), generator=torch.Generator().manual_seed(0))
    options = (("train.train_type", "qlora"),)
    torch._dynamo.reset()
    try:
        result = _compare(tiny_models("llama", num_hidden_layers=1), dist_env,
                          (*options, ("parallel.compile", "true")), ids, plain_options=options)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert result["error"] < 1e-4
    assert result["forwards per tile"] == 2
    assert graphs >= 3  # the block's graphs before and after the MLP, and one tile's


def test_compiled_tiles_stay_eager_where_their_storage_is_offloaded(dist_env, tiny_models):
    """parallel.cpu_offload (quant_sharding dtensor) with one resident block: the offloaded block's tiles run
    its MLP eagerly, fetching the storage through the offload window once per block and direction (a compiled
    tile would copy it from host memory in every tile's graph); the resident block's tiles run the compiled
    graph. Loss and gradients are the eager untiled blocks'."""
    import torch._dynamo

    ids = torch.randint(3, 400, (1, 37), generator=torch.Generator().manual_seed(0))
    options = (("train.train_type", "qlora"), ("parallel.quant_sharding", "dtensor"),
               ("parallel.cpu_offload", "true"), ("parallel.resident_blocks", "1"))
    compiled = (("parallel.compile", "true"), ("parallel.compile_backend", "aot_eager"))
    model = _build(tiny_models("llama"), dist_env, TILE, *options, *compiled)
    runs = [layer.mlp.forward.run for layer in model.model.layers]
    assert [layer.mlp.down_proj.base.offloaded.resident for layer in model.model.layers] == [True, False]
    assert isinstance(runs[0], functools.partial)  # the compiled tile
    assert getattr(runs[1], "__func__", None) is type(model.model.layers[1].mlp).forward  # the MLP's own forward
    torch._dynamo.reset()
    try:
        result = _compare(tiny_models("llama"), dist_env, (*options, *compiled), ids, plain_options=options)
    finally:
        torch._dynamo.reset()
    assert result["error"] < 1e-5
    assert result["forwards per tile"] == 2



def _worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    # Each rank its own tokens: the gradients compared are FSDP2's averages over both ranks.
    ids = torch.randint(3, 400, (1, 45), generator=torch.Generator().manual_seed(rank))
    result = _compare(model_dir, env, (("train.train_type", "qlora"),), ids)
    torch.save(result, f"{result_dir}/rank{rank}.pt")
    shutdown()


def test_tiled_mlp_gradients_reach_fsdp2_world_size_2(tmp_path, tiny_models):
    spawn(_worker, (2, free_port(), str(tiny_models("llama")), str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0]["loss"] != results[1]["loss"]  # different data on each rank
    assert all(r["error"] < 1e-5 for r in results), results


def _saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of the activations the forward saves for backward (parameters are not copies)."""
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return total


def test_tiled_mlp_saves_less_for_backward(dist_env, tiny_models):
    ids = torch.randint(3, 400, (1, 96), generator=torch.Generator().manual_seed(0))
    options = (("train.train_type", "qlora"), ("parallel.activation_checkpointing", "false"))
    plain = _saved_bytes(_build(tiny_models("llama"), dist_env, 0, *options), ids)
    tiled_model = _build(tiny_models("llama"), dist_env, TILE, *options)
    tiled = _saved_bytes(tiled_model, ids)
    # Untiled, each MLP keeps at least gate, up, act and product ([tokens, intermediate] each, fp32); tiled,
    # only its [tokens, hidden] input.
    cfg = tiled_model.config
    per_block = 4 * 96 * cfg.intermediate_size * 4 - 96 * cfg.hidden_size * 4
    assert plain - tiled >= cfg.num_hidden_layers * per_block, (plain, tiled)


class _MLP(nn.Module):
    """A gated MLP of LoRA linears with dropout: the tiles' backward must draw the forward's masks again."""

    def __init__(self) -> None:
        from qshard.adapters import LoRALinear

        super().__init__()
        torch.manual_seed(0)
        self.up = LoRALinear(nn.Linear(16, 48), 16, 48, 4, 8.0, dropout=0.3)
        self.down = LoRALinear(nn.Linear(48, 16), 48, 16, 4, 8.0, dropout=0.3)
        for layer in (self.up, self.down):
            layer.base.requires_grad_(False)
            nn.init.normal_(layer.lora_A)
            nn.init.normal_(layer.lora_B)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def test_tiled_mlp_replays_dropout_masks():
    from qshard.parallel.tiling import tile_mlps

    # The reference: the same tiles of the flattened tokens, through autograd (which keeps every tile's
    # intermediates and dropout masks), with the same random state at the start.
    x = torch.randn(2, 21, 16, generator=torch.Generator().manual_seed(3))
    mlp_plain, mlp_tiled = _MLP(), _MLP()
    block = nn.Module()
    block.mlp = mlp_tiled
    tile_mlps(block, [block], 5)
    flat = x.reshape(1, -1, 16)
    inputs = [flat.clone().requires_grad_(True) for _ in range(2)]
    torch.manual_seed(1)
    want = torch.cat([mlp_plain(p) for p in inputs[0].split(5, dim=1)], dim=1)
    torch.manual_seed(1)
    got = mlp_tiled(inputs[1])
    torch.testing.assert_close(got, want)
    weights = torch.arange(want.numel()).view_as(want).sin()
    (want * weights).sum().backward()
    torch.manual_seed(2)  # backward must not depend on the random state it finds
    (got * weights).sum().backward()
    # A mask drawn anew would change whole elements; summing the tiles in another order, the last bits only.
    trained = [(q.grad, p.grad) for p, q in zip(mlp_plain.parameters(), mlp_tiled.parameters()) if p.requires_grad]
    pairs = [(inputs[1].grad, inputs[0].grad), *trained]
    assert len(pairs) == 5
    for got_grad, want_grad in pairs:
        assert (got_grad - want_grad).norm() <= 1e-5 * want_grad.norm()


def test_tiled_mlp_taken_with_compile_and_negative_tiles_refused():
    assert resolve(None, [("parallel.mlp_tile_tokens", "4096"), ("parallel.compile", "true")]).parallel.compile is True
    with pytest.raises(QShardError, match="parallel.mlp_tile_tokens must be >= 0"):
        resolve(None, [("parallel.mlp_tile_tokens", "-1")])


# ---------------------------------------------------------------------------------------------------------------
# Positions: a sequence beyond the model's is refused unless its rope scaling reaches that far.

LIMIT = 32  # the tiny models' max_position_embeddings here
ROPES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=LIMIT),
    # Llama 3.1's convention: max_position_embeddings is already the extended length.
    "llama3": dict(rope_type="llama3", factor=4.0, original_max_position_embeddings=LIMIT // 4, low_freq_factor=1.0,
                   high_freq_factor=4.0),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_position_limit_follows_rope_scaling(kind):
    from transformers import LlamaConfig

    from qshard.models import position_limit

    assert position_limit(LlamaConfig(max_position_embeddings=LIMIT)) == (LIMIT, f"max_position_embeddings {LIMIT}")
    limit, origin = position_limit(LlamaConfig(max_position_embeddings=LIMIT, rope_parameters=ROPES[kind]))
    assert limit == (LIMIT if kind == "llama3" else 4 * LIMIT) and kind in origin


def _records(path, n: int, words: int):
    import json

    path.write_text("".join(json.dumps({"instruction": f"say {i}", "output": " ".join(["word"] * words)}) + "\n"
                            for i in range(n)))
    return path


def test_sequences_beyond_positions_refused_or_extended(tiny_models, tmp_path, capsys):
    from qshard import cli

    data = _records(tmp_path / "long.jsonl", 4, words=30)
    plain = tiny_models("llama", num_hidden_layers=1, max_position_embeddings=LIMIT)
    args = ["--data", str(data), "--max-steps", "1", "--data.max_length", "96", "--train.precision", "fp32",
            "--train.micro_batch_size", "1"]
    capsys.readouterr()
    code = cli.main(["train", "--model", str(plain), "--output-dir", str(tmp_path / "refused"), *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("qshard: error: ")]
    assert code == 2 and len(errors) == 1, errors
    assert "data.max_length 96" in errors[0] and f"the {LIMIT} positions" in errors[0] and "rope_scaling" in errors[0]
    assert not (tmp_path / "refused" / "config.yaml").exists()

    # Linear scaling x4 reaches 128 positions: the run trains, with the rotary embedding the config describes.
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from qshard.config import resolve
    from qshard.train.run import run_training

    scaled = tiny_models("llama", num_hidden_layers=1, max_position_embeddings=LIMIT, rope_parameters=ROPES["linear"])
    cfg = resolve(None, [("model.path", str(scaled)), ("data.path", str(data)), ("output.dir", str(tmp_path / "ok")),
                         ("train.max_steps", "1"), ("data.max_length", "96"), ("train.precision", "fp32"),
                         ("train.micro_batch_size", "1"), ("parallel.mlp_tile_tokens", "16")])
    result = run_training(cfg)
    assert result.summary["steps"] == 1
    rotary = result.model.model.rotary_emb
    assert rotary.rope_type == "linear"
    torch.testing.assert_close(rotary.inv_freq, LlamaRotaryEmbedding(result.model.config).inv_freq)


# ---------------------------------------------------------------------------------------------------------------
# Attention at long context: one unpacked row reaches SDPA with no mask (its causal kernel), never an L x L one.


def test_long_row_reaches_sdpa_without_a_mask(dist_env, tiny_models, monkeypatch):
    import torch.nn.functional as F

    from qshard.data import Example, collate
    from qshard.models import dense_mask_bytes
    from qshard.train.loss import build_loss

    length = 1024
    cfg = resolve(None, [("train.micro_batch_size", "1"), ("data.max_length", str(length))])
    assert dense_mask_bytes(cfg) == 0
    model = _build(tiny_models("llama", num_hidden_layers=1, max_position_embeddings=length), dist_env, 0)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal, q.shape[-2]))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    ids = torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = collate([Example(ids, ids)], pad_id=0)  # what the trainer sends: micro-batch 1, unpacked
    build_loss(model, chunk_tokens=256)(model, batch).backward()  # forward, then the checkpoint's recompute
    assert calls == [(True, True, length)] * 2

    # Packed rows do get a dense mask (a block-diagonal one): warned about from the size where it matters.
    calls.clear()
    halves = list(range(length // 2)) * 2
    with torch.no_grad():
        packed_batch = collate([Example(ids, ids, halves)], 0)
        model(input_ids=packed_batch["input_ids"], position_ids=packed_batch["position_ids"], use_cache=False)
    assert calls == [(False, False, length)]
    packed = resolve(None, [("train.micro_batch_size", "1"), ("data.max_length", "32768"), ("data.packing", "true")])
    assert dense_mask_bytes(packed) == 1 << 30
    # A preference pair is two padded rows: a mask even at one pair per micro-batch.
    pairs = resolve(None, [("train.objective", "dpo"), ("train.micro_batch_size", "1"), ("data.max_length", "32768"),
                           ("pref.share_prompt", "false")])
    assert dense_mask_bytes(pairs) == 2 << 30
    # Asked to share prompts (the default), the figure is the model's: none for shared rows, two rows' where the
    # model turns sharing off (a sliding window), and the warning says which.
    from transformers import LlamaConfig, MistralConfig

    from qshard.models import shares_prompt, warn_dense_mask

    asked = resolve(None, [("train.objective", "dpo"), ("train.micro_batch_size", "1"), ("data.max_length", "32768")])
    assert dense_mask_bytes(asked, shares_prompt(asked, LlamaConfig(), "sdpa")) == 0
    sliding = shares_prompt(asked, MistralConfig(sliding_window=4096), "sdpa")
    assert dense_mask_bytes(asked, sliding) == 2 << 30
    lines = LogLines()
    logging.getLogger("qshard").addHandler(lines)
    try:
        warn_dense_mask(asked, shares_prompt(asked, LlamaConfig(), "sdpa"))
        assert not lines.lines
        warn_dense_mask(asked, sliding)
    finally:
        logging.getLogger("qshard").removeHandler(lines)
    assert len(lines.lines) == 1 and "2.0 GiB" in lines.lines[0] and "each pair is two padded rows" in lines.lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Activation offload: host buffers from one pool, reused from step to step.


def test_offload_pool_reuses_host_buffers_across_steps(dist_env, tiny_models, monkeypatch):
    import logging

    from conftest import LogLines

    from qshard.parallel import offload

    # Eager blocks where dist_env computes (on a GPU machine, copies without a side stream): the bookkeeping alone.
    options = (("train.train_type", "qlora"), ("parallel.compile", "false"))
    device = dist_env.device.type
    ids = [torch.randint(3, 400, (1, 40), generator=torch.Generator().manual_seed(s)).to(dist_env.device)
           for s in range(3)]

    def train(hooks) -> list[float]:
        model = _build(tiny_models("llama"), dist_env, TILE, *options)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for batch in ids:
            with hooks(batch.numel()):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            held.append((pool.allocations, pool.nbytes, pool.in_use))
        return losses

    # On the CPU the hooks copy CPU tensors into plain host buffers: the same bookkeeping, no streams.
    pool, held = offload.HostPool(pin=False), []
    expected = train(lambda tokens: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    held.clear()
    lines, logger = LogLines(), logging.getLogger("qshard")
    monkeypatch.setattr(offload, "_logged", False)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        found = train(lambda tokens: offload.OffloadActivations(pool, None, device, tokens))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert found == expected  # the same tensors come back
    assert held[0][0] > 0 and held[0] == held[1] == held[2]  # steady after the first step
    assert all(in_use == 0 for *_, in_use in held)  # every buffer went back once backward was done
    # The head's weight, which its linear saves as a transposed view, stays where it is.
    head = _build(tiny_models("llama"), dist_env, TILE, *options).lm_head.weight
    assert pool.free and head.numel() * head.element_size() not in pool.free
    logged = [line for line in lines.lines if line.startswith("activation offload:")]
    assert len(logged) == 1 and "KiB per token" in logged[0], lines.lines


def test_offload_pool_stays_near_one_step_as_lengths_grow():
    """Steps of growing length (data sorted by length, say): the pool drops what no longer fits instead of
    keeping every earlier size (it held 29x a step's need before)."""
    from qshard.parallel import offload

    pool = offload.HostPool(pin=False)
    for step in range(1, 41):
        taken = [pool.take(1000 * step + block) for block in range(8)]  # one step: 8 blocks' inputs
        for buffer in taken:
            pool.give(buffer)
        assert pool.nbytes <= 2 * sum(b.size for b in taken), (step, pool.nbytes)
    assert pool.in_use == 0


def test_offload_copies_a_tensor_saved_twice_once(dist_env, tiny_models):
    """One tensor that several ops save (the final norm's scale, the log-softmax output) is copied to the host
    once, and comes back to each of them; backward gives the gradients it gives without offload."""
    from qshard.parallel import offload

    model = _build(tiny_models("llama"), dist_env, TILE, ("train.train_type", "qlora"))
    ids = torch.randint(3, 400, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = _loss_and_grads(model, ids)
    model.zero_grad(set_to_none=True)

    calls = []

    class Recording(offload.OffloadActivations):
        def _pack(self, tensor):
            calls.append((tensor, packed := super()._pack(tensor)))  # kept alive: ids stay unique
            return packed

    pool = offload.HostPool(pin=False)
    with Recording(pool, None, "cpu", ids.numel()):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    copies = {id(p): p for _, p in calls if isinstance(p, offload._Offloaded)}
    by_tensor = {}
    for tensor, copy in calls:
        by_tensor.setdefault(id(tensor), set()).add(id(copy))
    assert len(calls) > len(by_tensor)  # some tensor was saved more than once ...
    assert all(len(packs) == 1 for packs in by_tensor.values())  # ... and each got one copy
    assert pool.in_use == sum(c.host.numel() * c.host.element_size() for c in copies.values())
    del copy, tensor
    calls.clear(), copies.clear()  # autograd alone holds the copies now
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert loss.item() == expected[0] and all(torch.equal(grads[n], g) for n, g in expected[1].items())
    assert pool.in_use == 0


def test_offload_brings_each_block_back_while_the_block_after_runs_backward(dist_env, tiny_models):
    """Under parallel.activation_offload each block's saved tensors form a group (closed by a hook at the block's
    end); a tensor several blocks save (a table every block keeps) belongs to the last of them. What the last block
    and the head save stays on the device (backward needs it first). Backward finds every tensor it asks for back
    on the device already: the last group's brought back as the forward ended, each other group's while the group
    after it ran backward. Loss and gradients are those without offload. A gradient-free forward before (a
    preference loss's reference, under the same hooks) keeps nothing from the policy's forward."""
    from qshard.parallel import offload

    blocks = 4
    model = _build(tiny_models("llama", num_hidden_layers=blocks), dist_env, TILE, ("train.train_type", "qlora"),
                   ("parallel.activation_offload", "true"), ("parallel.compile", "false"))
    ids = torch.randint(3, 400, (1, 40), generator=torch.Generator().manual_seed(0)).to(dist_env.device)
    expected = _loss_and_grads(model, ids)  # outside an offloaded forward the blocks' hooks do nothing

    asked, kept = [], []

    class Recording(offload.OffloadActivations):
        def _pack(self, tensor):
            packed = super()._pack(tensor)
            if self.keeping:
                kept.append(tensor)
            return packed

        def _unpack(self, packed):
            if isinstance(packed, offload._Offloaded):
                asked.append((packed.group, packed.restored is not None))
            return super()._unpack(packed)

    pool = offload.HostPool(pin=False)
    recording = Recording(pool, None, dist_env.device.type, ids.numel())
    with recording:
        with torch.no_grad():  # a preference loss's reference forward comes first, under the same hooks
            model(input_ids=ids, labels=ids, use_cache=False)
        assert not recording.keeping and not kept
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    offloaded = [g for g in range(len(recording.groups)) if recording._group(g)]
    assert offloaded == list(range(blocks - 1)), [len(g) for g in recording.groups]  # not the last block's
    assert kept  # the last block and the head saved tensors (and kept them: no group holds a copy of theirs)
    copies = [c for g in offloaded for c in recording._group(g)]
    assert pool.in_use == sum(c.host.numel() * c.host.element_size() for c in copies)
    assert all(c.restored is not None for c in recording._group(blocks - 2))  # back before backward asks
    assert all(c.restored is None for g in range(blocks - 2) for c in recording._group(g))
    del copies
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert loss.item() == expected[0] and all(torch.equal(grads[n], g) for n, g in expected[1].items())
    assert {group for group, _ in asked} == set(range(blocks - 1))  # every group was asked for
    assert all(back for _, back in asked), asked
    assert pool.in_use == 0


def test_offload_a_tensor_several_blocks_save_comes_back_with_the_last_of_them():
    """A table every block saves is copied to the host once and belongs to the last block that offloaded it, whose
    backward comes first: it is back before backward asks, not fetched alone then (nor its first block's group
    with it). The last block keeps the table itself."""
    from qshard.parallel import offload

    class Scale(nn.Module):
        def forward(self, x, table):
            return x * table  # saves the table (x needs a gradient; the table does not)

    blocks = [Scale() for _ in range(3)]
    offload.group_saved_tensors_by_block(blocks)
    x, table = torch.randn(8, requires_grad=True), torch.rand(8) + 0.5
    pool = offload.HostPool(pin=False)
    asked = []

    class Recording(offload.OffloadActivations):
        def _unpack(self, packed):
            asked.append(packed is table or (packed.group, packed.restored is not None))
            return super()._unpack(packed)

    with Recording(pool, None, "cpu", 8) as recording:
        h = x
        for block in blocks:
            h = block(h, table)
    assert pool.allocations == 1  # one copy of the table
    (copy,) = {id(c): c for g in range(len(recording.groups)) for c in recording._group(g)}.values()
    assert copy.group == 1 and copy.restored is not None  # the second block's group, back as the forward ended
    h.sum().backward()
    assert asked == [True, (1, True), (1, True)] and torch.allclose(x.grad, table ** 3)


def test_offload_brings_nothing_back_after_a_failed_forward():
    """A forward that raises leaves its copies on the host (the error is what the user must see, not a second one
    from memory the copies back would take)."""
    from qshard.parallel import offload

    x = torch.ones(4, requires_grad=True)
    hooks = offload.OffloadActivations(offload.HostPool(pin=False), None, "cpu", 4)
    with pytest.raises(RuntimeError, match="forward failed"), hooks as recording:
        y = x * torch.full((4,), 2.0)
        raise RuntimeError("forward failed")
    assert recording._group(0) and all(c.restored is None for c in recording._group(0))
    del y


def test_offload_brings_saved_tensors_back_with_their_strides():
    """A compiled backward checks the strides of what it saved: a transposed view, a permuted one and a slice of a
    wider tensor come back strided as they were saved, an expanded one (elements sharing memory) contiguous; every
    value as saved, and the host holds each tensor's elements only."""
    from qshard.parallel import offload

    wide = torch.randn(6, 10)
    saved = {"transposed": torch.randn(4, 6).t(), "slice": wide[:, 2:5],
             "permuted": torch.randn(2, 3, 4).permute(2, 0, 1), "expanded": torch.randn(3, 1).expand(3, 5)}
    seen = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *tensors):
            ctx.save_for_backward(*tensors)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.update(zip(saved, ctx.saved_tensors))
            return (grad, *[None] * len(saved))

    x = torch.ones(2, requires_grad=True)
    pool = offload.HostPool(pin=False)
    with offload.OffloadActivations(pool, None, "cpu", 2):
        y = Keep.apply(x, *saved.values())
    assert pool.in_use == 4 * (24 + 18 + 24 + 15)  # each tensor's elements, no more
    y.sum().backward()
    for name, tensor in saved.items():
        assert seen[name] is not tensor and torch.equal(seen[name], tensor), name
        expected = tensor.contiguous().stride() if name == "expanded" else tensor.stride()
        assert seen[name].stride() == expected, (name, seen[name].stride(), tensor.stride())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies on a side stream and compiled blocks: CUDA")
def test_offloaded_compiled_blocks_keeping_projections_train_as_without_offload(tiny_models, tmp_path, monkeypatch,
                                                                               caplog):
    """On a GPU, compiled blocks that keep their projections (transposed views among what they save, whose strides
    the compiled backward checks) train under activation offload as without it, two micro-batches a step: the
    same losses, the offload's host memory logged, and a transposed tensor among those it brought back."""
    import json

    from qshard.cli import main as cli_main
    from qshard.parallel import offload

    monkeypatch.setattr(offload, "_logged", False)
    strided = []
    bring_back = offload.OffloadActivations._bring_back

    def recorded(self, copies):
        strided.extend(c.strides for c in copies if c.strides and not c.host.is_contiguous())
        return bring_back(self, copies)

    monkeypatch.setattr(offload.OffloadActivations, "_bring_back", recorded)

    model_dir = tiny_models("llama")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * 6})
                            + "\n" for i in range(16)))
    losses = {}
    for offloaded in ("false", "true"):
        out = tmp_path / offloaded
        with caplog.at_level(logging.INFO, logger="qshard"):
            assert cli_main(["train", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out),
                             "--max-length", "64", "--batch-size", "2", "--grad-accum", "2", "--max-steps", "3",
                             "--data.eval_fraction", "0", "--parallel.compile", "true",
                             "--model.embedding_on_host", "false",  # auto would differ with and without offload
                             "--parallel.ac_save_projections", "true", "--parallel.cuda_graphs", "false",
                             "--parallel.activation_offload", offloaded]) == 0
        torch._dynamo.reset()
        losses[offloaded] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["true"]) == 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4)
    assert sum(r.getMessage().startswith("activation offload: ") for r in caplog.records) == 1
    assert strided  # a transposed or permuted tensor went out and came back with its strides


def test_offload_copies_again_when_the_memory_went_to_another_tensor():
    """A saved tensor that has died leaves its memory to the next tensor (the caching allocator hands it out
    again): that one is copied anew, not taken for the first. Two tensors over one numpy buffer stand in for it."""
    import numpy as np

    from qshard.parallel import offload

    x = torch.ones(64, requires_grad=True)
    memory = np.full(64, 2.0, dtype=np.float32)
    pool = offload.HostPool(pin=False)
    with offload.OffloadActivations(pool, None, "cpu", 64):
        a = torch.from_numpy(memory)
        first = x * a  # saves a (copied to the host)
        del a
        memory[:] = 3.0
        b = torch.from_numpy(memory)  # the same address, shape and version as a had
        second = x * b
    (first.sum() + second.sum()).backward()
    assert torch.equal(x.grad, torch.full((64,), 5.0))

    # The first tensor alive, but given other memory: its old address may go to the next tensor all the same.
    x.grad = None
    memory[:] = 2.0
    with offload.OffloadActivations(pool, None, "cpu", 64):
        a = torch.from_numpy(memory)
        first = x * a
        a.data = torch.zeros(64)  # the same version, other memory
        memory[:] = 3.0
        second = x * torch.from_numpy(memory)
    (first.sum() + second.sum()).backward()
    assert torch.equal(x.grad, torch.full((64,), 5.0))
