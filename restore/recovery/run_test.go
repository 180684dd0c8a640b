package recovery

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

const (
	snap1 = "20250101T000000.000Z-node2-000001"
	snap2 = "20250101T000000.000Z-node2-000002"
)

var failedAddr = netip.MustParseAddr("10.0.0.2")

func request(cands ...string) clusterapi.RecoverRequest {
	rj := clusterapi.RecoverJob{Job: "rank1"}
	for _, c := range cands {
		rj.Candidates = append(rj.Candidates, clusterapi.Candidate{Snapshot: c, Source: "node3"})
	}
	return clusterapi.RecoverRequest{Failure: "node2-1", Failed: "node2", Addrs: []netip.Addr{failedAddr}, Source: "node3",
		Jobs: []clusterapi.RecoverJob{rj}}
}

// TestRun runs whole recoveries of a job with fakes of the agent's actions: which stages are reported in
// which order, and what each outcome does to the job, its incarnation, the network and the record.
func TestRun(t *testing.T) {
	stranger := ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("192.0.2.9:4000")}}
	tests := []struct {
		name    string
		cands   []string
		from    string // the request's TakenFrom
		setup   func(f *fake)
		wantErr string // "" for success
		stages  []string
		check   func(t *testing.T, f *fake, stages []Stage)
	}{
		{
			name:   "all steps, re-protected",
			cands:  []string{snap1},
			stages: []string{StageFetched, StageRewritten, StageRestored, StageReplayed, StageProtected},
			check: func(t *testing.T, f *fake, stages []Stage) {
				if !reflect.DeepEqual(f.claimed, []uint64{4}) || !reflect.DeepEqual(f.reprotected, []string{"rank1"}) {
					t.Errorf("claimed %v, re-protected %v; want incarnation 4 claimed and rank1 re-protected", f.claimed, f.reprotected)
				}
				wantNet := []string{"guard run-rank1 holding [10.0.0.2]", "take over 10.0.0.2", "initcwnd 10", "lower mtu", "put back mtu", "announce 10.0.0.2", "put back initcwnd"}
				if !reflect.DeepEqual(f.net, wantNet) {
					t.Errorf("network %v, want %v", f.net, wantNet)
				}
				wantPhases := []string{"rank1 " + PhaseRestored, "rank1 " + PhaseReplayed}
				if !reflect.DeepEqual(f.persisted, []string{"rank1"}) || !reflect.DeepEqual(f.phases, wantPhases) {
					t.Errorf("persisted %v, phases %v; want rank1 persisted, phases %v", f.persisted, f.phases, wantPhases)
				}
				if d := stages[0].Detail; !strings.Contains(d, "from node3 (snapshot "+snap1+", incarnation 4)") {
					t.Errorf("fetched detail %q; want the source, snapshot and claimed incarnation", d)
				}
			},
		},
		{
			name:   "first candidate fails to fetch: the next one is used",
			cands:  []string{snap1, snap2},
			setup:  func(f *fake) { f.fetchErr[snap1] = errors.New("connection refused") },
			stages: []string{StageFetched, StageRewritten, StageRestored, StageReplayed, StageProtected},
			check: func(t *testing.T, f *fake, stages []Stage) {
				if !reflect.DeepEqual(f.fetched, []string{snap1, snap2}) {
					t.Errorf("fetched %v, want both candidates in order", f.fetched)
				}
				d := stages[0].Detail
				if !strings.Contains(d, "snapshot "+snap2) || !strings.Contains(d, "failed before: "+snap1+" from node3: connection refused") {
					t.Errorf("fetched detail %q; want the second snapshot and why the first failed", d)
				}
			},
		},
		{
			name:   "a candidate taken on another host: refused, the next one is used",
			cands:  []string{snap1, snap2},
			setup:  func(f *fake) { f.takenOn = map[string]string{snap1: "node4"} },
			stages: []string{StageFetched, StageRewritten, StageRestored, StageReplayed, StageProtected},
			check: func(t *testing.T, f *fake, stages []Stage) {
				if d := stages[0].Detail; !strings.Contains(d, "snapshot "+snap2) || !strings.Contains(d, snap1+" was taken on node4, not on node2") {
					t.Errorf("fetched detail %q; want the second snapshot and why the first was refused", d)
				}
				if !reflect.DeepEqual(f.claimed, []uint64{4}) {
					t.Errorf("claimed %v, want one claim, for the second", f.claimed)
				}
			},
		},
		{
			// The failed node (a spare) was restoring the job for node4's recovery when it failed.
			name:   "a candidate taken on the node the failed one was restoring it for",
			cands:  []string{snap1},
			from:   "node4",
			setup:  func(f *fake) { f.takenOn = map[string]string{snap1: "node4"} },
			stages: []string{StageFetched, StageRewritten, StageRestored, StageReplayed, StageProtected},
		},
		{
			name:    "a candidate taken on a third host, with TakenFrom set",
			cands:   []string{snap1},
			from:    "node4",
			setup:   func(f *fake) { f.takenOn = map[string]string{snap1: "node5"} },
			wantErr: snap1 + " was taken on node5, not on node2",
			stages:  []string{StageFetched},
		},
		{
			name:    "no candidate can be fetched",
			cands:   []string{snap1, snap2},
			setup:   func(f *fake) { f.fetchErr[snap1], f.fetchErr[snap2] = errors.New("gone"), errors.New("corrupt") },
			wantErr: "none of 2 candidate snapshot(s) could be fetched and verified",
			stages:  []string{StageFetched},
			check: func(t *testing.T, f *fake, _ []Stage) {
				if len(f.net) != 0 || len(f.claimed) != 0 {
					t.Errorf("network %v, claims %v; want nothing touched", f.net, f.claimed)
				}
			},
		},
		{
			name:    "claim refused: no other candidate is tried",
			cands:   []string{snap1, snap2},
			setup:   func(f *fake) { f.claimErr = errors.New("incarnation 4 held by restore:x") },
			wantErr: "snapshot " + snap1 + " verified, but the job may not run here",
			stages:  []string{StageFetched},
			check: func(t *testing.T, f *fake, _ []Stage) {
				if !reflect.DeepEqual(f.fetched, []string{snap1}) || len(f.net) != 0 {
					t.Errorf("fetched %v, network %v; want only the first candidate, no network", f.fetched, f.net)
				}
			},
		},
		{
			name:    "a peer nobody logged: not recoverable, incarnation given back",
			cands:   []string{snap1},
			setup:   func(f *fake) { f.conns = []ckpt.Conn{stranger} },
			wantErr: "the peer is not a cluster member",
			stages:  []string{StageFetched, StageRewritten},
			check: func(t *testing.T, f *fake, stages []Stage) {
				if !reflect.DeepEqual(f.givenBack, []string{"rank1"}) || len(f.net) != 0 {
					t.Errorf("given back %v, network %v; want rank1 given back, no network", f.givenBack, f.net)
				}
				if stages[1].Err == nil {
					t.Error("the rewritten stage carries no error")
				}
			},
		},
		{
			name:    "address take-over fails: guard removed, incarnation given back",
			cands:   []string{snap1},
			setup:   func(f *fake) { f.takeOverErr = errors.New("EPERM") },
			wantErr: "take over address 10.0.0.2: EPERM",
			stages:  []string{StageFetched, StageRewritten},
			check: func(t *testing.T, f *fake, _ []Stage) {
				if !reflect.DeepEqual(f.net, []string{"guard run-rank1 holding [10.0.0.2]", "unguard run-rank1"}) || !reflect.DeepEqual(f.givenBack, []string{"rank1"}) {
					t.Errorf("network %v, given back %v; want the guard undone and rank1 given back", f.net, f.givenBack)
				}
			},
		},
		{
			name:   "path MTU cannot be lowered: restored all the same (524-byte segments), re-protected",
			cands:  []string{snap1},
			setup:  func(f *fake) { f.lowerMTUErr = errors.New("netlink: operation not permitted") },
			stages: []string{StageFetched, StageRewritten, StageRestored, StageReplayed, StageProtected},
			check: func(t *testing.T, f *fake, _ []Stage) {
				wantNet := []string{"guard run-rank1 holding [10.0.0.2]", "take over 10.0.0.2", "initcwnd 10", "announce 10.0.0.2", "put back initcwnd"}
				if !reflect.DeepEqual(f.net, wantNet) || !reflect.DeepEqual(f.reprotected, []string{"rank1"}) {
					t.Errorf("network %v, re-protected %v; want %v and rank1 re-protected", f.net, f.reprotected, wantNet)
				}
			},
		},
		{
			name:    "CRIU restore fails: unguarded, dropped from the record, not re-protected",
			cands:   []string{snap1},
			setup:   func(f *fake) { f.restoreErr = errors.New("criu restore: exit 1") },
			wantErr: "job rank1: criu restore: exit 1",
			stages:  []string{StageFetched, StageRewritten, StageRestored},
			check: func(t *testing.T, f *fake, _ []Stage) {
				if !reflect.DeepEqual(f.unlessSt, []string{"rank1"}) || !reflect.DeepEqual(f.phases, []string{"rank1 "}) ||
					len(f.reprotected) != 0 || f.kept != 0 {
					t.Errorf("given back unless started %v, phases %q, re-protected %v, keeps open %d; want rank1 given back, dropped, not re-protected, nothing kept",
						f.unlessSt, f.phases, f.reprotected, f.kept)
				}
				if want := []string{"unguard run-rank1", "put back mtu", "announce 10.0.0.2", "put back initcwnd"}; !reflect.DeepEqual(f.net[len(f.net)-4:], want) {
					t.Errorf("network %v; want the guard removed and the MTU put back before the announce, the initial window after it", f.net)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			if tt.setup != nil {
				tt.setup(f)
			}
			var stages []Stage
			req := request(tt.cands...)
			req.Jobs[0].TakenFrom = tt.from
			err := Run(t.Context(), req, f.deps(), func(s Stage) { stages = append(stages, s) })
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("Run = %v; want error containing %q", err, tt.wantErr)
			}
			var names []string
			for _, s := range stages {
				names = append(names, s.Name)
				if s.Job != "" && s.Job != "rank1" || s.End.Before(s.Start) {
					t.Errorf("stage %+v: want job rank1 (or none) and an end after its start", s)
				}
			}
			if !reflect.DeepEqual(names, tt.stages) {
				t.Errorf("stages %q, want %q", names, tt.stages)
			}
			if tt.check != nil {
				tt.check(t, f, stages)
			}
		})
	}
}

// TestRunRemovesWorkOfRefusedClaim: the working copy of a snapshot whose claim was refused is removed.
func TestRunRemovesWorkOfRefusedClaim(t *testing.T) {
	f := newFake(t)
	f.claimErr = errors.New("refused")
	var work string
	d := f.deps()
	d.Snapshots = snapshotsFunc(func(j *Job) { work = j.Work }, f)
	if err := Run(t.Context(), request(snap1), d, func(Stage) {}); err == nil {
		t.Fatal("Run succeeded with a refused claim")
	}
	if _, err := os.Stat(work); !os.IsNotExist(err) {
		t.Errorf("work directory %s: %v; want it removed", work, err)
	}
}

// TestRunRemovesWorkOfUnplannableJob: a job whose connections cannot be planned (here, a peer that is no
// cluster member) leaves no working copy behind, as large as its snapshot, and gives its claim back.
func TestRunRemovesWorkOfUnplannableJob(t *testing.T) {
	f := newFake(t)
	f.conns = []ckpt.Conn{{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("192.0.2.9:4000")}}}
	var work string
	d := f.deps()
	d.Snapshots = snapshotsFunc(func(j *Job) { work = j.Work }, f)
	if err := Run(t.Context(), request(snap1), d, func(Stage) {}); err == nil || !strings.Contains(err.Error(), "not a cluster member") {
		t.Fatalf("Run: %v; want the job refused, its peer not a cluster member", err)
	}
	if _, err := os.Stat(work); !os.IsNotExist(err) {
		t.Errorf("work directory %s: %v; want it removed", work, err)
	}
	if !reflect.DeepEqual(f.givenBack, []string{"rank1"}) {
		t.Errorf("given back %v, want rank1's claim", f.givenBack)
	}
}

// replayCase is one restored job with one connection that re-sends stream[:resend].
type replayCase struct {
	name      string
	check     *Check // nil: the record of stream
	logged    []byte // what the log captured of the re-sent bytes; nil: stream
	sentUpTo  uint32 // how far the restored socket got; 0: resend
	replayed  bool   // a previous agent saw this flow's replay complete
	ended     bool   // the job ended by itself
	lastLook  bool   // the job re-sends the rest and ends right after the first look at how far it sent
	rollsBack bool   // the job is set aside for its run's rollback (auto mode)
	gated     bool   // its receive order was replayed (a gate ran)
	wantErr   error  // errors.Is target, or nil
	wantMsg   string
}

// TestReplayAndVerify checks the one place that kills a restored job: after a replay that does not
// complete, or at a re-sent byte that differs from the peer's record or that nothing can check.
func TestReplayAndVerify(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	const resend = 3000
	stream := make([]byte, resend)
	for i := range stream {
		stream[i] = byte(i * 7)
	}
	record := &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{
		{Seq: 0, Len: resend, CRC: crc32.Checksum(stream, crc32.MakeTable(crc32.Castagnoli))}}}
	other := append([]byte(nil), stream...)
	other[1234] ^= 1
	tests := []replayCase{
		{name: "every byte verified", wantMsg: "re-sent bytes verified: all 3000 on 1 connection(s)"},
		{name: "a flow a previous agent saw replayed is not waited for, but checked", replayed: true, sentUpTo: 1,
			wantMsg: "re-sent bytes verified: all 3000"},
		{name: "the peer's record is missing", check: &Check{Missing: "node1 could not give its record of what it received: EOF"},
			wantErr: recvdigest.ErrUnverified, wantMsg: "node1 could not give its record"},
		{name: "no record was fetched", check: &Check{}, wantErr: recvdigest.ErrUnverified, wantMsg: "was not fetched"},
		{name: "a re-sent byte differs", logged: other, wantErr: recvdigest.ErrNondeterministic,
			wantMsg: "then connection " + conn.String() + " failed the check"},
		// The time is the gate's end (1.5 s after the restore in the fake), not when the wait for it began.
		{name: "receive order replayed, every byte verified", gated: true,
			wantMsg: "receive order replayed: 2 receive calls, 10 bytes delivered, 4 of them sent during the replay (done 1.5s after the restore); 3000 bytes re-sent"},
		{name: "a re-sent byte differs after the receive order was replayed", logged: other, gated: true,
			wantErr: recvdigest.ErrNondeterministic, wantMsg: "its receive calls were replayed in the recorded order"},
		{name: "the log lacks re-sent bytes", logged: stream[:100], wantErr: recvdigest.ErrUnverified},
		{name: "replay times out", sentUpTo: resend - 1, wantMsg: "failover.replay_timeout"},
		{name: "the job ends before its replay", sentUpTo: 1, ended: true, wantMsg: "job rank1 ended (ended) before it re-sent"},
		// Its end is seen before its last bytes are: it re-sent all its peer had, and is checked, not killed.
		{name: "the job re-sends the rest and ends between two looks", sentUpTo: 1, lastLook: true,
			wantMsg: "re-sent bytes verified: all 3000 on 1 connection(s)"},
		// Auto mode: the run rolls back; its peers are restored by the rollback, never reset.
		{name: "replay times out, the run rolls back", sentUpTo: resend - 1, rollsBack: true, wantMsg: "failover.replay_timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			d := f.deps()
			d.ReplayTimeout = 100 * time.Millisecond // the failure's bound; the passing cases do not wait
			f.ended, f.rollsBack = tt.ended, tt.rollsBack
			f.logged[conn] = stream
			if tt.logged != nil {
				f.logged[conn] = tt.logged
			}
			f.sent[conn] = resend
			if tt.sentUpTo != 0 {
				f.sent[conn] = tt.sentUpTo
			}
			if tt.lastLook {
				f.stateHook = func() {
					f.mu.Lock()
					defer f.mu.Unlock()
					f.sent[conn], f.ended = resend, true
				}
			}
			chk := Check{Received: record}
			if tt.check != nil {
				chk = *tt.check
			}
			cp := restore.ConnPlan{Resend: resend}
			cp.Conn.Tuple, cp.Conn.OutqSeq = conn, 0
			j := &Job{ID: "rank1", Plan: restore.Plan{Conns: []restore.ConnPlan{cp}}, Checks: map[tcpflow.Tuple]Check{conn: chk}}
			if tt.replayed {
				j.Replayed = []tcpflow.Tuple{conn}
			}
			if tt.gated {
				j.gateDone = make(chan gateResult, 1)
				j.RestoredAt = time.Now()
				j.gateDone <- gateResult{dets: 2, injected: 10, held: 4, done: j.RestoredAt.Add(1500 * time.Millisecond)}
			}
			j.stopKeeping = f.Keep(j.Plan)
			detail, err := ReplayAndVerify(t.Context(), d, j)
			failed := tt.wantErr != nil || strings.Contains(tt.wantMsg, "replay_timeout") || tt.ended
			switch {
			case !failed && err != nil:
				t.Fatalf("ReplayAndVerify = %q, %v; want success", detail, err)
			case failed && err == nil:
				t.Fatalf("ReplayAndVerify = %q, nil; want a failure", detail)
			case tt.wantErr != nil && !errors.Is(err, tt.wantErr):
				t.Errorf("error %v; want %v", err, tt.wantErr)
			}
			if tt.wantMsg != "" && !strings.Contains(detail+" "+errString(err), tt.wantMsg) {
				t.Errorf("detail %q, error %v; want %q in them", detail, err, tt.wantMsg)
			}
			if killed := len(f.killed) > 0; killed != failed {
				t.Errorf("killed %v; want killed %v", f.killed, failed)
			}
			if f.kept != 0 {
				t.Error("the re-sent bytes are still kept after the check")
			}
			if !failed && !tt.replayed && !reflect.DeepEqual(f.released, []tcpflow.Tuple{conn}) {
				t.Errorf("clamp released %v; want the flow once its replay is done", f.released)
			}
			if failed && !slices.Contains(f.released, conn) {
				t.Errorf("clamp released %v; an abandoned job's flows must not stay clamped", f.released)
			}
			// The peer had all resend bytes; a job that stopped short leaves it waiting unless reset there.
			wantNet := []string(nil)
			if failed && f.sent[conn] < resend && !tt.rollsBack {
				wantNet = []string{fmt.Sprintf("reset %s at %d", conn, resend)}
			}
			if !reflect.DeepEqual(f.net, wantNet) {
				t.Errorf("network %v; want %v", f.net, wantNet)
			}
		})
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// snapshotsFunc wraps f's Snapshots to look at each fetched job.
func snapshotsFunc(see func(*Job), f *fake) Snapshots { return seeingSnapshots{f, see} }

type seeingSnapshots struct {
	*fake
	see func(*Job)
}

func (s seeingSnapshots) Fetch(ctx context.Context, job string, c clusterapi.Candidate) (*Job, error) {
	j, err := s.fake.Fetch(ctx, job, c)
	if j != nil {
		s.see(j)
	}
	return j, err
}

// TestFetchCheck: a peer that cannot give its record of what it received leaves the reason in the Check,
// which the verification then reports (TestReplayAndVerify) instead of a silent pass.
func TestFetchCheck(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	rec := &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{{Seq: 0, Len: 10, CRC: 1}}}
	tests := []struct {
		name string
		peer receivedFunc
		want Check
	}{
		{"record given", func() (*recvdigest.Received, error) { return rec, nil }, Check{Received: rec}},
		{"record refused", func() (*recvdigest.Received, error) { return nil, errors.New("agent restarted since") },
			Check{Missing: "node1 could not give its record of what it received: agent restarted since"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := fetchCheck(t.Context(), tt.peer, "node1", conn, 0); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("fetchCheck = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestFetchConnNothingToResend: a peer that acknowledged nothing past the snapshot's write_seq gets no
// request for its record of what it received: nothing will be re-sent to it, and the upstream end of a
// one-way stream has no record (its agent refused, a warning in every recovery of a pipeline stage). A
// peer that acknowledged more is asked.
func TestFetchConnNothingToResend(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	rec := &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{{Seq: 5000, Len: 10, CRC: 1}}}
	tests := []struct {
		name  string
		live  ebpfprobes.FlowState
		asked bool
	}{
		{"acknowledged up to write_seq", ebpfprobes.FlowState{HasAck: true, Ack: 5000}, false},
		{"acknowledged less (bytes in the snapshot's send queue)", ebpfprobes.FlowState{HasAck: true, Ack: 4000}, false},
		{"acknowledged past write_seq", ebpfprobes.FlowState{HasAck: true, Ack: 5010}, true},
		{"no ACK seen", ebpfprobes.FlowState{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			peers := &onePeer{live: tt.live, rec: rec}
			got := fetchConn(t.Context(), Deps{Peers: peers}, ckpt.Conn{Tuple: conn, OutqSeq: 5000})
			if got.err != nil {
				t.Fatal(got.err)
			}
			if peers.asked != tt.asked {
				t.Errorf("record asked: %v, want %v", peers.asked, tt.asked)
			}
			if tt.asked && got.check.Received != rec {
				t.Errorf("check %+v, want the peer's record", got.check)
			}
			if !tt.asked && (got.check.Received != nil || got.check.Missing == "") {
				t.Errorf("check %+v, want none, saying why", got.check)
			}
		})
	}
}

// TestFetchConnConnecting: a connection whose socket was still connecting at the snapshot is refused
// without asking its peer from the placeholder InqSeq 0: whatever was exchanged on it since is in no
// snapshot.
func TestFetchConnConnecting(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:40000"), Remote: netip.MustParseAddrPort("10.0.0.1:7000")}
	got := fetchConn(t.Context(), Deps{Peers: receivedFunc(func() (*recvdigest.Received, error) { return nil, errors.New("not asked") })},
		ckpt.Conn{Tuple: conn, OutqSeq: 5000, Connecting: true})
	if !errors.Is(got.err, restore.ErrNotRecoverable) || !strings.Contains(got.err.Error(), "still connecting") {
		t.Errorf("fetchConn of a connecting socket: %v, want it refused as still connecting", got.err)
	}
}

// onePeer is Peers with one member, node1, holding every peer address.
type onePeer struct {
	live  ebpfprobes.FlowState
	rec   *recvdigest.Received
	asked bool
}

func (p *onePeer) Owner(context.Context, netip.Addr) string { return "node1" }

func (p *onePeer) LogRange(context.Context, string, clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
	live := p.live
	return clusterapi.LogRangeReply{Live: &live}, nil, nil
}

func (p *onePeer) Received(context.Context, string, tcpflow.Tuple, uint32) (*recvdigest.Received, error) {
	p.asked = true
	return p.rec, nil
}

// receivedFunc is Peers answering only Received.
type receivedFunc func() (*recvdigest.Received, error)

func (f receivedFunc) Owner(context.Context, netip.Addr) string { return "" }

func (f receivedFunc) LogRange(context.Context, string, clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
	return clusterapi.LogRangeReply{}, nil, errors.New("not asked")
}

func (f receivedFunc) Received(context.Context, string, tcpflow.Tuple, uint32) (*recvdigest.Received, error) {
	return f()
}

// TestPlanFetchesConnectionsAtOnce: plan asks the peers of all a job's connections at the same time (a
// fetch waits here until every one has started; one after another, the first would wait forever), skips a
// connection whose both ends were on the failed node or in the job's own network, and reports every connection that failed, in the
// manifest's order.
func TestPlanFetchesConnectionsAtOnce(t *testing.T) {
	local := netip.AddrPortFrom(failedAddr, 5000)
	var conns []ckpt.Conn
	f := newFake(t)
	for i, peer := range []string{"10.0.0.1", "10.0.0.3", "10.0.0.4"} {
		remote := netip.AddrPortFrom(netip.MustParseAddr(peer), uint16(7000+i))
		conns = append(conns, ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}})
		f.owners[remote.Addr()] = "owner-" + peer
	}
	internal := ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: netip.AddrPortFrom(failedAddr, 6000)}}
	conns = append(conns, internal)
	allStarted := barrier(3)
	f.logRange = func(owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
		if req.Tuple.Remote.Addr() == failedAddr && req.Tuple.Local.Addr() == failedAddr || req.Tuple.Remote.Addr() == jobAddr {
			t.Errorf("plan asked %s for a connection inside the failed node or the job's network: %s", owner, req.Tuple)
		}
		if err := allStarted(); err != nil {
			return clusterapi.LogRangeReply{}, nil, err
		}
		return clusterapi.LogRangeReply{}, nil, errors.New("refused by " + owner)
	}
	// Inside a job network: both ends are the job's, in its snapshot.
	conns = append(conns, ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(jobAddr, 5001), Remote: netip.AddrPortFrom(jobAddr, 6001)}})
	j := &Job{Manifest: &ckpt.Manifest{Info: ckpt.Info{Conns: conns}}, Net: fakeJobNet{f: f}}
	err := plan(context.Background(), f.deps(), j, onFailedNode(request(), []*Job{j}))
	if err == nil {
		t.Fatal("plan succeeded with every peer refusing")
	}
	msg := err.Error()
	if strings.Contains(msg, jobAddr.String()) {
		t.Errorf("plan's error %q names the connection inside the job's network", msg)
	}
	last := -1
	for _, owner := range []string{"owner-10.0.0.1", "owner-10.0.0.3", "owner-10.0.0.4"} {
		i := strings.Index(msg, "refused by "+owner)
		if i < 0 || i < last {
			t.Fatalf("plan's error %q: want every refusal, in the manifest's order", msg)
		}
		last = i
	}
}

// barrier returns a function that n goroutines call: it returns once all n called it, or fails after a
// bound (the calls were made one after another, not at once).
func barrier(n int) func() error {
	var started sync.WaitGroup
	started.Add(n)
	return func() error {
		started.Done()
		done := make(chan struct{})
		go func() { started.Wait(); close(done) }()
		select {
		case <-done:
			return nil
		case <-time.After(10 * time.Second): // a failure bound: they start at once
			return errors.New("the others never started")
		}
	}
}

// TestRunRestoresJobsAtOnce: the jobs of a failed node are fetched at once and restored at once (each
// fetch and each restore here waits until all three started; one after another, the first would wait for
// ever). Every job's guard is up before the first restore. A job whose restore fails is undone alone; the
// others are replayed and re-protected, and the error names the failed job.
func TestRunRestoresJobsAtOnce(t *testing.T) {
	f := newFake(t)
	req := request(snap1)
	req.Jobs = nil
	for _, id := range []string{"rank1", "rank2", "rank3"} {
		req.Jobs = append(req.Jobs, clusterapi.RecoverJob{Job: id, Candidates: []clusterapi.Candidate{{Snapshot: snap1, Source: "node3"}}})
	}
	fetching, restoring := barrier(3), barrier(3)
	f.fetchHook = func(string) {
		if err := fetching(); err != nil {
			t.Error("fetch:", err)
		}
	}
	f.restoreHook = func(j *Job) error {
		f.mu.Lock()
		guards := 0
		for _, n := range f.net {
			if strings.HasPrefix(n, "guard ") {
				guards++
			}
		}
		f.mu.Unlock()
		if guards != 3 {
			t.Errorf("restore of %s began with %d of 3 guards up", j.ID, guards)
		}
		if err := restoring(); err != nil {
			t.Error("restore:", err)
		}
		if j.ID == "rank2" {
			return errors.New("criu failed")
		}
		return nil
	}
	var stages []Stage
	err := Run(context.Background(), req, f.deps(), func(s Stage) { stages = append(stages, s) })
	if err == nil || !strings.Contains(err.Error(), "job rank2: criu failed") || strings.Contains(err.Error(), "rank1") || strings.Contains(err.Error(), "rank3") {
		t.Fatalf("Run: %v; want only rank2's restore failure", err)
	}
	perJob := map[string][]string{}
	for _, s := range stages {
		perJob[s.Job] = append(perJob[s.Job], s.Name)
	}
	want := map[string][]string{
		"rank1": {StageFetched, StageRewritten, StageRestored, StageReplayed},
		"rank2": {StageFetched, StageRewritten, StageRestored},
		"rank3": {StageFetched, StageRewritten, StageRestored, StageReplayed},
		"":      {StageProtected},
	}
	if !reflect.DeepEqual(perJob, want) {
		t.Errorf("stages per job %v, want %v", perJob, want)
	}
	slices.Sort(f.reprotected)
	if !reflect.DeepEqual(f.reprotected, []string{"rank1", "rank3"}) || !reflect.DeepEqual(f.unlessSt, []string{"rank2"}) {
		t.Errorf("re-protected %v, given back unless started %v; want rank1 and rank3, and rank2", f.reprotected, f.unlessSt)
	}
	if !slices.Contains(f.net, "unguard run-rank2") || slices.Contains(f.net, "unguard run-rank1") {
		t.Errorf("network %v: want rank2's guard removed, and only it", f.net)
	}
}

// TestRunLocalPeers: connections between two jobs of the failed node (on its own address) are restored from
// the two jobs' snapshots, which must agree on them; when they do not, or the other end is in no job of the
// recovery, the jobs concerned are refused by name, their claims given back, and the others go on.
func TestRunLocalPeers(t *testing.T) {
	a := netip.AddrPortFrom(failedAddr, 7000)
	b := netip.AddrPortFrom(failedAddr, 41000)
	c := netip.AddrPortFrom(failedAddr, 42000)
	conn := func(local, remote netip.AddrPort, inq, outq, outqLen uint32) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, InqSeq: inq, OutqSeq: outq, OutqLen: outqLen}
	}
	// The same, each job on an address of its own.
	ja, jb := netip.MustParseAddrPort("10.0.0.201:7000"), netip.MustParseAddrPort("10.0.0.202:41000")
	const semi = `checkpoint.mode = "semi-coordinated"`
	for _, tt := range []struct {
		name    string
		connsOf map[string][]ckpt.Conn
		refused []string // jobs refused, in order
		why     string
		remedy  string // what the error says to do
		jobNets bool
	}{
		{"one freeze: both ends agree", map[string][]ckpt.Conn{
			"rank1": {conn(a, b, 5000, 1000, 0)}, "rank2": {conn(b, a, 1000, 5000, 0)}, "rank3": nil}, nil, "", "", false},
		{"both ends in one job", map[string][]ckpt.Conn{
			"rank1": {conn(a, b, 5000, 1000, 0), conn(b, a, 1000, 5000, 0)}, "rank2": nil, "rank3": nil}, nil, "", "", false},
		// rank2 was dumped before 100 bytes of rank1's arrived, rank1 after they were acknowledged.
		{"dumped apart: bytes in neither snapshot", map[string][]ckpt.Conn{
			"rank1": {conn(a, b, 5000, 1000, 0)}, "rank2": {conn(b, a, 900, 5000, 0)}, "rank3": nil},
			[]string{"rank1", "rank2"}, "in neither snapshot", semi, false},
		{"the other end in no job of the node", map[string][]ckpt.Conn{
			"rank1": {conn(a, b, 5000, 1000, 0)}, "rank2": nil, "rank3": nil},
			[]string{"rank1"}, "its other end was on the failed node too, in no job restored with it", "must run as a job of that host", false},
		// rank3 talks to rank2, which is refused for its connection to rank1: rank3 cannot go on alone.
		{"connected to a refused job", map[string][]ckpt.Conn{
			"rank1": {conn(a, b, 5000, 1000, 0)}, "rank2": {conn(b, a, 900, 5000, 0), conn(b, c, 1, 1, 0)}, "rank3": {conn(c, b, 1, 1, 0)}},
			[]string{"rank1", "rank2", "rank3"}, "job rank3 is not transparently recoverable: connection 10.0.0.2:42000 -> 10.0.0.2:41000 to job rank2, which is refused: ", semi, false},
		{"job addresses, one freeze", map[string][]ckpt.Conn{
			"rank1": {conn(ja, jb, 5000, 1000, 0)}, "rank2": {conn(jb, ja, 1000, 5000, 0)}, "rank3": nil}, nil, "", "", true},
		{"job addresses, dumped apart", map[string][]ckpt.Conn{
			"rank1": {conn(ja, jb, 5000, 1000, 0)}, "rank2": {conn(jb, ja, 900, 5000, 0)}, "rank3": nil},
			[]string{"rank1", "rank2"}, "in neither snapshot", semi, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake(t)
			f.connsOf = tt.connsOf
			req := request(snap1)
			if tt.jobNets {
				// Every job of the node had its own address: its host address is not taken over.
				f.jobNet, req.Addrs = true, nil
				f.jobAddrOf = map[string]netip.Addr{"rank1": ja.Addr(), "rank2": jb.Addr(), "rank3": netip.MustParseAddr("10.0.0.203")}
			}
			req.Jobs = nil
			for _, id := range []string{"rank1", "rank2", "rank3"} {
				req.Jobs = append(req.Jobs, clusterapi.RecoverJob{Job: id, Candidates: []clusterapi.Candidate{{Snapshot: snap1, Source: "node3"}}})
			}
			var mu sync.Mutex
			var refused []string
			err := Run(context.Background(), req, f.deps(), func(s Stage) {
				if s.Name == StageRestored && s.Err != nil {
					mu.Lock()
					refused = append(refused, s.Job)
					mu.Unlock()
				}
			})
			slices.Sort(refused)
			if !slices.Equal(refused, tt.refused) {
				t.Fatalf("refused %v, want %v (err %v)", refused, tt.refused, err)
			}
			if len(tt.refused) == 0 {
				if err != nil {
					t.Fatalf("Run: %v", err)
				}
				return
			}
			if !errors.Is(err, restore.ErrNotRecoverable) || !strings.Contains(err.Error(), tt.why) || !strings.Contains(err.Error(), tt.remedy) {
				t.Errorf("Run: %v; want ErrNotRecoverable naming %q and what avoids it, %q", err, tt.why, tt.remedy)
			}
			slices.Sort(f.givenBack)
			if !slices.Equal(f.givenBack, tt.refused) {
				t.Errorf("claims given back %v, want %v", f.givenBack, tt.refused)
			}
			for _, id := range f.restored {
				if slices.Contains(tt.refused, id) {
					t.Errorf("refused job %s restored", id)
				}
			}
		})
	}
}

// A restored job whose connection's other end was a job of the failed node whose restore then failed is
// killed, and so is a job connected to it in turn: before, rank2 was verified and re-protected while this
// host reset its connection to rank1 (a reset the failed node's run never had, on bytes no log checks).
func TestRunRefusesJobsOfAFailedLocalPeer(t *testing.T) {
	a := netip.AddrPortFrom(failedAddr, 7000)
	b := netip.AddrPortFrom(failedAddr, 41000)
	c := netip.AddrPortFrom(failedAddr, 42000)
	conn := func(local, remote netip.AddrPort, inq, outq uint32) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, InqSeq: inq, OutqSeq: outq}
	}
	f := newFake(t)
	f.connsOf = map[string][]ckpt.Conn{
		"rank1": {conn(a, b, 5000, 1000)},
		"rank2": {conn(b, a, 1000, 5000), conn(b, c, 1, 1)},
		"rank3": {conn(c, b, 1, 1)},
		"rank4": nil, // no connection to them: recovered
	}
	f.restoreHook = func(j *Job) error {
		if j.ID == "rank1" {
			return errors.New("criu restore failed")
		}
		return nil
	}
	req := request(snap1)
	req.Jobs = nil
	for _, id := range []string{"rank1", "rank2", "rank3", "rank4"} {
		req.Jobs = append(req.Jobs, clusterapi.RecoverJob{Job: id, Candidates: []clusterapi.Candidate{{Snapshot: snap1, Source: "node3"}}})
	}
	err := Run(context.Background(), req, f.deps(), func(Stage) {})
	for _, want := range []string{"criu restore failed", "job rank2 is not transparently recoverable (killed): connection 10.0.0.2:41000 -> 10.0.0.2:7000 to job rank1, which is not restored",
		"job rank3 is not transparently recoverable (killed): connection 10.0.0.2:42000 -> 10.0.0.2:41000 to job rank2"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Run: %v; want it to say %q", err, want)
		}
	}
	slices.Sort(f.killed)
	if !slices.Equal(f.killed, []string{"rank2", "rank3"}) || !slices.Equal(f.reprotected, []string{"rank4"}) {
		t.Errorf("killed %v, re-protected %v; want rank2 and rank3 killed, rank4 re-protected", f.killed, f.reprotected)
	}
}

// A job whose restore failed leaves no flow in the ACK clamp: with its ACKs lowered, the peer would ignore
// the resets this host sends it for the missing socket and wait instead of failing.
func TestRestoreFailureReleasesClamp(t *testing.T) {
	f := newFake(t)
	f.restoreErr = errors.New("criu restore: exit 1")
	flow := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.3:4000")}
	j := &Job{ID: "rank1", RunID: "run-rank1", Work: t.TempDir(),
		Plan: restore.Plan{Conns: []restore.ConnPlan{{Conn: ckpt.Conn{Tuple: flow, OutqSeq: 1000}, Resend: 10}}}}
	d := f.deps()
	if err := d.Clamp.Clamp(flow, 1000); err != nil { // as prepareNetwork does
		t.Fatal(err)
	}
	if err := restoreJob(t.Context(), d, j, func(string, string, time.Time, string, error) {}); err == nil {
		t.Fatal("restoreJob succeeded")
	}
	if !slices.Contains(f.released, flow) {
		t.Errorf("the restore failed and the clamp released %v; want %v released", f.released, flow)
	}
}

// TestRestoreDeliversPeerFIN: a peer that closed after the snapshot has its FIN delivered once the job is
// restored, after the bytes the images hold (before, the restored program read those and then waited
// forever for the end of a stream whose FIN the failed host had acknowledged); one that cannot be
// delivered fails the job's replay, which kills it.
func TestRestoreDeliversPeerFIN(t *testing.T) {
	flow := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.3:4000")}
	other := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7001"), Remote: netip.MustParseAddrPort("10.0.0.3:4001")}
	for _, finErr := range []error{nil, errors.New("no socket")} {
		f := newFake(t)
		f.finErr = finErr
		j := &Job{ID: "rank1", RunID: "run-rank1", Work: t.TempDir(),
			Plan: restore.Plan{Conns: []restore.ConnPlan{
				{Conn: ckpt.Conn{Tuple: flow, InqSeq: 1000, OutqSeq: 5000}, Inject: make([]byte, 40), Fin: true},
				{Conn: ckpt.Conn{Tuple: other, InqSeq: 3000, OutqSeq: 6000}, Inject: make([]byte, 10)},
			}},
			peers: map[tcpflow.Tuple]restore.Peer{flow: {Live: ebpfprobes.FlowState{SndNxt: 1041, Ack: 5000, HasAck: true, FinSent: true}}}}
		if err := restoreJob(t.Context(), f.deps(), j, func(string, string, time.Time, string, error) {}); err != nil {
			t.Fatal(err)
		}
		if want := []string{"fin " + flow.String() + " at 1040"}; !slices.Equal(f.net, want) {
			t.Errorf("network after the restore: %v, want %v (the FIN where the peer's data ends, only where the peer closed)", f.net, want)
		}
		_, err := ReplayAndVerify(t.Context(), f.deps(), j)
		switch {
		case finErr == nil && err != nil:
			t.Errorf("ReplayAndVerify: %v", err)
		case finErr != nil && (err == nil || !strings.Contains(err.Error(), "its FIN could not be delivered") || !slices.Contains(f.killed, "rank1")):
			t.Errorf("FIN not delivered: ReplayAndVerify %v, killed %v; want rank1 killed, saying so", err, f.killed)
		}
	}
}

// TestResumeFins: an agent restarted during a recovery delivers the FINs its predecessor may not have
// delivered, with the peer's live state asked again (its latest TSval), and the job is refused if one
// cannot be delivered. Before, a resumed recovery delivered none, and a restored reader waited for the end
// of its stream until the connection timed out.
func TestResumeFins(t *testing.T) {
	flow := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.3:4000")}
	plan := &Job{Plan: restore.Plan{Conns: []restore.ConnPlan{
		{Conn: ckpt.Conn{Tuple: flow, InqSeq: 1000, OutqSeq: 5000}, Inject: make([]byte, 40), Fin: true},
		{Conn: ckpt.Conn{Tuple: tcpflow.Tuple{Local: flow.Local, Remote: netip.MustParseAddrPort("10.0.0.4:4000")}, InqSeq: 3000}},
	}}}
	fins := Fins(plan)
	if want := []FinConn{{Tuple: flow, Seq: 1040, OutqSeq: 5000}}; !slices.Equal(fins, want) {
		t.Fatalf("Fins = %+v, want %+v", fins, want)
	}
	for _, tc := range []struct {
		name     string
		owner    string
		rangeErr error
		finErr   error
		want     string // in ReplayAndVerify's error; "" for none
	}{
		{name: "delivered", owner: "node3"},
		{name: "no member holds the peer", want: "no member holds the peer"},
		{name: "log range fails", owner: "node3", rangeErr: errors.New("node3 is gone"), want: "node3 is gone"},
		{name: "socket refuses", owner: "node3", finErr: errors.New("no socket"), want: "no socket"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t)
			f.finErr = tc.finErr
			if tc.owner != "" {
				f.owners[flow.Remote.Addr()] = tc.owner
			}
			var asked []clusterapi.LogRangeRequest
			f.logRange = func(owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error) {
				asked = append(asked, req)
				live := ebpfprobes.FlowState{SndNxt: 1041, Ack: 5000, HasAck: true, FinSent: true, HasTS: true, TSval: 777}
				return clusterapi.LogRangeReply{From: req.From, Live: &live}, nil, tc.rangeErr
			}
			j := &Job{ID: "rank1", RunID: "run-rank1", Work: t.TempDir()}
			ResumeFins(t.Context(), f.deps(), fakeNet{f}, j, fins)
			if tc.owner != "" {
				if want := []clusterapi.LogRangeRequest{{Tuple: flow.Reverse(), From: 1040}}; !slices.Equal(asked, want) {
					t.Errorf("asked %+v, want %+v (the live state from where the data ends)", asked, want)
				}
			}
			if tc.rangeErr == nil && tc.owner != "" {
				if want := []string{"fin " + flow.String() + " at 1040: true 777"}; !slices.Equal(f.injectedTS, want) {
					t.Errorf("delivered %v, want %v", f.injectedTS, want)
				}
			} else if len(f.injectedTS) != 0 {
				t.Errorf("delivered %v without the peer's live state", f.injectedTS)
			}
			_, err := ReplayAndVerify(t.Context(), f.deps(), j)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("ReplayAndVerify: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !slices.Contains(f.killed, "rank1")):
				t.Errorf("ReplayAndVerify %v, killed %v; want rank1 killed, saying %q", err, f.killed, tc.want)
			}
		})
	}
}

// TestFailedRestoreUndoneAfterCancel: a restore that failed because the recovery's context ended (the agent
// stops) still takes its guard down: before, the undo ran on that ended context, which restore.Unguard
// refuses, and the guard dropped the job's flows and new connections to its address for good.
func TestFailedRestoreUndoneAfterCancel(t *testing.T) {
	f := newFake(t)
	f.restoreErr = context.Canceled
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	j := &Job{ID: "rank1", RunID: "run-rank1", Work: t.TempDir()}
	if err := restoreJob(ctx, f.deps(), j, func(string, string, time.Time, string, error) {}); err == nil {
		t.Fatal("restoreJob succeeded")
	}
	if want := []string{"unguard run-rank1"}; !slices.Equal(f.net, want) {
		t.Errorf("network after the failed restore: %v, want %v", f.net, want)
	}
}

// TestReplayAndVerifyAgentStopping: the agent stops (SIGTERM: the recovery's context ends) while a
// restored job has not re-sent all its peer had. The job has failed nothing: it is left running, with its
// peers untouched, for the next agent to resume from the record (the tracker leaves it unfinished), not
// killed as diverged with its peers reset.
func TestReplayAndVerifyAgentStopping(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	f := newFake(t)
	d := f.deps()
	f.sent[conn] = 10 // of 3000: the replay goes on
	cp := restore.ConnPlan{Resend: 3000}
	cp.Conn.Tuple = conn
	j := &Job{ID: "rank1", Plan: restore.Plan{Conns: []restore.ConnPlan{cp}}, RestoredAt: time.Now()}
	ctx, stop := context.WithCancel(t.Context())
	time.AfterFunc(20*time.Millisecond, stop)
	_, err := ReplayAndVerify(ctx, d, j)
	if err == nil {
		t.Fatal("ReplayAndVerify = nil; want an error: the replay was not verified")
	}
	if len(f.killed) != 0 || slices.ContainsFunc(f.net, func(s string) bool { return strings.HasPrefix(s, "reset ") }) {
		t.Errorf("agent stopping mid-replay: killed %v, network %v; want the job left running and its peer untouched, for the next agent to resume (err %v)", f.killed, f.net, err)
	}
}

// TestRunRefusesAJobNamedTwice: a recovery request that names a job twice is refused before anything is
// fetched, claimed or restored. Before, both entries were fetched and claimed (the same holder's claim of
// the same incarnation succeeds again, as a retried request's) and the job was restored twice here.
func TestRunRefusesAJobNamedTwice(t *testing.T) {
	f := newFake(t)
	req := request(snap1)
	req.Jobs = append(req.Jobs, req.Jobs[0])
	err := Run(t.Context(), req, f.deps(), func(Stage) {})
	if err == nil || !strings.Contains(err.Error(), "names job rank1 twice") {
		t.Errorf("Run = %v; want the request refused, naming rank1 twice", err)
	}
	if len(f.fetched) != 0 || len(f.claimed) != 0 || len(f.restored) != 0 || len(f.net) != 0 {
		t.Errorf("fetched %v, claimed %v, restored %v, network %v; want nothing done", f.fetched, f.claimed, f.restored, f.net)
	}
}
