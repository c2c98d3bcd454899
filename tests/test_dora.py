"""DoRA against peft's DoRA on the same weights: outputs and gradients of one layer (bf16-style dense,
NF4 and HQQ bases), then a tiny Llama trained with dora / qdora, exported, reloaded by peft, merged,
checkpointed and restored."""

from __future__ import annotations

import copy
from importlib import resources

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qshard import checkpoint, export
from qshard.adapters import DoRALinear
from qshard.build import build_model
from qshard.config import Config
from qshard.quant import HQQLinear, NF4Linear
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"
IN, OUT, RANK, ALPHA = 128, 48, 4, 8.0


def _base(kind: str) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(our frozen base, the dense nn.Linear peft gets: the same function)."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(IN, OUT).requires_grad_(False)
    if kind == "linear":
        return dense, copy.deepcopy(dense)
    if kind == "nf4":
        base = NF4Linear(IN, OUT, bias=True, blocksize=64, bias_dtype=torch.float32)
    else:
        base = HQQLinear(IN, OUT, bias=True, bits=3, group_size=64, bias_dtype=torch.float32)
    base.set_weight(dense.weight)
    base.bias.data.copy_(dense.bias)
    dense.weight.data.copy_(base.dequantized_weight(torch.float32))
    return base.requires_grad_(False), dense


def _pair(kind: str, dropout: float = 0.0):
    """Our DoRALinear and peft's, holding the same A, B and magnitude (B and m moved off their init, so
    that the norm and the magnitude both matter)."""
    base, dense = _base(kind)
    ours = DoRALinear(base, IN, OUT, RANK, ALPHA, dropout)
    a, b = ours.init_adapter(torch.Generator().manual_seed(1))
    ours.lora_A.data.copy_(a)
    ours.lora_B.data.copy_(torch.randn(OUT, RANK, generator=torch.Generator().manual_seed(2)) * 0.05)
    ours.magnitude.data.mul_(1 + 0.1 * torch.rand(OUT, generator=torch.Generator().manual_seed(3)))
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=["0"], use_dora=True)
    theirs = peft.get_peft_model(torch.nn.Sequential(dense), config)
    layer = theirs.base_model.model[0]
    layer.lora_A["default"].weight.data.copy_(ours.lora_A)
    layer.lora_B["default"].weight.data.copy_(ours.lora_B)
    layer.lora_magnitude_vector["default"].weight.data.copy_(ours.magnitude)
    trained = {
        "A": layer.lora_A["default"].weight,
        "B": layer.lora_B["default"].weight,
        "m": layer.lora_magnitude_vector["default"].weight,
    }
    return ours, theirs, trained


@pytest.mark.parametrize("kind", ["linear", "nf4", "hqq"])
def test_outputs_and_gradients_match_peft(kind):
    ours, theirs, params = _pair(kind)
    x = torch.randn(3, 5, IN, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = ours(x), theirs(x2)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(y)
    y.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for mine, name in ((ours.lora_A, "A"), (ours.lora_B, "B"), (ours.magnitude, "m")):
        assert mine.grad is not None and mine.grad.abs().sum() > 0, name
        torch.testing.assert_close(mine.grad, params[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_matches_peft_in_training():
    """With adapter dropout, peft also takes the magnitude's rescaling of the base on the dropped input."""
    ours, theirs, params = _pair("linear", dropout=0.3)
    ours.train()
    theirs.train()
    x = torch.randn(4, IN)
    torch.manual_seed(7)
    y = ours(x)
    torch.manual_seed(7)
    y2 = theirs(x)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(ours.magnitude.grad, params["m"].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.lora_A.grad, params["A"].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "nf4"])
def test_starts_as_the_base_function_with_magnitude_from_row_norms(kind):
    base, dense = _base(kind)
    dora = DoRALinear(base, IN, OUT, RANK, ALPHA, 0.0)
    a, b = dora.init_adapter(torch.Generator().manual_seed(1))
    dora.lora_A.data.copy_(a)
    dora.lora_B.data.copy_(b)
    torch.testing.assert_close(dora.magnitude, dense.weight.norm(dim=1))
    x = torch.randn(2, IN)
    torch.testing.assert_close(dora(x), dense(x), rtol=1e-6, atol=1e-6)


def test_magnitude_is_the_norm_of_its_own_rows():
    """What sharded init relies on: each block of rows gets its magnitude from those rows alone."""
    base, dense = _base("hqq")
    full = DoRALinear(base, IN, OUT, RANK, ALPHA, 0.0)
    full.init_adapter(torch.Generator())
    half = HQQLinear(IN, OUT // 2, bias=False, bits=3, group_size=64)
    half.packed.data.copy_(base.packed[OUT // 2 :])
    half.scale_zero.data.copy_(base.scale_zero[OUT // 2 :])
    part = DoRALinear(half, IN, OUT // 2, RANK, ALPHA, 0.0)
    part.init_adapter(torch.Generator())
    assert torch.equal(part.magnitude, full.magnitude[OUT // 2 :])


# ---------------------------------------------------------------------------------------------------------------
# A tiny Llama trained in this process (world size 1, fp32), against peft and transformers.


def _config(model_dir, out, train_type, **quant) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.train_type = str(model_dir), "fp32", train_type
    cfg.data.path, cfg.data.eval_path, cfg.data.max_length = str(DEMO / "train.jsonl"), str(DEMO / "eval.jsonl"), 48
    cfg.train.max_steps, cfg.train.micro_batch_size, cfg.optim.lr = 4, 4, 1e-2
    cfg.output.dir = str(out)
    for key, value in quant.items():
        setattr(cfg.quant, key, value)
    return cfg.validate()


def _peft_twin(model, model_dir, adapter_dir):
    """transformers' model on qshard's (dequantized) base, with the exported adapter loaded by peft."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(dict(export.base_weights(model, torch.float32)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    # Trainable, so that its gradients can be compared with ours.
    return peft.PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True).eval()


def _loss_and_grads(model, ids, names):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    params = dict(model.named_parameters())
    return loss.detach(), {n: params[m].grad for n, m in names.items()}


@pytest.mark.parametrize(("train_type", "quant"), [("dora", {}), ("qdora", {"method": "hqq", "bits": 3})])
def test_tiny_llama_matches_peft_then_exports_and_restores(train_type, quant, tiny_models, tmp_path, dist_env):
    model_dir = tiny_models("llama")
    cfg = _config(model_dir, tmp_path / "run", train_type, **quant)
    result = train(cfg, dist_env)
    model = result.model
    assert result.summary["eval_loss_end"] < result.summary["eval_loss_start"]

    adapter = result.out / "adapter"
    saved = load_file(adapter / "adapter_model.safetensors")
    magnitudes = [k for k in saved if k.endswith(".lora_magnitude_vector")]
    assert len(magnitudes) == 2 * 7 and (adapter / "adapter_config.json").read_text().count('"use_dora": true') == 1
    twin = _peft_twin(model, model_dir, adapter)
    twin_params = dict(twin.named_parameters())
    for key, tensor in saved.items():  # peft loaded every tensor we wrote, the magnitudes included
        name = (
            key.replace(".lora_magnitude_vector", ".lora_magnitude_vector.default.weight")
            .replace(".lora_A.weight", ".lora_A.default.weight")
            .replace(".lora_B.weight", ".lora_B.default.weight")
        )
        assert torch.equal(twin_params[name].detach(), tensor), key

    # Same logits, same loss and same gradients for every trained tensor (a trained point, so m != ||V||).
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    model.eval()
    q = "model.layers.1.self_attn.q_proj"
    ours_names = {"A": f"{q}.lora_A", "B": f"{q}.lora_B", "m": f"{q}.magnitude"}
    twin_names = {
        "A": f"base_model.model.{q}.lora_A.default.weight",
        "B": f"base_model.model.{q}.lora_B.default.weight",
        "m": f"base_model.model.{q}.lora_magnitude_vector.default.weight",
    }
    loss, grads = _loss_and_grads(model, ids, ours_names)
    twin_loss, twin_grads = _loss_and_grads(twin, ids, twin_names)
    torch.testing.assert_close(loss, twin_loss, rtol=1e-5, atol=1e-6)
    for name in ours_names:
        grad = grads[name].full_tensor() if hasattr(grads[name], "full_tensor") else grads[name]  # QDoRA: in place
        torch.testing.assert_close(grad, twin_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
        theirs = twin(input_ids=ids).logits
        assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()
        with twin.disable_adapter():
            assert (ours - twin(input_ids=ids).logits).abs().max() > 1e-3 * ours.abs().max()

        # Merged export: the DoRA-merged weights, loaded by transformers, give the same logits.
        weights = export.model_weights(model, torch.float32, merge_adapters=True)
        export.write_merged(tmp_path / "merged", weights, model_dir, is_main=True, dtype=torch.float32)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert (ours - merged(input_ids=ids).logits).abs().max() <= 1e-5 * ours.abs().max()

    # The checkpoint holds the magnitudes: a fresh model restored from it has the trained adapter exactly.
    latest = checkpoint.find_latest(result.out / "checkpoints")
    restored, _ = build_model(cfg, dist_env, model_dir)
    before = {k: v.clone() for k, v in export.gather_lora(restored).items()}  # on CPU these alias the params
    checkpoint.load(latest, restored, optimizer=None)
    after = export.gather_lora(restored)
    assert after.keys() == saved.keys()
    assert all(torch.equal(after[k], saved[k]) for k in saved)
    assert any(not torch.equal(before[k], saved[k]) for k in magnitudes)
