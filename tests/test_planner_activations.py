"""The activation model of `qshard plan` against the tensors autograd really saves: the bytes per token each
block of the meta-skeleton probe predicts equal those a real CPU forward of the built model saves
(`saved_tensors_hooks`, torch's own SDPA kernel), without checkpointing and with it (a checkpointed block keeps
only its input)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


class _LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those made under it (each op's outputs while its
    inputs live), a storage counted once however many views share it."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.live.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.live = {ref: n for ref, n in self.live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def _no_grad_peak(model, head, length: int) -> int:
    """The peak of a real gradient-free forward of `length` tokens per row through the head's per-token log-probs
    (KTO's mismatched rows, a reference): the tensors it makes, weights apart (those it casts do not grow with
    the tokens)."""
    from qshard.train.loss import loss_positions

    ids = torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(0))  # KTO's micro-batch of 2
    batch = {"input_ids": ids, "labels": ids, "loss_positions": loss_positions(ids)}
    with torch.no_grad(), _LiveBytes() as live:
        head.token_logps(model, batch)
    return live.peak


@pytest.mark.parametrize("chunk", ["4096", "8"])
def test_a_gradient_free_forward_is_planned_as_measured(tiny_models, dist_env, chunk):
    """What KTO's mismatched rows and a reference hold at the peak of their gradient-free forwards, per token: the
    plan's part against a real CPU forward's measured peak, where the head's logits of every token set it, and
    where (in chunks of 8 tokens) a block's tensors do."""
    from qshard.build import build_model, skeleton
    from qshard.planner.activations import probe_activations
    from qshard.planner.estimate import Shapes, _no_grad_forward, _no_grad_head
    from qshard.train.loss import build_loss

    model_dir = tiny_models("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2)
    cfg = resolve(None, [("model.path", str(model_dir)), ("lora.rank", "4"), ("train.objective", "kto"),
                         ("train.micro_batch_size", "2"), ("train.precision", "bf16"),
                         ("train.loss_chunk_tokens", chunk)])
    plan_model = skeleton(cfg, model_dir, 1, dist_env.device)
    acts = probe_activations(plan_model, cfg)
    # long enough that what grows with the tokens outweighs the weights' casts, which the plan counts apart
    lengths = (256, 512)
    predicted = [_no_grad_forward(cfg, acts, Shapes(plan_model, cfg, n, 1), False) for n in lengths]  # frozen head
    model, _ = build_model(cfg, dist_env, model_dir)
    measured = [_no_grad_peak(model, build_loss(model, cfg.train.loss_chunk_tokens), n) for n in lengths]
    span = lengths[1] - lengths[0]
    slope, planned = (measured[1] - measured[0]) / span, (predicted[1] - predicted[0]) / span
    if chunk == "4096":  # the head's logits of all the tokens at once: the peak, counted exactly (the whole
        # forward's plan takes the larger of that and the blocks' bound, which here is larger)
        head = [_no_grad_head(cfg, Shapes(plan_model, cfg, n, 1), False) for n in lengths]
        assert (head[1] - head[0]) / span == pytest.approx(slope, rel=0.01) and planned >= slope, (measured, head)
    else:  # the blocks': what they would save for backward bounds what they hold at once without gradient
        assert slope <= planned <= 2 * slope, (measured, predicted)
