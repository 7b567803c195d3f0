"""Flower's simulation engine on fedguide's FedAvg workload: the `flower` variant of parallel_clients.py.

Same config, data, partition, model, initial weights, optimiser and local loop as fedguide (all taken
from fedguide itself); only the orchestration is Flower's. Flower runs at its fastest setting on a
CPU machine: one Ray actor per core, each single-threaded.

    .venv/bin/python benchmarks/flower_baseline.py [--rounds 3] [--actors N] [--timeout S] [overrides ...]

Decisions:
- Flower's Message API (ServerApp with a main function and a Grid, ClientApp with a train function,
  the FedAvg of flwr.serverapp.strategy), driven by flwr.simulation.run_simulation, which runs the
  server in a thread of the calling process and the clients in Ray actors.
- The whole simulation runs in a child process in its own process group: a stuck actor or a Ray
  start-up that never finishes is then ended by a wall-clock timeout, and every process the
  simulation started is stopped with it, so the benchmark can neither hang nor leave Ray behind.
- Ray is started here (num_cpus = actors, no dashboard, a private temporary directory removed
  afterwards) before Flower's backend would start it, so its start-up time is measured on its own.
- A round's time is measured at the server from building the train messages to having aggregated
  the replies (Flower's FedAvg aggregation included; it takes milliseconds for this model, while
  fedguide reports its aggregation outside train_seconds). Federated evaluation is switched off
  (fraction_evaluate=0) and there is no server-side evaluation.
- Each actor process builds the data and the model once per workload (a module-level cache keyed
  by the config path and overrides) instead of receiving them with every message; the messages
  carry only the global weights and the config reference, as a Flower deployment would.
- The client loop is fedguide's train_local for FedAvg spelled out: per epoch a random permutation
  of the client's indices, mini-batches gathered by index from the in-memory tensors, cross
  entropy, zero_grad/backward/step, a fresh optimiser every round, and the random streams derived
  from (seed, round, client) as fedguide derives them.
- Only FedAvg with epoch-based local training is modelled; other configs are refused.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# Read by Flower at import time: no dependency installs, no telemetry, no update check, no network.
os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG = REPO / "configs/fmnist_dir0.1.yaml"
CONFIG_KEY, OVERRIDES_KEY = "fedguide-config", "fedguide-overrides"
# The child imports this file as a module (never as __main__), so Ray pickles the client function
# by reference and the per-process cache below survives from one message to the next.
CHILD_ENTRY = "import sys, flower_baseline; flower_baseline.child_main(sys.argv[1])"


# ---- client side (runs inside the Ray actors) ---------------------------------------------------
_WORKLOAD: dict[str, Any] = {}  # key -> (prepared, live model); one workload per actor process
_BUILDS = {"count": 0}


def _workload(config: str, overrides_json: str):
    key = f"{config}\n{overrides_json}"
    if key not in _WORKLOAD:
        from fedguide.config import load_config
        from fedguide.fl.setup import prepare
        from fedguide.models import build_model

        _WORKLOAD.clear()  # a new workload replaces the old one: one copy of the data per process
        prepared = prepare(load_config(Path(config), json.loads(overrides_json)))
        model = build_model(prepared.config.model.name, prepared.resolved.model.params, prepared.data.splits.model_spec())
        _WORKLOAD[key] = (prepared, model)
        _BUILDS["count"] += 1
    return _WORKLOAD[key]


def _load_arrays(model, arrays) -> None:
    import torch

    state = model.state_dict()
    with torch.no_grad():
        for name, value in arrays.to_torch_state_dict().items():
            # averaged integer buffers (e.g. BatchNorm's batch counter) arrive as floats
            state[name].copy_(value if state[name].is_floating_point() else value.round())


def local_sgd(model, data, train, generator) -> tuple[float, int]:
    """fedguide's train_local for FedAvg with epoch-based training; returns (mean loss, steps)."""
    import torch
    import torch.nn.functional as F

    from fedguide.core.training import has_batchnorm, make_optimizer

    n = len(data)
    optimizer = make_optimizer(model, train)
    model.train()
    min_batch = 2 if has_batchnorm(model) else 1
    loss_sum, steps = torch.zeros(()), 0
    for _ in range(train.epochs):
        order = data.indices[torch.randperm(n, generator=generator)]
        for start in range(0, n, train.batch_size):
            batch = order[start: start + train.batch_size]
            if batch.numel() < min_batch:
                continue
            loss = F.cross_entropy(model(data.x[batch]), data.y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            steps += 1
    if steps and not torch.isfinite(loss_sum):
        raise FloatingPointError(f"client {data.client_id} diverged (loss {float(loss_sum)}); lower train.lr")
    return (float(loss_sum) / steps if steps else float("nan")), steps


def client_train(msg, context):
    """The ClientApp's train function: load the global weights, train locally, reply with weights."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    from fedguide.core.seeding import derive_seed, torch_generator

    torch.set_num_threads(1)
    config = msg.content["config"]
    prepared, model = _workload(str(config[CONFIG_KEY]), str(config[OVERRIDES_KEY]))
    cfg = prepared.config
    client_id, round_ = int(context.node_config["partition-id"]), int(config["server-round"])
    data = prepared.data.client(client_id)
    _load_arrays(model, msg.content["arrays"])
    torch.manual_seed(derive_seed(cfg.seed, "client", round_, client_id))
    t0 = time.perf_counter()
    loss, steps = local_sgd(model, data, cfg.train, torch_generator(cfg.seed, "client", round_, client_id))
    fit_seconds = time.perf_counter() - t0
    metrics = MetricRecord({"num-examples": len(data), "train-loss": loss, "steps": steps,
                            "fit-seconds": fit_seconds, "pid": os.getpid(), "data-builds": _BUILDS["count"]})
    reply = RecordDict({"arrays": ArrayRecord.from_torch_state_dict(model.state_dict()), "metrics": metrics})
    return Message(reply, reply_to=msg)


# ---- server side (runs in the child process) ----------------------------------------------------
def _mean_loss(records, weight_key: str):
    from flwr.app import MetricRecord

    weights = [float(next(iter(r.metric_records.values()))[weight_key]) for r in records]
    losses = [float(next(iter(r.metric_records.values()))["train-loss"]) for r in records]
    return MetricRecord({"train-loss": sum(w * x for w, x in zip(weights, losses)) / max(sum(weights), 1.0)})


def _timed_fedavg(expected: int, **kwargs):
    """Flower's FedAvg, timing each round's train phase and refusing incomplete rounds."""
    from flwr.serverapp.strategy import FedAvg

    class TimedFedAvg(FedAvg):
        def __init__(self):
            super().__init__(**kwargs)
            self.rounds: list[dict[str, Any]] = []

        def configure_train(self, server_round, arrays, config, grid):
            self._t0 = time.perf_counter()  # the train messages are built and sent from here
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            t_received = time.perf_counter()
            replies = list(replies)
            errors = [m.error.reason for m in replies if m.has_error()]
            if errors or len(replies) != expected:
                # Flower wraps a client's exception in a long Ray traceback; its last line names it.
                first = errors[0].strip().strip("'>").splitlines()[-1][:300] if errors else "none"
                raise RuntimeError(f"round {server_round}: {len(replies)} of {expected} clients replied, "
                                   f"{len(errors)} with an error (first: {first})")
            out = super().aggregate_train(server_round, replies)
            t_done = time.perf_counter()
            metrics = [m.content["metrics"] for m in replies]
            self.rounds.append({
                "round": server_round,
                "seconds": t_done - self._t0,
                "receive_seconds": t_received - self._t0,
                "aggregate_seconds": t_done - t_received,
                "client_fit_seconds": sum(float(m["fit-seconds"]) for m in metrics),
                "steps": sum(int(m["steps"]) for m in metrics),
                "actor_builds": {int(m["pid"]): int(m["data-builds"]) for m in metrics},
                "ended_at": time.time(),
            })
            return out

    return TimedFedAvg()


def _check_workload(cfg) -> None:
    from fedguide.registry import ConfigError

    if cfg.method.name != "fedavg" or cfg.regularizers:
        extra = " with regularizers" if cfg.regularizers else ""
        raise ConfigError(f"the Flower baseline runs FedAvg only, not '{cfg.method.name}'{extra}; "
                          "set method.name=fedavg and no regularizers")
    if cfg.train.local_steps is not None:
        raise ConfigError("the Flower baseline trains whole epochs; unset train.local_steps")
    if cfg.train.rounds < 2:
        raise ConfigError(f"train.rounds={cfg.train.rounds}: round 1 is a warm-up, so at least 2 rounds are needed")


def child_main(spec_path: str) -> None:
    """Run the simulation described by the spec file and write its timings next to it."""
    stamps = {"child_started": time.time()}
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["result"])
    try:
        result = _simulate(spec, stamps)
    except Exception as err:  # reported to the parent with its type; the traceback goes to the log
        import traceback

        traceback.print_exc()
        out.write_text(json.dumps({"error": f"{type(err).__name__}: {err}",
                                   "config_error": type(err).__name__ == "ConfigError"}))
        sys.exit(1)
    out.write_text(json.dumps(result))


def _simulate(spec: dict[str, Any], stamps: dict[str, float]) -> dict[str, Any]:
    import ray
    import torch
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedguide.config import load_config
    from fedguide.fl.setup import prepare
    from fedguide.core.seeding import derive_seed
    from fedguide.models import build_model

    stamps["imported"] = time.time()
    overrides = spec["overrides"]
    prepared = prepare(load_config(Path(spec["config"]), overrides))
    cfg = prepared.config
    _check_workload(cfg)
    torch.manual_seed(derive_seed(cfg.seed, "model"))  # fedguide's initial global model
    model = build_model(cfg.model.name, prepared.resolved.model.params, prepared.data.splits.model_spec())
    initial = ArrayRecord.from_torch_state_dict(model.state_dict())
    num, per_round = cfg.clients.num, min(cfg.clients.per_round, cfg.clients.num)
    strategy = _timed_fedavg(per_round, fraction_train=per_round / num, min_train_nodes=per_round,
                             min_available_nodes=num, fraction_evaluate=0.0, train_metrics_aggr_fn=_mean_loss)
    train_config = ConfigRecord({CONFIG_KEY: spec["config"], OVERRIDES_KEY: json.dumps(overrides)})

    server = ServerApp()

    @server.main()
    def _main(grid, context):
        stamps["server_started"] = time.time()
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=cfg.train.rounds,
                       timeout=spec["round_timeout"], train_config=train_config)

    client = ClientApp()
    client.train()(client_train)
    stamps["prepared"] = time.time()

    ray.init(num_cpus=spec["actors"], include_dashboard=False, _temp_dir=spec["ray_dir"],
             logging_level="WARNING", log_to_driver=True)
    try:
        stamps["ray_started"] = time.time()
        run_simulation(server_app=server, client_app=client, num_supernodes=num,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
        stamps["simulation_returned"] = time.time()
    finally:
        ray.shutdown()
        stamps["ray_stopped"] = time.time()
    if len(strategy.rounds) != cfg.train.rounds:
        raise RuntimeError(f"the simulation ended after {len(strategy.rounds)} of {cfg.train.rounds} rounds")
    return {"rounds": strategy.rounds, "stamps": stamps, "clients": num, "per_round": per_round,
            "train_samples": int(sum(len(i) for i in prepared.data.client_indices))}


# ---- the parent: runs the child under a timeout ------------------------------------------------
def _group_members(pgid: int) -> list[int]:
    """Ids of the live processes in process group ``pgid`` (Linux /proc; empty elsewhere)."""
    members: list[int] = []
    if not Path("/proc").is_dir():
        return members
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # exited ones need no stopping
                members.append(int(entry.name))
    return members


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def _stop_group(pgid: int) -> list[str]:
    """Stop every process left in the child's group, by process id; returns their command lines."""
    left = _group_members(pgid)
    commands = [f"{pid} {_command(pid)}" for pid in left]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 5
        while time.time() < deadline and _group_members(pgid):
            time.sleep(0.1)
        if not _group_members(pgid):
            break
    return commands


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def require_flower() -> None:
    missing = [m for m in ("flwr", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed; pip install 'flwr[simulation]'")


def flower_run(config: Path, overrides: list[str], actors: int, timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Run the workload on Flower's simulation engine; per-round timings and start-up phases."""
    from fedguide.config import load_config

    require_flower()
    config = Path(config).resolve()
    overrides = list(overrides)
    cfg = load_config(config, overrides)
    _check_workload(cfg)  # refuse early, before any process starts
    timeout_s = timeout_s or 600 + 300 * cfg.train.rounds
    with tempfile.TemporaryDirectory(prefix="flower-", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        spec = {"config": str(config), "overrides": overrides, "actors": int(actors), "round_timeout": timeout_s,
                "ray_dir": str(tmp / "ray"), "result": str(tmp / "result.json")}
        (tmp / "spec.json").write_text(json.dumps(spec))
        (tmp / "flwr_home").mkdir()
        env = {**os.environ, "FLWR_HOME": str(tmp / "flwr_home"),
               "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
        log_path = tmp / "simulation.log"
        t0 = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", CHILD_ENTRY, str(tmp / "spec.json")], cwd=tmp, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop_group(proc.pid)
                proc.wait()
                raise TimeoutError(f"Flower simulation did not finish within {timeout_s:.0f} s and was stopped "
                                   f"(pass a larger timeout if the machine is slow); last lines of its log:\n"
                                   f"{_tail(log_path)}") from None
            except BaseException:
                _stop_group(proc.pid)
                raise
            finally:
                leftovers = _stop_group(proc.pid)
        wall = time.time() - t0
        result = json.loads((tmp / "result.json").read_text()) if (tmp / "result.json").exists() else None
        if rc != 0 or result is None or "error" in result:
            reason = result["error"] if result else f"exit status {rc}"
            if result and result.get("config_error"):
                from fedguide.registry import ConfigError

                raise ConfigError(reason.split(": ", 1)[-1])
            raise RuntimeError(f"Flower simulation failed ({reason}); last lines of its log:\n{_tail(log_path)}")
        result["stamps"]["parent_started"] = t0
        result["wall_seconds"] = wall
        result["leftover_processes"] = leftovers
        result["actors"] = int(actors)
        return result


def flower_rounds(config: Path, overrides: list[str], actors: int, timeout_s: Optional[float] = None) -> list[float]:
    """Seconds of the train phase of rounds 2..R (round 1 is a warm-up)."""
    return [r["seconds"] for r in flower_run(config, overrides, actors, timeout_s)["rounds"][1:]]


def startup_phases(result: dict[str, Any]) -> dict[str, float]:
    s = result["stamps"]
    first = result["rounds"][0]
    return {
        "interpreter + imports": s["imported"] - s["parent_started"],
        "data + model on the server": s["prepared"] - s["imported"],
        "ray.init": s["ray_started"] - s["prepared"],
        "simulation start to ServerApp main": s["server_started"] - s["ray_started"],
        "round 1 (actors start, build data)": first["seconds"],
        "after last round to Ray stopped": s["ray_stopped"] - result["rounds"][-1]["ended_at"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--actors", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--timeout", type=float, default=None, help="seconds before the simulation is stopped")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = [f"train.rounds={args.rounds}", *args.overrides]  # an explicit train.rounds override wins
    from fedguide.registry import ConfigError

    try:
        res = flower_run(args.config, overrides, args.actors, args.timeout)
    except (ConfigError, ImportError, RuntimeError, TimeoutError) as err:
        sys.exit(f"flower_baseline: {err}")
    print(f"workload: {args.config.name} {' '.join(overrides)}; {res['clients']} clients "
          f"({res['per_round']} per round, {res['train_samples']} samples); {args.actors} actors x 1 thread")
    for name, seconds in startup_phases(res).items():
        print(f"  {name:<38} {seconds:7.2f} s")
    print(f"  {'whole run':<38} {res['wall_seconds']:7.2f} s")
    for r in res["rounds"]:
        print(f"round {r['round']}: {r['seconds']:.3f} s (replies after {r['receive_seconds']:.3f} s, aggregation "
              f"{1e3 * r['aggregate_seconds']:.1f} ms; clients' SGD {r['client_fit_seconds']:.2f} s over "
              f"{r['steps']} steps; actor pid: data builds {r['actor_builds']})")
    timed = [r["seconds"] for r in res["rounds"][1:]]
    print(f"flower per round {[round(t, 3) for t in timed]}  median {statistics.median(timed):.3f} s "
          f"(rounds 2..{len(res['rounds'])})")
    if res["leftover_processes"]:
        print(f"warning: stopped {len(res['leftover_processes'])} process(es) the simulation left behind: "
              f"{res['leftover_processes']}")


if __name__ == "__main__":
    main()
