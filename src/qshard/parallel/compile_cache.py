"""Where compiled code is cached, chosen before anything imports torch's compiler.

A module of its own, importing nothing heavy: importing torch's compiler stack (qshard's parallel and
training modules do) asks inductor for its cache directory, which is then fixed for the process.
"""

from __future__ import annotations

import os
from pathlib import Path


def use_persistent_caches() -> Path:
    """Keep inductor's compiled graphs and kernels where the next run finds them: TORCHINDUCTOR_CACHE_DIR when
    set, else ~/.cache/qshard/inductor (torch's default is under /tmp, which a reboot or a new node of a
    cluster starts empty). Triton keeps its own kernels under ~/.triton. Returns the directory. It must run
    before anything asks inductor for its cache directory (importing torch._dynamo does), which then keeps it."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home / "qshard" / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
