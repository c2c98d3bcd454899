"""Every fast path computes the same function as the plain one: the plain-torch NF4 dequantization used in
compiled blocks, the chunked cross-entropy, and compiled blocks themselves."""

from __future__ import annotations

import json
import logging
from importlib import resources

import pytest
import torch
from conftest import nonzero_lora_b
from torch.distributed.tensor import DTensor

from qshard.adapters import LoRALinear
from qshard.build import build_model
from qshard.config import Config
from qshard.data import IGNORE_INDEX
from qshard.parallel.checkpointing import _ATTENTION_OPS
from qshard.quant import quantize_nf4
from qshard.quant.nf4 import NF4Linear, dequantize_nf4, dequantize_nf4_torch
from qshard.train.loss import ChunkedLoss, FullLogitsLoss, build_loss
from qshard.train.run import run_training as train

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_dequantization_is_bit_identical_to_bitsandbytes(device, dtype):
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)).to(device) * 0.05
    packed, absmax = quantize_nf4(weight, 64)
    assert torch.equal(dequantize_nf4_torch(packed, absmax, dtype), dequantize_nf4(packed, absmax, dtype))


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of different lengths: a masked prompt, and right padding on the second row."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, loss_fn, batch):
    loss = loss_fn(model, batch)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.clone()
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# gemma2 soft-caps its logits; qwen2's tiny model ties the head to the embeddings. Under qlora the head is frozen:
# each chunk's gradient is computed in forward (_FrozenHeadCE), eagerly or compiled as compiled runs do it (aot_eager
# traces it here; on a GPU inductor generates its kernels); under full the head trains (_ChunkedHeadCE).
@pytest.mark.parametrize(("model_type", "train_type", "backend"), [
    ("llama", "qlora", None), ("llama", "qlora", "inductor" if torch.cuda.is_available() else "aot_eager"),
    ("gemma2", "qlora", None), ("gemma2", "full", None), ("qwen2", "full", None)])
def test_chunked_loss_equals_full_logits(dist_env, tiny_models, model_type, train_type, backend):
    cfg = Config()
    cfg.train.precision = "fp32"
    cfg.train.train_type = train_type
    model, _ = build_model(cfg.validate(), dist_env, tiny_models(model_type))
    chunked = build_loss(model, chunk_tokens=7, compile_backend=backend)  # several chunks and a short last one
    assert isinstance(chunked, ChunkedLoss)
    if model_type == "gemma2":
        assert chunked.softcap
    frozen_head = not any(p.requires_grad for p in model.get_output_embeddings().parameters())
    assert frozen_head == (train_type == "qlora")
    batch = {k: v.to(dist_env.device) for k, v in _batch(model.config.vocab_size).items()}
    model.train()
    full_loss, full_grads = _loss_and_grads(model, FullLogitsLoss(), batch)
    chunk_loss, chunk_grads = _loss_and_grads(model, chunked, batch)
    torch.testing.assert_close(chunk_loss, full_loss, rtol=1e-5, atol=1e-5)
    assert full_grads.keys() == chunk_grads.keys() and full_grads
    if train_type == "full":
        assert any("lm_head" in n or "embed_tokens" in n for n in full_grads)  # the head's gradient is checked
    for name, grad in full_grads.items():
        # Relative to the whole gradient's norm: chunking changes the order of fp32 sums, which moves
        # near-zero elements by more than any per-element tolerance would allow them.
        error = (chunk_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < 1e-5, (name, float(error))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_frozen_heads_gradient_taken_in_forward_equals_the_recomputed_one(dtype, softcap):
    from qshard.train.loss import _chunk_loss_and_gradient, _ChunkedHeadCE, _chunks, _FrozenHeadCE

    assert _chunks(17, 8) == [(0, 8), (8, 17)] and _chunks(16, 8) == [(0, 8), (8, 16)] and _chunks(0, 8) == []
    g = torch.Generator().manual_seed(0)
    states = torch.randn(37, 64, generator=g).to(dtype)
    weight = (torch.randn(500, 64, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, 500, (37,), generator=g)
    for reduction, factor in (("sum", torch.tensor(0.37)), ("none", torch.linspace(0.5, 2, 37))):
        results = []
        for frozen in (False, True):
            x = states.clone().requires_grad_()
            if frozen:
                out = _FrozenHeadCE.apply(x, labels, weight, None, 8, softcap, reduction, _chunk_loss_and_gradient,
                                          True)
            else:
                out = _ChunkedHeadCE.apply(x, labels, weight, None, 8, softcap, reduction)
            (out * factor).sum().backward()
            results.append((out.detach(), x.grad))
        (loss, grad), (frozen_loss, frozen_grad) = results
        torch.testing.assert_close(frozen_loss, loss, rtol=1e-5, atol=1e-4)
        # bf16: the two round the same gradient at different points (scaled or not), within its precision.
        error = (frozen_grad.float() - grad.float()).norm() / grad.float().norm()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), float(error)
        with torch.no_grad():  # without grad: the losses alone, nothing kept
            again = _FrozenHeadCE.apply(states, labels, weight, None, 8, softcap, reduction, _chunk_loss_and_gradient,
                                        False)
        torch.testing.assert_close(again, frozen_loss)


def _run_config(model_dir, out, double_quant: bool = False, **parallel) -> Config:
    cfg = Config()
    cfg.quant.double_quant = double_quant
    cfg.model.path = str(model_dir)
    cfg.data.path = str(resources.files("qshard") / "demo_data" / "train.jsonl")
    cfg.data.eval_fraction = 0.0
    cfg.data.max_length = 48
    cfg.data.packing = True  # rows of one width: compiled blocks trace once, not again for a dynamic width
    cfg.train.precision = "fp32"
    cfg.train.max_steps = 3
    cfg.train.micro_batch_size = 2
    cfg.optim.lr = 1e-2
    cfg.output.dir = str(out)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg.validate()


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# On CPU, aot_eager runs the traced graphs without generating code: it checks dynamo's tracing of each
# block (NF4 autograd function, LoRA, attention) under activation checkpointing and FSDP2's hooks, and
# the autograd of the traced graphs. On a GPU, inductor's generated kernels too (the fast path itself).
# Double-quantized NF4 too: its two tables (codes and scales) are two constants of each graph.
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("backend", ["inductor" if torch.cuda.is_available() else "aot_eager"])
def test_compiled_blocks_train_like_eager_blocks(tmp_path, tiny_models, backend, double_quant):
    model_dir = tiny_models("llama")
    train(_run_config(model_dir, tmp_path / "eager", double_quant))
    try:
        train(_run_config(model_dir, tmp_path / "compiled", double_quant, compile=True, compile_backend=backend))
    finally:
        torch._dynamo.reset()
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert len(eager) == 3
    assert compiled == pytest.approx(eager, rel=1e-5)


def _kept_activation_bytes(model, batch) -> int:
    """Bytes that autograd keeps from one forward for backward, parameters (and views of them) not counted."""
    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}
    kept = 0

    def pack(t):
        nonlocal kept
        if t.untyped_storage().data_ptr() not in params:
            kept += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch, use_cache=False)
    return kept


def _tiny_qlora(dist_env, model_dir, dropout=0.0, **parallel):
    cfg = Config()
    cfg.lora.rank, cfg.lora.dropout = 8, dropout
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    model.train()
    return model


def test_compiled_blocks_checkpoint_inside_their_graph(dist_env, tiny_models):
    """Compiled blocks are checkpointed inside their graph (parallel/checkpointing.py: traced_checkpoint) and
    keep no more for backward than blocks checkpointed by hooks around an eager forward; without any
    checkpointing they keep many times more. With LoRA dropout they keep hooks (traced, they would keep
    every dropout's output: 6x), so again no more. (Kept projections, the default, are tested below.)"""
    model_dir = tiny_models("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=1024)
    batch = {"input_ids": torch.randint(3, 200, (1, 128), generator=torch.Generator().manual_seed(0))}
    kept = {}
    for name, parallel in {
        "eager, hooks": {},
        "compiled, traced": {"compile": True, "compile_backend": "aot_eager", "ac_save_projections": False},
        "compiled, none": {"compile": True, "compile_backend": "aot_eager", "activation_checkpointing": False},
        "compiled, dropout": {"compile": True, "compile_backend": "aot_eager", "dropout": 0.1},
    }.items():
        try:
            kept[name] = _kept_activation_bytes(_tiny_qlora(dist_env, model_dir, **parallel), batch)
        finally:
            torch._dynamo.reset()
    assert kept["compiled, traced"] <= kept["eager, hooks"] * 1.2, kept
    assert kept["compiled, traced"] * 5 < kept["compiled, none"], kept
    assert kept["compiled, dropout"] <= kept["eager, hooks"] * 1.2, kept


def test_traced_checkpoint_keeps_the_narrowing_projections_and_computes_the_same(dist_env, tiny_models):
    """parallel.ac_save_projections: the traced checkpoint keeps the outputs of attention's q/k/v projections
    and of every adapter's A (the matmuls backward reads that do not widen their input), and attention's output
    and log-sum-exp (fp32, a value per head and token), nothing more: not o_proj's or down_proj's outputs, which
    backward does not read, nor the MLP's wide gate/up outputs. The gradients are those of recomputing them."""
    layers, hidden, inter, rank, tokens = 2, 256, 1024, 8, 128
    model_dir = tiny_models("llama", num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter)
    batch = {"input_ids": torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(0))}
    kept, grads = {}, {}
    for save in (False, True):
        try:
            model = _tiny_qlora(dist_env, model_dir, compile=True, compile_backend="aot_eager",
                                ac_save_projections=save)
            nonzero_lora_b(model)
            kept[save] = _kept_activation_bytes(model, batch)
            model(**batch, use_cache=False).logits.float().square().mean().backward()
        finally:
            torch._dynamo.reset()
        grads[save] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    config = model.config
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    attention = config.num_attention_heads * config.head_dim * 2 + config.num_attention_heads * 4
    expected = layers * tokens * ((qkv + 7 * rank) * 2 + attention)  # bf16, and the log-sum-exp in fp32
    # ... and, where torch saves the CPU generator's state to recompute attention (a seeded op; 2.13 does, 2.11 does
    # not), no longer that.
    rng_state = layers * torch.get_rng_state().numel()
    assert kept[True] - kept[False] in (expected, expected - rng_state), (kept, expected, rng_state)
    assert grads[False].keys() == grads[True].keys() and grads[False]
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("save_projections", [False, True])
def test_traced_checkpoint_dequantizes_each_weight_once_in_backward(dist_env, tiny_models, monkeypatch,
                                                                   save_projections):
    """In the backward graph of a block checkpointed inside its compiled graph, each NF4 weight is dequantized
    once, for the recomputed forward and the input's gradient both (`NF4Linear.in_traced_checkpoint`): 7 for a
    Llama block, where saving the storage dequantized the weights the recompute needs a second time (13 without
    kept projections: all but down_proj's again; 9 with them: gate's and up's). Counted in the backward graph of
    AOTAutograd's default partitioner, which merges no equal expressions, as nothing merges the GPU's kernel calls
    (aot_eager's and inductor's partitioner merge the plain-torch expressions the CPU runs): the nibble split
    `packed & 15` each dequantization in plain torch ops does once, or on a GPU the calls of qshard's kernel
    (quant/nf4_triton.py). And no dense weight is kept from forward to backward: none of the forward graph's
    outputs (what it saves) has a weight's shape, nor the widened shape of a weight with its adapter's B factor
    beside it (`_NF4MatmulBesideLowRank`). (tests/test_compile_graphs.py checks the same under inductor's
    partitioner.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs, backward_graphs = [], []

    def keeping(graphs):
        def compiler(gm, inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keeping(forward_graphs), bw_compiler=keeping(backward_graphs))
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, options=None, **kw:
                        compile_fn(fn, **{**kw, "backend": backend}))
    model_dir = tiny_models("llama")
    try:
        model = _tiny_qlora(dist_env, model_dir, compile=True, compile_backend="aot_eager",
                            ac_save_projections=save_projections)
        batch = {"input_ids": torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(0))}
        model(**batch, use_cache=False).logits.float().square().mean().backward()
    finally:
        torch._dynamo.reset()
    assert len(forward_graphs) == len(backward_graphs) == 1  # both blocks run one graph
    dequantizations = [n for n in backward_graphs[0].graph.nodes if n.target is torch.ops.aten.bitwise_and.Scalar
                       or "nf4_dequantize" in str(n.target) or "triton_kernel_wrapper" in str(n.target)]
    assert len(dequantizations) == 7, backward_graphs[0].graph
    # Kept projections keep attention's output and log-sum-exp too: backward then runs no attention forward.
    attention = [n for n in backward_graphs[0].graph.nodes  # recomputed under the random state it ran with
                 if n.target in _ATTENTION_OPS or any(arg in _ATTENTION_OPS for arg in n.args)]
    assert len(attention) == (0 if save_projections else 1), backward_graphs[0].graph
    weight_shapes = {(m.out_features, m.in_features + extra) for m in model.modules() if isinstance(m, NF4Linear)
                     for extra in (0, 8)}  # rank 8
    (outputs,) = [n.args[0] for n in forward_graphs[0].graph.nodes if n.op == "output"]
    # Computed tensors only: the graph's inputs it saves include the storage (down_proj's codes are [128, 128]).
    saved = [tuple(o.meta["val"].shape) for o in outputs
             if isinstance(o, torch.fx.Node) and o.op != "placeholder" and "val" in o.meta]
    static = {shape for shape in saved if all(type(d) is int for d in shape)}  # the tokens' dimension may be symbolic
    assert saved and not static & weight_shapes, saved


def test_only_blocks_checkpointed_inside_their_graph_save_dense_weights(dist_env, tiny_models):
    """With `parallel.ac_every 2` the second block is not checkpointed: its NF4 layers keep saving their storage
    (a dense weight saved there would be kept from forward to backward), the first block's save the weight."""
    from qshard.quant.nf4 import _NF4Matmul, _NF4MatmulInTracedCheckpoint

    try:
        model = _tiny_qlora(dist_env, tiny_models("llama"), compile=True, compile_backend="aot_eager", ac_every=2)
    finally:
        torch._dynamo.reset()
    matmuls = [{m._matmul for m in block.modules() if isinstance(m, NF4Linear)} for block in model.model.layers]
    assert matmuls == [{_NF4MatmulInTracedCheckpoint}, {_NF4Matmul}]
    # Only the first block's adapters join their B factors to the base's matmul (it saves the widened weight).
    joined = [{m.joined_with_base for m in block.modules() if isinstance(m, LoRALinear)}
              for block in model.model.layers]
    assert joined == [{True}, {False}]


def test_compiled_checkpointed_blocks_reuse_their_dropout_masks(dist_env, tiny_models):
    """LoRA dropout in a compiled, checkpointed block: backward must use the masks forward drew, not draw new
    ones when it recomputes the block. Same seed, same gradients as the compiled block without checkpointing.
    aot_eager draws from torch's generator in the same order in both graphs; inductor draws its own way per
    graph, so there the two graphs' masks would differ anyway (not checked with inductor)."""
    model_dir = tiny_models("llama")
    batch = {"input_ids": torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))}
    grads = []
    for checkpointing in (True, False):
        cfg = Config()
        cfg.lora.rank, cfg.lora.dropout = 8, 0.5
        cfg.parallel.compile, cfg.parallel.compile_backend = True, "aot_eager"
        cfg.parallel.activation_checkpointing = checkpointing
        torch.manual_seed(0)
        model, _ = build_model(cfg.validate(), dist_env, model_dir)
        model.train()
        nonzero_lora_b(model)
        torch.manual_seed(7)
        try:
            model(**batch, use_cache=False).logits.float().square().mean().backward()
        finally:
            torch._dynamo.reset()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "lora_A" in n})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_only_dropout_with_a_nonzero_rate_counts_as_random():
    """What the traced checkpoint keeps rather than recomputes: ops that draw random numbers. Attention can
    drop out, but with dropout_p 0 (most models in training) it is deterministic and cheaper recomputed."""
    from qshard.parallel.checkpointing import _draws_random_numbers

    q = torch.randn(1, 2, 8, 4)
    aten = torch.ops.aten
    assert _draws_random_numbers(aten.native_dropout.default, (q, 0.1, True), {})
    assert not _draws_random_numbers(aten.native_dropout.default, (q, 0.0, True), {})
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not _draws_random_numbers(flash, (q, q, q), {"dropout_p": 0.0, "is_causal": True})
    assert _draws_random_numbers(flash, (q, q, q, 0.2), {})
    assert not _draws_random_numbers(aten.mm.default, (q[0, 0], q[0, 0].T), {})
    assert _draws_random_numbers(aten.bernoulli.Tensor, (q, torch.full_like(q, 0.5)), {})  # p as a tensor
    assert _draws_random_numbers(aten.rand_like.default, (q,), {})


def test_kept_projections_keep_every_sdpa_kernel_and_random_ones_always():
    """The traced checkpoint's policy on each fused attention kernel sdpa dispatches to (the GPU's are never run on
    a CPU, so asked here directly): kept with ac_save_projections, recomputed without, kept either way when it
    drops out; and on the matmuls, narrowing ones kept with it only."""
    from torch.utils.checkpoint import CheckpointPolicy

    from qshard.parallel.checkpointing import _RecomputePolicy

    aten = torch.ops.aten
    assert {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_fused_attention_overrideable.default} <= _ATTENTION_OPS
    q = torch.randn(1, 2, 8, 4, device="meta")
    for op in _ATTENTION_OPS:
        for save, p, want in ((True, 0.0, "MUST_SAVE"), (False, 0.0, "MUST_RECOMPUTE"), (True, 0.1, "MUST_SAVE"),
                              (False, 0.1, "MUST_SAVE")):
            got = _RecomputePolicy(save)(None, op, q, q, q, dropout_p=p)
            assert got is getattr(CheckpointPolicy, want), (op, save, p, got)
    # As the checkpoint calls them: the dropout probability by position (after the bias and log-sum-exp flag).
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert _RecomputePolicy(False)(None, efficient, q, q, q, None, True, 0.1) is CheckpointPolicy.MUST_SAVE
    assert _RecomputePolicy(False)(None, efficient, q, q, q, None, True, 0.0) is CheckpointPolicy.MUST_RECOMPUTE
    x, narrowing, widening = torch.randn(8, 16, device="meta"), torch.randn(16, 4, device="meta"), \
        torch.randn(16, 64, device="meta")
    assert _RecomputePolicy(True)(None, aten.mm.default, x, narrowing) is CheckpointPolicy.MUST_SAVE
    assert _RecomputePolicy(True)(None, aten.mm.default, x, widening) is CheckpointPolicy.MUST_RECOMPUTE
    assert _RecomputePolicy(False)(None, aten.mm.default, x, narrowing) is CheckpointPolicy.MUST_RECOMPUTE


def test_trainer_batches_ask_the_device_nothing(dist_env, tiny_models):
    """The trainer's device batch: the loss positions computed on the host, and no attention mask where nothing
    is padded (transformers would inspect it on the device). The loss is the same as with the mask."""
    from conftest import device_batch

    from qshard.data import Example
    from qshard.train.loop import Trainer
    from qshard.train.loss import loss_positions

    model = _tiny_qlora(dist_env, tiny_models("llama"))
    examples = [Example(list(range(3, 3 + n)), [IGNORE_INDEX] * 4 + list(range(7, 3 + n))) for n in (20, 20, 13)]
    cfg = Config()
    cfg.train.micro_batch_size = 2
    trainer = Trainer(cfg.validate(), dist_env, model, examples, [], pad_id=0)
    full = device_batch(trainer, [0, 1])
    assert "attention_mask" not in full
    assert torch.equal(full["loss_positions"], loss_positions(full["labels"]))
    assert len(full["loss_positions"]) == 2 * (20 - 4)  # labels[1:]: 3 masked, 16 trained per row
    padded = device_batch(trainer, [0, 2])
    assert "attention_mask" in padded and not bool(padded["attention_mask"].all())

    with torch.no_grad():
        masked = dict(full, attention_mask=torch.ones_like(full["input_ids"]))
        del masked["loss_positions"]  # derived on the device instead
        torch.testing.assert_close(trainer.loss_sum(model, full), trainer.loss_sum(model, masked), rtol=1e-6, atol=1e-5)


# Compiled DoRA blocks take three times as long to trace: DoRA runs eagerly here.
@pytest.mark.parametrize("train_type, precision, compiled", [("lora", "bf16_mixed", True), ("dora", "fp32", False)])
def test_lora_blocks_on_one_device_are_used_in_place_and_train_as_in_units(tmp_path, tiny_models, monkeypatch,
                                                                            train_type, precision, compiled):
    """On one device a block that trains only LoRA (DoRA) adapters over a frozen base in the compute dtype has no
    FSDP2 unit (plain parameters, no one-rank gathers) and, compiled, is checkpointed inside its graph, as a QLoRA
    block is; its fp32 adapters cast themselves where used, so it trains to the losses of the earlier path, where
    each block had a unit (forced here) and a hooks-based checkpoint around its compiled graph. (Under bf16_mixed
    DoRA's row norms and magnitude now read the fp32 masters, as QDoRA's do, rather than a unit's bf16 copies.)"""
    from conftest import LogLines
    from torch.distributed.fsdp import FSDPModule

    from qshard.parallel import fsdp

    model_dir = tiny_models("llama")

    def run(name):
        backend = {"compile": True, "compile_backend": "aot_eager"} if compiled else {"compile": False}
        cfg = _run_config(model_dir, tmp_path / name, **backend)
        cfg.train.train_type, cfg.train.precision = train_type, precision
        try:
            return train(cfg.validate()).model
        finally:
            torch._dynamo.reset()

    lines, logger = LogLines(), logging.getLogger("qshard")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        model = run("in_place")
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    traced = ", 2 checkpointed inside their compiled graphs" if compiled else ""
    assert "2 of 2 LoRA/DoRA blocks used in place (one device: no FSDP2 units; the fp32 adapters cast where " \
           f"used){traced}" in lines.lines, lines.lines
    assert not any(isinstance(b, FSDPModule) for b in model.model.layers) and isinstance(model, FSDPModule)
    params = dict(model.model.layers.named_parameters())
    assert not any(isinstance(p, DTensor) for p in params.values())
    master = torch.float32
    adapters = {n for n in params if "lora_" in n or n.endswith("magnitude")}
    assert all(params[n].dtype == master and params[n].requires_grad for n in adapters)
    assert all(p.dtype == (master if precision == "fp32" else torch.bfloat16) and not p.requires_grad
               for n, p in params.items() if n not in adapters)

    monkeypatch.setattr(fsdp, "adapter_block", lambda block, mp: False)
    units = run("units")
    assert all(isinstance(b, FSDPModule) for b in units.model.layers)
    in_place, in_units = _losses(tmp_path / "in_place"), _losses(tmp_path / "units")
    assert len(in_place) == 3
    # The same casts in the same places (bf16_mixed too: the unit's bf16 copy of a master is the adapter's own cast).
    assert in_place == pytest.approx(in_units, rel=1e-6)
