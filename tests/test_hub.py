"""Models named by a Hub id: resolved through huggingface_hub into the Hub cache, recorded with their commit.

Nothing here reaches the Internet. A Hub cache is written on disk as huggingface_hub writes it (blobs, refs,
snapshots of symlinks) and read with HF_HUB_OFFLINE=1; what needs the Hub itself (downloads, a gated or
missing repository, a revision that does not exist) is asked of a small Hub served on 127.0.0.1 in a thread,
which answers the requests huggingface_hub makes, with the status codes and headers it reads."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import free_port, spawn

from qshard import cli
from qshard.errors import QShardError
from qshard.loading.hub import HubModel, hub_model, resolve

REPO = "org/tiny"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
GOOD = {"instruction": "add 2 and 3", "output": "5"}


# ---------------------------------------------------------------------------------------------------- helpers


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(model_dir.iterdir()) if f.is_file()}


def write_cached(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    """`files` as huggingface_hub caches a repository at `commit`: each content once under blobs/ (named by its
    hash), the snapshot's files as relative symlinks to them, and each of `refs` (branches, tags) a file holding
    the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_env(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache of this test's own (through HF_HOME), offline; returns the cache directory."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf-home" / "hub"


def train(model: str, data: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(["train", "--model", model, "--data", str(data), "--output-dir", str(out), "--max-steps", "1",
                     "--max-length", "32", "--train.precision", "fp32", "--checkpoint.async_save", "false", *extra])
    return code, capsys.readouterr().err


def export(run: Path, out: Path, capsys, *extra: str) -> dict:
    capsys.readouterr()
    code = cli.main(["export", "adapter", "--run", str(run), "--out", str(out), *extra])
    assert code == 0, capsys.readouterr().err
    return json.loads((out / "adapter_config.json").read_text())


def one_error(code: int, stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("qshard: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(8)))
    return path


# --------------------------------------------------------------------------------------- the cache, offline


def test_train_from_hub_id_records_it_and_resume_and_export_keep_its_commit(hub_env, tiny_models, data, tmp_path,
                                                                            capsys):
    """`--model org/name` trains from the cached snapshot main points at; config.yaml keeps the id, the
    checkpoint and adapter_config.json the commit. After main moves to other weights, the run resumes and
    exports from its own commit; --base-name renames the base in the export (a merged one's config too)."""
    files = model_files(tiny_models("llama"))
    config = json.loads(files["config.json"])
    files["config.json"] = json.dumps({**config, "_name_or_path": "/home/someone/tiny"}).encode()
    write_cached(hub_env, REPO, COMMIT_A, files, refs=("main",))
    write_cached(hub_env, REPO, COMMIT_B, model_files(tiny_models("llama", seed=1)))
    out = tmp_path / "run"
    code, err = train(REPO, data, out, capsys)
    assert code == 0, err
    assert f"model {REPO}: commit {COMMIT_A}" in err
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == REPO and adapter["revision"] == COMMIT_A
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["path"] == REPO
    state = json.loads((out / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    assert state["base_commit"] == COMMIT_A and state["base_model"] == REPO

    (hub_env / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text(COMMIT_B)
    code, err = train(REPO, data, out, capsys, "--max-steps", "2", "--resume", "auto")
    assert code == 0, err  # the new main's weights differ: resolving main would fail the base check
    assert f"commit {COMMIT_A}, the one the checkpoint was trained from" in err and "resumed from" in err
    # --base-name with a revision of its own; without one, a Hub id other than the run's has none.
    assert export(out, tmp_path / "renamed", capsys, "--base-name", "team/base@v2") == {
        **adapter, "base_model_name_or_path": "team/base", "revision": "v2"}
    assert export(out, tmp_path / "other", capsys, "--base-name", "team/base")["revision"] is None
    own = export(out, tmp_path / "own", capsys)
    assert (own["base_model_name_or_path"], own["revision"]) == (REPO, COMMIT_A)
    code = cli.main(["export", "merged", "--run", str(out), "--out", str(tmp_path / "merged"), "--base-name", "team/m"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["_name_or_path"] == "team/m"


def test_revisions_resolve_to_their_snapshots(hub_env, tiny_models, tmp_path, monkeypatch):
    files = model_files(tiny_models("llama"))
    main = write_cached(hub_env, REPO, COMMIT_A, files, refs=("main",))
    tagged = write_cached(hub_env, REPO, COMMIT_B, files, refs=("v1",))
    assert resolve(HubModel(REPO)) == main
    assert resolve(hub_model(f"{REPO}@v1", None)) == tagged  # a tag (or branch) through refs/
    assert resolve(hub_model(REPO, "v1")) == tagged  # the same through model.revision
    assert resolve(hub_model(f"{REPO}@{COMMIT_A}", None)) == main  # a commit: its snapshot, no ref needed
    assert (main / "config.json").is_symlink()
    assert hub_model(f"{REPO}@v1", "v1") == HubModel(REPO, "v1")
    with pytest.raises(QShardError, match="asks for revision v1 and model.revision for v2"):
        hub_model(f"{REPO}@v1", "v2")
    with pytest.raises(QShardError, match="no revision after '@'"):
        hub_model(f"{REPO}@", None)
    # Not an id: more than one slash, or a part the Hub refuses; an existing local path is never one.
    assert hub_model("a/b/c", None) is None and hub_model("org/na--me", None) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert hub_model(REPO, None) is None
    with pytest.raises(QShardError, match="model.revision v1: model.path org/tiny is a local directory"):
        hub_model(REPO, "v1")


def test_cached_snapshot_without_weights(hub_env, tiny_models):
    files = {n: b for n, b in model_files(tiny_models("llama")).items() if not n.endswith(".safetensors")}
    snapshot = write_cached(hub_env, REPO, COMMIT_A, files, refs=("main",))
    with pytest.raises(QShardError, match=f"the cached snapshot {snapshot} holds no weights .*HF_HUB_OFFLINE"):
        resolve(HubModel(REPO))


def test_offline_errors_are_one_line(hub_env, tiny_models, data, tmp_path, capsys):
    """No cached copy, a revision the cache lacks, two revisions: one line each, exit 2, no run written; a path
    that is neither a directory nor a Hub id keeps the missing directory's error."""
    out = tmp_path / "run"
    line = one_error(*train(REPO, data, out, capsys))
    assert f"no cached copy of {REPO} at main in {hub_env}" in line and "HF_HUB_OFFLINE" in line
    write_cached(hub_env, REPO, COMMIT_A, model_files(tiny_models("llama")), refs=("main",))
    line = one_error(*train(f"{REPO}@nope", data, out, capsys))
    assert f"no cached copy of {REPO} at nope" in line
    line = one_error(*train(f"{REPO}@main", data, out, capsys, "--model.revision", "v1"))
    assert "asks for revision main and model.revision for v1" in line
    line = one_error(*train(str(tmp_path / "no" / "such" / "dir"), data, out, capsys))
    assert "model directory not found" in line
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------- a Hub, local


class FakeHub(ThreadingHTTPServer):
    """The Hub's answers to what huggingface_hub asks when resolving and downloading: a revision's commit
    (/api/models/ID/revision/REV), its file listing (/api/models/ID/tree/REV) and files (/ID/resolve/REV/FILE,
    HEAD for their metadata, GET for their bytes); errors as the Hub gives them (X-Error-Code)."""

    def __init__(self, repos: dict[str, dict], gated: tuple[str, ...] = ()):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.repos, self.gated = repos, gated  # repos: id -> {refs: {name: sha}, commits: {sha: {file: bytes}}}
        self.requests: list[str] = []  # "METHOD path" of each request
        self.downloads: list[str] = []  # the files whose bytes were sent
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        self.server.requests.append(f"{self.command} {self.path}")
        parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(self.path).path.strip("/").split("/")]
        api = parts[0] == "api"
        repo_id = "/".join(parts[2:4] if api else parts[0:2])
        repo = self.server.repos.get(repo_id)
        if repo is None:
            return self._send(401, {"X-Error-Code": "RepoNotFound"})
        rev = parts[5] if api else parts[3]
        commit = rev if rev in repo["commits"] else repo["refs"].get(rev)
        if commit is None:
            return self._send(404, {"X-Error-Code": "RevisionNotFound"})
        files = repo["commits"][commit]
        if api and parts[4] == "revision":
            info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": n} for n in files]}
            return self._send(200, {}, json.dumps(info).encode())
        if api and parts[4] == "tree":
            tree = [{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for n, b in files.items()]
            return self._send(200, {}, json.dumps(tree).encode())
        name = "/".join(parts[4:])
        if repo_id in self.server.gated:
            return self._send(403, {"X-Error-Code": "GatedRepo"})
        if name not in files:
            return self._send(404, {"X-Error-Code": "EntryNotFound"})
        if send_body:
            self.server.downloads.append(name)
        body = files[name]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
        return self._send(200, headers, body, send_body)

    def _send(self, status: int, headers: dict, body: bytes = b"", send_body: bool = True) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)


@pytest.fixture
def online(hub_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    hubs = []

    def start(repos: dict[str, dict], gated: tuple[str, ...] = ()) -> FakeHub:
        hubs.append(FakeHub(repos, gated))
        monkeypatch.setenv("HF_ENDPOINT", hubs[-1].url)
        return hubs[-1]

    yield start
    for hub in hubs:
        hub.shutdown()
        hub.server_close()


def test_download_takes_only_what_a_run_reads(online, hub_env, tiny_models, data, tmp_path, capsys, monkeypatch):
    """A dry run: the files that describe the model, no weights. Then a run: config, tokenizer, generation config
    and safetensors weights; not the .bin copy, the original/ folder or a README. Then offline, the cache serves
    the same snapshot."""
    files = model_files(tiny_models("llama"))
    extra = {"pytorch_model.bin": b"old", "original/consolidated.pth": b"raw", "README.md": b"# tiny",
             "model.gguf": b"gguf"}
    hub = online({REPO: {"refs": {"main": COMMIT_A}, "commits": {COMMIT_A: {**files, **extra}}}})
    code, err = train(REPO, data, tmp_path / "planned", capsys, "--dry-run")
    assert code == 0 and "the weights are not downloaded by a dry run" in err, err
    assert sorted(hub.downloads) == sorted(set(files) - {"model.safetensors"})
    assert not (tmp_path / "planned").exists()
    # A local directory without its weights is not a Hub snapshot the dry run left unfetched: it is refused.
    local = tmp_path / "local"
    local.mkdir()
    for name, content in files.items():
        if name != "model.safetensors":
            (local / name).write_bytes(content)
    code, err = train(str(local), data, tmp_path / "planned", capsys, "--dry-run")
    assert code == 2 and "not downloaded by a dry run" not in err, err
    snapshot = resolve(HubModel(REPO))
    assert snapshot == hub_env / "models--org--tiny" / "snapshots" / COMMIT_A
    assert sorted(hub.downloads) == sorted(files)  # each file once
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve(HubModel(REPO)) == snapshot


def test_bin_weights_only_without_safetensors_and_none_at_all(online, tiny_models):
    files = {n: b for n, b in model_files(tiny_models("llama")).items() if n != "model.safetensors"}
    hub = online({"org/bin": {"refs": {"main": COMMIT_A}, "commits": {COMMIT_A: {**files, "pytorch_model.bin": b"w",
                                                                                  "training_args.bin": b"t"}}},
                  "org/gguf": {"refs": {"main": COMMIT_A}, "commits": {COMMIT_A: {**files, "model.gguf": b"g"}}}})
    assert (resolve(HubModel("org/bin")) / "pytorch_model.bin").read_bytes() == b"w"
    assert "training_args.bin" not in hub.downloads
    with pytest.raises(QShardError, match=r"org/gguf: the repository has no weights qshard reads .* it has \.gguf"):
        resolve(HubModel("org/gguf"))


def test_hub_errors_are_one_line_each(online, tiny_models, data, tmp_path, capsys):
    files = model_files(tiny_models("llama"))
    online({REPO: {"refs": {"main": COMMIT_A}, "commits": {COMMIT_A: files}},
            "org/gated": {"refs": {"main": COMMIT_A}, "commits": {COMMIT_A: files}}}, gated=("org/gated",))
    line = one_error(*train("org/gated", data, tmp_path / "run", capsys))
    assert "org/gated: a gated repository; accept its license" in line and "HF_TOKEN" in line
    with pytest.raises(QShardError, match="no such local directory, and no Hub repository org/missing"):
        resolve(HubModel("org/missing"))
    with pytest.raises(QShardError, match=f"{REPO} has no revision v9"):
        resolve(HubModel(REPO, "v9"))


def test_unreachable_hub_falls_back_to_the_cache(hub_env, tiny_models, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(QShardError, match=f"no cached copy of {REPO} at main in {hub_env}.*did not provide it"):
        resolve(HubModel(REPO))
    cached = write_cached(hub_env, REPO, COMMIT_A, model_files(tiny_models("llama")), refs=("main",))
    assert resolve(HubModel(REPO)) == cached


def _resolve_on_rank(rank: int, port: int, endpoint: str, cache: str, results: str) -> None:
    import huggingface_hub.constants
    import torch
    import torch.distributed as dist

    from qshard.build import resolve_model
    from qshard.config import Config
    from qshard.loading.hub import resolve_on_nodes
    from qshard.parallel.distributed import DistEnv

    # A forked rank has the environment of the server it was forked from, not this test's.
    os.environ.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    found = {"each_rank": str(resolve_on_nodes(HubModel(REPO), local_rank=rank))}
    try:
        resolve_on_nodes(HubModel("org/missing"), local_rank=rank)
    except QShardError as exc:
        found["missing"] = str(exc)
    # Broadcast loading: rank 1 reads no cache at all (its own is empty), rank 0 sends it the small files.
    os.environ["HF_HUB_CACHE"] = cache if rank == 0 else str(Path(results, "empty-cache"))
    cfg = Config()
    cfg.model.path, cfg.model.load_mode = REPO, "broadcast"
    model_dir, commit = resolve_model(cfg, DistEnv(rank, 2, rank, torch.device("cpu"), None))
    found["broadcast"] = [commit, sorted(p.name for p in model_dir.iterdir())]
    Path(results, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_only_local_rank_0_downloads(online, hub_env, tiny_models, tmp_path):
    """Two ranks of one node: rank 0 downloads each file once, rank 1 waits, asks the Hub nothing, and reads the
    same snapshot; an error is both ranks'. Under broadcast loading rank 1 needs no cache."""
    files = model_files(tiny_models("llama"))
    hub = online({REPO: {"refs": {"main": COMMIT_A}, "commits": {COMMIT_A: files}}})
    spawn(_resolve_on_rank, (free_port(), hub.url, str(hub_env), str(tmp_path)))
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    snapshot = hub_env / "models--org--tiny" / "snapshots" / COMMIT_A
    assert [f["each_rank"] for f in found] == [str(snapshot), str(snapshot)]
    assert sorted(hub.downloads) == sorted(files)
    # Rank 0's resolutions only: of main for each_rank and broadcast loading, of the missing repository once.
    assert sum(f"/{REPO}/revision/" in r for r in hub.requests) == 2
    assert sum("/org/missing/revision/" in r for r in hub.requests) == 1
    assert all("no Hub repository org/missing" in f["missing"] for f in found)
    small = sorted(n for n in files if not n.endswith(".safetensors"))
    assert found[0]["broadcast"] == [COMMIT_A, sorted(files)] and found[1]["broadcast"] == [COMMIT_A, small]
    assert not (tmp_path / "empty-cache").exists()
