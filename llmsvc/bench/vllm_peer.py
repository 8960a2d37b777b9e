"""vLLM (its CPU build, in its own venv) as a peer of `llmsvc bench`, started with that venv's
interpreter and never imported here.

All-at-once workloads go through vLLM's offline `LLM.generate` in a child running
vllm_offline.py (a line-per-JSON protocol, see that file); Poisson workloads through vLLM's
OpenAI server on a free loopback port, fed by openai_stream at the same arrival offsets. Each
child is started once per bench run (vLLM takes over a minute to start) in its own process
group, and the whole group is stopped on exit, failure or Ctrl-C. Only one of the two is up at a
time, so they never compete for memory or cores. Every run starts from an empty prefix cache,
as each of ours does (a fresh engine or server per run): with --repeat the same prompts come
again, and a cache kept from the run before served vLLM's later runs from it (TTFT p50 111 ->
74 ms on S1). The offline child resets it before each job, the server through its
/reset_prefix_cache (dev mode) or, where that fails, by a restart."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from llmsvc.bench.metrics import RequestRecord
from llmsvc.bench.server_proc import free_port

OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline.py")
SERVED_NAME = "peer"  # the model name the server is asked to answer to
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever *_proxy says


class PeerError(RuntimeError):
    pass


def check_interpreter(python: str | None, timeout: float = 300.0) -> str:
    """vLLM's version in `python`; PeerError saying what is wrong when there is none."""
    if not python:
        raise PeerError("--baseline vllm needs --vllm-python PATH (the interpreter of a venv with vLLM; "
                        "see docs/benchmarks.md)")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise PeerError(f"--vllm-python {python}: not an executable file")
    r = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                       timeout=timeout, env=peer_env())
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise PeerError(f"--vllm-python {python} cannot import vllm: {tail}")
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "?"


def _cpu_list() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def peer_env() -> dict:
    """The environment of a vLLM child: nothing from a model hub; on the CPU, compute threads on
    every core this process may use (vLLM's CPU build otherwise keeps one core for itself).
    Values already set in the environment win."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_list())
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the child's process group (vLLM's engine core is a grandchild), SIGKILL after grace.
    SIGCONT first: a group frozen for one of our runs would hold SIGTERM pending, not shut down."""
    if proc.poll() is not None:
        with_group(proc.pid, signal.SIGKILL)  # stragglers of an exited leader
        return
    with_group(proc.pid, signal.SIGCONT)
    with_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    with_group(proc.pid, signal.SIGKILL)
    proc.wait()


def with_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def records_from_job(result: dict) -> tuple[list[RequestRecord], float, str | None]:
    """RequestRecords of one offline job, on a clock starting at 0 when generate was called.
    With vLLM's metrics, a request's first token lands at its TTFT and the rest evenly over its
    decode time (so TPOT is exact, inter-token percentiles are not); without, every token is
    stamped at the end of the call, as for HF generate, and the note says so."""
    if "error" in result:
        raise PeerError(f"vLLM offline: {result['error']}")
    wall, records = result["wall_s"], []
    for r in result["records"]:
        n = r["output_len"]
        if r.get("ttft_s") is not None and r.get("decode_s") is not None:
            t1, d = r["ttft_s"], r["decode_s"]
            times = [t1 + d * k / (n - 1) for k in range(n)] if n > 1 else [t1] * n
        else:
            times = [wall] * n
        records.append(RequestRecord(r["prompt_len"], 0.0, times, times[-1] if times else wall))
    note = None if result.get("ttft_source") else "vLLM reported no per-request metrics: TTFT is the call's end"
    return records, wall, note


class VllmPeer:
    """The vLLM children of one bench run, started on first use. close() stops whichever is up."""

    def __init__(self, python: str, model_dir: str, dtype: str, kv_cache_bytes: int = 2 << 30,
                 log_dir: str | None = None, start_timeout: float = 900.0) -> None:
        self.python, self.model_dir, self.dtype = python, model_dir, dtype
        self.common = ["--dtype", dtype, "--seed", "0", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
        self.start_timeout = start_timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="llmsvc-vllm-")
        self._offline: subprocess.Popen | None = None
        self._server: subprocess.Popen | None = None
        self._url: str | None = None
        self._server_used = False  # a run went through this server: its prefix cache is warm

    def _spawn(self, cmd: list[str], log_name: str, env: dict | None = None, **kw) -> subprocess.Popen:
        """Start cmd in its own process group with stderr (and stdout, unless kw redirects it:
        vLLM logs to stdout) appended to log_name in the log folder; env: added to peer_env()."""
        log = open(os.path.join(self.log_dir, log_name), "ab")
        kw.setdefault("stdout", log)
        try:
            return subprocess.Popen(cmd, stderr=log, env={**peer_env(), **(env or {})}, start_new_session=True, **kw)
        finally:
            log.close()  # the child holds its own descriptor

    def _fail(self, what: str, log_name: str) -> PeerError:
        path = os.path.join(self.log_dir, log_name)
        tail = Path(path).read_text(errors="replace").strip().splitlines()[-5:] if os.path.exists(path) else []
        return PeerError(f"{what} (log {path}):\n  " + "\n  ".join(tail))

    # -- offline LLM.generate -------------------------------------------------------------
    def run_offline(self, prompts: list[list[int]], output_len: int):
        """(records, wall_s, note) of one LLM.generate call on `prompts`."""
        if self._offline is None:
            self._stop_server()
            self._offline = self._spawn([self.python, str(OFFLINE_SCRIPT), "--model", self.model_dir,
                                         *self.common], "offline.log", stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1)
            ready = self._read(self._offline)
            if not ready.get("ready"):
                raise self._fail(f"vLLM offline did not start: {ready.get('error', ready)}", "offline.log")
        self._offline.stdin.write(json.dumps({"prompts": prompts, "max_tokens": output_len}) + "\n")
        self._offline.stdin.flush()
        return records_from_job(self._read(self._offline))

    def _read(self, proc: subprocess.Popen) -> dict:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise self._fail(f"vLLM offline exited with code {proc.returncode}", "offline.log")
        return json.loads(line)

    # -- OpenAI server ---------------------------------------------------------------------
    def server_url(self) -> str:
        """Base URL of vLLM's OpenAI server on loopback, started and healthy."""
        if self._server is None:
            self._stop_offline()
            port = free_port()
            self._server = self._spawn([self.python, "-m", "vllm.entrypoints.openai.api_server",
                                        "--model", self.model_dir, "--served-model-name", SERVED_NAME,
                                        *self.common, "--host", "127.0.0.1",
                                        "--port", str(port)], "server.log",
                                       env={"VLLM_SERVER_DEV_MODE": "1"})  # for /reset_prefix_cache
            self._url = f"http://127.0.0.1:{port}"
            wait_healthy(self._url, self.start_timeout, self._server,
                         lambda what: self._fail(what, "server.log"))
        return self._url

    def run_serving(self, prompts, output_len: int, offsets: list[float], concurrency: int | None = None):
        from llmsvc.bench.fairness import warmup_prompts
        from llmsvc.bench.openai_stream import run_completions

        if self._server is not None and self._server_used and not self._reset_server_cache():
            self._stop_server()  # no reset endpoint: a fresh server has an empty cache
        self._server_used = True
        url = self.server_url()
        warm = warmup_prompts(prompts)  # outside the clock, as ours; no measured prompt's prefix
        run_completions(url, SERVED_NAME, warm, 2, [0.0] * len(warm), concurrency)
        return run_completions(url, SERVED_NAME, prompts, output_len, offsets, concurrency)

    def process_groups(self) -> list[int]:
        """The process groups of the children up now (each started in a session of its own),
        for fairness.Turns to freeze while one of our systems runs."""
        from llmsvc.bench.fairness import peer_pgids

        return peer_pgids([self._offline, self._server])

    def _reset_server_cache(self) -> bool:
        """POST /reset_prefix_cache; True when the server answered 200."""
        try:
            req = urllib.request.Request(self._url + "/reset_prefix_cache", data=b"", method="POST")
            with _NO_PROXY.open(req, timeout=30) as r:
                return r.status == 200
        except OSError:  # HTTPError (404 without dev mode) included
            return False

    # -- stopping -----------------------------------------------------------------------------
    def _stop_offline(self) -> None:
        if self._offline is not None:
            proc, self._offline = self._offline, None
            try:
                proc.stdin.close()  # EOF: the script returns and vLLM shuts down
                proc.wait(15.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
            stop_group(proc)

    def _stop_server(self) -> None:
        self._server_used = False
        if self._server is not None:
            proc, self._server = self._server, None
            stop_group(proc)

    def close(self) -> None:
        try:
            self._stop_offline()
        finally:
            self._stop_server()

    def __enter__(self) -> "VllmPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen, fail) -> None:
    """Poll GET url/health until 200; fail(what) builds the error if the child dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise fail(f"vLLM server exited with code {proc.returncode} during start-up")
        try:
            with _NO_PROXY.open(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise fail(f"vLLM server at {url} not healthy after {timeout:.0f}s")
