package tally.peer;

import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.common.utils.Bytes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.errors.StreamsUncaughtExceptionHandler.StreamThreadExceptionResponse;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Grouped;
import org.apache.kafka.streams.kstream.Materialized;
import org.apache.kafka.streams.kstream.Named;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.processor.api.Processor;
import org.apache.kafka.streams.processor.api.ProcessorContext;
import org.apache.kafka.streams.processor.api.Record;
import org.apache.kafka.streams.state.KeyValueStore;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;
import sun.misc.Signal;

/**
 * Counts likes the way a team on the JVM would without tally: a Kafka Streams application with
 * exactly-once processing (EOS v2) that sums each post's likes minus unlikes into a KTable kept
 * in a RocksDB state store, and writes every updated count to an output topic.
 *
 * <pre>
 * java -cp 'lib/*' tally.peer.LikeCounts --bootstrap HOST:PORT --input TOPIC --output TOPIC
 *     --application-id ID --state-dir DIR [--threads N] [--commit-interval-ms MS]
 *     [--session-timeout-ms MS]
 * </pre>
 *
 * <p>The topology: the input topic (values are {@code tally.v1.LikeEvent}, plain or in Schema
 * Registry framing, decoded by {@link LikeEventDecoder}; keys are ignored) is re-keyed by {@code
 * post_id} with the value +1 or -1, repartitioned through {@code ID-deltas-repartition}, and
 * reduced by sum into the store {@code like-counts} (changelog {@code
 * ID-like-counts-changelog}); each update goes to the output topic with the post id and the
 * count, both as {@code LongSerializer} writes them (8 bytes, big-endian; the post id is
 * unsigned, so read it back as such). Bad messages are skipped and counted, with a warning for
 * the first and every 10,000th.
 *
 * <p>Prints {@code RUNNING ...} on stdout once the application first reaches the RUNNING state.
 * SIGTERM or SIGINT closes it (the open transaction is committed) and exits with status 0; an
 * unrecoverable error exits with 1, bad arguments with 2.
 */
public final class LikeCounts {
  private static final String USAGE =
      "usage: LikeCounts --bootstrap HOST:PORT --input TOPIC --output TOPIC --application-id ID"
          + " --state-dir DIR [--threads N] [--commit-interval-ms MS] [--session-timeout-ms MS]";

  /** How often a bad message is logged: the first one, then every this many. */
  private static final long LOG_EVERY = 10_000;

  private static final Logger LOG = LoggerFactory.getLogger(LikeCounts.class);

  /** Bad messages skipped since this process started (after a crash, some are seen again). */
  private static final AtomicLong BAD = new AtomicLong();

  /** Bad arguments: exit status 2 with the message and the usage. */
  private static final class UsageError extends Exception {
    UsageError(String message) {
      super(message);
    }
  }

  private LikeCounts() {}

  public static void main(String[] args) throws InterruptedException {
    long started = System.nanoTime();
    Map<String, String> options;
    Properties config;
    try {
      options = parse(args);
      config = config(options);
    } catch (UsageError e) {
      System.err.println("LikeCounts: " + e.getMessage());
      System.err.println(USAGE);
      System.exit(2);
      return;
    }
    Topology topology = topology(options.get("--input"), options.get("--output"));

    KafkaStreams streams = new KafkaStreams(topology, config);
    CountDownLatch stop = new CountDownLatch(1);
    AtomicBoolean failed = new AtomicBoolean();
    AtomicBoolean announced = new AtomicBoolean();
    streams.setStateListener(
        (now, before) -> {
          if (now == KafkaStreams.State.RUNNING && announced.compareAndSet(false, true)) {
            System.out.printf(
                "RUNNING application.id=%s input=%s output=%s threads=%s startup_ms=%d%n",
                options.get("--application-id"),
                options.get("--input"),
                options.get("--output"),
                config.getProperty(StreamsConfig.NUM_STREAM_THREADS_CONFIG),
                (System.nanoTime() - started) / 1_000_000);
            System.out.flush();
          } else if (now == KafkaStreams.State.ERROR || now == KafkaStreams.State.PENDING_ERROR) {
            failed.set(true);
            stop.countDown();
          }
        });
    // An exception no stream thread can recover from stops the whole client (and this process)
    // rather than running on with fewer threads.
    streams.setUncaughtExceptionHandler(
        e -> {
          LOG.error("stream thread failed; shutting down", e);
          return StreamThreadExceptionResponse.SHUTDOWN_CLIENT;
        });
    Signal.handle(new Signal("TERM"), signal -> stop.countDown());
    Signal.handle(new Signal("INT"), signal -> stop.countDown());

    streams.start();
    stop.await();
    boolean closed = streams.close(Duration.ofSeconds(60));
    System.err.printf(
        "LikeCounts: stopped (%s); %d bad messages skipped%n",
        failed.get() ? "failed" : closed ? "closed" : "close timed out", BAD.get());
    System.exit(failed.get() || !closed ? 1 : 0);
  }

  /** The Streams configuration from the command line; everything else is Kafka's default. */
  static Properties config(Map<String, String> options) throws UsageError {
    for (String flag :
        new String[] {"--bootstrap", "--input", "--output", "--application-id", "--state-dir"}) {
      if (!options.containsKey(flag)) {
        throw new UsageError(flag + " is required");
      }
    }
    Properties config = new Properties();
    config.put(StreamsConfig.APPLICATION_ID_CONFIG, options.get("--application-id"));
    config.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, options.get("--bootstrap"));
    config.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
    config.put(StreamsConfig.STATE_DIR_CONFIG, options.get("--state-dir"));
    config.put(
        StreamsConfig.NUM_STREAM_THREADS_CONFIG,
        Integer.toString(positive(options, "--threads", 1)));
    if (options.containsKey("--commit-interval-ms")) {
      // Unset, exactly_once_v2 commits every 100 ms.
      config.put(
          StreamsConfig.COMMIT_INTERVAL_MS_CONFIG,
          Integer.toString(positive(options, "--commit-interval-ms", 100)));
    }
    if (options.containsKey("--session-timeout-ms")) {
      // Unset, the consumer's default (45 s): how long the group waits for a member that stopped
      // heartbeating, such as a killed process, before its tasks move to another.
      config.put(
          StreamsConfig.consumerPrefix(ConsumerConfig.SESSION_TIMEOUT_MS_CONFIG),
          Integer.toString(positive(options, "--session-timeout-ms", 45_000)));
    }
    return config;
  }

  /** input → decode → re-key by post → repartition → sum per post (RocksDB) → output. */
  static Topology topology(String input, String output) {
    StreamsBuilder builder = new StreamsBuilder();
    builder.stream(input, Consumed.with(Serdes.ByteArray(), Serdes.ByteArray()).withName("likes"))
        .process(Decode::new, Named.as("decode"))
        .groupByKey(Grouped.with("deltas", Serdes.Long(), Serdes.Long()))
        .reduce(
            Long::sum,
            Named.as("sum"),
            Materialized.<Long, Long, KeyValueStore<Bytes, byte[]>>as("like-counts")
                .withKeySerde(Serdes.Long())
                .withValueSerde(Serdes.Long()))
        .toStream(Named.as("updates"))
        .to(output, Produced.with(Serdes.Long(), Serdes.Long()).withName("counts"));
    return builder.build();
  }

  /** Turns one message into (post_id, +1 or -1), or skips it as bad. */
  private static final class Decode implements Processor<byte[], byte[], Long, Long> {
    private final LikeEventDecoder decoder = new LikeEventDecoder();
    private ProcessorContext<Long, Long> context;

    @Override
    public void init(ProcessorContext<Long, Long> context) {
      this.context = context;
    }

    @Override
    public void process(Record<byte[], byte[]> record) {
      String bad = decoder.decode(record.value(), record.timestamp());
      if (bad == null) {
        context.forward(record.withKey(decoder.postId).withValue(decoder.delta));
        return;
      }
      long n = BAD.incrementAndGet();
      if (n == 1 || n % LOG_EVERY == 0) {
        String where =
            context
                .recordMetadata()
                .map(m -> m.topic() + "/" + m.partition() + "@" + m.offset())
                .orElse("?");
        LOG.warn("skipped a bad message ({}) at {}; {} skipped so far", bad, where, n);
      }
    }
  }

  private static int positive(Map<String, String> options, String flag, int fallback)
      throws UsageError {
    String value = options.get(flag);
    if (value == null) {
      return fallback;
    }
    try {
      int n = Integer.parseInt(value);
      if (n > 0) {
        return n;
      }
    } catch (NumberFormatException e) {
      // reported below
    }
    throw new UsageError(flag + " must be a positive number: " + value);
  }

  private static Map<String, String> parse(String[] args) throws UsageError {
    Map<String, String> options = new LinkedHashMap<>();
    for (int i = 0; i < args.length; i++) {
      String flag = args[i];
      switch (flag) {
        case "--bootstrap",
            "--input",
            "--output",
            "--application-id",
            "--state-dir",
            "--threads",
            "--commit-interval-ms",
            "--session-timeout-ms" -> {
          if (i + 1 == args.length) {
            throw new UsageError(flag + " needs a value");
          }
          options.put(flag, args[++i]);
        }
        case "-h", "--help" -> {
          System.out.println(USAGE);
          System.exit(0);
        }
        default -> throw new UsageError("unknown argument " + flag);
      }
    }
    return options;
  }
}
