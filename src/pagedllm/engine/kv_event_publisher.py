"""KVEventPublisher: sends KV-event batches over ZeroMQ from a thread of its own.

The engine's thread only puts a step's events in a bounded queue (`publish`, never
blocking); the publisher's thread encodes each batch (engine/kv_event_wire.py) and sends
it as three frames: topic, 8-byte big-endian sequence number, payload. The socket is an
XPUB (a PUB that also sees subscriptions: it counts them, so one can tell when a
subscriber listens); like any PUB it drops what a subscriber too slow to take it cannot
hold (its high-water mark), and sends nothing anywhere while no one subscribes. A full
queue drops the batch and counts it (`num_dropped`); the sequence number still advances,
so a subscriber sees the gap. Nothing a subscriber does (or fails to do) holds the engine.

The publisher binds its endpoint and subscribers connect to it: `tcp://127.0.0.1:5557`
(this machine only), `tcp://*:5557` (every interface, when allowed), port `*` for any free one
(`endpoint` then says which), `ipc://PATH` (a socket file only its owner may open). (vLLM
connects instead when the host is not a wildcard; a router that binds and waits for
engines to connect does not work here.) Where it may bind, and with which keys, is
decided before (engine/kv_event_access.py): given CURVE keys, the socket is a CURVE server
and a ZAP handler of its own ZeroMQ context lets in only the allowed subscriber keys; a
subscriber without them never completes the handshake, so it receives nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pagedllm.engine.kv_event_access import CurveKeys
from pagedllm.engine.kv_event_wire import KVEventBatch, encoder

logger = logging.getLogger("pagedllm")

_STOP = None


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        max_queue: int = 10_000,
        hwm: int = 100_000,
        keys: CurveKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.num_published = 0  # batches handed to `publish`, dropped ones included
        self.num_dropped = 0  # batches dropped because the queue was full
        self.num_sent = 0
        # (sequence number, batch): numbered as published, so a dropped batch is a gap
        # exactly where it was.
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(max_queue)
        # Subscriptions known so far, under `_subscribed` (notified on each change): the
        # tests wait on it before publishing.
        self._subscribers = 0
        self._subscribed = threading.Condition()
        self._seq = itertools.count()
        # A context of its own: a ZAP handler serves every socket of its context.
        self._context = zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self._socket = self._context.socket(zmq.XPUB)
        try:
            self._socket.set_hwm(hwm)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not the first
            self._socket.setsockopt(zmq.IPV6, endpoint.startswith("tcp://["))  # [::1] binds
            if keys is not None:
                self._authenticate(keys)
            self._socket.bind(endpoint)
            # What a subscriber connects to (the port chosen, when `*` was asked for).
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            transport, _, path = self.endpoint.partition("://")
            if transport == "ipc" and not path.startswith("@"):  # @: Linux's abstract names
                # Other local users may open the socket file as the umask left it: not now.
                os.chmod(path, 0o600)
        except BaseException:
            self._close_socket()
            raise
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch; never blocks (a full queue drops it, counted)."""
        seq = next(self._seq)
        self.num_published = seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then stop."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            logger.warning("KV events: %d batches unsent at shutdown", self._queue.qsize())
            self._queue = queue.Queue(maxsize=1)
            self._queue.put(_STOP)
        self._thread.join(timeout)

    def _authenticate(self, keys: CurveKeys) -> None:
        """Be a CURVE server that lets in only the subscribers holding an allowed key."""
        self._authenticator = ThreadAuthenticator(self._context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", _AllowedKeys(keys.client_publics))
        self._socket.curve_secretkey = keys.server_secret
        self._socket.curve_publickey = keys.server_public
        self._socket.curve_server = True

    def _close_socket(self) -> None:
        self._socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        encode = encoder().encode
        try:
            while True:
                self._note_subscriptions()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _STOP:
                    return
                seq, batch = item
                frames = (self.topic, seq.to_bytes(8, "big"), encode(batch))
                try:
                    self._socket.send_multipart(frames, zmq.NOBLOCK)
                    self.num_sent += 1
                except zmq.Again:  # no peer can take it now: as a PUB would, drop it
                    self.num_dropped += 1
        except Exception:
            logger.exception("KV events: the publisher thread failed; no more events are sent")
        finally:
            self._close_socket()

    def _note_subscriptions(self) -> None:
        """Count (un)subscriptions: XPUB hands them over as b"\\x01topic" / b"\\x00topic"."""
        while self._socket.poll(0, zmq.POLLIN):
            message = self._socket.recv()
            if message[:1] in (b"\x00", b"\x01"):
                with self._subscribed:
                    self._subscribers += 1 if message[:1] == b"\x01" else -1
                    self._subscribed.notify_all()


class _AllowedKeys:
    """The ZAP handler's question, answered: is this subscriber's key (Z85) allowed?"""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys
