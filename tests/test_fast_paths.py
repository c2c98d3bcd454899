"""Every fast path computes the same function as the plain one: the plain-torch NF4 dequantization used in
compiled blocks, the chunked cross-entropy, and compiled blocks themselves."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
from torch.distributed.tensor import DTensor

from qshard.build import build_model
from qshard.config import Config
from qshard.data import IGNORE_INDEX
from qshard.quant import quantize_nf4
from qshard.quant.nf4 import dequantize_nf4, dequantize_nf4_torch
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


# gemma2 soft-caps its logits; qwen2's tiny model ties the head to the embeddings.
@pytest.mark.parametrize(("model_type", "train_type"), [("llama", "qlora"), ("gemma2", "full"), ("qwen2", "full")])
def test_chunked_loss_equals_full_logits(dist_env, tiny_models, model_type, train_type):
    cfg = Config()
    cfg.model.dtype = "float32"
    cfg.train.train_type = train_type
    model, _ = build_model(cfg.validate(), dist_env, tiny_models(model_type))
    chunked = build_loss(model, chunk_tokens=7)  # several chunks and a short last one
    assert isinstance(chunked, ChunkedLoss)
    if model_type == "gemma2":
        assert chunked.softcap
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


def _run_config(model_dir, out, **parallel) -> Config:
    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.data.path = str(resources.files("qshard") / "demo_data" / "train.jsonl")
    cfg.data.eval_fraction = 0.0
    cfg.data.max_length = 48
    cfg.model.dtype = "float32"
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
@pytest.mark.parametrize("backend", ["inductor" if torch.cuda.is_available() else "aot_eager"])
def test_compiled_blocks_train_like_eager_blocks(tmp_path, tiny_models, backend):
    model_dir = tiny_models("llama")
    train(_run_config(model_dir, tmp_path / "eager"))
    try:
        train(_run_config(model_dir, tmp_path / "compiled", compile=True, compile_backend=backend))
    finally:
        torch._dynamo.reset()
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert len(eager) == 3
    assert compiled == pytest.approx(eager, rel=1e-5)
