"""Stage function (python3-http template shape). One replica serves the stage range in
QUART_STAGES of the model in QUART_MODEL: in the background it pulls work from the stage's
Redis Stream; over HTTP it answers a direct single-stage invoke (safetensors in, safetensors out).
A replica forked by a KeysManager zygote uses the parameters it inherited instead of loading them.
"""
from contracts.config import load_settings, replica_identity
from contracts.stage import StageRef
from contracts.wire import CONTENT_TYPE, BadRequest
from pipeline.inherited import inherited_runner
from pipeline.replica import Replica

IDENTITY = replica_identity()
STAGE = StageRef.parse(IDENTITY.model, IDENTITY.stages)
REPLICA = Replica(load_settings(), STAGE, IDENTITY.started_by, runner=inherited_runner(STAGE))
REPLICA.start()


def handle(event, context):
    if event.method != "POST":
        return {"statusCode": 405, "body": {"error": "POST safetensors bytes to invoke this stage"}}
    try:
        out = REPLICA.invoke(event.body)
    except BadRequest as exc:
        return {"statusCode": exc.status, "body": {"error": str(exc)}}
    return {"statusCode": 200, "body": out, "headers": {"Content-Type": CONTENT_TYPE}}


def ready():
    return REPLICA.alive()


def shutdown():
    REPLICA.stop()
