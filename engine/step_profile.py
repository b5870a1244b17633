"""Where one batched forward's time went, logged at DEBUG: wall time against this thread's CPU
time, the GPU's own time between two CUDA events, and the times the kernel preempted the thread.
A step much slower in wall time than in CPU and GPU time waited on something else (another
process's kernels, a starved core); a step whose CPU time is its wall time is launch-bound."""
from __future__ import annotations

import logging
import resource
import time

import torch

log = logging.getLogger("quart.replica")


class StepProfile:
    """Started before a forward, `done` after it; costs nothing unless DEBUG is on."""

    def __init__(self, device: torch.device) -> None:
        self.on = log.isEnabledFor(logging.DEBUG)
        if not self.on:
            return
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        self.switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def done(self, batch: int, first: int) -> None:
        if not self.on:
            return
        gpu = float("nan")
        if self.events is not None:
            self.events[1].record()
            self.events[1].synchronize()   # the step's outputs go to the CPU next anyway
            gpu = self.events[0].elapsed_time(self.events[1])
        wall = (time.perf_counter() - self.wall) * 1000.0
        log.debug("step at stage %d, batch %d: wall %.1f ms, thread CPU %.1f ms, GPU %.1f ms, %d preemptions",
                  first, batch, wall, (time.thread_time() - self.cpu) * 1000.0, gpu,
                  resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - self.switches)
