"""LoRA variants: rsLoRA, LoRA+ and PiSSA/OLoRA initialization. Each trains a tiny Llama in this process, is
exported, and loads in peft on the original base with the logits qshard computes; LoRA+ and PiSSA resume exactly."""

from __future__ import annotations

import dataclasses
import json
import shutil
from importlib import resources
from pathlib import Path

import peft
import pytest
import torch
from conftest import run_on_ranks
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from qshard import export
from qshard.cli import main as cli_main
from qshard.config import Config
from qshard.errors import QShardError
from qshard.train.optim import build_optimizer, build_scheduler, lora_plus_params
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"
IDS = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    """The first 16 held-out examples: no test here asserts a held-out loss."""
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    path.write_text("".join((DEMO / "eval.jsonl").read_text().splitlines(keepends=True)[:16]))
    return path


def _config(model_dir, out, eval_data, train_type="lora", **lora) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.train_type = str(model_dir), "fp32", train_type
    cfg.data.path, cfg.data.eval_path, cfg.data.max_length = str(DEMO / "train.jsonl"), str(eval_data), 40
    cfg.train.max_steps, cfg.train.micro_batch_size, cfg.optim.lr = 4, 2, 5e-3
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    cfg.checkpoint.every_steps, cfg.checkpoint.async_save = 2, False
    cfg.train.sample_every = 0
    cfg.output.dir = str(out)
    for key, value in lora.items():
        setattr(cfg.lora, key, value)
    return cfg.validate()


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resumed_losses(cfg: Config, out, dist_env) -> list[float]:
    """The losses of steps 3-4 of `cfg`'s run, resumed from its step-2 checkpoint into a directory of its own."""
    again = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(out)),
                                checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(_checkpoint(cfg, 2))))
    train(again, dist_env)
    return _losses(out)


def _checkpoint(cfg: Config, step: int) -> Path:
    return Path(cfg.output.dir) / "checkpoints" / f"step-{step:08d}"


def _peft_on_original_base(model_dir, adapter_dir):
    """transformers' model from the base model directory itself, with the exported adapter loaded by peft."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, adapter_dir).eval()


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits.float()


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _check_merged(model, model_dir, ours, tmp_path, bound):
    """The merged export, loaded by transformers, computes what the trained model does."""
    weights = export.model_weights(model, torch.float32, merge_adapters=True)
    export.write_merged(tmp_path / "merged", weights, model_dir, is_main=True, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert _relative_error(ours, _logits(merged)) <= bound


# ---------------------------------------------------------------------------------------------------------------
# rsLoRA and LoRA+ in one run.


def test_rslora_and_lora_plus_export_to_peft_and_resume_exactly(tiny_models, tmp_path, eval_data, dist_env):
    model_dir = tiny_models("llama", num_hidden_layers=1)
    cfg = _config(model_dir, tmp_path / "run", eval_data, use_rslora=True, plus_lr_ratio=16.0)
    result = train(cfg, dist_env)
    model = result.model

    # rsLoRA: the adapter says so, and peft on the original base computes what qshard does (alpha/sqrt(r) = 4,
    # where alpha/r would be 2).
    adapter_config = json.loads((result.out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["use_rslora"] is True and adapter_config["r"] == 4
    _check_peft_and_merged(model, model_dir, result.out / "adapter", tmp_path)

    # LoRA+: every B factor, and only those, in groups of their own at 16x the lr, after a scheduler step too.
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"), plus_lr_ratio=cfg.lora.plus_lr_ratio)
    b_factors = {id(p) for n, p in model.named_parameters() if n.endswith("lora_B")}
    assert lora_plus_params(model) == b_factors and len(b_factors) == 7
    scheduler = build_scheduler(optimizer, 10, cfg.optim)
    optimizer.step()
    scheduler.step()
    lrs = [(g["lr"], {id(p) for p in g["params"]}) for g in optimizer.param_groups]
    assert len(lrs) == 2 and lrs[1][1] == b_factors and not lrs[0][1] & b_factors
    assert lrs[0][0] < cfg.optim.lr and lrs[1][0] == pytest.approx(16 * lrs[0][0])

    # Resumed from step 2 (optimizer state in its groups, schedule), steps 3-4 are the same, bit for bit.
    assert _resumed_losses(cfg, tmp_path / "resumed", dist_env) == _losses(result.out)[2:]


def test_lora_plus_groups_dora_magnitudes_with_the_b_factors_undecayed():
    """As peft's LoRA+ groups them: A at lr; B and the 1-D magnitudes at lr x ratio; matrices decayed, magnitudes
    not (qshard's rule for 1-D parameters)."""
    from qshard.adapters import DoRALinear
    from qshard.config import OptimConfig

    dora = DoRALinear(torch.nn.Linear(16, 8, bias=False).requires_grad_(False), 16, 8, 2, 4.0, 0.0)
    optimizer = build_optimizer(torch.nn.Sequential(dora), OptimConfig(lr=1e-3, weight_decay=0.1), torch.device("cpu"),
                                plus_lr_ratio=8.0)
    groups = [([p is dora.lora_A, p is dora.lora_B, p is dora.magnitude].index(True) for p in g["params"])
              for g in optimizer.param_groups]
    assert [list(g) for g in groups] == [[0], [1], [2]]
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(1e-3, 0.1), (8e-3, 0.1), (8e-3, 0.0)]


# ---------------------------------------------------------------------------------------------------------------
# PiSSA and OLoRA: the adapter starts from the base weight, which keeps the residual.


def _base_weight(adapter) -> torch.Tensor:
    """The adapter's base weight, whole, in fp32 (dequantized where it is quantized)."""
    from qshard.quant import QuantizedLinear

    if isinstance(adapter.base, QuantizedLinear):
        return adapter.base.dequantized_weight(torch.float32)
    weight = adapter.base.weight.detach()
    return (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).float()


def _check_peft_and_merged(model, model_dir: Path, adapter: Path, tmp_path: Path) -> None:
    """peft on the original base with the exported adapter, and the merged export, compute what qshard does (and
    the base without the adapter does not)."""
    ours = _logits(model)
    twin = _peft_on_original_base(model_dir, adapter)
    assert _relative_error(ours, _logits(twin)) <= 1e-5
    with twin.disable_adapter():
        assert _relative_error(ours, _logits(twin)) > 1e-3
    _check_merged(model, model_dir, ours, tmp_path, 1e-5)


def _adapters(model) -> dict[str, torch.nn.Module]:
    from qshard.adapters import LoRALinear

    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_pissa_and_olora_export_a_lora_for_the_original_base(init, tiny_models, tmp_path, eval_data, dist_env):
    model_dir = tiny_models("llama", num_hidden_layers=1)
    cfg = _config(model_dir, tmp_path / "run", eval_data, init=init)
    result = train(cfg, dist_env)
    model = result.model

    # The base holds W - scaling B0 A0 (fp32 here), and B0 A0 is PiSSA's best rank-r part of W / OLoRA's QR part.
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, adapter in _adapters(model).items():
        w = original.get_submodule(name).weight.detach()
        a0, b0 = adapter.initial
        torch.testing.assert_close(_base_weight(adapter) + adapter.scaling * (b0 @ a0), w, rtol=0, atol=1e-5)
        if init == "pissa":
            tail = float((torch.linalg.svdvals(w)[4:] ** 2).sum())  # what the best rank-4 part leaves
            assert float(torch.linalg.matrix_norm(_base_weight(adapter)) ** 2) == pytest.approx(tail, rel=1e-4)

    # peft, on the original base, loads the rank-2r LoRA of what training added and computes what qshard does.
    adapter_config = json.loads((result.out / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["init_lora_weights"]) == (8, 16.0, True)
    _check_peft_and_merged(model, model_dir, result.out / "adapter", tmp_path)

    if init == "olora":  # OLoRA's residual depends on the scaling: a resume with another alpha would change the base
        other = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, alpha=4.0))
        with pytest.raises(QShardError, match="lora.alpha=8.0, but this run has lora.alpha=4.0"):
            _resumed_losses(other, tmp_path / "other-alpha", dist_env)
    if init == "pissa":  # resumed from step 2: the same residual rebuilt, the trained A, B read back
        assert _resumed_losses(cfg, tmp_path / "resumed", dist_env) == _losses(result.out)[2:]
        # `qshard export adapter` rebuilds the model, so (A0, B0) anew: the same adapter as the run wrote. Last: the
        # command ends this process's process group.
        assert cli_main(["export", "adapter", "--run", str(result.out), "--out", str(tmp_path / "exported")]) == 0
        exported = load_file(tmp_path / "exported" / "adapter_model.safetensors")
        written = load_file(result.out / "adapter" / "adapter_model.safetensors")
        assert exported.keys() == written.keys() and all(torch.equal(exported[k], written[k]) for k in written)


def test_pissa_on_two_ranks_trains_as_on_one(tiny_models, tmp_path, eval_data, dist_env):
    """Each rank splits the whole weight and keeps its rows of the residual and of (A0, B0): the same losses and
    adapter as one process with the same global batch."""
    model_dir = tiny_models("llama", num_hidden_layers=1)
    cfg = _config(model_dir, tmp_path / "one", eval_data, init="pissa")
    one = train(cfg, dist_env).out
    args = ["train", "--model", str(model_dir), "--data", str(DEMO / "train.jsonl"), "--eval-data", str(eval_data),
            "--output-dir", str(tmp_path / "two"), "--max-length", "40", "--batch-size", "1", "--lr", "5e-3",
            "--max-steps", "4", "--train.precision", "fp32", "--train.train_type", "lora", "--lora-rank", "4",
            "--lora.alpha", "8", "--lora.init", "pissa"]
    runs = run_on_ranks({"two": args}, nprocs=2)["two"]
    assert [run.code for run in runs] == [0, 0], runs[0].stderr
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "two")), torch.tensor(_losses(one)), rtol=1e-5,
                               atol=1e-6)
    ours, theirs = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (tmp_path / "two", one))
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def principal_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny Llama with block weights as pretrained ones are, a few large singular directions over the rest
    (random ones have a flat spectrum, which leaves PiSSA nothing to take): rank 4 at scale 1 plus N(0, 0.02)."""
    source = tiny_models("llama", num_hidden_layers=1)
    dest = tmp_path_factory.mktemp("principal")
    for item in source.iterdir():
        shutil.copy2(item, dest / item.name)
    weights = load_file(dest / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            out_features, in_features = w.shape
            u, v = torch.randn(out_features, 4, generator=generator), torch.randn(4, in_features, generator=generator)
            noise = torch.randn(w.shape, generator=generator) * 0.02
            weights[name] = (u @ v / in_features**0.5 + noise).to(w.dtype)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_pissa_on_an_nf4_base_quantizes_the_residual(principal_model, tmp_path, eval_data, dist_env):
    """qshard computes on quant(W - scaling B0 A0); peft on the original W differs from it by that quantization
    error alone, which PiSSA makes smaller than quant(W)'s: the point of PiSSA on a quantized base."""
    from qshard.quant import dequantize_nf4, quantize_nf4

    cfg = _config(principal_model, tmp_path / "run", eval_data, train_type="qlora", init="pissa")
    result = train(cfg, dist_env)
    model = result.model

    original = AutoModelForCausalLM.from_pretrained(principal_model, dtype=torch.float32)
    nf4 = AutoModelForCausalLM.from_pretrained(principal_model, dtype=torch.float32)
    for name, adapter in _adapters(model).items():
        w = original.get_submodule(name).weight.detach()
        plain = dequantize_nf4(*quantize_nf4(w, cfg.quant.blocksize), torch.float32)
        nf4.get_submodule(name).weight.data.copy_(plain)
        a0, b0 = adapter.initial
        with_residual = _base_weight(adapter) + adapter.scaling * (b0 @ a0)
        assert torch.linalg.matrix_norm(with_residual - w) < 0.5 * torch.linalg.matrix_norm(plain - w), name

    # Logits: peft on the original base is within the residual's quantization error of qshard, well inside the
    # error that quantizing the original base costs (the scale of NF4's error on these logits).
    ours = _logits(model)
    twin = _peft_on_original_base(principal_model, result.out / "adapter")
    nf4_gap = _relative_error(_logits(nf4), _logits(original))
    assert _relative_error(ours, _logits(twin)) < 0.5 * nf4_gap, (_relative_error(ours, _logits(twin)), nf4_gap)


@pytest.mark.parametrize(("options", "message"), [
    (["--lora.plus_lr_ratio", "0"], "lora.plus_lr_ratio must be > 0, got 0.0"),
    (["--lora.plus_lr_ratio", "16", "--train.train_type", "full"], "lora.plus_lr_ratio: train.train_type full"),
    (["--lora.init", "pissa", "--train.train_type", "llama_pro"], "lora.init: pissa initializes adapters"),
    (["--lora.init", "pissa_niter_3"], "lora.init must be one of default, pissa, olora, pissa_niter_1, "),
    (["--lora.init", "olora", "--train.train_type", "qdora"], "lora.init: olora with train.train_type qdora"),
    (["--lora.use_rslora", "true", "--train.train_type", "full"], "lora.use_rslora: scales adapters, which"),
])
def test_variant_options_refused_in_one_line(options, message):
    from qshard.config import resolve
    from qshard.errors import QShardError

    pairs = list(zip(options[::2], options[1::2], strict=True))
    with pytest.raises(QShardError, match=message.replace(".", r"\.")) as caught:
        resolve(None, [(key.removeprefix("--"), value) for key, value in pairs])
    assert "\n" not in str(caught.value)


def test_fast_pissa_finds_the_principal_part_of_a_decaying_spectrum():
    """pissa_niter_N's randomized SVD gives, on a weight with a decaying spectrum (as pretrained ones have), the
    top-r part the full SVD gives; and the same factors at every call (a resume rebuilds the same residual)."""
    from qshard.adapters.from_base import factors_from_base

    generator = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(96, 48, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(64, 48, generator=generator))
    weight = u @ torch.diag(0.7 ** torch.arange(48.0)) @ v.T
    exact_a, exact_b = factors_from_base("pissa")(weight, 4, 2.0)
    a, b = factors_from_base("pissa_niter_4")(weight, 4, 2.0)
    exact = exact_b @ exact_a
    assert torch.linalg.matrix_norm(b @ a - exact) < 1e-2 * torch.linalg.matrix_norm(exact)
    again = factors_from_base("pissa_niter_4")(weight, 4, 2.0)
    assert torch.equal(again[0], a) and torch.equal(again[1], b)
