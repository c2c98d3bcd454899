"""`qshard generate`: a tiny chatml run trained until it knows three answers, then asked for them from its
checkpoint (`--run`), in a conversation (`--chat`), and as a base with the exported PEFT adapter (`--model
--adapter`); and the bad inputs, each one line and exit 2. All through `qshard.cli.main` in this process."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from qshard import cli
from qshard.generate_cmd import Chatbot

ANSWERS = {"Name a color.": "Blue sky.", "Name a fruit.": "Green apple.", "Name a pet.": "Small cat."}


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """A one-layer base trained with chatml on three question-answer pairs, alone and as the second turn after
    another (fp32, so the answers are exact)."""
    root = tmp_path_factory.mktemp("generate")
    base = root / "base"
    shutil.copytree(tiny_models("llama", num_hidden_layers=1), base)
    data = root / "chat.jsonl"
    turns = {q: [{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in ANSWERS.items()}
    records = [{"messages": t} for t in turns.values()] * 4
    records += [{"messages": turns[first] + turns[second]} for first in turns for second in turns if first != second]
    data.write_text("".join(json.dumps(r) + "\n" for r in records * 3))
    out = root / "run"
    args = ["train", "--model", base, "--data", data, "--output-dir", out, "--data.chat_template", "chatml",
            "--max-length", "256", "--batch-size", "8", "--max-steps", "60", "--lr", "3e-3",
            "--optim.warmup_steps", "5", "--lora-rank", "16", "--lora.alpha", "32", "--train.precision", "fp32",
            "--checkpoint.async_save", "false", "--data.eval_fraction", "0"]
    assert cli.main([str(a) for a in args]) == 0
    return {"base": base, "out": out}


def generate(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_prompt_chat_and_adapter(run, capsys, monkeypatch):
    """One answer on standard output (logs on standard error); the same answers in a conversation that carries
    its history; the same completion from the base with the exported adapter; sampling repeats with its seed."""
    code, out, err = generate(capsys, "--run", run["out"], "--prompt", "Name a color.", "--max-new-tokens", "40")
    assert code == 0, err
    assert out == "Blue sky.\n"  # the turn's end marker (text in this vocabulary) is not part of the answer
    assert "generating with" in err and "Blue sky." not in err

    seen = []
    reply = Chatbot.reply
    monkeypatch.setattr(Chatbot, "reply", lambda self, messages, s: seen.append(list(messages)) or reply(self, messages,
                                                                                                           s))
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a pet.\n\nName a fruit.\n/exit\nName a color.\n"))
    code, out, err = generate(capsys, "--run", run["out"], "--chat", "--max-new-tokens", "40")
    assert code == 0, err
    assert out == "Small cat.\nGreen apple.\n"  # nothing after /exit
    assert [len(m) for m in seen] == [1, 3]  # the second turn is asked with the first question and answer
    assert seen[1][:2] == [{"role": "user", "content": "Name a pet."}, {"role": "assistant", "content": "Small cat."}]
    monkeypatch.setattr(Chatbot, "reply", reply)

    code, from_adapter, err = generate(capsys, "--model", run["base"], "--adapter", run["out"] / "adapter",
                                       "--prompt", "Name a color.", "--max-new-tokens", "40",
                                       "--train.precision", "fp32")
    assert code == 0, err
    assert from_adapter == "Blue sky.\n"
    _, from_run, _ = generate(capsys, "--run", run["out"], "--prompt", "Name a color.", "--max-new-tokens", "40")
    assert from_adapter == from_run

    sampled = [generate(capsys, "--run", run["out"], "--prompt", "Name a pet.", "--temperature", "1.5", "--top-p",
                        "0.95", "--seed", "7", "--max-new-tokens", "12")[1] for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()


def test_an_adapter_with_new_tokens_is_built_with_their_rows(run, capsys, tmp_path):
    """A run that added chatml's markers as tokens, with the embedding and head trained in full: its adapter on
    the base answers as the run does, and stops at the new <|im_end|> token."""
    out = tmp_path / "run"
    data = run["base"].parent / "chat.jsonl"
    args = ["train", "--model", run["base"], "--data", data, "--output-dir", out, "--data.chat_template", "chatml",
            "--data.add_special_tokens", '["<|im_start|>", "<|im_end|>"]', "--lora.modules_to_save",
            "[embed_tokens, lm_head]", "--max-length", "256", "--batch-size", "8", "--max-steps", "40", "--lr", "3e-3",
            "--optim.warmup_steps", "5", "--lora-rank", "16", "--lora.alpha", "32", "--train.precision", "fp32",
            "--checkpoint.async_save", "false", "--data.eval_fraction", "0"]
    assert cli.main([str(a) for a in args]) == 0
    code, from_run, err = generate(capsys, "--run", out, "--prompt", "Name a fruit.", "--max-new-tokens", "40")
    assert code == 0 and from_run == "Green apple.\n", err
    code, from_adapter, err = generate(capsys, "--model", run["base"], "--adapter", out / "adapter", "--prompt",
                                       "Name a fruit.", "--max-new-tokens", "40", "--train.precision", "fp32")
    assert code == 0 and from_adapter == from_run, err


def one_error(capsys, *args) -> str:
    code, out, err = generate(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and lines[-1].startswith("qshard: error: "), err
    assert not any("Traceback" in line for line in lines)
    return lines[-1]


def test_bad_inputs_are_one_line(run, capsys, tmp_path):
    assert "is not a directory" in one_error(capsys, "--run", tmp_path / "nope", "--prompt", "x")
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint" in one_error(capsys, "--run", tmp_path / "empty", "--prompt", "x")
    assert "--prompt" in one_error(capsys, "--run", run["out"])
    assert "--top-p" in one_error(capsys, "--run", run["out"], "--prompt", "x", "--top-p", "0")
    assert "--adapter" in one_error(capsys, "--model", run["base"], "--prompt", "x")

    adapter = tmp_path / "adapter"
    shutil.copytree(run["out"] / "adapter", adapter)
    config = adapter / "adapter_config.json"
    good = config.read_text()
    config.write_text("{not json")
    assert "adapter_config.json" in one_error(capsys, "--model", run["base"], "--adapter", adapter, "--prompt", "x")
    config.write_text(json.dumps({**json.loads(good), "peft_type": "PREFIX_TUNING"}))
    assert "PREFIX_TUNING" in one_error(capsys, "--model", run["base"], "--adapter", adapter, "--prompt", "x")
    config.write_text(good)
    plain = tmp_path / "plain-base"  # a base without a chat template, the adapter without a tokenizer of its own
    shutil.copytree(run["base"], plain)
    (plain / "chat_template.jinja").unlink()
    bare = tmp_path / "bare-adapter"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapter / name, bare / name)
    assert "no chat template" in one_error(capsys, "--model", plain, "--adapter", bare, "--chat")
    # An adapter of a wider model: its A factors have more columns than this base's linears.
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: (t.repeat(1, 2) if ".lora_A." in k else t) for k, t in tensors.items()}, weights)
    line = one_error(capsys, "--model", run["base"], "--adapter", adapter, "--prompt", "x")
    assert "lora_A" in line and "shape" in line


def test_a_peft_dora_adapter_generates_as_peft_does(run, capsys, tmp_path):
    """An adapter saved by peft itself (DoRA on two projections, lm_head trained in full, none of it at its
    initial value), on a full-precision base (train_type dora) so that the completion must equal peft's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"],
                                                 modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.3)
    peft_model.save_pretrained(tmp_path / "dora")
    tokenizer = AutoTokenizer.from_pretrained(run["base"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        new = peft_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        with peft_model.disable_adapter():
            plain = peft_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected and not torch.equal(new, plain)  # the adapter changes the completion
    code, out, err = generate(capsys, "--model", run["base"], "--adapter", tmp_path / "dora", "--prompt",
                              "Say something.", "--max-new-tokens", "8", "--train.train_type", "dora",
                              "--train.precision", "fp32")
    assert code == 0, err
    assert out == expected.rstrip() + "\n"
