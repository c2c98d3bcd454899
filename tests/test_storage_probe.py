"""The 4-bit storage under FSDP2, byte for byte, on whatever torch is installed: where its FSDP2 holds integer
parameters the codes and scales are sharded as the uint8/int32 tensors they are; where float carriers are used
instead (an FSDP2 that refuses integers), a build-time probe gathers NaN-looking patterns once and refuses to
train if any byte comes back changed. One pair of gloo ranks runs every world-size-2 case."""

from __future__ import annotations

import json
import logging
import os
from importlib import resources

import pytest
import torch
from conftest import LogLines, free_port, spawn

STEPS = 2
OFFLOADED_GRAD_OP = [("quant.method", "hqq"), ("parallel.cpu_offload", "true"), ("parallel.sharding", "grad_op")]
FP32_SCALES = ("quant.double_quant", "false")  # NF4 with its block scales as bitsandbytes keeps them
RUNS = {
    # name: (storage held as integers, config overrides)
    "nf4-int": (True, [FP32_SCALES]),
    "nf4-carriers": (False, [FP32_SCALES]),
    # Hybrid sharding: 2 replicas of 1 rank (FSDP2's 2-D mesh; the storage gathered over a shard group of 1).
    "nf4-int-hybrid": (True, [FP32_SCALES, ("parallel.sharding", "hybrid"), ("parallel.replicate_degree", "2")]),
    # HQQ under FSDP2's CPU offload and grad_op sharding (no reshard after forward); the integer storage in
    # compiled blocks too (the carriers compiled are another graph to compile: ~9 s more).
    "hqq-int-compiled-offload-grad_op": (True, [
        *OFFLOADED_GRAD_OP, ("parallel.compile", "true"), ("parallel.compile_backend", "aot_eager")]),
    "hqq-carriers-offload-grad_op": (False, OFFLOADED_GRAD_OP),
    # NF4 with double-quantized scales: three storage tensors (codes, absmax codes, row absmax).
    "nf4dq-int": (True, [("quant.double_quant", "true")]),
    "nf4dq-carriers": (False, [("quant.double_quant", "true")]),
}
PAIRS = (("nf4-int", "nf4-carriers"), ("nf4-int-hybrid", "nf4-carriers"),
         ("hqq-int-compiled-offload-grad_op", "hqq-carriers-offload-grad_op"), ("nf4dq-int", "nf4dq-carriers"))
# Each storage tensor's probe bytes: 17 rows of 32.
PROBE_BYTES = 544
PROBE = "byte for byte"  # in the log line the passed probe writes



def _options(model_dir: str, out: str, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [("model.path", model_dir), ("data.path", str(resources.files("qshard") / "demo_data" / "train.jsonl")),
            ("data.eval_fraction", "0"), ("train.eval_every", "0"), ("data.max_length", "32"),
            ("train.micro_batch_size", "2"), ("train.max_steps", str(STEPS)), ("optim.lr", "1e-2"),
            ("optim.warmup_steps", "0"), ("parallel.quant_sharding", "fsdp"), ("output.dir", out), *extra]


def _canonicalizing_copy_in():
    """A copy path that goes through fp32 arithmetic, as a torch release might: every bf16 NaN it copies
    becomes the canonical NaN (bitsandbytes #1945). Patched into FSDP2's all-gather inputs; returns the undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_param_all_gather_inputs

    def canonicalizing(fsdp_params):
        return [[t.float().to(t.dtype) if t.is_floating_point() else t for t in ts] for ts in original(fsdp_params)]

    collectives._get_param_all_gather_inputs = canonicalizing
    return lambda: setattr(collectives, "_get_param_all_gather_inputs", original)


def _torch_takes_integers(mesh) -> bool:
    """The test's own answer to the question qshard asks once per process: does this torch's fully_shard take
    a frozen integer parameter?"""
    from torch.distributed.fsdp import fully_shard

    module = torch.nn.Module()
    module.codes = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.uint8), requires_grad=False)
    try:
        fully_shard(module, mesh=mesh)
    except RuntimeError:
        return False
    return True


def _gathered_storage(model) -> dict[str, torch.Tensor]:
    """Block 0's q_proj storage, all-gathered by its FSDP2 unit."""
    block = model.model.layers[0]
    layer = block.self_attn.q_proj.base
    block.unshard()
    gathered = {name: getattr(layer, name).detach().clone() for name in layer.STORAGE}
    block.reshard()
    return gathered


def _build_error(cfg, env, model_dir: str) -> str | None:
    from qshard.build import build_model
    from qshard.errors import QShardError

    try:
        build_model(cfg, env, model_dir)
    except QShardError as exc:
        return str(exc)
    return None


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qshard import config as config_mod
    from qshard.parallel import fsdp
    from qshard.parallel.distributed import init_distributed, shutdown
    from qshard.train.run import train

    lines = LogLines()
    logging.getLogger("qshard").addHandler(lines)
    logging.getLogger("qshard").setLevel(logging.INFO)
    env = init_distributed()
    takes_integers = _torch_takes_integers(env.mesh)
    detected = getattr(fsdp, "fsdp_holds_integers", lambda mesh: None)(env.mesh)
    results = {"takes_integers": takes_integers, "detected": detected}

    def use_carriers(yes: bool) -> None:
        # The internal switch: this torch's answer, or float carriers as on a torch whose FSDP2 refuses integers.
        fsdp.fsdp_holds_integers = (lambda mesh: False) if yes else (lambda mesh: detected)

    for name, (integers, extra) in RUNS.items():
        use_carriers(not integers)
        del lines.lines[:]
        result = train(config_mod.resolve(None, _options(model_dir, f"{out}/{name}", extra)), env)
        results[name] = {"gathered": _gathered_storage(result.model),
                         "probe": [line for line in lines.lines if PROBE in line]}
        del result

    # Broken copy paths, each refused at build time (before any weight is read).
    cfg = config_mod.resolve(None, _options(model_dir, f"{out}/broken", [FP32_SCALES]))
    use_carriers(True)
    unit_policy = getattr(fsdp, "storage_unit_policy", None)
    fsdp.storage_unit_policy = lambda mp: MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # a unit that casts
    results["casting"] = _build_error(cfg, env, model_dir)
    fsdp.storage_unit_policy = unit_policy
    undo = _canonicalizing_copy_in()
    results["canonicalizing"] = _build_error(cfg, env, model_dir)
    use_carriers(False)  # integers are copied as they are: nothing to canonicalize
    results["canonicalizing-int"] = _build_error(cfg, env, model_dir)
    undo()
    torch.save(results, f"{out}/rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("storage")
    spawn(_worker, (free_port(), str(tiny_models("llama")), str(out)))
    return out, [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _quantized(model_dir, method: str) -> dict[str, torch.Tensor]:
    """Block 0's q_proj weight quantized whole, in this one process."""
    from qshard.loading import Checkpoint
    from qshard.quant import quantize_hqq, quantize_nf4
    from qshard.quant.nf4 import compress_absmax

    weight = Checkpoint(model_dir).read("model.layers.0.self_attn.q_proj.weight")
    if method == "hqq":
        packed, scale_zero = quantize_hqq(weight, 4, 64)
        return {"packed": packed, "scale_zero": scale_zero}
    packed, absmax = quantize_nf4(weight, 64)
    if method == "nf4dq":
        codes, row_absmax = compress_absmax(absmax, -(-absmax.shape[1] // 2) * 2)
        return {"packed": packed, "absmax_codes": codes, "row_absmax": row_absmax}
    return {"packed": packed, "absmax": absmax}


def test_integer_storage_is_gathered_as_the_single_process_quantization(ranks, tiny_models):
    """Where FSDP2 holds integers (torch 2.13 does), a block's unit shards and gathers the uint8 codes and int32
    scales themselves, beside its fp32 adapters, also with compiled blocks, CPU offload, grad_op and hybrid
    sharding."""
    _, results = ranks
    assert [res["detected"] for res in results] == [res["takes_integers"] for res in results]
    if not results[0]["takes_integers"]:
        pytest.skip(f"torch {torch.__version__}'s FSDP2 refuses integer parameters: the carriers are used")
    for name in [name for name, (integers, _) in RUNS.items() if integers]:
        want = _quantized(tiny_models("llama"), name.split("-")[0])
        for res in results:
            got = res[name]["gathered"]
            assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in want.items()}, name
            for part, tensor in want.items():
                assert torch.equal(got[part], tensor), (name, part)


def test_integer_storage_trains_exactly_as_the_carriers(ranks, tiny_models):
    """Same bytes, same numbers: the integer storage's losses equal the float carriers' step for step, and the
    carriers too come back as the single-process quantization's bytes."""
    out, results = ranks
    for integers, carriers in PAIRS:
        if results[0]["takes_integers"]:  # else both hold carriers: nothing to compare
            assert {t.dtype for t in results[0][integers]["gathered"].values()} == {torch.uint8, torch.int32}
        losses = _losses(out / integers)
        assert len(losses) == STEPS and all(loss == loss for loss in losses)  # finite, not NaN
        if integers in ("nf4-int", "nf4dq-int"):  # the same eager computation on the same bytes
            assert _losses(out / carriers) == losses
        else:  # gradients all-reduced, not reduce-scattered; compiled (aot_eager) against eager: equal bits
            # here, an ulp or so allowed
            torch.testing.assert_close(_losses(out / carriers), losses, rtol=1e-6, atol=0)
        want = _quantized(tiny_models("llama"), integers.split("-")[0])
        for res in results:
            got = res[carriers]["gathered"]
            assert {t.dtype for t in got.values()} == {torch.bfloat16, torch.float32}
            for part, tensor in want.items():
                assert torch.equal(got[part].view(tensor.dtype), tensor), (carriers, part)


def test_probe_passes_on_the_real_path_and_says_so(ranks):
    """Every build whose blocks FSDP2 units hold runs the probe once and logs one line saying it passed."""
    _, results = ranks
    for res in results:
        for name, (integers, _) in RUNS.items():
            (line,) = res[name]["probe"]
            kinds = "uint8/int32" if integers and res["takes_integers"] else "bfloat16/float32"
            tensors = 2
            if name.startswith("nf4dq"):  # codes and absmax codes of one dtype, the row absmax
                kinds, tensors = kinds.replace("/", "/" + kinds.split("/")[0] + "/"), 3
            method = name.split("-")[0].upper().removesuffix("DQ")
            assert line.startswith(f"FSDP2 gathers the {method} storage (as {kinds}) byte for byte: checked on cpu, "
                                   f"2 rank(s), {tensors * PROBE_BYTES} bytes"), line


def test_a_copy_path_that_changes_bytes_is_refused_at_build(ranks):
    """A unit that casts (fp32 scale carriers rounded to bf16), and a copy through fp32 arithmetic (every
    NaN-looking code pair canonicalized, as in bitsandbytes #1945): each build stops with one line naming the
    way out; integer storage goes through the canonicalizing copy unchanged."""
    _, results = ranks
    version = torch.__version__
    for res in results:
        assert res["casting"] == (f"FSDP2 in torch {version} changes the bytes of the 4-bit storage it gathers "
                                  "(544 of 1088 bytes differ); set parallel.quant_sharding: dtensor")
        message = res["canonicalizing"]
        assert message is not None and "\n" not in message
        assert message.startswith(f"FSDP2 in torch {version} changes the bytes of the 4-bit storage it gathers (")
        assert message.endswith(" of 1088 bytes differ); set parallel.quant_sharding: dtensor")
        if res["takes_integers"]:
            assert res["canonicalizing-int"] is None


def test_probe_patterns_cover_every_nan_looking_code_pair():
    """The probe's code bytes hold every bf16 NaN bit pattern (both signs, quiet and signalling), its scales the
    fp32 NaNs, infinities and denormals, and the rows split unevenly over 2, 4 and 8 ranks."""
    from qshard.parallel.fsdp import _PROBE_ROWS, _probe_bytes

    codes = _probe_bytes(torch.bfloat16, torch.device("cpu")).view(torch.int16).reshape(-1).int() & 0xFFFF
    nans = {*range(0x7F81, 0x8000), *range(0xFF81, 0x10000)}
    assert nans <= set(codes.tolist())
    assert torch.isnan(_probe_bytes(torch.uint8, torch.device("cpu")).view(torch.bfloat16)).sum() >= len(nans)
    scales = _probe_bytes(torch.float32, torch.device("cpu")).view(torch.float32)
    assert torch.isnan(scales).any() and torch.isinf(scales).any() and (scales.abs() < 1.2e-38).any()
    assert all(_PROBE_ROWS % ranks for ranks in (2, 4, 8))
