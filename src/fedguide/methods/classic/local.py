"""Local: every client trains alone, nothing is aggregated — the lower bound of collaboration.

Reports the mean, over all clients, of each client model's accuracy on the global test set.

Where it is expected to lose: everywhere on the global test set, by design — the bound the federation is
measured against. Under label skew each client's model knows its own classes only: on ``configs/demo.yaml``
(Dir 0.1, seeds 0-2, last-2) 28.38 ± 2.98 % against FedAvg's 60.51 %, −32.12 [−46.46, −17.78] points paired
(benchmarks/results/method_defaults/demo.md). On the clients' own test splits (``eval.mode: both``) it is the
baseline a personalised method has to beat: 87.54 ± 2.95 % there against FedAvg's global model's 60.52 %,
above Ditto's 85.48 and FedALA's 86.99, below FedRep's 91.98 (benchmarks/results/method_defaults/demo_personal.md).
"""
from fedguide.core.evaluation import mean_metrics
from fedguide.methods.base import METHODS, Method


@METHODS.register("local")
class Local(Method):
    """Local training only; accuracy = mean client-model accuracy on the global test set."""

    def server_payload(self, round_, client_id, global_weights):
        return {}  # nothing is communicated

    def client_start(self, ctx):
        # Every client begins from the same seeded initialisation, which needs no communication.
        return ctx.state.get("weights", self.run.initial_weights)

    def client_upload(self, model, ctx, state):
        ctx.update_state(weights=self.run.layout.flatten(model))
        return {"num_samples": len(ctx.data)}

    def aggregate(self, round_, global_weights, uploads):
        return global_weights

    def personal_model(self, round_, client_id, global_weights):
        weights = self.run.store.get(client_id, round_).get("weights")
        return self.run.initial_weights if weights is None else weights.to(self.run.device)

    def evaluate(self, round_, global_weights):
        return mean_metrics([self.run.evaluator.evaluate(self.personal_model(round_, cid, global_weights))
                             for cid in range(self.run.num_clients)])
