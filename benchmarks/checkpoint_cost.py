"""What checkpoint integrity costs: qshard's save (per-file CRC-32 checksums, recorded in trainer_state.json)
and load (metadata read as data, every file checked against its checksum) against plain DCP, on the
trainable state of the 8B-shaped QLoRA run: LoRA r=64 on the 7 linears of Llama-3-8B's 32 blocks (167.8M
fp32 parameters) and their AdamW state, ~2 GB. No model is built: the adapters are parameters of a bare
module, on the GPU when there is one (as in training, where the async save first stages them to CPU).

  python3 benchmarks/checkpoint_cost.py [--out /tmp/bench-ckpt-cost] [--params 167772160] [--repeat 3]

`--params` scales the number of blocks (a smaller run for a CPU check: --params 5e6 is one block). Every
row is the median of --repeat runs, in one table: for saves, the seconds training waits in save() and
the seconds until the checkpoint is complete (renamed); for loads, the seconds of the whole load (the
files are in the page cache, as right after a save); and reading every file once with each hash.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its import-time notice about optional CPU kernels

from qshard import checkpoint  # noqa: E402
from qshard.config import Config  # noqa: E402
from qshard.parallel.distributed import init_distributed, shutdown  # noqa: E402

RANK = 64
HIDDEN, KV, FFN, BLOCKS = 4096, 1024, 14336, 32  # Llama-3-8B
LINEARS = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
           "gate_proj": (HIDDEN, FFN), "up_proj": (HIDDEN, FFN), "down_proj": (FFN, HIDDEN)}
PER_BLOCK = sum(RANK * (fan_in + fan_out) for fan_in, fan_out in LINEARS.values())


def adapters(blocks: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """LoRA A and B of every linear of `blocks` blocks, and an AdamW that has taken one step (its moments exist)."""
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(blocks):
        block = nn.Module()
        for name, (fan_in, fan_out) in LINEARS.items():
            setattr(block, f"{name}_lora_A", nn.Parameter(torch.randn(RANK, fan_in, device=device) * 0.01))
            setattr(block, f"{name}_lora_B", nn.Parameter(torch.randn(fan_out, RANK, device=device) * 0.01))
        model.layers.append(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def qshard_save(root: Path, model, optimizer, device, blocking: bool) -> tuple[float, float]:
    """CheckpointManager's save: (seconds training waits, seconds until the checkpoint is complete)."""
    for old in root.glob("step-*"):  # as plain DCP's, deleted before the clock starts
        shutil.rmtree(old)
    cfg = Config()
    cfg.checkpoint.async_save = not blocking
    manager = checkpoint.CheckpointManager(root, cfg, is_main=True, device=device)
    _sync(device)
    started = time.perf_counter()
    manager.save(1, model, optimizer, {"step": 1}, blocking=blocking)
    waited = time.perf_counter() - started
    while manager.pending is not None and not manager.pending.future.done():
        time.sleep(0.005)
    manager.wait()
    return waited, time.perf_counter() - started


def dcp_save(root: Path, model, optimizer, device, blocking: bool, group) -> tuple[float, float]:
    """What qshard did before checksums: DCP alone, into the same layout."""
    path = root / "plain"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    _sync(device)
    started = time.perf_counter()
    state = checkpoint._app_state(model, optimizer)
    if blocking:
        dcp.save(state, checkpoint_id=str(path))
        return time.perf_counter() - started, time.perf_counter() - started
    future = dcp.async_save(state, checkpoint_id=str(path), process_group=group)
    waited = time.perf_counter() - started
    future.result()
    return waited, time.perf_counter() - started


def qshard_load(path: Path, model, optimizer, device) -> float:
    _sync(device)
    started = time.perf_counter()
    checkpoint.load(path, model, optimizer)
    _sync(device)
    return time.perf_counter() - started


def dcp_load(path: Path, model, optimizer, device) -> float:
    _sync(device)
    started = time.perf_counter()
    state = checkpoint._app_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    _sync(device)
    return time.perf_counter() - started


def hash_files(path: Path, algorithm: str) -> float:
    """Seconds to read every file of the checkpoint once and hash it."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    started = time.perf_counter()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        digest, crc = (None, 0) if algorithm == "crc32" else (hashlib.new(algorithm), 0)
        with file.open("rb") as f:
            while n := f.readinto(buf):
                if digest is None:
                    crc = zlib.crc32(view[:n], crc)
                else:
                    digest.update(view[:n])
    return time.perf_counter() - started


def one_round(root: Path, model, optimizer, device, group) -> dict[str, tuple[float, ...]]:
    """Each save, then each load of the last checkpoint saved, then each hash of its files."""
    rows = {
        "save async, checksums (qshard)": qshard_save(root, model, optimizer, device, False),
        "save async, plain DCP": dcp_save(root, model, optimizer, device, False, group),
        "save blocking, checksums (qshard)": qshard_save(root, model, optimizer, device, True),
        "save blocking, plain DCP": dcp_save(root, model, optimizer, device, True, group),
    }
    saved = checkpoint.find_latest(root)
    rows["load, verified (qshard)"] = (qshard_load(saved, model, optimizer, device),)
    rows["load, plain DCP"] = (dcp_load(saved, model, optimizer, device),)
    for algorithm in ("crc32", "sha256", "blake2b"):
        rows[f"read + {algorithm} of every file"] = (hash_files(saved, algorithm),)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bench-ckpt-cost")
    parser.add_argument("--params", type=float, default=BLOCKS * PER_BLOCK, help="trainable parameters (rounded "
                        f"to whole blocks of {PER_BLOCK:,})")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    env = init_distributed()
    try:
        blocks = max(1, round(args.params / PER_BLOCK))
        model, optimizer = adapters(blocks, env.device)
        n = sum(p.numel() for p in model.parameters())
        root = Path(args.out)
        shutil.rmtree(root, ignore_errors=True)
        group = torch.distributed.new_group(backend="gloo")

        rows: dict[str, list[tuple[float, ...]]] = {}
        for _ in range(args.repeat):
            for name, seconds in one_round(root, model, optimizer, env.device, group).items():
                rows.setdefault(name, []).append(seconds)
        saved = checkpoint.find_latest(root)
        size = sum(p.stat().st_size for p in saved.iterdir() if p.is_file())
        print(f"{n:,} trainable parameters ({blocks} blocks of LoRA r={RANK}) + AdamW on {env.device}: "
              f"a {size / 2**30:.2f} GiB checkpoint; median of {args.repeat} (seconds)")
        print(f"{'':36s} {'training waits':>15s} {'total':>15s}")
        for name, runs in rows.items():
            medians = [statistics.median(column) for column in zip(*runs)]
            cells = [f"{m:15.3f}" for m in medians] if len(medians) == 2 else [f"{'':15s}", f"{medians[0]:15.3f}"]
            print(f"{name:36s} {' '.join(cells)}")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
