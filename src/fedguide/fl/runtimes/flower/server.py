"""The server side of a Flower deployment (``runtime.name: flower``): what ``fedguide serve`` runs.

``fedguide serve CONFIG`` writes a Flower app into ``<run dir>/flower/app`` (a pyproject.toml whose
ServerApp and ClientApp are fedguide's and whose run config names the run directory), starts
``flower-superlink`` (one HTTP port for SuperNodes, the ``flwr`` command and the ServerApp) and
submits the app with ``flwr run``. The SuperLink starts the ServerApp in a process of its own; that
ServerApp runs fedguide's round loop (``deployed_experiment``) and writes the run directory exactly as
a local run does (config.yaml, partition.json, metrics.jsonl, checkpoints, model.safetensors,
summary.json). ``serve`` prints the ServerApp's log lines as they come and stops the SuperLink, and
every process under it, by their ids when the run ends, fails or is interrupted.

The round loop's clients are ``deployed_clients.DeployedClients``, the executor of the ``flower``
runtime (deployment.py), which the ServerApp hands a Grid.

Decisions:
- Security (README "Running on several machines"): with ``runtime.tls`` the SuperLink serves HTTPS
  (Flower's ``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``) and ``flwr run`` checks it against the
  CA (``root-certificates`` in the run's FLWR_HOME/config.toml); with ``runtime.auth.public_keys``
  it starts with ``--enable-supernode-auth`` and ``serve`` registers every listed key
  (``flwr supernode register``) before the run, so only those SuperNodes are admitted. Without
  ``runtime.tls`` it runs ``--insecure``, which ``serve`` allows beyond loopback only with an
  explicit ``--insecure``. Flower 1.42 hands the same certificates to the SuperLink's own
  ServerApp, whose Runtime API connection (to 127.0.0.1 or the ``--host`` address) is then TLS too.
- The SuperLink runs behind ``processes.LocalControl``: its Control and Runtime APIs (submit a run,
  register a key) answer this machine only, since Flower 1.42 serves them on the Fleet API's port
  without authentication.
"""
from __future__ import annotations

import json
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import fedguide
from fedguide.config import Config, load_config, to_yaml
from fedguide.core.atomic import write_json, write_text
from fedguide.fl.engine import Experiment
from fedguide.fl.runtimes.flower.deployment import Deployment, flower_params
from fedguide.fl.runtimes.flower.messages import FlowerRuntimeFailed
from fedguide.fl.runtimes.flower.processes import (command_line, descendants, flower_command, flower_env, is_loopback,
                                                   log_tail, port_open, start, stop_tree, superlink_command)
from fedguide.fl.runtimes.flower.protocol import APP_NAME, APP_PUBLISHER
from fedguide.fl.runtimes.flower.security import TLSParams, check_certificate, check_exposure, public_keys_in
from fedguide.fl.run_folder import RunFolder
from fedguide.fl.setup import Prepared, prepare
from fedguide.registry import ConfigError

START_TIMEOUT_S = 300  # the SuperLink up, the ServerApp process started; a busy machine takes a while
SUBMIT_TIMEOUT_S = 120
REGISTER_AT_ONCE = 4  # `flwr supernode register` processes running together
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
        cfg = RunFolder(run_dir).read_config() if resume else load_config(flower_dir / "requested-config.yaml")
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
    return Experiment(prepared, run_dir, log=log, runtime=Deployment(prepared.resolved.runtime.params, grid=grid))


def flower_server_app():
    """The ServerApp that runs fedguide's round loop; _server_app.py names it for Flower."""
    from flwr.serverapp import ServerApp

    app = ServerApp()
    app.main()(server_main)
    return app


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
            "components": {"serverapp": "fedguide.fl.runtimes.flower._server_app:server_app",
                           "clientapp": "fedguide.fl.runtimes.flower._client_app:client_app"},
            "config": {"run-dir": str(Path(run_dir).resolve()), "resume": bool(resume)},
        }}},
    }
    write_text(app / "pyproject.toml", tomli_w.dumps(pyproject))
    return app


# ---- the SuperLink and `fedguide serve` -------------------------------------------------------------
def superlink_port(cfg: Config) -> int:
    return int(cfg.runtime.superlink.rpartition(":")[2])


class SuperLink:
    """A ``flower-superlink`` process (and the ServerApps it starts) serving runs from ``folder``.

    ``tls``: serve HTTPS with its cert/key (else plain HTTP, ``--insecure``); ``public_keys``: the
    OpenSSH public keys of the only SuperNodes admitted (needs ``tls``), registered before it returns.
    """

    def __init__(self, folder: Path, port: int, host: str = "127.0.0.1", tls: Optional[TLSParams] = None,
                 public_keys: Sequence[str] = ()):
        self.folder = Path(folder).resolve()
        self.home = self.folder / "home"
        self.log_path = self.folder / "superlink.log"
        self.env = {**flower_env(self.home), "FORWARDED_ALLOW_IPS": "127.0.0.1"}  # see processes.LocalControl
        reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.address = f"[{reach}]:{port}" if ":" in reach else f"{reach}:{port}"
        if port_open(reach, port):
            raise ConfigError(f"port {port} on {reach} is already in use; set runtime.superlink to a free port")
        if public_keys and (tls is None or tls.cert is None):
            raise ConfigError("SuperNode authentication needs TLS: set runtime.tls.ca, runtime.tls.cert and "
                              "runtime.tls.key on the server")
        if tls is not None and (tls.cert is None or tls.key is None):
            raise ConfigError("runtime.tls on the server needs cert and key (the SuperLink's certificate and its "
                              "private key) besides ca")
        args = ["--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
        if tls is None:
            args.append("--insecure")
        else:
            args += ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]
        if public_keys:
            args.append("--enable-supernode-auth")
        self.proc = start(superlink_command(args), self.env, self.log_path)
        try:
            deadline = time.time() + START_TIMEOUT_S
            while not port_open(reach, port):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise FlowerRuntimeFailed(f"the SuperLink did not start; last lines of {self.log_path}:\n"
                                              f"{log_tail(self.log_path)}")
                time.sleep(0.1)
            if tls is not None:
                check_certificate(reach, port, tls)
            self.home.mkdir(parents=True, exist_ok=True)
            # `flwr run` and `flwr supernode register` find the SuperLink through FLWR_HOME/config.toml.
            trust = "insecure = true" if tls is None else f"root-certificates = {json.dumps(str(tls.ca))}"
            write_text(self.home / "config.toml", f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                                                  f'[superlink.{CONNECTION}]\naddress = "{self.address}"\n{trust}\n')
            self.nodes = self.register(public_keys)
        except BaseException:
            self.close()
            raise

    def register(self, public_keys: Sequence[str]) -> dict[str, int]:
        """Admit the SuperNodes of these OpenSSH public keys (``flwr supernode register``); key -> node id."""
        keys = list(dict.fromkeys(k.strip() for k in public_keys))
        folder = self.folder / "supernode-keys"
        nodes: dict[str, int] = {}
        for first in range(0, len(keys), REGISTER_AT_ONCE):
            running = []
            for i, key in enumerate(keys[first:first + REGISTER_AT_ONCE], first):
                path = folder / f"{i}.pub"
                write_text(path, key + "\n")
                running.append((key, path, subprocess.Popen(
                    [flower_command("flwr"), "supernode", "register", str(path), CONNECTION, "--format", "json"],
                    env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
            for key, path, proc in running:
                try:
                    out = proc.communicate(timeout=SUBMIT_TIMEOUT_S)[0]
                except subprocess.TimeoutExpired:
                    stop_tree(proc)
                    raise FlowerRuntimeFailed(f"flwr supernode register {path} did not return within "
                                              f"{SUBMIT_TIMEOUT_S} s") from None
                answer = _json_in(out)
                if not answer.get("success"):
                    raise FlowerRuntimeFailed(f"the SuperLink did not register the public key {path} "
                                              f"({key[:40]}...): {answer.get('error-message') or out.strip()}")
                nodes[key] = int(answer["node-id"])
        return nodes

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
        answer = _json_in(out.stdout)
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


def _json_in(text: str) -> dict[str, Any]:
    """The JSON object ``flwr ... --format json`` prints after its other output; {} if none."""
    try:
        return json.loads(text[text.index("{"):])
    except ValueError:
        return {}


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
          log: Callable[[str], None] = print, insecure: bool = False) -> dict[str, Any]:
    """``fedguide serve``: a SuperLink for one run, the run, and every process stopped at the end.

    A ``host`` beyond loopback needs ``runtime.tls`` or ``insecure``."""
    if resume:
        cfg = RunFolder(run_dir).read_config()
    elif cfg is None:
        raise ValueError("a new run needs its config")
    if cfg.runtime.name != "flower":
        raise ConfigError(f"fedguide serve runs runtime.name=flower; this config has {cfg.runtime.name!r} "
                          "(set runtime.name=flower, or use fedguide run)")
    flower_dir = Path(run_dir).resolve() / "flower"
    with open_superlink(cfg, flower_dir, host, insecure, log) as link:
        return start_run(link, run_dir, cfg, resume, log)


def open_superlink(cfg: Config, folder: Path, host: str = "127.0.0.1", insecure: bool = False,
                   log: Callable[[str], None] = print) -> SuperLink:
    """The SuperLink ``serve`` runs for ``cfg``: refused beyond loopback without TLS unless ``insecure``,
    with TLS from ``runtime.tls`` and the keys of ``runtime.auth.public_keys`` registered."""
    params = flower_params(cfg)
    warning = check_exposure(host, params.tls, insecure)
    if warning:
        log(warning)
    keys = [k for path in (params.auth.public_keys if params.auth else []) for k in public_keys_in(path)]
    if params.tls is not None and not keys and not is_loopback(host):
        log("warning: runtime.auth.public_keys is not set: any machine that reaches the SuperLink's port can join "
            "as a client")
    link = SuperLink(folder, superlink_port(cfg), host, tls=params.tls, public_keys=keys)
    security = "TLS" if params.tls else "plain HTTP"
    security += f", {len(link.nodes)} SuperNode keys admitted" if keys else ""
    log(f"SuperLink listening on {host}:{superlink_port(cfg)} ({security}; log {link.log_path}); clients connect to "
        f"{cfg.runtime.superlink}")
    return link
