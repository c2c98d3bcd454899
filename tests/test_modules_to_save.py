"""New tokens and the modules trained in full (`data.add_special_tokens`, `lora.modules_to_save`): the embedding
and head grow before sharding with new rows at the mean, train in full over one and two ranks, resume exactly,
and export as a PEFT adapter (and a merged model) that peft and transformers load with qshard's logits."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from importlib import resources

import pytest
import torch
from conftest import run_on_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qshard import checkpoint, config, export
from qshard.build import build_model
from qshard.checkpoint import complete_checkpoints
from qshard.cli import main as cli_main
from qshard.loading import Checkpoint
from qshard.parallel.distributed import init_distributed, shutdown

DEMO = resources.files("qshard") / "demo_data"
NEW_TOKENS = ["<|im_start|>", "<|im_end|>"]
STEPS = 6
VOCAB = 403  # the demo tokenizer's length, and the tiny models' vocab_size
ROWS = VOCAB + len(NEW_TOKENS)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
PEFT = "base_model.model."


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    path.write_text("".join((DEMO / "eval.jsonl").read_text().splitlines(keepends=True)[:4]))
    return path


def _train_args(model_dir, out, eval_data, *extra):
    """A chatml run, whose turns the new tokens now mark, training the embedding and head beside the adapters."""
    return ["train", "--model", str(model_dir), "--data", str(DEMO / "train.jsonl"), "--eval-data", str(eval_data),
            "--output-dir", str(out), "--max-length", "40", "--batch-size", "2", "--lr", "1e-2", "--max-steps",
            str(STEPS), "--train.precision", "fp32", "--data.chat_template", "chatml",
            "--data.add_special_tokens", ",".join(NEW_TOKENS), "--lora.modules_to_save", "embed_tokens,lm_head",
            "--save-every", "3", "--checkpoint.keep_last", "5", *extra]


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_models, eval_data):
    """One qlora run on two ranks (the chunked loss, 16 tokens a chunk, through the sharded head; the weights
    broadcast from rank 0), the same on one rank (full logits; the weights streamed from the files), and the
    one-rank run resumed from its step-3 checkpoint."""
    root, model = tmp_path_factory.mktemp("runs"), tiny_models("llama", num_hidden_layers=1)
    two = run_on_ranks({"two": _train_args(model, root / "two", eval_data, "--batch-size", "1", "--nproc", "2",
                                           "--train.loss_chunk_tokens", "16", "--model.load_mode", "broadcast")})["two"]
    assert [rank.code for rank in two] == [0, 0], two[0].stderr
    assert cli_main(_train_args(model, root / "one", eval_data, "--train.loss_chunk_tokens", "0")) == 0
    assert cli_main(_train_args(model, root / "resumed", eval_data, "--train.loss_chunk_tokens", "0",
                                "--resume", str(root / "one" / "checkpoints" / "step-00000003"))) == 0
    return root, model


@contextmanager
def _one_rank():
    env = init_distributed()
    try:
        yield env
    finally:
        shutdown()


def _rebuilt(run_dir, env, trained=True):
    """The run's model as qshard builds it again, with its last checkpoint's weights, or as training began."""
    ckpt = complete_checkpoints(run_dir / "checkpoints")[-1]
    state = checkpoint.read_state(ckpt)
    cfg = config.resolve(str(ckpt / "config.yaml"), [])
    model, _ = build_model(cfg, env, cfg.model.path, state["vocab_size"])
    if trained:
        checkpoint.load(ckpt, model, optimizer=None)
    return model


def _probe():
    """Token ids with the new ones among them."""
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 2], ids[:, 7] = VOCAB, VOCAB + 1
    return ids


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def test_world_sizes_agree_and_resume_is_exact(runs):
    """Two ranks (the chunked loss through the trained, sharded head) train as one rank does (full logits); the
    resumed run continues bit for bit; the embedding and head are in every checkpoint, with their optimizer state."""
    root, _ = runs
    one, two, resumed = _losses(root / "one"), _losses(root / "two"), _losses(root / "resumed")
    assert len(one) == STEPS
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-5)
    assert resumed == one[3:]
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(root / "one" / "checkpoints" / "step-00000003")).read_metadata().state_dict_metadata
    for name in (EMBED, HEAD):
        assert f"model.{name}" in keys and any(k.startswith(f"optim.state.{name}.exp_avg") for k in keys), name
    # The two ranks' adapter (gathered at the end of training) holds the grown embedding and head.
    saved = load_file(root / "two" / "adapter" / "adapter_model.safetensors")
    assert saved[PEFT + EMBED].shape == saved[PEFT + HEAD].shape == (ROWS, 128)


def test_new_rows_start_at_the_mean_and_peft_gives_qshards_logits(runs, capsys):
    root, model_dir = runs
    run = root / "one"
    assert cli_main(["export", "merged", "--run", str(run), "--out", str(root / "merged")]) == 0
    base_file = Checkpoint(model_dir)
    with _one_rank() as env:
        start = _rebuilt(run, env, trained=False)
        for name in (EMBED, HEAD):  # the new rows at the mean of the stored ones, in the stored dtype
            stored = base_file.read(name)
            grown = _full(dict(start.named_parameters())[name])
            assert grown.dtype == torch.float32 and grown.shape == (ROWS, 128)
            torch.testing.assert_close(grown[:VOCAB], stored.float(), rtol=0, atol=0)
            mean = stored.float().mean(dim=0).to(stored.dtype).float()
            torch.testing.assert_close(grown[VOCAB:], mean.expand(len(NEW_TOKENS), -1), rtol=0, atol=0)
        trained = _rebuilt(run, env)
        params = dict(trained.named_parameters())
        assert all(not torch.equal(_full(params[n])[VOCAB:], _full(dict(start.named_parameters())[n])[VOCAB:])
                   for n in (EMBED, HEAD))  # the new rows learned
        base_state = {name: tensor.float() for name, tensor in export.base_weights(trained, torch.float32)}
        trained.eval()
        with torch.no_grad():
            ours = trained(input_ids=_probe(), use_cache=False).logits

    # peft, over the base qshard trained on (NF4 dequantized) resized to the run's rows.
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"] and config["ensure_weight_tying"] is False
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.resize_token_embeddings(ROWS)
    base.load_state_dict(base_state)
    theirs = _peft_logits(base, run / "adapter")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    assert merged.config.vocab_size == ROWS
    with torch.no_grad():
        got = merged(input_ids=_probe()).logits
    assert (got - ours).abs().max() <= 0.02 * ours.abs().max()  # bf16 weights


def _peft_logits(base, adapter):
    """peft's logits on the probe, once it has loaded `adapter` with no key missing or left over."""
    import peft

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, adapter).eval()
        again = model.load_adapter(adapter, adapter_name="again")  # the same load, whose result says what matched
    assert not [w for w in caught if "missing" in str(w.message)], [str(w.message) for w in caught]
    assert not again.missing_keys and not again.unexpected_keys, again
    with torch.no_grad():
        return model(input_ids=_probe()).logits


def test_tied_embedding_trains_as_one_and_exports_tied(tiny_models, eval_data, tmp_path):
    """Naming the head of a tied pair trains their one weight: the adapter holds it under both names and asks peft
    to keep them tied (ensure_weight_tying), and peft and the merged model give qshard's logits."""
    model_dir = tiny_models("llama", num_hidden_layers=1, tie_word_embeddings=True)
    run = tmp_path / "run"
    args = _train_args(model_dir, run, eval_data, "--train.train_type", "lora", "--max-steps", "3",
                       "--lora.modules_to_save", "lm_head")
    assert cli_main(args) == 0
    assert cli_main(["export", "merged", "--run", str(run)]) == 0
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    assert saved[PEFT + EMBED].shape == (ROWS, 128) and torch.equal(saved[PEFT + EMBED], saved[PEFT + HEAD])
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"] and config["ensure_weight_tying"] is True
    with _one_rank() as env:
        model = _rebuilt(run, env).eval()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        with torch.no_grad():
            ours = model(input_ids=_probe(), use_cache=False).logits

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.resize_token_embeddings(ROWS)
    torch.testing.assert_close(_peft_logits(base, run / "adapter"), ours, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32)
    assert merged.config.vocab_size == ROWS and merged.config.tie_word_embeddings
    with torch.no_grad():
        got = merged(input_ids=_probe()).logits
    assert (got - ours).abs().max() <= 0.02 * ours.abs().max()  # bf16 weights


@pytest.mark.parametrize("extra, says", [
    (["--lora.modules_to_save", "q_proj"], "lora.modules_to_save: 'q_proj' is an adapted layer of the blocks"),
    (["--lora.target_modules", "v_proj", "--lora.modules_to_save", "q_proj"], "'q_proj' is a quantized layer"),
    (["--lora.modules_to_save", "embed"], "lora.modules_to_save: no module 'embed' in LlamaForCausalLM (modules it "
                                          "can train in full: embed_tokens, norm, lm_head)"),
    (["--lora.modules_to_save", "layers"], "'layers' (model.layers) holds the transformer blocks"),
    (["--lora.modules_to_save", "input_layernorm"], "lies inside a transformer block"),
    (["--data.add_special_tokens", "<x>"], "but embed_tokens and lm_head would stay frozen; set "
                                           "lora.modules_to_save: [embed_tokens, lm_head]"),
    (["--train.train_type", "full", "--lora.modules_to_save", "lm_head"], "a full run trains every weight"),
    (["--train.train_type", "llama_pro", "--data.add_special_tokens", "<x>"], "a llama_pro run trains only its new"),
])
def test_bad_modules_and_untrained_new_tokens_are_one_line(tiny_models, eval_data, tmp_path, capsys, extra, says):
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_models("llama", num_hidden_layers=1)), "--data", str(eval_data),
            "--eval-data", str(eval_data), "--output-dir", str(out), "--max-steps", "1", *extra]
    capsys.readouterr()
    assert cli_main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "qshard: error:" in line]
    assert len(errors) == 1 and says in errors[0], errors
    assert not out.exists() or not any(out.iterdir())  # nothing written that looks like a run


def test_random_weights_grow_the_same_way(tiny_models, eval_data):
    """model.init random: the generated embedding and head get the new rows at the mean of the others too."""
    cfg = config.resolve(None, [("model.path", str(tiny_models("llama", num_hidden_layers=1))),
                                ("model.init", "random"), ("data.add_special_tokens", ",".join(NEW_TOKENS)),
                                ("lora.modules_to_save", "embed_tokens,lm_head"), ("train.precision", "fp32")])
    with _one_rank() as env:
        model, _ = build_model(cfg, env, cfg.model.path, ROWS)
        params = dict(model.named_parameters())
        for name in (EMBED, HEAD):
            grown = _full(params[name])
            assert grown.shape == (ROWS, 128) and grown[:VOCAB].std() > 0.01
            mean = grown[:VOCAB].mean(dim=0)  # stored by the random source in the compute dtype: fp32 here
            torch.testing.assert_close(grown[VOCAB:], mean.expand(len(NEW_TOKENS), -1))
