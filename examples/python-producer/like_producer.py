#!/usr/bin/env python3
"""Publishes likes and unlikes to tally's topic as docs/contract.md asks of producers.

    python3 like_producer.py --bootstrap HOST:PORT --topic TOPIC --events FILE
        [--schema-registry-framing --schema-id N] [--compression zstd] [--linger-ms 20]
        [--positions FILE]

`LikeProducer` is the part to copy into a service; the rest is the command line the tests
drive. The `LikeEvent` class is generated from the contract, proto/tally/v1/like_event.proto,
into gen/ beside this file (README.md):

    python3 -m grpc_tools.protoc -I ../../proto --python_out=gen ../../proto/tally/v1/like_event.proto

--events holds one event a line, POST_ID USER_ID ACTION EVENT_TIME_MS [EVENT_ID], with ACTION
`like` or `unlike` and the ids unsigned 64-bit; blank lines and lines starting with # are
skipped. Every line is checked before anything is sent, so a bad file produces nothing. Once
every event is acknowledged it prints one JSON object on stdout (what it sent, the settings it
sent with, the client's batching figures) and, with --positions, writes
INDEX<TAB>PARTITION<TAB>OFFSET for each event, INDEX counting events from 0.

Exit status: 0 when every event was acknowledged, 1 when one was not, 2 for bad arguments or a
bad events file.
"""

import argparse
import json
import os
import struct
import sys

from confluent_kafka import Producer, libversion
from confluent_kafka import __version__ as client_version

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen"))
try:
    from tally.v1 import like_event_pb2  # noqa: E402
except ImportError as e:
    sys.exit(
        f"like-producer: the LikeEvent code is not generated ({e}); run in "
        "examples/python-producer: python3 -m grpc_tools.protoc -I ../../proto "
        "--python_out=gen ../../proto/tally/v1/like_event.proto"
    )

DEFAULT_LINGER_MS = 20
DEFAULT_COMPRESSION = "zstd"
BATCH_SIZE_BYTES = 262144


def schema_registry_header(schema_id):
    """Confluent Schema Registry framing under `schema_id`, written by hand: the magic byte 0,
    the id as 4 bytes big-endian, and the message-index list [0] (LikeEvent is the first
    message of like_event.proto) in its short form, the single byte 0. tally accepts no other
    list. confluent-kafka's ProtobufSerializer writes the same bytes, but needs a registry to
    talk to."""
    return struct.pack(">bIb", 0, schema_id, 0)


class LikeProducer:
    """tally counts every message it finds on the topic exactly once. It cannot tell a like the
    producer wrote twice from two likes, nor count a like the topic lost; those two are the
    producer's to prevent, and `config` is set for it:

    - enable.idempotence=true: a batch retried after a lost acknowledgement is written once,
      since the broker drops a batch whose producer id and sequence number it already holds.
    - acks=all: a like is acknowledged once every in-sync replica holds it, so a leader that
      fails after the acknowledgement does not take it along. Idempotence requires it.
    - max.in.flight.requests.per.connection=5: the most the idempotent producer allows while
      keeping each partition in order through retries.

    The key is the user_id, 8 bytes big-endian: tally ignores keys, and keying by user spreads
    a viral post's likes over every partition and so every consumer, while keeping one user's
    events (and every copy of one like, which dedupe needs) on one partition.
    """

    @staticmethod
    def config(bootstrap, compression=DEFAULT_COMPRESSION, linger_ms=DEFAULT_LINGER_MS):
        return {
            "bootstrap.servers": bootstrap,
            "client.id": "tally-like-producer",
            "enable.idempotence": "true",
            "acks": "all",
            "max.in.flight.requests.per.connection": "5",
            "linger.ms": str(linger_ms),
            "batch.size": str(BATCH_SIZE_BYTES),
            "compression.type": compression,
        }

    def __init__(self, config, topic, framing=None, on_stats=None):
        """`framing` None writes plain protobuf, else each value behind that header
        (`schema_registry_header`)."""
        extra = {"statistics.interval.ms": 200, "stats_cb": on_stats} if on_stats else {}
        self._producer = Producer({**config, **extra})
        self._topic = topic
        self._framing = framing or b""

    def send(self, post_id, user_id, action, event_time_ms, event_id="", on_delivery=None):
        """Queues one like or unlike, keyed by its user; `on_delivery(err, msg)` learns where it
        landed or why it was not written. `event_id` names the like for tally's dedupe: every
        send of one like carries the same id (an outbox row's id, a request id kept across
        retries). The Kafka timestamp is left to the client's clock: it, not event_time_ms,
        decides which routing version tally counts the event in.

        Refuses what tally would dead-letter: post_id 0, an action other than LIKE and UNLIKE.
        """
        if post_id == 0:
            raise ValueError("post_id 0 names no post")
        if action not in (like_event_pb2.ACTION_LIKE, like_event_pb2.ACTION_UNLIKE):
            raise ValueError(f"action must be ACTION_LIKE or ACTION_UNLIKE: {action}")
        event = like_event_pb2.LikeEvent(
            post_id=post_id,
            user_id=user_id,
            action=action,
            event_time_ms=event_time_ms,
            event_id=event_id,
        )
        value = self._framing + event.SerializeToString()
        key = struct.pack(">Q", user_id)
        while True:
            try:
                self._producer.produce(self._topic, value, key, on_delivery=on_delivery)
                break
            except BufferError:
                # The local queue is full: serve delivery reports until there is room.
                self._producer.poll(0.1)
        self._producer.poll(0)

    def flush(self):
        """Sends what is queued and waits until each send has completed or failed; returns how
        many are still queued (0 unless it gave up)."""
        return self._producer.flush(60)

    def poll(self, timeout):
        return self._producer.poll(timeout)


class UsageError(Exception):
    pass


def read_events(path):
    events = []
    try:
        with open(path, encoding="ascii") as f:
            lines = f.readlines()
    except OSError as e:
        raise UsageError(f"cannot read --events {path}: {e}")
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{path}:{number}: "
        if len(fields) not in (4, 5):
            raise UsageError(where + "want POST_ID USER_ID like|unlike EVENT_TIME_MS [EVENT_ID]")
        action = {"like": like_event_pb2.ACTION_LIKE, "unlike": like_event_pb2.ACTION_UNLIKE}.get(
            fields[2]
        )
        if action is None:
            raise UsageError(where + f"action must be like or unlike: {fields[2]}")
        try:
            post, user, time_ms = int(fields[0]), int(fields[1]), int(fields[3])
        except ValueError as e:
            raise UsageError(where + str(e))
        if not (0 < post < 2**64 and 0 <= user < 2**64):
            raise UsageError(where + "ids are unsigned 64-bit, and post_id 0 names no post")
        event_id = fields[4] if len(fields) == 5 else ""
        events.append((post, user, action, time_ms, event_id))
    return events


def main(argv):
    parser = argparse.ArgumentParser(prog="like-producer")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--schema-registry-framing", action="store_true")
    parser.add_argument("--schema-id", type=int)
    parser.add_argument("--compression", default=DEFAULT_COMPRESSION,
                        choices=["none", "gzip", "snappy", "lz4", "zstd"])
    parser.add_argument("--linger-ms", type=int, default=DEFAULT_LINGER_MS)
    parser.add_argument("--positions")
    args = parser.parse_args(argv)  # exits 2 on bad arguments
    try:
        framing = None
        if args.schema_registry_framing:
            if args.schema_id is None or not 0 <= args.schema_id < 2**32:
                raise UsageError("--schema-id must be an unsigned 32-bit number")
            framing = schema_registry_header(args.schema_id)
        elif args.schema_id is not None:
            raise UsageError("--schema-id goes with --schema-registry-framing")
        events = read_events(args.events)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"like-producer: {e}", file=sys.stderr)
        return 2

    # librdkafka's statistics: each report's batchcnt covers the batches since the one before.
    batches = {"batches": 0, "records": 0}

    def on_stats(text):
        topic = json.loads(text).get("topics", {}).get(args.topic)
        if topic:
            batches["batches"] += topic["batchcnt"]["cnt"]
            batches["records"] += topic["batchcnt"]["sum"]

    config = LikeProducer.config(args.bootstrap, args.compression, args.linger_ms)
    producer = LikeProducer(config, args.topic, framing, on_stats=on_stats)
    positions = [None] * len(events)
    failures = []

    def delivered(index):
        def report(err, msg):
            if err is not None:
                failures.append(f"event {index}: {err}")
            else:
                positions[index] = (msg.partition(), msg.offset())
        return report

    for index, (post, user, action, time_ms, event_id) in enumerate(events):
        producer.send(post, user, action, time_ms, event_id, on_delivery=delivered(index))
    # Every delivery report has been served once flush returns 0.
    unsent = producer.flush()
    # One more statistics report, for the batches of the last interval.
    producer.poll(0.5)
    if unsent or failures:
        print(f"like-producer: {unsent + len(failures)} of {len(events)} events were not "
              f"written; the first: {failures[:10]}", file=sys.stderr)
        return 1
    if args.positions:
        with open(args.positions, "w", encoding="ascii") as f:
            for index, (partition, offset) in enumerate(positions):
                f.write(f"{index}\t{partition}\t{offset}\n")
    print(json.dumps({
        "sent": len(events),
        "delivered": len(events) - len(failures),
        "framing": "plain" if framing is None else "schema-registry",
        "schema_id": args.schema_id if framing is not None else None,
        "client": f"confluent-kafka {client_version} (librdkafka {libversion()[0]})",
        "config": {k: v for k, v in sorted(config.items()) if k != "bootstrap.servers"},
        "batches": batches["batches"],
        "records_per_batch_avg": batches["records"] / max(batches["batches"], 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
