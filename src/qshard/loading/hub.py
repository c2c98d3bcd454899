"""Models named by a Hugging Face Hub id (`org/name`, `org/name@revision`): resolved to a snapshot directory in
the standard Hub cache, downloading only the files a run reads.

`model.path` is a Hub id only when it is not an existing local path and has the Hub's `namespace/name` form.
What is fetched: config.json, generation_config.json, the tokenizer and chat template files, and the weights
in one format (safetensors when the repository has them, else PyTorch .bin), by their index when sharded.
HF_HOME / HF_HUB_CACHE choose the cache and HF_HUB_OFFLINE=1 reads only the cache. With no network the
cache is used too, as huggingface_hub does. On several processes only local rank 0 of each node downloads;
the other ranks of its node wait and then read the same snapshot from the cache (`resolve_on_nodes`).

A snapshot directory is `<cache>/models--org--name/snapshots/<commit>`, so its name is the commit resolved.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from qshard.errors import QShardError
from qshard.loading.model_dir import BIN_FILE, BIN_INDEX_FILE, INDEX_FILE, SINGLE_FILE

log = logging.getLogger("qshard")

# Weight layouts in the order a model directory's `Checkpoint` prefers them (an index before a single file),
# safetensors before .bin: only the first one a repository has is downloaded.
WEIGHT_LAYOUTS = (INDEX_FILE, SINGLE_FILE, BIN_INDEX_FILE, BIN_FILE)
# Everything else a run reads from a model directory (top level only: subfolders hold other formats).
DESCRIPTION_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "additional_chat_templates/*",
)
# Weight files of other formats (or elsewhere than the top level), named when a repository has nothing else.
OTHER_WEIGHT_SUFFIXES = {".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".safetensors", ".bin"}


@dataclass(frozen=True)
class HubModel:
    """A Hub repository and the revision asked for (a branch, tag or commit; None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def hub_model(path: str | None, revision: str | None, option: str = "model.path") -> HubModel | None:
    """`model.path` (and `model.revision`) as a Hub model, or None for a local directory (or no path, or one
    that is neither: loading it then says the directory is missing). Conflicting revisions are refused."""
    if path is None or Path(path).exists():
        if revision is not None:
            where = f"{option} {path} is a local directory" if path else f"{option} names no Hub id"
            raise QShardError(f"model.revision {revision}: {where}; only a Hub id (org/name) has revisions")
        return None
    repo_id, at, asked = path.partition("@")
    if not is_repo_id(repo_id):
        return None
    if at and not asked:
        raise QShardError(f"{option} {path}: no revision after '@' (org/name@branch, tag or commit)")
    if asked and revision is not None and asked != revision:
        raise QShardError(f"model.path {path} asks for revision {asked} and model.revision for {revision}; "
                          "give the revision once")
    return HubModel(repo_id, asked or revision)


def is_repo_id(text: str) -> bool:
    """Whether `text` has the form of a Hub model id, `namespace/name` (the Hub's own rules for each part)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# The environment huggingface_hub reads, read when called: a launcher, a notebook or a test may set it after
# transformers imported huggingface_hub (which reads its constants once, at import).


def cache_dir() -> Path:
    """The Hub cache: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    from huggingface_hub import constants

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    values = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any((v or "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in values)


# ---------------------------------------------------------------------------------------------------------------
# One process.


def resolve(model: HubModel, local_only: bool = False, weights: bool = True) -> Path:
    """The snapshot directory of `model` in the cache, after downloading what it lacks of the files a run reads
    (from the cache alone when offline, `local_only`, or the Hub cannot be reached). Its name is the commit.
    Without `weights` (a dry run), only the files that describe the model: config, tokenizer, templates."""
    from huggingface_hub import snapshot_download

    cache, no_network = cache_dir(), local_only or offline()
    try:
        # The small files first: this fails as the Hub answers (gated, missing, no such revision), or falls back
        # to the cache when the Hub cannot be reached, and fixes the commit the weights are then read at.
        snapshot = Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=cache,
                                          local_files_only=no_network, allow_patterns=_patterns(DESCRIPTION_FILES),
                                          endpoint=os.environ.get("HF_ENDPOINT") or None))
        if weights and not no_network and not has_weights(snapshot):
            _download_weights(model, snapshot, cache)
    except QShardError:
        raise
    except Exception as exc:
        mapped = _hub_error(exc, model, cache, no_network)
        if mapped is None:
            raise
        raise mapped from None
    if weights and not any((snapshot / name).is_file() for name in WEIGHT_LAYOUTS):
        raise QShardError(f"model.path {model}: the cached snapshot {snapshot} holds no weights ({SINGLE_FILE}, "
                          f"{INDEX_FILE} or their .bin forms) and the Hub {_unreachable(no_network)}")
    return snapshot


def _download_weights(model: HubModel, snapshot: Path, cache: Path) -> None:
    """The weights of the first layout in WEIGHT_LAYOUTS the repository has at the snapshot's commit: the one
    file, or the index and the shards it names. A repository listing that fails leaves what is cached."""
    from huggingface_hub import HfApi, snapshot_download

    commit, endpoint = snapshot.name, os.environ.get("HF_ENDPOINT") or None
    try:
        files = set(HfApi(endpoint=endpoint).list_repo_files(model.repo_id, revision=commit))
    except Exception as exc:  # the Hub answered a moment ago: treat any failure now as the network's
        log.warning("model.path %s: cannot list the repository (%s); using the cached files", model, _first_line(exc))
        return
    layout = next((name for name in WEIGHT_LAYOUTS if name in files), None)
    if layout is None:
        others = sorted({Path(f).suffix for f in files} & OTHER_WEIGHT_SUFFIXES)
        raise QShardError(f"model.path {model}: the repository has no weights qshard reads ({SINGLE_FILE}, "
                          f"{INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE} at its top level; it has "
                          f"{', '.join(others) or 'no weight files'})")
    wanted = [layout]
    if layout.endswith(".index.json"):
        wanted += _index_shards(snapshot / layout)
    snapshot_download(model.repo_id, revision=commit, cache_dir=cache, allow_patterns=_patterns(wanted),
                      endpoint=endpoint)


def has_weights(snapshot: Path) -> bool:
    """Whether the snapshot holds the weights of some layout whole: a commit's files never change, so the Hub
    need not be asked for them again."""
    layout = next((name for name in WEIGHT_LAYOUTS if (snapshot / name).is_file()), None)
    if layout is None or not layout.endswith(".index.json"):
        return layout is not None
    return all((snapshot / shard).is_file() for shard in _index_shards(snapshot / layout))


def _index_shards(index: Path) -> list[str]:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise QShardError(f"{index}: not a valid checkpoint index ({exc})") from None


def _patterns(names) -> list[str]:
    """File names as huggingface_hub's patterns (fnmatch): literal but for a trailing `/*`."""
    return [glob.escape(n[:-2]) + "/*" if n.endswith("/*") else glob.escape(n) for n in names]


def _hub_error(exc: Exception, model: HubModel, cache: Path, no_network: bool) -> QShardError | None:
    """One line for each way the Hub or the cache can fail a resolution; None for anything else."""
    from huggingface_hub import errors

    name = f"model.path {model}"
    if isinstance(exc, errors.GatedRepoError):
        return QShardError(f"{name}: a gated repository; accept its license on https://huggingface.co/"
                           f"{model.repo_id} with your account, then log in (`hf auth login`) or set HF_TOKEN")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return QShardError(f"{name}: no such local directory, and no Hub repository {model.repo_id} (if it is "
                           "private, log in with `hf auth login` or set HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return QShardError(f"{name}: {model.repo_id} has no revision {model.revision} (give a branch, tag or commit)")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        revision = model.revision or "main"
        return QShardError(f"{name}: no such local directory, and no cached copy of {model.repo_id} at {revision} "
                           f"in {cache} (HF_HUB_CACHE / HF_HOME choose it), and the Hub "
                           f"{_unreachable(no_network, exc.__cause__)}")
    if isinstance(exc, errors.HfHubHTTPError):
        return QShardError(f"{name}: the Hub refused it ({_first_line(exc)})")
    return None


def _unreachable(no_network: bool, cause: BaseException | None = None) -> str:
    if offline():
        return "is not asked (HF_HUB_OFFLINE is set; unset it to download)"
    if no_network:  # a rank other than its node's local rank 0, which resolved it a moment ago
        return "is asked only by local rank 0 of each node (do the ranks of a node share one Hub cache?)"
    return "did not provide it" + (f" ({_first_line(cause)})" if cause is not None else "")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------------------------
# Several processes.


def resolve_on_nodes(model: HubModel, local_rank: int, weights: bool = True) -> Path:
    """`resolve` on local rank 0 of each node (downloading there), while the node's other ranks wait; they then
    read the commit it resolved from the cache. A collective: an error on any rank is every rank's."""
    mine = _all_ranks(lambda: str(resolve(model, weights=weights)) if local_rank == 0 else None)
    commits = sorted({Path(p).name for p in mine if p is not None})
    if len(commits) > 1:
        raise QShardError(f"model.path {model}: the nodes resolved it to different commits ({', '.join(commits)}): "
                          "it moved while they downloaded; run again, or pin model.revision to a commit")
    found = _all_ranks(lambda: str(resolve(HubModel(model.repo_id, commits[0]), local_only=True, weights=weights))
                       if local_rank != 0 else None)
    return Path(found[dist.get_rank()] or mine[dist.get_rank()])


def _all_ranks(compute: Callable[[], str | None]) -> list[str | None]:
    """`compute()` on every rank, each rank's result gathered on every rank; the first error raised anywhere
    is raised on every rank (no rank waits for one that failed)."""
    try:
        outcome = ("ok", compute())
    except Exception as exc:  # a download's OSError too: the other ranks must not wait for this one forever
        outcome = ("error", str(exc) if isinstance(exc, QShardError) else
                   f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    failed = [value for status, value in outcomes if status == "error"]
    if failed:
        raise QShardError(failed[0])
    return [value for _, value in outcomes]
