"""A Hugging Face model directory's config.json, read with errors that name the directory and what is wrong,
and the refusal of any directory that names Python code of its own for transformers to run.

A leaf: it imports no other qshard module but `errors`, so whatever must read a model's config (`build`,
broadcast loading in `loading`, `qshard expand`, a run's tokenizer check) imports it without a circle.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from qshard.errors import QShardError


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The model's config.json, with errors that name the directory and what is wrong."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise QShardError(f"model directory not found: {model_dir}")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise QShardError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise QShardError(f"{config_file}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    refuse_model_code(model_dir)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise QShardError(f"{config_file}: no 'model_type' key, so the architecture cannot be identified")
    model_type = raw["model_type"]
    # transformers' own message for an unknown type is a paragraph of upgrade advice; one line says it.
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise QShardError(
            f"{config_file}: unsupported model_type {model_type!r} (not an architecture transformers knows)"
        )
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
        # Field and shape checks (e.g. hidden_size not a multiple of the heads) wrap the reason in __cause__.
        reason = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ else exc
        raise QShardError(f"{config_file}: invalid {model_type} configuration ({reason})") from None
    if getattr(hf_config, "is_encoder_decoder", False):
        raise QShardError(
            f"{config_file}: {type(hf_config).__name__} (model_type '{model_type}') is encoder-decoder; "
            "qshard trains decoder-only LMs"
        )
    return hf_config


# The files in which a model directory can name Python modules of its own for transformers to import
# (`auto_map`: custom config, model or tokenizer classes).
CODE_NAMING_FILES = ("config.json", "tokenizer_config.json")


def refuse_model_code(model_dir: str | Path) -> None:
    """Refuse a model directory that names Python code of its own to run (`auto_map`), before anything
    of it is loaded: qshard never imports a module that came with a model."""
    for name in CODE_NAMING_FILES:
        path = Path(model_dir) / name
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # absent or unreadable: whoever loads it reports that, and no code can be named in it
        if isinstance(raw, dict) and "auto_map" in raw:
            raise QShardError(
                f"{path}: 'auto_map' names Python code shipped with the model; qshard does not run model-supplied "
                "code (if transformers implements this architecture itself, delete the 'auto_map' entry)"
            )


def read_json_object(path: Path, what: str) -> dict:
    """A JSON file that must hold one object (a generation or adapter config), with one-line errors naming
    `what` asked for it and the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QShardError(f"{what}: cannot read {path} ({exc})") from None
    if not isinstance(value, dict):
        raise QShardError(f"{path}: expected a JSON object")
    return value
