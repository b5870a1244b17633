"""Stage function (python3-http template shape). One replica serves the stage range in
QUART_STAGES of the model in QUART_MODEL: in the background it pulls work from the stage's
Redis Stream; over HTTP it answers a direct single-stage invoke (safetensors in, safetensors out).
A replica forked by a KeysManager zygote uses the parameters it inherited instead of loading them.
"""
from contracts.config import load_settings
from contracts.wire import CONTENT_TYPE, BadRequest
from pipeline.inherited import inherited_runner
from pipeline.replica import Replica

SETTINGS = load_settings()
REPLICA = Replica(SETTINGS, runner=inherited_runner(SETTINGS.model, *SETTINGS.stage_range()))
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
