"""What each runtime adds to the same FedAvg workload: start-up time and steady per-round time.

    .venv/bin/python benchmarks/runtime_overhead.py [--rounds 5] [--only local,flower-sim,...] [overrides ...]

Runtimes, each run through fedguide's own command line, one after another, with the same config:
- ``local``: ``fedguide run`` (clients one after another in the server process);
- ``flower-sim``: ``fedguide run`` with runtime.name=flower-sim (Ray actors, one per core);
- ``flower`` (long-lived): ``fedguide serve`` + one ``fedguide client`` per client on this machine,
  each a SuperNode with fedguide's long-lived ClientApp process;
- ``flower`` (per-message): the same with runtime.client_process=per-message, Flower's own
  ``flwr-clientapp`` process per message.

Measures, from each command's own output, timestamped as it is printed:
- start-up: from starting the processes to the start of round 1 (round 1's end minus its duration);
- round 1 (it builds the clients' run contexts: the first message of a run) and the steady round
  (median of rounds 2..R), each as metrics.jsonl reports it, and the clients' summed fit seconds;
- deployment only: when the SuperLink was up, the ServerApp reported, all clients had connected.

Decisions:
- Workload: configs/fmnist_dir0.1.yaml with 10% of the data and the MLP (a round computes in about
  0.2 s, so what a runtime adds shows; model.name=cnn weighs it down), 3 clients all sampled every round,
  one torch thread per process (runtime.threads_per_worker=1, so every runtime computes the same
  numbers); override anything on the command line.
- Clients are started together with the server (as one would on several machines at once); the
  benchmark stops every process it started, by its id, when a runtime is done or fails.
- The machine may be busy with other work: the numbers are one measurement each, not medians of
  repeats; the script prints the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))

from fedguide.fl.runtimes.flower.processes import free_port, stop_tree  # noqa: E402

CONFIG = REPO / "configs/fmnist_dir0.1.yaml"
WORKLOAD = ["data.fraction=0.1", "model.name=mlp", "clients.num=3", "clients.per_round=3", "runtime.threads_per_worker=1"]
FEDGUIDE = [sys.executable, "-m", "fedguide.cli"]
RUNTIMES = ("local", "flower-sim", "flower", "flower-per-message")
TIMEOUT_S = 900


class Timestamped:
    """A process whose output lines are read, with the time each arrived, by a background thread."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     stdin=subprocess.DEVNULL, cwd=REPO)
        self.lines: "queue.Queue[tuple[float, str]]" = queue.Queue()
        self.seen: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put((time.perf_counter(), line.rstrip("\n")))

    def wait(self, timeout: float, helpers: list[subprocess.Popen]) -> int:
        deadline = time.perf_counter() + timeout
        while self.proc.poll() is None:  # a helper (client) that dies would leave the server waiting
            dead = [h for h in helpers if h.poll() is not None]
            if dead or time.perf_counter() > deadline:
                raise RuntimeError(f"a client exited (code {dead[0].returncode})" if dead else "timed out")
            time.sleep(0.2)
        code = self.proc.returncode
        time.sleep(0.2)  # the reader's last lines
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code

    def first(self, fragment: str, t0: float):
        return next((t - t0 for t, line in self.seen if fragment in line), None)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("FEDGUIDE_OFFLINE", "1")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e["PYTHONUNBUFFERED"] = "1"
    e["COLUMNS"] = "200"
    return e


def measure(runtime: str, overrides: list[str], work: Path) -> dict:
    run_dir = work / runtime
    name = "flower" if runtime.startswith("flower") and runtime != "flower-sim" else runtime
    over = overrides + [f"runtime.name={name}"]
    num = int(next(o.split("=")[1] for o in reversed(overrides) if o.startswith("clients.num=")))
    clients: list[subprocess.Popen] = []
    server = None
    t0 = time.perf_counter()
    try:
        if name == "flower":
            over += [f"runtime.superlink=127.0.0.1:{free_port()}"]
            if runtime == "flower-per-message":
                over += ["runtime.client_process=per-message"]
            for cid in range(num):
                with open(work / f"{runtime}-client-{cid}.log", "w") as log:
                    clients.append(subprocess.Popen(
                        FEDGUIDE + ["client", "--partition-id", str(cid), str(CONFIG), *over,
                                    "--out", str(work / f"{runtime}-client-{cid}")],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env(), cwd=REPO))
            server = Timestamped(FEDGUIDE + ["serve", str(CONFIG), *over, "--out", str(run_dir)], env())
        else:
            server = Timestamped(FEDGUIDE + ["run", str(CONFIG), *over, "--out", str(run_dir)], env())
        code = server.wait(TIMEOUT_S, clients)
        wall = time.perf_counter() - t0
    finally:
        if server is not None:
            stop_tree(server.proc)
        for c in clients:
            stop_tree(c)
    if code != 0:
        tail = "\n".join(line for _, line in server.seen[-15:])
        raise RuntimeError(f"{runtime} failed (exit code {code}):\n{tail}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    round1_end = server.first("round   1/", t0)
    steady = [r["seconds"] for r in rows[1:]]
    return {
        "runtime": runtime, "wall": wall, "startup": round1_end - rows[0]["seconds"],
        "round1": rows[0]["seconds"], "steady": statistics.median(steady) if steady else float("nan"),
        "steady_all": steady, "fit": statistics.median(r["client_fit_seconds"] for r in rows[1:] or rows),
        "accuracy": rows[-1]["accuracy"],
        "superlink_up": server.first("SuperLink listening", t0),
        "serverapp_up": server.first("clients connected: 0 of", t0) or server.first("clients connected:", t0),
        "connected": server.first(f" connected: {num} of {num}", t0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(RUNTIMES), help="comma-separated subset of " + ", ".join(RUNTIMES))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = WORKLOAD + [f"train.rounds={args.rounds}"] + args.overrides
    runtimes = [r for r in args.only.split(",") if r]
    for r in runtimes:
        if r not in RUNTIMES:
            parser.error(f"unknown runtime {r!r}; choose from {', '.join(RUNTIMES)}")
    import torch
    import flwr

    load0 = os.getloadavg()
    print(f"# workload: {CONFIG.name} {' '.join(overrides)}")
    print(f"# {os.cpu_count()} cores, torch {torch.__version__}, flwr {flwr.__version__}; load average before "
          f"{load0[0]:.2f} (other work on this machine makes every number noisy: one measurement each)")
    results = []
    with tempfile.TemporaryDirectory(prefix="fedguide-runtime-overhead-") as tmp:
        for r in runtimes:
            res = measure(r, overrides, Path(tmp))
            results.append(res)
            print(f"# {r}: rounds {', '.join(f'{s:.2f}' for s in res['steady_all'])} s after round 1 "
                  f"({res['round1']:.2f} s); final accuracy {100 * res['accuracy']:.2f}%", flush=True)
    base = next((x for x in results if x["runtime"] == "local"), None)
    print(f"{'runtime':<20} {'start-up':>9} {'round 1':>8} {'steady':>8} {'fit/round':>10} "
          f"{'start-up vs local':>18} {'steady vs local':>16}")
    for x in results:
        ratio = (lambda k: f"{x[k] / base[k]:.2f}x" if base else "-")
        print(f"{x['runtime']:<20} {x['startup']:8.2f}s {x['round1']:7.2f}s {x['steady']:7.2f}s {x['fit']:9.2f}s "
              f"{ratio('startup'):>18} {ratio('steady'):>16}")
    for x in results:
        if x["superlink_up"] is not None:
            print(f"{x['runtime']}: SuperLink up {x['superlink_up']:.1f} s, ServerApp reporting "
                  f"{x['serverapp_up']:.1f} s, all clients connected {x['connected']:.1f} s, round 1 began "
                  f"{x['startup']:.1f} s after start")
    if base:
        for x in results:
            if x is not base:
                print(f"{x['runtime']}: {x['steady'] - base['steady']:+.2f} s per steady round and "
                      f"{x['startup'] - base['startup']:+.1f} s of start-up over local")
    load1 = os.getloadavg()
    print(f"# load average after {load1[0]:.2f}")


if __name__ == "__main__":
    main()
