"""Entry function of a model (python3-http template shape): the one endpoint users call.
It sends the request through the model's stage functions and answers JSON."""
from contracts.config import load_settings, replica_identity
from pipeline.entry import Entry

ENTRY = Entry(load_settings(), replica_identity().model)


async def handle(event, context):
    if event.method != "POST":
        return {"statusCode": 405, "body": {"error": "POST a JSON request to this model"}}
    status, body = await ENTRY.handle(event.body)
    return {"statusCode": status, "body": body}
