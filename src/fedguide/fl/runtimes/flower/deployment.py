"""The ``flower`` runtime: a Flower deployment, a SuperLink and one SuperNode per client, on as many
machines as there are. ``fedguide serve`` starts it (server.py: the SuperLink and the ServerApp, which
runs the round loop with this runtime and the deployment's Grid); every client machine runs
``fedguide client`` (node.py). Its executor is ``deployed_clients.DeployedClients``.

``runtime.tls`` and ``runtime.auth`` are Flower's TLS and SuperNode authentication for a deployment
beyond this machine (security.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedguide.fl.runtime import DEFAULT_THREADS, RUNTIMES, Executor, RunHandle, Runtime
from fedguide.fl.runtimes.flower.deployed_clients import ClientStatesOnClients, DeployedClients
from fedguide.fl.runtimes.flower.security import AuthParams, TLSParams
from fedguide.registry import ConfigError

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
