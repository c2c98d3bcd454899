"""Preference tuning: each method's loss and gradient against its paper's formula written out here, the options'
range checks, the reference as the base with adapters off, preference data, and training runs."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import LogLines

from qshard.adapters.lora import LoRALinear
from qshard.config import Config
from qshard.errors import QShardError
from qshard.train import preference as pref


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _logps(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Policy and reference per-sequence log-probs; mean ones as a per-token average (always below 0).
    pc, pr, rc, rr = (-(torch.rand(n, generator=g, dtype=torch.float64) * 20 + 1) for _ in range(4))
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr


def _check(ours, theirs, inputs):
    """Values equal, and gradients of the summed loss with respect to `inputs`."""
    torch.testing.assert_close(ours, torch.tensor(theirs, dtype=ours.dtype))
    grads = torch.autograd.grad(ours.sum(), inputs)
    for i, x in enumerate(inputs):
        for j in range(x.numel()):  # central differences of the paper's formula, element by element
            h = 1e-6
            up = [v.detach().clone() for v in inputs]
            down = [v.detach().clone() for v in inputs]
            up[i][j] += h
            down[i][j] -= h
            expected = (sum(_theirs_fn(*up)) - sum(_theirs_fn(*down))) / (2 * h)
            assert abs(grads[i][j].item() - expected) < 1e-5 * max(1.0, abs(expected)), (i, j)


_theirs_fn = None


def _use(fn):
    global _theirs_fn
    _theirs_fn = fn
    return fn


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_loss_and_gradient_are_the_papers(smoothing):
    pc, pr, rc, rr = _logps()
    beta = 0.3

    @_use
    def theirs(pc, pr):
        out = []
        for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True):
            z = beta * ((a - c) - (b - d))
            out.append(-(1 - smoothing) * math.log(_sig(z)) - smoothing * math.log(_sig(-z)))
        return out

    losses, chosen, rejected = pref.dpo_loss(pc, pr, rc, rr, beta, smoothing)
    torch.testing.assert_close(chosen, (beta * (pc - rc)).detach())
    torch.testing.assert_close(rejected, (beta * (pr - rr)).detach())
    _check(losses, theirs(pc.detach(), pr.detach()), (pc, pr))


def test_ipo_loss_and_gradient_are_the_papers():
    pc, pr, rc, rr = _logps(seed=1)
    tau = 0.5

    @_use
    def theirs(pc, pr):
        return [((a - c) - (b - d) - 1 / (2 * tau)) ** 2
                for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True)]

    _check(pref.ipo_loss(pc, pr, rc, rr, tau)[0], theirs(pc.detach(), pr.detach()), (pc, pr))


def test_orpo_loss_and_gradient_are_the_papers():
    pc, pr, _, _ = _logps(seed=2)
    mc, mr = (x.detach().div(7).requires_grad_() for x in (pc, pr))  # mean log-probs in (-3, 0)
    lam = 0.25

    @_use
    def theirs(mc, mr):
        out = []
        for a, b in zip(mc.tolist(), mr.tolist(), strict=True):
            odds = lambda lp: math.exp(lp) / (1 - math.exp(lp))  # noqa: E731
            out.append(-a - lam * math.log(_sig(math.log(odds(a) / odds(b)))))
        return out

    losses, _, _, nll, ratio = pref.orpo_loss(mc, mr, lam, 0.1)
    torch.testing.assert_close(nll, -mc.detach())
    _check(losses, theirs(mc.detach(), mr.detach()), (mc, mr))


def test_simpo_loss_and_gradient_are_the_papers():
    pc, pr, _, _ = _logps(seed=3)
    mc, mr = (x.detach().div(9).requires_grad_() for x in (pc, pr))
    beta, gamma = 2.0, 0.7

    @_use
    def theirs(mc, mr):
        return [-math.log(_sig(beta * a - beta * b - gamma)) for a, b in zip(mc.tolist(), mr.tolist(), strict=True)]

    _check(pref.simpo_loss(mc, mr, beta, gamma)[0], theirs(mc.detach(), mr.detach()), (mc, mr))


def test_kto_loss_and_gradient_are_the_papers():
    pd, pu, rd, ru = _logps(n=4, seed=4)
    pd, rd = pd[:3].detach().requires_grad_(), rd[:3]  # unequal counts of desirable and undesirable examples
    # The mismatched pairs' log-probs (prompt i with another example's completion), of two micro-batches; the last
    # row of the second compares nothing (weight 0).
    pm, rm = (-(torch.rand(7, generator=torch.Generator().manual_seed(s), dtype=torch.float64) * 20) for s in (5, 6))
    pm = pm.requires_grad_()
    w = torch.tensor([1.0, 1, 1, 1, 1, 1, 0])
    beta, wd, wu = 0.2, 1.0, 1.5
    kl = pref.kto_kl([pm[:4], pm[4:]], [rm[:4], rm[4:]], [w[:4], w[4:]])
    mismatched = [a - c for a, c in zip(pm.tolist()[:6], rm.tolist()[:6], strict=True)]
    z0 = max(0.0, sum(mismatched) / len(mismatched))
    assert z0 > 0 and kl.item() == pytest.approx(z0) and not kl.requires_grad
    assert pref.kto_kl([pm[:1]], [pm[:1].detach() + 1], [w[:1]]).item() == 0  # at least 0

    @_use
    def theirs(pd, pu):  # z0 held fixed: the paper's reference point takes no gradient
        out = [wd * (1 - _sig(beta * ((a - c) - z0))) for a, c in zip(pd.tolist(), rd.tolist(), strict=True)]
        return out + [wu * (1 - _sig(beta * (z0 - (b - d)))) for b, d in zip(pu.tolist(), ru.tolist(), strict=True)]

    loss_d, loss_u, _, _ = pref.kto_loss(pd, pu, rd, ru, kl, beta, wd, wu)
    _check(torch.cat([loss_d, loss_u]), theirs(pd.detach(), pu.detach()), (pd, pu))


class _Adapters(LoRALinear):
    """A stand-in policy: its log-probs are a function of the tokens written out below, and adapters_disabled
    switches it to its reference (it counts as a LoRA layer)."""

    def __init__(self, match: float, shift: list[float]):
        torch.nn.Module.__init__(self)  # none of a LoRA layer's weights: only its switch
        self.match = torch.nn.Parameter(torch.tensor(match, dtype=torch.float64))
        self.shift = shift
        self.adapter_enabled = True


def _stand_in_head():
    class Head:
        @staticmethod
        def token_logps(model, batch):
            """Reference: -1 a token. Policy: + shift[prompt] a token, + match for a completion token equal to
            its prompt's token + 10 (the prompt's own answer)."""
            labels = batch["labels"][:, 1:]
            rows, cols = (labels != -100).nonzero(as_tuple=True)
            token, prompt = labels[rows, cols], batch["input_ids"][rows, 0]
            out = torch.full(token.shape, -1.0, dtype=torch.float64)
            if model.adapter_enabled:
                shift = torch.tensor(model.shift, dtype=torch.float64)[prompt]
                out = out + shift + model.match * (token == prompt + 10)
            return out

    return Head()


def _kto_examples(labels):
    from qshard.data.example import Example
    from qshard.data.preference import Pair

    empty = Example([], [])
    pairs = []
    for p, desirable in enumerate(labels):  # prompt [p, 7], completion [p + 10, p + 10]
        row = Example([p, 7, p + 10, p + 10], [-100, -100, p + 10, p + 10])
        pairs.append(Pair(row, empty) if desirable else Pair(empty, row))
    return pairs


def test_kto_reference_point_is_from_mismatched_pairs_of_the_whole_global_batch():
    """The KTO loss of collated examples against the paper's, z0 from each prompt paired with the next example's
    completion: the same for the global batch as one micro-batch of 4 or two of 2 (here each mismatched pair's
    log-ratio depends on its prompt alone); and a desirable example of a large reward saturates."""
    from qshard.data.preference import collate_kto, mismatched_rows

    cfg = Config()
    cfg.train.objective, cfg.train.micro_batch_size, cfg.pref.beta = "kto", 2, 0.5
    loss_fn = pref.PreferenceLoss(cfg.validate(), _stand_in_head())
    labels, shift, match, beta = [True, False, True, False], [0.3, -0.1, 0.6, 0.2], 0.4, 0.5
    pairs = _kto_examples(labels)

    kl = mismatched_rows(collate_kto(pairs, pad_id=0))
    # Each example's prompt with the next one's completion, the last's with the first's.
    assert kl["input_ids"].tolist() == [[0, 7, 11, 11], [1, 7, 12, 12], [2, 7, 13, 13], [3, 7, 10, 10]]
    assert kl["labels"][:, :2].eq(-100).all() and kl["weight"].tolist() == [1, 1, 1, 1]
    assert mismatched_rows(collate_kto(pairs[:1], pad_id=0))["weight"].tolist() == [0]  # nothing to pair it with

    z0 = max(0.0, sum(2 * s for s in shift) / 4)  # a mismatched pair: 2 tokens of its prompt's shift, no match
    rewards = [2 * (s + match) for s in shift]
    expected = sum(1 - _sig(beta * (r - z0)) if d else 1 - _sig(beta * (z0 - r)) for r, d in zip(rewards, labels))

    def step_loss(model, batches):
        batches = [collate_kto(b, pad_id=0) for b in batches]
        loss_fn.start_step(model, batches)
        assert all(b["kto_z0"].item() == pytest.approx(z0) for b in batches)
        return sum(loss_fn(model, b)[0] for b in batches)

    model = _Adapters(match, shift)
    whole = step_loss(model, [pairs])
    assert whole.item() == pytest.approx(expected)
    halves = step_loss(model, [pairs[:2], pairs[2:]])  # each half alone would have its own z0
    assert halves.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(whole, model.match)
    theirs = sum(-2 * beta * _sig(beta * (r - z0)) * (1 - _sig(beta * (r - z0))) * (1 if d else -1)
                 for r, d in zip(rewards, labels))
    assert grad.item() == pytest.approx(theirs)
    alone = loss_fn(model, collate_kto(pairs, pad_id=0))[0]  # evaluated without start_step: its own z0
    assert alone.item() == pytest.approx(expected)

    # Desirable examples of a large reward: loss and gradient go to 0 (not 0.5 and -beta / 4 as with z0 = r).
    desirable = _kto_examples([True, True])
    model = _Adapters(40.0, [0.0, 0.0])
    loss = loss_fn(model, collate_kto(desirable, pad_id=0))[0]
    (grad,) = torch.autograd.grad(loss, model.match)
    assert loss.item() < 1e-6 and abs(grad.item()) < 1e-6


def test_objectives_are_chosen_once_with_their_defaults():
    cfg = Config()
    cfg.train.objective = "simpo"
    objective = pref.build_objective(cfg.validate())
    assert isinstance(objective, pref.SimPO) and objective.beta == 2.0 and not objective.needs_reference
    cfg.train.objective, cfg.pref.beta, cfg.pref.length_normalization = "dpo", 0.5, True
    objective = pref.build_objective(cfg.validate())
    assert objective.beta == 0.5 and objective.needs_reference and objective.length_normalized
    t = torch.tensor
    logps = pref.PairLogps(t([-1.0, -4.0]), t([-2.0, -1.0]), t([-0.5, -1.0]), t([-1.0, -0.5]), t([-2.0, -2.0]),
                           t([-2.0, -2.0]), t([-0.6, -0.6]), t([-0.7, -0.7]))
    loss, sums = objective(logps)
    # Means compared with means: the reference's too.
    torch.testing.assert_close(loss, pref.dpo_loss(t([-0.5, -1.0]), t([-1.0, -0.5]), t([-0.6, -0.6]),
                                                   t([-0.7, -0.7]), 0.5)[0].sum())
    metrics = pref.finish_metrics(objective.metrics, sums.tolist())
    assert metrics["rewards_accuracy"] == 0.5  # mean log-probs compared: pair 1 prefers chosen, pair 2 not
    assert metrics["logps_chosen"] == -2.5  # summed log-probs reported, whatever the loss compares
    torch.testing.assert_close(metrics["rewards_margin"], metrics["rewards_chosen"] - metrics["rewards_rejected"])


@pytest.mark.parametrize("setting, message", [
    ({"train.objective": "dpo", "pref.beta": 0}, "pref.beta must be > 0"),
    ({"train.objective": "dpo", "pref.label_smoothing": 0.6}, "pref.label_smoothing must be in [0.0, 0.5]"),
    ({"train.objective": "orpo", "pref.orpo_lambda": -1}, "pref.orpo_lambda must be >= 0"),
    ({"train.objective": "simpo", "pref.simpo_gamma": -0.1}, "pref.simpo_gamma must be >= 0"),
    ({"train.objective": "kto", "pref.kto_undesirable_weight": -1}, "pref.kto_undesirable_weight must be >= 0"),
    ({"train.objective": "dpo", "pref.max_prompt_length": 600}, "pref.max_prompt_length must be below"),
    ({"train.objective": "simpo", "pref.label_smoothing": 0.1}, "pref.label_smoothing: applies to train.objective dpo"),
    ({"train.objective": "orpo", "pref.precompute_reference": True}, "pref.precompute_reference: applies to"),
    ({"pref.beta": 0.1}, "pref.beta: applies to a preference train.objective, not sft"),
    ({"train.objective": "dpo", "data.packing": True}, "data.packing: train.objective dpo"),
    ({"train.objective": "dpo", "train.train_type": "full"}, "train.objective: dpo takes its reference"),
    ({"train.objective": "rlhf"}, "train.objective must be one of sft, dpo, ipo, orpo, simpo, kto"),
    ({"train.objective": "kto", "train.micro_batch_size": 1}, "train.micro_batch_size: train.objective kto estimates"),
    ({"train.objective": "kto", "train.micro_batch_size": 2, "pref.precompute_reference": True},
     "pref.precompute_reference: train.objective kto's reference point needs"),
    ({"train.objective": "kto", "train.micro_batch_size": 2, "train.init_adapter": "run"},
     "train.init_adapter: train.objective kto would need"),
])
def test_bad_preference_options_are_one_line_exit_2(setting, message, capsys):
    from qshard.cli import main

    flags = [x for key, value in setting.items() for x in (f"--{key}", str(value).lower())]
    assert main(["train", "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qshard: error: ") and message in err, err


# ------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("train_type", ["qlora", "qdora"])
def test_reference_is_the_base_with_adapters_off(train_type, tiny_models, dist_env):
    """Inside adapters_disabled the model computes what transformers computes from its (dequantized) base weights;
    outside, the adapters are back, bit for bit."""
    from transformers import AutoModelForCausalLM

    from qshard import export
    from qshard.adapters import LoRALinear, adapters_disabled
    from qshard.build import build_model

    model_dir = tiny_models("llama")
    cfg = Config()
    cfg.model.path, cfg.train.train_type, cfg.train.precision = str(model_dir), train_type, "fp32"
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    with torch.no_grad():
        for layer in layers:  # trained-looking adapters (B starts at zero, which would hide them)
            layer.lora_B.normal_(0, 0.5)
            if train_type == "qdora":
                layer.magnitude.mul_(1.5)
    model.eval()
    ids = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(input_ids=ids, use_cache=False).logits
        with adapters_disabled(model):
            reference = model(input_ids=ids, use_cache=False).logits
        again = model(input_ids=ids, use_cache=False).logits
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        missing, unexpected = hf.load_state_dict(dict(export.base_weights(model, torch.float32)), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        base = hf(input_ids=ids).logits
    torch.testing.assert_close(reference, base, atol=1e-4, rtol=1e-4)
    assert (adapted - reference).abs().max() > 0.1  # the adapters matter, and were switched off
    assert torch.equal(again, adapted) and all(layer.adapter_enabled for layer in layers)

    # The per-token log-probs the objectives use: chunked over the head as the full logits give them, gradients too.
    from qshard.train.loss import ChunkedLoss, FullLogitsLoss, loss_positions

    labels = ids.clone()
    labels[:, :5] = -100
    batch = {"input_ids": ids, "labels": labels, "loss_positions": loss_positions(labels)}
    results = []
    for head in (FullLogitsLoss(), ChunkedLoss(model, chunk_tokens=7)):
        model.zero_grad()
        logps = head.token_logps(model, batch)
        (logps * torch.linspace(0.5, 2, len(logps))).sum().backward()
        results.append((logps.detach(), [layer.lora_A.grad.clone() for layer in layers]))
    (full, full_grads), (chunked, chunked_grads) = results
    assert full.shape == (2 * 11,) and (full < 0).all()  # tokens 6..16 of each row are next tokens trained
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# --------------------------------------------------------------------------------------------------- data


def _write_jsonl(path, records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _encode(path, fmt="preference", **options):
    from qshard.data.tokenize import encode_source, make_options
    from qshard.demo_tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    gen = encode_source(path, tokenizer, make_options(options.pop("max_length", 64), fmt, **options))
    rows = []
    while True:
        try:
            ids, labels = next(gen)
        except StopIteration as stop:
            return tokenizer, [(r[0].tolist(), r[1].tolist()) for r in rows], stop.value
        rows.append((ids, labels))


def test_pair_layouts_encode_alike_with_the_prompt_untrained(tmp_path):
    """Strings, message lists, and UltraFeedback's whole conversations give the same two rows per record."""
    from qshard.data import IGNORE_INDEX
    from qshard.data.templates import Encoder

    user, good, bad = "Reverse the letters.", "c b a", "a b c"
    turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
    records = [
        {"prompt": user, "chosen": good, "rejected": bad},
        {"prompt": turn("user", user), "chosen": turn("assistant", good), "rejected": turn("assistant", bad)},
        {"prompt": user, "chosen": turn("user", user) + turn("assistant", good),
         "rejected": turn("user", user) + turn("assistant", bad)},
    ]
    tokenizer, rows, stats = _encode(_write_jsonl(tmp_path / "p.jsonl", records))
    assert len(rows) == 6 and stats.examples == 3 and rows[0:2] == rows[2:4] == rows[4:6]
    prompt = Encoder(tokenizer).generation_prompt(turn("user", user), "here")
    (chosen, chosen_labels), (rejected, _) = rows[0], rows[1]
    assert chosen[: len(prompt)] == prompt == rejected[: len(prompt)]
    assert chosen_labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert chosen_labels[len(prompt):] == chosen[len(prompt):] and chosen[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(chosen[len(prompt):], skip_special_tokens=True) == good


def test_prompt_and_completions_truncated_kto_rows(tmp_path):
    long_prompt = " ".join("abcdefghij" * 3)
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": long_prompt, "chosen": "x y z " * 10, "rejected": "q"}])
    tokenizer, rows, stats = _encode(path, max_length=24, max_prompt_length=8)
    (chosen, labels), (rejected, _) = rows
    assert chosen[0] == tokenizer.bos_token_id and labels[:8] == [-100] * 8 and labels[8] != -100
    assert len(chosen) == 24 and rejected[:8] == chosen[:8] and stats.truncated == 1
    assert _encode(path, max_length=24, max_prompt_length=8, overlong="drop")[2].dropped_overlong == 1
    kto = [{"prompt": "hi", "completion": "yes", "label": True}, {"prompt": "hi", "completion": "no", "label": False}]
    _, rows, _ = _encode(_write_jsonl(tmp_path / "k.jsonl", kto), "kto")
    assert [len(r[0]) > 0 for r in rows] == [True, False, False, True]


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are identical"),
    ({"chosen": "a", "rejected": "b"}, "no prompt: field 'prompt' is missing or empty"),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "field 'chosen' does not end with an assistant turn"),
    ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
])
def test_bad_pairs_name_file_and_line_or_are_skipped(tmp_path, record, message):
    from qshard.data.records import BadRecord

    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(BadRecord, match=f"{path}:2: ") as e:
        _encode(path)
    assert message in str(e.value)
    _, rows, stats = _encode(path, on_bad_record="skip")
    assert len(rows) == 2 and stats.bad == 1


# ----------------------------------------------------------------------------------------------- training


def _marker_pairs(path, n, seed):
    """Pairs of one answer with two endings, of one length: the chosen one ends with the marker "!!", the rejected
    one with another pair of signs (which one varies, so the base prefers neither ending more often)."""
    import random

    rng = random.Random(seed)
    records = []
    for _ in range(n):
        letters = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 5)))
        answer = " ".join(reversed(letters.split()))
        other = rng.choice(["??", "..", ",,", ";;", "--", "::", "**", "##"])
        records.append({"prompt": f"Reverse the letters.\n\n{letters}", "chosen": answer + " !!",
                        "rejected": f"{answer} {other}"})
    return _write_jsonl(path, records)


def _pref_config(model_dir, tmp_path, out="run", objective="dpo", steps=8) -> Config:
    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.data.path = str(_marker_pairs(tmp_path / "train.jsonl", 64, 0))
    cfg.data.eval_path = str(_marker_pairs(tmp_path / "eval.jsonl", 16, 1))
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.max_length = 32
    cfg.train.objective, cfg.train.precision, cfg.train.max_steps = objective, "fp32", steps
    cfg.train.micro_batch_size, cfg.train.grad_accum = 4, 2
    cfg.optim.lr, cfg.optim.warmup_steps = 2e-2, 0
    cfg.train.sample_every = 0  # samples: test_samples.py
    cfg.output.dir = str(tmp_path / out)
    return cfg.validate()


def _policy_accuracy(result, cfg) -> tuple[float, float]:
    """The share of held-out pairs whose chosen answer the base, then the trained model, finds more likely."""
    from qshard.adapters import adapters_disabled
    from qshard.data import load_datasets
    from qshard.demo_tokenizer import build_demo_tokenizer

    _, held_out = load_datasets(cfg, build_demo_tokenizer())
    trainer = result.trainer
    batch = trainer._to_device(trainer.objective.collate(list(held_out), trainer.pad_id))
    model = result.model.eval()
    with torch.no_grad():
        with adapters_disabled(model):
            base, _ = trainer.objective.sequence_logps(model, batch)
        trained, _ = trainer.objective.sequence_logps(model, batch)
    n = len(held_out)
    return tuple(float((x[:n] > x[n:]).float().mean()) for x in (base, trained))


def test_dpo_learns_the_preference_with_its_metrics(tiny_models, tmp_path, dist_env, monkeypatch):
    import json

    from qshard.train import run as run_mod

    kept = {}
    build = run_mod._build
    monkeypatch.setattr(run_mod, "_build", lambda *a, **k: kept.setdefault("run", build(*a, **k)))
    cfg = _pref_config(tiny_models("llama"), tmp_path)
    lines = LogLines()
    logger = logging.getLogger("qshard")
    monkeypatch.setattr(logger, "level", logging.INFO)
    logger.addHandler(lines)
    try:
        result = run_mod.train(cfg, dist_env)
    finally:
        logger.removeHandler(lines)
    result.trainer = kept["run"].trainer
    step_lines = [line for line in lines.lines if line.startswith("step 8/8")]
    assert step_lines and all(f in step_lines[0] for f in (" | margin ", " | acc ", "held-out loss", "held-out acc"))
    records = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    keys = {"rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
            "logps_rejected"}
    assert all(keys | {"pairs", "loss"} <= r.keys() for r in records)
    assert {f"eval_{k}" for k in keys} <= records[-1].keys() and "eval_ppl" not in records[-1]
    assert records[0]["pairs"] == 8 and records[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = ref
    before, after = _policy_accuracy(result, cfg)
    assert 0.2 <= before <= 0.8 and after > 0.9, (before, after)
    assert records[-1]["eval_rewards_accuracy"] > 0.9 and records[-1]["eval_rewards_margin"] > 0
    assert result.summary["eval_rewards_accuracy_end"] == records[-1]["eval_rewards_accuracy"]
    assert result.summary["eval_ppl_end"] is None  # a preference loss has no perplexity


def test_world_size_2_and_a_resumed_run_match_one_uninterrupted_run(tiny_models, tmp_path):
    """DPO over the same global batch: 1 rank x 2 micro-batches, 2 ranks x 1 (real processes, gloo), and the
    first run resumed from its step-2 checkpoint give the same losses and metrics, step by step. So does KTO on
    1 and 2 ranks: its reference point is the whole global batch's, on every rank."""
    import json
    import shutil

    from conftest import run_on_ranks

    from qshard.checkpoint import step_dir
    from qshard.cli import main

    cfg = _pref_config(tiny_models("llama"), tmp_path, steps=4)

    def args(out, *extra):
        return ["train", "--model", cfg.model.path, "--data", cfg.data.path, "--eval-data", cfg.data.eval_path,
                "--data.cache_dir", cfg.data.cache_dir, "--output-dir", str(tmp_path / out), "--train.objective",
                "dpo", "--max-steps", "4", "--batch-size", "4", "--train.precision", "fp32", "--data.max_length",
                "32", "--lr", "2e-2", "--optim.warmup_steps", "0", "--train.eval_every", "2",
                "--train.sample_every", "0", *extra]

    def records(out):
        return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    assert main(args("one", "--grad-accum", "2", "--save-every", "2", "--checkpoint.keep_last", "3")) == 0
    shutil.copytree(tmp_path / "one", tmp_path / "resumed")
    shutil.rmtree(step_dir(tmp_path / "resumed" / "checkpoints", 4))
    (tmp_path / "resumed" / "summary.json").unlink()
    assert main(args("resumed", "--grad-accum", "2", "--resume", "auto")) == 0
    kto = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
           for p in map(json.loads, Path(cfg.data.path).read_text().splitlines()) for key in ("chosen", "rejected")]
    kto_data = str(_write_jsonl(tmp_path / "kto.jsonl", kto))

    def kto_args(out, grad_accum):
        return ["train", "--model", cfg.model.path, "--data", kto_data, "--data.cache_dir", cfg.data.cache_dir,
                "--output-dir", str(tmp_path / out), "--train.objective", "kto", "--max-steps", "3", "--batch-size",
                "4", "--grad-accum", grad_accum, "--train.precision", "fp32", "--data.max_length", "32", "--lr",
                "2e-2", "--optim.warmup_steps", "0"]

    assert main(kto_args("kto-one", "2")) == 0
    runs = run_on_ranks({"two": args("two", "--grad-accum", "1"), "kto-two": kto_args("kto-two", "1")})
    ranks = runs["two"]
    assert all(run.code == 0 for run in ranks + runs["kto-two"]), ranks[0].stderr + runs["kto-two"][0].stderr
    kto_fields = ["loss", "kl", "rewards_chosen", "rewards_rejected", "logps_chosen"]
    kto_one, kto_two = records("kto-one"), records("kto-two")
    assert len(kto_one) == 3 and kto_one[-1]["kl"] > 0  # a reference point above 0 once the policy moved
    for a, b in zip(kto_one, kto_two, strict=True):
        torch.testing.assert_close([b[f] for f in kto_fields], [a[f] for f in kto_fields], rtol=1e-5, atol=1e-5)
    one, resumed, two = records("one"), records("resumed"), records("two")
    fields = ["loss", "rewards_chosen", "rewards_rejected", "rewards_accuracy", "logps_chosen", "logps_rejected",
              "eval_loss", "eval_rewards_margin", "eval_rewards_accuracy"]
    assert [r["step"] for r in one] == [r["step"] for r in resumed] == [r["step"] for r in two] == [1, 2, 3, 4]
    assert [[r.get(f) for f in fields] for r in resumed] == [[r.get(f) for f in fields] for r in one]  # bit for bit
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close([b.get(f) for f in fields], [a.get(f) for f in fields], rtol=1e-5, atol=1e-5)
    assert one[-1]["rewards_margin"] > one[0]["rewards_margin"]  # it trained
    # Exported and usable as an SFT run's: the PEFT adapter, and qshard generate on the run.
    assert (tmp_path / "one" / "adapter" / "adapter_model.safetensors").is_file()
    assert main(["generate", "--run", str(tmp_path / "one"), "--prompt", "Reverse the letters.", "--max-new-tokens",
                 "3"]) == 0


@pytest.mark.parametrize("objective, first_loss, own", [
    ("ipo", (0 - 1 / (2 * 0.1)) ** 2, ()),  # policy = reference: h = 0
    ("kto", 0.5, ("kl",)),  # 1 - sigmoid(0) for every example
    ("orpo", None, ("nll_loss", "log_odds_ratio")),
    ("simpo", None, ()),
])
def test_each_objective_trains_through_the_loop(objective, first_loss, own, tiny_models, tmp_path, dist_env):
    import json

    from qshard.train.run import train

    cfg = _pref_config(tiny_models("llama"), tmp_path, objective=objective, steps=2)
    if objective == "kto":  # each pair as two unpaired examples, one desirable and one not
        for name in ("path", "eval_path"):
            pairs = [json.loads(x) for x in Path(getattr(cfg.data, name)).read_text().splitlines()]
            kto = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
                   for p in pairs for key in ("chosen", "rejected")]
            setattr(cfg.data, name, str(_write_jsonl(tmp_path / f"kto-{name}.jsonl", kto)))
    result = train(cfg, dist_env)
    records = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    unit = "examples" if objective == "kto" else "pairs"
    assert [r[unit] for r in records] == [8, 8] and all(math.isfinite(r["loss"]) for r in records)
    assert {"rewards_chosen", "rewards_margin", *own, *(f"eval_{k}" for k in own)} <= records[-1].keys()
    if first_loss is not None:
        assert records[0]["loss"] == pytest.approx(first_loss, rel=1e-5)


# ------------------------------------------------------------------------------- precomputed reference, init adapter


def test_precomputed_reference_and_continuing_an_adapter(tiny_models, tmp_path, dist_env):
    """pref.precompute_reference trains as the per-step reference does, from log-probs kept in the data cache; a
    run continuing that run's adapter (train.init_adapter) starts from it, with it as the reference."""
    import json

    from qshard.train.run import train

    def records(result):
        return [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]

    model_dir = tiny_models("llama")
    each_step = records(train(_pref_config(model_dir, tmp_path, "each", steps=4), dist_env))
    cfg = _pref_config(model_dir, tmp_path, "pre", steps=4)
    cfg.pref.precompute_reference = True
    first = train(cfg, dist_env)
    kept = sorted(Path(cfg.data.cache_dir).glob("*/reference-*.npy"))
    assert len(kept) == 2  # the training and the held-out file's stores
    stamps = [p.stat().st_mtime_ns for p in kept]
    for a, b in zip(records(first), each_step, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["pairs"] == b["pairs"]
        assert a["rewards_margin"] == pytest.approx(b["rewards_margin"], rel=1e-3, abs=1e-5)

    cfg = _pref_config(model_dir, tmp_path, "continued", steps=2)
    cfg.pref.precompute_reference, cfg.train.init_adapter = True, str(first.out)
    continued = records(train(cfg.validate(), dist_env))
    assert continued[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy starts as its reference
    assert continued[0]["logps_chosen"] != pytest.approx(each_step[0]["logps_chosen"], rel=1e-3)  # the adapter's
    assert len(sorted(Path(cfg.data.cache_dir).glob("*/reference-*.npy"))) == 4  # another reference, beside
    assert [p.stat().st_mtime_ns for p in kept] == stamps  # the first one's, read back unchanged

    cfg.lora.rank, cfg.output.dir = 4, str(tmp_path / "other-rank")
    with pytest.raises(QShardError, match=r"train.init_adapter: .*adapter was trained with lora.rank 8, this run has"):
        train(cfg.validate(), dist_env)
