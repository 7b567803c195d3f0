"""The console's round line: global and personal accuracy as the run scores them."""
from fedguide.fl.engine import round_line

ROW = {"round": 3, "accuracy": 0.5, "loss": 0.25, "seconds": 1.0}


def test_the_round_line_shows_personal_accuracy_beside_the_global_with_eval_mode_both():
    assert round_line({**ROW, "personal_accuracy": 0.85}, 5, "both") == \
        "round   3/5  acc  50.00%  personal  85.00%  train loss 0.2500  1.0 s"
    # Rounds that do not score the clients (personal_every) show the global accuracy alone.
    assert round_line(ROW, 5, "both") == "round   3/5  acc  50.00%  train loss 0.2500  1.0 s"
    assert round_line({**ROW, "personal_accuracy": 0.5}, 5, "personal") == \
        "round   3/5  personal acc  50.00%  train loss 0.2500  1.0 s"
