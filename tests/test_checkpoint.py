"""Checkpoints: exact resume, preemption, SIGKILL mid-save, resharding, exports, and bad checkpoints."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import time
from importlib import resources
from pathlib import Path

import pytest
import torch
from conftest import cli, cli_env, run_on_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qshard import export
from qshard.checkpoint import STATE_FILE, complete_checkpoints
from qshard.cli import main as cli_main
from qshard.config import Config
from qshard.errors import QShardError
from qshard.train import optim
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"
STEPS = 24
EVAL_DATA = None  # set by the fixture below


@pytest.fixture(scope="module", autouse=True)
def _short_eval_data(tmp_path_factory):
    """Every run here evaluates the first 24 of the demo's 200 held-out examples: no test here asserts a
    held-out loss, and the whole set costs ~2.7 s of CPU per run (before the first step and after the last)."""
    global EVAL_DATA
    EVAL_DATA = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    EVAL_DATA.write_text("".join((DEMO / "eval.jsonl").read_text().splitlines(keepends=True)[:24]))


def _args(model_dir, out, *extra):
    return cli(
        "train", "--model", str(model_dir), "--data", str(DEMO / "train.jsonl"), "--eval-data",
        str(EVAL_DATA), "--output-dir", str(out), "--max-length", "48", "--batch-size", "2",
        "--lr", "1e-2", "--max-steps", str(STEPS), "--train.precision", "fp32", "--lora.dropout", "0.1",
        "--train.sample_every", "0", "--quant.double_quant", "false", *extra,  # fp32 scales: _dequantized_base
    )


def _run_here(args, capsys):
    """`args` through `qshard.cli.main` in this process: the same path from argv to exit code and stderr as
    `_run_spawned`, without a process start. For runs that need no process of their own (a signal, a resource
    limit) and whose losses are not compared bit for bit with another process's."""
    assert args[:3] == cli()
    capsys.readouterr()
    code = cli_main(args[3:])
    return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)


def _run_spawned(args, before=None):
    """`args` (a `python -m qshard` command line; with `--nproc N`, on N ranks) in processes of their own: through
    `qshard.cli.main` in processes spawned and set up as torchrun sets them up (run_on_ranks; the launcher itself
    is tested in test_launcher.py), without starting Python and importing torch again (most of a short run's
    time). `before(rank)` runs first in each. Rank 0's exit code and stderr (which holds the log); every other
    rank must exit as rank 0 did."""
    assert args[:3] == cli()
    nprocs = int(args[args.index("--nproc") + 1]) if "--nproc" in args else 1
    rank0, *others = run_on_ranks({"run": args[3:]}, nprocs, before)["run"]
    for rank, run in enumerate(others, 1):
        assert run.code == rank0.code, (rank, run.stderr)
    return subprocess.CompletedProcess(args, rank0.code, "", rank0.stderr)


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _start_and_interrupt(args, out, when, sig):
    """Start a run, wait until `when(out)` holds, send `sig`; return the finished process."""
    proc = subprocess.Popen(args, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not when(out):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, "", stderr)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("full") / "run"
    proc = _run_spawned(_args(tiny_models("llama"), out, "--save-every", "6", "--checkpoint.keep_last", "5"))
    assert proc.returncode == 0, proc.stderr
    return out


def test_preempted_run_resumes_bit_for_bit(uninterrupted, tiny_models, tmp_path):
    out = tmp_path / "run"
    args = _args(tiny_models("llama"), out, "--save-every", "6")
    started = lambda o: (o / "metrics.jsonl").is_file() and (o / "metrics.jsonl").read_text().count("\n") >= 3  # noqa: E731
    proc = _start_and_interrupt(args, out, started, signal.SIGTERM)
    assert proc.returncode == 0, proc.stderr
    assert "preempted: saved step" in proc.stderr and "--resume auto" in proc.stderr
    assert not (out / "summary.json").exists()  # not finished, and does not look finished
    saved = complete_checkpoints(out / "checkpoints")[-1]
    stopped_at = json.loads((saved / STATE_FILE).read_text())["step"]
    assert 3 <= stopped_at < STEPS and len(_losses(out)) == stopped_at

    resumed = _run_spawned(args + ["--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {stopped_at}" in resumed.stderr
    assert _losses(out) == _losses(uninterrupted)  # bit for bit, dropout included
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == STEPS


def test_sigkill_during_save_keeps_previous_checkpoint(uninterrupted, tiny_models, tmp_path):
    out = tmp_path / "run"
    args = _args(tiny_models("llama"), out, "--save-every", "1", "--checkpoint.keep_last", "3")

    def saving_after_first(o):  # a save in progress while an earlier one is complete
        root = o / "checkpoints"
        return root.is_dir() and complete_checkpoints(root) and any(p.suffix == ".tmp" for p in root.iterdir())

    proc = _start_and_interrupt(args, out, saving_after_first, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    done = complete_checkpoints(out / "checkpoints")
    assert done and all((p / STATE_FILE).is_file() and (p / "config.yaml").is_file() for p in done)
    resumed = _run_spawned(args + ["--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr
    last = json.loads((done[-1] / STATE_FILE).read_text())["step"] if done[-1].exists() else None
    assert last is None or f"at step {last}" in resumed.stderr
    assert _losses(out) == _losses(uninterrupted)
    assert not any(p.suffix == ".tmp" for p in (out / "checkpoints").iterdir())


def test_resume_at_another_world_size(uninterrupted, tiny_models, tmp_path, capsys):
    """Saved by 2 ranks, resumed by 1 with the same global batch: DCP reshards, the data order goes on.
    (No dropout here: its masks depend on how the batch is split over ranks.)"""
    two = tmp_path / "ws2"
    proc = _run_spawned(_args(tiny_models("llama"), two, "--nproc", "2", "--batch-size", "1", "--save-every", "6",
                              "--checkpoint.keep_last", "5", "--lora.dropout", "0"))
    assert proc.returncode == 0, proc.stderr
    one = tmp_path / "ws1"
    resumed = _run_here(_args(tiny_models("llama"), one, "--resume", str(two / "checkpoints" / "step-00000012"),
                              "--lora.dropout", "0", "--save-every", "6"), capsys)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 12" in resumed.stderr
    torch.testing.assert_close(torch.tensor(_losses(one)), torch.tensor(_losses(two)[12:]), rtol=1e-5, atol=1e-5)
    # And back: world size 1 keeps the quantized blocks' LoRA weights as plain tensors (no FSDP2 unit), which
    # 2 ranks read back as their DTensor shards.
    again = tmp_path / "ws2-again"
    proc = _run_spawned(_args(tiny_models("llama"), again, "--nproc", "2", "--batch-size", "1", "--lora.dropout", "0",
                              "--resume", str(one / "checkpoints" / "step-00000018")))
    assert proc.returncode == 0, proc.stderr
    assert "at step 18" in proc.stderr
    torch.testing.assert_close(torch.tensor(_losses(again)), torch.tensor(_losses(two)[18:]), rtol=1e-5, atol=1e-5)


def test_resume_keeps_this_runs_optimizer_implementation(uninterrupted, tiny_models, tmp_path, capsys, monkeypatch):
    """A checkpoint written by fused AdamW, resumed by a run whose build_optimizer chooses foreach (what it chooses
    under fp16 loss scaling): the resumed run steps with foreach, its hyperparameters as saved, and trains on as the
    uninterrupted run did."""
    built = []

    def foreach_optimizer(model, cfg, device, loss_scaling, *rest):
        built.append(optim.build_optimizer(model, cfg, device, True, *rest))
        return built[-1]

    saved = uninterrupted / "checkpoints" / "step-00000018"
    monkeypatch.setattr("qshard.train.loop.build_optimizer", foreach_optimizer)
    resumed = _run_here(_args(tiny_models("llama"), tmp_path / "run", "--resume", str(saved)), capsys)
    assert resumed.returncode == 0, resumed.stderr
    [optimizer] = built
    assert all(g["foreach"] and not g["fused"] for g in optimizer.param_groups)
    # What wrote the checkpoint: the uninterrupted fp32 run's optimizer, fused.
    assert optim.build_optimizer(torch.nn.Linear(2, 2), Config().optim, torch.device("cpu")).param_groups[0]["fused"]
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "run")), torch.tensor(_losses(uninterrupted)[18:]),
                               rtol=1e-5, atol=1e-5)


def test_exported_adapter_and_merged_model(uninterrupted, tiny_models, tmp_path, capsys):
    proc = _run_here(cli("export", "adapter", "--run", str(uninterrupted), "--out", str(tmp_path / "adapter")), capsys)
    assert proc.returncode == 0, proc.stderr
    ours = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    trained = load_file(uninterrupted / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == trained.keys() and all(torch.equal(ours[k], trained[k]) for k in ours)

    proc = _run_here(cli("export", "merged", "--run", str(uninterrupted), "--out", str(tmp_path / "merged")), capsys)
    assert proc.returncode == 0, proc.stderr
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged").dtype == torch.bfloat16
    # Computed in fp32 from the stored bf16 weights, so that only the weights' rounding is compared.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    import peft

    base = AutoModelForCausalLM.from_pretrained(tiny_models("llama"), dtype=torch.float32)
    nf4_base = dict(_base_state_of(uninterrupted, tiny_models("llama")))
    base.load_state_dict(nf4_base, strict=False)
    reference = peft.PeftModel.from_pretrained(base, uninterrupted / "adapter").eval()
    ids = torch.randint(3, 400, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = merged(input_ids=ids).logits.float()
        b = reference(input_ids=ids).logits.float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max(), float((a - b).abs().max() / b.abs().max())


def _base_state_of(run_dir, model_dir):
    """The NF4-dequantized base the run trained on, computed here through qshard's own quantizer."""
    from qshard.loading import Checkpoint
    from qshard.quant import dequantize_nf4, quantize_nf4

    ckpt = Checkpoint(model_dir)
    for name in sorted(ckpt.names()):
        tensor = ckpt.read(name)
        if ".layers." in name and name.endswith("proj.weight"):
            tensor = dequantize_nf4(*quantize_nf4(tensor, 64), torch.float32)
        yield name, tensor.float()


def test_merged_weights_match_trained_model_in_process(tiny_models, tmp_path, dist_env):
    result = train(_fp32_config(tiny_models("qwen2"), tmp_path, "qlora", steps=4, lr=1e-2), dist_env)
    ours, theirs = _merged_logits(result.model, tiny_models("qwen2"), tmp_path, max_shard_bytes=200_000)
    assert len(list((tmp_path / "merged").glob("model-*-of-*.safetensors"))) > 1  # sharded as asked
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()


def _fp32_config(model_dir, tmp_path, train_type, steps, lr) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.train_type = str(model_dir), "fp32", train_type
    cfg.data.path, cfg.data.eval_path, cfg.data.max_length = str(DEMO / "train.jsonl"), str(EVAL_DATA), 48
    cfg.train.max_steps, cfg.optim.lr, cfg.output.dir = steps, lr, str(tmp_path / "run")
    return cfg.validate()


def _merged_logits(model, model_dir, tmp_path, **write_kwargs):
    """Logits of the trained model and of its fp32 merged export loaded by transformers, on one probe."""
    weights = export.model_weights(model, torch.float32, merge_adapters=True)
    export.write_merged(tmp_path / "merged", weights, model_dir, is_main=True, dtype=torch.float32, **write_kwargs)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(3, 400, (2, 20), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits, merged(input_ids=ids).logits


# ---------------------------------------------------------------------------------------------------- bad input


def _error_line(proc):
    lines = [x for x in proc.stderr.splitlines() if x.startswith("qshard: error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_resume_refuses_another_base_model(uninterrupted, tiny_models, tmp_path, capsys):
    ckpt = uninterrupted / "checkpoints" / f"step-{STEPS:08d}"
    other = tiny_models("llama", seed=5)
    proc = _run_here(_args(other, tmp_path / "x", "--resume", str(ckpt)), capsys)
    assert "another base model" in _error_line(proc)
    proc = _run_here(_args(tiny_models("llama"), tmp_path / "y", "--resume", str(ckpt), "--lora-rank", "4"), capsys)
    assert "lora.rank" in _error_line(proc)
    assert not (tmp_path / "x" / "config.yaml").exists() and not (tmp_path / "y" / "config.yaml").exists()


def test_resume_refuses_another_quantized_base():
    from qshard.checkpoint import check_compatible

    saved = Config().to_dict()
    # As an older qshard saved it: nf4, 4 bits, fp32 scales (double_quant was off before its auto).
    del saved["quant"]["method"], saved["quant"]["bits"], saved["quant"]["double_quant"]
    state = {"base_fingerprint": "f", "config": saved}
    check_compatible(Path("ck"), state, Config(), "f")  # same base, same quantization
    cfg = Config()
    cfg.quant.method, cfg.quant.bits = "hqq", 2
    with pytest.raises(QShardError, match=r"quant.method='nf4', but this run has quant.method='hqq'"):
        check_compatible(Path("ck"), state, cfg.validate(), "f")
    # Double-quantized scales are another base too (an older qshard's checkpoint had fp32 ones).
    cfg = Config()
    cfg.quant.double_quant = True
    with pytest.raises(QShardError, match=r"quant.double_quant=False, but this run has quant.double_quant=True"):
        check_compatible(Path("ck"), state, cfg.validate(), "f")


def test_corrupt_checkpoint_is_a_clear_error(uninterrupted, tiny_models, tmp_path, capsys):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(uninterrupted / "checkpoints" / f"step-{STEPS:08d}", ckpt)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    proc = _run_here(_args(tiny_models("llama"), tmp_path / "x", "--resume", str(ckpt)), capsys)
    assert str(ckpt) in _error_line(proc)
    (ckpt / STATE_FILE).write_text("{not json")
    proc = _run_here(_args(tiny_models("llama"), tmp_path / "y", "--resume", str(ckpt)), capsys)
    assert "trainer_state.json:1" in _error_line(proc)


def test_full_disk_during_save_leaves_previous_checkpoint(tiny_models, tmp_path, capsys):
    out = tmp_path / "run"
    args = _args(tiny_models("llama"), out, "--max-steps", "4", "--save-every", "2", "--checkpoint.async_save", "false")
    first = _run_here(args, capsys)
    assert first.returncode == 0, first.stderr
    before = {p.name: (p / STATE_FILE).read_bytes() for p in complete_checkpoints(out / "checkpoints")}

    more = _args(tiny_models("llama"), out, "--max-steps", "8", "--save-every", "2", "--checkpoint.async_save",
                 "false", "--resume", "auto")
    proc = _run_spawned(more, before=_small_files)
    assert "saving checkpoint" in _error_line(proc)
    after = {p.name: (p / STATE_FILE).read_bytes() for p in complete_checkpoints(out / "checkpoints")}
    assert after == before  # the earlier checkpoints are untouched, and no partial one counts
    assert not (out / "summary.json").exists()


def _small_files(rank: int) -> None:
    """A 'disk' that takes no file over 64 KiB: the checkpoint shard does not fit."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


@pytest.mark.parametrize("how", ["fsdp", "dtensor"])
def test_checkpoint_holds_only_what_trains(tiny_models, tmp_path, capsys, how):
    """The frozen base (NF4 codes and scales, params or DTensor buffers) is rebuilt, never saved."""
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "run"
    proc = _run_here(_args(tiny_models("llama"), out, "--max-steps", "2", "--parallel.quant_sharding", how), capsys)
    assert proc.returncode == 0, proc.stderr
    keys = FileSystemReader(str(complete_checkpoints(out / "checkpoints")[-1])).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2 and all(k.endswith(("lora_A", "lora_B")) for k in model_keys)
    assert any(k.startswith("optim.state.") for k in keys)


def test_full_finetune_checkpoint_and_consolidated_export(tiny_models, tmp_path, dist_env):
    """Full fine-tuning saves every weight, and the merged export is the trained model itself."""
    from torch.distributed.checkpoint import FileSystemReader

    result = train(_fp32_config(tiny_models("llama"), tmp_path, "full", steps=2, lr=1e-3), dist_env)
    saved = FileSystemReader(str(complete_checkpoints(tmp_path / "run" / "checkpoints")[-1])).read_metadata()
    model_keys = {k for k in saved.state_dict_metadata if k.startswith("model.")}
    assert model_keys == {f"model.{n}" for n, _ in result.model.named_parameters()}
    ours, theirs = _merged_logits(result.model, tiny_models("llama"), tmp_path)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_sigusr1_saves_and_exits_and_partial_checkpoints_are_refused(tiny_models, tmp_path, capsys):
    out = tmp_path / "run"
    args = _args(tiny_models("llama"), out, "--save-every", "100")
    started = lambda o: (o / "metrics.jsonl").is_file() and (o / "metrics.jsonl").read_text().count("\n") >= 2  # noqa: E731
    proc = _start_and_interrupt(args, out, started, signal.SIGUSR1)
    assert proc.returncode == 0 and "received SIGUSR1" in proc.stderr, proc.stderr
    [saved] = complete_checkpoints(out / "checkpoints")
    partial = saved.with_name(saved.name + ".tmp")
    saved.rename(partial)
    (partial / STATE_FILE).unlink()  # what a save killed before its end leaves behind
    refused = _run_here(_args(tiny_models("llama"), tmp_path / "other", "--resume", str(partial)), capsys)
    assert "not a complete qshard checkpoint" in _error_line(refused)
    # auto ignores the partial one: a fresh start
    fresh = _run_here(args + ["--resume", "auto", "--max-steps", "2"], capsys)
    assert fresh.returncode == 0, fresh.stderr
    assert "resumed from" not in fresh.stderr


def test_no_checkpoint_at_end_when_asked(tiny_models, tmp_path, capsys):
    """checkpoint.at_end false: the periodic save stays, the end's save is skipped, the adapter is still exported."""
    out = tmp_path / "run"
    args = _args(tiny_models("llama"), out, "--max-steps", "3", "--save-every", "2", "--checkpoint.at_end", "false")
    proc = _run_here(args, capsys)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-00000002"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoint"] is None and summary["steps"] == 3
    metrics = (out / "metrics.jsonl").read_text()
    # --resume auto finds step 2's checkpoint, but the run is finished: nothing is trained again
    again = _run_here(args + ["--resume", "auto"], capsys)
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr
    assert (out / "metrics.jsonl").read_text() == metrics and (out / "summary.json").is_file()
    # more steps cannot continue from a step that was never saved
    more = _run_here(args + ["--resume", "auto", "--max-steps", "5"], capsys)
    assert more.returncode == 2 and "without a checkpoint of it" in more.stderr, more.stderr
    assert (out / "metrics.jsonl").read_text() == metrics
