"""Local: every client trains alone, nothing is aggregated — the lower bound of collaboration.

Reports the mean, over all clients, of each client model's accuracy on the global test set.
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
