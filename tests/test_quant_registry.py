"""A quantization method is one QuantizedLinear subclass and one registry entry. A toy method written here
(int8 codes, one fp32 scale per row, symmetric), registered from this file and from nowhere else, is accepted
by the configuration, trains (losses close to LoRA over the unquantized base), is sharded by FSDP2 at world
size 2 with the storage probe passing (losses equal to world size 1's), holds fused MoE experts, and its
merged export holds exactly what its own dequantization gives."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import SRC, LogLines, free_port, spawn
from safetensors.torch import load_file

from qshard import cli
from qshard.config import QUANT_BITS, QuantConfig, resolve
from qshard.errors import QShardError
from qshard.quant import QUANT_METHODS, QuantizedExperts, QuantizedLinear, register_quant_method

NAME = "int8toy"
STEPS = 4
# Leaves the adapters off k_proj, o_proj and the MLP: their merged weights are the base as quantized.
TARGETS = "q_proj,v_proj"


class Int8Rows(QuantizedLinear):
    """The toy: each row's weights w as int8 codes round(w / s), s = max|w| / 127 kept as fp32 bits."""

    STORAGE = ("codes", "scale")
    CARRIERS = {"codes": torch.bfloat16, "scale": torch.float32}
    BITS = (8,)
    EXPERTS = True

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        storage = {"codes": (in_features, torch.int8), "scale": (1, torch.int32)}
        super().__init__(in_features, out_features, bias, storage, bias_dtype=bias_dtype, device=device)

    @classmethod
    def can_quantize(cls, in_features: int, quant: QuantConfig) -> bool:
        return in_features % 2 == 0  # a row of codes is carried in bf16 elements

    @classmethod
    def from_config(cls, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                    bias_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> Int8Rows:
        return cls(in_features, out_features, bias, bias_dtype=bias_dtype, device=device)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(2.0**-100) / 127
        codes = (w / scale).round().clamp(-127, 127).to(torch.int8)
        return {"codes": codes, "scale": scale.view(torch.int32)}

    def dequantize(self, storage: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        codes, scale = storage
        return (codes.view(torch.int8).float() * scale.view(torch.int32).view(torch.float32)).to(dtype)


def _register(name: str = NAME) -> None:
    register_quant_method(name, Int8Rows)


def _unregister(name: str = NAME) -> None:
    del QUANT_METHODS[name], QUANT_BITS[name]


def _options(out, model_dir, data, nproc: int, train_type: str = "qlora") -> list[tuple[str, str]]:
    """Global batch 4 (micro-batches of 1 x grad_accum x nproc) whatever the world size; fp32, so that the
    world sizes can be compared closely."""
    quant = [("quant.method", NAME), ("quant.bits", "8")] if train_type == "qlora" else []
    return [("model.path", str(model_dir)), ("data.path", str(data)), ("data.eval_fraction", "0"),
            ("output.dir", str(out)), ("train.train_type", train_type), *quant,
            ("lora.target_modules", TARGETS), ("train.grad_accum", str(4 // nproc)),
            ("train.micro_batch_size", "1"), ("train.max_steps", str(STEPS)), ("optim.lr", "1e-2"),
            ("optim.warmup_steps", "0"), ("train.precision", "fp32"), ("data.max_length", "32")]


def _flags(options: list[tuple[str, str]]) -> list[str]:
    return [arg for name, value in options for arg in (f"--{name}", value)]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]



def _worker(rank: int, port: int, model_dir: str, data: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from torch.distributed.tensor import DTensor

    from qshard.parallel.distributed import init_distributed, shutdown
    from qshard.train.run import train

    _register()  # every process of a run registers the method before its config is read
    lines = LogLines()
    logging.getLogger("qshard").addHandler(lines)
    logging.getLogger("qshard").setLevel(logging.INFO)
    env = init_distributed()
    model = train(resolve(None, _options(out, model_dir, data, 2)), env).model
    layers = [m for m in model.modules() if isinstance(m, Int8Rows)]
    codes = layers[0].codes
    torch.save({"layers": len(layers), "lines": lines.lines, "sharded": isinstance(codes, DTensor),
                "local_rows": codes.to_local().shape[0], "rows": codes.shape[0],
                "dtypes": [getattr(layers[0], n).dtype for n in Int8Rows.STORAGE]}, f"{out}/rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def toy():
    _register()
    yield NAME
    _unregister()


@pytest.fixture(scope="module")
def runs(toy, tiny_models, tmp_path_factory):
    """LoRA over the unquantized base and the toy's QLoRA at world size 1 (`qshard train` in this process),
    and the toy's at world size 2 (two spawned gloo ranks)."""
    root = tmp_path_factory.mktemp("toy")
    data = root / "train.jsonl"
    records = [{"instruction": f"Reverse {w}", "output": w[::-1]} for w in ("abc", "lemon", "qshard", "fsdp") * 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    model_dir = tiny_models("llama")
    for name, train_type in (("lora", "lora"), ("ws1", "qlora")):
        assert cli.main(["train", *_flags(_options(root / name, model_dir, data, 1, train_type))]) == 0
    spawn(_worker, (free_port(), str(model_dir), str(data), str(root / "ws2")))
    ranks = [torch.load(root / "ws2" / f"rank{r}.pt") for r in range(2)]
    return root, model_dir, ranks


def test_config_takes_its_methods_from_the_registry():
    """A registered name is a valid quant.method at its own bits; the built-in methods' errors point to it."""
    name = "int8rows"
    with pytest.raises(QShardError, match=f"quant.method must be one of nf4, hqq, got '{name}'"):
        resolve(None, [("quant.method", name), ("quant.bits", "4")])
    _register(name)
    try:
        assert resolve(None, [("quant.method", name), ("quant.bits", "8")]).quant.method == name
        with pytest.raises(QShardError, match=f"quant.bits: nf4 is a 4-bit format, got 8; for 8 bits use quant.method "
                                              f"{name}$"):
            resolve(None, [("quant.bits", "8")])
        with pytest.raises(QShardError, match=f"quant.bits: {name} is a 8-bit format, got 4; for 4 bits use quant"):
            resolve(None, [("quant.method", name)])
        with pytest.raises(QShardError, match=f"{name} quantizes the frozen base, which train.train_type lora keeps"):
            resolve(None, [("quant.method", name), ("quant.bits", "8"), ("train.train_type", "lora")])
        with pytest.raises(ValueError, match=f"quant.method {name} is taken by Int8Rows"):
            _register(name)
    finally:
        _unregister(name)
    # The configuration is checked before torch is imported: the method table needs none.
    check = "import sys, qshard.config; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", check], check=True, env={**os.environ, "PYTHONPATH": SRC})


def test_toy_method_trains_close_to_lora_over_the_unquantized_base(runs):
    root, _, _ = runs
    lora, toy = _losses(root / "lora"), _losses(root / "ws1")
    assert len(toy) == len(lora) == STEPS and toy[-1] < toy[0]
    assert toy != lora  # the base is quantized ...
    torch.testing.assert_close(torch.tensor(toy), torch.tensor(lora), rtol=2e-2, atol=0)  # ... to 8 bits


def test_toy_method_is_sharded_by_fsdp2_with_the_probe_passing(runs):
    root, _, ranks = runs
    for res in ranks:
        assert res["layers"] == 14 and res["sharded"] and res["local_rows"] * 2 == res["rows"]
        (probe,) = [line for line in res["lines"] if "byte for byte" in line]
        kinds = "/".join(str(d).removeprefix("torch.") for d in res["dtypes"])
        assert probe.startswith(f"FSDP2 gathers the {NAME.upper()} storage (as {kinds}) byte for byte: checked on "
                                "cpu, 2 rank(s)"), probe
    torch.testing.assert_close(torch.tensor(_losses(root / "ws2")), torch.tensor(_losses(root / "ws1")),
                               rtol=1e-5, atol=1e-5)


def test_merged_export_holds_the_toy_dequantized_base(runs):
    """`qshard export merged` of the world-size-2 run: each linear without an adapter is what the toy's
    dequantize gives for the checkpoint's weight, which is within half a code step of it."""
    from qshard.loading import Checkpoint

    root, model_dir, _ = runs
    assert cli.main(["export", "merged", "--run", str(root / "ws2"), "--out", str(root / "merged")]) == 0
    merged = {k: v for f in (root / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    base = Checkpoint(model_dir)
    compared = 0
    for name, tensor in merged.items():
        if not name.startswith("model.layers.") or not name.endswith("_proj.weight"):
            continue
        weight = base.read(name).float()
        if name.split(".")[-2] in TARGETS.split(","):
            assert not torch.equal(tensor, weight.to(tensor.dtype))  # the adapter is merged in
            continue
        layer = Int8Rows(weight.shape[1], weight.shape[0], bias=False)
        storage = layer.quantize(weight)
        assert torch.equal(tensor, layer.dequantize(tuple(storage.values()), tensor.dtype)), name
        step = storage["scale"].view(torch.float32)
        assert ((tensor.float() - weight).abs() <= step / 2 + weight.abs() * 2.0**-8).all(), name
        compared += 1
    assert compared == 10  # k_proj, o_proj, gate_proj, up_proj and down_proj of both blocks


def test_experts_are_quantized_by_any_method_that_holds_them(toy, tiny_models, dist_env):
    from qshard.build import build_model
    from qshard.loading import Checkpoint

    model_dir = tiny_models("mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=128)
    cfg = resolve(None, [("model.path", str(model_dir)), ("quant.method", toy), ("quant.bits", "8")])
    model, report = build_model(cfg, dist_env, model_dir)
    layer = model.model.layers[0].mlp.experts
    assert isinstance(layer, QuantizedExperts) and isinstance(layer.down_proj, Int8Rows)
    stored = Checkpoint(model_dir).read("model.layers.0.mlp.experts.down_proj")
    weight = layer.down_proj.dequantized_weight(torch.float32).view(stored.shape)
    for e in range(stored.shape[0]):  # each expert's rows exactly as that expert quantized on its own
        alone = layer.down_proj.quantize(stored[e])
        assert torch.equal(weight[e], layer.down_proj.dequantize(tuple(alone.values()), torch.float32))
