r"""The servers ``cpattn bench serve`` starts and reads: a free loopback port, one ``cpattn serve``
subprocess per engine (started, waited for, stopped), and its ``/metrics`` counters.

>>> parse_metrics('cpattn_steps_total 3\n# HELP x\ncpattn_pcp_steps_total{role="prefill"} 2\n')["cpattn_steps_total"]
3.0
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

NAME = "bench"  # the served model name every benchmark server answers to
METRICS = ("cpattn_prefix_hit_tokens_total", "cpattn_prefix_query_tokens_total", "cpattn_replayed_steps_total",
           "cpattn_eager_steps_total", "cpattn_steps_total", "cpattn_preemptions_total", "cpattn_pcp_steps_total")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``cpattn serve`` subprocess on 127.0.0.1 (its stderr in a temporary file)."""

    def __init__(self, flags: list[str], common: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="cpattn-bench-serve-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
        self.args = [*flags, *common]
        self.proc = subprocess.Popen([sys.executable, "-m", "cpattn", "serve", *self.args, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--served-model-name", NAME],
                                     env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def log_tail(self, n: int = 5) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return " | ".join(f.read().strip().splitlines()[-n:])

    def wait_ready(self, deadline: float) -> None:
        import urllib.request

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cpattn serve {' '.join(self.args)} exited {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cpattn serve {' '.join(self.args)} did not answer /health in time: "
                                   f"{self.log_tail()}")
            time.sleep(0.25)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics counters (label variants summed)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, the values of one name's label sets summed.

    >>> parse_metrics('# HELP x y\\nx 2\\nb{rank="0"} 1\\nb{rank="1"} 3\\n')
    {'x': 2.0, 'b': 4.0}
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _delta(before: list[dict], after: list[dict]) -> dict:
    d = {m: sum(a.get(m, 0.0) - b.get(m, 0.0) for a, b in zip(after, before)) for m in METRICS}
    q = d["cpattn_prefix_query_tokens_total"]
    return {"prefix_hit_rate": d["cpattn_prefix_hit_tokens_total"] / q if q > 0 else None,
            "prefix_hit_tokens": int(d["cpattn_prefix_hit_tokens_total"]), "prefix_query_tokens": int(q),
            "steps": int(d["cpattn_steps_total"]), "replayed_steps": int(d["cpattn_replayed_steps_total"]),
            "eager_steps": int(d["cpattn_eager_steps_total"]), "preemptions": int(d["cpattn_preemptions_total"]),
            "pcp_steps": int(d["cpattn_pcp_steps_total"])}


# ----------------------------------------------------------------------------- the run
