"""The Method interface: a few hooks around a fixed round loop (in the spirit of Flower's Strategy).

A method overrides only what differs from FedAvg. Server-side hooks: ``setup``, ``server_payload``,
``aggregate``, ``evaluate``; client-side hooks: ``client_start``, ``fit`` (the client's training: by
default the local loop below, which calls ``begin_local``, ``local_loss`` and ``after_backward``),
``client_upload``. A client's state of the round passes between its hooks as the object ``begin_local``
returns (``fit``'s own, where it trains its own way), never through the context. Payloads and uploads
are plain records (dicts of tensors and scalars) so the same method runs in-process and across a network.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel

from fedguide.core.aggregation import sample_weighted_average
from fedguide.core.records import Record, record_bytes  # noqa: F401  (part of the method author's API)
from fedguide.core.training import train_local
from fedguide.methods._personalise import fine_tune
from fedguide.methods.context import ClientContext, RunContext  # noqa: F401  (likewise)
from fedguide.registry import NoParams, Registry

if TYPE_CHECKING:
    from fedguide.config import TrainConfig
    from fedguide.models.split import SplitModel


class Method:
    """FedAvg's behaviour; subclasses override hooks. Registered via ``@METHODS.register(name)``."""

    Params: ClassVar[type[BaseModel]] = NoParams
    # Where the method is defined: a link to its paper (or, for a paper's own baseline, that paper); shown by
    # `fedguide list` and checked against docs/methods.md. Empty for the references (local, centralized).
    paper: ClassVar[str] = ""
    # Model settings this method cannot work without (FedDW's bias-free classification layer). Checked when
    # the config is resolved, never applied: a method's name never changes the network it is compared on, so
    # the config sets them, for every method of the comparison.
    model_requirements: ClassVar[dict[str, Any]] = {}
    # False for methods that learn from unlabeled clients (semi-supervised scenarios, FedDISC).
    needs_client_labels: ClassVar[bool] = True
    # Optional install layers this method needs (pyproject extras, e.g. ("guidance",)); resolving a config
    # checks them, so a missing package is named with its pip command before anything is built.
    extras: ClassVar[tuple[str, ...]] = ()
    # False for methods that classify without the run's model (a head on a frozen encoder, zero-shot): they
    # have no personalised model for eval.mode personal/both to score.
    personal_evaluation: ClassVar[bool] = True
    # False for methods that compute on the host whatever ``train.device`` says (small heads on cached
    # features, one-shot classifiers trained in their own loops): their payloads, client state, uploads
    # and server state stay on the CPU. True: all of those are moved to the run's device.
    on_device: ClassVar[bool] = True
    # The regularisers this method is trained with (methods.compose): the config's ``regularizers:``, added
    # when the run is opened, after any the method brings itself (FedDW's). They are applied from this list by
    # the local loop and by ``compose.Hooks``; a method never calls them.
    regularizers: Sequence[Any] = ()  # of compose.Regularizer
    # The server's step from this method's aggregate to the next global model (``server_optimizer:``, set when
    # the run is opened; methods.server_optimizers), applied by ``compose.Hooks``; None: the aggregate itself.
    server_optimizer: Any = None

    def __init__(self, params: BaseModel, run: "RunContext"):
        self.params = params
        self.run = run

    @classmethod
    def option_extras(cls, params: BaseModel) -> dict[str, tuple[str, ...]]:
        """Install layers that only some settings need: option key (as a config names it) -> extras. Checked
        after the parameters are parsed, like ``extras``, so the error names the option that asks for them."""
        return {}

    @classmethod
    def gpu_nondeterminism(cls, params: BaseModel, config: Any) -> Optional[str]:
        """Why these settings cannot run with ``train.deterministic: true`` on a GPU (an operation they use has
        no deterministic CUDA kernel), as a sentence naming the option to change; None when they can."""
        return None

    # ---- federation ---------------------------------------------------------------------------
    @staticmethod
    def federation(client_indices: list[np.ndarray]) -> list[np.ndarray]:
        """Reshape the partition before training (Centralized merges every client into one)."""
        return client_indices

    def setup(self) -> None:
        """On the server before the first round of this process (also on resume): fit bases,
        precompute features, build prototypes. Server state that evolves goes in ``server_state``."""

    def init_global(self, weights: torch.Tensor) -> torch.Tensor:
        """The round-1 global weights (a fresh run only), e.g. FedNH's fixed prototype head."""
        return weights

    # ---- server -> client ---------------------------------------------------------------------
    def server_payload(self, round_: int, client_id: int, global_weights: torch.Tensor) -> Record:
        return {"weights": global_weights}

    # ---- client -------------------------------------------------------------------------------
    def local_train(self, train: "TrainConfig") -> "TrainConfig":
        """The settings of this method's local loop (SCAFFOLD's Algorithm 1 is plain SGD)."""
        return train

    def client_start(self, ctx: ClientContext) -> torch.Tensor:
        """The weights local training starts from."""
        return ctx.payload["weights"]

    def fit(self, model: "SplitModel", ctx: ClientContext, train: "TrainConfig") -> tuple[Optional[float], Any]:
        """The client's training of ``model`` (the run's live model, holding ``client_start``'s weights);
        returns (the mean training loss, or None when the run's model took no step, the round's state for
        ``client_upload``). The round's ``loss`` is the mean over the clients that trained. The default is the
        local loop: epochs (or ``train.local_steps`` steps) of ``local_loss`` with ``local_train(train)``'s
        settings, on the state ``begin_local`` returns. Methods that train differently (one-shot clients
        training their own architectures, frozen-encoder heads, inference-only clients) override this instead
        of switching the loop off, and return a state of their own (or None)."""
        model.train()  # begin_local's own passes (SCAFFOLD's full gradient) see the model as the loop trains it
        state = self.begin_local(model, ctx)
        loss, ctx.steps = train_local(model, self, ctx, self.local_train(train), ctx.generator, state)
        return (loss if ctx.steps else None), state

    def begin_local(self, model: "SplitModel", ctx: ClientContext) -> Any:
        """After the start weights are loaded, before the first step: this round's state on the client (a
        small dataclass of the method's own: anchor weights, frozen models, cached targets), which the loop
        hands to ``local_loss``, ``after_backward`` and ``local_optimizers``, and ``fit`` to ``client_upload``.
        It lives for the round and is never stored; what a client keeps goes in ``ctx.update_state``."""
        return None

    def local_loss(self, model: "SplitModel", x: torch.Tensor, y: torch.Tensor, ctx: ClientContext,
                   state: Any) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def after_backward(self, model: "SplitModel", ctx: ClientContext, state: Any) -> None:
        """Between backward and the optimiser step: edit gradients in place (a closed-form term's
        gradient is cheaper added here than traced by autograd)."""

    def local_optimizers(self, ctx: ClientContext, state: Any) -> list[torch.optim.Optimizer]:
        """Optimisers of parameters the method owns beside the model's (SemanticFL's learned text projection,
        FedNH's learned scale), built in ``begin_local`` and kept in its state. The local loop steps them with
        the model's optimiser, after it, and zeroes their gradients; under ``train.precision: fp16`` their
        gradients are unscaled with the model's (before ``after_backward``) and their step is skipped on
        overflow like the model's. A method must not step them itself: it would step on gradients scaled by
        the loss scale."""
        return []

    def client_upload(self, model: "SplitModel", ctx: ClientContext, state: Any) -> Record:
        """What the client sends back after ``fit``; ``state`` is the round's state ``fit`` returned."""
        return {"weights": self.run.layout.flatten(model), "num_samples": len(ctx.data)}

    # ---- server -------------------------------------------------------------------------------
    def aggregate(self, round_: int, global_weights: torch.Tensor, uploads: list[Record]) -> torch.Tensor:
        return sample_weighted_average([u["weights"] for u in uploads], [u["num_samples"] for u in uploads])

    def evaluate(self, round_: int, global_weights: torch.Tensor) -> dict[str, Any]:
        """Test metrics of this round; must contain ``accuracy``."""
        return self.run.evaluator.evaluate(global_weights)

    def personal_model(self, round_: int, client_id: int, global_weights: torch.Tensor) -> torch.Tensor:
        """Client ``client_id``'s personalised weights after round ``round_`` (eval.mode personal/both), scored
        on its own test split. The default personalisation: the global model, fine-tuned for
        ``eval.finetune_steps`` steps of cross-entropy on the client's training data when that is set.
        Methods whose clients keep a model of their own return it from the client store
        (``self.run.store.get(client_id, round_)``, which sees this round's writes)."""
        steps = self.run.eval.finetune_steps
        if not steps:
            return global_weights
        train = self.run.train.model_copy(update={"local_steps": steps})
        return fine_tune(self.run, client_id, round_, global_weights, train)

    # ---- checkpointing of server-side state -------------------------------------------------------
    def server_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no server state but the checkpoint has {sorted(state)}")


METHODS: Registry = Registry("method", plugins=("fedguide.methods",))
