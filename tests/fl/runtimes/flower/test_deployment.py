"""The flower deployment runtime: config agreement, failed clients, client state on the clients, and
runs identical to the local runtime — through an in-process loopback Grid (fast) and through a real
SuperLink with three `fedguide client` processes on localhost (e2e)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedguide.config import build_config
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config, tiny_raw, without_timing

pytest.importorskip("flwr")

from fedguide.fl.runtimes.flower import node as client_side, server  # noqa: E402
from fedguide.fl.runtimes.flower.deployment import FlowerParams  # noqa: E402
from fedguide.fl.runtimes.flower.messages import FlowerClientFailed  # noqa: E402
from fedguide.fl.runtimes.flower.processes import alive, command_line, descendants, free_port, stop_tree  # noqa: E402
from fedguide.fl.runtimes.flower.protocol import comparable, differences, fingerprint, run_key  # noqa: E402
from tests.fl.runtimes.flower.loopback import LoopbackGrid, deployed_clients  # noqa: E402

DEPLOY_KEYS = {"failed_clients", "client_errors"}
FLOWER = {"name": "flower", "workers": 1, "threads_per_worker": 1}


def deployed_rows(rows):
    return [{k: v for k, v in r.items() if k not in DEPLOY_KEYS} for r in without_timing(rows)]


def files(run_dir: Path, skip: str) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                  if p.is_file() and not str(p.relative_to(run_dir)).startswith(skip))


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the experiment both sides agree on ---------------------------------------------------------
def test_fingerprint_ignores_machine_local_keys_and_differences_name_the_rest():
    base = tiny_config()
    elsewhere = tiny_config(data={"root": "/data/here"}, runtime=FLOWER, meta={"git_commit": "abc"})
    assert fingerprint(base) == fingerprint(elsewhere)
    other = tiny_config(train={"lr": 0.01})
    assert fingerprint(other) != fingerprint(base)
    assert differences(comparable(base), comparable(other)) == ["train.lr: 0.05 (server) vs 0.01 (client)"]
    assert run_key(Path("/a/run")) != run_key(Path("/b/run")) and run_key(Path("/a/run")).startswith("run-")


def test_runtime_config_refuses_what_a_deployment_cannot_use():
    with pytest.raises(ValueError, match="runtime.workers does not apply"):
        FlowerParams(workers=2)
    with pytest.raises(ValueError, match="not host:port"):
        FlowerParams(superlink="localhost")
    assert FlowerParams().min_clients is None


def test_the_local_supernode_is_retried_while_it_runs_and_not_once_it_exited():
    """A transport error to the client's own SuperNode is retried (it may still be starting), but once its process
    has exited the call gives up at once: before, a refused client waited RUNTIME_RETRY_S (20 s) before it could
    report the refusal or start a new SuperNode."""
    import httpx

    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise httpx.ConnectError("connection refused")
        return "answered"

    assert client_side._retry(lambda: True).invoke(flaky) == "answered"  # retried until it answers
    assert len(calls) == 3
    calls.clear()
    t0 = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        client_side._retry(lambda: False).invoke(flaky)
    assert len(calls) == 1 and time.monotonic() - t0 < 1.0


def test_run_and_resume_point_a_flower_config_to_serve(tmp_path, capsys):
    from fedguide.cli import main

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_raw(runtime=FLOWER)))
    assert main(["run", str(tmp_path / "tiny.yaml"), "--quiet", "--out", str(tmp_path / "run")]) == 2
    assert "fedguide serve CONFIG" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---- a deployment through an in-process Grid ----------------------------------------------------
@pytest.fixture
def loopback(tmp_path, monkeypatch):
    def make(cfg, client_cfg=None) -> LoopbackGrid:
        return deployed_clients(monkeypatch, tmp_path, cfg, client_cfg)
    return make


def run_deployed(tmp_path, cfg, grid, name="deployed", resume=False):
    lines: list[str] = []
    run_dir = tmp_path / name
    summary = server.deployed_experiment(prepare(cfg), run_dir, grid, log=lines.append).run(resume=resume)
    return summary, read_rows(run_dir), run_dir, lines


@pytest.mark.parametrize("method", [{"name": "fedavg"}, {"name": "scaffold"}, {"name": "local"}])
def test_deployed_run_matches_local_and_keeps_client_state_on_the_clients(tmp_path, loopback, method):
    """`local` reads every client's state on the server to evaluate: it is fetched from the clients."""
    layers = {"method": method, "clients": {"num": 3, "per_round": 2}, "train": {"rounds": 3}}
    _, local_rows, local_dir = run_tiny(tmp_path, tiny_config(layers), "local")
    cfg = tiny_config(layers, runtime=FLOWER)
    summary, rows, run_dir, _ = run_deployed(tmp_path, cfg, loopback(cfg))

    assert deployed_rows(rows) == deployed_rows(local_rows)
    assert all(r["failed_clients"] == [] and r["client_errors"] == {} for r in rows)
    assert summary["runtime"] == "flower" and summary["client_failures"] == [] and summary["workers"] == 3
    assert files(run_dir, "flower") == files(local_dir, "client_state")  # no client state on the server
    local_states = sorted((local_dir / "client_state" / "committed").glob("*/tensors.safetensors"))
    assert (method["name"] == "fedavg") == (local_states == [])
    for path in local_states:
        cid = path.parent.name
        on_client = tmp_path / f"client-{cid}" / "runs" / run_key(run_dir) / "client_state" / "committed" / cid
        a, b = load_file(path), load_file(on_client / "tensors.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), cid
        assert not list(on_client.parent.parent.glob("pending-*")), "the final round's state was committed"


def test_a_silent_client_is_dropped_recorded_and_not_asked_again(tmp_path, loopback):
    layers = {"clients": {"num": 3, "per_round": 3}, "train": {"rounds": 3}}
    cfg = tiny_config(layers, runtime={**FLOWER, "min_clients": 2, "round_timeout": 0.3})
    grid = loopback(cfg)
    grid.silent[9000 + 7 * 1] = 2  # client 1's machine dies before round 2
    summary, rows, _, lines = run_deployed(tmp_path, cfg, grid)

    assert [r["failed_clients"] for r in rows] == [[], [1], [1]]
    assert "no reply within runtime.round_timeout=0.3 s" in rows[1]["client_errors"]["1"]
    assert "failed earlier in this run" in rows[2]["client_errors"]["1"]
    assert [(f["round"], f["client"]) for f in summary["client_failures"]] == [(2, 1), (3, 1)]
    assert len(summary["accuracy_curve"]) == 3 and rows[2]["bytes_up"] == 2 * rows[0]["bytes_up"] / 3
    assert sum(1 for node, kind in grid.delivered if node == 9007 and kind == "train") == 1  # round 1 only
    assert any("round 2: client 1 failed" in line for line in lines)


def test_without_min_clients_a_failing_client_stops_the_run_at_its_checkpoint(tmp_path, loopback):
    cfg = tiny_config(train={"rounds": 1, "lr": 1e12}, runtime=FLOWER)
    with pytest.raises(FlowerClientFailed, match=r"round 1: 0 of 2 clients replied, 2 needed \(every sampled "
                                                 r"client(.|\n)*client \d: FloatingPointError: client \d diverged"):
        run_deployed(tmp_path, cfg, loopback(cfg))
    assert not (tmp_path / "deployed" / "summary.json").exists()


def test_a_resumed_deployment_drops_the_aborted_round_state_and_matches_local(tmp_path, loopback):
    """SCAFFOLD; client 1 goes silent in round 2 (no min_clients): the run stops at round 1's
    checkpoint while the other client of round 2 has written pending state. Resumed with every
    client answering, the run ends exactly as a local run: the aborted round's write was dropped."""
    layers = {"method": {"name": "scaffold"}, "clients": {"num": 3, "per_round": 2}, "train": {"rounds": 3}}
    _, local_rows, _ = run_tiny(tmp_path, tiny_config(layers), "local")
    cfg = tiny_config(layers, runtime={**FLOWER, "round_timeout": 0.3})
    grid = loopback(cfg)
    chosen = local_rows[1]["clients"]
    grid.silent[9000 + 7 * chosen[0]] = 2
    with pytest.raises(FlowerClientFailed, match=f"client {chosen[0]} failed in round 2"):
        run_deployed(tmp_path, cfg, grid)
    other = tmp_path / f"client-{chosen[1]}" / "runs" / run_key(tmp_path / "deployed") / "client_state"
    assert (other / "pending-2").is_dir()
    _, rows, _, _ = run_deployed(tmp_path, cfg, _answering(grid), resume=True)
    assert deployed_rows(rows) == deployed_rows(local_rows)


def _answering(grid: LoopbackGrid) -> LoopbackGrid:
    grid.silent.clear()
    grid.pending.clear()
    return grid


def test_a_client_with_another_config_is_refused_with_the_keys_named(tmp_path, loopback):
    cfg = tiny_config(runtime=FLOWER)
    with pytest.raises(ConfigError, match=r"train.lr: 0.05 \(server\) vs 0.01 \(client\)"):
        run_deployed(tmp_path, cfg, loopback(cfg, client_cfg=tiny_config(train={"lr": 0.01})))


def test_the_flower_app_names_fedguide_and_the_run(tmp_path):
    import tomllib

    app = tomllib.loads((server.write_app(tmp_path / "run", resume=True) / "pyproject.toml").read_text())
    flwr = app["tool"]["flwr"]["app"]
    assert flwr["components"] == {"serverapp": "fedguide.fl.runtimes.flower._server_app:server_app",
                                  "clientapp": "fedguide.fl.runtimes.flower._client_app:client_app"}
    assert flwr["config"] == {"run-dir": str((tmp_path / "run").resolve()), "resume": True}


# ---- a real deployment on localhost ---------------------------------------------------------------
def start_client(tmp_path: Path, cid: int, config: Path, overrides: list[str]) -> subprocess.Popen:
    with open(tmp_path / f"client-{cid}.out", "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "fedguide.cli", "client", "--partition-id", str(cid),
                                 str(config), *overrides, "--out", str(tmp_path / f"client-{cid}")],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def train_messages_received(client_dir: Path) -> int:
    try:
        return (client_dir / "supernode.log").read_text(errors="replace").count("Receiving: train message")
    except OSError:
        return 0


@pytest.mark.e2e
def test_deployment_on_localhost_matches_local_and_survives_a_killed_supernode(tmp_path):
    """SuperLink + 3 `fedguide client` processes (SuperNode + long-lived ClientApp), two runs of 2 rounds:
    FedAvg as in the local runtime; then, with runtime.min_clients=2, client 2's SuperNode and its
    process are killed (SIGKILL) once its round-1 message arrived: the run completes with the others."""
    port = free_port()
    layers = {"clients": {"num": 3, "per_round": 3}, "train": {"rounds": 2}}
    raw = tiny_raw(layers, runtime={**FLOWER, "superlink": f"127.0.0.1:{port}", "connect_timeout": 120})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(raw))
    _, local_rows, local_dir = run_tiny(tmp_path, tiny_config(layers), "local")
    cfg = prepare(build_config(raw)).config

    clients: list[subprocess.Popen] = []
    link = None
    started: set[int] = set()  # every process of this test, to check that none is left
    try:
        clients = [start_client(tmp_path, cid, tmp_path / "tiny.yaml", []) for cid in range(3)]
        link = server.SuperLink(tmp_path / "link", port)
        lines: list[str] = []
        summary = server.start_run(link, tmp_path / "run", cfg, resume=False, log=lines.append)
        rows = read_rows(tmp_path / "run")
        assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in local_rows]
        assert deployed_rows(rows) == deployed_rows(local_rows)
        assert summary["client_failures"] == [] and summary["workers"] == 3
        assert files(tmp_path / "run", "flower") == files(local_dir, "client_state")

        # Run 2, same experiment; the runtime section (not part of the experiment) tolerates a loss. The round
        # waits round_timeout for the killed client; the live ones, warm from run 1, answer in a fraction of a second.
        tolerant = build_config({**cfg.model_dump(mode="json"),
                                 "runtime": {**raw["runtime"], "min_clients": 2, "round_timeout": 10}})
        before = train_messages_received(tmp_path / "client-2")
        outcome: dict = {}

        def second_run():
            try:
                outcome["summary"] = server.start_run(link, tmp_path / "run2", tolerant, False, lines.append)
            except BaseException as err:  # reported below
                outcome["error"] = err
        thread = threading.Thread(target=second_run)
        thread.start()
        deadline = time.time() + 120
        while train_messages_received(tmp_path / "client-2") == before and thread.is_alive():
            assert time.time() < deadline, "client 2 received no train message"
            time.sleep(0.02)
        victim = clients[2]
        supernodes = {p for p in descendants(victim.pid) if "flower-supernode" in command_line(p)}
        os.kill(victim.pid, signal.SIGSTOP)  # frozen: it cannot replace its SuperNode
        for pid in supernodes:
            os.kill(pid, signal.SIGKILL)
        os.kill(victim.pid, signal.SIGKILL)  # the machine is gone
        victim.wait(timeout=10)
        thread.join(timeout=240)
        assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
        rows2 = read_rows(tmp_path / "run2")
        failed = [r["failed_clients"] for r in rows2]
        assert [2] in failed and all(f in ([], [2]) for f in failed)
        first = failed.index([2])
        assert failed[first:] == [[2]] * (len(failed) - first)  # not asked again once failed
        assert outcome["summary"]["client_failures"][0]["client"] == 2
        assert len(outcome["summary"]["accuracy_curve"]) == 2
        assert any("client 2 failed" in line for line in lines)
        started = {link.proc.pid, *descendants(link.proc.pid)}
        for c in clients:
            started |= {c.pid, *descendants(c.pid)}
    finally:
        if link is not None:
            link.close()
        for c in clients:
            stop_tree(c)
    assert not [p for p in started if alive(p)], "a process of the deployment is still running"
    assert all(c.poll() is not None for c in clients)
