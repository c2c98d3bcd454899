"""Early stopping, the best checkpoint and output.adapter_from: best, on a run whose held-out loss stops improving
(a learning rate too high for it), through resume, and their bad inputs."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from conftest import run_on_ranks
from safetensors.torch import load_file

from qshard.checkpoint import STATE_FILE, step_dir
from qshard.cli import main as cli_main

DEMO = resources.files("qshard") / "demo_data"
EVERY, PATIENCE, MAX_STEPS = 2, 2, 24


@pytest.fixture(scope="module")
def inputs(tiny_models, tmp_path_factory):
    """A one-layer model and the first 16 of the demo's held-out examples."""
    eval_data = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    eval_data.write_text("".join((DEMO / "eval.jsonl").read_text().splitlines(keepends=True)[:16]))
    return tiny_models("llama", num_hidden_layers=1), eval_data


def _args(inputs, out, *extra, max_steps=MAX_STEPS) -> list[str]:
    model, eval_data = inputs
    # A constant schedule: a run with fewer max_steps trains the same steps, so it can be resumed further.
    return ["train", "--model", str(model), "--data", str(DEMO / "train.jsonl"), "--eval-data", str(eval_data),
            "--output-dir", str(out), "--max-length", "32", "--batch-size", "2", "--lr", "5e-2",
            "--max-steps", str(max_steps), "--train.precision", "fp32", "--optim.schedule", "constant",
            "--lora.rank", "4", "--train.eval_every", str(EVERY),
            "--train.early_stopping_patience", str(PATIENCE), "--checkpoint.keep_best", "true",
            "--checkpoint.keep_last", "1", "--train.sample_every", "0",
            "--quant.double_quant", "false", *extra]  # the losses the expected stops were chosen for


def _train(inputs, out, *extra, max_steps=MAX_STEPS) -> int:
    return cli_main(_args(inputs, out, *extra, max_steps=max_steps))


def _evals(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def _expected(evals: list[tuple[int, float]]) -> tuple[int, float, int | None]:
    """(best step, best loss, step stopped at) by the rule, with min_delta 0, from the logged losses."""
    best_step, best, waited = None, float("inf"), 0
    for step, loss in evals:
        waited = 0 if loss < best else waited + 1
        if loss < best:
            best_step, best = step, loss
        if waited == PATIENCE:
            return best_step, best, step
    return best_step, best, None


def _steps_kept(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir())


def _export(out: Path, ckpt: Path, dest: Path) -> dict[str, torch.Tensor]:
    assert cli_main(["export", "adapter", "--run", str(out), "--checkpoint", str(ckpt), "--out", str(dest)]) == 0
    return load_file(dest / "adapter_model.safetensors")


def test_early_stopping_best_checkpoint_and_resume(inputs, tmp_path):
    out = tmp_path / "run"
    assert _train(inputs, out, "--output.adapter_from", "best") == 0
    evals = _evals(out)
    best_step, best_loss, stopped = _expected(evals)
    assert stopped is not None and stopped < MAX_STEPS  # the constructed case does stop early
    assert evals[-1][0] == stopped  # no step after the evaluation that ran out of patience
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["stopped_at_step"] == stopped
    assert summary["best_step"] == best_step and summary["best_eval_loss"] == best_loss
    assert summary["best_checkpoint"] == f"checkpoints/step-{best_step:08d}"
    assert summary["checkpoint"] == f"checkpoints/step-{stopped:08d}" and summary["adapter_from"] == "best"
    # keep_last 1 pruned every other checkpoint, never the best; the final one was saved at the stop.
    assert _steps_kept(out) == [best_step, stopped]
    state = json.loads((step_dir(out / "checkpoints", stopped) / STATE_FILE).read_text())
    assert state["best"] == {"loss": best_loss, "step": best_step, "evals_without_improvement": PATIENCE}

    # adapter/ holds the best step's weights, not the last step's.
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    best = _export(out, step_dir(out / "checkpoints", best_step), tmp_path / "best")
    last = _export(out, step_dir(out / "checkpoints", stopped), tmp_path / "last")
    assert adapter.keys() == best.keys() and all(torch.equal(adapter[k], best[k]) for k in best)
    assert not all(torch.equal(adapter[k], last[k]) for k in last)

    # Stopped one evaluation before the stop (patience partly used), then resumed to the full length: the best
    # and the patience count carry on, so the run stops where the uninterrupted one did, with the same best.
    again = tmp_path / "again"
    assert _train(inputs, again, max_steps=stopped - EVERY) == 0
    assert json.loads((again / "summary.json").read_text())["stopped_early"] is False
    assert _train(inputs, again, "--resume", "auto") == 0
    resumed = json.loads((again / "summary.json").read_text())
    assert (resumed["best_step"], resumed["stopped_at_step"]) == (best_step, stopped)
    assert _steps_kept(again) == [best_step, stopped]
    torch.testing.assert_close(torch.tensor(_evals(again)), torch.tensor(evals), rtol=1e-5, atol=1e-5)
    # A run that stopped early is finished: --resume auto has nothing to do, even when the run was cut off
    # between its last checkpoint and summary.json (which it then writes, training nothing).
    assert _train(inputs, again, "--resume", "auto") == 0
    (again / "summary.json").unlink()
    assert _train(inputs, again, "--resume", "auto") == 0
    assert _steps_kept(again) == [best_step, stopped] and _evals(again)[-1][0] == stopped
    rewritten = json.loads((again / "summary.json").read_text())
    assert rewritten["stopped_at_step"] == stopped and rewritten["eval_loss_end"] == pytest.approx(evals[-1][1])
    # A larger patience goes on from there.
    assert _train(inputs, again, "--resume", "auto", "--train.early_stopping_patience", "100") == 0
    assert _evals(again)[-1][0] == MAX_STEPS
    assert json.loads((again / "summary.json").read_text())["stopped_early"] is False


def test_two_ranks_stop_together_and_load_the_best(inputs, tmp_path):
    """Under FSDP2 on two ranks: both stop at the same evaluation, and adapter/ is the best step's weights, read
    back into every rank's shards."""
    out = tmp_path / "run"
    ranks = run_on_ranks({"run": _args(inputs, out, "--output.adapter_from", "best")})["run"]
    assert [r.code for r in ranks] == [0, 0], ranks[0].stderr + ranks[1].stderr
    best_step, best_loss, stopped = _expected(_evals(out))
    assert stopped is not None and _evals(out)[-1][0] == stopped
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["best_step"], summary["best_eval_loss"]) == (best_step, best_loss)
    assert summary["stopped_at_step"] == stopped
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    best = _export(out, step_dir(out / "checkpoints", best_step), tmp_path / "best")
    assert adapter.keys() == best.keys() and all(torch.equal(adapter[k], best[k]) for k in best)


@pytest.mark.parametrize("extra, needle", [
    (["--train.early_stopping_patience", "2", "--data.eval_fraction", "0"],
     "train.early_stopping_patience: needs a held-out set"),
    (["--checkpoint.keep_best", "true", "--train.eval_every", "0"], "checkpoint.keep_best: needs train.eval_every"),
    (["--train.early_stopping_patience", "-1"], "train.early_stopping_patience must be >= 0"),
    (["--train.early_stopping_min_delta", "-0.1"], "train.early_stopping_min_delta must be >= 0"),
    (["--output.adapter_from", "best"], "output.adapter_from: best needs checkpoint.keep_best"),
    (["--train.early_stopping_min_delta", "0.1"], "train.early_stopping_min_delta: has no effect without"),
    (["--output.adapter_from", "best", "--checkpoint.keep_best", "true", "--train.train_type", "full"],
     "output.adapter_from: train.train_type full writes no adapter"),
])
def test_bad_inputs(inputs, tmp_path, capsys, extra, needle):
    model, _ = inputs
    out = tmp_path / "out"
    capsys.readouterr()
    code = cli_main(["train", "--model", str(model), "--data", str(DEMO / "train.jsonl"), "--output-dir", str(out),
                     "--train.eval_every", "2", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("qshard: error:") == 1 and needle in err, err
    assert "Traceback" not in err and not out.exists()


def test_dry_run_plan_names_them(inputs, tmp_path, capsys):
    model, eval_data = inputs
    capsys.readouterr()
    assert cli_main(["train", "--model", str(model), "--data", str(DEMO / "train.jsonl"), "--eval-data", str(eval_data),
                     "--output-dir", str(tmp_path / "out"), "--train.eval_every", "2", "--dry-run",
                     "--train.early_stopping_patience", "3", "--checkpoint.keep_best", "true"]) == 0
    plan = capsys.readouterr().out
    assert "newest 2 kept and the best held-out loss's" in plan and "stops early after 3 evaluations" in plan, plan
