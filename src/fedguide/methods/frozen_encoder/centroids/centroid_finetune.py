"""FedDISC's "Fine-tuning" baseline (the FedDISC paper Sec. 4.1, Table 1-2): the clients run FedDISC's
protocol unchanged (prototypes, pseudo-labels, noised k-means centroids and domain features, one upload;
see _centroids.py), and the server trains the linear head on the frozen image encoder directly on the
uploaded noised centroids with their pseudo-labels, generating nothing.

Decisions: the head is trained exactly as FedDISC's (SGD lr 0.01, batch 256, ``head_epochs``) on the
centroids as uploaded (√ᾱ-scaled and noised, as the paper's server receives them); the domain features
are uploaded (the protocol is FedDISC's) but not used. ``num_centroids`` is Table 2's L.
"""
from __future__ import annotations

from fedguide.methods.frozen_encoder.centroids._centroids import CentroidOneShot, CentroidParams, uploaded_centroids
from fedguide.methods.base import METHODS


@METHODS.register("centroid_finetune", params=CentroidParams)
class CentroidFinetune(CentroidOneShot):
    """FedDISC's Fine-tuning baseline: the linear head trained on the uploaded noised centroids."""

    paper = "https://arxiv.org/abs/2305.04063"

    def fit_head(self, uploads):
        x, y = uploaded_centroids(uploads)
        head, loss = self.train_server_head(x, y)
        return head, {"train_centroids": int(len(y)), "head_train_loss": loss}
