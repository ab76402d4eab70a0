"""KV events for external routers: a real ZeroMQ SUB socket receives what an engine
publishes (`kv_events_endpoint`), decodes vLLM's wire layout by hand (plain msgpack
arrays, tagged events, topic + sequence number frames), checks every block hash from the
token ids it carries, and rebuilds the engine's set of cached blocks exactly, through
prefix hits, evictions and a reset. A subscriber that never reads, or none at all, costs
the engine nothing: it produces the same tokens as an engine that publishes nothing.
The events carry every prompt's token ids: the publisher binds this machine only unless
told otherwise, and then lets in only subscribers holding an allowed CURVE key."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.auth

from inspect_internals import wait_for_subscribers
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_event_access import CLIENT_PUBLIC_KEYS_ENV, SERVER_SECRET_KEY_ENV
from pagedllm.engine.kv_event_publisher import KVEventPublisher
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_args import engine_config
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.block_hash import hash_block

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def ids(prompt: list[int]) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt}


class Replica:
    """A router's view of one engine, rebuilt from the frames alone."""

    def __init__(self, sub: zmq.Socket, block_size: int) -> None:
        self.sub = sub
        self.block_size = block_size
        self.cached: set[bytes] = set()
        self.seqs: list[int] = []
        self.kinds: list[str] = []

    def drain(self, publisher: KVEventPublisher) -> int:
        """Apply batches until every batch the publisher was handed so far has arrived
        (none is dropped in these tests); how many arrived."""
        n = 0
        while len(self.seqs) < publisher.num_published:
            assert self.sub.poll(30_000), "a published batch did not arrive"  # a hang guard
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b""
            self.seqs.append(int.from_bytes(seq, "big"))
            self.apply(msgspec.msgpack.decode(payload))
            n += 1
        return n

    def apply(self, batch: Any) -> None:
        assert isinstance(batch, list) and isinstance(batch[0], float) and batch[1]
        assert abs(batch[0] - time.time()) < 60
        for event in batch[1]:
            kind = event[0]
            self.kinds.append(kind)
            if kind == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium, lora_name = event[1:]
                assert block_size == self.block_size
                assert (lora_id, medium, lora_name) == (None, None, None)
                assert len(tokens) == len(hashes) * block_size
                for i, block_hash in enumerate(hashes):  # the chain, rebuilt from tokens
                    block_tokens = tokens[i * block_size : (i + 1) * block_size]
                    assert hash_block(parent or b"", block_tokens) == block_hash
                    assert isinstance(block_hash, bytes) and len(block_hash) == 16
                    parent = block_hash
                self.cached.update(hashes)
            elif kind == "BlockRemoved":
                hashes, medium = event[1:]
                assert medium is None and set(hashes) <= self.cached
                self.cached.difference_update(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.cached.clear()


ENDPOINT = "tcp://127.0.0.1:*"  # the engine binds a free port of this machine


@pytest.fixture
def sockets() -> Iterator[list[zmq.Socket]]:
    made: list[zmq.Socket] = []
    yield made
    for socket in made:
        socket.close(linger=0)


def subscribe(llm: LLM, sockets: list[zmq.Socket], **options: int) -> zmq.Socket:
    """A SUB socket connected to the engine's publisher, once the publisher knows of it."""
    publisher = llm.engine.kv_events
    assert publisher is not None
    socket = zmq.Context.instance().socket(zmq.SUB)
    sockets.append(socket)
    for option, value in options.items():
        socket.setsockopt(getattr(zmq, option), value)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(publisher.endpoint)
    assert wait_for_subscribers(publisher, len(sockets))
    return socket


def engine_hashes(llm: LLM) -> frozenset[bytes]:
    hashes = llm.engine.snapshot(cached_hashes=True).cached_hashes
    assert hashes is not None
    return hashes


def test_a_subscriber_rebuilds_the_engines_cached_blocks_exactly(tiny_llama_dir, sockets) -> None:
    # 24 blocks of 4 tokens: the rounds below overflow it, so cached blocks get evicted.
    llm = LLM(
        str(tiny_llama_dir),
        block_size=4,
        num_kv_blocks=24,
        watermark=0.0,
        kv_events_endpoint=ENDPOINT,
    )
    publisher = llm.engine.kv_events
    assert publisher is not None and publisher.endpoint.startswith("tcp://127.0.0.1:")
    replica = Replica(subscribe(llm, sockets), 4)
    assert engine_hashes(llm) == frozenset()
    system = list(range(1, 22))  # 21 tokens: 5 full blocks every prompt shares
    rounds = [
        [[*system, 30, 31, 32]],
        [[*system, 40 + i, 41 + i, 42 + i, 43 + i, 44] for i in range(3)],  # prefix hits
        [list(range(50, 50 + 37)), list(range(90, 90 + 29))],  # new prompts: evictions
        [[*system, 30, 31, 32, 33, 34, 35]],
    ]
    for i, prompts in enumerate(rounds):
        outs = llm.generate([ids(p) for p in prompts], GREEDY, use_tqdm=False)
        assert replica.drain(publisher) > 0
        assert replica.cached == engine_hashes(llm), f"round {i}"
        if i == 1:
            assert outs[0].num_cached_tokens == 20
    assert llm.engine.kv.allocator.num_evictions > 0
    # A reset between steps goes out with the next step: the replica starts over too.
    llm.reset_prefix_cache()
    llm.generate([ids([*system, 7, 8])], GREEDY, use_tqdm=False)
    replica.drain(publisher)
    assert replica.cached == engine_hashes(llm) != frozenset()
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} == set(replica.kinds)
    # One batch per step that changed the cache, numbered 0, 1, 2, ... without a gap.
    assert replica.seqs == list(range(len(replica.seqs)))
    # (num_sent may lag the last arrival: it counts after the send returns)
    assert publisher.num_published == len(replica.seqs) and publisher.num_dropped == 0
    llm.engine.shutdown()
    assert llm.engine.kv_events is None


def test_consecutive_blocks_of_a_prompt_share_one_event(tiny_llama_dir, sockets) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, kv_events_endpoint=ENDPOINT)
    socket = subscribe(llm, sockets)
    llm.generate([ids(list(range(1, 18)))], SamplingParams(max_tokens=1), use_tqdm=False)
    frames = [socket.recv_multipart() for _ in range(1)]
    batch = msgspec.msgpack.decode(frames[0][2])
    # The 17-token prompt's 4 full blocks are cached in its one step, as one chain.
    assert [e[0] for e in batch[1]] == ["BlockStored"]
    stored = batch[1][0]
    assert len(stored[1]) == 4 and stored[2] is None and stored[3] == list(range(1, 17))
    llm.engine.shutdown()


def test_no_subscriber_or_a_stalled_one_changes_nothing_in_the_engine(
    tiny_llama_dir, sockets
) -> None:
    prompts = [ids([*range(1, 30), i]) for i in range(8)]
    options: dict[str, Any] = dict(block_size=4, num_kv_blocks=40, watermark=0.0)
    plain = LLM(str(tiny_llama_dir), **options)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    for stalled in (False, True):
        llm = LLM(str(tiny_llama_dir), kv_events_endpoint=ENDPOINT, **options)
        if stalled:  # subscribes, then never reads, with room for one message
            subscribe(llm, sockets, RCVHWM=1)
        got = llm.generate(prompts * 3, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want * 3
        publisher = llm.engine.kv_events
        assert publisher is not None
        start = time.monotonic()
        llm.engine.shutdown()  # the stalled subscriber does not hold it (a hang guard:
        assert time.monotonic() - start < 30  # close() itself may wait 2 s + 2 s)
        assert publisher.num_dropped == 0 and publisher.num_sent > 0


def test_the_endpoint_is_an_engine_option_checked_at_creation() -> None:
    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    assert engine_config(args).kv_events_endpoint == "tcp://127.0.0.1:5557"
    for bad in ("127.0.0.1:5557", "tcp://host", "http://x:1", "tcp://*:port"):
        with pytest.raises(InvalidParameterError) as info:
            engine_config(build_parser().parse_args(["serve", "--kv-events-endpoint", bad]))
        assert info.value.param == "kv_events_endpoint"


# ------------------------------------------------------------ who may subscribe
@pytest.fixture
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SERVER_SECRET_KEY_ENV, raising=False)
    monkeypatch.delenv(CLIENT_PUBLIC_KEYS_ENV, raising=False)


@pytest.fixture
def certificates(tmp_path: Path) -> dict[str, Path]:
    """zmq.auth certificates: the publisher's, an allowed subscriber's (its public key in
    the folder `allowed`, where the publisher reads only .key files) and a stranger's."""
    for folder in ("allowed", "stranger"):
        (tmp_path / folder).mkdir()
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    _, allowed_secret = zmq.auth.create_certificates(tmp_path / "allowed", "router")
    _, stranger_secret = zmq.auth.create_certificates(tmp_path / "stranger", "stranger")
    return {
        "server": Path(server_public),
        "server_secret": Path(server_secret),
        "allowed": tmp_path / "allowed",
        "allowed_secret": Path(allowed_secret),
        "stranger_secret": Path(stranger_secret),
    }


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5557",
        "tcp://0.0.0.0:5557",
        "tcp://[::]:5557",
        "tcp://192.168.1.20:5557",
        "tcp://eth0:5557",
        "tcp://router.example:5557",
    ],
)
def test_an_endpoint_other_machines_reach_is_refused_without_allow_remote(endpoint) -> None:
    for make in (
        lambda: EngineConfig(kv_events_endpoint=endpoint),
        lambda: engine_config(
            build_parser().parse_args(["serve", "--kv-events-endpoint", endpoint])
        ),
    ):
        with pytest.raises(InvalidParameterError) as info:
            make()
        assert info.value.param == "kv_events_endpoint"
        assert "--kv-events-allow-remote" in str(info.value)
        assert "tcp://127.0.0.1:PORT" in str(info.value)


def test_local_endpoints_need_neither_the_flag_nor_keys(no_key_in_env) -> None:
    for endpoint in (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.2:*",
        "tcp://localhost:5557",
        "tcp://[::1]:5557",
        "ipc:///run/pagedllm/kv.sock",
        "inproc://kv",
    ):
        assert EngineConfig(kv_events_endpoint=endpoint).kv_events_keys() is None


def test_a_remote_endpoint_without_keys_is_refused_unless_unauthenticated_is_asked(
    no_key_in_env, certificates
) -> None:
    remote = dict(kv_events_endpoint="tcp://*:5557", kv_events_allow_remote=True)
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(**remote)
    assert info.value.param == "kv_events_server_key"
    assert "--kv-events-allow-unauthenticated" in str(info.value)
    args = ["serve", "--kv-events-endpoint", "tcp://*:5557", "--kv-events-allow-remote"]
    with pytest.raises(InvalidParameterError):
        engine_config(build_parser().parse_args(args))
    opted_out = engine_config(
        build_parser().parse_args([*args, "--kv-events-allow-unauthenticated"])
    )
    assert opted_out.kv_events_keys() is None
    # Half the keys, or a certificate without the key asked for, is refused by name.
    halves = [
        (dict(kv_events_server_key=str(certificates["server_secret"])), "kv_events_client_keys"),
        (dict(kv_events_client_keys=str(certificates["allowed"])), "kv_events_server_key"),
        (
            dict(
                kv_events_server_key=str(certificates["server"]),  # the public half
                kv_events_client_keys=str(certificates["allowed"]),
            ),
            "kv_events_server_key",
        ),
        (
            dict(
                kv_events_server_key=str(certificates["server_secret"]),
                kv_events_client_keys=str(certificates["server"].parent / "nowhere"),
            ),
            "kv_events_client_keys",
        ),
    ]
    for keys, param in halves:
        with pytest.raises(InvalidParameterError) as info:
            EngineConfig(**remote, **keys)
        assert info.value.param == param


def test_the_keys_come_from_files_or_the_environment(monkeypatch, certificates) -> None:
    files = EngineConfig(
        kv_events_endpoint="tcp://*:5557",
        kv_events_allow_remote=True,
        kv_events_server_key=str(certificates["server_secret"]),
        kv_events_client_keys=str(certificates["allowed"]),
    ).kv_events_keys()
    server_public, server_secret = zmq.auth.load_certificate(certificates["server_secret"])
    (allowed_public,) = zmq.auth.load_certificates(certificates["allowed"])
    assert files is not None and files.server_public == server_public
    assert files.client_publics == {allowed_public}
    assert server_secret.decode() not in repr(files)  # a secret never reaches a log line
    monkeypatch.setenv(SERVER_SECRET_KEY_ENV, server_secret.decode())
    monkeypatch.setenv(CLIENT_PUBLIC_KEYS_ENV, f" {allowed_public.decode()}, ")
    remote = EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_allow_remote=True)
    assert remote.kv_events_keys() == files
    monkeypatch.setenv(CLIENT_PUBLIC_KEYS_ENV, "not-a-key")
    with pytest.raises(InvalidParameterError) as info:
        remote.kv_events_keys()
    assert info.value.param == "kv_events_client_keys"


def test_only_subscribers_with_an_allowed_key_receive_a_prompts_tokens(
    tiny_llama_dir, sockets, certificates
) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        block_size=4,
        kv_events_endpoint="tcp://*:*",
        kv_events_allow_remote=True,
        kv_events_server_key=str(certificates["server_secret"]),
        kv_events_client_keys=str(certificates["allowed"]),
    )
    publisher = llm.engine.kv_events
    assert publisher is not None
    address = "tcp://127.0.0.1:" + publisher.endpoint.rsplit(":", 1)[1]
    server_public, _ = zmq.auth.load_certificate(certificates["server"])

    def subscriber(secret: Path | None) -> zmq.Socket:
        socket = zmq.Context.instance().socket(zmq.SUB)
        sockets.append(socket)
        if secret is not None:
            socket.curve_publickey, socket.curve_secretkey = zmq.auth.load_certificate(secret)
            socket.curve_serverkey = server_public
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(address)
        return socket

    anyone = subscriber(None)  # no credentials at all
    stranger = subscriber(certificates["stranger_secret"])  # knows the server, not allowed
    router = subscriber(certificates["allowed_secret"])
    assert wait_for_subscribers(publisher, 1)
    assert not wait_for_subscribers(publisher, 2, timeout=1.0)  # the other two never got in
    secret_prompt = list(range(101, 117))  # 4 full blocks of someone's prompt
    llm.generate([ids(secret_prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
    assert router.poll(10_000)
    _, _, payload = router.recv_multipart()
    stored = msgspec.msgpack.decode(payload)[1][0]
    assert stored[0] == "BlockStored" and stored[3] == secret_prompt
    assert anyone.poll(500) == 0 and stranger.poll(500) == 0
    llm.engine.shutdown()


def test_an_ipc_socket_file_is_its_owners_only(tmp_path: Path) -> None:
    old_umask = os.umask(0o000)  # the most open a user's umask can leave it
    try:
        publisher = KVEventPublisher(f"ipc://{tmp_path}/kv.sock")
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "kv.sock").st_mode) == 0o600
    finally:
        publisher.close()
