"""The activation model of `qshard plan` against the tensors autograd really saves: the bytes per token each
block of the meta-skeleton probe predicts equal those a real CPU forward of the built model saves
(`saved_tensors_hooks`, torch's own SDPA kernel), without checkpointing and with it (a checkpointed block keeps
only its input)."""

from __future__ import annotations

import pytest
import torch

from qshard.config import resolve

LENGTHS = (24, 40)


def _saved_per_block(model, blocks, length: int) -> tuple[list[int], list[int]]:
    """Bytes each block saves for backward through autograd's hooks in one real forward of `length` tokens
    (parameters left out), and the bytes of each block's input (what a checkpoint keeps instead)."""
    params = {id(p) for p in model.parameters()}
    saved, seen, current, inputs = [0] * len(blocks), set(), [None], [0] * len(blocks)

    def enter(i, args, kwargs):
        current[0] = i
        states = args[0] if args else kwargs["hidden_states"]
        inputs[i] = states.untyped_storage().nbytes()

    def pack(t):
        base = t._base if t._base is not None else t
        weight = isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)  # FSDP2's gathered ones
        if current[0] is not None and id(base) not in seen and not weight and id(base) not in params:
            seen.add(id(base))
            saved[current[0]] += base.untyped_storage().nbytes()
        return t

    handles = [h for i, b in enumerate(blocks) for h in (
        b.register_forward_pre_hook(lambda _m, a, k, i=i: enter(i, a, k), with_kwargs=True),
        b.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))]
    ids = torch.randint(3, 300, (1, length), generator=torch.Generator().manual_seed(0))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    return saved, inputs


@pytest.mark.parametrize("overrides", [
    [("train.train_type", "qlora"), ("train.precision", "fp32")],
    [("train.train_type", "lora"), ("train.precision", "bf16_mixed"), ("lora.dropout", "0.1")],
    [("train.train_type", "qdora"), ("train.precision", "bf16"), ("quant.method", "hqq")],
    [("train.train_type", "full"), ("train.precision", "bf16_mixed")],
])
def test_probe_predicts_what_each_block_saves(tiny_models, dist_env, overrides):
    from qshard.build import build_model, skeleton
    from qshard.planner.activations import probe_activations

    model_dir = tiny_models("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2)
    for checkpointing in ("false", "true"):
        cfg = resolve(None, [("model.path", str(model_dir)), ("lora.rank", "4"),
                             ("parallel.activation_checkpointing", checkpointing), *overrides])
        acts = probe_activations(skeleton(cfg, model_dir, 1, dist_env.device), cfg)
        model, _ = build_model(cfg, dist_env, model_dir)
        blocks = list(model.model.layers)  # FSDP2 units of their own, or used in place
        (short, _), (long, inputs) = (_saved_per_block(model, blocks, n) for n in LENGTHS)
        slope = [(b - a) / (LENGTHS[1] - LENGTHS[0]) for a, b in zip(short, long)]
        if checkpointing == "false":
            assert slope == pytest.approx(acts.saved), (overrides, slope, acts.saved)
        else:  # nothing saved inside a checkpointed block: it keeps its input, outside autograd's hooks
            assert slope == [0.0] * len(blocks), slope
            assert inputs == [acts.block_input * LENGTHS[1]] * len(blocks), (inputs, acts.block_input)
        assert min(acts.saved) > 4 * acts.block_input  # what checkpointing saves is most of it
