"""A replica that does not find its partitioned model on disk fetches it: on a cluster, OpenFaaS
functions mount no volumes, so the model lies on a volume of the KeysManager on each node
(deploy/kubernetes/), which serves it (keysmanager/api.py: GET /models/...), and a cold replica
fetches the manifest, the tokenizer and only its own stages' shards from QUART_MODELS_URL into
QUART_MODELS, checking every shard's sha256 against the manifest."""
from __future__ import annotations

import hashlib
import json
import logging
import time
import urllib.parse
import urllib.request
from pathlib import Path

from contracts.config import Settings
from contracts.secrets import bearer
from pipeline.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger("quart.model_fetch")
CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The model could not be fetched, or a shard did not match its checksum."""


def ensure_model(settings: Settings, model: str, stages: range = range(0)) -> Path:
    """settings.model_dir(model) holding the manifest, the tokenizer and the shards of `stages`,
    fetched from QUART_MODELS_URL what is missing (nothing when it is unset)."""
    directory = settings.model_dir(model)
    if not settings.models_url or _complete(directory, stages):
        return directory
    started = time.monotonic()
    base = f"{settings.models_url.rstrip('/')}/models/{urllib.parse.quote(model)}"
    token = settings.internal_api_token()
    listing = json.loads(_get(f"{base}", token).read())
    others = {f["path"] for f in listing["files"]} - {MANIFEST_NAME}
    _download(f"{base}/{MANIFEST_NAME}", token, directory / MANIFEST_NAME)
    manifest = Manifest.load(directory)
    shards = {manifest.stages[i].shard: manifest.stages[i].sha256 for i in stages}
    tokenizer = {p for p in others if p.startswith(manifest.tokenizer + "/")}
    for path in sorted(tokenizer | set(shards)):
        _download(f"{base}/{urllib.parse.quote(path)}", token, directory / path, shards.get(path))
    log.info("fetched %s (stages %s) from %s in %.1f s", model, list(stages), settings.models_url,
             time.monotonic() - started)
    return directory


def _complete(directory: Path, stages: range) -> bool:
    try:
        manifest = Manifest.load(directory)
    except FileNotFoundError:
        return False
    return manifest.tokenizer_path().is_dir() and all(manifest.shard_path(i).is_file() for i in stages)


def _get(url: str, token: str):
    request = urllib.request.Request(url, headers=bearer(token))
    try:
        return urllib.request.urlopen(request, timeout=30)
    except (OSError, ValueError) as exc:
        raise FetchError(f"fetching {url}: {exc}") from None


def _download(url: str, token: str, target: Path, sha256: str | None = None) -> None:
    """`url` to `target` (whole, or not at all), checked against `sha256` when given."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    with _get(url, token) as reply, open(partial, "wb") as out:
        while chunk := reply.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    if sha256 is not None and digest.hexdigest() != sha256:
        partial.unlink()
        raise FetchError(f"{url}: sha256 {digest.hexdigest()[:12]}… is not the manifest's {sha256[:12]}…")
    partial.rename(target)
