"""Every supported architecture: a tiny random instance loads, trains QLoRA steps, and its PEFT adapter
reproduces qshard's logits in transformers; models qshard cannot train are refused up front, by name."""

from __future__ import annotations

import pytest
import torch
from test_train import _check_roundtrip, _config

from qshard.build import build_model
from qshard.config import Config
from qshard.errors import QShardError
from qshard.quant import NF4Linear
from qshard.quant import QuantizedExperts as NF4Experts
from qshard.train.run import train


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t

MOE = dict(num_experts_per_tok=2, intermediate_size=128)
ARCHITECTURES = {
    "llama3-rope-scaling": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "gemma2-tied": ("gemma2", dict(tie_word_embeddings=True)),
    "gemma3-text-tied": ("gemma3_text", dict(tie_word_embeddings=True, sliding_window=16)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "phi3": ("phi3", {}),
    "mixtral": ("mixtral", dict(num_local_experts=4, **MOE)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=128, decoder_sparse_step=1, **MOE)),
}
# (Llama, Mistral, Qwen2 and Qwen3 without these twists are trained in test_train.py.)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_and_exports(name, tiny_models, tmp_path, dist_env):
    model_type, overrides = ARCHITECTURES[name]
    model_dir = tiny_models(model_type, **overrides)
    cfg = _config(model_dir, tmp_path / "run", precision="fp32", steps=4)
    cfg.train.eval_every = 0
    cfg.train.sample_every = None  # samples at the end: generation with each architecture's KV cache
    result = train(cfg, dist_env)
    summary = result.summary
    assert summary["steps"] == 4 and summary["eval_loss_end"] < summary["eval_loss_start"]
    model = result.model
    assert any(isinstance(m, NF4Linear) for m in model.modules())
    # Every frozen linear of the blocks is NF4: the plain linears left are LoRA's trainable A and B.
    linears = [m for b in model.model.layers for m in b.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.requires_grad for m in linears)
    experts = [m for m in model.modules() if isinstance(m, NF4Experts)]
    assert len(experts) == (2 if model_type in ("mixtral", "qwen3_moe") else 0)
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    _check_roundtrip(result, model_dir, atol=1e-4, dtype=torch.float32)


def test_experts_are_quantized_per_expert(tiny_models, dist_env):
    """The fused [experts, out, in] weight's NF4 rows are each expert quantized on its own."""
    from qshard.loading import Checkpoint
    from qshard.quant import dequantize_nf4, quantize_nf4

    model_dir = tiny_models("mixtral", num_local_experts=4, **MOE)
    cfg = Config()
    cfg.quant.double_quant = False  # fp32 NF4 scales: the storage this test inspects (absmax)
    model, report = build_model(cfg, dist_env, model_dir)
    layer = model.model.layers[0].mlp.experts
    assert isinstance(layer, NF4Experts) and "model.layers.0.mlp.experts" in report.quantized
    # Quantized where the model lives (bitsandbytes' CUDA and CPU paths are compared with themselves).
    stored = Checkpoint(model_dir).read("model.layers.0.mlp.experts.down_proj").to(layer.down_proj.packed.device)
    for e in range(stored.shape[0]):
        packed, absmax = quantize_nf4(stored[e], 64)
        rows = slice(e * stored.shape[1], (e + 1) * stored.shape[1])
        # As integers: the storage is held as float carriers of the same bytes (parallel/fsdp.py); on one
        # device as plain tensors (no FSDP2 unit on the blocks), elsewhere as DTensor shards.
        assert torch.equal(_local(layer.down_proj.packed).view(torch.uint8)[rows], packed)
        assert torch.equal(_local(layer.down_proj.absmax).view(torch.int32)[rows], absmax)
    weight = dequantize_nf4(_local(layer.down_proj.packed), _local(layer.down_proj.absmax), torch.float32)
    assert (weight.view(stored.shape) - stored.float()).abs().max() < 0.2 * stored.float().abs().max()


def test_double_quantized_experts_are_each_expert_on_its_own_and_train(tiny_models, dist_env):
    """quant.double_quant over fused experts: each expert's rows hold its own NF4 codes, absmax codes and row
    scales (what a per-expert quantization gives), and a forward and backward through them runs."""
    from qshard.loading import Checkpoint
    from qshard.quant import NF4DoubleQuantLinear, quantize_nf4
    from qshard.quant.nf4 import compress_absmax

    model_dir = tiny_models("mixtral", num_local_experts=4, **MOE)
    cfg = Config()
    cfg.quant.double_quant = True
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    layer = model.model.layers[0].mlp.experts.down_proj
    assert isinstance(layer, NF4DoubleQuantLinear)
    stored = Checkpoint(model_dir).read("model.layers.0.mlp.experts.down_proj").to(layer.packed.device)
    for e in range(stored.shape[0]):
        packed, absmax = quantize_nf4(stored[e], 64)
        codes, row_absmax = compress_absmax(absmax, layer.codes_width)
        rows = slice(e * stored.shape[1], (e + 1) * stored.shape[1])
        assert torch.equal(_local(layer.packed).view(torch.uint8)[rows], packed)
        assert torch.equal(_local(layer.absmax_codes).view(torch.uint8)[rows], codes)
        assert torch.equal(_local(layer.row_absmax).view(torch.int32)[rows], row_absmax)
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0)).to(layer.packed.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_model_without_block_declaration_is_refused(tiny_models):
    from qshard import models
    from qshard.hf_config import load_hf_config

    model = models.build_skeleton(load_hf_config(tiny_models("llama")), Config())
    model._no_split_modules = None  # as a model class that never declared its block
    with pytest.raises(QShardError, match="LlamaForCausalLM does not declare _no_split_modules.*model.block_class"):
        models.find_blocks(model, None)


def test_blocks_without_linears_are_refused(tiny_models, dist_env):
    cfg = Config()
    cfg.model.block_class = "LlamaRMSNorm"  # a "block" that holds no linear layer
    with pytest.raises(QShardError, match="LlamaForCausalLM: its blocks contain no nn.Linear"):
        build_model(cfg, dist_env, tiny_models("llama"))


def test_unquantizable_experts_module_is_refused(tiny_models, dist_env, monkeypatch):
    """An experts module with more than 3-D weights (here a 2-D bias added to Mixtral's) is named and refused
    before any weight is read."""
    from transformers.models.mixtral import modeling_mixtral

    init = modeling_mixtral.MixtralExperts.__init__

    def with_bias(self, config):
        init(self, config)
        self.down_bias = torch.nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    monkeypatch.setattr(modeling_mixtral.MixtralExperts, "__init__", with_bias)
    with pytest.raises(QShardError, match=r"MixtralForCausalLM: experts module 'model.layers.0.mlp.experts' "
                                          r"\(MixtralExperts\).*down_bias.*train_type lora"):
        build_model(Config(), dist_env, tiny_models("mixtral", num_local_experts=4, **MOE))
