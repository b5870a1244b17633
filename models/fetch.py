"""A replica that does not find its partitioned model on disk fetches it: on a cluster, OpenFaaS
functions mount no volumes, so the model lies on a volume of the KeysManager on each node
(deploy/kubernetes/), which serves it (keysmanager/api.py: GET /models/...), and a cold replica
fetches the manifest, the tokenizer and only its own stages' shards from QUART_MODELS_URL into
QUART_MODELS, checking every shard's sha256 against the manifest."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from contracts.config import Settings
from contracts.secrets import bearer
from models.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger("quart.model_fetch")
CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The model could not be fetched, or a shard did not match its checksum; `status` is the
    store's HTTP status where it answered one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def ensure_model(settings: Settings, model: str, stages: range = range(0)) -> Path:
    """settings.model_dir(model) holding the manifest, the tokenizer and the shards of `stages`,
    fetched from QUART_MODELS_URL what is missing (nothing when it is unset)."""
    directory = settings.model_dir(model)
    if not settings.models_url or _complete(directory, stages):
        return directory
    started = time.monotonic()
    manifest = ensure_manifest(settings, model)
    token = settings.internal_api_token()
    for i in stages:
        info = manifest.stages[i]
        if not manifest.shard_path(i).is_file():
            download(shard_url(settings, model, info.shard), token, manifest.shard_path(i), info.sha256)
    log.info("fetched %s (stages %s) from %s in %.1f s", model, list(stages), settings.models_url,
             time.monotonic() - started)
    return directory


def ensure_manifest(settings: Settings, model: str, tokenizer: bool = True) -> Manifest:
    """The model's manifest, with its tokenizer beside it (`tokenizer`: a stage replica needs
    none): fetched from QUART_MODELS_URL when they are not on disk (the shards are left to the caller)."""
    directory = settings.model_dir(model)
    if not settings.models_url or ((directory / MANIFEST_NAME).is_file()
                                   and (not tokenizer or Manifest.load(directory).tokenizer_path().is_dir())):
        return Manifest.load(directory)
    base = f"{settings.models_url.rstrip('/')}/models/{urllib.parse.quote(model)}"
    token = settings.internal_api_token()
    download(f"{base}/{MANIFEST_NAME}", token, directory / MANIFEST_NAME)
    manifest = Manifest.load(directory)
    if not tokenizer:
        return manifest
    with open_url(base, token) as reply:
        listing = json.loads(reply.read())
    for path in sorted(f["path"] for f in listing["files"] if f["path"].startswith(manifest.tokenizer + "/")):
        download(f"{base}/{urllib.parse.quote(path)}", token, directory / path)
    return manifest


def served_files(directory: Path) -> dict:
    """What a server of models answers for GET /models/{model} (a KeysManager, a model store):
    every file of the model's directory with its size, the listing `ensure_manifest` reads."""
    return {"files": [{"path": str(f.relative_to(directory)), "bytes": f.stat().st_size}
                      for f in sorted(directory.rglob("*")) if f.is_file()]}


def served_file(directory: Path, relative: str) -> Path | None:
    """The file GET /models/{model}/{relative} serves; None for one that is missing or lies
    outside the model's directory (`..`, a link out)."""
    path = (directory / relative).resolve()
    return path if directory.resolve() in path.parents and path.is_file() else None


def shard_url(settings: Settings, model: str, shard: str) -> str:
    return f"{settings.models_url.rstrip('/')}/models/{urllib.parse.quote(model)}/{urllib.parse.quote(shard)}"


def _complete(directory: Path, stages: range) -> bool:
    try:
        manifest = Manifest.load(directory)
    except FileNotFoundError:
        return False
    return manifest.tokenizer_path().is_dir() and all(manifest.shard_path(i).is_file() for i in stages)


def open_url(url: str, token: str):
    request = urllib.request.Request(url, headers=bearer(token))
    try:
        return urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as exc:
        raise FetchError(f"fetching {url}: {exc}", exc.code) from None
    except (OSError, ValueError) as exc:
        raise FetchError(f"fetching {url}: {exc}") from None


def partial_path(target: Path) -> Path:
    """Where a download to `target` is written until it is whole: a name of this process and
    thread, so that replicas fetching the same file at once do not write into each other."""
    return target.with_name(f"{target.name}.{os.getpid()}-{threading.get_ident()}.part")


def download(url: str, token: str, target: Path, sha256: str | None = None,
             cancelled: Callable[[], bool] = lambda: False, partial: Path | None = None,
             pace: Callable[[int], None] = lambda size: None) -> None:
    """`url` to `target` (whole, or not at all: it is written to `partial` until checked against
    `sha256` when given, then renamed); FetchError once `cancelled()` says so. Each chunk is read
    once `pace` lets it in (a server's paced downlink)."""
    partial = partial or partial_path(target)
    digest = hashlib.sha256()
    try:
        with open_url(url, token) as reply:
            target.parent.mkdir(parents=True, exist_ok=True)  # only once the source has it: a miss leaves nothing
            with open(partial, "wb") as out:
                while True:
                    pace(CHUNK)
                    if not (chunk := reply.read(CHUNK)):
                        break
                    if cancelled():
                        raise FetchError(f"{url}: cancelled")
                    digest.update(chunk)
                    out.write(chunk)
                    out.flush()  # a reader following the .part sees each chunk as it lands
        if sha256 is not None and digest.hexdigest() != sha256:
            raise FetchError(f"{url}: sha256 {digest.hexdigest()[:12]}… is not the manifest's {sha256[:12]}…")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.rename(target)
