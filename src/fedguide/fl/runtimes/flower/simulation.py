"""The ``flower-sim`` runtime: every client a virtual SuperNode of Flower's simulation engine (Ray
actors) on this machine; the executor is ``simulated_clients.FlowerClients``, which imports Flower only
when it starts."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.device import is_gpu_like
from fedguide.fl.runtime import RUNTIMES, Executor, RunHandle, Runtime
from fedguide.fl.runtimes.flower.simulated_clients import FlowerClients, actors_and_threads


class FlowerSimParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = Field(
        "auto", description="Ray actors training the clients: a number = that many; auto = one per core (at most "
                            "the clients of a round)")
    threads_per_worker: Optional[int] = Field(None, ge=1, description="torch threads per actor; null = 1")
    gpus_per_client: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="share of a GPU each actor reserves (Ray's num_gpus); null = 1/actors "
                                          "when train.device is a GPU (the actors share it), else 0")


@RUNTIMES.register("flower-sim", summary="clients as virtual SuperNodes of Flower's simulation engine "
                                         "(pip install 'flwr[simulation]')")
class FlowerSim(Runtime):
    Params = FlowerSimParams
    extras = ("flower",)

    def resources(self, clients_per_round: int, num_params: int, device: Optional[torch.device] = None
                  ) -> tuple[int, int]:
        if self.params.workers == "auto" and device is not None and is_gpu_like(device):
            return 1, self.params.threads_per_worker or 1  # one actor per GPU unless asked (runtimes/local.py)
        return actors_and_threads(self.params, clients_per_round)

    def start(self, run: RunHandle) -> Executor:
        gpus = self.params.gpus_per_client
        if gpus is None:
            gpus = 1.0 / run.workers if run.ctx.device.type == "cuda" else 0.0
        return FlowerClients(run.workers, run.threads, run.run_dir, run.ctx.num_clients, gpus)
