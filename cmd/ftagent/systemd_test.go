package main

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeAgent serves at once; its loops are stale while stale is set. asked counts StaleLoops calls.
type fakeAgent struct {
	serving chan struct{}
	stale   atomic.Bool
	mu      sync.Mutex
	asked   int
	cond    *sync.Cond
}

func (f *fakeAgent) Serving() <-chan struct{} { return f.serving }

func (f *fakeAgent) StaleLoops(time.Time, time.Duration) []string {
	f.mu.Lock()
	f.asked++
	f.cond.Broadcast()
	f.mu.Unlock()
	if f.stale.Load() {
		return []string{"self-fence"}
	}
	return nil
}

// waitAsked waits until StaleLoops has been called n more times.
func (f *fakeAgent) waitAsked(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for until := f.asked + n; f.asked < until; {
		f.cond.Wait()
	}
}

// TestNotifySystemd: READY=1 once the agent serves; WATCHDOG=1 while its loops turn, none while one is
// stale (systemd then restarts the agent), and again once it turns.
func TestNotifySystemd(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", sock)
	t.Setenv("WATCHDOG_USEC", "150000")
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
	f := &fakeAgent{serving: make(chan struct{})}
	f.cond = sync.NewCond(&f.mu)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); notifySystemd(ctx, f, slog.New(slog.DiscardHandler)) }()
	defer func() { cancel(); <-done }()

	read := func() string {
		t.Helper()
		buf := make([]byte, 64)
		conn.SetReadDeadline(time.Now().Add(time.Minute))
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		return string(buf[:n])
	}
	close(f.serving)
	if got := read(); got != "READY=1" {
		t.Fatalf("first notification %q, want READY=1", got)
	}
	if got := read(); got != "WATCHDOG=1" {
		t.Fatalf("with every loop turning: %q, want WATCHDOG=1", got)
	}

	f.stale.Store(true)
	f.waitAsked(2) // any notification decided before the loop went stale has been sent
	drain := func() (n int) {
		buf := make([]byte, 64)
		for {
			conn.SetReadDeadline(time.Now())
			if _, err := conn.Read(buf); err != nil {
				return n
			}
			n++
		}
	}
	drain()
	f.waitAsked(3)
	if n := drain(); n != 0 {
		t.Errorf("%d watchdog notifications while a loop was stale, want none", n)
	}

	f.stale.Store(false)
	if got := read(); got != "WATCHDOG=1" {
		t.Errorf("once the loop turns again: %q, want WATCHDOG=1", got)
	}
}
