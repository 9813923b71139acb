#!/usr/bin/env python3
"""Runs Kafka transactions with the Python Kafka client (confluent-kafka), for the end-to-end
tests of tally against transactional producers.

Reads one transaction a line from --input, as JSON:

    {"end": "commit" | "abort" | "open", "messages": [[PARTITION, VALUE_HEX], ...]}

and runs them in order with one transactional producer (--transactional-id,
--transaction-timeout-ms): begin, produce every message (lz4, many messages to a record batch),
wait until every message is written to the log, then commit or abort. So an aborted
transaction's records are in the log too, followed by its abort marker. "open" never ends its
transaction: once its records are written the producer reports it and waits, until it is killed
or --hold-secs pass (it then exits 3 without ending the transaction, as a crash would). The
broker aborts it when --transaction-timeout-ms runs out.

After each transaction prints one JSON line on stdout, flushed at once:

    {"txn": I, "end": "commit", "positions": [[PARTITION, OFFSET], ...]}

with the offset of every message, in input order. --pause-ms waits between transactions.
Exits 2 when the client is not installed, 1 when a transaction fails.
"""

import argparse
import json
import os
import sys
import time

try:
    import confluent_kafka
    from confluent_kafka import KafkaException, Producer
except ImportError as error:  # the Rust test turns this into an install hint
    print(f"confluent-kafka is not importable: {error}", file=sys.stderr)
    sys.exit(2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--transactional-id", required=True)
    parser.add_argument("--transaction-timeout-ms", type=int, default=60000)
    parser.add_argument("--input", required=True, help="the transactions, one a line")
    parser.add_argument("--pause-ms", type=int, default=0)
    parser.add_argument("--hold-secs", type=float, default=120.0)
    args = parser.parse_args()

    producer = Producer(
        {
            "bootstrap.servers": args.brokers,
            "transactional.id": args.transactional_id,
            "transaction.timeout.ms": args.transaction_timeout_ms,
            "compression.type": "lz4",
            "linger.ms": 20,
            "batch.num.messages": 500,
            "batch.size": 1000000,
        }
    )
    producer.init_transactions(60)

    with open(args.input, encoding="ascii") as lines:
        transactions = [json.loads(line) for line in lines if line.strip()]
    for number, txn in enumerate(transactions):
        positions = [None] * len(txn["messages"])
        failures = []

        def delivery(i):
            def on_delivery(error, message):
                if error is not None:
                    failures.append(f"message {i}: {error}")
                else:
                    positions[i] = [message.partition(), message.offset()]

            return on_delivery

        producer.begin_transaction()
        for i, (partition, value) in enumerate(txn["messages"]):
            while True:
                try:
                    producer.produce(
                        args.topic,
                        value=bytes.fromhex(value),
                        partition=partition,
                        on_delivery=delivery(i),
                    )
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
        # Written to the log, still inside the transaction.
        remaining = producer.flush(60)
        if remaining or failures or any(p is None for p in positions):
            print(
                f"transaction {number}: {remaining} undelivered; failures: {failures[:10]}",
                file=sys.stderr,
            )
            sys.exit(1)
        end = txn["end"]
        if end == "open":
            report(number, end, positions)
            time.sleep(args.hold_secs)
            # Gone without ending the transaction, as a crash leaves it.
            os._exit(3)
        try:
            if end == "commit":
                producer.commit_transaction(60)
            elif end == "abort":
                producer.abort_transaction(60)
            else:
                raise ValueError(f"transaction {number}: unknown end {end!r}")
        except KafkaException as error:
            print(f"transaction {number}: {end} failed: {error}", file=sys.stderr)
            sys.exit(1)
        report(number, end, positions)
        if args.pause_ms:
            time.sleep(args.pause_ms / 1000)
    print(
        json.dumps(
            {
                "done": len(transactions),
                "client": f"confluent-kafka {confluent_kafka.__version__} "
                f"(librdkafka {confluent_kafka.libversion()[0]})",
            }
        ),
        flush=True,
    )


def report(number, end, positions):
    print(json.dumps({"txn": number, "end": end, "positions": positions}), flush=True)


if __name__ == "__main__":
    main()
