"""Methods that federate the lower part of the model and keep its top on each client (FedRep, FedPer).

The flat weight vector splits at ``personal_start``: the shared part [0, start) travels and is averaged, the
personal part [start, end) (the classification layer, or the top layers) never leaves the client. A client
keeps its personal part in its disk state (``personal``); one that has not trained yet starts from the run's
seeded initial values, as every client's model does in round 1. The server's global vector carries the
averaged shared part and the untouched initial personal part (what ``model.safetensors`` holds).

Global accuracy (FedDW, Sec. V-B: personalised methods "do not share their backbone network with the
server", so the server has no model of its own to test): the mean over all clients of the accuracy of their
personalised models (the global shared part with their own personal part) on the global test set, as
``local`` reports it, with ``client_accuracy_min``/``max``. Personalised accuracy: the same models on the
clients' own test splits.

FedDW's code scores these rows otherwise (``utils.py`` L248-274, ``inference_by_pFL``, called at ``main.py``
L367 for FedRep and L410 for FedPer): the mean over all clients of ``client.model`` as its last local training
left it, its own trained shared part included (``Updata.py`` L472 loads the averaged part before training,
nothing after), on the global test set; a client that has not trained holds the initial model (``main.py``
L334-335). ``last_local_eval: true`` reports that reading beside the one above, as ``readings.last_local`` in
metrics.jsonl (``final_last_local_accuracy`` and ``last_local_accuracy_last_k`` in summary.json); the
clients then also keep their trained shared part in their disk state (``local_shared``), the size of the
shared part per client, and every round scores each client's model twice.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedguide.core.aggregation import average_leading_part
from fedguide.methods._personalise import mean_client_metrics
from fedguide.methods.base import Method


def last_local_field():
    return Field(False, description="also score each client's model as its last local training left it (FedDW's "
                                    "inference_by_pFL) on the global test set: readings.last_local")


class SplitFederation(Method):
    def personal_start(self) -> int:
        """Where the personal part begins in the flat weight vector."""
        raise NotImplementedError

    def server_payload(self, round_, client_id, global_weights):
        return {"shared": global_weights[: self.personal_start()]}

    def own_part(self, state: dict) -> torch.Tensor:
        """The client's personal part: from its state, else the initial one."""
        part = state.get("personal")
        return self.run.initial_weights[self.personal_start():] if part is None else part.to(self.run.device)

    def client_start(self, ctx):
        return torch.cat([ctx.payload["shared"], self.own_part(ctx.state)])

    def client_upload(self, model, ctx, state):
        flat, start = self.run.layout.flatten(model), self.personal_start()
        kept = {"personal": flat[start:]}
        if self.params.last_local_eval:
            kept["local_shared"] = flat[:start]
        ctx.update_state(**kept)
        return {"shared": flat[:start], "num_samples": len(ctx.data)}

    def aggregate(self, round_, global_weights, uploads):
        return average_leading_part(global_weights, [u["shared"] for u in uploads],
                                    [u["num_samples"] for u in uploads])

    def personal_model(self, round_, client_id, global_weights):
        return torch.cat([global_weights[: self.personal_start()],
                          self.own_part(self.run.store.get(client_id, round_))])

    def last_local_model(self, round_: int, client_id: int) -> torch.Tensor:
        """The client's model as its last local training left it; the initial model before it has trained."""
        state = self.run.store.get(client_id, round_)
        if state.get("local_shared") is None:
            return self.run.initial_weights
        return torch.cat([state["local_shared"].to(self.run.device), state["personal"].to(self.run.device)])

    def evaluate(self, round_, global_weights):
        out = mean_client_metrics(self.run, lambda cid: self.personal_model(round_, cid, global_weights))
        if self.params.last_local_eval:
            last = mean_client_metrics(self.run, lambda cid: self.last_local_model(round_, cid))
            out["readings"] = {"last_local": last["accuracy"]}
        return out
