"""What every HTTP endpoint shares about a request: the error a client must fix (answered as a
4xx naming the problem) and the one JSON body reader. No torch: the gateway imports it."""
from __future__ import annotations

import json


class BadRequest(ValueError):
    """Input that a client must fix; answered with an HTTP 4xx and this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def load_json(body: bytes) -> object:
    """A JSON request body; BadRequest (400) naming what is wrong with it, whatever it holds."""
    try:
        data = json.loads(body)
        # A lone surrogate ("\ud800") parses but is no text: it must not reach a tokenizer or a log.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:
        raise BadRequest(f"malformed JSON: not UTF-8 text ({exc.reason})") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python converts
        raise BadRequest(f"malformed JSON: {exc}") from None
    return data
