"""Unsloth on the work of benchmarks/speed.py, and its longest context on one GPU: a second anchor beside the
transformers + peft + bitsandbytes reference (benchmarks/hf_reference.py).

  python3 benchmarks/unsloth_anchor.py --out DIR [--ckpt /tmp/llama3-8b-random] [--data FILE] [--seq 2048]
                                       [--steps 8] [--warmup 3] [--longest] [--longest-start 16384]
                                       [--longest-max 524288] [--longest-budget-s 180] [--cap-gib 80] [--no-2k]
  python3 benchmarks/unsloth_anchor.py --out DIR --dry-run    # the table and JSON of canned rows, on any machine

The work is hf_reference.py's: the random-weight checkpoint `qshard make-checkpoint --shape llama3-8b` writes
(speed.py writes it too), loaded by Unsloth's FastLanguageModel in NF4 with bf16 compute, LoRA r=64 alpha 16 on
every block linear (q, k, v, o, gate, up, down), Unsloth's own gradient checkpointing ("unsloth": checkpoints
offloaded to host memory), batch 1, AdamW (fused) at a constant lr, Unsloth's defaults otherwise. Time per step
(forward, backward, optimizer step) with a CUDA sync each side; the median over the steps after --warmup; peak
GPU memory is torch.cuda.max_memory_allocated over the steps (reset after loading, as hf_reference.py does).
The batches: --data (speed.py's data.jsonl, tokenized as hf_reference.py does) or random token ids of --seq.
A full row (no padding) is passed without an attention mask, which means the same, so no system is charged for
a dense mask it would not build from a user's batch.

Every run is a process of its own (this script again, with --child): one JSON line each, and one failing
(Unsloth refusing the machine, an import error, out of memory, a timeout, a crash) becomes its row with the
error's own line rather than ending the benchmark. --longest then doubles the sequence from --longest-start
(random ids, --longest-steps steps each, under a --cap-gib memory cap as benchmarks/long_context.py sets it)
until a length fails or --longest-budget-s runs out (a step at 256k tokens takes minutes on an H200: start high
with --longest-start, or read the peak extrapolated from the two longest lengths that ran, which the report
gives). Rows go to DIR/results.json; the table is printed last.

The GPU machine has no network: the children run with the Hub, transformers, datasets and Unsloth's statistics
offline (CHILD_ENV), and Unsloth's compiled-module cache goes under DIR instead of the working directory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 2**30
# Unsloth prints to stdout too: the child's row is the line that starts with this.
ROW_MARK = "unsloth_anchor row: "
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The children's environment: off the network (each variable is read by the package named), and a GPU or an
# error (Unsloth would otherwise fall back to training the 8B model on the CPU).
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",  # huggingface_hub; also Unsloth's has_internet() and get_statistics()
    "TRANSFORMERS_OFFLINE": "1",  # transformers; Unsloth's has_internet() reads it too
    "HF_DATASETS_OFFLINE": "1",  # datasets (imported through trl)
    "UNSLOTH_DISABLE_STATISTICS": "1",  # Unsloth's per-load statistics download from the Hub
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "UNSLOTH_DISABLE_CPU_FALLBACK": "1",  # unsloth_zoo/device_type.py: raise when no accelerator is found
}


# ------------------------------------------------------------------------------------------------ one run


def _error_line(exc: BaseException) -> str:
    """The exception as one line: its type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("unsloth", "unsloth_zoo", "torch", "transformers", "peft", "trl", "bitsandbytes", "xformers",
                 "triton", "flash_attn"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def batches(args, tokenizer_path: str, vocab: int, count: int, device: str = "cuda") -> list[dict]:
    """`count` batches on `device`: --data's examples (as hf_reference.py reads them) or random ids; each with its
    real token count under "tokens", and no attention mask where it has no padding."""
    import torch

    if args.data:
        from transformers import AutoTokenizer

        from qshard.data import collate, load_examples

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        examples = load_examples(args.data, tok, args.seq)
        if len(examples) < count * args.batch:
            raise SystemExit(f"--data {args.data}: {len(examples)} examples, {count * args.batch} needed")
        rows = [collate(examples[i * args.batch:(i + 1) * args.batch], tok.pad_token_id) for i in range(count)]
    else:
        gen = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(count):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    kept = []
    for batch in rows:
        batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        batch["tokens"] = int(batch["attention_mask"].sum())
        if batch["tokens"] == batch["attention_mask"].numel():
            del batch["attention_mask"]  # full rows: the same as no mask
        kept.append({k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()})
    return kept


def child(args) -> dict:
    """One Unsloth run in this process; its row (status ok, oom or failed, with the stage that failed)."""
    row = {"system": "unsloth", "seq": args.seq, "batch": args.batch, "status": "failed", "stage": "import"}
    started = time.perf_counter()
    try:
        # Unsloth first: it patches transformers, peft and trl as they are imported (and may refuse the machine).
        import unsloth  # noqa: F401, I001
        from unsloth import FastLanguageModel
        import torch

        row["versions"] = _versions()
        row["import_s"] = round(time.perf_counter() - started, 1)
        if args.cap_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
            row["cap_gib"] = args.cap_gib
        row["stage"] = "load"
        loaded = time.perf_counter()
        model, _ = FastLanguageModel.from_pretrained(
            args.model, max_seq_length=args.seq, dtype=torch.bfloat16, load_in_4bit=True, local_files_only=True)
        row["stage"] = "lora"
        model = FastLanguageModel.get_peft_model(
            model, r=args.rank, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=TARGETS,
            use_gradient_checkpointing="unsloth", random_state=0)
        FastLanguageModel.for_training(model)
        row["load_s"] = round(time.perf_counter() - loaded, 1)
        params = [p for p in model.parameters() if p.requires_grad]
        row["trainable_params"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        row["stage"] = "data"
        data = batches(args, args.model, model.config.vocab_size, args.steps)
        row["load_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        torch.cuda.reset_peak_memory_stats()
        row["stage"] = "step"
        times, losses, tokens = [], [], []
        for batch in data:
            tokens.append(batch.pop("tokens"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(round(float(out.loss), 4))
        med = statistics.median(times[args.warmup:])
        row.update(status="ok", median_step_s=round(med, 4),
                   tokens_per_s=round(statistics.median(tokens[args.warmup:]) / med, 1),
                   step_times_s=[round(t, 4) for t in times], losses=losses)
        del row["stage"]
    except BaseException as exc:  # noqa: BLE001  (every failure is this row's answer, KeyboardInterrupt too)
        import traceback

        traceback.print_exc()
        row["status"] = "oom" if type(exc).__name__ == "OutOfMemoryError" else "failed"
        row["error"] = _error_line(exc)
        row["error_detail"] = str(exc)[:2000]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
    row["peak_host_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 2)
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


# ------------------------------------------------------------------------------------------------ the runs


def child_command(ckpt: Path, seq: int, batch: int, rank: int, steps: int, warmup: int, data: str | None,
                  cap_gib: float) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", str(ckpt), "--seq", str(seq),
           "--batch", str(batch), "--rank", str(rank), "--steps", str(steps), "--warmup", str(warmup),
           "--cap-gib", str(cap_gib)]
    return cmd + (["--data", str(data)] if data else [])


def child_env(out: Path) -> dict:
    """The environment of a child: offline, qshard's src importable, Unsloth's compile cache under `out`."""
    path = [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **CHILD_ENV, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "UNSLOTH_COMPILE_LOCATION": str(out / "unsloth_compiled_cache")}


def row_from_process(seq: int, returncode: int | None, stdout: str, log_tail: list[str], wall_s: float) -> dict:
    """A child's row: its last JSON line, or (killed, crashed, timed out) what its exit and log say."""
    lines = [line for line in (stdout or "").splitlines() if line.startswith(ROW_MARK)]
    if lines:
        row = json.loads(lines[-1][len(ROW_MARK):])
        row.setdefault("wall_s", wall_s)
        return row
    if returncode is None:
        status, error = "timeout", f"no result after {wall_s:.0f} s"
    elif returncode < 0:
        status, error = "killed", f"killed by signal {-returncode} (host memory?)"
    else:
        status, error = "failed", f"exit {returncode}"
    last = next((line.strip() for line in reversed(log_tail) if line.strip()), "")
    return {"system": "unsloth", "seq": seq, "status": status, "error": f"{error}: {last}" if last else error,
            "wall_s": wall_s}


def run_child(out: Path, ckpt: Path, seq: int, *, batch: int = 1, rank: int = 64, steps: int, warmup: int,
              data: str | None = None, cap_gib: float = 0, timeout_s: float, tag: str) -> dict:
    """One Unsloth run in a process of its own (log: out/unsloth-TAG.log); its row, printed as one JSON line."""
    out = Path(out).resolve()  # the child runs in `out`: every path it is given must not depend on the caller's
    data = str(Path(data).resolve()) if data else None
    cmd = child_command(Path(ckpt).resolve(), seq, batch, rank, steps, warmup, data, cap_gib)
    log = out / f"unsloth-{tag}.log"
    started = time.perf_counter()
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout_s,
                                  env=child_env(out), cwd=out)
            returncode, stdout = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            returncode = None
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    wall = round(time.perf_counter() - started, 1)
    with open(log, "a") as f:  # Unsloth's own stdout (banners, notices) belongs in the log too
        f.write(stdout)
    row = row_from_process(seq, returncode, stdout, log.read_text(errors="replace").splitlines()[-20:], wall)
    row["command"] = " ".join(cmd)
    row["log"] = log.name
    print(json.dumps(row), flush=True)
    return row


def longest_schedule(start: int, limit: int) -> list[int]:
    """The sequence lengths the probe tries, doubling from `start` up to `limit`."""
    seqs = []
    while start <= limit:
        seqs.append(start)
        start *= 2
    return seqs


def probe_longest(args, run) -> list[dict]:
    """Doubling lengths until one fails or the budget is spent; `run(seq, timeout_s)` gives each length's row."""
    deadline = time.monotonic() + args.longest_budget_s
    rows = []
    for seq in longest_schedule(args.longest_start, args.longest_max):
        left = deadline - time.monotonic()
        if left < args.longest_min_s:
            break
        row = run(seq, left)
        rows.append(row)
        if row["status"] != "ok":
            break
    return rows


def longest_ok(rows: list[dict]) -> int | None:
    return max((r["seq"] for r in rows if r.get("phase") == "longest" and r["status"] == "ok"), default=None)


def extrapolated_longest(rows: list[dict], cap_gib: float) -> int | None:
    """The sequence at which the probe's peak reserved GPU memory, a straight line through its two longest runs,
    reaches the cap (a long step costs minutes, so the last doubling may not fit the budget); None without two."""
    ok = sorted((r["seq"], r["peak_reserved_gib"]) for r in rows
                if r.get("phase") == "longest" and r["status"] == "ok" and r.get("peak_reserved_gib") is not None)
    if len(ok) < 2 or not cap_gib:
        return None
    (s1, m1), (s2, m2) = ok[-2:]
    slope = (m2 - m1) / (s2 - s1)
    return int(s2 + (cap_gib - m2) / slope) if slope > 0 else None


def table(rows: list[dict]) -> str:
    """The rows as a markdown table; a failed row shows its status and error line instead of numbers."""
    def num(row, key, fmt):
        return format(row[key], fmt) if row.get(key) is not None else "-"

    out = ["| run | seq | status | median step (s) | tok/s | peak allocated GiB | peak reserved GiB | host RSS GiB |"
           " load (s) | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        note = r.get("error", "") if r["status"] != "ok" else f"steps {len(r.get('step_times_s', []))}"
        out.append(f"| {r.get('phase', 'unsloth')} | {r['seq']:,} | {r['status']} | {num(r, 'median_step_s', '.3f')} | "
                   f"{num(r, 'tokens_per_s', ',.0f')} | {num(r, 'peak_alloc_gib', '.2f')} | "
                   f"{num(r, 'peak_reserved_gib', '.2f')} | {num(r, 'peak_host_rss_gib', '.1f')} | "
                   f"{num(r, 'load_s', '.1f')} | {note.replace('|', '/')} |")
    return "\n".join(out)


def report(args, rows: list[dict]) -> dict:
    result = {"args": {k: str(v) for k, v in vars(args).items() if k not in ("child",)}, "rows": rows,
              "longest_ok_seq": longest_ok(rows), "child_env": CHILD_ENV,
              "extrapolated_longest_seq": extrapolated_longest(rows, args.cap_gib)}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print()
    print(table(rows))
    if args.longest:
        print(f"longest sequence Unsloth trained: {result['longest_ok_seq']} (under {args.cap_gib:g} GiB; peak "
              f"reserved memory extrapolated linearly reaches the cap at {result['extrapolated_longest_seq']})")
    return result


DRY_ROWS = [
    {"system": "unsloth", "phase": "seq-2k", "seq": 2048, "status": "ok", "median_step_s": 0.5, "tokens_per_s": 4096.0,
     "peak_alloc_gib": 9.0, "peak_reserved_gib": 10.0, "peak_host_rss_gib": 20.0, "load_s": 30.0,
     "step_times_s": [9.0, 0.5, 0.5]},
    {"system": "unsloth", "phase": "longest", "seq": 16384, "status": "ok", "median_step_s": 4.0,
     "tokens_per_s": 4096.0, "peak_alloc_gib": 12.0, "peak_reserved_gib": 14.0, "step_times_s": [4.0]},
    {"system": "unsloth", "phase": "longest", "seq": 32768, "status": "ok", "median_step_s": 8.0,
     "tokens_per_s": 4096.0, "peak_alloc_gib": 20.0, "peak_reserved_gib": 22.0, "step_times_s": [8.0]},
    {"system": "unsloth", "phase": "longest", "seq": 65536, "status": "oom",
     "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"},
]


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/llama3-8b-random"))
    p.add_argument("--data", help="speed.py's data.jsonl (full-length examples); random token ids without it")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="steps timed, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit of the --seq run")
    p.add_argument("--no-2k", dest="short", action="store_false", help="only the --longest probe")
    p.add_argument("--longest", action="store_true", help="probe the longest sequence (doubling)")
    p.add_argument("--longest-start", type=int, default=16384)
    p.add_argument("--longest-max", type=int, default=524288)
    p.add_argument("--longest-steps", type=int, default=1)
    p.add_argument("--longest-warmup", type=int, default=0)
    p.add_argument("--longest-budget-s", type=float, default=180.0, help="all probes together")
    p.add_argument("--longest-min-s", type=float, default=30.0, help="no new probe with less time left")
    p.add_argument("--cap-gib", type=float, default=80.0, help="GPU memory cap of the probes (0: none)")
    p.add_argument("--dry-run", action="store_true", help="the report of canned rows; runs nothing")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if not args.model:
            p.error("--child needs --model")
        print(ROW_MARK + json.dumps(child(args)), flush=True)
        return None
    if not args.out:
        p.error("--out DIR is required")
    for warmup, steps, name in ((args.warmup, args.steps, ""), (args.longest_warmup, args.longest_steps, "longest-")):
        if warmup >= steps:
            p.error(f"--{name}warmup {warmup} leaves no timed step of --{name}steps {steps}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        return report(args, [dict(r) for r in DRY_ROWS])
    if not (args.ckpt / "config.json").is_file():
        p.error(f"--ckpt {args.ckpt}: no config.json (write it with `python3 -m qshard make-checkpoint --shape "
                "llama3-8b --out DIR --device cuda`, or run benchmarks/speed.py first)")
    args.ckpt = args.ckpt.resolve()
    data = str(Path(args.data).resolve()) if args.data else None
    rows = []
    if args.short:
        row = run_child(args.out, args.ckpt, args.seq, batch=args.batch, rank=args.rank, steps=args.steps,
                        warmup=args.warmup, data=data, timeout_s=args.timeout_s, tag=f"seq{args.seq}")
        rows.append({**row, "phase": f"seq-{args.seq}"})
    if args.longest:
        def run(seq, left):
            row = run_child(args.out, args.ckpt, seq, batch=args.batch, rank=args.rank, steps=args.longest_steps,
                            warmup=args.longest_warmup, cap_gib=args.cap_gib, timeout_s=left, tag=f"longest{seq}")
            return {**row, "phase": "longest"}

        rows.extend(probe_longest(args, run))
    return report(args, rows)


if __name__ == "__main__":
    main()
