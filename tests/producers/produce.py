#!/usr/bin/env python3
"""Produces Kafka messages with the Python Kafka client (confluent-kafka), for the end-to-end
tests of tally against a client other than its own.

Reads one message a line from --input: `PARTITION<TAB>KEY_HEX<TAB>VALUE_HEX` (an empty KEY_HEX
means no key), and produces them in order to --topic with --compression, letting the client
put many messages in each record batch (linger and batch limits large). Waits until every
message is delivered, writes where each landed to --positions if given, and prints one JSON
object on stdout:

    {"delivered": N, "batches": B, "batched_messages": M, "largest_batch": L,
     "compression": "zstd", "client": "confluent-kafka 2.x (librdkafka 2.x)"}

where B, M and L come from librdkafka's statistics (the record batches the producer sent and
the messages in them). Exits 2 when the client is not installed, 1 when a delivery fails.

With --events, each line is a like instead, encoded here as `tally.v1.LikeEvent` by hand:
`PARTITION<TAB>POST_ID<TAB>USER_ID<TAB>ACTION<TAB>TIME_MS<TAB>EVENT_ID` (an empty EVENT_ID
means none). With --resend SHARE, that share of the records carrying an event id is published
again, as an outbox relay that restarts does: half right behind the first copy (so usually in
the same record batch), half after up to --resend-gap more records or, for those still waiting
at the end, after everything else is delivered (a later batch). The report then also holds
"resent" and "resent_later", and --positions lists the first copies only.
"""

import argparse
import json
import random
import sys

try:
    import confluent_kafka
    from confluent_kafka import Producer
except ImportError as error:  # the Rust test turns this into an install hint
    print(f"confluent-kafka is not importable: {error}", file=sys.stderr)
    sys.exit(2)


def varint(value):
    """A protobuf varint: base 128, least significant group first."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def like_event(post_id, user_id, action, time_ms, event_id):
    """`tally.v1.LikeEvent` as proto3 encoders write it: fields in number order, zeros and an
    empty event id left out; `action` is an int32 enum, sign-extended to 64 bits on the wire;
    `event_id` (field 5) is a string: wire type 2, its length, its UTF-8 bytes."""
    out = bytearray()
    for number, value in ((1, post_id), (2, user_id), (3, action), (4, time_ms)):
        if value:
            out += varint(number << 3) + varint(value & 0xFFFFFFFFFFFFFFFF)
    if event_id:
        data = event_id.encode("utf-8")
        out += varint((5 << 3) | 2) + varint(len(data)) + data
    return bytes(out)


def read_messages(path, events):
    """(partition, key, value, has an event id) for every line of the input."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            fields = line.rstrip("\n").split("\t")
            if events:
                partition, post, user, action, time_ms, event_id = fields
                value = like_event(int(post), int(user), int(action), int(time_ms), event_id)
                yield int(partition), None, value, bool(event_id)
            else:
                partition, key, value = fields
                key = bytes.fromhex(key) if key else None
                yield int(partition), key, bytes.fromhex(value), False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument(
        "--compression", required=True, choices=["none", "gzip", "snappy", "lz4", "zstd"]
    )
    parser.add_argument("--input", required=True, help="the messages, one a line")
    parser.add_argument(
        "--positions", help="write `LINE<TAB>PARTITION<TAB>OFFSET` here for every message"
    )
    parser.add_argument(
        "--events", action="store_true", help="the input holds likes to encode, not values"
    )
    parser.add_argument(
        "--resend",
        type=float,
        default=0.0,
        help="share of the records with an event id to publish again (with --events)",
    )
    parser.add_argument(
        "--resend-gap", type=int, default=2000, help="records a later copy waits at most"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the resend choices")
    args = parser.parse_args()
    if args.resend and not args.events:
        parser.error("--resend needs --events")
    rng = random.Random(args.seed)

    batches = {"count": 0, "messages": 0, "largest": 0}

    def on_stats(text):
        # Window histograms: each report covers the batches sent since the previous one.
        topic = json.loads(text).get("topics", {}).get(args.topic)
        if topic:
            counts = topic["batchcnt"]
            batches["count"] += counts["cnt"]
            batches["messages"] += counts["sum"]
            batches["largest"] = max(batches["largest"], counts["max"])

    producer = Producer(
        {
            "bootstrap.servers": args.brokers,
            "compression.type": args.compression,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 200,
            "batch.num.messages": 500,
            "batch.size": 1000000,
            "message.timeout.ms": 120000,
            "statistics.interval.ms": 100,
            "stats_cb": on_stats,
        }
    )

    failures = []
    positions = {}
    copies = {"delivered": 0}

    def delivery(line):
        def on_delivery(error, message):
            if error is not None:
                failures.append(f"line {line}, partition {message.partition()}: {error}")
            elif line is None:
                copies["delivered"] += 1
            else:
                positions[line] = (message.partition(), message.offset())

        return on_delivery

    def send(partition, key, value, line):
        while True:
            try:
                producer.produce(
                    args.topic,
                    value=value,
                    key=key,
                    partition=partition,
                    on_delivery=delivery(line),
                )
                return
            except BufferError:
                producer.poll(0.1)

    sent = 0
    resent = {"now": 0, "later": 0}
    # Copies waiting for their turn: (records still to send before it, partition, key, value).
    waiting = []
    for partition, key, value, has_id in read_messages(args.input, args.events):
        send(partition, key, value, sent)
        sent += 1
        if has_id and rng.random() < args.resend:
            if rng.random() < 0.5:
                send(partition, key, value, None)
                resent["now"] += 1
            else:
                waiting.append([rng.randint(1, args.resend_gap), partition, key, value])
        for copy in waiting:
            copy[0] -= 1
        for _, partition, key, value in [c for c in waiting if c[0] <= 0]:
            send(partition, key, value, None)
            resent["later"] += 1
        waiting = [c for c in waiting if c[0] > 0]
        producer.poll(0)
    remaining = producer.flush(120)
    # What still waits goes out after every first copy is delivered: in later batches.
    for _, partition, key, value in waiting:
        send(partition, key, value, None)
        resent["later"] += 1
    remaining += producer.flush(120)
    # One more statistics report after the last delivery.
    producer.poll(0.5)
    copies_sent = resent["now"] + resent["later"]
    if remaining or failures or len(positions) != sent or copies["delivered"] != copies_sent:
        print(
            f"{sent} sent, {len(positions)} delivered, {copies_sent} copies sent, "
            f"{copies['delivered']} delivered, {remaining} undelivered; "
            f"failures: {failures[:10]}",
            file=sys.stderr,
        )
        sys.exit(1)
    if args.positions:
        with open(args.positions, "w", encoding="ascii") as out:
            for line in range(sent):
                partition, offset = positions[line]
                out.write(f"{line}\t{partition}\t{offset}\n")
    print(
        json.dumps(
            {
                "delivered": len(positions),
                "batches": batches["count"],
                "batched_messages": batches["messages"],
                "largest_batch": batches["largest"],
                "resent": copies_sent,
                "resent_later": resent["later"],
                "compression": args.compression,
                "client": f"confluent-kafka {confluent_kafka.__version__} "
                f"(librdkafka {confluent_kafka.libversion()[0]})",
            }
        )
    )


if __name__ == "__main__":
    main()
