"""Scale to zero and back (OpenFaaS's labels): a model's stage functions labelled
`com.openfaas.scale.zero: "true"` go to zero replicas once the model has had no request for
`com.openfaas.scale.zero-duration` (a Go duration: "90s", "15m", "1h30m"; OpenFaaS's default 15m)
and holds no work; the first request after wakes every one of them at once, so a cold pipeline
starts all its stages in parallel instead of one after another. The entry stays up: it is the
activator that holds the requests while the stages start. Pure: state in, decision out."""
from __future__ import annotations

from dataclasses import dataclass

from contracts.stack import parse_duration

ZERO_LABEL = "com.openfaas.scale.zero"
ZERO_DURATION_LABEL = "com.openfaas.scale.zero-duration"
DEFAULT_ZERO_DURATION_S = 15 * 60.0


@dataclass(frozen=True)
class ZeroScaling:
    """A function's scale-to-zero labels."""
    enabled: bool = False
    idle_s: float = DEFAULT_ZERO_DURATION_S

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> ZeroScaling:
        """ValueError naming the label whose value is wrong."""
        raw = labels.get(ZERO_LABEL, "false").strip().lower()
        if raw not in ("true", "false"):
            raise ValueError(f"label {ZERO_LABEL}={labels[ZERO_LABEL]!r} must be true or false")
        duration = labels.get(ZERO_DURATION_LABEL)
        try:
            idle_s = parse_duration(duration) if duration is not None else DEFAULT_ZERO_DURATION_S
        except ValueError as exc:
            raise ValueError(f"label {ZERO_DURATION_LABEL}: {exc}") from None
        return cls(raw == "true", idle_s)


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
