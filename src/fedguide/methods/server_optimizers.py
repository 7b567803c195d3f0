"""Server optimisers (``server_optimizer:``), usable with any method: the step from the global weights to the
method's aggregate taken as a pseudo-gradient, as FedOpt does (Reddi et al. 2021, "Adaptive federated
optimization", Alg. 2; FedAvgM: Hsu et al. 2019). The rules are pure functions in ``core.server_updates``.

``average`` (the default) keeps the method's aggregate as the next global model, which is what every method
does without a server optimiser. The others turn FedAvg into FedAvgM, FedAdagrad, FedAdam or FedYogi, and
compose the same way with any other method whose global weights are the model's (FedProx + server Adam is
``method.name=fedprox server_optimizer.name=adam``). A server optimiser is applied by ``compose.Hooks`` after
the method (and its regularisers) aggregated; its state is checkpointed with the method's under the keys
``server_optimizer.<key>``, so a resumed run continues its moments exactly.

Defaults: beta1 0.9, beta2 0.99 and tau 1e-3 are the values Reddi et al. fix or find best across tasks
(Sec. 5 and App. D); their server learning rate is tuned per task on a grid, so lr (0.01 for the adaptive
rules, 1.0 with momentum 0.9 for FedAvgM, Hsu et al.'s setting) is a starting point to tune, not a result.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.server_updates import adaptive_step, avgm_step
from fedguide.registry import ConfigError, NoParams, Registry

SERVER_OPTIMIZERS: Registry = Registry("server optimizer")


class ServerOptimizer:
    """The identity: the method's aggregate is the next global model."""

    Params: ClassVar[type[BaseModel]] = NoParams
    name: ClassVar[str] = "average"
    label: ClassVar[str] = ""  # appended to the method's name in summaries ("fedavg+server_adam"); "" for none

    def __init__(self, params: BaseModel, mask: Optional[torch.Tensor] = None):
        self.params = params
        self.mask = mask  # True on trainable parameters; None: every entry
        self.state: dict[str, torch.Tensor] = {}
        self.t = 0  # server steps taken

    def step(self, global_weights: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        return aggregate

    def _mask_for(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if self.mask is None:
            return None
        if self.mask.numel() != x.numel():
            raise ConfigError(f"server_optimizer.name={self.name} steps the model's weights, but this method's "
                              f"global state has {x.numel()} values where the model has {self.mask.numel()}; "
                              "use server_optimizer.name=average with this method")
        return self.mask.to(x.device)

    def server_state(self) -> dict[str, torch.Tensor]:
        if not self.state:
            return {}
        return {**self.state, "t": torch.tensor(self.t, dtype=torch.int64)}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        self.t = int(state.pop("t").item()) if "t" in state else 0
        self.state = state


SERVER_OPTIMIZERS.register("average", summary="the method's aggregate is the next global model (no server optimiser)")(
    ServerOptimizer)


class AvgMParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1.0, gt=0.0, description="server learning rate eta (Hsu et al. 2019: 1.0)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="server momentum beta (Hsu et al. 2019: 0.9)")


@SERVER_OPTIMIZERS.register("avgm", params=AvgMParams, summary="FedAvgM: server momentum (Hsu et al. 2019)")
class ServerMomentum(ServerOptimizer):
    Params = AvgMParams
    name = "avgm"
    label = "server_avgm"
    paper = "https://arxiv.org/abs/1909.06335"

    def step(self, global_weights: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        out, self.state = avgm_step(global_weights, aggregate, self.state, self.params.lr, self.params.momentum,
                                    self._mask_for(global_weights))
        self.t += 1
        return out


class AdaptiveParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(0.01, gt=0.0, description="server learning rate eta (tuned per task in Reddi et al.)")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="first-moment decay (Reddi et al.: 0.9)")
    beta2: float = Field(0.99, ge=0.0, lt=1.0, description="second-moment decay (Reddi et al.: 0.99; unused by adagrad)")
    tau: float = Field(1e-3, gt=0.0, description="adaptivity tau; v starts at tau^2 (Reddi et al.: 1e-3)")
    bias_correction: bool = Field(False, description="scale lr by sqrt(1-beta2^t)/(1-beta1^t) as Flower's FedAdam "
                                                     "does; false = Reddi et al.'s Alg. 2")


class _Adaptive(ServerOptimizer):
    Params = AdaptiveParams
    paper = "https://arxiv.org/abs/2003.00295"

    def step(self, global_weights: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        p = self.params
        out, self.state = adaptive_step(self.name, global_weights, aggregate, self.state, self.t + 1, p.lr, p.beta1,
                                        p.beta2, p.tau, p.bias_correction, self._mask_for(global_weights))
        self.t += 1
        return out


for _rule, _who in (("adagrad", "FedAdagrad"), ("adam", "FedAdam"), ("yogi", "FedYogi")):
    SERVER_OPTIMIZERS.register(_rule, params=AdaptiveParams, summary=f"{_who} (Reddi et al. 2021, Alg. 2)")(
        type(f"Server{_rule.capitalize()}", (_Adaptive,), {"name": _rule, "label": f"server_{_rule}"}))
