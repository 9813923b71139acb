package tally.peer;

import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CharsetDecoder;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;

/**
 * Decodes one like-event message value the way tally does (src/pipeline/decode.rs), by hand: a
 * varint and length-delimited reader for the five fields of {@code tally.v1.LikeEvent}, so the
 * build needs no protoc.
 *
 * <p>A value is the protobuf bytes of one {@code LikeEvent}, or the same bytes in Confluent
 * Schema Registry framing: the magic byte 0, a 4-byte big-endian schema id (any id is accepted),
 * the message-index list {@code [0]} (the byte {@code 00}, or {@code 02 00}), then the protobuf.
 * A protobuf message never starts with the byte 0 (field number 0 does not exist), so the two
 * forms tell themselves apart. A message is bad, with the same reason names as tally's {@code
 * tally_bad_messages_total{reason}}, when its value is null, it does not decode, its {@code
 * post_id} is 0, its action is neither {@code ACTION_LIKE} (1) nor {@code ACTION_UNLIKE} (2), or
 * its Kafka timestamp lies past 2100-01-01.
 *
 * <p>One instance per stream task: it keeps the last decoded event in fields and is not
 * thread-safe.
 */
final class LikeEventDecoder {
  /** 2100-01-01T00:00:00Z: a Kafka timestamp past it is no real clock. */
  static final long MAX_TIMESTAMP_MS = 4_102_444_800_000L;

  private static final int VARINT = 0;
  private static final int FIXED64 = 1;
  private static final int LENGTH_DELIMITED = 2;
  private static final int START_GROUP = 3;
  private static final int END_GROUP = 4;
  private static final int FIXED32 = 5;
  private static final int MAX_GROUP_DEPTH = 100;

  /** The bytes do not decode; thrown by the reader, caught by {@link #decode}. */
  private static final class Malformed extends Exception {
    final String reason;

    Malformed(String reason) {
      super(reason, null, false, false);
      this.reason = reason;
    }
  }

  private static final Malformed UNDECODABLE = new Malformed("undecodable");
  private static final Malformed FRAMING_TRUNCATED = new Malformed("framing_truncated");
  private static final Malformed MESSAGE_INDEX_INVALID = new Malformed("message_index_invalid");

  private final CharsetDecoder utf8 =
      StandardCharsets.UTF_8
          .newDecoder()
          .onMalformedInput(CodingErrorAction.REPORT)
          .onUnmappableCharacter(CodingErrorAction.REPORT);

  private byte[] bytes;
  private int pos;
  private int end;

  /** The post of the last event {@link #decode} accepted (unsigned 64-bit, as a long's bits). */
  long postId;

  /** +1 for a like, -1 for an unlike: the last accepted event's change to its post's count. */
  long delta;

  /**
   * Decodes one message; on success sets {@link #postId} and {@link #delta} and returns null,
   * otherwise returns why the message is bad.
   */
  String decode(byte[] value, long timestampMs) {
    if (value == null) {
      return "empty";
    }
    bytes = value;
    pos = 0;
    end = value.length;
    long post = 0;
    int action = 0;
    try {
      if (end > 0 && value[0] == 0) {
        unframe();
      }
      while (pos < end) {
        long key = varint();
        if (key > 0xffff_ffffL) {
          throw UNDECODABLE;
        }
        int field = (int) (key >>> 3);
        int wireType = (int) (key & 7);
        if (field == 0) {
          throw UNDECODABLE;
        }
        switch (field) {
          case 1 -> post = scalar(wireType);
          case 2, 4 -> scalar(wireType); // user_id, event_time_ms: not needed to count
          case 3 -> action = (int) scalar(wireType); // an enum is an int32 on the wire
          case 5 -> eventId(wireType);
          default -> skip(wireType, field, 0);
        }
      }
    } catch (Malformed e) {
      return e.reason;
    }
    if (action == 1) {
      delta = 1;
    } else if (action == 2) {
      delta = -1;
    } else {
      return action == 0 ? "action_unspecified" : "action_unknown";
    }
    if (post == 0) {
      return "post_id_zero";
    }
    if (timestampMs > MAX_TIMESTAMP_MS) {
      return "timestamp_out_of_range";
    }
    postId = post;
    return null;
  }

  /** Steps over the magic byte, the schema id and the message-index list {@code [0]}. */
  private void unframe() throws Malformed {
    if (end < 5) {
      throw FRAMING_TRUNCATED;
    }
    pos = 5;
    long count = zigzag();
    if (count == 0 || (count == 1 && zigzag() == 0)) {
      return;
    }
    throw MESSAGE_INDEX_INVALID;
  }

  /** One zig-zag varint of the message-index list. */
  private long zigzag() throws Malformed {
    long value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos == end) {
        throw FRAMING_TRUNCATED;
      }
      int b = bytes[pos++] & 0xff;
      if (shift == 63 && b > 1) {
        throw MESSAGE_INDEX_INVALID;
      }
      value |= (long) (b & 0x7f) << shift;
      if (b < 0x80) {
        return (value >>> 1) ^ -(value & 1);
      }
    }
    throw MESSAGE_INDEX_INVALID;
  }

  /** A base-128 varint of at most 10 bytes, the 10th holding one bit at most. */
  private long varint() throws Malformed {
    long value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos == end) {
        throw UNDECODABLE;
      }
      int b = bytes[pos++] & 0xff;
      if (shift == 63 && b > 1) {
        throw UNDECODABLE;
      }
      value |= (long) (b & 0x7f) << shift;
      if (b < 0x80) {
        return value;
      }
    }
    throw UNDECODABLE;
  }

  /** A known varint field: any other wire type is a decode error. */
  private long scalar(int wireType) throws Malformed {
    if (wireType != VARINT) {
      throw UNDECODABLE;
    }
    return varint();
  }

  /** event_id: a length-delimited string that must be valid UTF-8; read and ignored. */
  private void eventId(int wireType) throws Malformed {
    if (wireType != LENGTH_DELIMITED) {
      throw UNDECODABLE;
    }
    int length = length();
    if (length > 0) {
      try {
        utf8.reset().decode(ByteBuffer.wrap(bytes, pos - length, length));
      } catch (CharacterCodingException e) {
        throw UNDECODABLE;
      }
    }
  }

  /** Reads a length prefix and steps over that many bytes; returns the length. */
  private int length() throws Malformed {
    long length = varint();
    if (length < 0 || length > end - pos) {
      throw UNDECODABLE;
    }
    pos += (int) length;
    return (int) length;
  }

  /** Steps over a field this reader does not know, as protobuf decoders must. */
  private void skip(int wireType, int field, int depth) throws Malformed {
    switch (wireType) {
      case VARINT -> varint();
      case FIXED64 -> advance(8);
      case LENGTH_DELIMITED -> length();
      case FIXED32 -> advance(4);
      case START_GROUP -> {
        if (depth == MAX_GROUP_DEPTH) {
          throw UNDECODABLE;
        }
        while (true) {
          long key = varint();
          if (key > 0xffff_ffffL || (key >>> 3) == 0) {
            throw UNDECODABLE;
          }
          int inner = (int) (key >>> 3);
          int innerType = (int) (key & 7);
          if (innerType == END_GROUP) {
            if (inner != field) {
              throw UNDECODABLE;
            }
            return;
          }
          skip(innerType, inner, depth + 1);
        }
      }
      default -> throw UNDECODABLE; // an end-group without its start, or wire type 6 or 7
    }
  }

  private void advance(int n) throws Malformed {
    if (end - pos < n) {
      throw UNDECODABLE;
    }
    pos += n;
  }
}
