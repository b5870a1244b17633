"""Entry function of a model (python3-http template shape): the one endpoint users call.
It sends the request through the model's stage functions and answers JSON, or server-sent
events (a body that is an async iterator of bytes) when a generative request streams."""
from contracts.config import load_settings, replica_identity
from frontend.entry import Entry

ENTRY = Entry(load_settings(), replica_identity().model)


async def handle(event, context):
    answer = await ENTRY.handle(event.method, event.path, event.body)
    body = answer.stream if answer.stream is not None else answer.body
    return {"statusCode": answer.status, "body": body, "headers": answer.headers}
