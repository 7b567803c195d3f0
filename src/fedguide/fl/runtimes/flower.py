"""The ``flower`` runtime: a Flower deployment, a SuperLink and one SuperNode per client, on as many
machines as there are. ``fedguide serve`` starts it (fl/flower/deploy.py: the SuperLink and the
ServerApp, which runs the round loop with this runtime and the deployment's Grid); every client
machine runs ``fedguide client`` (fl/flower/node.py). Its executor is
``fl.flower.deployed_clients.DeployedClients``."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedguide.fl.flower.deployed_clients import ClientStatesOnClients, DeployedClients
from fedguide.fl.runtimes.base import DEFAULT_THREADS, RUNTIMES, Executor, RunHandle, Runtime
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


@RUNTIMES.register("flower", summary="a Flower deployment: 'fedguide serve' and one 'fedguide client' per client")
class Deployment(Runtime):
    Params = FlowerParams

    def __init__(self, params: FlowerParams, grid=None):
        super().__init__(params)
        self.grid = grid  # the deployment's Grid, handed over by the ServerApp

    @classmethod
    def refuses(cls, run_dir: Optional[Path], resume: bool) -> Optional[str]:
        if resume:
            return f"{run_dir} ran on a Flower deployment; continue it with: fedguide serve --resume {run_dir}"
        return ("runtime.name=flower runs on a Flower deployment: start 'fedguide serve CONFIG' and one "
                "'fedguide client --partition-id I CONFIG' per client (README \"Running on several machines\")")

    def resources(self, clients_per_round: int, num_params: int) -> tuple[int, int]:
        return clients_per_round, self.params.threads_per_worker or DEFAULT_THREADS

    def start(self, run: RunHandle) -> Executor:
        if self.grid is None:
            raise ConfigError(self.refuses(run.run_dir, resume=False))
        cfg = run.prepared.config
        clients = DeployedClients(self.grid, self.params, cfg, run.run_dir, run.ctx.num_clients, run.log,
                                  threads=self.resources(cfg.clients.per_round, run.ctx.layout.numel)[1])
        for folder in (run.run_dir / "client_state" / "committed", run.run_dir / "client_state"):
            try:
                folder.rmdir()  # made empty when the run was opened; client state lives on the clients
            except OSError:
                pass
        run.ctx.store = ClientStatesOnClients(clients)  # methods hold ctx itself, so they see this
        if run.checkpoint is not None:
            clients.restore(run.checkpoint.metrics)
        clients.connect()
        return clients
