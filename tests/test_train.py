"""Training end to end in this process, and the PEFT round trip for every supported architecture."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qshard import export
from qshard.config import Config
from qshard.train.run import train


def _config(model_dir, out, train_type="qlora", steps=6, precision="bf16_mixed") -> Config:
    from importlib import resources

    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.data.path = str(resources.files("qshard") / "demo_data" / "train.jsonl")
    cfg.data.eval_path = str(resources.files("qshard") / "demo_data" / "eval.jsonl")
    cfg.data.max_length = 48
    cfg.train.train_type = train_type
    cfg.train.precision = precision
    cfg.train.max_steps = steps
    cfg.train.micro_batch_size = 4
    cfg.optim.lr = 1e-2
    cfg.train.sample_every = 0  # samples: test_samples.py (test_architectures turns them on)
    cfg.output.dir = str(out)
    return cfg.validate()


def _peft_model(model_dir, adapter_dir, base_state, dtype):
    """The base as transformers loads it, given qshard's base weights, with the adapter through PEFT."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    missing, unexpected = hf.load_state_dict(base_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # only a tied head may be implied
    return peft.PeftModel.from_pretrained(hf, adapter_dir).eval()


def _check_roundtrip(result, model_dir, atol, dtype=torch.bfloat16):
    model = result.model
    adapter = result.out / "adapter"
    saved = load_file(adapter / "adapter_model.safetensors")
    base_state = dict(export.base_weights(model, dtype))
    pm = _peft_model(model_dir, adapter, base_state, dtype)

    # Every saved tensor landed in the PEFT model, and PEFT expects no tensor that is not saved.
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name].float(), tensor.float())
    assert any(t.abs().sum() > 0 for n, t in saved.items() if "lora_B" in n)

    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        ours = model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
        theirs = pm(input_ids=ids).logits.float()
    scale = ours.abs().max()
    assert (ours - theirs).abs().max() <= atol * scale, float((ours - theirs).abs().max() / scale)
    # and the adapter matters: without it the logits differ clearly
    with pm.disable_adapter(), torch.no_grad():
        plain = pm(input_ids=ids).logits.float()
    assert (ours - plain).abs().max() > 5 * atol * scale


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_qlora_trains_and_peft_loads_it(model_type, tiny_models, tmp_path, dist_env):
    """In fp32 qshard's trained model and transformers + PEFT on the same (dequantized) base agree tightly."""
    model_dir = tiny_models(model_type)
    result = train(_config(model_dir, tmp_path / "run", precision="fp32"), dist_env)
    assert result.summary["eval_loss_end"] < result.summary["eval_loss_start"]
    records = [json.loads(x) for x in (result.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_gib"} <= r.keys()
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
    _check_roundtrip(result, model_dir, atol=1e-4, dtype=torch.float32)


def test_qlora_bf16_peft_logits_within_bf16_tolerance(tiny_models, tmp_path, dist_env):
    """The default precision: bf16 compute here, fp32 adapter math in PEFT; a few bf16 ulps apart."""
    model_dir = tiny_models("llama")
    result = train(_config(model_dir, tmp_path / "run"), dist_env)
    _check_roundtrip(result, model_dir, atol=0.03)


def test_lora_on_bf16_base_roundtrip(tiny_models, tmp_path, dist_env):
    model_dir = tiny_models("llama")
    result = train(_config(model_dir, tmp_path / "run", train_type="lora"), dist_env)
    _check_roundtrip(result, model_dir, atol=0.03)


def test_full_finetune_trains_every_weight(tiny_models, tmp_path, dist_env):
    model_dir = tiny_models("llama")
    cfg = _config(model_dir, tmp_path / "run", train_type="full", steps=3)
    cfg.optim.lr = 1e-3
    result = train(cfg, dist_env)
    params = dict(result.model.named_parameters())
    assert all(p.requires_grad and p.dtype == torch.float32 for p in params.values())
    assert result.summary["adapter"] is None and not (result.out / "adapter").exists()
    assert result.summary["eval_loss_end"] < result.summary["eval_loss_start"]


def test_qlora_dtypes(tiny_models, tmp_path, dist_env):
    """fp32 master weights and optimizer state for the adapters; frozen base bf16; NF4 storage in its integer
    dtypes, since at world size 1 the blocks are used in place, with no FSDP2 unit to carry it in floats
    (the multi-rank tests check the carriers)."""
    cfg = _config(tiny_models("llama"), tmp_path / "run", steps=1)
    cfg.quant.double_quant = False  # the fp32-scale storage (packed, absmax); test_train_types trains the other
    result = train(cfg, dist_env)
    for name, p in result.model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad and p.dtype == torch.float32, name
        elif name.endswith("packed"):
            assert not p.requires_grad and p.dtype == torch.uint8, name
        elif name.endswith("absmax"):
            assert not p.requires_grad and p.dtype == torch.int32, name
        else:
            assert not p.requires_grad and p.dtype == torch.bfloat16, name


def test_one_device_blocks_have_no_fsdp_units(tiny_models, dist_env):
    """World size 1: quantized blocks are used in place (no FSDP2 unit, plain parameters: no one-rank gathers
    and copies), and so are the frozen embedding and head; the root stays a unit. So are the blocks of a bf16
    base that train only adapters (LoRA: they cast their fp32 masters where used). Under CPU offload (FSDP2 moves
    the storage) the blocks keep their units; blocks, embedding and head that train in full keep theirs."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from qshard.build import build_model
    from qshard.config import Config

    def built(**parallel):
        cfg = Config()
        cfg.train.train_type = parallel.pop("train_type", "qlora")
        for key, value in parallel.items():
            setattr(cfg.parallel, key, value)
        return build_model(cfg.validate(), dist_env, tiny_models("llama"))[0]

    model = built()
    block, embed, head = model.model.layers[0], model.get_input_embeddings(), model.get_output_embeddings()
    assert not isinstance(block, FSDPModule) and isinstance(model, FSDPModule)
    assert not any(isinstance(m, FSDPModule) for m in (embed, head))
    assert not any(isinstance(p, DTensor) for m in (block, embed, head) for p in m.parameters())
    assert isinstance(model.model.norm.weight, DTensor)  # the root's own
    lora, offloaded = built(train_type="lora"), built(cpu_offload=True)
    assert not any(isinstance(b, FSDPModule) for b in lora.model.layers)
    assert not any(isinstance(p, DTensor) for p in lora.model.layers.parameters())
    assert all(isinstance(b, FSDPModule) for b in offloaded.model.layers)
    assert not isinstance(lora.get_input_embeddings(), FSDPModule)  # frozen, bf16: in place
    # Under cpu_offload too: offloading a frozen embedding would only copy it to the GPU at every gather.
    assert not isinstance(offloaded.get_input_embeddings(), FSDPModule)
    # quant_sharding concerns quantized storage only: a LoRA run's blocks are in place under either setting
    assert not any(isinstance(b, FSDPModule) for b in built(train_type="lora", quant_sharding="dtensor").model.layers)
    full = built(train_type="full")
    assert all(isinstance(m, FSDPModule) for m in (full.get_input_embeddings(), full.get_output_embeddings()))
    assert all(isinstance(b, FSDPModule) for b in full.model.layers)


def test_adapter_blocks_are_used_in_place_all_together_or_not_at_all(tiny_models, dist_env, monkeypatch):
    """If one block that trains adapters could not be used in place, none is: the optimizer's adapter group takes
    one kind of tensor (plain or DTensor)."""
    from torch.distributed.fsdp import FSDPModule

    from qshard.build import build_model
    from qshard.config import Config
    from qshard.parallel import fsdp

    seen: list = []
    monkeypatch.setattr(fsdp, "adapter_block", lambda block, mp: seen.append(block) or block is seen[0])
    cfg = Config()
    cfg.train.train_type = "lora"
    model = build_model(cfg.validate(), dist_env, tiny_models("llama"))[0]
    assert len(seen) >= 2 and all(isinstance(b, FSDPModule) for b in model.model.layers)


def test_embedded_demo_end_to_end(tmp_path, capsys):
    """`qshard train` with no model and no data: the shipped demo, whose held-out loss must fall. Through
    qshard.cli.main in this process (what `python -m qshard` calls): a process start with torch's imports
    would add ~15% to this test's CPU time. 75 of its 500 steps (the preset's length is tests/test_config.py's):
    the held-out loss falls by about 4 in those too (8.50 -> 4.51 on 2026-12-03), in a seventh of the time."""
    from qshard.cli import main

    out = tmp_path / "demo"
    capsys.readouterr()
    code = main(["train", "--output-dir", str(out), "--max-steps", "75"])
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 75
    assert summary["eval_loss_end"] < summary["eval_loss_start"] - 2.0, summary
    assert "held-out loss" in stderr
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "config.yaml").is_file() and (out / "demo-model" / "config.json").is_file()
