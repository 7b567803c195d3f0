"""The server side of a Flower deployment (``runtime.name: flower``): what ``fedguide serve`` runs.

``fedguide serve CONFIG`` writes a Flower app into ``<run dir>/flower/app`` (a pyproject.toml whose
ServerApp and ClientApp are fedguide's and whose run config names the run directory), starts
``flower-superlink`` (one HTTP port for SuperNodes, the ``flwr`` command and the ServerApp) and
submits the app with ``flwr run``. The SuperLink starts the ServerApp in a process of its own; that
ServerApp runs fedguide's round loop (``DeployedExperiment``) and writes the run directory exactly as
a local run does (config.yaml, partition.json, metrics.jsonl, checkpoints, model.safetensors,
summary.json). ``serve`` prints the ServerApp's log lines as they come and stops the SuperLink, and
every process under it, by their ids when the run ends, fails or is interrupted.

The round loop's clients are ``deployed_clients.DeployedClients``, the executor of the ``flower``
runtime (``fl/runtimes/flower.py``), which the ServerApp hands a Grid.

Decisions:
- The SuperLink and the clients run without TLS (``--insecure``): fine on localhost or a trusted
  network; see README "Running on several machines".
"""
from __future__ import annotations

import json
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import fedguide
from fedguide.config import Config, load_config, to_yaml
from fedguide.core.atomic import write_json, write_text
from fedguide.fl.engine import Experiment
from fedguide.fl.flower.messages import FlowerRuntimeFailed
from fedguide.fl.flower.processes import command_line, descendants, flower_command, flower_env, log_tail, port_open, start, stop_tree
from fedguide.fl.flower.protocol import APP_NAME, APP_PUBLISHER
from fedguide.fl.runtimes.flower import Deployment
from fedguide.fl.setup import Prepared, load_run_config, prepare
from fedguide.registry import ConfigError

START_TIMEOUT_S = 300  # the SuperLink up, the ServerApp process started; a busy machine takes a while
SUBMIT_TIMEOUT_S = 120
CONNECTION = "fedguide"  # the SuperLink connection's name in the run's FLWR_HOME/config.toml


# ---- the ServerApp ----------------------------------------------------------------------------------
def _appender(path: Path) -> Callable[[str], None]:
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    return log


def server_main(grid, context) -> None:
    run_dir = Path(str(context.run_config["run-dir"]))
    resume = bool(context.run_config["resume"])
    flower_dir = run_dir / "flower"
    log = _appender(flower_dir / "server.log")
    outcome: dict[str, Any] = {"status": "failed", "error": "the ServerApp stopped before the run began"}
    try:
        cfg = load_run_config(run_dir) if resume else load_config(flower_dir / "requested-config.yaml")
        summary = deployed_experiment(prepare(cfg), run_dir, grid, log).run(resume=resume)
        outcome = {"status": "completed", "final_accuracy": summary["final_accuracy"]}
    except BaseException as err:
        outcome = {"status": "failed", "error": str(err), "type": type(err).__name__,
                   "config_error": isinstance(err, ConfigError),
                   "resumable": (run_dir / "config.yaml").is_file()}
        log(f"error: {type(err).__name__}: {err}")
        _appender(flower_dir / "server-traceback.log")(traceback.format_exc())
        raise
    finally:
        write_json(flower_dir / "outcome.json", outcome)


def deployed_experiment(prepared: Prepared, run_dir: Path, grid, log: Callable[[str], None] = print) -> Experiment:
    """fedguide's round loop with its clients on the SuperNodes that ``grid`` reaches."""
    params = prepared.params["runtime"]
    return Experiment(prepared, run_dir, log=log, runtime=Deployment(params, grid=grid))


def _server_app():
    from flwr.serverapp import ServerApp

    app = ServerApp()
    app.main()(server_main)
    return app


server_app = _server_app()  # named in the Flower app's pyproject.toml (serverapp = "...deploy:server_app")


def write_app(run_dir: Path, resume: bool) -> Path:
    """The Flower app of a run: a pyproject.toml naming fedguide's ServerApp/ClientApp and the run."""
    import tomli_w

    app = Path(run_dir) / "flower" / "app"
    pyproject = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": APP_NAME, "version": fedguide.__version__, "license": "Apache-2.0",
                    "description": "a fedguide run on a Flower deployment", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": APP_PUBLISHER,
            "components": {"serverapp": "fedguide.fl.flower.deploy:server_app",
                           "clientapp": "fedguide.fl.flower.node:client_app"},
            "config": {"run-dir": str(Path(run_dir).resolve()), "resume": bool(resume)},
        }}},
    }
    write_text(app / "pyproject.toml", tomli_w.dumps(pyproject))
    return app


# ---- the SuperLink and `fedguide serve` -------------------------------------------------------------
def superlink_port(cfg: Config) -> int:
    return int(cfg.runtime.superlink.rpartition(":")[2])


class SuperLink:
    """A ``flower-superlink`` process (and the ServerApps it starts) serving runs from ``folder``."""

    def __init__(self, folder: Path, port: int, host: str = "127.0.0.1"):
        self.folder = Path(folder).resolve()
        self.home = self.folder / "home"
        self.log_path = self.folder / "superlink.log"
        self.env = flower_env(self.home)
        reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.address = f"{reach}:{port}"
        if port_open(reach, port):
            raise ConfigError(f"port {port} on {reach} is already in use; set runtime.superlink to a free port")
        self.proc = start([flower_command("flower-superlink"), "--insecure", "--host", host, "--port", str(port),
                           "--disable-runtime-dependency-installation"], self.env, self.log_path)
        try:
            deadline = time.time() + START_TIMEOUT_S
            while not port_open(reach, port):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise FlowerRuntimeFailed(f"the SuperLink did not start; last lines of {self.log_path}:\n"
                                              f"{log_tail(self.log_path)}")
                time.sleep(0.1)
            self.home.mkdir(parents=True, exist_ok=True)
            # `flwr run` finds the SuperLink through FLWR_HOME/config.toml.
            write_text(self.home / "config.toml", f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                                                  f'[superlink.{CONNECTION}]\naddress = "{self.address}"\ninsecure = true\n')
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SuperLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        stop_tree(self.proc)

    def submit(self, app_dir: Path) -> str:
        """``flwr run`` the app; returns Flower's run id."""
        try:
            out = subprocess.run([flower_command("flwr"), "run", str(app_dir), CONNECTION, "--format", "json"],
                                 env=self.env, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FlowerRuntimeFailed(f"flwr run did not return within {SUBMIT_TIMEOUT_S} s") from None
        try:
            answer = json.loads(out.stdout[out.stdout.index("{"):])
        except ValueError:
            answer = {}
        if not answer.get("success"):
            raise FlowerRuntimeFailed(f"flwr run failed: {answer.get('error-message') or out.stderr or out.stdout}")
        return str(answer["run-id"])

    def _serverapps(self) -> set[int]:
        return {p for p in descendants(self.proc.pid) if "flwr-serverapp" in command_line(p)}

    def wait(self, run_dir: Path, log: Callable[[str], None], poll_s: float = 0.2) -> dict[str, Any]:
        """Echo the ServerApp's log until its outcome is written; the outcome."""
        flower_dir = Path(run_dir) / "flower"
        outcome_path, log_path = flower_dir / "outcome.json", flower_dir / "server.log"
        offset, seen, gone_since = 0, False, None
        deadline = time.time() + START_TIMEOUT_S
        while True:
            offset = _echo(log_path, offset, log)
            if outcome_path.is_file():
                _echo(log_path, offset, log)
                return json.loads(outcome_path.read_text())
            if self.proc.poll() is not None:
                raise FlowerRuntimeFailed(f"the SuperLink stopped (exit code {self.proc.returncode}); last lines "
                                          f"of {self.log_path}:\n{log_tail(self.log_path)}")
            running = bool(self._serverapps())
            seen = seen or running
            if seen and not running:
                gone_since = gone_since or time.time()
                if time.time() - gone_since > 5:  # its outcome file would be there by now
                    raise FlowerRuntimeFailed(f"the ServerApp process ended without a result; last lines of "
                                              f"{self.log_path}:\n{log_tail(self.log_path, 30)}")
            elif not seen and time.time() > deadline:
                raise FlowerRuntimeFailed(f"the SuperLink did not start the ServerApp within {START_TIMEOUT_S} s; "
                                          f"see {self.log_path}")
            time.sleep(poll_s)


def _echo(path: Path, offset: int, log: Callable[[str], None]) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            fh.seek(offset)
            text = fh.read()
    except OSError:
        return offset
    complete = text[:text.rfind("\n") + 1]  # a line still being written waits for the next look
    for line in complete.splitlines():
        log(line)
    return offset + len(complete.encode())


def start_run(link: SuperLink, run_dir: Path, cfg: Optional[Config], resume: bool,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Submit one run to a running SuperLink and wait for it; its summary, or the run's error raised."""
    run_dir = Path(run_dir).resolve()
    flower_dir = run_dir / "flower"
    flower_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_text(flower_dir / "requested-config.yaml", to_yaml(cfg))
    for stale in ("outcome.json", "server.log"):
        (flower_dir / stale).unlink(missing_ok=True)
    link.submit(write_app(run_dir, resume))
    outcome = link.wait(run_dir, log)
    if outcome["status"] != "completed":
        error = ConfigError if outcome.get("config_error") else FlowerRuntimeFailed
        raise error(outcome.get("error", "the run failed"))
    return json.loads((run_dir / "summary.json").read_text())


def serve(run_dir: Path, cfg: Optional[Config] = None, resume: bool = False, host: str = "127.0.0.1",
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """``fedguide serve``: a SuperLink for one run, the run, and every process stopped at the end."""
    if resume:
        cfg = load_run_config(run_dir)
    elif cfg is None:
        raise ValueError("a new run needs its config")
    if cfg.runtime.name != "flower":
        raise ConfigError(f"fedguide serve runs runtime.name=flower; this config has {cfg.runtime.name!r} "
                          "(set runtime.name=flower, or use fedguide run)")
    flower_dir = Path(run_dir).resolve() / "flower"
    with SuperLink(flower_dir, superlink_port(cfg), host) as link:
        log(f"SuperLink listening on {host}:{superlink_port(cfg)} (log {link.log_path}); clients connect to "
            f"{cfg.runtime.superlink}")
        return start_run(link, run_dir, cfg, resume, log)
