"""Watching a run: the per-step log line (MFU, memory, ETA), train.profile_steps' trace, and `qshard plot`.

Two tiny runs through `qshard.cli.main` in this process (one profiled) serve every test of this file."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch

from qshard import cli
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.random_model import named_config, write_random_checkpoint

RECORD = {"instruction": "add 2 and 3", "output": "5"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two 3-step runs of a tiny Llama on CPU, `a` profiling steps 2..3; their dirs and what they logged."""
    root = tmp_path_factory.mktemp("observe")
    tokenizer = build_demo_tokenizer()
    write_random_checkpoint(root / "model", named_config("llama-tiny", vocab_size=len(tokenizer)))
    tokenizer.save_pretrained(root / "model")
    (root / "data.jsonl").write_text((json.dumps(RECORD) + "\n") * 16)
    logged = {}
    for name, extra in (("a", ["--train.profile_steps", "[2,3]"]), ("b", ["--lr", "1e-3"])):
        stderr = root / f"{name}.err"
        with open(stderr, "w") as f, contextlib.redirect_stderr(f):
            code = cli.main(["train", "--model", str(root / "model"), "--data", str(root / "data.jsonl"),
                             "--output-dir", str(root / name), "--max-steps", "3", "--max-length", "32",
                             "--data.eval_fraction", "0.25", "--train.eval_every", "2",
                             # no samples with the evaluations: greedy decoding would fill the trace (and its time)
                             "--train.sample_every", "0", *extra])
        logged[name] = stderr.read_text()
        assert code == 0, logged[name]
    return {"root": root, "stderr": logged}


# --------------------------------------------------------------------------------------------------- log line


def test_log_line_on_cpu(runs):
    from qshard.train.metrics import format_duration

    """One plain line per step (stderr is no terminal) with loss, tok/s, memory as GiB and % of the machine,
    lr, grad norm and an ETA; no MFU on CPU, in the line or in metrics.jsonl."""
    lines = [line for line in runs["stderr"]["b"].splitlines() if " qshard: step " in line]
    assert [re.search(r"step (\d+)/3 ", line).group(1) for line in lines] == ["1", "2", "3"], lines
    pattern = re.compile(r"step \d/3 \| loss \d+\.\d{4} \| [\d,]+ tok/s \| \d+\.\d\d GiB \(\d+%\) \| .*"
                         r"lr \S+ \| grad_norm \d+\.\d{3} \| ETA \d+s$")
    assert all(pattern.search(line) for line in lines), lines
    assert lines[-1].endswith("ETA 0s")
    assert "MFU" not in runs["stderr"]["b"]
    records = [json.loads(line) for line in (runs["root"] / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and not any("mfu" in r for r in records)
    assert "qshard plot" in runs["stderr"]["b"]  # the end-of-run message names the plot command
    # compile is on by default where it pays; on the CPU the run says once that it is off
    assert runs["stderr"]["b"].count("parallel.compile auto: off on cpu") == 1
    assert [format_duration(s) for s in (3723.4, 245, 6)] == ["1h02m03s", "4m05s", "6s"]


def test_mfu_counts_every_block_linear_and_the_head():
    """6 x (q, k, v, o, gate, up, down per block, and the head) for llama-tiny; a quantized base under a LoRA
    wrapper counts as the plain linear it replaces; the GPU table gives the peak, unknown devices none."""
    from transformers import AutoModelForCausalLM

    from qshard.adapters.lora import LoRALinear
    from qshard.config import QuantConfig
    from qshard.quant.nf4 import NF4Linear
    from qshard.train.metrics import matmul_flops_per_token, mfu_per_token_rate, peak_bf16_flops

    config = named_config("llama-tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hidden, inter, vocab, kv = 128, 256, 512, 2 * 128 // 4
    block = hidden * hidden * 2 + hidden * kv * 2 + hidden * inter * 3
    expected = 6 * (2 * block + hidden * vocab)
    assert matmul_flops_per_token(model) == expected
    attn = model.model.layers[0].self_attn
    base = NF4Linear.from_config(hidden, hidden, False, QuantConfig(), device="meta")
    attn.q_proj = LoRALinear(base, hidden, hidden, rank=8, alpha=16, dropout=0.0)
    assert matmul_flops_per_token(model) == expected
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA GeForce GTX 1080") is None
    assert mfu_per_token_rate(model, torch.device("cpu"), 1) is None


# --------------------------------------------------------------------------------------------------- profiler


def test_profile_steps_writes_a_trace_of_those_steps(runs):
    trace = runs["root"] / "a" / "profile" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("args", {}).get("Input Dims") for e in events)  # record_shapes
    assert any(e.get("cat") == "python_function" for e in events)  # with_stack
    assert not (runs["root"] / "b" / "profile").exists()
    assert "ui.perfetto.dev" in runs["stderr"]["a"]


@pytest.mark.parametrize("steps, needle", [
    ("[2,4]", "train.profile_steps: [2, 4] reaches past the run's last step (3)"),
    ("[3,2]", "train.profile_steps must be [first, last]"),
    ("[0,1]", "train.profile_steps must be [first, last]"),
])
def test_profile_steps_outside_the_run(runs, tmp_path, capsys, steps, needle):
    root = runs["root"]
    capsys.readouterr()
    code = cli.main(["train", "--model", str(root / "model"), "--data", str(root / "data.jsonl"),
                     "--output-dir", str(tmp_path / "out"), "--max-steps", "3", "--max-length", "32",
                     "--train.profile_steps", steps])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("qshard: error: ") and needle in errors[0], err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------------- plot


def test_plot_two_runs(runs, tmp_path):
    png = tmp_path / "cmp.png"
    assert cli.main(["plot", str(runs["root"] / "a"), str(runs["root"] / "b"), "--out", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_of_a_directory_without_metrics(runs, tmp_path, capsys):
    capsys.readouterr()
    assert cli.main(["plot", str(runs["root"] / "a"), str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"qshard: error: {tmp_path}: no metrics.jsonl (not a qshard run?)"
