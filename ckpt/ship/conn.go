package ship

import (
	"context"
	"errors"
	"io"
	"os"
	"sync"
	"time"
)

// DefaultIdleTimeout is how long either side waits for the peer to make
// progress before giving up, when the connection supports deadlines.
const DefaultIdleTimeout = 2 * time.Minute

type deadliner interface {
	SetDeadline(time.Time) error
}

// guard maps context cancellation and an idle timeout onto connection
// deadlines. A plain io.ReadWriter without deadlines gets neither; the
// caller must then close it to unblock a transfer.
type guard struct {
	d         deadliner
	idle      time.Duration
	mu        sync.Mutex
	cancelled bool
	allowance time.Duration // extra wait while the peer does heavy work
	stop      func() bool
	// until, if set, bounds every read however steadily the peer trickles (limit): a receive ends by
	// then. Writes are not bounded by it, so that a refusal still reaches the peer.
	until    time.Time
	untilErr error // what a read past until returns
}

func newGuard(ctx context.Context, rw io.ReadWriter, idle time.Duration) *guard {
	g := &guard{idle: idle}
	if g.idle <= 0 {
		g.idle = DefaultIdleTimeout
	}
	d, ok := rw.(deadliner)
	if !ok {
		return g
	}
	g.d = d
	g.stop = context.AfterFunc(ctx, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.cancelled = true
		g.d.SetDeadline(time.Unix(1, 0))
	})
	g.arm()
	return g
}

// arm pushes the deadline one idle period ahead, unless cancelled.
func (g *guard) arm() {
	if g.d == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.cancelled {
		g.d.SetDeadline(time.Now().Add(g.idle + g.allowance))
	}
}

// limit bounds every read from now on to end by until (the zero time: no bound); a read past it fails
// with err.
func (g *guard) limit(until time.Time, err error) {
	g.mu.Lock()
	g.until, g.untilErr = until, err
	g.mu.Unlock()
}

// expired is the error of limit once its time has passed, or nil.
func (g *guard) expired() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.until.IsZero() && !time.Now().Before(g.until) {
		return g.untilErr
	}
	return nil
}

// armRead is arm for a read: the deadline is also no later than until.
func (g *guard) armRead() {
	if g.d == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.cancelled {
		d := time.Now().Add(g.idle + g.allowance)
		if !g.until.IsZero() && g.until.Before(d) {
			d = g.until
		}
		g.d.SetDeadline(d)
	}
}

// allow adds d to every deadline from now on (0 to stop), for waits that
// cover work on the peer proportional to the snapshot size.
func (g *guard) allow(d time.Duration) {
	g.mu.Lock()
	g.allowance = d
	g.mu.Unlock()
	g.arm()
}

// hashAllowance is how long a peer may need to hash and fsync size bytes,
// at a conservative 50 MB/s.
func hashAllowance(size int64) time.Duration {
	return time.Duration(size/(50<<20)+1) * time.Second
}

// release stops watching the context and clears the deadline, so the
// caller can keep using the connection.
func (g *guard) release() {
	if g.d == nil {
		return
	}
	g.stop()
	g.mu.Lock()
	defer g.mu.Unlock()
	g.d.SetDeadline(time.Time{})
}

// armedWriter re-arms the deadline before every write.
type armedWriter struct {
	w io.Writer
	g *guard
	n int64
}

func (a *armedWriter) Write(p []byte) (int, error) {
	a.g.arm()
	n, err := a.w.Write(p)
	a.n += int64(n)
	return n, err
}

// armedReader re-arms the deadline before every read, and fails every read once the guard's limit has
// passed (also on a connection without deadlines, as soon as the peer sends anything).
type armedReader struct {
	r io.Reader
	g *guard
}

func (a *armedReader) Read(p []byte) (int, error) {
	if err := a.g.expired(); err != nil {
		return 0, err
	}
	a.g.armRead()
	n, err := a.r.Read(p)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		if lerr := a.g.expired(); lerr != nil {
			return n, lerr
		}
	}
	return n, err
}
