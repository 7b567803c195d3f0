"""FedDISC's "Fine-tuning" baseline (papers/feddisc.md Sec. 4.1, Table 1-2): the clients run FedDISC's
protocol unchanged (prototypes, pseudo-labels, noised k-means centroids and domain features, one upload;
see _centroids.py), and the server trains the linear head on the frozen image encoder directly on the
uploaded noised centroids with their pseudo-labels, generating nothing.

Decisions: the head is trained exactly as FedDISC's (SGD lr 0.01, batch 256, ``head_epochs``) on the
centroids as uploaded (√ᾱ-scaled and noised, as the paper's server receives them); the domain features
are uploaded (the protocol is FedDISC's) but not used. ``num_centroids`` is Table 2's L.
"""
from __future__ import annotations

import torch

from fedguide.methods._centroids import CentroidOneShot, CentroidParams
from fedguide.methods._frozen_encoder import new_head, train_head
from fedguide.methods.base import METHODS


@METHODS.register("centroid_finetune", params=CentroidParams)
class CentroidFinetune(CentroidOneShot):
    """FedDISC's Fine-tuning baseline: the linear head trained on the uploaded noised centroids."""

    def fit_head(self, uploads):
        p = self.params
        x = torch.cat([u["centroids"] for u in uploads]).float()
        y = torch.cat([u["centroid_labels"] for u in uploads]).long()
        head = new_head(self.features.dim, self.run.num_classes, self.head_seed())
        head, loss = train_head(head, x, y, p.head_epochs, p.head_lr, p.head_batch_size, p.head_momentum,
                                p.head_weight_decay, torch.Generator().manual_seed(self.head_seed() % 2 ** 31))
        return head, {"train_centroids": int(len(y)), "head_train_loss": loss}
