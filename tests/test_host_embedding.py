"""model.embedding_on_host: the input embedding looked up on the host, outside every FSDP2 unit, trains as the
embedding on the device does (SFT and DPO, one rank and two, with samples, evaluation and `qshard generate`), and
is refused in one line where the embedding trains or is the head's weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_on_ranks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from qshard.cli import main as cli_main

ON = ("--model.embedding_on_host", "true")


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Chat records for SFT, pairs for DPO and the same as unpaired examples for KTO, with held-out sets."""
    root = tmp_path_factory.mktemp("host-embedding-data")
    chats = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                           {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]}
             for n in range(1, 9)]
    pairs = [{"prompt": f"Reverse {w}.", "chosen": w[::-1] + " !!", "rejected": w[::-1] + " ??"}
             for w in ("abc", "bcd", "cde", "def", "efg", "fgh", "ghi", "hij")]
    _write_jsonl(root / "sft.jsonl", chats[:6])
    _write_jsonl(root / "sft-eval.jsonl", chats[6:])
    _write_jsonl(root / "dpo.jsonl", pairs[:6])
    _write_jsonl(root / "dpo-eval.jsonl", pairs[6:])
    kto = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"} for p in pairs
           for key in ("chosen", "rejected")]
    _write_jsonl(root / "kto.jsonl", kto[:12])
    _write_jsonl(root / "kto-eval.jsonl", kto[12:])
    return root


def _args(model_dir: Path, data: Path, out: Path, objective: str, *extra: str) -> list[str]:
    name = objective if objective in ("sft", "kto") else "dpo"
    return ["train", "--model", str(model_dir), "--data", str(data / f"{name}.jsonl"), "--eval-data",
            str(data / f"{name}-eval.jsonl"), "--output-dir", str(out), "--train.objective", objective,
            "--max-length", "32", "--batch-size", "2", "--lr", "3e-2", "--max-steps", "3", "--train.precision",
            "fp32", "--optim.warmup_steps", "0", "--train.eval_every", "3", "--data.cache_dir",
            str(data / "cache"), *extra]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[float]:
    return [r[k] for r in _records(out) for k in ("loss", "eval_loss") if k in r]


def _watch(run) -> dict:
    """Count the decoder's training and evaluation calls by what they were given, and note where the built
    model keeps its embedding."""
    model = run.model
    seen = {"input_ids": 0, "inputs_embeds": 0}

    def count(_module, _args, kwargs):
        if kwargs.get("use_cache"):  # generation (samples) passes ids, one token at a time
            return
        for key in ("input_ids", "inputs_embeds"):
            seen[key] += kwargs.get(key) is not None

    model.base_model.register_forward_pre_hook(count, with_kwargs=True)
    embed = model.get_input_embeddings()
    # Every parameter an FSDP2 unit holds is a DTensor (the root's too): a plain tensor is in none.
    seen["embed_in_unit"] = isinstance(embed, FSDPModule) or isinstance(embed.weight, DTensor)
    seen["embed_device"] = embed.weight.device.type
    seen["head_in_unit"] = isinstance(model.get_output_embeddings(), FSDPModule) or \
        isinstance(model.get_output_embeddings().weight, DTensor)
    return seen


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto"])
def test_one_rank_trains_as_the_embedding_on_the_device(objective, tiny_models, data, tmp_path, monkeypatch):
    """Same losses (fp32) with and without the option; with it the decoder gets the rows (never the ids) in
    training, evaluation, the reference pass and KTO's mismatched rows, and the embedding is a plain host tensor
    in no FSDP2 unit. The SFT run samples at its evaluation and `qshard generate` runs on it (the ids then go
    through the module)."""
    from qshard.train import run as run_mod

    model_dir = tiny_models("llama", num_hidden_layers=1)
    watched = {}
    build = run_mod._build

    def kept(*a, **k):
        run = build(*a, **k)
        watched["seen"] = _watch(run)
        return run

    assert cli_main(_args(model_dir, data, tmp_path / "off", objective)) == 0
    watched_off = watched.pop("seen", None)
    monkeypatch.setattr(run_mod, "_build", kept)
    assert cli_main(_args(model_dir, data, tmp_path / "on", objective, *ON)) == 0
    seen = watched["seen"]
    torch.testing.assert_close(_losses(tmp_path / "on"), _losses(tmp_path / "off"), rtol=1e-6, atol=1e-6)
    assert len(_losses(tmp_path / "on")) == 3 + 1  # three steps, held-out after the last
    assert seen["input_ids"] == 0 and seen["inputs_embeds"] > 0, seen
    assert not seen["embed_in_unit"] and seen["embed_device"] == "cpu", seen
    assert watched_off is None  # the run without the option was built before the watch
    if objective == "sft":
        # The run with the defaults: `auto` settled off where there is no GPU, and its config.yaml says so.
        assert yaml.safe_load((tmp_path / "off" / "config.yaml").read_text())["model"]["embedding_on_host"] is False
        assert (tmp_path / "on" / "samples.jsonl").read_text() == (tmp_path / "off" / "samples.jsonl").read_text()
        assert cli_main(["generate", "--run", str(tmp_path / "on"), "--prompt", "Count to 3.",
                         "--max-new-tokens", "3"]) == 0


def test_two_ranks_train_as_the_embedding_on_the_device(tiny_models, data, tmp_path):
    """World size 2 (gloo): each rank looks its rows up in its own host copy; the SFT and DPO losses are those of
    the same runs with the embedding in its FSDP2 unit."""
    model_dir = tiny_models("llama", num_hidden_layers=1)
    runs = {f"{objective}-{name}": _args(model_dir, data, tmp_path / f"{objective}-{name}", objective, *extra)
            for objective in ("sft", "dpo") for name, extra in (("off", ()), ("on", ON))}
    ranks = run_on_ranks(runs)
    for name, results in ranks.items():
        assert [r.code for r in results] == [0, 0], (name, results[0].stderr, results[1].stderr)
    for objective in ("sft", "dpo"):
        on, off = _losses(tmp_path / f"{objective}-on"), _losses(tmp_path / f"{objective}-off")
        assert len(on) == 3 + 1
        torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-6)
        assert "input embedding looked up on the host" in ranks[f"{objective}-on"][0].stderr


@pytest.mark.parametrize("extra, says", [
    (("--train.train_type", "full"), "model.embedding_on_host: train.train_type full trains the input embedding"),
    (("--lora.modules_to_save", "embed_tokens"), "model.embedding_on_host: lora.modules_to_save trains the input"),
    ((), "model.embedding_on_host: the input embedding is tied to the output head (tie_word_embeddings)"),
], ids=["full", "modules_to_save", "tied"])
def test_refused_where_the_embedding_trains_or_is_the_head(extra, says, tiny_models, data, tmp_path, capsys):
    tied = not extra
    model_dir = tiny_models("llama", num_hidden_layers=1, tie_word_embeddings=tied)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli_main(_args(model_dir, data, out, "sft", *ON, *extra)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "qshard: error:" in line]
    assert len(errors) == 1 and says in errors[0], err
    assert "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())  # nothing written that looks like a run


def test_plan_moves_the_embedding_from_each_gpu_to_the_host(capsys):
    """`qshard plan`: with the option the 8B embedding (128,256 x 4,096 bf16) leaves every rank's GPU peak and
    takes host memory once per rank, with each rank's looked-up rows of a step and the next, pinned."""
    def plan(*extra):
        capsys.readouterr()
        assert cli_main(["plan", "--model.shape", "llama3-8b", "--gpus", "2", "--seq", "2048", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    embedding = 128_256 * 4_096 * 2 / 2**30
    rows = 2 * 2_048 * 4_096 * 2 / 2**30  # a step's rows and the next step's, pinned on the host (a power of two)
    off, on = plan(), plan(*ON)
    assert on["host_parts"]["input embedding"] == pytest.approx(2 * embedding, rel=1e-3), on["host_parts"]
    assert off["host_parts"]["input embedding"] == 0
    assert on["host_parts"]["data batches"] == pytest.approx(off["host_parts"]["data batches"] + 2 * rows, rel=1e-3)
    assert on["peak_host_gib"] == pytest.approx(off["peak_host_gib"] + 2 * embedding + 2 * rows, rel=1e-3)
    assert on["parts"]["embedding and head"] == pytest.approx(off["parts"]["embedding and head"] - embedding / 2,
                                                              abs=0.01), (on["parts"], off["parts"])
    assert on["peak_gpu_gib"] < off["peak_gpu_gib"]


@pytest.mark.parametrize("extra, on, why", [
    ((), True, "on (one GPU"),
    (("--gpus", "2"), False, "off (2 ranks"),
    (("--parallel.cpu_offload", "true"), False, "off (parallel.cpu_offload"),
    (("--parallel.activation_offload", "true"), False, "off (parallel.activation_offload"),
    (("--train.train_type", "full"), False, "off (train.train_type full trains the input embedding)"),
    (("--lora.modules_to_save", "embed_tokens"), False, "off (lora.modules_to_save trains the input embedding)"),
    (("--tied",), False, "off (the input embedding is tied to the output head"),
], ids=["one-gpu", "two-gpus", "cpu-offload", "activation-offload", "full", "modules-to-save", "tied"])
def test_auto_looks_the_embedding_up_on_the_host_for_one_gpu_only(extra, on, why, tiny_models, capsys):
    """`qshard plan` settles model.embedding_on_host auto as `qshard train` does on that machine: on for one GPU
    with an embedding that neither trains nor is the head's, the embedding then out of the GPU's peak; off, and
    why, for several GPUs, either offload, and an embedding that must stay with the GPU. An explicit value stays."""
    tied = extra == ("--tied",)
    model_dir = tiny_models("llama", num_hidden_layers=1, tie_word_embeddings=tied)
    extra = () if tied else extra

    def plan(*more):
        capsys.readouterr()
        assert cli_main(["plan", "--model", str(model_dir), "--seq", "64", "--gpu-kind", "h200", *extra, *more]) == 0
        return capsys.readouterr().out

    settled = [line for line in plan().splitlines() if "model.embedding_on_host auto" in line]
    assert len(settled) == 1 and why in settled[0], settled
    as_json = json.loads(plan("--json"))
    assert as_json["embedding_on_host"] is on
    given = json.loads(plan("--json", "--model.embedding_on_host", "false"))
    assert "embedding_on_host" not in given  # given, not settled
    if not tied:  # the tiny tied model's embedding is the head's weight: counted once either way
        shape = json.loads((model_dir / "config.json").read_text())
        embedding = shape["vocab_size"] * shape["hidden_size"] * 2 / 2**30  # bf16
        gap = given["parts"]["embedding and head"] - as_json["parts"]["embedding and head"]
        assert gap == pytest.approx(embedding if on else 0.0, abs=1e-6)


def test_train_settles_auto_before_it_predicts_the_run(tiny_models, caplog, dist_env, monkeypatch):
    """`qshard train`'s preflight on a one-GPU machine (predicted here on the CPU) settles `auto` on, says so once,
    and predicts the run with the embedding on the host; without a GPU (no machine) it settles off."""
    import logging

    from qshard.config import resolve
    from qshard.planner import command
    from qshard.planner.command import preflight
    from qshard.planner.hardware import Machine, gpu

    model_dir = tiny_models("llama", num_hidden_layers=1)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cfg = resolve(None, [("model.path", str(model_dir))])
    assert cfg.model.embedding_on_host == "auto"
    predicted = []
    estimate = command.estimate

    def recorded(model, planned, *args, **kwargs):  # what the prediction saw
        predicted.append(planned.model.embedding_on_host)
        return estimate(model, planned, *args, **kwargs)

    monkeypatch.setattr(command, "estimate", recorded)
    with caplog.at_level(logging.INFO, logger="qshard"):
        preflight(cfg, Machine(gpu("h200")), model_dir, vocab, auto_fit=False, is_main=True)
    # The first two: parallel.activation_offload auto's, settled before the embedding (which leaves the host's memory
    # to the offload): with it (the embedding then off), and without it, the embedding where that run would keep it;
    # every prediction after them with the embedding on the host.
    assert predicted[:2] == ["auto", True], predicted
    assert cfg.model.embedding_on_host is True and predicted[2:] and all(v is True for v in predicted[2:]), predicted
    assert sum("model.embedding_on_host auto: on" in r.getMessage() for r in caplog.records) == 1
    cpu = resolve(None, [("model.path", str(model_dir))])
    preflight(cpu, None, model_dir, vocab, auto_fit=False, is_main=True)
    assert cpu.model.embedding_on_host is False


def test_auto_is_settled_for_each_setting_fit_tries(tiny_models):
    """--fit (and --auto-fit) plan each setting with the embedding where `qshard train` would settle `auto` for
    it: on the GPU under either offload, on the host otherwise; the same search with `auto` given as off keeps it
    on the GPU throughout."""
    from qshard.config import resolve
    from qshard.planner.command import compile_planned, plan_model
    from qshard.planner.fit import search
    from qshard.planner.hardware import Machine, gpu

    def candidates(value):
        cfg = compile_planned(resolve(None, [("model.shape", "llama3-8b"), ("model.embedding_on_host", value)]),
                              triton=True)
        found, _ = search(plan_model(cfg, 1), cfg, Machine(gpu("h200")), 2048, top=400)
        return found

    embedding = 128_256 * 4_096 * 2 / 2**30
    found = candidates("auto")
    offloads = ("--parallel.cpu_offload true", "--parallel.activation_offload true")
    kinds = set()
    for c in found:
        offloaded = any(flag in c.flags() for flag in offloads)
        kinds.add(offloaded)
        on_gpu = c.estimate.parts["embedding and head"]
        assert on_gpu == pytest.approx(2 * embedding if offloaded else embedding, abs=0.01), (c.flags(), on_gpu)
        assert (c.estimate.host_parts.get("input embedding", 0) > 0) is not offloaded, c.flags()
    assert kinds == {False, True}  # both kinds of setting were searched
    assert all(c.estimate.parts["embedding and head"] == pytest.approx(2 * embedding, abs=0.01)
               for c in candidates("false"))


def test_auto_left_unsettled_reads_as_off_and_several_ranks_build_nothing():
    """Code that builds a model without settling `auto` keeps the embedding on the GPU; several ranks settle it off
    without building a skeleton (every rank must choose alike, and only one would have one to ask)."""
    from qshard.config import resolve
    from qshard.host_embedding import HostEmbedding
    from qshard.planner import command
    from qshard.planner.estimate import _host_rows

    cfg = resolve(None, [("model.shape", "llama3-8b")])
    assert cfg.model.embedding_on_host == "auto" and not cfg.model.looks_up_on_host()
    model = command.plan_model(cfg, 1)
    assert HostEmbedding.of(model.model) is None and _host_rows(cfg, None) == 0.0

    def no_skeleton():
        raise AssertionError("a skeleton was built")

    why = command.settle_embedding_on_host(cfg, True, 2, no_skeleton)
    assert cfg.model.embedding_on_host is False and why == (
        "model.embedding_on_host auto: off (2 ranks: each would hold a host copy of its own)")
    failing = resolve(None, [("model.shape", "llama3-8b")])
    assert "off (the model's skeleton" in command.settle_embedding_on_host(failing, True, 1, no_skeleton)  # no stop
    # Export and generate build the run's model with the embedding on the device, whatever the run settled.
    from qshard.export_cmd import reading_config

    assert reading_config(resolve(None, [("model.embedding_on_host", "true")])).model.embedding_on_host is False


def test_a_run_on_one_gpu_settles_auto_on_and_says_so_in_its_config(tiny_models, data, tmp_path, monkeypatch,
                                                                    capsys):
    """`qshard train` with the defaults, where the machine is one GPU (its prediction stood in for on the CPU):
    the run keeps the embedding on the host, says so once, and its config.yaml says true."""
    from qshard.planner.hardware import Machine, gpu
    from qshard.train import run as run_mod

    monkeypatch.setattr(run_mod, "this_machine", lambda device, world: Machine(gpu("h200")))
    model_dir = tiny_models("llama", num_hidden_layers=1)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli_main(_args(model_dir, data, out, "sft")) == 0
    err = capsys.readouterr().err
    assert err.count("model.embedding_on_host auto: on (one GPU") == 1, err
    assert "input embedding looked up on the host" in err
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["embedding_on_host"] is True


@pytest.mark.parametrize("staged", [False, True])
def test_the_loader_reads_the_embedding_into_host_memory_only(staged, tiny_models):
    """The host embedding's checkpoint tensor is handed to the store in host memory, never on the device (here
    `meta`, which stands for one), read whole or through the staging ring; the other tensors go to the device."""
    from qshard.build import skeleton
    from qshard.config import resolve
    from qshard.host_embedding import host_tensor_names
    from qshard.loading import Checkpoint
    from qshard.loading.read_ahead import ReadOptions, _ReadAhead

    model_dir = tiny_models("llama", num_hidden_layers=1)
    cfg = resolve(None, [("model.path", str(model_dir)), ("model.embedding_on_host", "true")])
    host = host_tensor_names(skeleton(cfg, model_dir, 1, torch.device("cpu")).model)
    assert host == {"model.embed_tokens.weight"}
    checkpoint = Checkpoint(model_dir)
    names = sorted(checkpoint.names())
    options = ReadOptions(threads=2, in_flight_bytes=1 << 16, piece_bytes=1 << 12, staged=staged)
    try:
        with _ReadAhead(checkpoint, names, torch.device("meta"), options, host) as reads:
            got = {name: reads.take(i) for i, name in enumerate(names)}
        assert {n for n, t in got.items() if t.device.type == "cpu"} == host
        assert all(t.device.type == "meta" for n, t in got.items() if n not in host)
        torch.testing.assert_close(got["model.embed_tokens.weight"], checkpoint.read("model.embed_tokens.weight"),
                                   rtol=0, atol=0)
    finally:
        checkpoint.close()


class _Rows(torch.Tensor):
    """Looked-up rows that note (in `moved`, once each) when they are sent to the device: `.to`, on CPU the same
    call as on a GPU. What `.to` returns is a plain tensor: the model never sees this class."""

    moved: list[torch.Tensor] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to:
            if not any(t is args[0] for t in cls.moved):
                cls.moved.append(args[0])
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return out


def test_each_micro_batch_gets_its_rows_at_its_forward_and_no_gradient(tiny_models, data, tmp_path, monkeypatch):
    """grad_accum 3, reentrant checkpointing: each micro-batch's rows are sent to the device at its own forward
    (not the whole step's, nor the next step's, ahead), the rows the decoder gets never require grad (no gradient
    copied back to the host), and the first block's LoRA trains as with the embedding on the device (same losses)."""
    from qshard.train import loop

    model_dir = tiny_models("llama", num_hidden_layers=1)
    rows_sent, grad_rows = [], []
    looked_up = loop.with_input_embeddings

    def tracked(model, batch):
        out = looked_up(model, batch)
        if "inputs_embeds" in out:
            out["inputs_embeds"] = out["inputs_embeds"].as_subclass(_Rows)
        return out

    def note(_module, _args, kwargs):
        rows = kwargs.get("inputs_embeds")
        if rows is not None and torch.is_grad_enabled():
            rows_sent.append(len(_Rows.moved))
            grad_rows.append(rows.requires_grad)

    from qshard.train import run as run_mod
    build = run_mod._build

    def kept(*a, **k):
        run = build(*a, **k)
        run.model.base_model.register_forward_pre_hook(note, with_kwargs=True)
        return run

    extra = ("--grad-accum", "3", "--batch-size", "1", "--max-steps", "2", "--train.eval_every", "0",
             "--parallel.compile", "false", "--parallel.activation_checkpointing", "true",
             "--parallel.ac_reentrant", "true")
    assert cli_main(_args(model_dir, data, tmp_path / "off", "sft", *extra)) == 0
    monkeypatch.setattr(loop, "with_input_embeddings", tracked)
    monkeypatch.setattr(run_mod, "_build", kept)
    monkeypatch.setattr(_Rows, "moved", [])
    assert cli_main(_args(model_dir, data, tmp_path / "on", "sft", *ON, *extra)) == 0
    # Each training forward one micro-batch's rows after the one before (the held-out batches' came first).
    assert rows_sent == list(range(rows_sent[0], rows_sent[0] + 6)), rows_sent
    assert grad_rows == [False] * 6
    assert all(t.grad is None and not t.requires_grad for t in _Rows.moved)
    torch.testing.assert_close(_losses(tmp_path / "on"), _losses(tmp_path / "off"), rtol=1e-6, atol=1e-6)


def test_a_model_without_head_keeps_its_host_embedding_out_of_the_root(tiny_models, monkeypatch):
    """`shard_embedding_and_head` on a model without an output head (its early return): the host embedding is
    still among the modules the root unit leaves alone."""
    from qshard.build import skeleton
    from qshard.config import resolve
    from qshard.parallel.fsdp import shard_embedding_and_head
    from qshard.precision import precision

    model_dir = tiny_models("llama", num_hidden_layers=1)
    cfg = resolve(None, [("model.path", str(model_dir)), ("model.embedding_on_host", "true")])
    model = skeleton(cfg, model_dir, 1, torch.device("cpu")).model
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    kept = shard_embedding_and_head(model, None, cfg.parallel, precision(cfg))  # returns before using the mesh
    assert kept == [model.get_input_embeddings()]
