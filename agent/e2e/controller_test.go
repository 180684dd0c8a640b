package e2e

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab/labcluster"
)

// With a small log cap and a sender as fast as the link allows, the log stays under its cap (plus the ring
// while a snapshot waits for its job's bytes), the controller makes the receiving node snapshot, and
// nothing is lost: the program's result is correct and the log never has a hole. The agents park nothing:
// the cap is the log's, and parked bytes would show as holes until taken.
func TestLogControllerKeepsCap(t *testing.T) {
	t.Parallel() // each test has its own lab
	const capMiB, ringMiB = 16, 4
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", LogMemoryMiB: capMiB, LogRingMiB: ringMiB, LogNoPark: true})
	ctx := context.Background()
	st := c.Lab.State()
	peers := st.Hosts[0].Addr.Addr().String() + ":7600," + st.Hosts[1].Addr.Addr().String() + ":7600"
	var outs []*strings.Builder
	var waits []func() error
	for r, h := range st.Hosts {
		cmd, out, _ := startWrapped(t, c, h.Name, "rank", bins.Ringstencil, "--rank", string(rune('0'+r)),
			"--peers", peers, "--iters", "1500", "--block", "65536")
		sb := &strings.Builder{}
		outs = append(outs, sb)
		waits = append(waits, func() error { err := waitCmd(t, cmd, 3*time.Minute); sb.WriteString(out.String()); return err })
	}
	var mu sync.Mutex
	maxMem := map[string]int64{}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // sample both logs while the ranks run
		defer close(done)
		for {
			for _, h := range []string{"node1", "node2"} {
				s, err := c.Client(h).Status(ctx)
				if err == nil && s.Log != nil {
					mu.Lock()
					maxMem[h] = max(maxMem[h], s.Log.Counters.MemoryBytes)
					mu.Unlock()
				}
				if conns, err := c.Client(h).LoggedConns(ctx); err == nil {
					for _, lc := range conns {
						if lc.Hole {
							t.Errorf("%s's log has a hole: %+v", h, lc)
						}
					}
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	for i, w := range waits {
		if err := w(); err != nil {
			t.Fatalf("rank %d: %v", i, err)
		}
	}
	close(stop)
	<-done
	f0, f1 := strings.Fields(outs[0].String()), strings.Fields(outs[1].String())
	if len(f0) != 4 || len(f1) != 4 || f0[3] != f1[3] {
		t.Fatalf("ranks disagree (lost or corrupted bytes): %q / %q", outs[0].String(), outs[1].String())
	}
	for _, h := range []string{"node1", "node2"} {
		s, err := c.Client(h).Status(ctx)
		if err != nil || s.Log == nil {
			t.Fatalf("status of %s: %v", h, err)
		}
		requested := 0
		for _, e := range s.Log.Events {
			if e.Kind == "snapshot-requested" {
				requested++
			}
		}
		t.Logf("%s: max log memory %.1f MiB (cap %d MiB), %d snapshot requests, %d backpressure drops, logged %.0f MiB",
			h, float64(maxMem[h])/(1<<20), capMiB, requested, s.Log.Counters.DropsBackpressure, float64(s.Log.Counters.BytesLogged)/(1<<20))
		// While a snapshot waits for bytes its job sent that are still in the ring, the consumer drains past
		// the cap by at most the ring's size (capture.Capture.Urge).
		if maxMem[h] > (capMiB+ringMiB)<<20 {
			t.Errorf("%s's log reached %d bytes, over its cap of %d MiB and the ring's %d MiB", h, maxMem[h], capMiB, ringMiB)
		}
		if requested == 0 {
			t.Errorf("%s's controller asked for no snapshot although its sender logged far more than the cap", h)
		}
	}
}
