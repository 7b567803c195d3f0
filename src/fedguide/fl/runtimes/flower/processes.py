"""Processes the Flower runtimes start, and how they are stopped: by their own ids, never by name.

Holds the process-tree helpers (Linux /proc), Flower's environment, free local ports and the start of
a Flower command with its output in a log file.

Decisions:
- Every Flower command runs with ``FLOWER_ENV`` (no runtime dependency installs, no telemetry, no
  update check) and its own FLWR_HOME, so nothing is written outside the run's folders; the
  folder holding the running Python is put first on PATH because Flower starts its helpers
  (flower-superexec, flwr-serverapp, flwr-clientapp) by name.
- A started process gets the kernel's parent-death signal (SIGTERM, Linux): if the fedguide
  process that started it dies, even by SIGKILL, it stops too, and a SuperNode stopped by SIGTERM
  still tells its SuperLink that it is leaving.
- ``stop_tree`` collects the whole tree before signalling anything: Flower starts some helpers in
  a session of their own, and a child whose parent died first would be re-parented out of reach.
- The SuperLink runs as ``python -m fedguide.fl.runtimes.flower.processes superlink ARGS``
  (``run_superlink``): Flower 1.42's ``flower-superlink`` with one more middleware, ``LocalControl``.
  Flower serves its Fleet API (SuperNodes), Control API (``flwr run``, ``flwr supernode register``) and Runtime API
  (the ServerApp) on one port, and its Control API has no account authentication outside Flower's
  enterprise edition: whoever reaches the port could submit a run (code that the SuperLink's
  ServerApp process would import) or register a SuperNode key of their own. ``LocalControl``
  answers requests from other machines for the Fleet API only (403 for the rest); ``fedguide
  serve`` and the ServerApp connect from this machine. It takes the peer address the server saw,
  after uvicorn's proxy-header rewrite, which trusts ``X-Forwarded-For`` from 127.0.0.1 only.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

# Read by Flower when it is imported: no dependency installs, no telemetry, no update check.
FLOWER_ENV = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_TELEMETRY_ENABLED": "0",
              "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
              "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}  # CPU actors: Ray leaves device variables alone


def descendants(pid: int) -> set[int]:
    """Live descendants of ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return set()
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in ("Z", "X"):
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] not in ("Z", "X")


def command_args(pid: int) -> list[str]:
    """The program and arguments ``pid`` runs (Linux /proc; empty when gone, elsewhere, or mid-exec)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def command_line(pid: int) -> str:
    return " ".join(command_args(pid))


def is_ray_process(pid: int) -> bool:
    """Whether ``pid`` runs Ray: a worker or actor (titled ``ray::...``), raylet, the GCS server, or one of Ray's
    Python scripts (dashboard, log monitor, autoscaler monitor). Judged by the program and script, not by any
    argument: a fork server started after ``import ray`` carries Ray's folders in its ``sys.path`` argument."""
    args = command_args(pid)
    if not args:
        return False
    return (args[0].startswith("ray::") or Path(args[0]).name in ("raylet", "gcs_server")
            or any(a.endswith(".py") and "/ray/" in a for a in args[1:3]))


def stop_processes(pids: set[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + grace_s
        while time.time() < deadline and any(alive(p) for p in pids):
            time.sleep(0.05)
        pids = {p for p in pids if alive(p)}
        if not pids:
            return


def stop_tree(proc: Optional[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop ``proc`` and every process under it; reap ``proc``."""
    if proc is None:
        return
    stop_processes(descendants(proc.pid) | {proc.pid}, grace_s)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def flower_env(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(FLOWER_ENV)
    env["FLWR_HOME"] = str(flwr_home)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def flower_command(name: str) -> str:
    """The Flower command installed next to the running Python (it is the one that matches it)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _parent_death_signal() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start(args: Sequence[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start a command with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(args), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_parent_death_signal)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# ---- addresses and the SuperLink ----------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost); 0.0.0.0 and :: do not."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_host(address: str) -> str:
    """The host of ``host:port`` (IPv6 in brackets allowed)."""
    return address.rpartition(":")[0].strip("[]")


OPEN_PREFIXES = ("/v1/fleet/",)  # what other machines may ask the SuperLink: the SuperNodes' Fleet API


class LocalControl:
    """ASGI middleware: requests from other machines reach only the Fleet API (``OPEN_PREFIXES``);
    the Control and Runtime APIs (and anything else) answer them 403. ``local`` holds the addresses
    that count as this machine besides loopback (the address the SuperLink listens on)."""

    def __init__(self, app, local: Sequence[str] = ()):
        self.app = app
        self.local = {_normal(a) for a in local}

    def allowed(self, scope) -> bool:
        if scope["type"] not in ("http", "websocket") or scope.get("path", "").startswith(OPEN_PREFIXES):
            return True
        client = scope.get("client")
        peer = _normal(client[0]) if client else ""
        return is_loopback(peer) or peer in self.local

    async def __call__(self, scope, receive, send):
        if self.allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = (b"fedguide: this SuperLink answers its Control and Runtime APIs on its own machine only; "
                b"other machines reach its Fleet API (SuperNodes)\n")
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _normal(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _addresses_of(host: str) -> list[str]:
    if host in ("", "0.0.0.0", "::") or is_loopback(host):
        return []
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except OSError:
        return [host]


def superlink_command(args: Sequence[str]) -> list[str]:
    """The command that runs ``flower-superlink ARGS`` behind ``LocalControl``."""
    return [sys.executable, "-m", "fedguide.fl.runtimes.flower.processes", "superlink", *args]


def run_superlink(args: Sequence[str]) -> None:
    """``flower-superlink ARGS`` (Flower 1.42) with ``LocalControl`` outermost in its HTTP app."""
    import argparse

    from starlette.middleware import Middleware
    import flwr.superlink.main as superlink_app
    from flwr.superlink.cli import flower_superlink

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    host = parser.parse_known_args(list(args))[0].host
    flower_middleware = superlink_app._get_middleware  # pylint: disable=protected-access

    def middleware():
        return [Middleware(LocalControl, local=_addresses_of(host)), *flower_middleware()]

    superlink_app._get_middleware = middleware  # pylint: disable=protected-access
    sys.argv = ["flower-superlink", *args]
    sys.exit(flower_superlink())


if __name__ == "__main__":
    if sys.argv[1:2] != ["superlink"]:
        sys.exit("usage: python -m fedguide.fl.runtimes.flower.processes superlink [flower-superlink options]")
    run_superlink(sys.argv[2:])
