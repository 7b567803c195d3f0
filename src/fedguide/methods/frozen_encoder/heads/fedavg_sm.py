"""FedAvg-sm (FedDISC's "Semi-supervised FedAvg" baseline, the FedDISC paper Sec. 4.1: "using clients' data
and corresponding pseudo-labels for conducting FedAvg, which requires client training and multiple rounds
of communications"; 30 rounds in Table 1).

Every round the server sends the global linear head and the class prototypes of its labeled set (FedDISC
Eq. 2); each client pseudo-labels its images by the nearest prototype in cosine (Eq. 3) and trains the head
on them with cross-entropy (``train`` section: lr, momentum, weight decay, batch size, epochs); the server
averages the heads weighted by the clients' sample counts.

Decisions: pseudo-labels come from the prototypes (the paper does not say which pseudo-labels FedAvg-sm
uses; these are FedDISC's own), so they do not change from round to round; the head starts from a seeded
random initialisation (the paper does not say the server pre-trains it). Frozen encoder and head: see
_head_federation.
"""
from __future__ import annotations

from fedguide.methods.frozen_encoder._frozen_encoder import pseudo_labels
from fedguide.methods.frozen_encoder.heads._head_federation import HeadFederation, HeadParams
from fedguide.methods.base import METHODS


@METHODS.register("fedavg_sm", params=HeadParams)
class FedAvgSM(HeadFederation):
    """FedAvg-sm: FedAvg of a linear head on the frozen encoder, trained on prototype pseudo-labels."""

    paper = "https://arxiv.org/abs/2305.04063"

    def extra_payload(self, round_):
        protos, present = self.prototypes()
        return {"prototypes": protos, "prototype_present": present}

    def client_train(self, head, ctx):
        x = self.client_features(ctx)
        y = pseudo_labels(x, ctx.payload["prototypes"], ctx.payload["prototype_present"])
        t = self.run.train
        trained, loss = self.train_supervised(head, x, y, t.epochs, self.client_generator(ctx))
        return trained, loss, float(len(x))
