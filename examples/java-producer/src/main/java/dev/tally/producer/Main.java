package dev.tally.producer;

import com.example.tally.v1.Action;
import java.io.IOException;
import java.io.PrintWriter;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ConcurrentLinkedQueue;
import org.apache.kafka.common.KafkaException;
import org.apache.kafka.common.Metric;
import org.apache.kafka.common.MetricName;
import org.apache.kafka.common.utils.AppInfoParser;

/**
 * Produces the likes and unlikes of a file with {@link LikeProducer}.
 *
 * <pre>
 * java -jar target/like-producer.jar --bootstrap HOST:PORT --topic TOPIC --events FILE
 *     [--schema-registry-framing --schema-id N] [--compression zstd] [--linger-ms 20]
 *     [--positions FILE]
 * </pre>
 *
 * <p>{@code --events} holds one event a line, {@code POST_ID USER_ID ACTION EVENT_TIME_MS
 * [EVENT_ID]}, with ACTION {@code like} or {@code unlike}, the ids unsigned 64-bit and the
 * optional event id written to {@code event_id}; blank lines and lines
 * starting with {@code #} are skipped. Every line is checked before anything is sent, so a bad
 * file produces nothing. Once every event is acknowledged it prints one JSON object on stdout
 * (what it sent, the settings it sent with and the client's batching figures) and, with {@code
 * --positions}, writes {@code INDEX<TAB>PARTITION<TAB>OFFSET} for each event, INDEX counting
 * events from 0, so a reader can find each one on the topic.
 *
 * <p>Exit status: 0 when every event was acknowledged, 1 when one was not, 2 for bad arguments or
 * a bad events file.
 */
public final class Main {
  private static final String USAGE =
      "usage: like-producer --bootstrap HOST:PORT --topic TOPIC --events FILE"
          + " [--schema-registry-framing --schema-id N] [--compression none|gzip|snappy|lz4|zstd]"
          + " [--linger-ms MS] [--positions FILE]";

  /** One line of the events file. */
  private record Event(long postId, long userId, Action action, long eventTimeMs, String eventId) {}

  /** Bad arguments or input: exit status 2 with the message and the usage. */
  private static final class UsageError extends Exception {
    UsageError(String message) {
      super(message);
    }
  }

  private Main() {}

  public static void main(String[] args) {
    try {
      System.exit(run(args));
    } catch (UsageError e) {
      System.err.println("like-producer: " + e.getMessage());
      System.err.println(USAGE);
      System.exit(2);
    } catch (IOException | KafkaException e) {
      System.err.println("like-producer: " + e);
      System.exit(1);
    }
  }

  private static int run(String[] args) throws UsageError, IOException {
    Map<String, String> options = parse(args);
    String bootstrap = required(options, "--bootstrap");
    String topic = required(options, "--topic");
    Path eventsFile = Path.of(required(options, "--events"));
    String compression = options.getOrDefault("--compression", LikeProducer.DEFAULT_COMPRESSION);
    int lingerMs = number(options, "--linger-ms", LikeProducer.DEFAULT_LINGER_MS);
    SchemaRegistryFraming framing = null;
    if (options.containsKey("--schema-registry-framing")) {
      String id = required(options, "--schema-id");
      try {
        framing = new SchemaRegistryFraming(Integer.parseUnsignedInt(id));
      } catch (NumberFormatException e) {
        throw new UsageError("--schema-id must be an unsigned 32-bit number: " + id);
      }
    } else if (options.containsKey("--schema-id")) {
      throw new UsageError("--schema-id goes with --schema-registry-framing");
    }
    List<Event> events = readEvents(eventsFile);

    Properties config = LikeProducer.config(bootstrap, compression, lingerMs);
    int[] partitions = new int[events.size()];
    long[] offsets = new long[events.size()];
    ConcurrentLinkedQueue<String> failures = new ConcurrentLinkedQueue<>();
    Map<String, Object> report = new LinkedHashMap<>();
    try (LikeProducer producer = new LikeProducer(config, topic, framing)) {
      for (int i = 0; i < events.size(); i++) {
        Event event = events.get(i);
        int index = i;
        producer.send(
            event.postId(),
            event.userId(),
            event.action(),
            event.eventTimeMs(),
            event.eventId(),
            (metadata, error) -> {
              if (error != null) {
                failures.add("event " + index + ": " + error);
                partitions[index] = -1;
              } else {
                partitions[index] = metadata.partition();
                offsets[index] = metadata.offset();
              }
            });
      }
      // Every callback has run once flush returns.
      producer.flush();
      report.put("sent", events.size());
      report.put("delivered", events.size() - failures.size());
      report.put("framing", framing == null ? "plain" : "schema-registry");
      report.put("schema_id", framing == null ? null : Integer.toUnsignedLong(framing.schemaId()));
      report.put("client", "kafka-clients " + AppInfoParser.getVersion());
      Map<String, Object> settings = new LinkedHashMap<>();
      config.stringPropertyNames().stream().sorted().forEach(k -> settings.put(k, config.get(k)));
      report.put("config", settings);
      for (String name :
          List.of(
              "record-send-total",
              "record-retry-total",
              "record-error-total",
              "records-per-request-avg",
              "batch-size-avg",
              "compression-rate-avg")) {
        report.put(name.replace('-', '_'), metric(producer.metrics(), name));
      }
    }
    if (!failures.isEmpty()) {
      System.err.println(
          "like-producer: "
              + failures.size()
              + " of "
              + events.size()
              + " events were not written; the first: "
              + failures.stream().limit(10).toList());
      return 1;
    }
    if (options.containsKey("--positions")) {
      try (PrintWriter out =
          new PrintWriter(
              Files.newBufferedWriter(
                  Path.of(options.get("--positions")), StandardCharsets.US_ASCII))) {
        for (int i = 0; i < events.size(); i++) {
          out.print(i + "\t" + partitions[i] + "\t" + offsets[i] + "\n");
        }
      }
    }
    System.out.println(json(report));
    return 0;
  }

  /** {@code --flag value} pairs, and {@code --schema-registry-framing}, which takes none. */
  private static Map<String, String> parse(String[] args) throws UsageError {
    Map<String, String> options = new LinkedHashMap<>();
    for (int i = 0; i < args.length; i++) {
      String flag = args[i];
      switch (flag) {
        case "--schema-registry-framing" -> options.put(flag, "");
        case "--bootstrap",
            "--topic",
            "--events",
            "--schema-id",
            "--compression",
            "--linger-ms",
            "--positions" -> {
          if (i + 1 == args.length) {
            throw new UsageError(flag + " needs a value");
          }
          options.put(flag, args[++i]);
        }
        default -> throw new UsageError("unknown argument " + flag);
      }
    }
    return options;
  }

  private static String required(Map<String, String> options, String flag) throws UsageError {
    String value = options.get(flag);
    if (value == null) {
      throw new UsageError(flag + " is required");
    }
    return value;
  }

  private static int number(Map<String, String> options, String flag, int fallback)
      throws UsageError {
    String value = options.get(flag);
    try {
      return value == null ? fallback : Integer.parseInt(value);
    } catch (NumberFormatException e) {
      throw new UsageError(flag + " must be a number: " + value);
    }
  }

  private static List<Event> readEvents(Path file) throws UsageError {
    List<Event> events = new ArrayList<>();
    List<String> lines;
    try {
      lines = Files.readAllLines(file, StandardCharsets.US_ASCII);
    } catch (IOException e) {
      throw new UsageError("cannot read --events " + file + ": " + e);
    }
    int lineNumber = 0;
    for (String line : lines) {
      lineNumber++;
      String trimmed = line.strip();
      if (trimmed.isEmpty() || trimmed.startsWith("#")) {
        continue;
      }
      String[] fields = trimmed.split("\\s+");
      String where = file + ":" + lineNumber + ": ";
      if (fields.length != 4 && fields.length != 5) {
        throw new UsageError(
            where + "want POST_ID USER_ID like|unlike EVENT_TIME_MS [EVENT_ID]: " + line);
      }
      Action action =
          switch (fields[2]) {
            case "like" -> Action.ACTION_LIKE;
            case "unlike" -> Action.ACTION_UNLIKE;
            default -> throw new UsageError(where + "action must be like or unlike: " + fields[2]);
          };
      try {
        long postId = Long.parseUnsignedLong(fields[0]);
        if (postId == 0) {
          throw new UsageError(where + "post_id 0 names no post");
        }
        events.add(
            new Event(
                postId,
                Long.parseUnsignedLong(fields[1]),
                action,
                Long.parseLong(fields[3]),
                fields.length == 5 ? fields[4] : ""));
      } catch (NumberFormatException e) {
        throw new UsageError(where + e.getMessage());
      }
    }
    return events;
  }

  /** A producer-level metric's value, or null when the client does not have it. */
  private static Object metric(Map<MetricName, ? extends Metric> metrics, String name) {
    return metrics.entrySet().stream()
        .filter(e -> e.getKey().group().equals("producer-metrics"))
        .filter(e -> e.getKey().name().equals(name))
        .map(e -> e.getValue().metricValue())
        .findFirst()
        .orElse(null);
  }

  /** The report as one line of JSON; it holds strings, numbers, null and one nested map. */
  private static String json(Object value) {
    if (value == null) {
      return "null";
    }
    if (value instanceof Map<?, ?> map) {
      StringBuilder out = new StringBuilder("{");
      for (Map.Entry<?, ?> e : map.entrySet()) {
        if (out.length() > 1) {
          out.append(',');
        }
        out.append(json(e.getKey().toString())).append(':').append(json(e.getValue()));
      }
      return out.append('}').toString();
    }
    if (value instanceof Double d) {
      return d.isNaN() || d.isInfinite() ? "null" : d.toString();
    }
    if (value instanceof Number) {
      return value.toString();
    }
    StringBuilder out = new StringBuilder("\"");
    for (char c : value.toString().toCharArray()) {
      if (c == '"' || c == '\\') {
        out.append('\\').append(c);
      } else if (c < 0x20) {
        out.append(String.format("\\u%04x", (int) c));
      } else {
        out.append(c);
      }
    }
    return out.append('"').toString();
  }
}
