"""What the simulated cluster is made of and what its mechanisms cost. Two presets: QUART's
testbed (12 GPU servers x 4 GPUs, 1 TB host memory each) and this repository's embedded runtime
on one host, whose costs were measured on it (see `embedded_runtime`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SimConfig:
    # Servers. A slot is one stage replica on a GPU; QUART co-locates stages on a GPU
    # (its scheduler reserves "GPU memory space", §6.2), so a GPU holds several.
    servers: int = 12
    gpus_per_server: int = 4
    replicas_per_gpu: int = 4
    # The KeysManager's byte budget per server: host memory times its threshold (QUART: 85 %).
    host_memory_bytes: float = 1024e9
    cache_threshold: float = 0.85
    # Start paths. Cold: read the shard at the server's bandwidth, shared by the cold starts
    # under way (HydraServe Eq. 4), then initialise the runtime. Fork: from a zygote in host
    # memory, then copy the shard to the GPU (0 = no copy, as for emulated stages).
    bandwidth: float = 1.25e9            # bytes/s: 10 Gb/s to remote storage
    # > 0: the servers share one link of this many bytes/s to the model store (cold reads share it,
    # not their own links), and a start that cannot fork may receive its stage from the servers
    # that cache it (λScale's peer start, scheduler/peer_start.py) over links of `bandwidth`.
    store_bandwidth: float = 0.0
    init_s: float = 3.0                  # runtime start after the read (process, imports, CUDA)
    fork_s: float = 0.03                 # fork to first work (scale-up benchmark: 29-32 ms)
    h2d_bandwidth: float = 12e9          # bytes/s host to GPU over PCIe
    cache_at_start: str = "none"         # "all", "parallel" (the embedded runtime), "sequential" or "none"
    # CPU cores per server that runtime initialisations share (0: not modelled, each takes
    # init_s). Where modelled, init_s is CPU work, and the data plane's own work (hops, the
    # entry, service overhead) slows by (initialisations + 1) / cores when they outnumber them;
    # the data plane's CPU (item_cpu_s, request_cpu_s) shares them too.
    host_cores: float = 0.0
    cold_deadline_s: float = 60.0
    # Data plane. A hop costs a fixed part (serialise, queue, deserialise) plus the activation
    # over the network; the entry's own work per request (HTTP in and out) is entry_s.
    hop_s: float = 0.002
    hop_bandwidth: float = 1.25e9
    entry_s: float = 0.003
    service_overhead_s: float = 0.0      # per item on top of the drawn compute time
    # Where the cores are modelled: the CPU part of a hop (pack, Redis, unpack), which shares
    # them with every other hop and start, so a burst whose hand-offs outrun them waits there.
    item_cpu_s: float = 0.0
    request_cpu_s: float = 0.0           # a request's CPU outside the stages, sharing the cores too
    # Generative models batch, budget and drain as the settings' batching section says (QUART_MAX_BATCH,
    # QUART_KV_BYTES, QUART_KV_WAIT_S, QUART_DRAIN). A KV migration costs a fixed part plus the
    # cache's bytes at migrate_bandwidth: the kv_migration benchmark's SmolLM2 figures (3 to 47 MB
    # through Redis in 13 to 178 ms) fitted.
    migrate_s: float = 0.0017
    migrate_bandwidth: float = 2.68e8
    # Control plane (contracts/config.Settings has the same names and defaults).
    tick_s: float = 1.0
    window_s: float = 10.0
    slo_s: float = 2.0
    # > 0: each model's latency objective is this multiple of its unloaded latency (QUART's
    # "SLO ... a multiple of each model inference time") instead of slo_s for all.
    slo_x: float = 0.0
    request_timeout_s: float = 120.0
    # The entry's admission control (frontend/admission.py at QUART_ADMIT_WAIT_S) on a model's
    # requests, as the embedded runtime runs it; QUART's testbed evaluation has none.
    admission: bool = False
    initial_replicas: int = 1
    # > 0: every model's stage functions scale to zero once it has been idle this long (OpenFaaS's
    # com.openfaas.scale.zero-duration, decided by the Controller's idle rule), and the gateway
    # wakes them all on the next request's way in; 0: never.
    idle_s: float = 0.0
    # > 0: every single-pass model also has a whole-model function of up to this many replicas,
    # serving its first stage's queue with every stage at once, and consolidates into it and
    # splits back by HydraServe's sliding window (the Controller's layout rule); 0: none.
    whole_max: int = 0
    sample_s: float = 0.5
    tail_s: float = 15.0                 # simulated after the last arrival, as loadgen's --tail
    seed: int = 0

    @property
    def slots(self) -> int:
        return self.gpus_per_server * self.replicas_per_gpu

    @property
    def cache_budget(self) -> int:
        return int(self.host_memory_bytes * self.cache_threshold)

    def hop(self, activation_bytes: int) -> float:
        """One hand-off between stages: the fixed part and the activation over the network."""
        return self.hop_s + (activation_bytes / self.hop_bandwidth if self.hop_bandwidth > 0 else 0.0)

    def replace(self, **changes: object) -> SimConfig:
        return dataclasses.replace(self, **changes)


def quart_testbed(**changes: object) -> SimConfig:
    """QUART §8.1: 12 GPU servers with 4 GPUs and 1 TB of memory each."""
    return SimConfig(**changes)


def embedded_runtime(**changes: object) -> SimConfig:
    """This repository's embedded runtime on one 2-core host with emulated stages, as
    `python -m loadgen compare --stack-file stack-emulated.yml` runs it, with costs measured on
    that host: one virtual server with 64 slots; a hop from hand-off to pick-up takes 2.5 ms, a
    stage's measured service exceeds its drawn sleep by 0.6 ms, a request spends 5 ms outside
    the stages (benchmarks/results/loadgen-cv1, static policy, stages after the bottleneck); a
    forked replica takes its first item after about 30 ms; a cold replica or a zygote first
    imports its modules, 5.1 s of one core's work (`import engine.replica, engine.watchdog`:
    4.7 s user + 0.5 s system), sharing the 2 cores with every other start. Its one KeysManager
    warms the stages four at a time, and when a replay starts four of eight are cached (`make up`
    says so). Emulated stages read no parameters. The entry refuses (429) what would queue past
    QUART_ADMIT_WAIT_S, as the runtime's does (7-12 % of the live_policies runs' requests). The
    data plane's CPU shares the two cores (benchmarks/results/data_plane_cpu.json): 1.8 ms a stage
    item (the stage processes and Redis, 13.6-15.4 ms over 8 stages), the hop's CPU part, and
    4.8 ms a request outside the stages (entry 2.3-2.6, gateway 1.2-1.4, load generator 1.1)."""
    base = dict(servers=1, gpus_per_server=64, replicas_per_gpu=1, host_memory_bytes=0.0,
                bandwidth=1e15, init_s=5.1, host_cores=2.0, fork_s=0.03, h2d_bandwidth=0.0,
                cache_at_start="parallel", hop_s=0.0025, hop_bandwidth=0.0, entry_s=0.005,
                service_overhead_s=0.0006, window_s=5.0, slo_s=1.0, admission=True, item_cpu_s=0.0018,
                request_cpu_s=0.0048)
    return SimConfig(**{**base, **changes})
