"""examples/: every recipe resolves and passes `qshard train --dry-run` as it is, with only its model and data
replaced by a tiny model of the same architecture and a tiny local file in the same record format; the dry run
checks everything a run checks before training, prints the plan and writes nothing. The SLURM script parses and
runs the same way. Also `qshard --version` and the versions a run's config.yaml records."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import qshard
from qshard import cli
from qshard import config as config_mod

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128)
# Each example's architecture: the transformers model type its tiny stand-in is built as (and its class).
# A new example must be listed here.
ARCHITECTURES = {
    "qlora-8b.yaml": "llama",
    "qlora-8b-fast.yaml": "llama",
    "llama3.1-8b-chat.yaml": "llama",
    "qwen2.5-7b-packing.yaml": "qwen2",
    "mistral-7b-qdora.yaml": "mistral",
    "mixtral-8x7b-2x24gb.yaml": "mixtral",
    "llama3.1-70b-2x24gb.yaml": "llama",
    "llama3.1-70b-1x24gb.yaml": "llama",
    "llama3.1-70b-8gpu.yaml": "llama",
    "continued-pretraining.yaml": "llama",
    "llama3.1-8b-dpo.yaml": "llama",
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
           "mixtral": "MixtralForCausalLM"}
SBATCH = EXAMPLES / "slurm" / "llama3.1-70b-2nodes.sbatch"


# ----------------------------------------------------------------------------------------------- inputs


def _record(fmt: str, i: int, words: int) -> dict:
    text = " ".join(f"sort {i} {w} letters" for w in range(words))
    if fmt == "chat":
        return {"messages": [{"role": "user", "content": f"add {i} and 3"}, {"role": "assistant", "content": text}]}
    if fmt == "sharegpt":
        return {"conversations": [{"from": "human", "value": f"add {i} and 3"}, {"from": "gpt", "value": text}]}
    if fmt == "text":
        return {"text": text}
    if fmt == "preference":
        return {"prompt": f"add {i} and 3", "chosen": text, "rejected": f"{text} no"}
    return {"instruction": f"add {i} and 3", "input": "", "output": text}


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """`data_files(format, long)`: 160 records of `format`; long ones (~1,000 tokens) fill packed sequences."""
    root = tmp_path_factory.mktemp("example-data")

    def get(fmt: str, long: bool) -> Path:
        path = root / f"{fmt}-{'long' if long else 'short'}.jsonl"
        if not path.exists():
            words = 120 if long else 3
            path.write_text("".join(json.dumps(_record(fmt, i, words)) + "\n" for i in range(160)))
        return path

    return get


def _tiny(tiny_models, model_type: str, lora_rank: int = 8, resident_blocks: int = 0) -> Path:
    """The tiny model of `model_type`; with as many key/value heads as query heads where the rank needs the
    k/v projections as wide as the hidden size (128): a rank cannot exceed a layer's smaller side. Its
    positions reach as far as the examples' sequences (the model it stands for has that many); it has more blocks
    than the example keeps resident, so that some are streamed."""
    overrides = {**(MOE if model_type == "mixtral" else {}), "max_position_embeddings": 8192}
    if resident_blocks >= 2:
        overrides = {**overrides, "num_hidden_layers": resident_blocks + 2}
    if lora_rank > 64:
        overrides = {**overrides, "num_key_value_heads": 4}
    return tiny_models(model_type, **overrides)


def _data_args(example: dict, data_files) -> list[str]:
    """The example's data replaced by local files of the same formats: data.path, and each source (a Hub
    dataset's split, subset and revision dropped with it)."""
    data = example.get("data") or {}
    long = bool(data.get("packing"))
    default = data.get("format", "auto")
    if example["train"].get("objective", "sft") != "sft":  # preference records: pairs (no example uses KTO's)
        default = "preference"
    args = []
    if data.get("path"):
        fmt = default if default != "auto" else "instruction"
        args += ["--data.path", str(data_files(fmt, long))]
    if data.get("sources"):
        sources = []
        for source in data["sources"]:
            fmt = source.get("format", default)
            local = {k: v for k, v in source.items() if k not in ("hub", "split", "subset", "revision")}
            sources.append({**local, "path": str(data_files(fmt if fmt != "auto" else "instruction", long))})
        args += ["--data.sources", json.dumps(sources)]
    return args


def _dry_run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _plan(out: str) -> dict[str, str]:
    """The plan's `name   text` lines as {name: text}."""
    assert out.startswith("qshard train --dry-run: every input checked"), out
    return {m[1]: m[2] for m in re.finditer(r"^  (\w+(?: \w+)?)\s{2,}(.*)$", out, re.MULTILINE)}


# ----------------------------------------------------------------------------------------------- examples


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_example_dry_run(name, tiny_models, data_files, tmp_path, monkeypatch, capsys):
    """The example as it is, its model and data replaced: exit 0, the plan's key lines, nothing written (the
    relative output dir, resolved in an empty working directory, is not created; the cache is elsewhere)."""
    example = yaml.safe_load((EXAMPLES / name).read_text())
    model_type = ARCHITECTURES[name]
    resident = (example.get("parallel") or {}).get("resident_blocks", 0)
    model_dir = _tiny(tiny_models, model_type, example["lora"]["rank"], resident)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = ["train", "--config", str(EXAMPLES / name), "--model.path", str(model_dir),
            *_data_args(example, data_files), "--data.cache_dir", str(tmp_path / "cache"), "--dry-run"]
    code, out, err = _dry_run(argv, capsys)
    assert code == 0, err
    plan = _plan(out)
    train, parallel = example["train"], example.get("parallel") or {}
    world = parallel.get("nproc", 1)
    layers = resident + 2 if resident >= 2 else 2
    assert plan["model"].startswith(f"{model_dir} ({CLASSES[model_type]}, {layers} layers, ")
    assert plan["train type"].startswith(train["train_type"])
    assert f"r={example['lora']['rank']} " in plan["train type"]
    assert re.fullmatch(r"[\d,]+ parameters \(\d+\.\d\d% of the model's\)", plan["trainable"])
    assert plan["parallel"].startswith(f"{world} rank(s), sharding full")
    for flag in ("compile", "cpu_offload", "ac_save_projections"):
        assert (flag in plan["parallel"].split(", ")) == bool(parallel.get(flag)), (flag, plan["parallel"])
    global_batch = train.get("micro_batch_size", 1) * train.get("grad_accum", 1) * world
    assert f"x {world} rank(s) = {global_batch} " in plan["batch"]
    assert re.match(r"[\d,]+ training (examples|sequences|pairs)", plan["data"])
    assert ("packing on" in plan["data"]) == bool(example["data"].get("packing"))
    assert re.match(r"[\d,]+ optimizer steps \(", plan["steps"])
    assert plan["output"] == example["output"]["dir"]
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "work"]


def test_dry_run_leaves_an_existing_output_dir_as_it_was(tiny_models, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = [(p.name, p.stat().st_mtime_ns) for p in out.iterdir()], out.stat().st_mtime_ns
    argv = ["train", "--config", str(EXAMPLES / "qlora-8b.yaml"), "--model", str(tiny_models("llama")),
            "--data", str(data_files("instruction", False)), "--output-dir", str(out),
            "--data.cache_dir", str(tmp_path / "cache"), "--nproc", "2", "--dry-run", "--lora.use_rslora", "true",
            "--lora.plus_lr_ratio", "16", "--lora.init", "olora", "--lora.modules_to_save", "[lm_head]"]
    code, stdout, err = _dry_run(argv, capsys)
    assert code == 0, err
    plan = _plan(stdout)
    assert plan["parallel"].startswith("2 rank(s)")  # planned for, not launched
    assert plan["train type"].endswith("rsLoRA, LoRA+ x16, init olora; trained in full: lm_head")
    assert ([(p.name, p.stat().st_mtime_ns) for p in out.iterdir()], out.stat().st_mtime_ns) == before


def test_dry_run_reports_a_bad_data_file_as_a_run_does(tiny_models, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_record("instruction", 0, 3)) + "\n{not json\n")
    out = tmp_path / "run"
    argv = ["train", "--config", str(EXAMPLES / "qlora-8b.yaml"), "--model", str(tiny_models("llama")),
            "--data", str(bad), "--output-dir", str(out), "--data.cache_dir", str(tmp_path / "cache"), "--dry-run"]
    code, stdout, err = _dry_run(argv, capsys)
    errors = [line for line in err.splitlines() if line.startswith("qshard: error:")]
    assert code == 2 and stdout == "" and "Traceback" not in err
    assert len(errors) == 1 and f"{bad}:2" in errors[0], err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------- SLURM


def _sbatch_qshard_args() -> list[str]:
    """The arguments of the script's `srun ... qshard ...` command, continuation lines joined."""
    script = SBATCH.read_text().replace("\\\n", " ")
    command = next(line for line in script.splitlines() if line.startswith("srun "))
    words = shlex.split(command)
    return words[words.index("qshard") + 1:]


def test_sbatch_script_parses_and_its_command_dry_runs(tiny_models, data_files, tmp_path, monkeypatch, capsys):
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for directive in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=USR1@"):
        assert f"#SBATCH {directive}" in text
    assert "export MASTER_ADDR MASTER_PORT" in text
    args = _sbatch_qshard_args()
    assert args[0] == "train" and "--resume" in args
    config = args[args.index("--config") + 1]
    args[args.index("--config") + 1] = str(ROOT / config)  # relative to the repository root, where it is submitted
    assert (ROOT / config).is_file()
    monkeypatch.chdir(tmp_path)
    code, out, err = _dry_run([*args, "--model.path", str(tiny_models("llama")),
                               "--data", str(data_files("instruction", False)),
                               "--data.cache_dir", str(tmp_path / "cache"), "--dry-run"], capsys)
    assert code == 0, err
    assert _plan(out)["output"] == args[args.index("--output-dir") + 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


# ----------------------------------------------------------------------------------------------- versions


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"qshard {qshard.__version__} (python ")
    assert f"torch {torch.__version__}" in line and f"transformers {transformers.__version__}" in line
    assert "bitsandbytes " in line


def test_saved_config_records_versions_and_still_resolves(tiny_models, data_files, tmp_path, capsys):
    """config.yaml (as a run and each checkpoint save it) records the versions under a key of its own; read back
    by --config it is the same configuration, so a run started from it, and resume's comparison of configs,
    see what was saved."""
    cfg = config_mod.resolve(str(EXAMPLES / "qlora-8b.yaml"), [("model.path", str(tiny_models("llama"))),
                                                              ("data.path", str(data_files("instruction", False)))])
    saved = tmp_path / "config.yaml"
    config_mod.save(cfg, saved)
    versions = yaml.safe_load(saved.read_text())["versions"]
    assert versions["qshard"] == qshard.__version__ and versions["torch"] == torch.__version__
    assert versions["transformers"] == transformers.__version__
    assert {"bitsandbytes", "peft", "python"} <= versions.keys()
    resolved = config_mod.resolve(str(saved), [])
    assert resolved == cfg and resolved.to_dict() == cfg.to_dict()
    code, out, err = _dry_run(["train", "--config", str(saved), "--output-dir", str(tmp_path / "run"),
                               "--data.cache_dir", str(tmp_path / "cache"), "--dry-run"], capsys)
    assert code == 0, err
    assert not (tmp_path / "run").exists()


def test_dry_run_on_two_ranks_with_broadcast_loading(tiny_models, data_files, tmp_path):
    """Under a launcher (torchrun, srun) every rank dry-runs: with broadcast loading only rank 0 reads the weight
    files, and nothing is written."""
    from conftest import run_on_ranks

    out = tmp_path / "run"
    argv = ["train", "--config", str(EXAMPLES / "qlora-8b.yaml"), "--model", str(tiny_models("llama")),
            "--data", str(data_files("instruction", False)), "--output-dir", str(out),
            "--data.cache_dir", str(tmp_path / "cache"), "--model.load_mode", "broadcast", "--dry-run"]
    ranks = run_on_ranks({"dry": argv})["dry"]
    assert [r.code for r in ranks] == [0, 0], [r.stderr for r in ranks]
    assert not out.exists()
