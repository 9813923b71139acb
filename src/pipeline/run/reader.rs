//! Reader: one partition's messages, taken from the partition's own queue
//! and decoded, deduplicated, routed and added to its batch on a task of its
//! own, so that the thread polling the consumer does none of it and the
//! partitions of one process are read on every core.
//!
//! Invariants kept here:
//! * one reader at a time takes a partition's queue: the reader of a new
//!   ownership starts after the reader of the one before has stopped;
//! * the consumer is sent to a new position only by the partition's reader,
//!   between two messages: every message it takes after a seek was fetched
//!   after it (librdkafka drops what is older), so nothing read before a
//!   resync, a re-read or an assignment enters a batch after it. A new
//!   ownership starts with such a seek, to the fences' position or, when
//!   none is known, to where the assignment placed the consumer;
//! * the position the reader reports for its partition is read between two
//!   messages, so every message below it has been taken (see
//!   `Pipeline::dispatch`, which sends the offsets up to it that held no
//!   message);
//! * a message read ahead (decoded, its dedupe slots prefetched) is taken in
//!   its turn or the consumer is sent back to it: a run of messages read
//!   ahead never holds more than the batch has room for, and a reader that
//!   stops inside one (its batch filled after all), or with messages taken
//!   from the queue after an error, seeks to the first message it left, so
//!   nothing fetched is passed over;
//! * the queue's stream wakes the reader with one message; what follows it
//!   is taken many a call ([`tally_fetch::Batches`], one bookkeeping of
//!   librdkafka's poll a call instead of one a message), never more than the
//!   run has room for, in the queue's order;
//! * a reader never waits for another partition, nor makes one wait: it
//!   holds only its own partition's state, stops taking when its batch is
//!   full until the main loop has sent it, and yields its thread after each
//!   run of messages (a queue that always holds more would otherwise keep
//!   the thread, and the main loop and the other readers behind it).
//!
//! Order per partition is the queue's; the main loop still dispatches,
//! applies and commits every batch (see the parent module).

use std::collections::VecDeque;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::consumer::stream_consumer::MessageStream;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::BorrowedMessage;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tally_fetch::{Batches, Fetched};
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::debug;

use super::DRAIN_AT_MOST;
use super::intake::{self, Intake, Owned, Read, Record, Slot};
use crate::domain::slots::SlotGroups;
use crate::domain::versions::{Readiness, RouteTable, RouteWatch};
use crate::infra::{metrics, tasks};
use crate::pipeline::aggregate::Limits;
use crate::pipeline::consume::{LikeConsumer, PartitionQueue, TallyContext};
use crate::pipeline::dead_letter::DeadLetters;
use crate::pipeline::decode::Decoder;

/// What a reader tells the main loop.
#[derive(Debug)]
pub(super) enum Event {
    /// The partition's batch is full: send it.
    Full(i32),
    /// A message below the partition's position arrived with no seek asked
    /// for: its log is to be checked against the fences.
    BelowFence(i32),
    /// The partition's queue returned an error.
    Failed(KafkaError),
}

/// How the events of the current generation are routed; replaced when the
/// generation changes.
pub(super) struct View {
    pub(super) groups: SlotGroups,
    /// The windows of trending counts the generation keeps.
    pub(super) windows: crate::domain::windows::Windows,
    pub(super) watch: RouteWatch,
}

/// What every reader of a pipeline shares.
pub(super) struct Reading {
    pub(super) topic: String,
    pub(super) consumer: Arc<LikeConsumer>,
    pub(super) decoder: Decoder,
    pub(super) dead_letters: Option<Arc<DeadLetters>>,
    pub(super) limits: Limits,
    /// The routing of the current generation.
    pub(super) view: RwLock<Arc<View>>,
    pub(super) events: UnboundedSender<Event>,
}

impl Reading {
    fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Routes from now on with `view`.
    pub(super) fn set_view(&self, view: View) {
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(view);
    }
}

/// Messages a reader reads ahead of taking them: enough for the waits for
/// their dedupe windows' memory to overlap, few enough that the first one's
/// slots are still in cache when it is decided.
const RUN: usize = 32;

/// A message of a run: one the queue's stream handed out (the one that woke
/// the reader), or one taken after it through [`Batches`].
enum Held<'q> {
    Woke(BorrowedMessage<'q>),
    Taken(Fetched<'q>),
}

impl Held<'_> {
    /// The message's timestamp in milliseconds, 0 when it has none: read
    /// once, as the message joins a run.
    fn timestamp(&self) -> i64 {
        let timestamp = match self {
            Held::Woke(message) => message.timestamp(),
            Held::Taken(message) => message.timestamp(),
        };
        timestamp.to_millis().unwrap_or(0)
    }

    fn record(&self, timestamp: i64) -> Record<'_> {
        let (partition, offset, key, payload) = match self {
            Held::Woke(m) => (m.partition(), m.offset(), m.key(), m.payload()),
            Held::Taken(m) => (m.partition(), m.offset(), m.key(), m.payload()),
        };
        Record {
            partition,
            offset,
            timestamp,
            key,
            payload,
        }
    }
}

/// How long a refused seek waits before it is tried again (librdkafka
/// refuses one while the partition's fetcher is still starting).
const SEEK_RETRY: Duration = Duration::from_millis(10);

/// How long a seek, or the read of the committed offset, may take.
const PLACE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often an idle reader reads its position: the consumer passes
/// transaction markers without handing out a message.
const POSITION_EVERY: Duration = Duration::from_millis(100);

/// Starts the reader of `partition`'s new ownership `slot`, once `previous`
/// (the reader of the ownership before, if any) has stopped.
pub(super) fn spawn(
    partition: i32,
    slot: Arc<Slot>,
    queue: PartitionQueue,
    reading: Arc<Reading>,
    previous: Option<JoinHandle<()>>,
) -> JoinHandle<()> {
    {
        let mut state = slot.lock();
        state.read_apart = true;
        // The ownership starts with the reader's own seek.
        match (state.pending_seek, state.next) {
            (Some(_), _) => {}
            (None, Some(next)) => state.seek_to(next),
            (None, None) => state.placing = true,
        }
    }
    let reader = Reader {
        partition,
        slot,
        reading,
        table: None,
    };
    tasks::spawn("partition-reader", async move {
        if let Some(previous) = previous {
            let _ = previous.await;
        }
        reader.read(queue).await;
    })
}

struct Reader {
    partition: i32,
    slot: Arc<Slot>,
    reading: Arc<Reading>,
    /// The registry view the last message was routed with.
    table: Option<Arc<RouteTable>>,
}

impl Reader {
    async fn read(mut self, queue: PartitionQueue) {
        // One stream for the whole ownership: its waker is registered once,
        // not once per message.
        let mut messages = queue.stream();
        // A second handle to the same queue, for what follows a wake-up.
        let batches = Batches::new(
            self.reading.consumer.clone(),
            &self.reading.topic,
            self.partition,
        );
        let mut idle = tokio::time::interval(POSITION_EVERY);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut retry_at: Option<Instant> = None;
        loop {
            if retry_at.is_none_or(|at| at <= Instant::now()) {
                retry_at = self.place();
            }
            let room = {
                let state = self.slot.lock();
                !state.batch.is_full(&self.reading.limits)
            };
            let retry = retry_at.unwrap_or_else(Instant::now);
            tokio::select! {
                biased;
                _ = self.slot.stopped() => return,
                _ = self.slot.poke.notified() => {}
                _ = tokio::time::sleep_until(retry), if retry_at.is_some() => {}
                Some(received) = messages.next(), if room => {
                    if self.take(&mut messages, batches.as_ref(), received).await {
                        self.note_position();
                    }
                    // librdkafka's queue is always ready while it holds
                    // messages, and tokio cannot budget it: without a yield a
                    // reader catching up (a re-read) would keep its worker
                    // thread, and the main loop and the other readers queued
                    // behind it would wait for its end.
                    tokio::task::yield_now().await;
                }
                _ = idle.tick() => self.note_position(),
            }
        }
    }

    /// Sends the consumer where the partition's state asks; returns when to
    /// try again if librdkafka refused.
    fn place(&self) -> Option<Instant> {
        let (target, placing) = {
            let state = self.slot.lock();
            (state.pending_seek, state.placing)
        };
        let offset = match (target, placing) {
            (Some(offset), _) => Offset::Offset(offset),
            (None, true) => match self.committed() {
                Ok(offset) => offset,
                Err(error) => {
                    debug!(partition = self.partition, %error, "Cannot read the committed offset yet; retrying.");
                    return Some(Instant::now() + SEEK_RETRY);
                }
            },
            (None, false) => return None,
        };
        let reading = &self.reading;
        let sought = tokio::task::block_in_place(|| {
            reading
                .consumer
                .seek(&reading.topic, self.partition, offset, PLACE_TIMEOUT)
        });
        if let Err(error) = sought {
            debug!(partition = self.partition, ?offset, %error, "Seek not accepted yet; retrying.");
            return Some(Instant::now() + SEEK_RETRY);
        }
        let mut state = self.slot.lock();
        // The main loop may have asked for another position meanwhile.
        if state.pending_seek == target {
            state.pending_seek = None;
            state.placing = false;
            state.position = None;
        }
        None
    }

    /// Where the assignment placed a partition without known fences: the
    /// group's committed offset, or the log's start (`auto.offset.reset`).
    fn committed(&self) -> KafkaResult<Offset> {
        let reading = &self.reading;
        let mut list = TopicPartitionList::new();
        list.add_partition(&reading.topic, self.partition);
        let found = tokio::task::block_in_place(|| {
            reading.consumer.committed_offsets(list, PLACE_TIMEOUT)
        })?;
        Ok(
            match found
                .find_partition(&reading.topic, self.partition)
                .map(|e| e.offset())
            {
                Some(Offset::Offset(offset)) => Offset::Offset(offset),
                _ => Offset::Beginning,
            },
        )
    }

    /// Takes `first` and what the queue already holds after it, up to
    /// [`DRAIN_AT_MOST`], in runs of at most [`RUN`]: each run is read
    /// (decoded, its dedupe window's memory asked for) before its first
    /// message is taken. What follows `first` is taken through `batches`,
    /// many messages a call, or from `messages` when the queue has no such
    /// handle. Returns `false` when it stopped early (the batch filled, or
    /// the ownership ended).
    async fn take(
        &mut self,
        messages: &mut MessageStream<'_, TallyContext>,
        batches: Option<&Batches>,
        first: KafkaResult<BorrowedMessage<'_>>,
    ) -> bool {
        let view = self.reading.view();
        self.table = Some(view.watch.current());
        // Each message can add a counter and a cell per window to the batch.
        let keys_per_message = 1 + view.windows.sizes().len();
        let mut received = Some(first.map(Held::Woke));
        // Taken from the queue and not yet into a run: only what followed an
        // error in one call.
        let mut pending: VecDeque<KafkaResult<Fetched<'_>>> = VecDeque::new();
        let mut run: Vec<(Held<'_>, i64)> = Vec::with_capacity(RUN);
        let mut reads: Vec<Read> = Vec::with_capacity(RUN);
        let (mut taken, mut messages_read) = (0, 0);
        let mut whole = true;
        let mut unread = None;
        loop {
            // No more than the batch has room for: the batch can fill only
            // at a run's last message, so nothing read is left over.
            let room = {
                let state = self.slot.lock();
                state.batch.room(&self.reading.limits, keys_per_message)
            };
            let most = RUN.min(room.max(1)).min(DRAIN_AT_MOST - taken);
            let mut failed = None;
            while run.len() < most {
                let next = match (received.take(), batches) {
                    (Some(first), _) => Some(first),
                    (None, Some(batches)) => {
                        if pending.is_empty() {
                            batches.take(most - run.len(), &mut pending);
                        }
                        pending.pop_front().map(|r| r.map(Held::Taken))
                    }
                    (None, None) => messages
                        .next()
                        .now_or_never()
                        .flatten()
                        .map(|r| r.map(Held::Woke)),
                };
                let Some(result) = next else {
                    break;
                };
                taken += 1;
                match result {
                    Ok(message) => {
                        let timestamp = message.timestamp();
                        run.push((message, timestamp));
                    }
                    Err(error) => {
                        // Sent after the messages before it are taken.
                        failed = Some(error);
                        break;
                    }
                }
            }
            let ran_dry = run.len() < most && failed.is_none();
            messages_read += run.len();
            {
                let state = self.slot.lock();
                let decoder = &self.reading.decoder;
                reads.extend(
                    run.iter()
                        .map(|(message, at)| intake::read(&state, decoder, &message.record(*at))),
                );
            }
            let mut left = run.drain(..).zip(reads.drain(..));
            for ((message, at), message_read) in left.by_ref() {
                if self.slot.ended() || !self.one(&view, &message.record(at), message_read).await {
                    whole = false;
                    break;
                }
            }
            if let Some(((message, at), _)) = left.next() {
                unread = Some(message.record(at).offset);
            }
            drop(left);
            if let Some(error) = failed {
                let _ = self.reading.events.send(Event::Failed(error));
            }
            if !whole || ran_dry {
                break;
            }
            if taken == DRAIN_AT_MOST {
                whole = false;
                break;
            }
        }
        // What was taken from the queue and not into a batch is read again.
        for result in pending {
            match result {
                Ok(message) => {
                    unread = unread.or(Some(message.offset()));
                }
                Err(error) => {
                    let _ = self.reading.events.send(Event::Failed(error));
                }
            }
        }
        if let Some(offset) = unread {
            self.read_again(offset);
        }
        metrics::messages_read(messages_read);
        whole
    }

    /// A run stopped before `offset`, its first message not taken: unless
    /// the ownership ended or the consumer is already sent elsewhere, the
    /// consumer goes back to it, so no message is passed over. The run's
    /// length keeps the batch from filling before its end; this is the
    /// guard, not the way.
    fn read_again(&self, offset: i64) {
        if self.slot.ended() {
            return;
        }
        let mut state = self.slot.lock();
        if state.pending_seek.is_none() && state.next == Some(offset) {
            state.seek_to(offset);
        }
    }

    /// Takes one message, read by [`intake::read`]; `false` when the reader
    /// is to stop taking.
    async fn one(&mut self, view: &View, message: &Record<'_>, read: Read) -> bool {
        let partition = self.partition;
        let (offset, timestamp) = (message.offset, message.timestamp);
        let mut table = self.table.take().unwrap_or_else(|| view.watch.current());
        let reading = &self.reading;
        let take = |state: &mut Owned, table: &RouteTable, read: Read| {
            let intake = intake::accept(
                state,
                &view.groups,
                &view.windows,
                message,
                read,
                table,
                reading.dead_letters.as_deref(),
            );
            (intake, state.batch.is_full(&reading.limits))
        };
        // One lock per message, unless the registry has to be waited for:
        // the lock is never held across that wait.
        let taken = {
            let mut state = self.slot.lock();
            let waits = intake::decides(&state, offset)
                && table.readiness_of(partition, offset, timestamp) != Readiness::Ready;
            match waits {
                true => Err(read),
                false => Ok(take(&mut state, &table, read)),
            }
        };
        let (intake, full) = match taken {
            Ok(taken) => taken,
            Err(read) => {
                let mut watch = view.watch.clone();
                let cluster = view.groups.is_cluster();
                table = tokio::select! {
                    _ = self.slot.stopped() => return false,
                    table = watch.route_for(partition, offset, timestamp, cluster) => table,
                };
                take(&mut self.slot.lock(), &table, read)
            }
        };
        self.table = Some(table);
        match intake {
            Intake::Taken if full => {
                let _ = reading.events.send(Event::Full(partition));
                false
            }
            Intake::BelowFence => {
                let _ = reading.events.send(Event::BelowFence(partition));
                true
            }
            Intake::Taken | Intake::Dropped => true,
        }
    }

    /// Reads the consumer's position in the partition, when it matters: the
    /// batch is empty (offsets up to it that held no message are sent as
    /// passed) or a re-read is running (it ends there).
    fn note_position(&self) {
        {
            let state = self.slot.lock();
            if !state.settled() || (!state.batch.is_empty() && state.reread.is_none()) {
                return;
            }
        }
        let reading = &self.reading;
        let Ok(list) = reading.consumer.position() else {
            return;
        };
        let Some(Offset::Offset(position)) = list
            .find_partition(&reading.topic, self.partition)
            .map(|e| e.offset())
        else {
            return;
        };
        let mut state = self.slot.lock();
        if state.settled() {
            state.position = Some(position);
        }
    }
}
