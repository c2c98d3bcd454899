"""Mixture-of-experts checkpoints in the Hub's per-expert layout load as the fused layout does."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_architectures import MOE
from test_loading import _nf4_state
from transformers import AutoModelForCausalLM

from qshard.build import build_model
from qshard.config import Config
from qshard.errors import QShardError

FAMILIES = {
    # model type, tiny-model overrides, the module name and per-expert (gate, up, down) names on the Hub
    "mixtral": (dict(num_local_experts=4, **MOE), "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": (
        dict(num_experts=4, moe_intermediate_size=128, decoder_sparse_step=1, **MOE),
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
    ),
}


def _per_expert_copy(fused_dir, dest, family: str):
    """The fused checkpoint rewritten as the Hub stores it: one 2-D tensor per expert and projection (gate
    and up split apart), the MoE module under its Hub name, in two shards with an index."""
    _, module, (gate, up, down) = FAMILIES[family]
    dest.mkdir()
    for f in fused_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dest / f.name)
    tensors = {}
    for name, value in load_file(fused_dir / "model.safetensors").items():
        match = re.match(r"(.+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$", name)
        if match is None:
            tensors[name] = value
            continue
        prefix = f"{match[1]}.{module}"
        if match[2] == "gate.weight":
            tensors[f"{prefix}.gate.weight"] = value
            continue
        for e, expert in enumerate(value):
            if match[3] == "down_proj":
                tensors[f"{prefix}.experts.{e}.{down}.weight"] = expert.clone()
            else:
                g, u = expert.chunk(2, dim=0)
                tensors[f"{prefix}.experts.{e}.{gate}.weight"] = g.clone()
                tensors[f"{prefix}.experts.{e}.{up}.weight"] = u.clone()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: tensors[n] for n in part}, dest / f"part{i}.safetensors")
        weight_map.update(dict.fromkeys(part, f"part{i}.safetensors"))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_expert_layout_loads_like_the_fused_one(family, tiny_models, tmp_path, dist_env):
    fused = tiny_models(family, **FAMILIES[family][0])
    per_expert = _per_expert_copy(fused, tmp_path / "per-expert", family)
    ids = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))

    def hf_logits(model_dir):
        with torch.no_grad():
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits

    # transformers converts the per-expert files itself: they hold the same model (the test's layout is right).
    torch.testing.assert_close(hf_logits(per_expert), hf_logits(fused), rtol=0, atol=0)

    cfg = Config()
    cfg.train.precision = "fp32"
    reference, loaded = (build_model(cfg, dist_env, d)[0] for d in (fused, per_expert))
    expected, state = _nf4_state(reference), _nf4_state(loaded)
    assert state.keys() == expected.keys()
    for name in expected:
        assert torch.equal(state[name], expected[name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_per_expert_layout_with_an_expert_missing(tiny_models, tmp_path, dist_env):
    per_expert = _per_expert_copy(tiny_models("mixtral", **FAMILIES["mixtral"][0]), tmp_path / "m", "mixtral")
    index = json.loads((per_expert / "model.safetensors.index.json").read_text())
    victim = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    shard = per_expert / index["weight_map"].pop(victim)
    save_file({n: t for n, t in load_file(shard).items() if n != victim}, shard)
    (per_expert / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        QShardError,
        match=rf"checkpoint has no tensor '{re.escape(victim)}' needed to build "
        r"'model.layers.1.mlp.experts.gate_up_proj' \[4, 256, 128\]",
    ):
        build_model(Config(), dist_env, per_expert)
