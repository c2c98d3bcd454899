"""pref.share_prompt: a pair as one row [prompt, chosen, rejected] whose rejected tokens never see the chosen ones.
The row, what its attention passes let each token see, written out by hand; the per-sequence log-probs and the DPO
gradient equal two rows' on tiny models through the two causal passes, with no mask; an attention that does not take
the rows stops the run; a tiny DPO run trains as with two rows; where the model cannot run such rows, one line says
so."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import LogLines

from qshard.attention import SHARED_ROWS
from qshard.config import Config
from qshard.data import model_inputs
from qshard.data.example import Example
from qshard.data.preference import Pair, collate_pairs, collate_shared_pairs

X = -100


def _pair(prompt, chosen, rejected):
    return Pair(Example(prompt + chosen, [X] * len(prompt) + chosen),
                Example(prompt + rejected, [X] * len(prompt) + rejected))


def _visible(rows, row: int) -> list[list[bool]]:
    """[L, L]: which keys (dim 1) a query (dim 0) of a shared batch's row attends to through its two causal passes
    (attention.py); a padding query attends to none (its output is zeros)."""
    first, second, source = (t.tolist() for t in rows)
    width, seen = len(source[row]), []
    for where in source[row]:
        if where < len(first):  # the first pass, prompt + chosen: a prefix of the row
            keys = first[: where + 1]
        elif where < len(first) + len(second[row]):
            keys = second[row][: where - len(first) + 1]
        else:
            keys = []
        seen.append([key in keys for key in range(width)])
    return seen


def test_shared_row_what_it_sees_positions_and_targets():
    pairs = [_pair([1, 2, 3], [4, 5], [6, 7, 8]), _pair([9, 10], [11], [12])]
    batch = collate_shared_pairs(pairs, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0, 0, 0]]
    # The rejected tokens' positions restart where the prompt ends; padding is at 0 (no position beyond the row's).
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 2, 0, 0, 0, 0]]
    T, F = True, False
    first = [[T, F, F, F, F, F, F, F],  # prompt: causal
             [T, T, F, F, F, F, F, F],
             [T, T, T, F, F, F, F, F],
             [T, T, T, T, F, F, F, F],  # chosen: the prompt and itself
             [T, T, T, T, T, F, F, F],
             [T, T, T, F, F, T, F, F],  # rejected: the prompt and itself, never the chosen
             [T, T, T, F, F, T, T, F],
             [T, T, T, F, F, T, T, T]]
    second = [[T, F, F, F, F, F, F, F],
              [T, T, F, F, F, F, F, F],
              [T, T, T, F, F, F, F, F],
              [T, T, F, T, F, F, F, F],
              [F, F, F, F, F, F, F, F],  # padding: nothing (zeros)
              [F, F, F, F, F, F, F, F],
              [F, F, F, F, F, F, F, F],
              [F, F, F, F, F, F, F, F]]
    assert "attention_mask" not in batch and [_visible(batch[SHARED_ROWS], r) for r in (0, 1)] == [first, second]
    # The model's mask is a placeholder of one element, 4D so that transformers builds none of its own.
    placeholder = model_inputs(batch)["attention_mask"]
    assert placeholder.shape == (2, 1, 8, 8) and placeholder.untyped_storage().nbytes() == 1
    # Each trained token and the position predicting it: the first rejected one from the prompt's last position.
    assert batch["loss_targets"].tolist() == [4, 5, 6, 7, 8, 11, 12]
    assert batch["loss_positions"].tolist() == [2, 3, 2, 5, 6, 8 + 1, 8 + 1]
    assert batch["loss_sequences"].tolist() == [0, 0, 2, 2, 2, 1, 3]  # every chosen, then every rejected
    assert batch["sequence_tokens"].tolist() == [2, 1, 3, 1]
    assert batch["chosen_sequences"].tolist() == [0, 1] and batch["rejected_sequences"].tolist() == [2, 3]
    assert int(batch["num_tokens"]) == 8 + 4
    # The attention's two causal passes: prompt + chosen (a prefix of the longest), and prompt + rejected (padded
    # with 0); where each position's output is among theirs (5 + 6 outputs, then the padding's zeros).
    first, second, source = (t.tolist() for t in batch[SHARED_ROWS])
    assert first == [0, 1, 2, 3, 4] and second == [[0, 1, 2, 5, 6, 7], [0, 1, 3, 0, 0, 0]]
    assert source == [[0, 1, 2, 3, 4, 8, 9, 10], [0, 1, 2, 7, 11, 11, 11, 11]]
    with_reference = [p._replace(ref_chosen=-1.0, ref_rejected=-2.0) for p in pairs]
    assert collate_shared_pairs(with_reference, 0)["ref_logps"].tolist() == [-1, -1, -2, -2]


def _record_sdpa(monkeypatch) -> list[tuple[bool, bool]]:
    """(no mask, causal) of every SDPA call from now on."""
    import torch.nn.functional as F

    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    return calls


def _assert_grads_close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Each gradient as the other's to fp32 round-off, relative to its largest element (gradients of 10 and more
    differ by 1e-4 between two orders of the same sums)."""
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)


def _random_pairs(seed=0):
    """Three pairs of different prompt and completion lengths (so every row is padded somewhere)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()  # noqa: E731
    return [_pair(ids(p), ids(c), ids(r)) for p, c, r in ((5, 4, 7), (2, 9, 3), (8, 1, 2))]


def test_shared_rows_give_two_rows_log_probs_and_gradients(tiny_models, dist_env, monkeypatch):
    """Per-sequence summed and mean log-probs (policy, and reference with the adapters off) and the DPO loss's
    gradients of the LoRA weights: one shared row a pair equals two rows a pair, through the chunked head and the
    full logits, through the two causal passes (attention.py: every SDPA call causal, without a mask). A model
    whose attention does not take the rows in every layer stops at its first shared forward, with one line."""
    from transformers import AttentionInterface

    from qshard.adapters import LoRALinear, adapters_disabled
    from qshard.attention import shared_prompt_attention, use_shared_prompt_attention
    from qshard.build import build_model
    from qshard.errors import QShardError
    from qshard.train.loss import ChunkedLoss, FullLogitsLoss, loss_positions
    from qshard.train.preference import PreferenceLoss

    model_dir = tiny_models("llama")
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.objective = str(model_dir), "fp32", "dpo"
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:  # trained-looking adapters, so that policy and reference differ
            layer.lora_B.normal_(0, 0.5, generator=g)
    model.eval()
    pairs = _random_pairs()
    two_rows = collate_pairs(pairs, pad_id=0)
    two_rows["loss_positions"] = loss_positions(two_rows["labels"])  # as the trainer adds it
    shared = collate_shared_pairs(pairs, pad_id=0)
    calls = _record_sdpa(monkeypatch)
    use_shared_prompt_attention()
    for head in (ChunkedLoss(model, chunk_tokens=5), FullLogitsLoss()):
        results = []
        for batch, is_shared in ((two_rows, False), (shared, True)):
            calls.clear()
            loss_fn = PreferenceLoss(cfg, head, is_shared)
            assert loss_fn.collate is (collate_shared_pairs if is_shared else collate_pairs)
            model.zero_grad()
            with torch.no_grad(), adapters_disabled(model):
                reference = loss_fn.sequence_logps(model, batch)
            policy = loss_fn.sequence_logps(model, batch)
            loss, _ = loss_fn(model, batch)
            loss.backward()
            results.append((policy, reference, loss.detach(), [layer.lora_A.grad.clone() for layer in layers]))
            # 5 forwards of 2 layers (reference, policy, the loss's reference and policy, the checkpoint's recompute):
            # 2 causal passes each, for the 3 rows together.
            kernels = [(True, True)] * 10 * 2 if is_shared else None
            assert kernels is None or calls == kernels, calls
        (policy, reference, loss, grads), *shared_results = results
        assert policy[0].shape == (6,) and (reference[0] - policy[0]).abs().max() > 0.1  # the adapters matter
        assert any(g.abs().max() > 0 for g in grads)
        for s_policy, s_reference, s_loss, s_grads in shared_results:
            for ours, theirs in zip((*s_policy, *s_reference), (*policy, *reference), strict=True):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s_loss, loss, atol=1e-6, rtol=1e-5)
            _assert_grads_close(s_grads, grads)
    # An attention that does not pass the rows on in its second layer (it would attend through the placeholder).
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    AttentionInterface.register("sdpa", lambda module, *args, **kwargs: shared_prompt_attention(
        module, *args, **{k: v for k, v in kwargs.items() if module.layer_idx == 0 or k != SHARED_ROWS}))
    loss_fn = PreferenceLoss(cfg, FullLogitsLoss(), True)
    with pytest.raises(QShardError, match=r"^pref.share_prompt: LlamaForCausalLM's attention took the shared rows in "
                                          r"1 of its 2 layers .*; set pref.share_prompt: false"):
        loss_fn(model, shared)


@pytest.mark.parametrize("model_type", ["phi3", "gemma", "qwen3_moe"])
def test_other_families_run_the_two_causal_passes_alike(model_type, tiny_models, dist_env, monkeypatch):
    """A fused projection (Phi-3), Gemma's scaled embedding and plain head, mixture-of-experts blocks (Qwen3-MoE):
    their attention is handed the rows, and the DPO loss and its gradients are two rows'."""
    from qshard.adapters import LoRALinear
    from qshard.attention import use_shared_prompt_attention
    from qshard.build import build_model
    from qshard.models import shares_prompt
    from qshard.train.loss import ChunkedLoss, loss_positions
    from qshard.train.preference import PreferenceLoss

    model_dir = tiny_models(model_type)
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.objective = str(model_dir), "fp32", "dpo"
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    assert shares_prompt(cfg, model.config, model.config._attn_implementation)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            layer.lora_B.normal_(0, 0.5, generator=g)
    model.eval()
    pairs = _random_pairs(seed=1)
    two_rows = collate_pairs(pairs, pad_id=0)
    two_rows["loss_positions"] = loss_positions(two_rows["labels"])
    calls = _record_sdpa(monkeypatch)
    use_shared_prompt_attention()
    head, results = ChunkedLoss(model, chunk_tokens=5), []
    for batch, shared in ((two_rows, False), (collate_shared_pairs(pairs, pad_id=0), True)):
        model.zero_grad()
        calls.clear()
        loss, _ = PreferenceLoss(cfg, head, shared)(model, batch)
        loss.backward()
        results.append((loss.detach(), [layer.lora_A.grad.clone() for layer in layers]))
    assert calls and set(calls) == {(True, True)}
    (loss, grads), (s_loss, s_grads) = results
    torch.testing.assert_close(s_loss, loss, atol=1e-6, rtol=1e-5)
    _assert_grads_close(s_grads, grads)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_run_with_shared_prompts_trains_as_with_two_rows(tiny_models, tmp_path, monkeypatch):
    """The same run, pref.share_prompt true and false: the same losses and metrics step by step and held out, from
    fewer input tokens (each prompt once), every attention of the shared run through SDPA's causal kernel without
    a mask; the reference computed each step and precomputed alike."""
    from test_preference import _marker_pairs

    from qshard.cli import main

    data, held_out = _marker_pairs(tmp_path / "train.jsonl", 32, 0), _marker_pairs(tmp_path / "eval.jsonl", 8, 1)

    def run(out, share, *extra):
        args = ["train", "--model", str(tiny_models("llama")), "--data", str(data), "--eval-data", str(held_out),
                "--data.cache_dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / out), "--train.objective",
                "dpo", "--max-steps", "3", "--batch-size", "4", "--grad-accum", "2", "--train.precision", "fp32",
                "--data.max_length", "32", "--lr", "2e-2", "--optim.warmup_steps", "0", "--train.sample_every", "0",
                "--pref.share_prompt", share, *extra]
        assert main(args) == 0
        return _records(tmp_path / out)

    two = run("two", "false")
    with monkeypatch.context() as patch:
        calls = _record_sdpa(patch)
        shared = run("shared", "true")
    assert calls and set(calls) == {(True, True)}
    fields = ["loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
              "logps_rejected", "grad_norm", "eval_loss", "eval_rewards_margin", "eval_logps_rejected"]
    assert [r["step"] for r in shared] == [1, 2, 3] and "eval_loss" in shared[-1]
    for a, b in zip(two, shared, strict=True):
        torch.testing.assert_close([b.get(f) for f in fields], [a.get(f) for f in fields], rtol=1e-4, atol=1e-5)
        assert b["pairs"] == a["pairs"] == 8 and b["tokens"] < a["tokens"]  # each prompt computed once
    assert shared[-1]["rewards_margin"] > shared[0]["rewards_margin"]  # it trained
    precomputed = run("precomputed", "true", "--pref.precompute_reference", "true")
    fields.remove("rewards_accuracy")  # rewards of 0 at the first step, and a precomputed reference's round-off
    for a, b in zip(two, precomputed, strict=True):
        torch.testing.assert_close([b.get(f) for f in fields], [a.get(f) for f in fields], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("setting, message", [
    ({"train.objective": "kto", "train.micro_batch_size": 2, "pref.share_prompt": True},
     "pref.share_prompt: applies to train.objective dpo or ipo or orpo or simpo, not kto"),
    ({"pref.share_prompt": False},
     "pref.share_prompt: applies to train.objective dpo or ipo or orpo or simpo, not sft"),
])
def test_share_prompt_outside_the_pair_objectives_is_one_line_exit_2(setting, message, capsys):
    from qshard.cli import main

    flags = [x for key, value in setting.items() for x in (f"--{key}", str(value).lower())]
    assert main(["train", "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qshard: error: ") and message in err, err


def test_models_that_cannot_take_the_mask_run_two_rows_and_say_so(monkeypatch):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3NextConfig

    from qshard.models import shares_prompt

    cfg = Config()
    cfg.train.objective = "simpo"
    lines = LogLines()
    logger = logging.getLogger("qshard")
    monkeypatch.setattr(logger, "level", logging.INFO)
    logger.addHandler(lines)
    try:
        assert shares_prompt(cfg, LlamaConfig(), "sdpa", say=True) and not lines.lines
        assert not shares_prompt(cfg, LlamaConfig(), "eager", say=True)
        assert not shares_prompt(cfg, MistralConfig(sliding_window=4096), "sdpa", say=True)
        assert shares_prompt(cfg, MistralConfig(sliding_window=None), "sdpa")
        assert not shares_prompt(cfg, Gemma2Config(), "sdpa", say=True)
        assert not shares_prompt(cfg, Qwen3NextConfig(num_hidden_layers=4), "sdpa", say=True)  # linear attention
        cfg.pref.share_prompt = False
        assert not shares_prompt(cfg, LlamaConfig(), "sdpa", say=True)
        cfg.pref.share_prompt, cfg.train.objective = None, "kto"
        assert not shares_prompt(cfg, LlamaConfig(), "sdpa", say=True)
    finally:
        logger.removeHandler(lines)
    assert len(lines.lines) == 4, lines.lines
    assert "LlamaConfig's eager attention cannot keep a pair's rejected tokens from its chosen" in lines.lines[0]
    assert all(line.startswith("pref.share_prompt: off") and "each pair runs as two rows" in line
               for line in lines.lines)
    assert "sliding-window" in lines.lines[1] and "Gemma2Config" in lines.lines[2]
    assert "Qwen3NextConfig's layers other than full attention (linear_attention)" in lines.lines[3], lines.lines[3]


def test_compiled_blocks_keep_their_graphs_whatever_the_pairs_of_a_batch(tiny_models, dist_env):
    """The rows as index tensors of the batch: batches of 1 to 5 pairs and of several lengths (eval's and
    precompute's last chunks hold fewer) compile the blocks at most a graph for the first shape, a dynamic one,
    and one of a single pair (torch specializes a size of 1), and never recompile past that."""
    from torch._dynamo.utils import counters

    from qshard.attention import use_shared_prompt_attention
    from qshard.build import build_model

    model_dir = tiny_models("llama")
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.objective = str(model_dir), "fp32", "dpo"
    cfg.parallel.compile, cfg.parallel.compile_backend = True, "aot_eager"
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    use_shared_prompt_attention()
    g = torch.Generator().manual_seed(2)
    ids = lambda: torch.randint(3, 400, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist()  # noqa: E731
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.no_grad():
            for pairs in (3, 2, 4, 1, 5, 2):
                batch = collate_shared_pairs([_pair(ids(), ids(), ids()) for _ in range(pairs)], pad_id=0)
                model(**model_inputs(batch), use_cache=False)
        graphs = dict(counters["stats"])["unique_graphs"]
        assert graphs <= 3, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
