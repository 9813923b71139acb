package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/protobuf/proto"

	tallyv1 "likeproducer/gen/tally/v1"
)

// LikeProducer publishes likes and unlikes to tally's topic as docs/contract.md asks of
// producers.
//
// tally counts every message it finds on the topic exactly once. It cannot tell a like the
// producer wrote twice from two likes, nor count a like the topic lost; those two are the
// producer's to prevent:
//
//   - Idempotent writes (franz-go's default; never DisableIdempotentWrite): a batch retried after
//     a lost acknowledgement is written once, since the broker drops a batch whose producer id
//     and sequence number it already holds.
//   - acks=all (kgo.AllISRAcks, also the default): a like is acknowledged once every in-sync
//     replica holds it, so a leader that fails after the acknowledgement does not take it along.
//     Idempotence requires it.
//   - At most 5 produce requests in flight per broker, which keeps each partition in order
//     through retries: franz-go's idempotent default, which it does not let a client change
//     (MaxProduceRequestsInflightPerBroker is refused with idempotency on).
//
// The key is the user_id, 8 bytes big-endian: tally ignores keys, and keying by user spreads a
// viral post's likes over every partition and so every consumer, while keeping one user's events
// (and every copy of one like, which dedupe needs) on one partition. A post_id key would put a
// viral post on one partition.
type LikeProducer struct {
	client  *kgo.Client
	framing []byte // nil: plain protobuf; else the 6-byte Schema Registry header
	batches *batchStats
}

// Settings the producer uses, in Kafka's names, as the report prints them.
const (
	DefaultLinger      = 20 * time.Millisecond
	DefaultCompression = "zstd"
	batchMaxBytes      = 262144
)

// SchemaRegistryHeader is Confluent Schema Registry framing under schemaID, written by hand:
// the magic byte 0, the id as 4 bytes big-endian, and the message-index list [0] (LikeEvent is
// the first message of like_event.proto) in its short form, the single byte 0. tally accepts no
// other list.
func SchemaRegistryHeader(schemaID uint32) []byte {
	header := []byte{0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(header[1:5], schemaID)
	return header
}

// NewLikeProducer connects to brokers for topic. framing nil writes plain protobuf, else each
// value behind that header (SchemaRegistryHeader).
func NewLikeProducer(brokers []string, topic string, framing []byte, compression string, linger time.Duration) (*LikeProducer, error) {
	codec, err := codecNamed(compression)
	if err != nil {
		return nil, err
	}
	batches := &batchStats{}
	client, err := kgo.NewClient(
		kgo.SeedBrokers(brokers...),
		kgo.ClientID("tally-like-producer"),
		kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(linger),
		kgo.ProducerBatchMaxBytes(batchMaxBytes),
		kgo.ProducerBatchCompression(codec),
		kgo.WithHooks(batches),
	)
	if err != nil {
		return nil, err
	}
	return &LikeProducer{client: client, framing: framing, batches: batches}, nil
}

// Send queues one like or unlike, keyed by its user; done learns where it landed or why it was
// not written. eventID names the like for tally's dedupe: every send of one like carries the
// same id (an outbox row's id, a request id kept across retries). The Kafka timestamp is left to
// the client's clock: it, not eventTimeMs, decides which routing version tally counts the event
// in.
//
// It refuses what tally would dead-letter: post_id 0 and an action other than LIKE and UNLIKE.
func (p *LikeProducer) Send(ctx context.Context, postID, userID uint64, action tallyv1.Action, eventTimeMs int64, eventID string, done func(*kgo.Record, error)) error {
	if postID == 0 {
		return errors.New("post_id 0 names no post")
	}
	if action != tallyv1.Action_ACTION_LIKE && action != tallyv1.Action_ACTION_UNLIKE {
		return fmt.Errorf("action must be ACTION_LIKE or ACTION_UNLIKE: %v", action)
	}
	event := &tallyv1.LikeEvent{
		PostId:      postID,
		UserId:      userID,
		Action:      action,
		EventTimeMs: eventTimeMs,
		EventId:     eventID,
	}
	value, err := proto.MarshalOptions{}.MarshalAppend(append([]byte(nil), p.framing...), event)
	if err != nil {
		return err
	}
	key := binary.BigEndian.AppendUint64(nil, userID)
	p.client.Produce(ctx, &kgo.Record{Key: key, Value: value}, done)
	return nil
}

// Flush sends what is queued and waits until each send has completed or failed.
func (p *LikeProducer) Flush(ctx context.Context) error {
	return p.client.Flush(ctx)
}

// Close flushes and disconnects.
func (p *LikeProducer) Close() {
	_ = p.client.Flush(context.Background())
	p.client.Close()
}

func codecNamed(name string) (kgo.CompressionCodec, error) {
	switch name {
	case "none":
		return kgo.NoCompression(), nil
	case "gzip":
		return kgo.GzipCompression(), nil
	case "snappy":
		return kgo.SnappyCompression(), nil
	case "lz4":
		return kgo.Lz4Compression(), nil
	case "zstd":
		return kgo.ZstdCompression(), nil
	}
	return kgo.CompressionCodec{}, fmt.Errorf("unknown compression %q: none, gzip, snappy, lz4 or zstd", name)
}

// batchStats counts the batches the brokers acknowledged, for the report.
type batchStats struct {
	mu                sync.Mutex
	batches, records  int
	uncompressedBytes int
	compressedBytes   int
}

func (s *batchStats) OnProduceBatchWritten(_ kgo.BrokerMetadata, _ string, _ int32, m kgo.ProduceBatchMetrics) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches++
	s.records += m.NumRecords
	s.uncompressedBytes += m.UncompressedBytes
	s.compressedBytes += m.CompressedBytes
}
