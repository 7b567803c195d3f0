"""Shared by the personalised-FL method tests: a tiny run opened in-process and one client's round."""
from __future__ import annotations

from fedguide.fl.client_step import run_client
from fedguide.fl.setup import open_run, prepare
from tests.tiny import tiny_config


def opened(tmp_path, method: dict, **over):
    """(run context, set-up method) of the tiny digits run with ``method``, as a client process opens it."""
    ctx, m = open_run(prepare(tiny_config(method=method, **over)), tmp_path, setup=True)
    return ctx, m


def client_round(ctx, method, client_id: int, round_: int, global_weights):
    """One client's round on ``global_weights``: (upload, its result), state written to the pending store."""
    payload = method.server_payload(round_, client_id, global_weights)
    res = run_client(ctx, method, ctx.config.train, ctx.config.seed, round_, client_id, payload)
    return res.upload, res
