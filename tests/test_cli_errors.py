"""Bad input to `qshard train`: one clear `qshard: error:` line naming the problem, a non-zero exit, no
traceback (not even one per rank), and nothing in the output directory that looks like a run.

A few cases run the real command as a subprocess (the launcher with two ranks among them); the rest call
`qshard.cli.main` in this process, which takes the same path from argv to exit code, at a fraction of
the cost of starting Python and importing torch again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from qshard import cli
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.random_model import named_config, write_random_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"
# What makes a directory look like a run (see train/run.py).
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "adapter")
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d qshard: ")  # progress lines logged before the error was found
GOOD = {"instruction": "add 2 and 3", "output": "5"}


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder with a tiny Llama checkpoint (`model/`) and eight good records (`data.jsonl`)."""
    root = tmp_path_factory.mktemp("inputs")
    tokenizer = build_demo_tokenizer()
    write_random_checkpoint(root / "model", named_config("llama-tiny", vocab_size=len(tokenizer)))
    tokenizer.save_pretrained(root / "model")
    write_jsonl(root / "data.jsonl", [json.dumps(GOOD)] * 8)
    return root


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def copy_model(inputs: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in (inputs / "model").iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def rewrite_weights(model_dir: Path, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def shard_in_two(model_dir: Path) -> tuple[list[str], list[str]]:
    """Split model.safetensors into two shards and an index; return the names in each shard."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = names[: len(names) // 2], names[len(names) // 2 :]
    weight_map = {}
    for i, half in enumerate(halves, start=1):
        fname = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in half}, model_dir / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, fname))
    write_index(model_dir, weight_map)
    return list(halves[0]), list(halves[1])


def write_index(model_dir: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


# ----------------------------------------------------------------------------------------------- running


def run_subprocess(args: list[str], cwd: Path, timeout: float = 240, first_path: Path | None = None
                   ) -> tuple[int, str]:
    launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")
    env = {k: v for k, v in os.environ.items() if k not in launched}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in (first_path, SRC) if p), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "qshard", "train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )
    return proc.returncode, proc.stderr


def run_in_process(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(["train", *args])
    return code, capsys.readouterr().err


def train_args(model, data, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--data", str(data), "--output-dir", str(out), "--max-steps", "1", *extra]


def assert_one_error(code: int, stderr: str, *needles: str) -> str:
    """Exactly one error line, naming every needle; nothing else but earlier progress lines."""
    assert code != 0, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("qshard: error: ")]
    assert len(errors) == 1, stderr
    others = [line for line in lines if not line.startswith("qshard: error: ") and not LOG_LINE.match(line)]
    assert not others, stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def assert_no_run(out: Path) -> None:
    left = [name for name in RUN_FILES if (out / name).exists()]
    assert not left, f"{out} holds {left} after a failed run"


# ------------------------------------------------------------------------- the real command, as a process


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--lora.rank", "0"], ["lora.rank must be > 0, got 0"]),
        (["--max-length", "-5"], ["data.max_length must be > 0, got -5"]),
        (["--train.bogus", "1"], ["unknown option 'train.bogus'"]),
        (["--nonsense"], ["unknown argument '--nonsense'"]),
    ],
    ids=["rank0", "negative-length", "unknown-key", "unknown-flag"],
)
def test_bad_option_subprocess(inputs, tmp_path, args, needles):
    out = tmp_path / "out"
    code, err = run_subprocess(train_args(inputs / "model", inputs / "data.jsonl", out, *args), tmp_path)
    assert code == 2
    assert_one_error(code, err, *needles)
    assert not out.exists()  # options are checked before anything is created


def test_malformed_jsonl_subprocess(inputs, tmp_path):
    lines = [json.dumps(GOOD), json.dumps(GOOD), '{"instruction": "x", "output": ']
    data = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out"
    code, err = run_subprocess(train_args(inputs / "model", data, out), tmp_path)
    assert_one_error(code, err, f"{data}:3", "invalid JSON")
    assert_no_run(out)


def test_malformed_jsonl_two_ranks_reports_once(inputs, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(GOOD), json.dumps(GOOD), "{not json"])
    out = tmp_path / "out"
    code, err = run_subprocess(train_args(inputs / "model", data, out, "--nproc", "2"), tmp_path)
    line = assert_one_error(code, err, f"{data}:3")
    assert err.count(line) == 1, err
    # assert_one_error allows no other line: no failure report from the launcher or from rank 1.
    assert_no_run(out)


def test_error_on_one_rank_only_is_reported_with_its_rank(inputs, tmp_path):
    """An error that only rank 1 meets (here injected at its start: a sitecustomize module that Python runs
    in every process, acting in rank 1 only) still reaches the user, once, naming the rank: rank 0, which
    alone used to print errors, never sees it and is stopped by the launcher."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import qshard.build\n"
        "    from qshard.errors import QShardError\n"
        "    def fail(*args, **kwargs):\n"
        "        raise QShardError('/data/shard-1: injected failure on rank 1 only')\n"
        "    qshard.build.build_model = fail\n"
    )
    out = tmp_path / "out"
    code, err = run_subprocess(train_args(inputs / "model", inputs / "data.jsonl", out, "--nproc", "2"), tmp_path,
                               first_path=inject)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("qshard: error")]
    assert errors == ["qshard: error (rank 1): /data/shard-1: injected failure on rank 1 only"], err
    assert "Traceback" not in err, err


# ----------------------------------------------------------------------------------------- model directory


def test_missing_model_dir(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_in_process(train_args(tmp_path / "no-such-model", inputs / "data.jsonl", out), capsys)
    assert_one_error(code, err, str(tmp_path / "no-such-model"))
    assert_no_run(out)


def test_missing_model_dir_says_not_found(inputs, tmp_path, capsys):
    code, err = run_in_process(train_args(tmp_path / "nope", inputs / "data.jsonl", tmp_path / "out"), capsys)
    assert_one_error(code, err, f"model directory not found: {tmp_path / 'nope'}")


def edit_config(model_dir: Path, **changes) -> Path:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


def config_only(model_dir: Path, raw: dict) -> Path:
    """Replace the checkpoint by a bare config.json (the tokenizer stays)."""
    for f in model_dir.glob("model*.safetensors"):
        f.unlink()
    (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir / "config.json"


T5 = dict(model_type="t5", vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=2)


@pytest.mark.parametrize(
    "corrupt,needles",
    [
        (lambda d: edit_config(d, model_type="frobnicator"),
         ["config.json", "unsupported model_type 'frobnicator'"]),
        (lambda d: config_only(d, T5), ["config.json", "T5Config", "'t5'", "encoder-decoder"]),
        (lambda d: config_only(d, {"model_type": "vit"}), ["ViTConfig", "'vit'", "no causal-LM class"]),
        (lambda d: (d / "config.json").unlink(), ["no config.json"]),
        # (hf_config.load_hf_config would say config.json:2, but the tokenizer, loaded first, reports it)
        (lambda d: (d / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": }'),
         ["config.json", "JSON"]),
        (lambda d: (d / "config.json").write_text('{"hidden_size": 128}'),
         ["config.json", "no 'model_type'"]),
        # transformers' message here spans six lines; the CLI still prints one
        (lambda d: [f.unlink() for f in d.glob("tokenizer*")], ["cannot load its tokenizer"]),
    ],
    ids=["unknown-model-type", "encoder-decoder", "no-causal-lm", "no-config", "bad-json", "no-model-type",
         "no-tokenizer"],
)
def test_bad_model_config(inputs, tmp_path, capsys, corrupt, needles):
    model = copy_model(inputs, tmp_path / "model")
    corrupt(model)
    out = tmp_path / "out"
    code, err = run_in_process(train_args(model, inputs / "data.jsonl", out), capsys)
    assert_one_error(code, err, *needles)
    assert_no_run(out)


def test_invalid_config_values(inputs, tmp_path, capsys):
    model = copy_model(inputs, tmp_path / "model")
    edit_config(model, num_attention_heads=3)  # 128 is no multiple of 3
    code, err = run_in_process(train_args(model, inputs / "data.jsonl", tmp_path / "out"), capsys)
    assert_one_error(code, err, "config.json", "not a multiple of the number of attention heads")


def test_more_resident_blocks_than_the_model_has(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_in_process(train_args(inputs / "model", inputs / "data.jsonl", out, "--parallel.cpu_offload",
                                          "true", "--parallel.quant_sharding", "dtensor",
                                          "--parallel.resident_blocks", "3"), capsys)
    assert code == 2
    assert_one_error(code, err, "parallel.resident_blocks: 3", "the model's 2 blocks (LlamaDecoderLayer)")
    assert_no_run(out)


def test_invalid_config_values_model_check(inputs, tmp_path):
    """The same problem as above, reported by hf_config.load_hf_config once it runs first."""
    from qshard.errors import QShardError
    from qshard.hf_config import load_hf_config

    model = copy_model(inputs, tmp_path / "model")
    edit_config(model, num_attention_heads=3)
    with pytest.raises(QShardError, match=r"config\.json: invalid llama configuration .*attention heads"):
        load_hf_config(model)
    edit_config(model, num_attention_heads=4, hidden_size="wide")
    with pytest.raises(QShardError, match=r"config\.json: invalid llama configuration .*hidden_size"):
        load_hf_config(model)


# ------------------------------------------------------------------------------------------------ checkpoint

DROPPED = "model.layers.1.mlp.up_proj.weight"


def drop_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.pop(DROPPED))


def reshape_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1].clone()}))


def add_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.update({"model.layers.0.extra.weight": t["model.norm.weight"].clone()}))


def truncate(d: Path, keep: float) -> None:
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def index_missing_shard(d: Path) -> None:
    shard_in_two(d)
    (d / "model-00002-of-00002.safetensors").unlink()


def index_lists_absent_tensor(d: Path) -> None:
    first, second = shard_in_two(d)
    write_index(d, {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                    **dict.fromkeys(second, "model-00002-of-00002.safetensors"),
                    first[0]: "model-00002-of-00002.safetensors"})  # which does not hold it


def index_omits_tensor(d: Path) -> None:
    first, second = shard_in_two(d)
    weight_map = {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(second, "model-00002-of-00002.safetensors")}
    del weight_map[DROPPED]  # still in its shard, but the index does not say so
    write_index(d, weight_map)


@pytest.mark.parametrize(
    "corrupt,needles",
    [
        (drop_tensor, ["checkpoint has no tensor", f"'{DROPPED}'"]),
        (reshape_tensor, ["model.safetensors", "'model.norm.weight'", "shape [127]", "[128]"]),
        (add_tensor, ["model.safetensors", "'model.layers.0.extra.weight'", "not part of LlamaForCausalLM"]),
        (lambda d: truncate(d, 0.5), ["model.safetensors", "cannot read safetensors file"]),
        (lambda d: truncate(d, 0.0001), ["model.safetensors", "cannot read safetensors file"]),
        (index_missing_shard,
         ["model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"]),
        (index_lists_absent_tensor, ["model-00002-of-00002.safetensors", "is absent"]),
        (index_omits_tensor, ["checkpoint has no tensor", f"'{DROPPED}'", "model.safetensors.index.json"]),
        (lambda d: (d / "model.safetensors").unlink(), ["no model.safetensors"]),
    ],
    ids=["missing-tensor", "wrong-shape", "unexpected-tensor", "truncated", "truncated-header",
         "missing-shard", "index-lists-absent", "index-omits", "no-weights"],
)
def test_bad_checkpoint(inputs, tmp_path, capsys, corrupt, needles):
    model = copy_model(inputs, tmp_path / "model")
    corrupt(model)
    out = tmp_path / "out"
    code, err = run_in_process(train_args(model, inputs / "data.jsonl", out), capsys)
    line = assert_one_error(code, err, *needles)
    assert str(model) in line  # the file or directory at fault
    assert_no_run(out)


# ------------------------------------------------------------------------------------------------------ data


@pytest.mark.parametrize(
    "lines,needles",
    [
        ([], ["has no records"]),
        (["", "   "], ["has no records"]),
        ([json.dumps(GOOD), json.dumps(GOOD), "{broken"], [":3: invalid JSON"]),
        ([json.dumps(GOOD), json.dumps(GOOD), json.dumps({"instruction": "no answer"})],
         [":3: missing field 'output'"]),
        ([json.dumps(GOOD), "[1, 2]"], [":2: a record must be a JSON object"]),
    ],
    ids=["empty", "blank", "malformed-line-3", "missing-output", "not-an-object"],
)
def test_bad_data(inputs, tmp_path, capsys, lines, needles):
    data = write_jsonl(tmp_path / "train.jsonl", lines)
    out = tmp_path / "out"
    code, err = run_in_process(train_args(inputs / "model", data, out), capsys)
    line = assert_one_error(code, err, str(data), *needles)
    assert f"{data}:" in line or "no records" in line
    assert_no_run(out)


def test_bad_eval_data_and_missing_file(inputs, tmp_path, capsys):
    bad_eval = write_jsonl(tmp_path / "eval.jsonl", [json.dumps(GOOD), "", "nope"])
    out = tmp_path / "out"
    args = train_args(inputs / "model", inputs / "data.jsonl", out, "--eval-data", str(bad_eval))
    code, err = run_in_process(args, capsys)
    assert_one_error(code, err, f"{bad_eval}:3")
    code, err = run_in_process(train_args(inputs / "model", tmp_path / "absent.jsonl", out), capsys)
    assert_one_error(code, err, str(tmp_path / "absent.jsonl"), "not found")
    assert_no_run(out)


def test_too_few_examples_leaves_no_run(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    args = train_args(inputs / "model", inputs / "data.jsonl", out, "--batch-size", "64")
    code, err = run_in_process(args, capsys)
    assert_one_error(code, err, "training examples", "micro_batch_size")
    assert_no_run(out)


# ------------------------------------------------------------------------------------------- a finished run


def test_finished_run_is_not_overwritten(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    args = train_args(inputs / "model", inputs / "data.jsonl", out, "--batch-size", "2",
                      "--data.eval_fraction", "0.25")
    code, err = run_in_process(args, capsys)
    assert code == 0, err
    assert (out / "summary.json").is_file() and (out / "adapter").is_dir()
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    bad_data = train_args(inputs / "model", tmp_path / "absent.jsonl", out)
    for again in (args, [*args, "--lr", "1e-3"], bad_data):
        code, err = run_in_process(again, capsys)
        assert_one_error(code, err, str(out), "already holds a run", "--overwrite")

    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before
