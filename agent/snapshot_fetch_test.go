package agent

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"testing"
	"testing/synctest"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
)

// slowSender is a holder's end of a fetch whose link pauses, within the idle timeout, before each of its
// first stalls writes after the one of HELLO and MANIFEST.
type slowSender struct {
	net.Conn
	stall  time.Duration
	stalls int
	writes int
}

func (s *slowSender) Write(p []byte) (int, error) {
	if s.writes++; s.writes > 1 && s.stalls > 0 {
		s.stalls--
		time.Sleep(s.stall)
	}
	return s.Conn.Write(p)
}

// incompressible is n bytes that S2 cannot shrink (a fixed seed: the test is the same at every run).
func incompressible(n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{1})
	r.Read(b)
	return b
}

// TestFetchIsBoundedByTheManifest: a fetch's transfer is bounded by its snapshot's size (ship's bound for
// a protector's receive: the idle timeout plus a second per MiB, twice), not by a fixed time. A fetch was
// cut off after 10 minutes whatever the snapshot: 60 GB at 100 MB/s never arrived, from any holder, and
// the job could not be restored. A holder that stalls past the manifest's bound is still refused.
func TestFetchIsBoundedByTheManifest(t *testing.T) {
	holder := testStore(t, "node1")
	p, err := holder.Begin("big-1a2b3c4d")
	if err != nil {
		t.Fatal(err)
	}
	// 320 MiB of zeros (a hole on disk, little on the wire) and 3 MiB that do not compress (a dozen writes
	// of the sender's buffer): ship allows 2 min + 2 × 324 s, 12.8 minutes.
	const size = 323 << 20
	f, err := os.Create(filepath.Join(p.Dir(), "pages-1.img"))
	if err == nil {
		err = f.Truncate(320 << 20)
		f.Close()
	}
	if err == nil {
		err = os.WriteFile(filepath.Join(p.Dir(), "pages-2.img"), incompressible(3<<20), 0o600)
	}
	if err != nil {
		t.Fatal(err)
	}
	m, err := p.Commit(context.Background(), ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0", Mode: ckpt.ModeUncoordinated})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		stalls int // of 100 s each, within ship's idle timeout of 2 minutes
		ok     bool
	}{
		{"slow but within the manifest's bound", 7, true}, // 11.7 minutes
		{"stalling past the manifest's bound", 9, false},  // 15 minutes
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &Agent{store: testStore(t, "spare1"), log: slog.New(slog.DiscardHandler)}
			synctest.Test(t, func(t *testing.T) {
				cli, srv := net.Pipe()
				served := make(chan error, 1)
				go func() {
					defer srv.Close()
					_, err := ship.Send(context.Background(), &slowSender{Conn: srv, stall: 100 * time.Second, stalls: tc.stalls}, holder, m.Job, m.ID, ship.SendOptions{Peer: "spare1"})
					served <- err
				}()
				start := time.Now()
				err := a.receiveFetch(t.Context(), cli, "node1", m.Job, m.ID, 0)
				took := time.Since(start) // the bubble's clock: the stalls, nothing else
				cli.Close()
				<-served
				if tc.ok {
					if err != nil {
						t.Fatalf("a fetch of %d MiB that took %v (the manifest allows more) failed: %v", size>>20, took, err)
					}
					if took <= 10*time.Minute {
						t.Fatalf("the transfer took %v: the test means it to take more than 10 minutes", took)
					}
					return
				}
				if !errors.Is(err, ship.ErrTransferLimit) {
					t.Fatalf("a holder that stalled %v past the manifest's bound: got %v, want ship.ErrTransferLimit", took, err)
				}
			})
			if _, err := a.store.Verify(context.Background(), m.Job, m.ID); (err == nil) != tc.ok {
				t.Errorf("the fetched copy verifies: %v, want %v", err == nil, tc.ok)
			}
		})
	}
}
