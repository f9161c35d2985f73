"""C load generators for the benches: ``wrk`` (HTTP/1.1) and ``h2load`` (HTTP/2, for gRPC).

Both are Debian packages (``wrk``, ``nghttp2-client``). :func:`ensure_tool` finds one on PATH
or installs its package (``apt-get install -y``, through ``sudo -n`` when not root) and says
what it did; a bench that cannot have the tool records that and skips the figures it gives.

* :func:`run_wrk`: ``wrk -t1 -cN -dDs --latency`` with a Lua script that POSTs a body file
  with the given headers, after an untimed warm-up run. Its text output is parsed (Requests/sec,
  the latency distribution, errors), and the script's ``done()`` prints the exact figures
  (µs) as one JSON line, which win where both exist.
* :func:`run_h2load`: ``h2load -cN -m1 -t1 -D S --warm-up-time W`` POSTing a body file (for
  gRPC: the 5-byte gRPC frame header and a serialized ModelInferRequest, with
  ``content-type: application/grpc`` and ``te: trailers``). h2load counts any HTTP 200 as a
  success; a gRPC error travels in a 200's trailers, so the caller checks the request first.

Both report the CPU the server processes (and their children) used during the timed run,
the client's own CPU, everything else on the machine, and hypervisor steal, with the same
``disturbed`` rule as the Python client in ``_load.py``. Every run is bounded by its duration
and a subprocess timeout; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
_INSTALL_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------- tools
def _version(path: str, flag: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([path, flag], capture_output=True, timeout=10, check=False)
        text = (done.stdout + done.stderr).decode(errors="replace").strip()
        return text.splitlines()[0][:120] if text else None
    return None


def ensure_tool(binary: str, package: str, version_flag: str = "--version") -> dict[str, Any]:
    """Find ``binary`` or install Debian's ``package``; never raises.

    Returns ``path`` (None when not to be had), ``installed_by_bench``, ``version`` and, on
    failure, ``error``.
    """
    path = shutil.which(binary)
    info: dict[str, Any] = {"binary": binary, "package": package, "installed_by_bench": False}
    if path is None:
        apt = shutil.which("apt-get")
        if apt is None:
            info["error"] = f"{binary} not found and no apt-get to install {package}"
        else:
            prefix: list[str] = []
            if os.geteuid() != 0:
                sudo = shutil.which("sudo")
                if sudo is None:
                    info["error"] = f"{binary} not found; not root and no sudo to install it"
                    prefix = ["-"]
                else:
                    prefix = [sudo, "-n"]
            if prefix != ["-"]:
                env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
                tried: list[str] = []
                for step in ([], ["update"]):
                    if step:  # the package lists may be missing or stale: refresh, then retry
                        _run_quiet([*prefix, apt, "-q", "update"], env)
                    cmd = [*prefix, apt, "install", "-y", "-q", "--no-install-recommends", package]
                    code, tail = _run_quiet(cmd, env)
                    tried.append(f"{' '.join(cmd[-5:])}: exit {code} {tail}")
                    path = shutil.which(binary)
                    if path is not None:
                        info["installed_by_bench"] = True
                        info["install_command"] = " ".join(cmd)
                        break
                if path is None:
                    info["error"] = f"{binary} not found and installing {package} failed"
                    info["install_attempts"] = tried
    info["path"] = path
    info["version"] = _version(path, version_flag) if path else None
    return info


def _run_quiet(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    try:
        done = subprocess.run(
            cmd, capture_output=True, timeout=_INSTALL_TIMEOUT_S, check=False, env=env
        )
    except (OSError, subprocess.SubprocessError) as e:
        return -1, str(e)[:200]
    return done.returncode, done.stderr.decode(errors="replace").strip()[-200:]


# ---------------------------------------------------------------------------- CPU accounting
def _procs(pids: list[int]) -> list[Any]:
    """psutil processes of ``pids`` and all their children (worker processes)."""
    import psutil

    found: dict[int, Any] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            found[p.pid] = p
            for c in p.children(recursive=True):
                found[c.pid] = c
    return list(found.values())


def _cpu_s(procs: list[Any]) -> float:
    import psutil

    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class CpuWindow:
    """CPU of the server processes, the load client (reaped children) and the machine."""

    def __init__(self, server_pids: list[int]) -> None:
        self.procs = _procs(server_pids)

    def __enter__(self) -> CpuWindow:
        self.start = self._sample()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.t0
        end = self._sample()
        self.delta = {k: end[k] - self.start[k] for k in end}

    def _sample(self) -> dict[str, float]:
        import psutil

        total = psutil.cpu_times()
        busy = sum(getattr(total, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "machine_busy_s": busy,
            "steal_s": getattr(total, "steal", 0.0),
            "server_s": _cpu_s(self.procs),
            "client_s": kids.ru_utime + kids.ru_stime,
        }

    def report(self, requests: int, seconds: float) -> dict[str, Any]:
        d = self.delta
        seconds = max(1e-9, seconds)
        other = d["machine_busy_s"] - d["server_s"] - d["client_s"]
        cpu = {k: round(v, 3) for k, v in d.items()}
        cpu["other_s"] = round(other, 3)
        cpu["other_cores"] = round(other / seconds, 3)
        cpu["steal_cores"] = round(d["steal_s"] / seconds, 3)
        cpu["machine_busy_fraction"] = round(
            d["machine_busy_s"] / (seconds * (os.cpu_count() or 1)), 3
        )
        if requests:
            cpu["server_us_per_request"] = round(d["server_s"] / requests * 1e6, 1)
            cpu["client_us_per_request"] = round(d["client_s"] / requests * 1e6, 1)
        return cpu


# ---------------------------------------------------------------------------- wrk
_WRK_LUA = """\
wrk.method = "POST"
local f = assert(io.open({body!r}, "rb"))
wrk.body = f:read("*a")
f:close()
{headers}
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"status":%d,"timeout":%d,"mean_us":%.1f,"p50_us":%d,"p90_us":%d,' ..
    '"p99_us":%d,"max_us":%d}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
"""

_UNITS_US = {"us": 1.0, "ms": 1000.0, "s": 1e6, "m": 60e6}


def _us(text: str) -> float | None:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    return float(m.group(1)) * _UNITS_US[m.group(2)] if m else None


def wrk_script(path: Path, body_file: Path, headers: dict[str, str]) -> Path:
    lines = "\n".join(f"wrk.headers[{k!r}] = {v!r}" for k, v in headers.items())
    # Python's repr of a plain str is a valid Lua string literal for these values.
    path.write_text(_WRK_LUA.format(body=str(body_file), headers=lines))
    return path


def parse_wrk(text: str) -> dict[str, Any]:
    """Figures from wrk's text output (and its done() JSON line, when present)."""
    out: dict[str, Any] = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if m:
        out["rps_text"] = float(m.group(1))
    m = re.search(r"(\d+) requests in ([\d.]+\w+),", text)
    if m:
        out["requests_text"] = int(m.group(1))
    dist: dict[str, float | None] = {}
    for pct, value in re.findall(r"^\s+(\d+)%\s+(\S+)\s*$", text, flags=re.M):
        dist[f"p{pct}"] = _us(value)
    if dist:
        out["latency_distribution_us"] = dist
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    out["non_2xx_3xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["socket_errors"] = (
        dict(zip(("connect", "read", "write", "timeout"), map(int, m.groups()), strict=True))
        if m
        else {}
    )
    for line in text.splitlines():
        if line.startswith("WRK_JSON "):
            out["done"] = json.loads(line[len("WRK_JSON ") :])
    return out


def run_wrk(
    wrk: str,
    *,
    port: int,
    path: str,
    body_file: Path,
    headers: dict[str, str],
    script_dir: Path,
    connections: int = 64,
    warmup_s: int = 1,
    duration_s: int = 5,
    server_pids: list[int] | None = None,
) -> dict[str, Any]:
    """One closed-loop wrk run (after a warm-up run) and its figures; raises RuntimeError."""
    script = wrk_script(
        script_dir
        / f"wrk-{body_file.stem}-{zlib.crc32(repr(sorted(headers.items())).encode()):08x}.lua",
        body_file,
        headers,
    )
    url = f"http://{HOST}:{port}{path}"
    base = [wrk, "-t1", f"-c{connections}", "--latency", "-s", str(script)]
    if warmup_s > 0:
        subprocess.run(
            [*base, f"-d{warmup_s}s", url],
            capture_output=True,
            timeout=warmup_s + 30,
            check=False,
        )
    window = CpuWindow(server_pids or [])
    with window:
        done = subprocess.run(
            [*base, f"-d{duration_s}s", url],
            capture_output=True,
            timeout=duration_s + 30,
            check=False,
        )
    text = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.decode()[-1000:]}")
    parsed = parse_wrk(text)
    d = parsed.get("done")
    if d is None and "rps_text" not in parsed:
        raise RuntimeError(f"cannot read wrk's output: {text[-1000:]}")
    errors = parsed["non_2xx_3xx"] + sum(parsed["socket_errors"].values())
    if d is not None:
        seconds = d["duration_us"] / 1e6
        requests = d["requests"]
        errors = max(errors, d["status"] + d["connect"] + d["read"] + d["write"] + d["timeout"])
        lat = {
            "p50": float(d["p50_us"]),
            "p90": float(d["p90_us"]),
            "p99": float(d["p99_us"]),
            "max": float(d["max_us"]),
            "mean": d["mean_us"],
        }
    else:
        seconds = float(duration_s)
        requests = parsed.get("requests_text", 0)
        lat = {k: v for k, v in parsed.get("latency_distribution_us", {}).items()}
    ok = max(0, requests - errors)
    report: dict[str, Any] = {
        "client": "wrk",
        "command": f"wrk -t1 -c{connections} -d{duration_s}s --latency -s post.lua URL "
        f"(after a {warmup_s} s warm-up run)",
        "concurrency": connections,
        "requests": requests,
        "ok": ok,
        "errors": errors,
        "seconds": round(seconds, 3),
        "rps": round(ok / seconds, 1) if seconds > 0 else 0.0,
        "rps_text": parsed.get("rps_text"),
        "latency_us": lat,
        "latency_distribution_us": parsed.get("latency_distribution_us"),
        "socket_errors": parsed["socket_errors"],
        "non_2xx_3xx": parsed["non_2xx_3xx"],
    }
    if server_pids:
        cpu = window.report(requests, window.seconds)
        report["cpu"] = cpu
        report["disturbed"] = cpu["other_cores"] > 0.3 or cpu["steal_cores"] > 0.15
    return report


# ---------------------------------------------------------------------------- h2load
def _ms(seconds: float) -> str:
    """A duration for h2load, which takes "500ms" but not "0.5"."""
    return f"{max(1, round(seconds * 1000))}ms"


def parse_h2load(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    m = re.search(r"finished in ([\d.]+)(ms|s), ([\d.]+) req/s", text)
    if m:
        out["seconds"] = float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)
        out["rps_text"] = float(m.group(3))
    m = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        text,
    )
    if m:
        keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
        out["requests"] = dict(zip(keys, map(int, m.groups()), strict=True))
    m = re.search(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text)
    if m:
        mn, mx, mean, sd = (_us(x) for x in m.groups())
        out["time_for_request_us"] = {"min": mn, "max": mx, "mean": mean, "sd": sd}
    return out


def run_h2load(
    h2load: str,
    *,
    port: int,
    path: str,
    body_file: Path,
    headers: dict[str, str],
    connections: int = 64,
    streams_per_connection: int = 1,
    warmup_s: float = 1.0,
    duration_s: float = 5.0,
    server_pids: list[int] | None = None,
) -> dict[str, Any]:
    """One closed-loop h2load run over h2c (prior knowledge); raises RuntimeError."""
    cmd = [
        h2load,
        "-t1",
        f"-c{connections}",
        f"-m{streams_per_connection}",
        f"--duration={_ms(duration_s)}",
        f"--warm-up-time={_ms(warmup_s)}",
        "-d",
        str(body_file),
    ]
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    cmd.append(f"http://{HOST}:{port}{path}")
    window = CpuWindow(server_pids or [])
    with window:
        done = subprocess.run(
            cmd, capture_output=True, timeout=warmup_s + duration_s + 30, check=False
        )
    text = done.stdout.decode(errors="replace")
    parsed = parse_h2load(text)
    if done.returncode != 0 or "requests" not in parsed:
        raise RuntimeError(
            f"h2load failed ({done.returncode}): {text[-800:]} {done.stderr.decode()[-800:]}"
        )
    req = parsed["requests"]
    # "finished in" includes the warm-up; the counts and req/s are of the main duration.
    seconds = duration_s
    ok = req["succeeded"]
    report: dict[str, Any] = {
        "client": "h2load",
        "command": f"h2load -t1 -c{connections} -m{streams_per_connection} "
        f"--duration={_ms(duration_s)} --warm-up-time={_ms(warmup_s)} -d body "
        + " ".join(f"-H '{k}: {v}'" for k, v in headers.items())
        + " URL",
        "concurrency": connections * streams_per_connection,
        "requests": req,
        "ok": ok,
        "seconds": round(seconds, 3),
        "rps": round(ok / seconds, 1) if seconds > 0 else 0.0,
        "rps_text": parsed.get("rps_text"),
        "time_for_request_us": parsed.get("time_for_request_us"),
        "note": "h2load counts an HTTP 200 as success (a gRPC error would be a 200 with "
        "grpc-status in its trailers); the request was checked with a real gRPC client first",
    }
    if server_pids:
        # The window holds h2load's warm-up too: count the requests of the whole window.
        cpu = window.report(round(report["rps"] * window.seconds), window.seconds)
        report["cpu"] = cpu
        report["disturbed"] = cpu["other_cores"] > 0.3 or cpu["steal_cores"] > 0.15
    return report
