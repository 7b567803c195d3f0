"""A Flower deployment beyond localhost: TLS, SuperNode authentication, and the refusals that keep an
unprotected SuperLink on this machine. Certificates and keys are made here with `cryptography`
(a CA, a server certificate for 127.0.0.1/localhost, OpenSSH ECDSA keys for the SuperNodes)."""
from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import os
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from fedguide.config import build_config
from fedguide.fl.setup import prepare, resolve
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config, tiny_raw

pytest.importorskip("flwr")

from fedguide.fl.runtimes.flower import node as client_side, security, server  # noqa: E402
from fedguide.fl.runtimes.flower.deployment import flower_params  # noqa: E402
from fedguide.fl.runtimes.flower.messages import FlowerRuntimeFailed  # noqa: E402
from fedguide.fl.runtimes.flower.processes import (LocalControl, alive, command_line, descendants,  # noqa: E402
                                                   free_port, stop_tree)
from fedguide.fl.runtimes.flower.protocol import fingerprint  # noqa: E402
from tests.fl.runtimes.flower.test_deployment import FLOWER, deployed_rows, read_rows, start_client  # noqa: E402


# ---- certificates and keys ------------------------------------------------------------------------
def make_tls(folder: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> dict[str, str]:
    """A CA and a server certificate it signed for ``names``: {ca, cert, key} paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=1))
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedguide test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid["not_valid_before"])
          .not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


def _san(name: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_key(folder: Path, name: str) -> tuple[str, str]:
    """A SuperNode key pair as ``ssh-keygen -t ecdsa -b 384 -N ''`` writes it: (private, public) paths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b" " + name.encode())
    return str(private), str(public)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> dict[str, str]:
    return make_tls(tmp_path_factory.mktemp("tls"))


# ---- the runtime section ------------------------------------------------------------------------------
def runtime_error(runtime: dict) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(tiny_config(runtime={**FLOWER, **runtime}))
    return str(err.value)


def test_tls_and_auth_files_are_checked_with_the_fix_named(tmp_path, tls, monkeypatch):
    private, public = make_key(tmp_path, "client-0")
    missing = str(tmp_path / "nope.crt")
    assert "runtime.tls.ca" in runtime_error({"tls": {"ca": missing}})
    assert f"{missing} is not a file on this machine; set runtime.tls.ca to the CA certificate" in \
        runtime_error({"tls": {"ca": missing}})
    assert "runtime.tls.key: " in runtime_error({"tls": {**tls, "key": missing}})
    assert "cert and runtime.tls.key go together" in runtime_error({"tls": {"ca": tls["ca"], "cert": tls["cert"]}})
    assert "runtime.tls.certfile: Extra inputs are not permitted" in runtime_error({"tls": {**tls, "certfile": "x"}})
    assert "runtime.auth needs runtime.tls" in runtime_error({"auth": {"private_key": private}})
    assert "runtime.auth.public_keys" in runtime_error({"tls": tls, "auth": {"public_keys": [missing]}})
    assert "is not an OpenSSH public key" in runtime_error({"tls": tls, "auth": {"public_keys": [private]}})
    assert "is not an OpenSSH private key" in runtime_error({"tls": tls, "auth": {"private_key": public}})
    assert "runtime.auth needs public_keys" in runtime_error({"tls": tls, "auth": {}})

    # Relative paths are taken from the working directory; server and client may hold different ones.
    monkeypatch.chdir(Path(tls["ca"]).parent)
    cfg = resolve(tiny_config(runtime={**FLOWER, "tls": {"ca": "ca.crt", "cert": "server.pem", "key": "server.key"},
                                       "auth": {"public_keys": [public]}})).config
    params = flower_params(cfg)
    assert str(params.tls.cert) == tls["cert"] and [str(p) for p in params.auth.public_keys] == [public]
    assert cfg.runtime.tls["ca"] == tls["ca"]  # the resolved config (config.yaml) holds absolute paths
    client_cfg = resolve(tiny_config(runtime={**FLOWER, "tls": {"ca": tls["ca"]},
                                              "auth": {"private_key": private}})).config
    assert fingerprint(cfg) == fingerprint(client_cfg)


# ---- who may be exposed ---------------------------------------------------------------------------
def test_serve_beyond_loopback_needs_tls_or_an_explicit_insecure(tmp_path, tls, capsys):
    cfg = resolve(tiny_config(runtime=FLOWER)).config
    with pytest.raises(ConfigError, match=r"--host 0.0.0.0 .*runtime.tls.*--insecure"):
        server.serve(tmp_path / "run", cfg, host="0.0.0.0")
    assert not (tmp_path / "run").exists(), "refused before anything started"

    assert security.check_exposure("127.0.0.1", None, False) is None
    assert security.check_exposure("localhost", None, False) is None
    assert security.check_exposure("::1", None, False) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "server.lan"):
        with pytest.raises(ConfigError, match="runtime.tls"):
            security.check_exposure(host, None, False)
        assert "warning: --insecure" in security.check_exposure(host, None, True)
    tls_params = flower_params(resolve(tiny_config(runtime={**FLOWER, "tls": tls})).config).tls
    assert security.check_exposure("0.0.0.0", tls_params, False) is None
    with pytest.raises(ConfigError, match="--insecure and runtime.tls contradict"):
        security.check_exposure("0.0.0.0", tls_params, True)

    from fedguide.cli import main

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_raw(runtime=FLOWER)))
    assert main(["serve", str(tmp_path / "tiny.yaml"), "--host", "0.0.0.0", "--out", str(tmp_path / "cli")]) == 2
    assert "--insecure" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


def test_a_client_needs_tls_or_insecure_for_a_superlink_on_another_machine(tmp_path, tls, monkeypatch):
    started = []
    monkeypatch.setattr(client_side, "_run_supernode", lambda *a, **k: started.append(a))
    cfg = resolve(tiny_config(runtime=FLOWER)).config
    with pytest.raises(ConfigError, match=r"10.1.2.3:9092 is on another machine: set runtime.tls.ca.*--insecure"):
        client_side.run_client_node(cfg, 0, tmp_path / "c", superlink="10.1.2.3:9092")
    tls_cfg = resolve(tiny_config(runtime={**FLOWER, "tls": {"ca": tls["ca"]}})).config
    with pytest.raises(ConfigError, match="--insecure and runtime.tls contradict"):
        client_side.run_client_node(tls_cfg, 0, tmp_path / "c", superlink="10.1.2.3:9092", insecure=True)
    assert started == [] and not (tmp_path / "c").exists()
    security.check_connection("10.1.2.3:9092", None, insecure=True)  # explicitly allowed
    security.check_connection("127.0.0.1:9092", None, insecure=False)
    security.check_connection("[::1]:9092", None, insecure=False)
    assert security.Security().args() == ["--insecure"]
    assert security.Security(Path("ca.crt"), Path("k")).args() == [
        "--root-certificates", "ca.crt", "--auth-supernode-private-key", "k"]


def test_serve_checks_that_its_certificate_names_where_it_reaches_the_superlink(tmp_path, tls):
    """serve's `flwr` commands and the ServerApp reach the SuperLink at 127.0.0.1 (for --host 0.0.0.0):
    a certificate only for the public name, or from another CA, is named before the run is submitted
    (Flower would only say 'unavailable')."""
    import socket
    import threading

    def served(paths: dict[str, str]) -> tuple[int, threading.Thread]:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(paths["cert"], paths["key"])
        listener = socket.create_server(("127.0.0.1", 0))

        def accept():
            with listener:
                conn, _ = listener.accept()
                try:
                    with context.wrap_socket(conn, server_side=True):
                        pass
                except (ssl.SSLError, OSError):
                    pass
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        return listener.getsockname()[1], thread

    def params(paths):
        return flower_params(resolve(tiny_config(runtime={**FLOWER, "tls": paths})).config).tls

    public_only = make_tls(tmp_path / "public", names=("server.example.org",))
    port, thread = served(public_only)
    with pytest.raises(ConfigError, match=r"not valid for '127.0.0.1'. It must be signed by that CA and name 127.0.0.1 "
                                          r"\(subjectAltName IP:127.0.0.1"):
        security.check_certificate("127.0.0.1", port, params(public_only))
    thread.join(10)
    port, thread = served(tls)
    with pytest.raises(ConfigError, match="unable to get local issuer certificate"):
        security.check_certificate("127.0.0.1", port, params({**tls, "ca": public_only["ca"]}))
    thread.join(10)
    port, thread = served(tls)
    security.check_certificate("127.0.0.1", port, params(tls))
    thread.join(10)


def test_other_machines_reach_the_fleet_api_only():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    sent = []

    async def send(message):
        sent.append(message)

    guard = LocalControl(app, local=["192.168.1.5"])

    def call(path, peer):
        sent.clear()
        asyncio.run(guard({"type": "http", "path": path, "client": (peer, 40000)}, None, send))
        return sent[0]["status"] if sent else "passed"

    assert call("/v1/fleet/pull-messages", "203.0.113.9") == "passed"
    for path in ("/v1/control/start-run", "/v1/control/register-node", "/v1/runtime/acquire-task", "/docs"):
        assert call(path, "203.0.113.9") == 403
        assert call(path, "127.0.0.1") == "passed"
        assert call(path, "::ffff:127.0.0.1") == "passed"
        assert call(path, "192.168.1.5") == "passed"  # the address it listens on: this machine
    assert seen.count("/v1/control/start-run") == 3


def test_a_refused_client_retries_for_connect_timeout_then_names_the_refusal(tmp_path, monkeypatch):
    """Flower's refusals as its SuperNode logs them: an unregistered key (2004) may be registered
    moments later (serve registers its allow-list after the SuperLink starts), so the client retries
    for runtime.connect_timeout; a SuperLink that admits registered keys only (2001) while the client
    has none stops it at once."""
    said = {"2004": "Failed to initialize the connection to the SuperLink.\n[code: 2004] Failed to activate "
                    "SuperNode.\n",
            "2001": "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered via the "
                    "CLI.\n",
            "tls": "SSL/TLS handshake error detected.\nExit Code: 305\nFailed to initialize the connection to the "
                   "SuperLink.\n[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed\n"}
    outcomes: list[str] = []

    def supernode(address, node_config, folder, long_lived, log, security):
        kind = outcomes.pop(0)
        with open(folder / "supernode.log", "a") as fh:
            fh.write(said.get(kind, "SuperNode terminated gracefully.\n"))
        if kind == "stop":
            raise KeyboardInterrupt  # the user stops the client
        return 1

    monkeypatch.setattr(client_side, "_run_supernode", supernode)
    monkeypatch.setattr(client_side, "REFUSED_RETRY_S", 0.01)
    cfg = resolve(tiny_config(runtime={**FLOWER, "connect_timeout": 0.3})).config
    lines: list[str] = []

    outcomes[:] = ["2001"]
    with pytest.raises(FlowerRuntimeFailed, match="admits registered SuperNodes only: set runtime.auth.private_key"):
        client_side.run_client_node(cfg, 0, tmp_path / "a", log=lines.append)

    outcomes[:] = ["tls"]
    with pytest.raises(FlowerRuntimeFailed, match=r"TLS connection to the SuperLink 127.0.0.1:9092 failed: "
                                                  r"\[SSL: CERTIFICATE_VERIFY_FAILED\] certificate verify failed "
                                                  r"\(runtime.tls.ca"):
        client_side.run_client_node(cfg, 0, tmp_path / "t", log=lines.append)

    outcomes[:] = ["2004"] * 1000
    t0 = time.time()
    with pytest.raises(FlowerRuntimeFailed, match=r"refused client 1's SuperNode for \d+ s "
                                                  r"\(runtime.connect_timeout=0.3\)"
                                                  r": its key \(none\) is not registered there"):
        client_side.run_client_node(cfg, 1, tmp_path / "b", log=lines.append)
    assert 0.3 < time.time() - t0 < 5 and len(outcomes) < 999
    assert sum("retrying for up to runtime.connect_timeout=0.3 s" in line for line in lines) == 1

    outcomes[:] = ["2004", "2004", "stop"]  # registered in time: the third SuperNode gets in
    with pytest.raises(KeyboardInterrupt):
        client_side.run_client_node(resolve(tiny_config(runtime=FLOWER)).config, 1, tmp_path / "c", log=lines.append)
    assert outcomes == []


# ---- deployments on localhost ---------------------------------------------------------------------
def in_thread(work: Callable[[], Any], timeout: float = 240) -> Callable[[], Any]:
    """Start ``work`` in a thread; the returned call waits for it and returns its result or raises its error."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = work()
        except BaseException as err:  # raised in the caller's thread
            box["error"] = err
    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def result():
        thread.join(timeout)
        assert not thread.is_alive(), f"still running after {timeout} s"
        if "error" in box:
            raise box["error"]
        return box["result"]
    return result


def _post(url: str, ca: str, forwarded_for: str = "") -> int:
    request = urllib.request.Request(url, data=b"", method="POST",
                                     headers={"X-Forwarded-For": forwarded_for} if forwarded_for else {})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=ca), timeout=20) as res:
            return res.status
    except urllib.error.HTTPError as err:
        return err.code


def _stop_all(link, clients) -> set[int]:
    started = set()
    if link is not None:
        started |= {link.proc.pid, *descendants(link.proc.pid)}
    for c in clients:
        started |= {c.pid, *descendants(c.pid)}
    if link is not None:
        link.close()
    for c in clients:
        stop_tree(c)
    return started


@pytest.mark.e2e
def test_over_tls_with_authentication_only_registered_clients_join_and_the_run_is_the_local_one(tmp_path, tls):
    """A SuperLink with its certificate whose allow-list holds clients 0 and 1's public keys; `fedguide
    client` processes that trust its CA. A third client claiming partition 1 with an unregistered key is
    refused until its connect_timeout and stops naming the refusal; one without a key is refused at once;
    the registered ones complete the run, with the local runtime's per-round results. The SuperLink speaks
    HTTPS only, and answers its Control API to this machine only (a request forwarded for another address
    gets 403)."""
    port = free_port()
    layers = {"clients": {"num": 2, "per_round": 2}, "train": {"rounds": 1}}
    runtime = {**FLOWER, "superlink": f"127.0.0.1:{port}", "connect_timeout": 120, "tls": {"ca": tls["ca"]}}
    keys = [make_key(tmp_path / "keys", f"client-{cid}") for cid in range(2)]
    intruder_key, _ = make_key(tmp_path / "keys", "intruder")
    (tmp_path / "client.yaml").write_text(yaml.safe_dump(tiny_raw(layers, runtime=runtime)))
    server_runtime = {**runtime, "tls": tls, "auth": {"public_keys": [keys[0][1], keys[1][1]]}}
    cfg = prepare(build_config(tiny_raw(layers, runtime=server_runtime))).config
    _, local_rows, _ = run_tiny(tmp_path, tiny_config(layers), "local")

    clients: list[subprocess.Popen] = []
    link, lines = None, []
    try:
        t0 = time.time()
        link = server.open_superlink(cfg, tmp_path / "run" / "flower", log=lines.append)
        assert any("TLS, 2 SuperNode keys admitted" in line for line in lines), lines
        intruder = start_client(tmp_path, 7, tmp_path / "client.yaml",
                                [f"runtime.auth.private_key={intruder_key}", "runtime.connect_timeout=1",
                                 "--partition-id", "1"])
        keyless = start_client(tmp_path, 8, tmp_path / "client.yaml", ["--partition-id", "0"])
        clients = [intruder, keyless]
        clients += [start_client(tmp_path, cid, tmp_path / "client.yaml", [f"runtime.auth.private_key={keys[cid][0]}"])
                    for cid in range(2)]
        # The run goes on while the refused clients retry and give up: the refusals are its background.
        outcome = in_thread(lambda: server.start_run(link, tmp_path / "run", cfg, resume=False, log=lines.append))
        assert keyless.wait(timeout=180) != 0
        said = (tmp_path / "client-8.out").read_text()
        assert "admits registered SuperNodes only" in said and "runtime.auth.private_key" in said, said[-2000:]
        assert intruder.wait(timeout=180) != 0
        said = (tmp_path / "client-7.out").read_text()
        assert "refused client 1's SuperNode" in said and "not registered there" in said, said[-2000:]
        assert "[code: 2004]" in (tmp_path / "client-7" / "supernode.log").read_text()
        print(f"refusals seen: {time.time() - t0:.1f} s")

        summary = outcome()
        assert summary["client_failures"] == [] and len(summary["accuracy_curve"]) == 1
        assert deployed_rows(read_rows(tmp_path / "run")) == deployed_rows(local_rows)
        print(f"authenticated run: {time.time() - t0:.1f} s")

        assert "Uvicorn running on https://127.0.0.1" in link.log_path.read_text()
        assert 'root-certificates = "' in (link.home / "config.toml").read_text()
        base = f"https://127.0.0.1:{port}"
        assert _post(f"{base}/v1/control/list-runs", tls["ca"], forwarded_for="203.0.113.9") == 403
        assert _post(f"{base}/v1/control/list-runs", tls["ca"]) != 403  # this machine: Flower answers
        assert _post(f"{base}/v1/fleet/pull-messages", tls["ca"], forwarded_for="203.0.113.9") != 403
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        server_log = (tmp_path / "run" / "flower" / "superlink.log").read_text()
        assert "[/v1/fleet/activate-node][ApiError:2004]" in server_log  # the server saw both refusals
        assert "[/v1/fleet/register-node][ApiError:2001]" in server_log
    finally:
        started = _stop_all(link, clients)
    assert not [p for p in started if alive(p)], "a client process is still running"
    assert not [p for p in descendants(os.getpid()) if "flwr" in command_line(p) or "flower" in command_line(p)]
