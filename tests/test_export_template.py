"""Exports carry the chat template training used and the tokens that end a trained answer, so that
transformers' `generate` after `apply_chat_template` stops where training taught the model to stop. One tiny
chatml run from a base without a chat template, made once in this process through `qshard.cli.main`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qshard import cli
from qshard.config import Config
from qshard.data.templates import CHATML, Encoder, end_of_turn_ids
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.export_tokenizer import export_tokenizer

ANSWERS = {"Name a color.": "Blue sky.", "Name a fruit.": "Green apple.", "Name a pet.": "Small cat."}
MAX_NEW_TOKENS = 200


def conversation(question: str, answer: str | None = None) -> list[dict[str, str]]:
    turns = [{"role": "user", "content": question}]
    return turns + ([{"role": "assistant", "content": answer}] if answer is not None else [])


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """A one-layer base whose tokenizer has no chat template, trained with chatml until it knows the answers,
    then exported merged."""
    root = tmp_path_factory.mktemp("export-template")
    base = root / "base"
    shutil.copytree(tiny_models("llama", num_hidden_layers=1), base)
    (base / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(base).chat_template is None
    data = root / "chat.jsonl"
    records = [{"messages": conversation(q, a)} for q, a in ANSWERS.items()]
    data.write_text("".join(json.dumps(r) + "\n" for r in records * 16))
    out = root / "run"
    args = ["train", "--model", base, "--data", data, "--eval-data", data, "--output-dir", out,
            "--data.chat_template", "chatml", "--max-length", "128", "--batch-size", "8", "--max-steps", "40",
            "--lr", "3e-3", "--optim.warmup_steps", "5", "--lora-rank", "16", "--lora.alpha", "32",
            "--train.precision", "fp32", "--checkpoint.async_save", "false"]
    assert cli.main([str(a) for a in args]) == 0
    assert cli.main(["export", "merged", "--run", str(out)]) == 0
    return {"base": base, "out": out, "data": data}


def test_merged_export_stops_at_the_end_of_turn_and_round_trips_the_template(run):
    merged = run["out"] / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    trained = AutoTokenizer.from_pretrained(run["base"])  # what training rendered with: the base's + chatml
    ends = json.loads((merged / "generation_config.json").read_text())["eos_token_id"]
    assert ends == [tokenizer.eos_token_id]  # the demo vocabulary has no <|im_end|> token: the appended eos
    assert tokenizer.chat_template == CHATML
    for question, answer in ANSWERS.items():
        for messages, prompt in ((conversation(question, answer), False), (conversation(question), True)):
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                trained.apply_chat_template(messages, chat_template=CHATML, tokenize=False,
                                            add_generation_prompt=prompt)
        ids = tokenizer.apply_chat_template(conversation(question), add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        # What training saw: the encoder's tokens of the same prompt (its bos included).
        expected = Encoder(trained, "chatml").encode({"messages": conversation(question, answer)}, "chat", "x")[0]
        assert ids[0].tolist() == expected[: ids.shape[1]]
        new = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        assert len(new) < MAX_NEW_TOKENS and new[-1] in ends, tokenizer.decode(new)
        assert tokenizer.decode(new, skip_special_tokens=True) == answer + "<|im_end|>\n"


@pytest.fixture(scope="module")
def run_with_new_tokens(run, tmp_path_factory):
    """The same base and data, with chatml's markers added as tokens and the embedding and head trained."""
    out = tmp_path_factory.mktemp("new-tokens") / "run"
    args = ["train", "--model", run["base"], "--data", run["data"], "--output-dir", out, "--data.chat_template",
            "chatml", "--data.add_special_tokens", '["<|im_start|>", "<|im_end|>"]', "--lora.modules_to_save",
            "[embed_tokens, lm_head]", "--max-length", "128", "--batch-size", "8", "--max-steps", "40", "--lr",
            "3e-3", "--optim.warmup_steps", "5", "--lora-rank", "16", "--lora.alpha", "32", "--train.precision",
            "fp32", "--checkpoint.async_save", "false", "--data.eval_fraction", "0"]
    assert cli.main([str(a) for a in args]) == 0
    assert cli.main(["export", "merged", "--run", str(out)]) == 0
    return out


def test_added_end_of_turn_token_is_exported_and_generation_stops_at_it(run_with_new_tokens):
    """New tokens, trained embeddings and head, and the template together: what a user training a chat format
    into a base model runs. The merged model's vocabulary is the tokenizer's, and `generate` stops at <|im_end|>."""
    merged = run_with_new_tokens / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.vocab_size == len(tokenizer) == model.get_input_embeddings().weight.shape[0]
    ends = json.loads((merged / "generation_config.json").read_text())["eos_token_id"]
    assert ends == [im_end, tokenizer.eos_token_id]
    for question, answer in ANSWERS.items():
        ids = tokenizer.apply_chat_template(conversation(question), add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        new = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        assert new[-1] == im_end and tokenizer.decode(new[:-1]) == answer, tokenizer.decode(new)


def test_the_adapter_carries_the_template_and_the_end_tokens(run):
    adapter = run["out"] / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    assert tokenizer.chat_template == CHATML
    generation = json.loads((adapter / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id]
    marker = json.loads((adapter / ".qshard-export.json").read_text())
    assert {"generation_config.json", "tokenizer_config.json", "adapter_model.safetensors"} <= set(marker["files"])
    # `qshard export adapter` writes the same files as training's end did.
    again = run["out"].parent / "adapter-again"
    assert cli.main(["export", "adapter", "--run", str(run["out"]), "--out", str(again)]) == 0
    assert {p.name: p.read_bytes() for p in again.iterdir() if p.name != "adapter_model.safetensors"} == \
        {p.name: p.read_bytes() for p in adapter.iterdir() if p.name != "adapter_model.safetensors"}


def with_tokens(*tokens: str):
    tokenizer = build_demo_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


# A Llama-3-like template: each turn closed by one special token, which is also the tokenizer's eos.
EOT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n{{ m['content'] | trim }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}"
)


def test_end_of_turn_tokens_are_found_by_rendering_a_probe():
    tokenizer = with_tokens("<|start|>", "<|end|>", "<|eot|>")
    tokenizer.chat_template = EOT_TEMPLATE
    eot, eos = tokenizer.convert_tokens_to_ids("<|eot|>"), tokenizer.eos_token_id
    assert end_of_turn_ids(Encoder(tokenizer, "tokenizer"), "chat") == [eot, eos]  # eos appended by the encoder
    tokenizer.eos_token = "<|eot|>"
    assert end_of_turn_ids(Encoder(tokenizer, "tokenizer"), "chat") == [eot]  # the template's own eos
    chatml = with_tokens("<|im_start|>", "<|im_end|>")
    assert end_of_turn_ids(Encoder(chatml, "chatml"), "chat") == [chatml.convert_tokens_to_ids("<|im_end|>"), eos]
    plain = build_demo_tokenizer()  # <|im_end|> is several tokens here: only the eos ends a turn
    assert end_of_turn_ids(Encoder(plain, "chatml"), "chat") == [eos]
    assert end_of_turn_ids(Encoder(plain, "alpaca"), "chat") == [eos]
    assert end_of_turn_ids(Encoder(plain, "chatml"), "text") == [eos]


def test_exported_tokenizer_keeps_the_base_generation_config_and_a_text_run_the_tokenizer(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "temperature": 0.6}))
    tokenizer = with_tokens("<|im_start|>", "<|im_end|>")
    tokenizer.chat_template = None
    cfg = Config()
    cfg.data.path, cfg.data.chat_template = "data.jsonl", "chatml"
    exported = export_tokenizer(cfg, tokenizer, tmp_path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert exported.generation == {"eos_token_id": [im_end, tokenizer.eos_token_id, 7], "temperature": 0.6}
    assert exported.chat_template == CHATML
    out = tmp_path / "export"
    out.mkdir()
    exported.write(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == CHATML and tokenizer.chat_template is None
    assert json.loads((out / "generation_config.json").read_text()) == exported.generation
    cfg.data.format = "text"  # no conversation rendered: no template to carry, the eos ends the text
    exported = export_tokenizer(cfg, tokenizer, tmp_path)
    assert exported.chat_template is None
    tokenizer.chat_template = EOT_TEMPLATE  # the tokenizer's own stays, whatever data.chat_template says
    assert export_tokenizer(cfg, tokenizer, tmp_path).chat_template == EOT_TEMPLATE
    assert exported.generation["eos_token_id"] == [tokenizer.eos_token_id, 7]
