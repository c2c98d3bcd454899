"""parallel.compile: auto, decided once per run for its device, and the persistent caches of compiled code."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from qshard.config import Config, from_dict
from qshard.errors import QShardError
from qshard.parallel import compile as compile_mod
from qshard.parallel.compile import compile_choice, decide_compile
from qshard.parallel.compile_cache import use_persistent_caches

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _parallel(**options):
    cfg = from_dict({"parallel": options})
    cfg.validate()
    return cfg.parallel


@pytest.fixture
def triton(monkeypatch):
    """Whether Triton is found, as the test says (this machine's torch may have it or not)."""
    real = importlib.util.find_spec

    def set_present(present: bool):
        monkeypatch.setattr(compile_mod.importlib.util, "find_spec",
                            lambda name, *a: (real("torch") if present else None) if name == "triton"
                            else real(name, *a))
    return set_present


def test_auto_is_the_default_and_compiles_on_cuda_with_triton(triton):
    assert Config().parallel.compile == "auto"
    triton(True)
    assert compile_choice(_parallel(), CUDA) == (True, "parallel.compile auto: on (CUDA, Triton)")
    assert compile_choice(_parallel(), CPU) == (False, "parallel.compile auto: off on cpu")
    triton(False)
    assert compile_choice(_parallel(), CUDA) == (False, "parallel.compile auto: off, Triton is not installed")
    # backends that generate no kernels need no Triton
    assert compile_choice(_parallel(compile_backend="aot_eager"), CUDA)[0] is True


def test_auto_stays_off_where_compile_would_not_pay_and_explicit_values_win(triton):
    triton(True)
    # reentrant checkpointing would be traced into the graph, which would then keep the activations
    assert compile_choice(_parallel(ac_reentrant=True), CUDA) == (
        False, "parallel.compile auto: off with parallel.ac_reentrant true")
    # tiled MLPs compile tile by tile (parallel/tiling.py), so they leave compile on
    assert compile_choice(_parallel(mlp_tile_tokens=1024), CUDA) == (True, "parallel.compile auto: on (CUDA, Triton)")
    assert compile_choice(_parallel(compile=True, mlp_tile_tokens=1024), CUDA)[0] is True
    assert compile_choice(_parallel(compile=True), CPU) == (True, "parallel.compile true")
    assert compile_choice(_parallel(compile=False), CUDA) == (False, "parallel.compile false")
    with pytest.raises(QShardError, match="parallel.ac_reentrant: with parallel.compile"):
        _parallel(compile=True, ac_reentrant=True)
    with pytest.raises(QShardError, match="parallel.compile must be one of auto, true, false, got 'yes'"):
        from_dict({"parallel": {"compile": "yes"}})


def test_decided_config_is_a_copy_and_inductor_runs_use_the_persistent_cache(triton, monkeypatch, tmp_path):
    triton(True)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = from_dict({})
    decided = decide_compile(cfg, CUDA, log_it=False)
    assert decided.parallel.compile is True and cfg.parallel.compile == "auto"  # config.yaml keeps auto
    assert str(tmp_path / "xdg" / "qshard" / "inductor") == __import__("os").environ["TORCHINDUCTOR_CACHE_DIR"]
    assert decide_compile(cfg, CPU, log_it=False).parallel.compile is False
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_caches() == tmp_path / "mine"  # the user's choice is kept


def test_the_traced_checkpoint_notice_is_dropped_and_other_warnings_kept():
    import logging

    compile_mod.quiet_traced_checkpoint_notice()
    compile_mod.quiet_traced_checkpoint_notice()  # once is enough; twice adds no second filter
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    assert len(logger.filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\n")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else"]


def test_qshard_train_chooses_the_cache_before_anything_fixes_it(tmp_path):
    """Importing torch's compiler stack fixes inductor's cache directory for the process (torch's default under
    /tmp): `qshard train` must set its own first. A fresh process, as users start it."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), OMP_NUM_THREADS="1")
    script = ("import os; from qshard import cli; "
              f"code = cli.main(['train', '--model.shape', 'llama-tiny', '--output-dir', {str(tmp_path / 'run')!r}, "
              "'--dry-run']); print(code, os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    chosen = str(tmp_path / "xdg" / "qshard" / "inductor")
    assert out.stdout.splitlines()[-1].split() == ["0", chosen], out.stderr[-2000:]


def test_auto_read_from_yaml_is_decided_like_the_default(tmp_path, triton):
    """A config.yaml saying `compile: auto` (every resumed run's) holds a str that is not the literal's object."""
    from qshard.config import resolve

    triton(True)
    (tmp_path / "run.yaml").write_text("parallel:\n  compile: auto\n")
    parallel = resolve(str(tmp_path / "run.yaml"), []).parallel
    assert compile_choice(parallel, CPU) == (False, "parallel.compile auto: off on cpu")
    assert compile_choice(parallel, CUDA) == (True, "parallel.compile auto: on (CUDA, Triton)")
