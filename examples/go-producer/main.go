// Command like-producer produces the likes and unlikes of a file with LikeProducer.
//
//	like-producer --bootstrap HOST:PORT --topic TOPIC --events FILE
//	    [--schema-registry-framing --schema-id N] [--compression zstd] [--linger-ms 20]
//	    [--positions FILE]
//
// --events holds one event a line, POST_ID USER_ID ACTION EVENT_TIME_MS [EVENT_ID], with ACTION
// like or unlike and the ids unsigned 64-bit; blank lines and lines starting with # are skipped.
// Every line is checked before anything is sent, so a bad file produces nothing. Once every
// event is acknowledged it prints one JSON object on stdout (what it sent, the settings it sent
// with and the batches the brokers acknowledged) and, with --positions, writes
// INDEX<TAB>PARTITION<TAB>OFFSET for each event, INDEX counting events from 0.
//
// Exit status: 0 when every event was acknowledged, 1 when one was not, 2 for bad arguments or
// a bad events file.
package main

//go:generate buf generate

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	tallyv1 "likeproducer/gen/tally/v1"
)

type event struct {
	postID, userID uint64
	action         tallyv1.Action
	eventTimeMs    int64
	eventID        string
}

type usageError struct{ error }

func main() {
	code, err := run(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "like-producer:", err)
		var usage usageError
		if errors.As(err, &usage) {
			fmt.Fprintln(os.Stderr, "usage: like-producer --bootstrap HOST:PORT --topic TOPIC --events FILE"+
				" [--schema-registry-framing --schema-id N] [--compression none|gzip|snappy|lz4|zstd]"+
				" [--linger-ms MS] [--positions FILE]")
			os.Exit(2)
		}
	}
	os.Exit(code)
}

func run(args []string) (int, error) {
	flags := flag.NewFlagSet("like-producer", flag.ContinueOnError)
	bootstrap := flags.String("bootstrap", "", "brokers, HOST:PORT[,HOST:PORT...]")
	topic := flags.String("topic", "", "the topic tally reads")
	eventsFile := flags.String("events", "", "the events file")
	framed := flags.Bool("schema-registry-framing", false, "frame each value as Confluent's serializers do")
	schemaID := flags.String("schema-id", "", "the id the registry gave like_event.proto")
	compression := flags.String("compression", DefaultCompression, "none, gzip, snappy, lz4 or zstd")
	lingerMs := flags.Int("linger-ms", int(DefaultLinger/time.Millisecond), "how long to fill a batch")
	positions := flags.String("positions", "", "write INDEX PARTITION OFFSET per event here")
	if err := flags.Parse(args); err != nil {
		return 2, usageError{err}
	}
	for name, value := range map[string]string{"--bootstrap": *bootstrap, "--topic": *topic, "--events": *eventsFile} {
		if value == "" {
			return 2, usageError{fmt.Errorf("%s is required", name)}
		}
	}
	var framing []byte
	var reportedID any
	switch {
	case *framed:
		id, err := strconv.ParseUint(*schemaID, 10, 32)
		if err != nil {
			return 2, usageError{fmt.Errorf("--schema-id must be an unsigned 32-bit number: %q", *schemaID)}
		}
		framing, reportedID = SchemaRegistryHeader(uint32(id)), id
	case *schemaID != "":
		return 2, usageError{errors.New("--schema-id goes with --schema-registry-framing")}
	}
	events, err := readEvents(*eventsFile)
	if err != nil {
		return 2, usageError{err}
	}

	linger := time.Duration(*lingerMs) * time.Millisecond
	producer, err := NewLikeProducer(strings.Split(*bootstrap, ","), *topic, framing, *compression, linger)
	if err != nil {
		return 2, usageError{err}
	}
	defer producer.Close()
	ctx := context.Background()
	partitions := make([]int32, len(events))
	offsets := make([]int64, len(events))
	var mu sync.Mutex
	var failures []string
	for i, e := range events {
		done := func(r *kgo.Record, err error) {
			if err != nil {
				mu.Lock()
				failures = append(failures, fmt.Sprintf("event %d: %v", i, err))
				mu.Unlock()
				return
			}
			partitions[i], offsets[i] = r.Partition, r.Offset
		}
		if err := producer.Send(ctx, e.postID, e.userID, e.action, e.eventTimeMs, e.eventID, done); err != nil {
			return 2, usageError{fmt.Errorf("event %d: %w", i, err)}
		}
	}
	// Every callback has run once Flush returns.
	if err := producer.Flush(ctx); err != nil {
		return 1, err
	}
	if len(failures) > 0 {
		return 1, fmt.Errorf("%d of %d events were not written; the first: %v",
			len(failures), len(events), failures[:min(10, len(failures))])
	}
	if *positions != "" {
		var out strings.Builder
		for i := range events {
			fmt.Fprintf(&out, "%d\t%d\t%d\n", i, partitions[i], offsets[i])
		}
		if err := os.WriteFile(*positions, []byte(out.String()), 0o644); err != nil {
			return 1, err
		}
	}

	framingName := "plain"
	if framing != nil {
		framingName = "schema-registry"
	}
	b := producer.batches
	b.mu.Lock()
	defer b.mu.Unlock()
	report := map[string]any{
		"sent":      len(events),
		"delivered": len(events) - len(failures),
		"framing":   framingName,
		"schema_id": reportedID,
		"client":    "franz-go " + moduleVersion("github.com/twmb/franz-go"),
		// franz-go's settings in Kafka's names.
		"config": map[string]string{
			"enable.idempotence":                    "true",
			"acks":                                  "all",
			"max.in.flight.requests.per.connection": "5",
			"linger.ms":                             strconv.Itoa(*lingerMs),
			"batch.size":                            strconv.Itoa(batchMaxBytes),
			"compression.type":                      *compression,
		},
		"batches":               b.batches,
		"records_per_batch_avg": float64(b.records) / float64(max(b.batches, 1)),
		"compression_rate_avg":  float64(b.compressedBytes) / float64(max(b.uncompressedBytes, 1)),
	}
	line, _ := json.Marshal(report)
	fmt.Println(string(line))
	return 0, nil
}

func readEvents(path string) ([]event, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("cannot read --events %s: %w", path, err)
	}
	defer file.Close()
	var events []event
	scanner := bufio.NewScanner(file)
	for n := 1; scanner.Scan(); n++ {
		line := strings.TrimSpace(scanner.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		where := fmt.Sprintf("%s:%d: ", path, n)
		fields := strings.Fields(line)
		if len(fields) != 4 && len(fields) != 5 {
			return nil, errors.New(where + "want POST_ID USER_ID like|unlike EVENT_TIME_MS [EVENT_ID]: " + line)
		}
		var e event
		switch fields[2] {
		case "like":
			e.action = tallyv1.Action_ACTION_LIKE
		case "unlike":
			e.action = tallyv1.Action_ACTION_UNLIKE
		default:
			return nil, errors.New(where + "action must be like or unlike: " + fields[2])
		}
		if e.postID, err = strconv.ParseUint(fields[0], 10, 64); err != nil {
			return nil, errors.New(where + err.Error())
		}
		if e.postID == 0 {
			return nil, errors.New(where + "post_id 0 names no post")
		}
		if e.userID, err = strconv.ParseUint(fields[1], 10, 64); err != nil {
			return nil, errors.New(where + err.Error())
		}
		if e.eventTimeMs, err = strconv.ParseInt(fields[3], 10, 64); err != nil {
			return nil, errors.New(where + err.Error())
		}
		if len(fields) == 5 {
			e.eventID = fields[4]
		}
		events = append(events, e)
	}
	return events, scanner.Err()
}

// moduleVersion is the version of a dependency this binary was built with.
func moduleVersion(path string) string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == path {
				return dep.Version
			}
		}
	}
	return "unknown"
}
