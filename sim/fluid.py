"""Jobs sharing one capacity equally (processor sharing): cold starts sharing a server's read
bandwidth (HydraServe Eq. 4), or runtime initialisations sharing its CPU cores."""
from __future__ import annotations

import math

EPS = 1e-9


class Fluid:
    def __init__(self, capacity: float, cap_each: float = math.inf) -> None:
        self.capacity, self.cap_each = capacity, cap_each
        self.jobs: list[list] = []        # [token, work left]
        self.since = 0.0
        self.version = 0                  # a completion event from an older version is stale
        self.used = 0.0                   # capacity × seconds used so far (core-seconds for cores)

    def rate(self) -> float:
        return min(self.cap_each, self.capacity / len(self.jobs)) if self.jobs else 0.0

    def advance(self, now: float) -> None:
        if self.jobs and now > self.since:
            done = self.rate() * (now - self.since)
            for job in self.jobs:
                job[1] -= done
            self.used += done * len(self.jobs)
        self.since = now

    def add(self, token: object, work: float, now: float) -> None:
        self.advance(now)
        self.jobs.append([token, work])

    def remove(self, token: object, now: float) -> bool:
        self.advance(now)
        kept = [j for j in self.jobs if j[0] is not token]
        removed = len(kept) != len(self.jobs)
        self.jobs = kept
        return removed

    def finished(self, now: float) -> list[object]:
        self.advance(now)
        eps = EPS * max(1.0, self.capacity)
        done = [j[0] for j in self.jobs if j[1] <= eps]
        self.jobs = [j for j in self.jobs if j[1] > eps]
        return done

    def next_done(self, now: float) -> float | None:
        """When the next job finishes if nothing changes; a new version invalidates older ones."""
        self.version += 1
        if not self.jobs:
            return None
        return now + max(0.0, min(j[1] for j in self.jobs)) / self.rate()
