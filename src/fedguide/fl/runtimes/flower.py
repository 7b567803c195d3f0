"""The ``flower`` runtime: a Flower deployment, a SuperLink and one SuperNode per client, on as many
machines as there are. ``fedguide serve`` starts it (fl/flower/deploy.py: the SuperLink and the
ServerApp, which runs the round loop with this runtime and the deployment's Grid); every client
machine runs ``fedguide client`` (fl/flower/node.py). Its executor is
``fl.flower.deployed_clients.DeployedClients``.

``runtime.tls`` and ``runtime.auth`` are Flower's TLS and SuperNode authentication for a deployment
beyond this machine: paths on the machine that reads the config (server and clients may differ; the
config fingerprint leaves ``runtime`` out), checked here so a missing file fails before any process
starts."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fedguide.fl.flower.deployed_clients import ClientStatesOnClients, DeployedClients
from fedguide.fl.runtimes.base import DEFAULT_THREADS, RUNTIMES, Executor, RunHandle, Runtime
from fedguide.registry import ConfigError

NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")
HOW_TO_MAKE = 'README "Running on several machines" shows how to make them'


def _existing_file(value: Optional[Path], where: str, what: str) -> Optional[Path]:
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value} is not a file on this machine; set {where} to {what} ({HOW_TO_MAKE})")
    return path.resolve()


def public_keys_in(path: Path) -> list[str]:
    """The OpenSSH public keys of a file (one a line, '#' comments and blank lines skipped), each
    checked to be an EC key on a NIST curve, the kind Flower's SuperNode authentication takes."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    keys = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = load_ssh_public_key(line.encode())
        except (ValueError, TypeError, UnsupportedAlgorithm) as err:
            raise ValueError(f"{path} line {number} is not an OpenSSH public key ({err})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in NIST_CURVES:
            raise ValueError(f"{path} line {number} is not an ECDSA key on a NIST curve (make one with "
                             "ssh-keygen -t ecdsa -b 384)")
        keys.append(line)
    if not keys:
        raise ValueError(f"{path} holds no public key")
    return keys


class TLSParams(BaseModel):
    """Flower's TLS: the SuperLink serves HTTPS with ``cert``/``key``; the SuperNodes and the server's own
    ``flwr``/ServerApp connections check it against ``ca``."""
    model_config = ConfigDict(extra="forbid")
    ca: Path = Field(description="PEM certificate of the CA that signed the SuperLink's certificate (server and "
                                 "clients)")
    cert: Optional[Path] = Field(None, description="server: the SuperLink's PEM certificate, naming the address the "
                                                   "clients use and 127.0.0.1 (or the --host address)")
    key: Optional[Path] = Field(None, description="server: the PEM private key of cert")

    @field_validator("ca", "cert", "key")
    @classmethod
    def _exists(cls, value: Optional[Path], info: ValidationInfo) -> Optional[Path]:
        what = {"ca": "the CA certificate (PEM)", "cert": "the SuperLink's certificate (PEM)",
                "key": "the SuperLink's private key (PEM)"}[info.field_name]
        return _existing_file(value, f"runtime.tls.{info.field_name}", what)

    @model_validator(mode="after")
    def _pair(self) -> "TLSParams":
        if (self.cert is None) != (self.key is None):
            raise ValueError("runtime.tls.cert and runtime.tls.key go together (the SuperLink's certificate and "
                             "its private key, on the server)")
        return self


class AuthParams(BaseModel):
    """Flower's SuperNode authentication: the SuperLink admits the SuperNodes whose public keys
    ``fedguide serve`` registered (the allow-list), each proving its key with every request."""
    model_config = ConfigDict(extra="forbid")
    public_keys: list[Path] = Field(
        default_factory=list, description="server: the allow-list, files of OpenSSH ECDSA public keys (one a line) of "
                                          "the clients' SuperNodes; registered when 'fedguide serve' starts, any "
                                          "other SuperNode is refused")
    private_key: Optional[Path] = Field(
        None, description="client: this client's SuperNode private key, OpenSSH ECDSA without a passphrase "
                          "(ssh-keygen -t ecdsa -b 384 -N '' -f client-0)")

    @field_validator("public_keys")
    @classmethod
    def _public(cls, value: list[Path]) -> list[Path]:
        what = "files of the clients' OpenSSH public keys"
        paths = [_existing_file(p, "runtime.auth.public_keys", what) for p in value]
        for path in paths:
            public_keys_in(path)
        return paths

    @field_validator("private_key")
    @classmethod
    def _private(cls, value: Optional[Path]) -> Optional[Path]:
        path = _existing_file(value, "runtime.auth.private_key", "this client's OpenSSH private key")
        if path is not None:
            from cryptography.exceptions import UnsupportedAlgorithm
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.hazmat.primitives.serialization import load_ssh_private_key

            try:
                key = load_ssh_private_key(path.read_bytes(), None)
            except (ValueError, TypeError, UnsupportedAlgorithm) as err:
                raise ValueError(f"{value} is not an OpenSSH private key without a passphrase ({err}); make one "
                                 "with ssh-keygen -t ecdsa -b 384 -N ''") from None
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{value} is not an ECDSA key; make one with ssh-keygen -t ecdsa -b 384 -N ''")
        return path

    @model_validator(mode="after")
    def _something(self) -> "AuthParams":
        if not self.public_keys and self.private_key is None:
            raise ValueError("runtime.auth needs public_keys (server: the clients' public keys) or private_key "
                             "(client: its own key)")
        return self


class FlowerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    threads_per_worker: Optional[int] = Field(
        None, ge=1, description="torch intra-op threads of each client process; null = torch's default")
    superlink: str = Field(
        "127.0.0.1:9092", description="host:port of the SuperLink as the clients reach it; 'fedguide serve' "
                                      "listens on its port")
    min_clients: Optional[int] = Field(
        None, ge=1, description="a round counts when at least this many of its sampled clients reply; the "
                                "others are recorded as failed; null = every sampled client")
    round_timeout: Optional[float] = Field(
        None, gt=0, description="seconds a round waits for replies before counting the missing clients as "
                                "failed; null = until Flower reports their SuperNode gone")
    connect_timeout: float = Field(600.0, gt=0, description="seconds the server waits for every client to connect")
    client_process: Literal["long-lived", "per-message"] = Field(
        "long-lived", description="client side: long-lived = one process per client trains every message (torch "
                                  "and the data load once); per-message = Flower's own flwr-clientapp process "
                                  "per message")
    tls: Optional[TLSParams] = Field(
        None, description="TLS between the clients and the SuperLink: {ca, cert, key} on the server, {ca} on a "
                          "client; needed for any SuperLink beyond 127.0.0.1 unless --insecure is given")
    auth: Optional[AuthParams] = Field(
        None, description="SuperNode authentication (needs tls): {public_keys: [...]} on the server, "
                          "{private_key: ...} on a client")

    @model_validator(mode="after")
    def _auth_over_tls(self) -> "FlowerParams":
        if self.auth is not None and self.tls is None:
            raise ValueError("runtime.auth needs runtime.tls: Flower authenticates SuperNodes over TLS only; set "
                             "runtime.tls.ca (and, on the server, runtime.tls.cert and runtime.tls.key)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_workers(cls, data: Any) -> Any:
        if isinstance(data, dict) and "workers" in data:
            if data["workers"] != 1:
                raise ValueError("runtime.workers does not apply to runtime.name=flower (each client is its own "
                                 "process); remove it, and set runtime.threads_per_worker for the clients' threads")
            data = {k: v for k, v in data.items() if k != "workers"}
        return data

    @field_validator("superlink")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"runtime.superlink {value!r} is not host:port; write e.g. 127.0.0.1:9092")
        return value


def flower_params(cfg) -> FlowerParams:
    """The ``runtime`` section of a ``runtime.name: flower`` config, validated."""
    return RUNTIMES.parse_params(cfg.runtime.name, cfg.runtime.params_dict(), "runtime")


@RUNTIMES.register("flower", summary="a Flower deployment: 'fedguide serve' and one 'fedguide client' per client")
class Deployment(Runtime):
    Params = FlowerParams
    extras = ("flower",)

    def __init__(self, params: FlowerParams, grid=None):
        super().__init__(params)
        self.grid = grid  # the deployment's Grid, handed over by the ServerApp

    @classmethod
    def refuses(cls, run_dir: Optional[Path], resume: bool) -> Optional[str]:
        if resume:
            return f"{run_dir} ran on a Flower deployment; continue it with: fedguide serve --resume {run_dir}"
        return ("runtime.name=flower runs on a Flower deployment: start 'fedguide serve CONFIG' and one "
                "'fedguide client --partition-id I CONFIG' per client (README \"Running on several machines\")")

    def resources(self, clients_per_round: int, num_params: int, device: Optional[torch.device] = None
                  ) -> tuple[int, int]:
        return clients_per_round, self.params.threads_per_worker or DEFAULT_THREADS

    def start(self, run: RunHandle) -> Executor:
        if self.grid is None:
            raise ConfigError(self.refuses(run.run_dir, resume=False))
        cfg = run.prepared.config
        clients = DeployedClients(self.grid, self.params, cfg, run.run_dir, run.ctx.num_clients, run.log,
                                  threads=run.threads)
        run.ctx.store = ClientStatesOnClients(clients)  # methods hold ctx itself, so they see this
        if run.checkpoint is not None:
            clients.restore(run.checkpoint.metrics)
        clients.connect()
        return clients
