package clusterapi

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// A stream goes on as long as it moves: every read or write has the idle timeout, re-armed before each.

// idleBodyReader re-arms the server's read deadline before every read of a request body.
type idleBodyReader struct {
	r    io.Reader
	rc   *http.ResponseController
	idle time.Duration
}

func (b idleBodyReader) Read(p []byte) (int, error) {
	if err := b.rc.SetReadDeadline(time.Now().Add(b.idle)); err != nil {
		return 0, fmt.Errorf("arm the read deadline: %w", err)
	}
	return b.r.Read(p)
}

// flushWriter writes a streaming response: it re-arms the write deadline before every write and flushes
// after it, so that the peer sees each piece as it is written.
type flushWriter struct {
	w    io.Writer
	rc   *http.ResponseController
	idle time.Duration
}

func (f flushWriter) Write(p []byte) (int, error) {
	if err := f.rc.SetWriteDeadline(time.Now().Add(f.idle)); err != nil {
		return 0, fmt.Errorf("arm the write deadline: %w", err)
	}
	n, err := f.w.Write(p)
	if err != nil {
		return n, err
	}
	return n, f.rc.Flush()
}

// idleWatch ends a client call (through its context's cancel) once a read or write has waited longer
// than idle: the client's side of the idle deadline, which http.Client has no per-read knob for.
type idleWatch struct {
	idle  time.Duration
	mu    sync.Mutex
	t     *time.Timer
	fired bool
}

func newIdleWatch(idle time.Duration, cancel context.CancelFunc) *idleWatch {
	w := &idleWatch{idle: idle}
	w.t = time.AfterFunc(idle, func() {
		w.mu.Lock()
		w.fired = true
		w.mu.Unlock()
		cancel()
	})
	return w
}

// kick pushes the idle deadline one idle period ahead (unless it already passed).
func (w *idleWatch) kick() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.fired {
		w.t.Reset(w.idle)
	}
}

// setIdle changes the idle period from the next kick on.
func (w *idleWatch) setIdle(d time.Duration) {
	w.mu.Lock()
	w.idle = d
	w.mu.Unlock()
}

func (w *idleWatch) stop() { w.t.Stop() }

// pause stops the clock until the next kick (a stream silent on purpose between its messages).
func (w *idleWatch) pause() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.t.Stop()
}

// err is err, said to be a stall if the idle deadline ended the call.
func (w *idleWatch) err(err error) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fired && err != nil {
		return fmt.Errorf("the peer stalled for %s (i/o timeout): %w", w.idle, err)
	}
	return err
}

// idleReader kicks the watch around every read.
type idleReader struct {
	r io.Reader
	w *idleWatch
}

func (r idleReader) Read(p []byte) (int, error) {
	r.w.kick()
	n, err := r.r.Read(p)
	r.w.kick()
	return n, r.w.err(err)
}
