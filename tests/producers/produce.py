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
"""

import argparse
import json
import sys

try:
    import confluent_kafka
    from confluent_kafka import Producer
except ImportError as error:  # the Rust test turns this into an install hint
    print(f"confluent-kafka is not importable: {error}", file=sys.stderr)
    sys.exit(2)


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
    args = parser.parse_args()

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

    def delivery(line):
        def on_delivery(error, message):
            if error is not None:
                failures.append(f"line {line}, partition {message.partition()}: {error}")
            else:
                positions[line] = (message.partition(), message.offset())

        return on_delivery

    sent = 0
    with open(args.input, encoding="ascii") as lines:
        for line in lines:
            partition, key, value = line.rstrip("\n").split("\t")
            while True:
                try:
                    producer.produce(
                        args.topic,
                        value=bytes.fromhex(value),
                        key=bytes.fromhex(key) if key else None,
                        partition=int(partition),
                        on_delivery=delivery(sent),
                    )
                    break
                except BufferError:
                    producer.poll(0.1)
            sent += 1
            producer.poll(0)
    remaining = producer.flush(120)
    # One more statistics report after the last delivery.
    producer.poll(0.5)
    if remaining or failures or len(positions) != sent:
        print(
            f"{sent} sent, {len(positions)} delivered, {remaining} undelivered; "
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
                "compression": args.compression,
                "client": f"confluent-kafka {confluent_kafka.__version__} "
                f"(librdkafka {confluent_kafka.libversion()[0]})",
            }
        )
    )


if __name__ == "__main__":
    main()
