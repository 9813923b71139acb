package dev.tally.producer;

import com.example.tally.v1.Action;
import com.example.tally.v1.LikeEvent;
import java.time.Duration;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.Future;
import org.apache.kafka.clients.producer.Callback;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.Metric;
import org.apache.kafka.common.MetricName;
import org.apache.kafka.common.serialization.LongSerializer;

/**
 * Publishes likes and unlikes to tally's topic as docs/contract.md asks of producers.
 *
 * <p>tally counts every message it finds on the topic exactly once. It cannot tell a like the
 * producer wrote twice from two likes, nor count a like the topic lost; those two are the
 * producer's to prevent, and {@link #config} is set for it:
 *
 * <ul>
 *   <li>{@code enable.idempotence=true}: a batch retried after a lost acknowledgement is written
 *       once, since the broker drops a batch whose producer id and sequence number it already
 *       holds. Without it, a timeout followed by a retry counts those likes twice.
 *   <li>{@code acks=all}: a like is acknowledged once every in-sync replica holds it, so a leader
 *       that fails after the acknowledgement does not take it along. Idempotence requires it.
 *   <li>{@code max.in.flight.requests.per.connection=5}: the most the idempotent producer allows
 *       while keeping each partition in order through retries.
 * </ul>
 *
 * <p>The key is the {@code user_id}, 8 bytes big-endian ({@link LongSerializer}), as tally's own
 * producer writes it: tally ignores keys, and keying by user spreads a viral post's likes over
 * every partition and so every consumer. A {@code post_id} key would put a viral post on one
 * partition, one consumer's worth of throughput.
 *
 * <p>Batching is what makes a like cheap: with {@code linger.ms} the client waits a few
 * milliseconds to fill a batch per partition, and a compressed batch of a few thousand small,
 * alike events costs one request and a fraction of its bytes. tally's consumer reads gzip, snappy,
 * lz4 and zstd.
 */
public final class LikeProducer implements AutoCloseable {
  /** Waiting this long to fill a batch delays a like by as much, unnoticed in a counter. */
  public static final int DEFAULT_LINGER_MS = 20;

  /** Per partition; a like is about 30 bytes, so a full batch holds several thousand. */
  public static final int BATCH_SIZE_BYTES = 256 * 1024;

  public static final String DEFAULT_COMPRESSION = "zstd";

  private final KafkaProducer<Long, LikeEvent> producer;
  private final String topic;

  /** The producer settings above, for {@code bootstrapServers}. */
  public static Properties config(String bootstrapServers, String compression, int lingerMs) {
    Properties config = new Properties();
    config.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrapServers);
    config.put(ProducerConfig.CLIENT_ID_CONFIG, "tally-like-producer");
    config.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
    config.put(ProducerConfig.ACKS_CONFIG, "all");
    config.put(ProducerConfig.MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION, "5");
    config.put(ProducerConfig.LINGER_MS_CONFIG, Integer.toString(lingerMs));
    config.put(ProducerConfig.BATCH_SIZE_CONFIG, Integer.toString(BATCH_SIZE_BYTES));
    config.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, compression);
    return config;
  }

  /**
   * A producer to {@code topic} with {@code config}; {@code framing} null writes plain protobuf,
   * else each value in Schema Registry framing.
   */
  public LikeProducer(Properties config, String topic, SchemaRegistryFraming framing) {
    this.producer =
        new KafkaProducer<>(config, new LongSerializer(), new LikeEventSerializer(framing));
    this.topic = topic;
  }

  /**
   * Queues one like or unlike, keyed by its user; {@code callback} learns where it landed or why
   * it was not written. The Kafka timestamp is left to the client's clock: it, not {@code
   * eventTimeMs}, decides which routing version tally counts the event in.
   *
   * @throws IllegalArgumentException for an event tally would dead-letter: {@code post_id} 0, or
   *     an action other than LIKE and UNLIKE
   */
  public Future<RecordMetadata> send(
      long postId, long userId, Action action, long eventTimeMs, Callback callback) {
    return send(postId, userId, action, eventTimeMs, "", callback);
  }

  /**
   * As above, with the event's id: the outbox row's id or the client's request id, so that tally
   * counts the like once however often it is published ({@code tally run --dedupe ids}). Empty
   * means none.
   */
  public Future<RecordMetadata> send(
      long postId,
      long userId,
      Action action,
      long eventTimeMs,
      String eventId,
      Callback callback) {
    if (postId == 0) {
      throw new IllegalArgumentException("post_id 0 names no post");
    }
    if (action != Action.ACTION_LIKE && action != Action.ACTION_UNLIKE) {
      throw new IllegalArgumentException("action must be ACTION_LIKE or ACTION_UNLIKE: " + action);
    }
    LikeEvent event =
        LikeEvent.newBuilder()
            .setPostId(postId)
            .setUserId(userId)
            .setAction(action)
            .setEventTimeMs(eventTimeMs)
            .setEventId(eventId)
            .build();
    return producer.send(new ProducerRecord<>(topic, userId, event), callback);
  }

  /** Sends what is queued and waits until each send has completed or failed. */
  public void flush() {
    producer.flush();
  }

  /** The client's own metrics: batches, compression, retries. */
  public Map<MetricName, ? extends Metric> metrics() {
    return producer.metrics();
  }

  @Override
  public void close() {
    producer.close(Duration.ofSeconds(30));
  }
}
