//! The Kafka Streams peer's records as its Java client writes them: a key (a post) and a value
//! (its count) are each 8 big-endian bytes (`LongSerializer`), and the default partitioner
//! puts a key on the partition Kafka's murmur2 of those bytes gives it.

/// An 8-byte big-endian value, as Kafka's `LongSerializer` writes it.
pub(super) fn long(bytes: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(bytes.try_into().ok()?))
}

/// The partition of `partitions` the Java producer's default partitioner gives a record keyed
/// by `post` as `LongSerializer` writes it: murmur2 of the 8 bytes, made positive, modulo.
pub(super) fn partition_of(post: u64, partitions: u32) -> i32 {
    ((murmur2(&post.to_be_bytes()) & 0x7fff_ffff) % partitions.max(1)) as i32
}

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`).
fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        for (i, &byte) in rest.iter().enumerate().rev() {
            h ^= u32::from(byte) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^ (h >> 15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_client() {
        // Utils.murmur2 and the default partitioner of kafka-clients 4.1.1.
        assert_eq!(murmur2(b"21") as i32, -973_932_308);
        assert_eq!(murmur2(b"foobar") as i32, -790_332_482);
        assert_eq!(murmur2(b"abc") as i32, 479_470_107);
        assert_eq!(murmur2(&(1u64 << 40).to_be_bytes()) as i32, 611_698_062);
        assert_eq!(murmur2(&4242u64.to_be_bytes()) as i32, -1_493_756_900);
        assert_eq!(partition_of(1 << 40, 8), 6);
        assert_eq!(partition_of(1, 8), 4);
        assert_eq!(partition_of(4242, 8), 4);
        assert_eq!(partition_of(1 << 41, 8), 7);
    }

    #[test]
    fn counts_are_longs() {
        assert_eq!(long(&(-3i64).to_be_bytes()), Some(-3));
        assert_eq!(long(&[0, 1]), None);
    }
}
