package agent

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/ring"
)

// TestFailoverNeedsMajority: a protector declares its predecessor n3 failed (a new view) only if it
// reaches a majority of the members whose majority the restore's claim needs (n1 itself, n2, s1, s2: 3 of
// 4). Cut off with the others silent (refused, or a member that never answers), it leaves n3 alive in its
// view, and n3 is suspected again after another heartbeat timeout; answered by two of them, it declares.
// A cluster of two, with no other member to ask, declares as before.
func TestFailoverNeedsMajority(t *testing.T) {
	pki := newTestPKI(t)
	tests := []struct {
		name    string
		ports   func() map[string]uint16
		members func([]ring.Member) []ring.Member
		declare bool
	}{
		{"members silent", func() map[string]uint16 {
			return map[string]uint16{"n2": stalledPeer(t, pki, "n2")} // s1 and s2 refuse
		}, nil, false},
		{"one member answers", func() map[string]uint16 {
			return map[string]uint16{"n2": scriptedPeer(t, pki, "n2", &pingScript{name: "n2"})}
		}, nil, false},
		{"a majority answers", func() map[string]uint16 {
			return map[string]uint16{"n2": scriptedPeer(t, pki, "n2", &pingScript{name: "n2"}), "s1": scriptedPeer(t, pki, "s1", &pingScript{name: "s1"})}
		}, nil, true},
		{"two nodes", func() map[string]uint16 { return nil }, func(m []ring.Member) []ring.Member { return []ring.Member{m[0], m[2]} }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, logs := clientAgent(t, pki, tt.ports())
			if tt.members != nil {
				v, err := ring.New(tt.members(a.View().Members))
				if err != nil {
					t.Fatal(err)
				}
				a.members.view = v
			}
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel() // ends the declaration's keepFailedInView
			start := time.Now()
			a.watchdog.Watch("n3", start.Add(-time.Second))
			if got := a.watchdog.Suspects(start); len(got) != 1 {
				t.Fatalf("suspects = %+v, want n3", got)
			}
			err := a.runFailover(ctx, failureID("n3", start), detect.Suspect{Name: "n3", Since: start.Add(-time.Second)}, start, nil)
			m, _ := a.View().Member("n3")
			if tt.declare {
				if err != nil || m.State != ring.StateFailed {
					t.Fatalf("runFailover = %v, n3 %s; want it declared failed; log:\n%s", err, m.State, logs.String())
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "cannot reach a majority") || m.State != ring.StateAlive {
				t.Fatalf("runFailover = %v, n3 %s; want it left alive for lack of a majority; log:\n%s", err, m.State, logs.String())
			}
			if !strings.Contains(logs.String(), "cannot reach a majority of the members") {
				t.Errorf("no warning in the log:\n%s", logs.String())
			}
			// The fail-over is tried again: n3 is suspected anew once another timeout has passed.
			now := time.Now()
			if got := a.watchdog.Suspects(now); len(got) != 0 {
				t.Errorf("suspects right after the refusal = %+v, want none", got)
			}
			if got := a.watchdog.Suspects(now.Add(a.cfg.Heartbeat.Timeout.Duration + time.Millisecond)); len(got) != 1 || got[0].Name != "n3" {
				t.Errorf("suspects a timeout after the refusal = %+v, want n3", got)
			}
			// And after every timeout however often it is refused: the partition may heal at any time (the
			// retries of a fail-over that changed nothing for another reason wait longer each time).
			for range 3 {
				a.failover(ctx, detect.Suspect{Name: "n3", Since: start.Add(-time.Second)}, time.Now())
			}
			now = time.Now()
			if got := a.watchdog.Suspects(now.Add(a.cfg.Heartbeat.Timeout.Duration + time.Millisecond)); len(got) != 1 || got[0].Name != "n3" {
				t.Errorf("suspects a timeout after the third refused fail-over = %+v, want n3", got)
			}
		})
	}
}
