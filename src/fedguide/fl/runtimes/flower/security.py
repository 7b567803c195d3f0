"""Security of a Flower deployment beyond this machine, server and client side: the ``runtime.tls``
and ``runtime.auth`` sections (checked when a config is read, so a missing or wrong file fails before
any process starts), the SuperNodes' keys, and which connections may go without TLS.

Decisions (README "Running on several machines"):
- Paths are those of the machine that reads the config: server and clients may hold different ones
  (the config fingerprint leaves ``runtime`` out).
- With ``runtime.tls`` the SuperLink serves HTTPS (Flower's ``--ssl-ca-certfile/--ssl-certfile/
  --ssl-keyfile``) and its certificate is checked for the address ``fedguide serve`` itself reaches it
  at; without it, a SuperLink beyond loopback (server) or a SuperLink on another machine (client)
  needs an explicit ``--insecure``.
- SuperNode authentication takes OpenSSH ECDSA keys on a NIST curve, the kind Flower admits: the
  server registers the allow-list (``runtime.auth.public_keys``), each client proves its
  ``runtime.auth.private_key``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fedguide.fl.runtimes.flower.messages import FlowerRuntimeFailed
from fedguide.fl.runtimes.flower.processes import address_host, is_loopback
from fedguide.registry import ConfigError

NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")
HOW_TO_MAKE = 'README "Running on several machines" shows how to make them'


def _existing_file(value: Optional[Path], where: str, what: str) -> Optional[Path]:
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value} is not a file on this machine; set {where} to {what} ({HOW_TO_MAKE})")
    return path.resolve()


def public_keys_in(path: Path) -> list[str]:
    """The OpenSSH public keys of a file (one a line, '#' comments and blank lines skipped), each
    checked to be an EC key on a NIST curve, the kind Flower's SuperNode authentication takes."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    keys = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = load_ssh_public_key(line.encode())
        except (ValueError, TypeError, UnsupportedAlgorithm) as err:
            raise ValueError(f"{path} line {number} is not an OpenSSH public key ({err})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in NIST_CURVES:
            raise ValueError(f"{path} line {number} is not an ECDSA key on a NIST curve (make one with "
                             "ssh-keygen -t ecdsa -b 384)")
        keys.append(line)
    if not keys:
        raise ValueError(f"{path} holds no public key")
    return keys


class TLSParams(BaseModel):
    """Flower's TLS: the SuperLink serves HTTPS with ``cert``/``key``; the SuperNodes and the server's own
    ``flwr``/ServerApp connections check it against ``ca``."""
    model_config = ConfigDict(extra="forbid")
    ca: Path = Field(description="PEM certificate of the CA that signed the SuperLink's certificate (server and "
                                 "clients)")
    cert: Optional[Path] = Field(None, description="server: the SuperLink's PEM certificate, naming the address the "
                                                   "clients use and 127.0.0.1 (or the --host address)")
    key: Optional[Path] = Field(None, description="server: the PEM private key of cert")

    @field_validator("ca", "cert", "key")
    @classmethod
    def _exists(cls, value: Optional[Path], info: ValidationInfo) -> Optional[Path]:
        what = {"ca": "the CA certificate (PEM)", "cert": "the SuperLink's certificate (PEM)",
                "key": "the SuperLink's private key (PEM)"}[info.field_name]
        return _existing_file(value, f"runtime.tls.{info.field_name}", what)

    @model_validator(mode="after")
    def _pair(self) -> "TLSParams":
        if (self.cert is None) != (self.key is None):
            raise ValueError("runtime.tls.cert and runtime.tls.key go together (the SuperLink's certificate and "
                             "its private key, on the server)")
        return self


class AuthParams(BaseModel):
    """Flower's SuperNode authentication: the SuperLink admits the SuperNodes whose public keys
    ``fedguide serve`` registered (the allow-list), each proving its key with every request."""
    model_config = ConfigDict(extra="forbid")
    public_keys: list[Path] = Field(
        default_factory=list, description="server: the allow-list, files of OpenSSH ECDSA public keys (one a line) of "
                                          "the clients' SuperNodes; registered when 'fedguide serve' starts, any "
                                          "other SuperNode is refused")
    private_key: Optional[Path] = Field(
        None, description="client: this client's SuperNode private key, OpenSSH ECDSA without a passphrase "
                          "(ssh-keygen -t ecdsa -b 384 -N '' -f client-0)")

    @field_validator("public_keys")
    @classmethod
    def _public(cls, value: list[Path]) -> list[Path]:
        what = "files of the clients' OpenSSH public keys"
        paths = [_existing_file(p, "runtime.auth.public_keys", what) for p in value]
        for path in paths:
            public_keys_in(path)
        return paths

    @field_validator("private_key")
    @classmethod
    def _private(cls, value: Optional[Path]) -> Optional[Path]:
        path = _existing_file(value, "runtime.auth.private_key", "this client's OpenSSH private key")
        if path is not None:
            from cryptography.exceptions import UnsupportedAlgorithm
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.hazmat.primitives.serialization import load_ssh_private_key

            try:
                key = load_ssh_private_key(path.read_bytes(), None)
            except (ValueError, TypeError, UnsupportedAlgorithm) as err:
                raise ValueError(f"{value} is not an OpenSSH private key without a passphrase ({err}); make one "
                                 "with ssh-keygen -t ecdsa -b 384 -N ''") from None
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{value} is not an ECDSA key; make one with ssh-keygen -t ecdsa -b 384 -N ''")
        return path

    @model_validator(mode="after")
    def _something(self) -> "AuthParams":
        if not self.public_keys and self.private_key is None:
            raise ValueError("runtime.auth needs public_keys (server: the clients' public keys) or private_key "
                             "(client: its own key)")
        return self


def check_certificate(host: str, port: int, tls: TLSParams) -> None:
    """The SuperLink's certificate verifies against the CA for ``host``, the address ``serve``'s
    ``flwr`` commands and the ServerApp connect to; a clear error otherwise (Flower's is 'unavailable')."""
    import ipaddress
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(tls.ca))
    try:
        with socket.create_connection((host, port), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                pass
    except ssl.SSLCertVerificationError as err:
        try:
            san = f"IP:{ipaddress.ip_address(host)}"
        except ValueError:
            san = f"DNS:{host}"
        raise ConfigError(f"the SuperLink's certificate {tls.cert} does not verify for {host} against "
                          f"runtime.tls.ca {tls.ca}: {str(err.verify_message).rstrip('.')}. It must be signed by that "
                          f"CA and name {host} (subjectAltName {san}: this machine reaches the SuperLink there) "
                          "besides the address the clients use") from None
    except (ssl.SSLError, OSError) as err:
        raise FlowerRuntimeFailed(f"a TLS connection to the SuperLink at {host}:{port} failed: {err}") from None


def check_exposure(host: str, tls: Optional[TLSParams], insecure: bool) -> Optional[str]:
    """Refuse a SuperLink that other machines reach without TLS unless ``--insecure`` says so; the
    warning to print, if any."""
    if insecure and tls is not None:
        raise ConfigError("--insecure and runtime.tls contradict each other: drop --insecure to serve over TLS, "
                          "or remove runtime.tls")
    if is_loopback(host):
        return None
    if tls is None and not insecure:
        raise ConfigError(f"--host {host} lets other machines reach the SuperLink: set runtime.tls (ca, cert, key) "
                          "and runtime.auth.public_keys so the traffic is encrypted and only your clients join "
                          "(README \"Running on several machines\"), or pass --insecure to serve plain HTTP on a "
                          "network you trust")
    if tls is None:
        return (f"warning: --insecure: the SuperLink on {host} speaks plain HTTP, and any machine that reaches its "
                f"port can join as a client")
    return None


def check_connection(address: str, tls, insecure: bool) -> None:
    """Refuse plain HTTP to a SuperLink on another machine unless ``--insecure`` says so."""
    if insecure and tls is not None:
        raise ConfigError("--insecure and runtime.tls contradict each other: drop --insecure to connect over TLS, "
                          "or remove runtime.tls")
    if tls is None and not insecure and not is_loopback(address_host(address)):
        raise ConfigError(f"the SuperLink {address} is on another machine: set runtime.tls.ca to the CA certificate "
                          "that signed its certificate (and runtime.auth.private_key to this client's key if the "
                          "server authenticates clients), or pass --insecure to connect over plain HTTP on a "
                          "network you trust")


class Security:
    """How this client's SuperNodes reach the SuperLink: TLS (the CA's certificate) and the key they
    authenticate with, or plain HTTP."""

    def __init__(self, ca: Optional[Path] = None, private_key: Optional[Path] = None):
        self.ca, self.private_key = ca, private_key

    def args(self) -> list[str]:
        out = ["--root-certificates", str(self.ca)] if self.ca else ["--insecure"]
        return out + (["--auth-supernode-private-key", str(self.private_key)] if self.private_key else [])
