"""The configuration tree: defaults, YAML, command-line overrides, coercion, validation and saving.

Pure and in-process: nothing here imports torch or reads a model."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Literal, Union

import pytest
import yaml

from qshard import cli
from qshard import config as config_mod
from qshard.config import DEMO_PRESET, Config, from_dict, load_yaml, resolve
from qshard.errors import QShardError

# Paths that turn the demo preset off, so the plain defaults show.
PATHS = ["--model.path", "m", "--data.path", "d.jsonl"]


def parse(*argv: str) -> Config:
    """What `qshard train ARGV` resolves to (the real parser and override order)."""
    args, extra = cli.parse_args(["train", *argv])
    return cli.parse_train_config(args, extra)


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def leaves(cls: type = Config, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, type) of every leaf option."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += leaves(tp, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, tp))
    return out


def get(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def other_value(dotted: str, tp) -> tuple[str, object]:
    """A valid value unlike the default: (command-line text, expected value)."""
    default = get(Config(), dotted)
    if typing.get_origin(tp) in (Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Literal:
        choice = next(c for c in reversed(typing.get_args(tp)) if c != default)
        return str(choice), choice
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):  # data.sources: a list of {path, weight, ...} mappings
            return "[{path: a.jsonl, weight: 2}]", [item(path="a.jsonl", weight=2.0)]
        if item is int:  # train.profile_steps: [first, last]
            return "[2,3]", [2, 3]
        if typing.get_origin(item) is Literal:  # output.trackers: names from a fixed set
            choices = list(typing.get_args(item)[-2:])
            return ",".join(choices), choices
        return "q_proj,v_proj", ["q_proj", "v_proj"]
    if tp is bool:
        return str(not default).lower(), not default
    if tp is int:
        return "3", 3
    if tp is float:
        return "0.5", 0.5  # inside every float option's valid range
    assert tp is str, (dotted, tp)
    return "some/dir", "some/dir"


ALL_KEYS = leaves()
# Options whose other values are valid only with another option set too: those companion settings.
COMPANIONS = {
    "quant.bits": {"quant.method": "hqq"},
    "parallel.replicate_degree": {"parallel.sharding": "hybrid"},
    "parallel.compile_backend": {"parallel.compile": "true"},
    "parallel.ac_save_projections": {"parallel.compile": "true"},
    "parallel.resident_blocks": {"parallel.cpu_offload": "true", "parallel.quant_sharding": "dtensor"},
    "parallel.overlap_host_optimizer": {"parallel.cpu_offload": "true"},
    "parallel.defer_grad_accumulation": {"parallel.cpu_offload": "true"},
    "train.early_stopping_patience": {"train.eval_every": "2"},
    "train.early_stopping_min_delta": {"train.eval_every": "2", "train.early_stopping_patience": "2"},
    "checkpoint.keep_best": {"train.eval_every": "2"},
    "output.adapter_from": {"train.eval_every": "2", "checkpoint.keep_best": "true"},
    **{f"pref.{name}": {"train.objective": "dpo"} for name in ("beta", "label_smoothing", "length_normalization",
                                                                "max_prompt_length", "precompute_reference",
                                                                "share_prompt")},
    "pref.orpo_lambda": {"train.objective": "orpo"},
    "train.objective": {"train.micro_batch_size": "2"},  # its other value, kto, compares examples of a micro-batch
    "pref.simpo_gamma": {"train.objective": "simpo"},
    "pref.kto_desirable_weight": {"train.objective": "kto", "train.micro_batch_size": "2"},
    "pref.kto_undesirable_weight": {"train.objective": "kto", "train.micro_batch_size": "2"},
}


# ----------------------------------------------------------------------------------------------- defaults


def test_defaults_validate():
    assert Config().validate() == Config()
    assert from_dict({}) == Config()
    assert parse(*PATHS) == from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"}})


# ----------------------------------------------------------------------------------- every key, both ways


@pytest.mark.parametrize("dotted,tp", ALL_KEYS, ids=[k for k, _ in ALL_KEYS])
def test_every_key_settable_from_command_line_and_yaml(tmp_path, dotted, tp):
    text, expected = other_value(dotted, tp)
    companions = COMPANIONS.get(dotted, {})
    paths = [*PATHS, *(arg for key, value in companions.items() for arg in (f"--{key}", value))]
    assert get(parse(*paths, f"--{dotted}", text), dotted) == expected
    assert get(parse(*paths, f"--{dotted}={text}"), dotted) == expected
    assert get(parse(*paths, f"--{dotted.replace('_', '-')}", text), dotted) == expected
    sections: dict[str, dict[str, str]] = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    for option, value in {**companions, dotted: text}.items():
        section, key = option.split(".")
        sections.setdefault(section, {})[key] = value
    yaml_text = "".join(f"{name}:\n" + "".join(f"  {k}: {v}\n" for k, v in keys.items())
                        for name, keys in sections.items())
    assert get(parse("--config", str(write(tmp_path, yaml_text))), dotted) == expected


@pytest.mark.parametrize("flag,dotted", sorted(cli.SHORTCUTS.items()))
def test_every_shortcut_sets_its_key(flag, dotted):
    tp = dict(ALL_KEYS)[dotted]
    text, expected = other_value(dotted, tp)
    assert get(parse(*PATHS, flag, text), dotted) == expected
    assert get(parse(*PATHS, f"{flag}={text}"), dotted) == expected


def test_overwrite_flag():
    assert parse(*PATHS).output.overwrite is False
    assert parse(*PATHS, "--overwrite").output.overwrite is True
    assert parse(*PATHS, "--output.overwrite", "false", "--overwrite").output.overwrite is True
    assert parse(*PATHS, "--overwrite", "--output.overwrite", "false").output.overwrite is False


# ----------------------------------------------------------------------------------------------- precedence


def test_command_line_overrides_yaml(tmp_path):
    yaml_path = write(
        tmp_path,
        "model: {path: m}\ndata: {path: d.jsonl, max_length: 64}\n"
        "lora: {rank: 4, alpha: 8}\noptim: {lr: 1.0e-3}\ntrain: {max_steps: 10}\n",
    )
    cfg = parse("--config", str(yaml_path), "--lora.rank", "32", "--max-steps", "7",
                "--data.path=other.jsonl")
    assert cfg.lora.rank == 32 and cfg.train.max_steps == 7 and cfg.data.path == "other.jsonl"
    # Untouched YAML values survive; untouched keys keep their defaults.
    assert cfg.lora.alpha == 8.0 and cfg.optim.lr == 1e-3 and cfg.data.max_length == 64
    assert cfg.optim.schedule == Config().optim.schedule
    # A command-line null clears a YAML value.
    assert parse("--config", str(yaml_path), "--train.max_steps", "null").train.max_steps is None


def test_later_flags_win():
    assert parse(*PATHS, "--lora.rank", "4", "--lora.rank=16").lora.rank == 16
    assert parse(*PATHS, "--optim.lr", "1e-3", "--optim.lr", "2e-3").optim.lr == 2e-3
    # Short flags and dotted keys are one sequence, not two.
    assert parse("--data.path", "a", "--data", "b", "--model", "m").data.path == "b"
    assert parse("--data", "b", "--data.path=a", "--model", "m").data.path == "a"
    assert parse(*PATHS, "--lora.rank", "4", "--lora-rank", "16").lora.rank == 16


# ----------------------------------------------------------------------------------------------- coercion


@pytest.mark.parametrize(
    "argv,dotted,expected",
    [
        (["--lr", "5e-3"], "optim.lr", 5e-3),  # YAML 1.1 reads this as a string
        (["--optim.eps=1e-8"], "optim.eps", 1e-8),
        (["--optim.lr", "1"], "optim.lr", 1.0),
        (["--optim.lr", "2.5E-4"], "optim.lr", 2.5e-4),
        (["--lora.alpha", "32"], "lora.alpha", 32.0),
        (["--train.seed", "-1"], "train.seed", -1),
        (["--quant.blocksize", "128"], "quant.blocksize", 128),
        (["--parallel.activation_checkpointing", "false"], "parallel.activation_checkpointing", False),
        (["--checkpoint.async_save=False"], "checkpoint.async_save", False),
        (["--output.overwrite", "true"], "output.overwrite", True),
        (["--lora.target_modules", "q_proj,v_proj"], "lora.target_modules", ["q_proj", "v_proj"]),
        (["--lora.target_modules", "q_proj, v_proj,"], "lora.target_modules", ["q_proj", "v_proj"]),
        (["--lora.target_modules=[q_proj, v_proj]"], "lora.target_modules", ["q_proj", "v_proj"]),
        (["--lora.target_modules", "q_proj"], "lora.target_modules", ["q_proj"]),
        (["--lora.target_modules", "null"], "lora.target_modules", None),
        (["--train.max_steps", "null"], "train.max_steps", None),
        (["--train.max_steps", "~"], "train.max_steps", None),
        (["--data.eval_path", "null"], "data.eval_path", None),
        (["--data.eval_path="], "data.eval_path", None),
        # String options keep their text, whatever YAML would make of it.
        (["--output-dir", "2024-06-01"], "output.dir", "2024-06-01"),
        (["--output-dir", "on"], "output.dir", "on"),
        (["--output-dir", "0123"], "output.dir", "0123"),
        (["--output-dir", "1.10"], "output.dir", "1.10"),
        (["--model.block_class", "LlamaDecoderLayer"], "model.block_class", "LlamaDecoderLayer"),
    ],
)
def test_coercion(argv, dotted, expected):
    value = get(parse(*PATHS, *argv), dotted)
    assert value == expected and type(value) is type(expected)


def test_yaml_coercion(tmp_path):
    cfg = parse("--config", str(write(tmp_path, (
        "model: {path: m}\ndata: {path: d.jsonl, eval_path: null}\n"
        "optim: {lr: 5e-3, eps: 1e-8, max_grad_norm: 2}\n"
        "lora: {target_modules: [q_proj, v_proj]}\nparallel: {activation_checkpointing: no}\n"
        "output: {dir: '2024-06-01'}\nquant:\n"  # an empty section is the defaults
    ))))
    assert cfg.optim.lr == 5e-3 and cfg.optim.eps == 1e-8 and cfg.optim.max_grad_norm == 2.0
    assert type(cfg.optim.max_grad_norm) is float
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.parallel.activation_checkpointing is False
    assert cfg.output.dir == "2024-06-01" and cfg.quant == Config().quant and cfg.data.eval_path is None


# ----------------------------------------------------------------------------------------------- errors


def error_of(*argv: str) -> str:
    with pytest.raises(QShardError) as info:
        parse(*argv)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "argv,needles",
    [
        # unknown keys, top-level and nested, from either form
        (["--train.bogus", "1"], ["command line", "unknown option 'train.bogus'", "train.max_steps"]),
        (["--bogus.key=1"], ["command line", "unknown option 'bogus'", "train"]),
        (["--lora.rank.x", "1"], ["lora.rank", "must be an integer"]),
        (["--nonsense"], ["unknown argument '--nonsense'"]),
        (["--nonsense", "1"], ["unknown argument '--nonsense'"]),
        (["stray"], ["unknown argument 'stray'"]),
        (["--lora.rank"], ["'--lora.rank' needs a value"]),
        (["--model.path", "--data.path", "x"], ["'--model.path' needs a value"]),
        (["--max-length"], ["'--data.max_length' needs a value"]),
        (["--max-len", "5"], ["unknown argument '--max-len'"]),  # no silent prefix matching
        (["--config"], ["--config", "expected one argument"]),  # argparse's own errors: one line too
        # wrong types
        (["--lora.rank", "abc"], ["command line", "lora.rank must be an integer", "'abc'"]),
        (["--lora.rank", "2.5"], ["lora.rank must be an integer"]),
        (["--lora.rank", "true"], ["lora.rank must be an integer"]),
        (["--lr", "fast"], ["optim.lr must be a finite number", "'fast'"]),
        (["--lr", "nan"], ["optim.lr must be a finite number"]),
        (["--lr", ".inf"], ["optim.lr must be a finite number"]),
        (["--optim.max_grad_norm", "inf"], ["optim.max_grad_norm must be a finite number"]),
        (["--parallel.activation_checkpointing", "maybe"], ["must be true or false"]),
        (["--parallel.activation_checkpointing", "1"], ["activation_checkpointing must be true or false"]),
        (["--lora.target_modules", "{a: 1}"], ["lora.target_modules must be a list"]),
        # choices
        (["--train-type", "qlorax"], ["train.train_type must be one of qlora, lora, full", "'qlorax'"]),
        (["--train.precision", "float32"], ["train.precision must be one of fp32, bf16, bf16_mixed, fp16_mixed"]),
        (["--quant.blocksize", "100"], ["quant.blocksize must be one of 64, 128, 256"]),
        (["--quant.blocksize", "64.0"], ["quant.blocksize must be one of 64, 128, 256"]),
        (["--optim.schedule", "step"], ["optim.schedule must be one of constant, linear, cosine"]),
        (["--data.format", "csv"], ["data.format must be one of auto, instruction, chat"]),
        # values out of range
        (["--lora.rank", "0"], ["lora.rank must be > 0, got 0"]),
        (["--lora-rank=-1"], ["lora.rank must be > 0, got -1"]),
        (["--max-length", "-5"], ["data.max_length must be > 0, got -5"]),
        (["--data.max_length=0"], ["data.max_length must be > 0, got 0"]),
        (["--lora.dropout", "1.0"], ["lora.dropout must be in [0.0, 1.0)", "1.0"]),
        (["--lora.dropout", "-0.1"], ["lora.dropout"]),
        (["--lora.alpha", "0"], ["lora.alpha must be > 0"]),
        (["--lora.target_modules", "[]"], ["lora.target_modules", "at least one"]),
        (["--data.eval_fraction", "1"], ["data.eval_fraction"]),
        (["--lr", "0"], ["optim.lr must be > 0"]),
        (["--lr", "-1e-4"], ["optim.lr must be > 0"]),
        (["--optim.beta2", "1"], ["optim.beta2"]),
        (["--optim.min_lr_ratio", "1.5"], ["optim.min_lr_ratio"]),
        (["--optim.warmup_steps", "-1"], ["optim.warmup_steps must be >= 0"]),
        (["--optim.weight_decay", "-0.1"], ["optim.weight_decay must be >= 0"]),
        (["--max-steps", "0"], ["train.max_steps must be > 0"]),
        (["--epochs", "0"], ["train.epochs must be > 0"]),
        (["--batch-size", "0"], ["train.micro_batch_size must be > 0"]),
        (["--grad-accum", "-2"], ["train.grad_accum must be > 0"]),
        (["--train.eval_every", "-1"], ["train.eval_every must be >= 0"]),
        (["--train.log_every", "0"], ["train.log_every must be > 0"]),
        (["--parallel.ac_save_projections", "true", "--parallel.compile", "false"],
         ["parallel.ac_save_projections: has no effect without "
                                                        "parallel.compile true"]),
        (["--parallel.ac_save_projections", "true", "--parallel.compile", "true", "--lora.dropout", "0.1"],
         ["parallel.ac_save_projections: has no effect without lora.dropout 0"]),
        (["--nproc", "0"], ["parallel.nproc must be > 0"]),
    ],
)
def test_bad_option_names_it(argv, needles):
    message = error_of(*PATHS, *argv)
    for needle in needles:
        assert needle in message, message


def test_yaml_key_errors_name_the_file(tmp_path):
    cases = {
        "bogus: 1\n": "unknown option 'bogus'",
        "train: {bogus: 1}\n": "unknown option 'train.bogus'",
        "lora: {rank: '8'}\n": "lora.rank must be an integer",
        "lora: 5\n": "lora must be a mapping",
        "lora: {rank: 0}\n": "lora.rank must be > 0",
        "optim: {lr: .nan}\n": "optim.lr must be a finite number",
        "model: {path: [a, b]}\n": "model.path must be a string",
        "quant: {blocksize: '64'}\n": "quant.blocksize must be one of 64, 128, 256",
    }
    for text, needle in cases.items():
        path = write(tmp_path, text)
        message = error_of("--config", str(path))
        assert needle in message, message
        if "must be >" not in needle:  # range checks name the option only
            assert message.startswith(f"{path}: "), message


def test_command_line_errors_are_not_blamed_on_the_yaml_file(tmp_path):
    path = write(tmp_path, "lora: {rank: 4}\n")
    for argv, needle in [(["--train.bogus", "1"], "unknown option 'train.bogus'"),
                         (["--lora.rank", "x"], "lora.rank must be an integer")]:
        message = error_of("--config", str(path), *argv)
        assert message.startswith("command line: ") and needle in message and str(path) not in message


@pytest.mark.parametrize(
    "text,line",
    [
        ("lora:\n  rank: 8\n  alpha: [1, 2\ntrain: {}\n", 4),  # the parser notices at the next line
        ("model: {path: m}\ndata:\n path: d\n  max_length: 8\n", 4),
        ("lora: {rank: 8}\n\toptim: {}\n", 2),
    ],
)
def test_invalid_yaml_names_file_and_line(tmp_path, text, line):
    path = write(tmp_path, text)
    message = error_of("--config", str(path))
    assert message.startswith(f"{path}:{line}: invalid YAML"), message


def test_yaml_file_problems(tmp_path):
    absent = tmp_path / "absent.yaml"
    assert error_of("--config", str(absent)) == f"config file not found: {absent}"
    assert "top level must be a mapping" in error_of("--config", str(write(tmp_path, "- a\n- b\n")))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"lora: {rank: 8}\n\xff\xfe\x00")
    assert error_of("--config", str(binary)).startswith(f"{binary}: not a YAML text file")
    assert load_yaml(write(tmp_path, "# only a comment\n")) == {}
    deep = write(tmp_path, "lora: " + "[" * 100_000 + "\n")
    assert error_of("--config", str(deep)) == f"{deep}: invalid YAML (nested too deeply to read)"
    assert "lora.rank must be an integer" in error_of("--lora.rank", "[" * 100_000)


# ----------------------------------------------------------------------------------------------- demo preset


def test_demo_preset_applies_without_model_and_data():
    cfg = parse()
    assert cfg.train.micro_batch_size == DEMO_PRESET["train"]["micro_batch_size"]
    assert cfg.train.max_steps == DEMO_PRESET["train"]["max_steps"]
    assert cfg.optim.lr == DEMO_PRESET["optim"]["lr"] and cfg.lora.rank == DEMO_PRESET["lora"]["rank"]
    assert cfg.data.max_length == DEMO_PRESET["data"]["max_length"]
    assert cfg.train.precision == "fp32"
    # A precision given is the user's choice: the preset's fp32 never replaces it.
    assert parse("--train.precision", "bf16_mixed").train.precision == "bf16_mixed"


@pytest.mark.parametrize(
    "argv", [["--model", "m"], ["--data", "d.jsonl"], ["--model.path=m", "--data=d"], ["--model.shape", "llama3-8b"]]
)
def test_demo_preset_not_applied_when_model_or_data_given(argv):
    cfg = parse(*argv)
    assert (cfg.train, cfg.optim, cfg.lora, cfg.data.max_length) == (
        Config().train, Config().optim, Config().lora, Config().data.max_length
    )


def test_demo_preset_never_overrides_user_values(tmp_path):
    before = copy.deepcopy(DEMO_PRESET)
    cfg = parse("--lr", "1e-3", "--lora.rank", "4", "--train.max_steps", "null",
                "--data.eval_path", "e.jsonl")
    assert cfg.optim.lr == 1e-3 and cfg.lora.rank == 4 and cfg.train.max_steps is None
    assert cfg.data.eval_path == "e.jsonl"  # held-out data alone keeps the demo
    assert cfg.train.micro_batch_size == DEMO_PRESET["train"]["micro_batch_size"]  # the rest still applies
    assert cfg.lora.alpha == DEMO_PRESET["lora"]["alpha"]
    yaml_path = write(tmp_path, "train: {micro_batch_size: 2}\noptim: {warmup_steps: 0}\n")
    yaml_cfg = parse("--config", str(yaml_path))
    assert yaml_cfg.train.micro_batch_size == 2 and yaml_cfg.optim.warmup_steps == 0
    assert yaml_cfg.train.max_steps == DEMO_PRESET["train"]["max_steps"]
    assert before == DEMO_PRESET  # resolving never edits the preset itself


# ----------------------------------------------------------------------------------------------- saving


@pytest.mark.parametrize(
    "argv",
    [
        [],  # the demo
        [*PATHS],
        [*PATHS, "--lr", "5e-3", "--optim.eps", "1e-8", "--lora.target_modules", "q_proj,v_proj",
         "--output-dir", "2024-06-01", "--train-type", "full", "--quant.blocksize", "256", "--max-steps", "9",
         "--parallel.activation_checkpointing", "false", "--data.eval_path", "e.jsonl",
         "--lora.dropout", "0.05",
         "--train.precision", "fp32", "--optim.schedule", "constant", "--output.overwrite", "true"],
    ],
)
def test_save_round_trips(tmp_path, argv):
    cfg = parse(*argv)
    path = tmp_path / "config.yaml"
    config_mod.save(cfg, path)
    assert resolve(str(path), []) == cfg
    assert parse("--config", str(path)) == cfg


# ----------------------------------------------------------------------------------------------- removed options

PRECISION_INSTEAD = "model.dtype: removed; use train.precision (fp32 for float32, bf16_mixed for bfloat16)"
SHARDING_INSTEAD = "parallel.reshard_after_forward: removed; use parallel.sharding (grad_op for false)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model.dtype", "float32"], PRECISION_INSTEAD),
        (["--model.dtype", "float32", "--train.precision", "fp32"], PRECISION_INSTEAD),
        (["--parallel.reshard_after_forward", "false"], SHARDING_INSTEAD),
        (["--parallel.quant_sharding", "auto"], "parallel.quant_sharding: auto is removed; use fsdp (what it meant)"),
    ],
)
def test_removed_options_on_the_command_line_say_what_replaced_them(argv, message):
    assert error_of(*PATHS, *argv) == f"command line: {message}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: {dtype: bfloat16}\ntrain: {precision: fp32}\n", PRECISION_INSTEAD),
        ("model: {dtype: float16}\n", PRECISION_INSTEAD),
        ("parallel: {reshard_after_forward: true, sharding: grad_op}\n", SHARDING_INSTEAD),
        ("parallel: {reshard_after_forward: false, sharding: hybrid}\n", SHARDING_INSTEAD),
        ("parallel: {reshard_after_forward: 0, sharding: grad_op}\n", SHARDING_INSTEAD),
    ],
)
def test_removed_options_in_a_yaml_file_that_change_the_run_are_refused(tmp_path, text, message):
    path = write(tmp_path, text)
    assert error_of(*PATHS, "--config", str(path)) == f"{path}: {message}"


def test_an_earlier_runs_config_yaml_still_resolves(tmp_path, caplog):
    """config.yaml as an earlier qshard saved it: the removed options empty and quant_sharding auto (its
    default then), set where their replacements are left at their defaults (read as those, with a warning),
    or set to what the options that replaced them say."""
    saved = Config().to_dict()
    saved["model"].update(path="m", dtype=None)
    saved["data"]["path"] = "d.jsonl"
    saved["parallel"].update(reshard_after_forward=None, quant_sharding="auto")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved, sort_keys=False))
    plain = parse(*PATHS)
    assert plain.parallel.quant_sharding == "fsdp"
    assert resolve(str(path), []) == plain
    assert parse("--config", str(path), "--parallel.quant_sharding", "dtensor").parallel.quant_sharding == "dtensor"
    equivalent = {
        "model: {dtype: float32}\ntrain: {precision: fp32}\n": ("train.precision", "fp32"),
        "model: {dtype: float32}\n": ("train.precision", "fp32"),  # read as its replacement
        "model: {dtype: bfloat16}\n": ("train.precision", "bf16_mixed"),
        "model: {dtype: bfloat16}\ntrain: {precision: bf16}\n": ("train.precision", "bf16"),
        "parallel: {reshard_after_forward: false}\n": ("parallel.sharding", "grad_op"),
        "parallel: {reshard_after_forward: false, sharding: full}\n": ("parallel.sharding", "grad_op"),
        "parallel: {reshard_after_forward: false, sharding: grad_op}\n": ("parallel.sharding", "grad_op"),
        "parallel: {reshard_after_forward: true, sharding: hybrid}\n": ("parallel.sharding", "hybrid"),
    }
    for text, (dotted, value) in equivalent.items():
        assert get(parse(*PATHS, "--config", str(write(tmp_path, text))), dotted) == value, text
    # The demo computes in what model.dtype asked for, as it did.
    assert parse("--config", str(write(tmp_path, "model: {dtype: float32}\n"))).train.precision == "fp32"
    assert parse("--config", str(write(tmp_path, "model: {dtype: bfloat16}\n"))).train.precision == "bf16_mixed"
    assert "model.dtype is removed; read float32 as train.precision: fp32 (write that instead)" in caplog.text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"activation_checkpointing": False, "ac_every": 2}, "parallel.ac_every: has no effect"),
        ({"activation_checkpointing": False, "ac_reentrant": True}, "parallel.ac_reentrant: has no effect"),
        ({"compile": True, "ac_reentrant": True}, "parallel.ac_reentrant: with parallel.compile"),
        ({"compile": False, "compile_backend": "aot_eager"}, "parallel.compile_backend: aot_eager has no effect"),
    ],
)
def test_parallel_options_that_would_be_ignored_or_harmful_are_refused(options, message):
    with pytest.raises(QShardError, match=message):
        from_dict({"parallel": options}).validate()
