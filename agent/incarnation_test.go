package agent

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/grant"
)

func testStore(t *testing.T, node string) *ckpt.Store {
	t.Helper()
	s, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func testSnapshot(t *testing.T, s *ckpt.Store, job, content string) *ckpt.Manifest {
	t.Helper()
	p, err := s.Begin(job)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(p.Dir(), "pages-1.img"), []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := p.Commit(context.Background(), ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0", Mode: ckpt.ModeUncoordinated})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestFetchRefusesOtherSnapshot: a member asked for one snapshot that sends another (another job's, or
// another snapshot of the same job) is refused before anything is stored.
func TestFetchRefusesOtherSnapshot(t *testing.T) {
	holder := testStore(t, "node1")
	asked := testSnapshot(t, holder, "counter-1a2b3c4d", "asked for")
	newer := testSnapshot(t, holder, "counter-1a2b3c4d", "a newer one")
	other := testSnapshot(t, holder, "secret-99999999", "another job's memory")
	tests := []struct {
		name      string
		sendJob   string
		sendID    string
		wantError string // "" if the fetch must succeed
	}{
		{"the snapshot asked for", asked.Job, asked.ID, ""},
		{"another job's snapshot", other.Job, other.ID, "received " + other.ID + " of job secret-99999999"},
		{"another snapshot of the same job", newer.Job, newer.ID, "received " + newer.ID + " of job counter-1a2b3c4d"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := &Agent{store: testStore(t, "spare1"), log: slog.New(slog.DiscardHandler)}
			cli, srv := net.Pipe()
			defer cli.Close()
			served := make(chan error, 1)
			go func() {
				defer srv.Close()
				// (The request travels in the HTTP exchange before the transfer: clusterapi's tests.)
				// A member that ignores what was asked for and sends something else.
				_, err := ship.Send(context.Background(), srv, holder, tt.sendJob, tt.sendID, ship.SendOptions{Peer: "spare1"})
				served <- err
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err := a.receiveFetch(ctx, cli, "node2", asked.Job, asked.ID, 0)
			cli.Close()
			<-served
			stored, _ := a.store.Jobs()
			if tt.wantError == "" {
				if err != nil {
					t.Fatalf("fetch of the snapshot asked for: %v", err)
				}
				if _, err := a.store.Verify(ctx, asked.Job, asked.ID); err != nil {
					t.Fatalf("fetched snapshot does not verify: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "not authorized") || !strings.Contains(err.Error(), tt.wantError) {
				t.Fatalf("fetch got %v; want a refusal containing %q", err, tt.wantError)
			}
			for _, job := range stored {
				if ids, _ := a.store.List(job, ""); len(ids) > 0 {
					t.Errorf("the refused snapshot was stored: job %s %v", job, ids)
				}
			}
		})
	}
}

func TestExpectSnapshot(t *testing.T) {
	const id = "20260301T120304.000Z-node1-000007"
	tests := []struct {
		name string
		m    ckpt.Manifest
		ok   bool
	}{
		{"as asked", ckpt.Manifest{Job: "j", ID: id, Node: "node1"}, true},
		{"other job", ckpt.Manifest{Job: "k", ID: id, Node: "node1"}, false},
		{"other id", ckpt.Manifest{Job: "j", ID: "20260301T120304.000Z-node1-000008", Node: "node1"}, false},
		{"node differs from the id's", ckpt.Manifest{Job: "j", ID: id, Node: "node9"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := expectSnapshot("j", id)(&tt.m); (err == nil) != tt.ok {
				t.Fatalf("expectSnapshot(%+v) = %v, want ok %v", tt.m, err, tt.ok)
			}
		})
	}
}

func TestRecoveryCandidates(t *testing.T) {
	m := func(id string) *ckpt.Manifest { return &ckpt.Manifest{ID: id} }
	const (
		s1 = "20260301T120000.000Z-node1-000001"
		s2 = "20260301T120100.000Z-node1-000002"
	)
	tests := []struct {
		name string
		held []heldReplica
		want []Candidate
	}{
		{"local only", []heldReplica{{holder: "node2", m: m(s2)}}, []Candidate{{Snapshot: s2, Source: "node2"}}},
		{"newest remote first, local replica after it",
			[]heldReplica{{holder: "node2", m: m(s1)}, {holder: "node3", m: m(s2)}}, []Candidate{{Snapshot: s2, Source: "node3"}, {Snapshot: s1, Source: "node2"}}},
		{"same snapshot on two holders: this host first",
			[]heldReplica{{holder: "node2", m: m(s2)}, {holder: "node3", m: m(s2)}, {holder: "node4", m: m(s1)}}, []Candidate{{Snapshot: s2, Source: "node2"}, {Snapshot: s2, Source: "node3"}, {Snapshot: s1, Source: "node4"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			held := append([]heldReplica(nil), tt.held...)
			sortHeld(held)
			got := recoveryCandidates(held)
			if len(got) != len(tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
			for i := range got {
				if got[i] != tt.want[i] {
					t.Fatalf("got %v, want %v", got, tt.want)
				}
			}
		})
	}
}

func TestRecoverJobCandidates(t *testing.T) {
	const s1, s2 = "20260301T120000.000Z-node1-000001", "20260301T120100.000Z-node1-000002"
	many := make([]Candidate, maxCandidates+1)
	for i := range many {
		many[i] = Candidate{Snapshot: s1, Source: "node2"}
	}
	tests := []struct {
		name    string
		rj      RecoverJob
		want    []Candidate
		wantErr bool
	}{
		{"an older agent's request: one snapshot from the request's source", RecoverJob{Job: "j", Snapshot: s1}, []Candidate{{Snapshot: s1, Source: "node2"}}, false},
		{"one snapshot from another holder", RecoverJob{Job: "j", Snapshot: s1, Source: "node3"}, []Candidate{{Snapshot: s1, Source: "node3"}}, false},
		{"the list wins", RecoverJob{Job: "j", Snapshot: s2, Source: "node3", Candidates: []Candidate{{Snapshot: s2, Source: "node3"}, {Snapshot: s1, Source: ""}}},
			[]Candidate{{Snapshot: s2, Source: "node3"}, {Snapshot: s1, Source: "node2"}}, false},
		{"a bad snapshot id", RecoverJob{Job: "j", Candidates: []Candidate{{Snapshot: "../../etc", Source: "node3"}}}, nil, true},
		{"too many", RecoverJob{Job: "j", Candidates: many}, nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.rj.CandidateList("node2")
			if (err != nil) != tt.wantErr {
				t.Fatalf("err %v, want error %v", err, tt.wantErr)
			}
			if len(got) != len(tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
			for i := range got {
				if got[i] != tt.want[i] {
					t.Fatalf("got %v, want %v", got, tt.want)
				}
			}
		})
	}
}

// TestAnswerOf: a member's reply becomes an answer; a refusal with a record that does not validate is no
// answer, so that its strings never reach an error message.
func TestAnswerOf(t *testing.T) {
	tests := []struct {
		name     string
		r        grantReplyForTest
		granted  bool
		conflict bool
	}{
		{"granted", grantReplyForTest{granted: true}, true, false},
		{"refused", grantReplyForTest{conflictHolder: "restore:ab", conflictN: 1}, false, true},
		{"refusal with a bad record", grantReplyForTest{conflictHolder: "a\x1b[2Jb", conflictN: 1}, false, false},
		{"refusal of incarnation 0", grantReplyForTest{conflictHolder: "x", conflictN: 0}, false, false},
		{"error", grantReplyForTest{err: "disk full"}, false, false},
		{"empty", grantReplyForTest{}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := tt.r.reply()
			a := answerOf("node2", r, err)
			if a.Granted != tt.granted || (a.Conflict != nil) != tt.conflict || (a.Err == nil) != (tt.granted || tt.conflict) {
				t.Fatalf("answer %+v", a)
			}
		})
	}
}

type grantReplyForTest struct {
	granted        bool
	conflictHolder string
	conflictN      uint64
	err            string
}

func (g grantReplyForTest) reply() (grantReply, error) {
	r := grantReply{Granted: g.granted}
	if g.conflictHolder != "" {
		r.Conflict = &grant.Record{Incarnation: g.conflictN, Holder: g.conflictHolder, Host: "spare1"}
	}
	if g.err != "" {
		return r, errors.New(g.err)
	}
	return r, nil
}

// TestSortHeldAcrossHosts: a recovery that takes over a job the failed node was restoring (taken) holds
// replicas of two hosts: the failed node's, of the copy it restored and snapshotted, and those of the
// job's earlier host. The failed node's come first whatever the two clocks say: its copy began from one
// of the earlier host's snapshots, so each of its snapshots is newer. Ids are compared only within one
// host; with the earlier host's clock ahead, its stale snapshot was tried first.
func TestSortHeldAcrossHosts(t *testing.T) {
	m := func(id string) *ckpt.Manifest {
		sid, err := ckpt.ParseID(id)
		if err != nil {
			t.Fatal(err)
		}
		return &ckpt.Manifest{ID: id, Node: sid.Node}
	}
	const (
		spare1 = "20260301T120500.000Z-spare1-000001" // the failed node's, after its restore
		spare2 = "20260301T120600.000Z-spare1-000002"
		ahead  = "20260301T130000.000Z-node1-000009" // the earlier host's, its clock an hour ahead
		ahead2 = "20260301T125900.000Z-node1-000008"
		behind = "20260301T110000.000Z-node1-000009" // its clock an hour behind
	)
	tests := []struct {
		name string
		held []heldReplica // the failed node's first, as runFailover appends them
		want []Candidate
	}{
		{"earlier host's clock ahead",
			[]heldReplica{{holder: "node2", m: m(spare2)}, {holder: "node3", m: m(ahead)}},
			[]Candidate{{Snapshot: spare2, Source: "node2"}, {Snapshot: ahead, Source: "node3"}}},
		{"earlier host's clock behind",
			[]heldReplica{{holder: "node2", m: m(spare2)}, {holder: "node3", m: m(behind)}},
			[]Candidate{{Snapshot: spare2, Source: "node2"}, {Snapshot: behind, Source: "node3"}}},
		{"each host's newest first, hosts in the given order",
			[]heldReplica{{holder: "node2", m: m(spare1)}, {holder: "node4", m: m(spare2)}, {holder: "node3", m: m(ahead2)}, {holder: "node5", m: m(ahead)}},
			[]Candidate{{Snapshot: spare2, Source: "node4"}, {Snapshot: spare1, Source: "node2"}, {Snapshot: ahead, Source: "node5"}, {Snapshot: ahead2, Source: "node3"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			held := append([]heldReplica(nil), tt.held...)
			sortHeld(held)
			if got := recoveryCandidates(held); !slices.Equal(got, tt.want) {
				t.Fatalf("candidates %v, want %v", got, tt.want)
			}
		})
	}
}
