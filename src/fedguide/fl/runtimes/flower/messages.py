"""What a train message and its reply hold, for both Flower runtimes, and how their failures are named.

A train message holds a ConfigRecord "job" (client-id, round, and what the runtime needs to find the
run) and the payload as "payload-arrays"/"payload-scalars"; the reply holds the upload as
"upload-arrays"/"upload-scalars" and a ConfigRecord "result" with the client's loss, sample count
and fit seconds. Both are encoded by ``records`` so every tensor arrives bit for bit.
"""
from __future__ import annotations

from fedguide.fl.client_step import ClientResult, run_client
from fedguide.fl.runtime import WorkerCrashed
from fedguide.fl.runtimes.flower.records import decode, encode


class FlowerRuntimeFailed(WorkerCrashed):
    """The Flower runtime failed to start or stopped; the run stops at its last checkpoint. A kind of
    WorkerCrashed, so the command line reports it the same way (message, resume hint, exit code)."""


class FlowerClientFailed(FlowerRuntimeFailed):
    """A client's train message came back with an error (or, deployed, too few clients replied)."""


def train_reply(msg, ctx, method, cfg):
    """The reply to a train message: fedguide's run_client on the decoded payload, result encoded."""
    from flwr.app import ConfigRecord, Message, RecordDict

    job = msg.content["job"]
    client_id, round_ = int(job["client-id"]), int(job["round"])
    payload = decode(msg.content["payload-arrays"], msg.content["payload-scalars"])
    res = run_client(ctx, method, cfg.train, cfg.seed, round_, client_id, payload)
    arrays, scalars = encode(res.upload)
    reply = RecordDict({"upload-arrays": arrays, "upload-scalars": scalars,
                        "result": ConfigRecord({"client-id": res.client_id, "num-samples": int(res.num_samples),
                                                "fit-seconds": float(res.fit_seconds),
                                                # no "loss" key: the run's model took no step
                                                **({} if res.loss is None else {"loss": float(res.loss)})})})
    return Message(reply, reply_to=msg)


def decode_result(content) -> ClientResult:
    r = content["result"]
    return ClientResult(int(r["client-id"]), decode(content["upload-arrays"], content["upload-scalars"]),
                        float(r["loss"]) if "loss" in r else None, int(r["num-samples"]), float(r["fit-seconds"]))


def error_reason(reason: str) -> str:
    # Flower wraps a client's exception in a long traceback (logged in full by Flower) ending in
    # "...occurred. Message: <the exception's text>"; that text is the reason, else the last lines.
    reason = (reason or "").strip().strip("'>")
    if "Message: " in reason:
        return reason.rsplit("Message: ", 1)[1].strip()[:2000]
    lines = [x for x in reason.splitlines() if x.strip()]
    return "\n".join(lines[-3:])[:2000] if lines else "(no reason given)"
