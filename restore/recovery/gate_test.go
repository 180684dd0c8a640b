package recovery

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestGateDeliversHeldBytes: once a gate has delivered a restored job's receive bytes, its peers' own
// segments pass again, and what each peer sent during the replay (the hold dropped it) is delivered from
// its log at once, after the gate's bytes. Before, a peer learned of those drops only by its
// retransmission timer: 22.9 s after a slow replay, a 14 s stall of the heavy-traffic ring. The gate's
// segments carry each peer's clock as the ACK clamp last saw it, when that is later than the recovery's.
func TestGateDeliversHeldBytes(t *testing.T) {
	connA := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.12:7302"), Remote: netip.MustParseAddrPort("10.0.0.11:40000")}
	connB := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.12:41000"), Remote: netip.MustParseAddrPort("10.0.0.13:7303")}
	const inqSeq = 1000 // both connections' snapshots end their receive queues here, empty
	planned := map[tcpflow.Tuple]int{connA: 300, connB: 200}
	tests := []struct {
		name string
		// sentSince is what each peer sent after the planned bytes, logged whole unless logged says less.
		sentSince map[tcpflow.Tuple]int
		logged    map[tcpflow.Tuple]int
		logErr    map[tcpflow.Tuple]error
		wantHeld  map[tcpflow.Tuple]int // bytes delivered after the gate, by connection
	}{
		{name: "both peers sent during the replay", sentSince: map[tcpflow.Tuple]int{connA: 131072, connB: 40},
			wantHeld: map[tcpflow.Tuple]int{connA: 131072, connB: 40}},
		{name: "nothing sent since the plan", wantHeld: map[tcpflow.Tuple]int{}},
		{name: "the log is behind the peer's live state: what it holds", sentSince: map[tcpflow.Tuple]int{connA: 500},
			logged: map[tcpflow.Tuple]int{connA: 120}, wantHeld: map[tcpflow.Tuple]int{connA: 120}},
		{name: "one log cannot be read: the other is delivered, the recovery goes on",
			sentSince: map[tcpflow.Tuple]int{connA: 64, connB: 32}, logErr: map[tcpflow.Tuple]error{connA: errors.New("member gone")},
			wantHeld: map[tcpflow.Tuple]int{connB: 32}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			f.owners[connA.Remote.Addr()] = "node1"
			f.owners[connB.Remote.Addr()] = "node3"
			f.logRange = func(owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
				conn := req.Tuple.Reverse()
				addTo(f, &f.net, fmt.Sprintf("log of %s from %d", conn, req.From))
				if err := tt.logErr[conn]; err != nil {
					return clusterapi.LogRangeReply{}, nil, err
				}
				if want := uint32(inqSeq + planned[conn]); req.From != want {
					t.Errorf("log of %s asked from %d, want %d (after the gate's bytes)", conn, req.From, want)
				}
				n := tt.sentSince[conn]
				if l, ok := tt.logged[conn]; ok {
					n = l
				}
				live := ebpfprobes.FlowState{SndNxt: req.From + uint32(tt.sentSince[conn]), Ack: 5000}
				return clusterapi.LogRangeReply{From: req.From, Len: int64(n), Live: &live}, make([]byte, n), nil
			}
			// The recovery read both peers' clocks at 1000; since then the clamp saw A's at 5000, and B's
			// only at an older 900 (its segments reordered).
			f.peerTSval = map[tcpflow.Tuple]uint32{connA: 5000, connB: 900}
			d := f.deps()
			live := restore.Peer{Live: ebpfprobes.FlowState{HasTS: true, TSval: 1000, Ack: 9000}}
			j := &Job{ID: "rank1", peers: map[tcpflow.Tuple]restore.Peer{connA: live, connB: live}}
			sources := map[tcpflow.Tuple]intercept.Source{}
			for _, c := range []tcpflow.Tuple{connA, connB} {
				inject := make([]byte, planned[c])
				j.Plan.Conns = append(j.Plan.Conns, restore.ConnPlan{
					Conn:   ckpt.Conn{Tuple: c, InqSeq: inqSeq, OutqSeq: 9000},
					Inject: inject, Deferred: true})
				sources[c] = intercept.Source{Seq: inqSeq, Data: inject}
			}
			// The job read 100 bytes of A, then the rest of both (the gate's injectRest).
			det := intercept.Det{Conn: connA, End: inqSeq + 100, Len: 100}
			g, err := intercept.NewGate([]intercept.Det{det}, sources)
			if err != nil {
				t.Fatal(err)
			}
			j.gate = g
			events := make(chan intercept.Event, 1)
			events <- intercept.Event{Det: det}
			startGate(context.Background(), d, j, events, func() {})
			var r gateResult
			select {
			case r = <-j.gateDone:
			case <-time.After(time.Minute):
				t.Fatal("the gate did not end")
			}
			if r.err != nil {
				t.Fatal(r.err)
			}
			var held int64
			for _, n := range tt.wantHeld {
				held += int64(n)
			}
			if r.held != held || r.injected != 500+held {
				t.Errorf("gate result: %d bytes injected, %d of them held; want %d and %d", r.injected, r.held, 500+held, held)
			}
			// Every hold ends before any log is asked: a segment the peer sends after the log was read
			// must pass.
			lastHold, firstLog := -1, len(f.net)
			for i, e := range f.net {
				if strings.HasPrefix(e, "hold ") {
					lastHold = i
				}
				if strings.HasPrefix(e, "log of ") && i < firstLog {
					firstLog = i
				}
			}
			if lastHold < 0 || lastHold > firstLog {
				t.Errorf("holds and log reads out of order: %q", f.net)
			}
			// The gate's segments carry each peer's latest clock: A's as the clamp saw it, B's as read.
			for _, want := range []string{
				fmt.Sprintf("%s at %d: true 5000", connA, inqSeq),
				fmt.Sprintf("%s at %d: true 1000", connB, inqSeq),
			} {
				if !slices.Contains(f.injectedTS, want) {
					t.Errorf("no injection %q in %q", want, f.injectedTS)
				}
			}
			for _, c := range []tcpflow.Tuple{connA, connB} {
				want := fmt.Sprintf("inject %s at %d: %d bytes", c, inqSeq+planned[c], tt.wantHeld[c])
				if got := slices.Contains(f.net, want); got != (tt.wantHeld[c] > 0) {
					t.Errorf("%q in %q: %v, want %v", want, f.net, got, !got)
				}
			}
		})
	}
}

// sinceAsks records what a recovery asks its Determinants for, and refuses (planGate then stops).
type sinceAsks struct {
	Determinants
	source, ran string
	m           *ckpt.Manifest
}

func (s *sinceAsks) Since(_ context.Context, source string, m *ckpt.Manifest, ran string) ([]intercept.Det, error) {
	s.source, s.m, s.ran = source, m, ran
	return nil, errors.New("refused")
}

// TestGateAsksForTheFailedHostsOrder: a spare that failed while restoring a job from node4's snapshot is
// where the job last ran from it: its record, not node4's, holds the order the peers depend on once it has
// read past node4's (intercept.Store.SinceOn). The recovery names it when it asks for the determinants.
func TestGateAsksForTheFailedHostsOrder(t *testing.T) {
	f := newFake(t)
	f.takenOn = map[string]string{snap1: "node4"}
	d := f.deps()
	asks := &sinceAsks{}
	d.Determinants = asks
	req := clusterapi.RecoverRequest{Failure: "node2-1", Failed: "node2", Source: "node3"}
	rj := clusterapi.RecoverJob{Job: "j1", TakenFrom: "node4", Candidates: []clusterapi.Candidate{{Snapshot: snap1, Source: "node3"}}}
	j, _, err := fetch(context.Background(), d, req, rj)
	if err != nil {
		t.Fatal(err)
	}
	planGate(context.Background(), d, j, nil)
	if asks.m != j.Manifest || asks.source != "node3" || asks.ran != "node2" {
		t.Fatalf("asked %s for %v with the job last run on %q; want node3, snapshot %s, node2", asks.source, asks.m, asks.ran, snap1)
	}
	if j.gate != nil || !strings.Contains(j.gateWhy, "refused") {
		t.Fatalf("gate %v, why %q: want none, refused", j.gate, j.gateWhy)
	}
}
