"""Llama-Pro: `qshard expand` writes a deeper checkpoint that computes what the original did, and
`train_type: llama_pro` trains only the blocks it added."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train import _config
from transformers import AutoModelForCausalLM

from qshard import cli, export
from qshard.build import build_model
from qshard.config import Config
from qshard.errors import QShardError
from qshard.expand import MARKER, PARTIAL_MARKER, expand_checkpoint
from qshard.loading import Checkpoint
from qshard.train.run import train


def _logits(model_dir, ids) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_expanded_model_gives_the_original_logits(tiny_models, tmp_path):
    """2 layers + 2 new ones, written in several shards: the same logits, the copied weights bit for bit,
    the new blocks' output projections zero, the tokenizer carried over."""
    source = tiny_models("llama")
    out = tmp_path / "expanded"
    assert expand_checkpoint(source, out, 2, max_shard_bytes=300_000) == [1, 3]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config[MARKER] == {"new_layers": [1, 3], "original_layers": 2}
    assert (out / "tokenizer.json").is_file() and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert not list(tmp_path.glob("*.tmp"))

    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(out, ids), _logits(source, ids), rtol=0, atol=1e-5)
    before, after = Checkpoint(source), Checkpoint(out)
    for new, copied in ((1, 0), (3, 1)):
        for name in before.names():
            if f"layers.{copied}." not in name:
                continue
            value = after.read(name.replace(f"layers.{copied}.", f"layers.{new}."))
            zeroed = "o_proj" in name or "down_proj" in name
            assert torch.equal(value, torch.zeros_like(value) if zeroed else before.read(name)), name
    assert torch.equal(
        after.read("model.layers.2.mlp.down_proj.weight"), before.read("model.layers.1.mlp.down_proj.weight")
    )


def test_expand_command_and_its_refusals(tiny_models, tmp_path, capsys):
    source = tiny_models("llama")
    args = ["expand", "--model", str(source), "--output", str(tmp_path / "x"), "--new-blocks", "1"]
    assert cli.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main([*args[:-3], str(tmp_path / "y"), "--new-blocks", "3"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("qshard: error: --new-blocks 3: must divide the model's 2 layers")
    )
    names = Checkpoint(source).names()
    copies = {n.replace("layers.1.", "layers.2.") for n in names if "layers.1." in n}
    assert set(load_file(tmp_path / "x" / "model.safetensors")) == names | copies  # single file in, single out
    assert json.loads((tmp_path / "x" / "config.json").read_text())["num_hidden_layers"] == 3

    with pytest.raises(QShardError, match=r"--new-blocks 3: must divide the model's 2 layers"):
        expand_checkpoint(source, tmp_path / "y", 3)
    with pytest.raises(QShardError, match=r"--output: .*/x already exists and is not an empty directory"):
        expand_checkpoint(source, tmp_path / "x", 1)
    with pytest.raises(QShardError, match=r"already expanded"):
        expand_checkpoint(tmp_path / "x", tmp_path / "z", 1)
    # Phi writes the residual stream through `dense` and `fc2`: nothing Llama-Pro knows how to zero.
    phi = tiny_models("phi")
    with pytest.raises(QShardError, match=r"layer 1 has no attention output projection \(o_proj\)"):
        expand_checkpoint(phi, tmp_path / "p", 1)
    assert not (tmp_path / "y").exists() and not (tmp_path / "p").exists() and not (tmp_path / "p.tmp").exists()
    assert not (tmp_path / "x" / PARTIAL_MARKER).exists()  # a finished expansion does not look partial
    # A directory at the temporary path that an interrupted expansion did not leave is never deleted.
    (tmp_path / "w.tmp").mkdir()
    (tmp_path / "w.tmp" / "mine.txt").write_text("keep")
    with pytest.raises(QShardError, match=r"w.tmp exists and was not left by an interrupted qshard expand"):
        expand_checkpoint(source, tmp_path / "w", 1)
    assert (tmp_path / "w.tmp" / "mine.txt").read_text() == "keep"
    (tmp_path / "w.tmp" / PARTIAL_MARKER).touch()  # an interrupted run's leftover is replaced
    expand_checkpoint(source, tmp_path / "w", 1)
    assert not (tmp_path / "w.tmp").exists() and (tmp_path / "w" / "config.json").is_file()


def test_llama_pro_trains_only_the_new_blocks(tiny_models, tmp_path, dist_env):
    """Original blocks, embeddings and head keep the checkpoint's values; the new block moves; the merged
    export loads in transformers and gives qshard's logits."""
    expanded = tmp_path / "expanded"
    expand_checkpoint(tiny_models("llama"), expanded, 1)  # layers 0, 1 and the new 2
    cfg = _config(expanded, tmp_path / "run", train_type="llama_pro", steps=3, precision="fp32")
    cfg.optim.lr = 1e-3
    result = train(cfg, dist_env)
    model = result.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("model.layers.2.") for n in trainable)
    assert result.summary["adapter"] is None
    stored = Checkpoint(expanded)
    for name, param in model.named_parameters():
        value = param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()
        if name in trainable:
            assert param.dtype == torch.float32
        else:
            assert torch.equal(value, stored.read(name).float()), name
    o_proj = model.model.layers[2].self_attn.o_proj.weight.full_tensor()
    assert o_proj.abs().max() > 0  # was zero: the new block learned something

    merged = tmp_path / "merged"
    export.write_merged(merged, export.model_weights(model, torch.float32), expanded, True, dtype=torch.float32)
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(_logits(merged, ids), ours, rtol=0, atol=1e-4)


def test_llama_pro_needs_an_expanded_model(tiny_models, dist_env):
    cfg = Config()
    cfg.train.train_type = "llama_pro"
    with pytest.raises(QShardError, match=r"llama_pro: the model's config.json has no 'qshard_llama_pro' entry"):
        build_model(cfg, dist_env, tiny_models("llama"))
