"""Scale to zero and back (OpenFaaS's labels): a model's stage functions labelled
`com.openfaas.scale.zero: "true"` go to zero replicas once the model has had no request for
`com.openfaas.scale.zero-duration` (a Go duration: "90s", "15m", "1h30m"; OpenFaaS's default 15m)
and holds no work; the first request after wakes every one of them at once, so a cold pipeline
starts all its stages in parallel instead of one after another. The entry stays up: it is the
activator that holds the requests while the stages start. Pure: state in, decision out."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelActivity:
    """What the gateway knows of one model's stage functions that may scale to zero."""
    last_request_at: float      # its latest invocation (or when it was deployed or woken)
    idle_s: float               # the shortest zero-duration among them
    replicas: int               # desired replicas over them
    work: int                   # requests in flight at the gateway, and items in their streams


def decide(now: float, m: ModelActivity) -> str | None:
    """"sleep" (scale them to zero), "wake" (back to their minimum), or None."""
    if m.replicas > 0 and m.work == 0 and now - m.last_request_at >= m.idle_s:
        return "sleep"
    if m.replicas == 0 and m.work > 0:
        return "wake"
    return None
