//go:build linux

package recvdigest

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/ftkit/ftkit/netlog"
)

// Source yields raw receive-tap records (netlog's ring-buffer layout), as ebpfprobes.RecvTap does: fn gets
// each record waiting, raw valid only until fn returns; ReadBatch blocks until there is at least one, and
// returns ctx.Err() once ctx is done and the records already there are read.
type Source interface {
	ReadBatch(ctx context.Context, max int, fn func(raw []byte) error) (int, error)
}

// RecorderStats are a Recorder's counters.
type RecorderStats struct {
	Records    uint64 // records read from the source
	BadRecords uint64 // records netlog.DecodeRecord refused (skipped)
}

// Recorder feeds a Book from a Source with one goroutine until Close.
type Recorder struct {
	book   *Book
	log    *slog.Logger
	cancel context.CancelFunc
	done   chan struct{}

	records, bad atomic.Uint64

	mu  sync.Mutex
	err error // why the goroutine stopped on its own
}

// NewRecorder starts reading src into book. log may be nil.
func NewRecorder(src Source, book *Book, log *slog.Logger) *Recorder {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Recorder{book: book, log: log, cancel: cancel, done: make(chan struct{})}
	go r.run(ctx, src)
	return r
}

func (r *Recorder) run(ctx context.Context, src Source) {
	defer close(r.done)
	handle := func(raw []byte) error {
		r.records.Add(1)
		rec, err := netlog.DecodeRecord(raw)
		if err == nil && rec.Parked != 0 {
			// The receive tap never parks a segment: a parked record (no payload) is not one of its records,
			// and taken as the record that starts a flow it would wipe the flow's record.
			err = fmt.Errorf("%w: a parked record (%d bytes) of %s, which the receive tap never writes", netlog.ErrBadRecord, rec.Parked, rec.Conn)
		}
		if err != nil {
			// One bad record must not stop the digests of every flow; a few are logged.
			if n := r.bad.Add(1); n&(n-1) == 0 {
				r.log.Error("receive digests: bad record from the receive tap (tap and netlog disagree on the layout?)", "err", err, "count", n)
			}
			return nil
		}
		r.book.Add(rec) // copies what it keeps: raw is the ring's memory
		return nil
	}
	for ctx.Err() == nil {
		if _, err := src.ReadBatch(ctx, 0, handle); err != nil {
			if ctx.Err() != nil {
				return // closing: whatever the source says now is about our cancellation
			}
			err = fmt.Errorf("receive digests: reading the receive tap stopped, nothing more is recorded, so later recoveries report re-sent bytes as unverified: %w", err)
			r.mu.Lock()
			r.err = err
			r.mu.Unlock()
			r.log.Error("receive digests stopped", "err", err)
			return
		}
	}
}

// Err returns why the Recorder stopped reading on its own, or nil while it runs (or after Close).
func (r *Recorder) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// Done is closed when the goroutine has returned: after Close, or when reading failed (see Err).
func (r *Recorder) Done() <-chan struct{} { return r.done }

// Stats returns the Recorder's counters.
func (r *Recorder) Stats() RecorderStats {
	return RecorderStats{Records: r.records.Load(), BadRecords: r.bad.Load()}
}

// Close stops reading and waits for the goroutine. The Book stays usable.
func (r *Recorder) Close() {
	r.cancel()
	<-r.done
}
