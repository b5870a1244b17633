"""Stage function (python3-http template shape). One replica serves the stage range in
QUART_STAGES of the model in QUART_MODEL: in the background it pulls work from the stage's
Redis Stream; over HTTP it answers a direct single-stage invoke (safetensors in, safetensors out)
from callers holding the runtime's internal token: users go through the model's entry, which bounds
what they ask. A replica forked by a KeysManager zygote uses the parameters it inherited instead of loading them.
"""
import sys

from contracts.config import load_settings, replica_identity
from contracts.secrets import bearer_ok
from contracts.stage import StageRef

IDENTITY = replica_identity()
STAGE = StageRef.parse(IDENTITY.model, IDENTITY.stages)
SETTINGS = load_settings()
TOKEN = SETTINGS.internal_api_token()
# A cold process starts reading its shards now, so that they arrive while torch imports below
# (HydraServe §5); a fork has torch and its parameters already.
COLD = "pipeline.inherited" not in sys.modules and not SETTINGS.compute.emulate
if COLD and SETTINGS.coldstart.overlap:
    from pipeline.shard_reader import start_readers
    READERS = start_readers(SETTINGS, STAGE)
else:
    READERS = None

from contracts.wire import CONTENT_TYPE, BadRequest  # noqa: E402  (imports torch)
from pipeline.inherited import inherited_runner  # noqa: E402
from pipeline.replica import Replica  # noqa: E402

REPLICA = Replica(SETTINGS, STAGE, IDENTITY.started_by, runner=inherited_runner(STAGE), readers=READERS)
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
