"""Who may read the KV events: where the publisher may bind, and the CURVE keys that
authenticate its subscribers.

The events carry the token ids of every client's prompt, so the publisher binds this
machine only (a loopback address, an ipc:// socket file that only its owner may open, or
inproc://) unless `allow_remote` is set, and a publisher reachable from other machines
takes only subscribers whose CURVE public key it was given, unless `allow_unauthenticated`
says otherwise. Keys come from certificate files in zmq.auth's format (made with
`zmq.auth.create_certificates`) or, when no file is named, from the environment. Plain
Python until keys are read (then pyzmq, for its certificate reader and key checks).
"""

from __future__ import annotations

import ipaddress
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.errors import InvalidParameterError

SERVER_SECRET_KEY_ENV = "PAGEDLLM_KV_EVENTS_SERVER_SECRET_KEY"
CLIENT_PUBLIC_KEYS_ENV = "PAGEDLLM_KV_EVENTS_CLIENT_PUBLIC_KEYS"

_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[\w.-]+):(\*|\d{1,5})|(ipc|inproc)://\S+")


@dataclass(frozen=True)
class CurveKeys:
    """The publisher's CURVE key pair and the public keys of the subscribers it accepts,
    each 40 characters of Z85 (zmq.auth's form)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_publics: frozenset[bytes]


def is_local(endpoint: str) -> bool:
    """Whether binding `endpoint` lets only this machine in: a loopback address,
    `localhost`, ipc:// or inproc://. A wildcard, an interface or a host name is not."""
    transport, _, address = endpoint.partition("://")
    if transport != "tcp":
        return True
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def who_may_subscribe(endpoint: str, keys: CurveKeys | None) -> str:
    """A line for the log: who can read what the publisher at `endpoint` sends."""
    if keys is not None:
        return f"CURVE: the holders of {len(keys.client_publics)} allowed key(s)"
    if is_local(endpoint):
        return "no authentication: any process of this machine"
    return "no authentication: anyone who can reach it, every prompt's token ids"


def publisher_keys(
    endpoint: str,
    *,
    allow_remote: bool,
    server_key: str | None,
    client_keys: str | None,
    allow_unauthenticated: bool,
    environ: Mapping[str, str] = os.environ,
) -> CurveKeys | None:
    """Check that the publisher may bind `endpoint` as asked, and return the CURVE keys it
    authenticates with (files first, then `environ`); None: no authentication."""
    if not _ENDPOINT.fullmatch(endpoint):
        raise InvalidParameterError(
            "kv_events_endpoint",
            "kv_events_endpoint must be a ZeroMQ endpoint: tcp://HOST:PORT, ipc://PATH or "
            f"inproc://NAME, got {endpoint!r}",
        )
    remote = not is_local(endpoint)
    if remote and not allow_remote:
        raise InvalidParameterError(
            "kv_events_endpoint",
            f"kv_events_endpoint {endpoint!r} can be reached from other machines, and KV "
            "events carry the token ids of every client's prompt: bind a loopback address "
            "(tcp://127.0.0.1:PORT) or ipc://PATH, or pass --kv-events-allow-remote "
            "(kv_events_allow_remote=True) with CURVE keys (docs/kv-events.md)",
        )
    secret = _server_secret(server_key, environ)
    publics = _client_publics(client_keys, environ)
    if secret is None and publics is None:
        if remote and not allow_unauthenticated:
            raise InvalidParameterError(
                "kv_events_server_key",
                f"kv_events_endpoint {endpoint!r} can be reached from other machines: give "
                "the CURVE keys that authenticate subscribers (--kv-events-server-key FILE "
                f"and --kv-events-client-keys DIR, or ${SERVER_SECRET_KEY_ENV} and "
                f"${CLIENT_PUBLIC_KEYS_ENV}), or pass --kv-events-allow-unauthenticated to "
                "let anyone who reaches it read every prompt's token ids",
            )
        return None
    # One half without the other would encrypt without choosing who reads, or not start.
    if secret is None:
        raise InvalidParameterError(
            "kv_events_server_key",
            "subscribers' public keys were given without the publisher's secret key: give "
            f"--kv-events-server-key FILE (a .key_secret certificate) or ${SERVER_SECRET_KEY_ENV}",
        )
    if not publics:
        raise InvalidParameterError(
            "kv_events_client_keys",
            "the publisher's secret key was given without the public keys of the subscribers "
            "it accepts: give --kv-events-client-keys (a directory of .key certificates, or "
            f"one) or ${CLIENT_PUBLIC_KEYS_ENV} (Z85 keys separated by commas)",
        )
    import zmq

    return CurveKeys(zmq.curve_public(secret), secret, publics)


def _server_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    if path is None:
        value = environ.get(SERVER_SECRET_KEY_ENV, "").strip()
        return _z85_key(value.encode(), "kv_events_server_key", SERVER_SECRET_KEY_ENV) or None
    import zmq.auth

    try:
        _, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise InvalidParameterError(
            "kv_events_server_key", f"kv_events_server_key: cannot read {path!r}: {e}"
        ) from e
    if secret is None:
        raise InvalidParameterError(
            "kv_events_server_key",
            f"kv_events_server_key {path!r} holds no secret key: give the .key_secret "
            "certificate, not the public .key one",
        )
    return _z85_key(secret, "kv_events_server_key", path)


def _client_publics(path: str | None, environ: Mapping[str, str]) -> frozenset[bytes] | None:
    if path is None:
        value = environ.get(CLIENT_PUBLIC_KEYS_ENV, "")
        keys = [k.encode() for k in re.split(r"[\s,]+", value) if k]
        where = CLIENT_PUBLIC_KEYS_ENV
    else:
        import zmq.auth

        try:
            if Path(path).is_dir():
                keys = list(zmq.auth.load_certificates(path))
            else:
                keys = [zmq.auth.load_certificate(path)[0]]
        except (OSError, ValueError) as e:
            raise InvalidParameterError(
                "kv_events_client_keys", f"kv_events_client_keys: cannot read {path!r}: {e}"
            ) from e
        if not keys:
            raise InvalidParameterError(
                "kv_events_client_keys",
                f"kv_events_client_keys: no .key certificate in the directory {path!r}",
            )
        where = path
    if not keys:
        return None
    return frozenset(_z85_key(k, "kv_events_client_keys", where) for k in keys)


def _z85_key(key: bytes, param: str, where: str) -> bytes:
    """`key` if it is a CURVE key in Z85 (40 characters); b"" stays b"" (none given)."""
    if not key:
        return key
    from zmq.utils import z85

    try:
        valid = len(key) == 40 and len(z85.decode(key)) == 32
    except (KeyError, struct.error):  # a character outside Z85, a value over 32 bits
        valid = False
    if not valid:
        raise InvalidParameterError(
            param, f"{param}: {where} holds no CURVE key (40 characters of Z85)"
        )
    return key
