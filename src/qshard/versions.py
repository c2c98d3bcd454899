"""The versions of qshard and of the libraries a run's results depend on, for `qshard --version` and every
run's config.yaml. Read from the installed packages' metadata: nothing is imported (bitsandbytes' import
alone takes seconds)."""

from __future__ import annotations

import platform
from importlib import metadata

import qshard

# The libraries whose version can change a run's numbers or speed; peft and triton (compiled blocks' kernels) are
# optional.
LIBRARIES = ("torch", "transformers", "bitsandbytes", "peft", "triton")


def versions() -> dict[str, str]:
    """{qshard, python, torch, transformers, bitsandbytes, peft, triton: version, or "not installed"}."""
    found = {"qshard": qshard.__version__, "python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def version_line() -> str:
    """`qshard 0.1.0 (python 3.12.3, torch 2.13.0, ...)`: what `qshard --version` prints."""
    found = versions()
    rest = ", ".join(f"{name} {version}" for name, version in found.items() if name != "qshard")
    return f"qshard {found['qshard']} ({rest})"
