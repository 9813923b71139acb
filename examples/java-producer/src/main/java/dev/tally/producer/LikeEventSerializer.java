package dev.tally.producer;

import com.example.tally.v1.LikeEvent;
import org.apache.kafka.common.serialization.Serializer;

/** Writes a {@code LikeEvent} as a Kafka message value: plain protobuf, or framed. */
public final class LikeEventSerializer implements Serializer<LikeEvent> {
  private final SchemaRegistryFraming framing;

  /** {@code framing} null writes the plain protobuf bytes. */
  public LikeEventSerializer(SchemaRegistryFraming framing) {
    this.framing = framing;
  }

  @Override
  public byte[] serialize(String topic, LikeEvent event) {
    // A null value is a tombstone, which tally dead-letters as `empty`: never written on purpose.
    if (event == null) {
      throw new IllegalArgumentException("a like event is never null");
    }
    byte[] protobuf = event.toByteArray();
    return framing == null ? protobuf : framing.frame(protobuf);
  }
}
