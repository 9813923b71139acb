//! Batches: the messages one partition's queue already holds, taken many a
//! call.
//!
//! rdkafka hands out a split partition queue's messages one per poll, and
//! each poll of librdkafka reads the clock twice and records a poll interval
//! under a lock, then rdkafka reads it once more and allocates a shared
//! handle to the message's event. `rd_kafka_consume_batch_queue` does that
//! bookkeeping once per call. [`Batches`] is a second handle to a queue that
//! [`rdkafka::consumer::BaseConsumer::split_partition_queue`] split off; the
//! split queue keeps its waker (wait for the first message there), and
//! [`Batches::take`] takes what follows it.
//!
//! Invariant: a [`Fetched`] message is destroyed exactly once, before the
//! client it came from: it borrows the [`Batches`] it was taken through,
//! which holds the consumer.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

use rdkafka::Timestamp;
use rdkafka::bindings as rd;
use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::error::KafkaError;

/// The most messages one [`Batches::take`] hands out.
pub const AT_MOST: usize = 64;

/// A second handle to one partition's queue of fetched messages.
pub struct Batches {
    queue: NonNull<rd::rd_kafka_queue_t>,
    /// The consumer whose queue this is, kept alive as long as the handle
    /// and every message taken through it.
    _client: Arc<dyn Send + Sync>,
}

// SAFETY: librdkafka's queues are locked internally and may be served from
// any thread; the handle is freed once, by `Drop`.
unsafe impl Send for Batches {}
// SAFETY: as for `Send`: every call through `&Batches` locks the queue.
unsafe impl Sync for Batches {}

impl Batches {
    /// A handle to the queue of `topic`'s `partition` in `consumer`, or
    /// `None` when librdkafka has none (a producer, or a topic name with a
    /// NUL byte). Take from it only after the queue was split off the
    /// consumer's: a queue still forwarded would serve the consumer's.
    pub fn new<K, C>(consumer: Arc<K>, topic: &str, partition: i32) -> Option<Batches>
    where
        K: Consumer<C> + Send + Sync + 'static,
        C: ConsumerContext,
    {
        let topic = CString::new(topic).ok()?;
        let client = consumer.client().native_ptr();
        // SAFETY: `client` is a live handle (held by `consumer`) and `topic`
        // a NUL-terminated string that outlives the call; the queue returned
        // holds a reference of its own, given back by `Drop`.
        let queue = unsafe { rd::rd_kafka_queue_get_partition(client, topic.as_ptr(), partition) };
        Some(Batches {
            queue: NonNull::new(queue)?,
            _client: consumer,
        })
    }

    /// Appends to `into`, in queue order, up to `most` (at most
    /// [`AT_MOST`]) of the messages and errors the queue holds now, without
    /// waiting. Returns how many it appended (0 when the queue was empty).
    pub fn take<'q>(
        &'q self,
        most: usize,
        into: &mut impl Extend<Result<Fetched<'q>, KafkaError>>,
    ) -> usize {
        let mut taken = [std::ptr::null_mut::<rd::rd_kafka_message_t>(); AT_MOST];
        let most = most.min(AT_MOST);
        if most == 0 {
            return 0;
        }
        // SAFETY: `queue` is live while `self` is; `taken` has room for
        // `most` pointers, and librdkafka writes at most that many.
        let count = unsafe {
            rd::rd_kafka_consume_batch_queue(self.queue.as_ptr(), 0, taken.as_mut_ptr(), most)
        };
        let count = usize::try_from(count).unwrap_or(0).min(most);
        into.extend(taken[..count].iter().filter_map(|&message| {
            let fetched = Fetched {
                message: NonNull::new(message)?,
                _queue: std::marker::PhantomData,
            };
            Some(match fetched.error() {
                Some(error) => Err(error),
                None => Ok(fetched),
            })
        }));
        count
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        // SAFETY: the handle came from `rd_kafka_queue_get_partition` and is
        // given back once; no `Fetched` outlives `self`.
        unsafe { rd::rd_kafka_queue_destroy(self.queue.as_ptr()) }
    }
}

/// One message taken through [`Batches::take`]; destroyed when dropped.
pub struct Fetched<'q> {
    message: NonNull<rd::rd_kafka_message_t>,
    _queue: std::marker::PhantomData<&'q Batches>,
}

// SAFETY: a fetched message is read-only here and librdkafka lets any
// thread destroy it.
unsafe impl Send for Fetched<'_> {}
// SAFETY: every method takes `&self` and only reads the message.
unsafe impl Sync for Fetched<'_> {}

impl Fetched<'_> {
    fn raw(&self) -> &rd::rd_kafka_message_t {
        // SAFETY: the message is live until `Drop`, and nothing writes to it.
        unsafe { self.message.as_ref() }
    }

    /// The error the queue handed out in place of a message, as rdkafka
    /// reports it from a poll.
    fn error(&self) -> Option<KafkaError> {
        let raw = self.raw();
        match raw.err {
            rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR => None,
            rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF => {
                Some(KafkaError::PartitionEOF(raw.partition))
            }
            code => Some(KafkaError::MessageConsumption(code.into())),
        }
    }

    /// The partition the message was read from.
    pub fn partition(&self) -> i32 {
        self.raw().partition
    }

    /// The message's offset in its partition.
    pub fn offset(&self) -> i64 {
        self.raw().offset
    }

    /// The message's value, if it has one.
    pub fn payload(&self) -> Option<&[u8]> {
        let raw = self.raw();
        // SAFETY: librdkafka keeps the value for as long as the message.
        unsafe { bytes(raw.payload, raw.len) }
    }

    /// The message's key, if it has one.
    pub fn key(&self) -> Option<&[u8]> {
        let raw = self.raw();
        // SAFETY: librdkafka keeps the key for as long as the message.
        unsafe { bytes(raw.key, raw.key_len) }
    }

    /// The message's timestamp, as rdkafka reports it.
    pub fn timestamp(&self) -> Timestamp {
        let mut kind = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: the message is live; `kind` is a valid place to write to.
        let at = unsafe { rd::rd_kafka_message_timestamp(self.message.as_ptr(), &mut kind) };
        match kind {
            _ if at == -1 => Timestamp::NotAvailable,
            rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_CREATE_TIME => {
                Timestamp::CreateTime(at)
            }
            rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_LOG_APPEND_TIME => {
                Timestamp::LogAppendTime(at)
            }
            _ => Timestamp::NotAvailable,
        }
    }
}

/// The `len` bytes at `at`, or `None` for a null pointer.
///
/// # Safety
/// A non-null `at` points at `len` readable bytes that nothing changes for
/// as long as `'m`.
unsafe fn bytes<'m>(at: *mut std::ffi::c_void, len: usize) -> Option<&'m [u8]> {
    let at = NonNull::new(at.cast::<u8>())?;
    // SAFETY: as the caller promises.
    Some(unsafe { std::slice::from_raw_parts(at.as_ptr(), len) })
}

impl Drop for Fetched<'_> {
    fn drop(&mut self) {
        // SAFETY: the message came from `rd_kafka_consume_batch_queue` and is
        // destroyed once, while its client is held by the `Batches` it borrows.
        unsafe { rd::rd_kafka_message_destroy(self.message.as_ptr()) }
    }
}
