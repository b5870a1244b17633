"""Stage function (python3-http template shape). One replica serves the stage range in
QUART_STAGES of the model in QUART_MODEL: in the background it pulls work from the stage's
Redis Stream; over HTTP it answers a direct single-stage invoke (safetensors in, safetensors out)
from callers holding the runtime's internal token: users go through the model's entry, which bounds
what they ask. A replica forked by a KeysManager zygote uses the parameters it inherited instead of loading them;
one forked from the runtime zygote, or started as a new process, reads its shards (and one that cannot
leaves the reason in Redis for the requests waiting on it).
"""
import sys

from contracts.config import load_settings, replica_identity
from contracts.secrets import bearer_ok
from contracts.stage import StageRef
from models.shard_reader import start_failures_recorded, start_readers

IDENTITY = replica_identity()
STAGE = StageRef.parse(IDENTITY.model, IDENTITY.stages)
SETTINGS = load_settings()
TOKEN = SETTINGS.internal_api_token()
# A cold process starts reading its shards now, so that they arrive while torch imports below
# (HydraServe §5); a fork has torch and its parameters already.
COLD = "engine.inherited" not in sys.modules and not SETTINGS.compute.emulate

with start_failures_recorded(SETTINGS, STAGE):
    READERS = start_readers(SETTINGS, STAGE) if COLD and SETTINGS.coldstart.overlap else None

    # Imported only now (torch, transformers): the shards are on their way meanwhile.
    from contracts.wire import CONTENT_TYPE, BadRequest
    from engine.inherited import inherited_runner
    from engine.replica import StageReplica

    REPLICA = StageReplica(SETTINGS, STAGE, IDENTITY.started_by, runner=inherited_runner(STAGE), readers=READERS)
REPLICA.start()


def handle(event, context):
    if event.method != "POST":
        return {"statusCode": 405, "body": {"error": "POST safetensors bytes to invoke this stage"}}
    if not bearer_ok(event.headers.get("Authorization"), TOKEN):
        return {"statusCode": 401, "body": {"error": "unauthorized: a stage is invoked directly only with the "
                                                     "internal token; users call the model's entry"},
                "headers": {"WWW-Authenticate": "Bearer"}}
    try:
        out = REPLICA.invoke(event.body)
    except BadRequest as exc:
        return {"statusCode": exc.status, "body": {"error": str(exc)}}
    return {"statusCode": 200, "body": out, "headers": {"Content-Type": CONTENT_TYPE}}


def ready():
    return REPLICA.alive()


def shutdown():
    REPLICA.stop()
