"""The KeysManager's HTTP API, on loopback (the autoscaler, the scheduler and the local provider
call it). JSON in, JSON out; bad requests get a 4xx naming the problem. Every path but /healthz and
the metrics needs the runtime's internal token (`Authorization: Bearer ...`); 401 without it.

    GET  /healthz
    GET  /metrics                      Prometheus: the cache and the forks (keysmanager/metrics.py)
    GET  /metrics/replicas             the forked replicas' own metrics, labelled by function and pid
    GET  /zygotes                      what is cached
    GET  /stats                        memory use, threshold, counts
    POST /cache   {"model", "stages"}  cache a stage range (waits until its zygote has loaded;
                  `compile` in its answer and in /zygotes says whether forks serve compiled steps
                  yet: "compiling", "done", "failed" or "off"); 507 when it does not fit the
                  server's cache budget; 502 when its zygote exits before it answers, 504 when it
                  does not answer within QUART_ZYGOTE_START_S
    POST /fork    {"model", "stages", "function", "cow": true, "env": {"QUART_...": ...}}
                  -> {"pid", "port_file", "started_by"}; 404 not cached, 409 shard changed
    POST /start   {"model", "stages", "function", "env"}
                  -> {"pid", "port_file", "started_by": "cold"}: a cold replica forked from the runtime
                  zygote (libraries imported, no parameters; started on first use), which reads its
                  shard like any cold start
    POST /evict   {"model", "stages"}
    GET  /forks                        the replicas forked here that still run
    POST /stop    {"pid"}              drain and end one of them; 404 if it is not one
    PUT  /config  {"memory_threshold": 0.85}
    POST /prefetch {"model", "stages"} start pulling those shards from QUART_MODELS_URL into shared
                                       memory for a cold start placed here; 409 without a store
    GET  /prefetch                     the prefetches and their state (fetching, done, failed)
    DELETE /prefetch/{model}           cancel that model's prefetches and free their memory
    GET  /models/{model}               the files of a partitioned model: [{"path", "bytes"}]
    GET  /models/{model}/{path}        one of them (replicas on a cluster fetch their shards here:
                                       models/fetch.py)
    GET  /blocks/{model}/{shard}/{first}-{end}[?plan=&round=&after=]
                                       pieces [first, end) of a shard held or being received here
                                       (λScale's multicast: keysmanager/blocks.py), sent at this
                                       server's QUART_SERVER_BANDWIDTH, after this server's send of
                                       round `after` of the same plan (keysmanager/pacing.py); 409
                                       for pieces still on their way after HOLD_S, 429 while its
                                       turn has not come after HOLD_S, 416 out of range, 413 over
                                       MAX_PULL_PIECES
    POST /multicast {"model", "shard", "pulls": [{"source", "first", "end"[, "plan", "round",
                    "after"]}], "fallbacks": [url]}
                                       receive a shard from peers by that schedule (its pulls tile
                                       the shard's pieces); 404 unknown model or shard
    GET  /multicast                    the shards being received or received here
    DELETE /multicast/{model}          stop receiving that model's shards and free them
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from contracts.http_errors import json_errors
from contracts.loops import every
from contracts.requests import BadRequest, load_json
from contracts.secrets import bearer_ok
from contracts.stage import StageRef
from keysmanager.blocks import HOLD_S, MAX_PULL_PIECES, NOT_YET_POLL_S, URL_RE, Gone, NotYet, Pull, Receiver, Turn
from keysmanager.cache_policy import OverBudget
from keysmanager.manager import KeysManager, NotCached, NotForkedHere, StaleShard, ZygoteExited
from keysmanager.metrics import Families, replica_families
from keysmanager.pacing import Link, SendOrder
from keysmanager.prefetch import NoStore, Prefetcher
from models.fetch import FetchError, served_file, served_files
from models.manifest import MANIFEST_NAME, PIECE_BYTES, Manifest, StageInfo

log = logging.getLogger("quart.keysmanager")
STAGES_RE = re.compile(r"^\d+(-\d+)?$")
# What the block route writes at a time, each through the server's paced uplink.
SEND_CHUNK = 256 << 10
# The least time a block waits for its plan's earlier send from this server while the link is idle.
ORDER_GRACE_S = 0.5
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# What a probe and a Prometheus scrape read without the internal token: nothing that acts.
OPEN_PATHS = ("/healthz", "/metrics", "/metrics/replicas")


def _prometheus(body: bytes) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class Invalid(ValueError):
    pass


async def _json(request: web.Request) -> dict:
    try:
        body = load_json(await request.read())
    except BadRequest as exc:
        raise Invalid(str(exc)) from None
    if not isinstance(body, dict):
        raise Invalid("the body must be a JSON object")
    return body


def _stage_range(body: dict) -> StageRef:
    model, stages = body.get("model"), body.get("stages")
    if not isinstance(model, str) or not NAME_RE.fullmatch(model):
        raise Invalid("'model' must be a model name")
    if isinstance(stages, int) and not isinstance(stages, bool):
        stages = str(stages)
    if not isinstance(stages, str) or not STAGES_RE.match(stages):
        raise Invalid("'stages' must be a stage index or a range 'a-b'")
    try:
        return StageRef.parse(model, stages)
    except ValueError as exc:
        raise Invalid(str(exc)) from None


def _env(body: dict) -> dict[str, str]:
    env = body.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise Invalid("'env' must be an object of strings")
    # Only configuration reaches a child: nothing that changes what code it runs.
    bad = sorted(k for k in env if not k.startswith("QUART_"))
    if bad:
        raise Invalid(f"only QUART_* variables may be passed to a replica, not {bad}")
    return env


def _turn(query: Mapping[str, str]) -> Turn | None:
    """A block pull's place in its multicast plan, from the block route's query."""
    try:
        return Turn.parse(query)
    except ValueError as exc:
        raise Invalid(f"the query's {exc}") from None


def _pulls(body: dict) -> tuple[list[Pull], list[str]]:
    pulls, fallbacks = body.get("pulls"), body.get("fallbacks", [])
    if not isinstance(pulls, list) or not pulls:
        raise Invalid("'pulls' must be a non-empty list of {source, first, end}")
    try:
        out = [Pull.from_json(pull) for pull in pulls]
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    if not isinstance(fallbacks, list) or not all(isinstance(f, str) and URL_RE.fullmatch(f) for f in fallbacks):
        raise Invalid("'fallbacks' must be a list of KeysManagers' http(s) URLs")
    return out, fallbacks


def _tiles(pulls: list[Pull], pieces: int) -> None:
    """Invalid unless the pulls cover pieces [0, pieces) once each, each within MAX_PULL_PIECES."""
    at = 0
    for pull in sorted(pulls, key=lambda p: p.first):
        if pull.first != at or not pull.first < pull.end <= pieces or pull.end - pull.first > MAX_PULL_PIECES:
            raise Invalid(f"the pulls must cover the shard's {pieces} pieces once each, in runs of 1 to "
                          f"{MAX_PULL_PIECES} (at piece {at}: {pull.first}-{pull.end})")
        at = pull.end
    if at != pieces:
        raise Invalid(f"the pulls cover pieces 0-{at} of {pieces}")


def _no_pieces(model: str) -> web.Response:
    """A model partitioned before manifests carried piece hashes: nothing to check a block by."""
    return web.json_response({"error": f"{model} was partitioned without piece hashes; partition it again"},
                             status=409)


def build_app(manager: KeysManager, token: str, watch_period_s: float = 1.0) -> web.Application:
    uplink, downlink = Link(manager.settings.servers.bandwidth), Link(manager.settings.servers.bandwidth)
    receiver = Receiver(manager.settings, downlink)
    prefetcher = Prefetcher(manager.settings, downlink, lambda model, shard: (
        (job := receiver.receiving(model, shard)) is not None and not job.error))
    order = SendOrder(uplink)

    def run(fn, *args):
        return asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def cache(request: web.Request) -> web.Response:
        stage = _stage_range(await _json(request))
        try:
            z = await run(manager.cache, stage)
        except OverBudget as exc:
            return web.json_response({"error": str(exc)}, status=507)
        except FetchError as exc:  # the store's 404 is the caller's unknown model; anything else is the store's
            return web.json_response({"error": str(exc)}, status=404 if exc.status == 404 else 502)
        return web.json_response(z.describe())

    def _function(body: dict, stage: StageRef) -> str:
        function = body.get("function", f"{stage.model}-s{stage.stages}")
        if not isinstance(function, str) or not NAME_RE.fullmatch(function):
            raise Invalid("'function' must be a function name")
        return function

    async def fork(request: web.Request) -> web.Response:
        body = await _json(request)
        stage = _stage_range(body)
        function = _function(body, stage)
        cow = body.get("cow", True)
        if not isinstance(cow, bool):
            raise Invalid("'cow' must be true or false")
        try:
            return web.json_response(await run(manager.fork, stage, function, _env(body), cow))
        except NotCached:
            return web.json_response({"error": f"{stage.model} stages {stage.stages} are not cached here"}, status=404)
        except StaleShard as exc:
            return web.json_response({"error": str(exc)}, status=409)

    async def start(request: web.Request) -> web.Response:
        body = await _json(request)
        stage = _stage_range(body)
        function = _function(body, stage)
        env = _env(body)
        if not (manager.settings.model_dir(stage.model) / "manifest.json").exists() and not env.get("QUART_MODELS_URL") \
                and not manager.settings.models_url:
            raise FileNotFoundError(f"no partitioned model {stage.model!r} on this server and no store to fetch it from")
        return web.json_response(await run(manager.start_cold, stage, function, env))

    async def evict(request: web.Request) -> web.Response:
        stage = _stage_range(await _json(request))
        try:
            await run(manager.evict, stage)
        except NotCached:
            return web.json_response({"error": f"{stage.model} stages {stage.stages} are not cached here"}, status=404)
        return web.json_response({"evicted": stage.key})

    async def stop_fork(request: web.Request) -> web.Response:
        pid = (await _json(request)).get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise Invalid("'pid' must be the process id of a replica forked here")
        try:
            await run(manager.stop, pid)
        except NotForkedHere as exc:
            return web.json_response({"error": exc.args[0]}, status=404)
        return web.json_response({"stopped": pid})

    def model_dir(request: web.Request) -> Path:
        model = request.match_info["model"]
        if not NAME_RE.fullmatch(model):
            raise Invalid("not a model name")
        directory = manager.settings.model_dir(model)
        if not directory.is_dir():
            raise FileNotFoundError(f"no partitioned model {model!r} on this server")
        return directory.resolve()

    async def model_files(request: web.Request) -> web.Response:
        return web.json_response(served_files(model_dir(request)))

    async def model_file(request: web.Request) -> web.StreamResponse:
        directory = model_dir(request)
        path = served_file(directory, request.match_info["path"])
        if path is None:
            raise FileNotFoundError(f"no file {request.match_info['path']!r} in model {directory.name!r}")
        return web.FileResponse(path)

    def shard_here(model: str, shard: str) -> tuple[StageInfo, Path | None] | None:
        """A shard's manifest entry and its file where this server holds the model, else the
        entry of one it is receiving; None where it has neither (nothing is fetched to find out)."""
        directory = manager.settings.model_dir(model)
        if (directory / MANIFEST_NAME).is_file():
            info = Manifest.load(directory).stage_of(shard)
            return (info, directory / shard) if info else None
        job = receiver.receiving(model, shard)
        return (job.info, None) if job else None

    async def blocks(request: web.Request) -> web.StreamResponse:
        model, shard = request.match_info["model"], request.match_info["shard"]
        first, end = int(request.match_info["first"]), int(request.match_info["end"])
        if not NAME_RE.fullmatch(model):
            raise Invalid("not a model name")
        found = await run(shard_here, model, shard)
        if found is None:
            raise FileNotFoundError(f"no shard {shard!r} of {model!r} held or being received here")
        info, local = found
        if not info.pieces:
            return _no_pieces(model)
        if end - first > MAX_PULL_PIECES:
            return web.json_response({"error": f"at most {MAX_PULL_PIECES} pieces a pull, not {end - first}"}, status=413)
        if not 0 <= first < end <= len(info.pieces):
            return web.json_response({"error": f"pieces {first}-{end} are outside {shard}'s 0-{len(info.pieces)}"},
                                     status=416)
        turn = _turn(request.query)
        held_until = time.monotonic() + HOLD_S
        while not (local and local.is_file()) and receiver.arriving(model, shard, first, end) \
                and time.monotonic() < held_until:
            await asyncio.sleep(NOT_YET_POLL_S)
        grace_s = max(ORDER_GRACE_S, (end - first) * PIECE_BYTES / uplink.rate)
        if turn and not await order.turn(turn.plan, turn.after, grace_s, HOLD_S):
            return web.json_response({"error": f"round {turn.round} of plan {turn.plan} goes out after this "
                                               f"server's round {turn.after}"}, status=429, headers={"Retry-After": "0"})
        try:
            data = await run(receiver.pieces, model, info, local, first, end)
        except NotYet as exc:
            return web.json_response({"error": str(exc)}, status=409)
        except Gone as exc:
            return web.json_response({"error": str(exc)}, status=410)
        try:
            return await send(request, data)
        finally:  # sent, or cut off on the way: its successors go on either way
            if turn:
                await order.sent(turn.plan, turn.round)

    async def send(request: web.Request, data: bytes) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        reply.content_length = len(data)
        await reply.prepare(request)
        for at in range(0, len(data), SEND_CHUNK):
            chunk = data[at:at + SEND_CHUNK]
            await uplink.send(len(chunk))
            await reply.write(chunk)
        await reply.write_eof()
        return reply

    async def multicast(request: web.Request) -> web.Response:
        body = await _json(request)
        model, shard = body.get("model"), body.get("shard")
        if not isinstance(model, str) or not NAME_RE.fullmatch(model):
            raise Invalid("'model' must be a model name")
        if not isinstance(shard, str):
            raise Invalid("'shard' must be a shard's file name")
        pulls, fallbacks = _pulls(body)
        try:
            manifest = await run(receiver.manifest, model)
        except FetchError as exc:
            return web.json_response({"error": str(exc)}, status=404 if exc.status == 404 else 502)
        info = manifest.stage_of(shard)
        if info is None:
            raise FileNotFoundError(f"{model} has no shard {shard!r}")
        if not info.pieces:
            return _no_pieces(model)
        _tiles(pulls, len(info.pieces))
        if (manager.settings.model_dir(model) / shard).is_file():
            return web.json_response({"model": model, "shard": shard, "state": "held"})
        return web.json_response(await run(receiver.start, model, info, pulls, fallbacks))

    async def cancel_multicast(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not NAME_RE.fullmatch(model):
            raise Invalid("not a model name")
        return web.json_response({"cancelled": await run(receiver.cancel, model)})

    async def prefetch(request: web.Request) -> web.Response:
        stage = _stage_range(await _json(request))
        try:
            return web.json_response(await run(prefetcher.start, stage))
        except NoStore as exc:
            return web.json_response({"error": str(exc)}, status=409)
        except FetchError as exc:  # the store's 404 is the caller's unknown model; anything else is the store's
            return web.json_response({"error": str(exc)}, status=404 if exc.status == 404 else 502)

    async def cancel_prefetch(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not NAME_RE.fullmatch(model):
            raise Invalid("not a model name")
        return web.json_response({"cancelled": await run(prefetcher.cancel, model)})

    async def config(request: web.Request) -> web.Response:
        threshold = (await _json(request)).get("memory_threshold")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise Invalid("'memory_threshold' must be a number in 0..1")
        manager.threshold = float(threshold)
        return web.json_response(manager.stats())

    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not bearer_ok(request.headers.get("Authorization"), token):
            # A fork runs code with the settings it is given: only the runtime may ask for one.
            return web.json_response({"error": "unauthorized: the KeysManager API needs the internal token"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except Invalid as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except FileNotFoundError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except ZygoteExited as exc:
            return web.json_response({"error": str(exc)}, status=502)
        except TimeoutError as exc:  # a zygote not ready within QUART_ZYGOTE_START_S, which the message names
            return web.json_response({"error": str(exc) or f"{request.method} {request.path} timed out"}, status=504)

    async def watch(app: web.Application) -> None:
        app["watcher"] = asyncio.create_task(every(watch_period_s, lambda: run(manager.watch_once), log, "watcher"))
        app["sweeper"] = asyncio.create_task(every(watch_period_s, lambda: run(prefetcher.sweep), log, "prefetch sweeper"))

    async def stop(app: web.Application) -> None:
        app["watcher"].cancel()
        app["sweeper"].cancel()
        await run(receiver.shutdown)
        await run(prefetcher.shutdown)
        await run(manager.shutdown)

    async def metrics(_: web.Request) -> web.Response:
        return _prometheus(generate_latest(manager.metrics.registry))

    async def replica_metrics(_: web.Request) -> web.Response:
        registry = CollectorRegistry()
        registry.register(Families(await run(replica_families, manager.replica_targets())))
        return _prometheus(generate_latest(registry))

    app = web.Application(middlewares=[json_errors, errors])
    app.router.add_get("/healthz", lambda _: web.Response(text="OK"))
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/replicas", replica_metrics)
    app.router.add_get("/zygotes", lambda _: web.json_response(manager.list()))
    app.router.add_get("/stats", lambda _: web.json_response(manager.stats()))
    app.router.add_post("/cache", cache)
    app.router.add_post("/fork", fork)
    app.router.add_post("/start", start)
    app.router.add_post("/evict", evict)
    app.router.add_put("/config", config)
    app.router.add_get("/forks", lambda _: web.json_response(manager.forks()))
    app.router.add_post("/stop", stop_fork)
    app.router.add_post("/prefetch", prefetch)
    app.router.add_get("/prefetch", lambda _: web.json_response(prefetcher.list()))
    app.router.add_delete("/prefetch/{model}", cancel_prefetch)
    app.router.add_get("/blocks/{model}/{shard}/{first:\\d+}-{end:\\d+}", blocks)
    app.router.add_post("/multicast", multicast)
    app.router.add_get("/multicast", lambda _: web.json_response(receiver.list()))
    app.router.add_delete("/multicast/{model}", cancel_multicast)
    app.router.add_get("/models/{model}", model_files)
    app.router.add_get("/models/{model}/{path:.+}", model_file)
    app.on_startup.append(watch)
    app.on_shutdown.append(stop)
    return app
