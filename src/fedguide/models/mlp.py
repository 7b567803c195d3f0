"""A small MLP: any image size, fast enough for tests and the 8x8 digits."""
from __future__ import annotations

from pydantic import Field
from torch import nn

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import HeadParams, SplitModel, assemble


class MLPParams(HeadParams):
    hidden: int = Field(128, ge=1)
    feature_dim: int = Field(64, ge=1)
    batch_norm: bool = Field(False, description="BatchNorm after each hidden layer, before its ReLU (what "
                                                "method.name=fedbn keeps local)")


@MODELS.register("mlp", params=MLPParams, summary="flatten + 2 hidden layers (d=64), linear head; for small inputs")
def build_mlp(params: MLPParams, spec: ModelSpec) -> SplitModel:
    c, h, w = spec.input_shape
    def norm(width: int) -> list[nn.Module]:
        return [nn.BatchNorm1d(width)] if params.batch_norm else []

    encoder = nn.Sequential(
        nn.Flatten(), nn.Linear(c * h * w, params.hidden), *norm(params.hidden), nn.ReLU(inplace=True),
        nn.Linear(params.hidden, params.feature_dim), *norm(params.feature_dim), nn.ReLU(inplace=True),
    )
    return assemble(encoder, params.feature_dim, spec.num_classes, params)
