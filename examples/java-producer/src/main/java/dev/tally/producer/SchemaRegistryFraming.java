package dev.tally.producer;

import java.nio.ByteBuffer;

/**
 * Confluent Schema Registry framing of a {@code LikeEvent}, written by hand: Confluent's
 * serializers are not on Maven Central, and the framing is six fixed bytes.
 *
 * <p>A framed value is the magic byte 0, the schema id as 4 bytes big-endian, the message-index
 * list, then the protobuf (docs/contract.md, "Value framing"). The list says which message of the
 * registered schema follows; {@code LikeEvent} is the first message of {@code like_event.proto},
 * the list {@code [0]}, which Confluent's serializers write as the single byte 0 (a count of
 * zero). tally accepts that list only, so no other is written here.
 */
public final class SchemaRegistryFraming {
  /** Opens every framed value; no protobuf message starts with it (field numbers start at 1). */
  public static final byte MAGIC_BYTE = 0;

  /** The message-index list {@code [0]} in its short form. */
  private static final byte FIRST_MESSAGE = 0;

  private final byte[] header;

  /**
   * Framing under {@code schemaId}, the id the registry gave {@code like_event.proto}. Ids are
   * unsigned 32-bit on the wire: an id past {@link Integer#MAX_VALUE} arrives here negative.
   */
  public SchemaRegistryFraming(int schemaId) {
    header =
        ByteBuffer.allocate(6).put(MAGIC_BYTE).putInt(schemaId).put(FIRST_MESSAGE).array();
  }

  /** The schema id this framing writes. */
  public int schemaId() {
    return ByteBuffer.wrap(header, 1, 4).getInt();
  }

  /** {@code protobuf}, the bytes of one {@code LikeEvent}, framed. */
  public byte[] frame(byte[] protobuf) {
    return ByteBuffer.allocate(header.length + protobuf.length).put(header).put(protobuf).array();
  }
}
