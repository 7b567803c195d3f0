"""The engine: rounds, local training, aggregation, evaluation, checkpoints and client state."""
