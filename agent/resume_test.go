package agent

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ackclamp"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/tcpflow"
)

func resumeTestAgent(t *testing.T) *Agent {
	t.Helper()
	var cfg Config
	cfg.Name, cfg.StateDir = "spare1", t.TempDir()
	return &Agent{cfg: cfg, log: slog.New(slog.DiscardHandler), byID: map[string]*Job{}, changed: make(chan struct{})}
}

func testRecoveryJob(job string, conns ...restore.ConnPlan) *recovery.Job {
	m := &ckpt.Manifest{Job: job, ID: "20250101T000000.000-node2-1"}
	return &recovery.Job{ID: job, Manifest: m, Plan: restore.Plan{Conns: conns}}
}

func connPlan(local, remote string, outq, resend uint32) restore.ConnPlan {
	var c restore.ConnPlan
	c.Conn.Local, c.Conn.Remote, c.Conn.OutqSeq, c.Resend = netip.MustParseAddrPort(local), netip.MustParseAddrPort(remote), outq, resend
	return c
}

// TestRecoveryRecordPersists is what a target agent killed during a replay leaves for its successor: the
// jobs, their replays (only the connections with bytes to re-send) with the peers' records of what they
// received and the snapshot's prefix CRCs, the FINs their peers sent after the snapshot, the phases and the stages, in a 0600 file of a 0700 directory;
// the outcome stays without the replays.
func TestRecoveryRecordPersists(t *testing.T) {
	a := resumeTestAgent(t)
	req := RecoverRequest{Failure: "node2-20250101T000001.000", Source: "node3"}
	tr := a.trackRecovery(req)
	var emitted []Stage
	emit := tr.wrap(func(s Stage) { emitted = append(emitted, s) })
	emit(Stage{Name: StageFetched, Job: "rank1", Host: "spare1"})
	r := testRecoveryJob("rank1",
		connPlan("10.0.0.2:7000", "10.0.0.1:40000", 1000, 5000),
		connPlan("10.0.0.2:7001", "10.0.0.3:40001", 9, 0),  // nothing to re-send: nothing to wait for
		connPlan("10.0.0.2:7002", "10.0.0.4:40002", 20, 0), // its peer closed it after the snapshot
	)
	r.Plan.Conns[2].Fin, r.Plan.Conns[2].Conn.InqSeq, r.Plan.Conns[2].Inject = true, 300, make([]byte, 10)
	fin := recovery.FinConn{Tuple: r.Plan.Conns[2].Conn.Tuple, Seq: 310, OutqSeq: 20}
	keep := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	prefix := &ckpt.SentPrefix{Len: 1000, CRC: 0xabcd}
	r.Plan.Conns[0].Conn.SentPrefix = prefix
	kept := &recvdigest.Received{Conn: keep, Pieces: []recvdigest.Piece{{Seq: 0, Len: recvdigest.BlockSize, CRC: 7}}}
	r.Checks = map[tcpflow.Tuple]recovery.Check{keep: {Received: kept},
		{Local: netip.MustParseAddrPort("10.0.0.2:7001"), Remote: netip.MustParseAddrPort("10.0.0.3:40001")}: {Missing: "nothing re-sent"}}
	tr.Persist([]*recovery.Job{r})
	at := time.Date(2025, 1, 1, 0, 0, 2, 0, time.UTC)
	tr.SetPhase("rank1", phaseRestored, at)

	path := recoveryPath(a.cfg.StateDir, req.Failure)
	for p, want := range map[string]os.FileMode{path: 0o600, filepath.Dir(path): 0o700 | os.ModeDir} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode() != want {
			t.Errorf("%s has mode %v, want %v", p, st.Mode(), want)
		}
	}
	recs, err := loadRecoveries(a.cfg.StateDir)
	if err != nil || len(recs) != 1 {
		t.Fatalf("loadRecoveries = %v, %v; want one record", recs, err)
	}
	got := recs[0]
	wantJobs := []recoveryJob{{Job: "rank1", Snapshot: r.Manifest.ID, Phase: phaseRestored, RestoredAt: at,
		Conns: []recoveryConn{{Tuple: keep, OutqSeq: 1000, Resend: 5000, SentPrefix: prefix, Check: recovery.Check{Received: kept}}},
		Fins:  []recovery.FinConn{fin}}}
	if got.Failure != req.Failure || got.Coordinator != "node3" || got.Done || !reflect.DeepEqual(got.Jobs, wantJobs) {
		t.Errorf("record %+v; want failure %s by node3, jobs %+v, not done", got, req.Failure, wantJobs)
	}
	// What a resumed agent rebuilds from it checks the same bytes with the same record.
	j := Job{ID: "rank1"}
	rr := a.resumedRecoveryJob(got.Jobs[0], j)
	if len(rr.Plan.Conns) != 1 || !reflect.DeepEqual(rr.Plan.Conns[0].Conn.SentPrefix, prefix) ||
		!reflect.DeepEqual(rr.Checks[keep].Received, kept) {
		t.Errorf("resumed plan %+v, checks %+v; want the re-sent connection with its prefix and record", rr.Plan.Conns, rr.Checks)
	}
	if len(got.Stages) != 1 || got.Stages[0].Name != StageFetched || len(emitted) != 1 {
		t.Errorf("stages %+v recorded, %d emitted; want the one stage in both", got.Stages, len(emitted))
	}

	// An agent that stops (SIGTERM) mid-replay leaves the recovery for the next one.
	stopping, stop := context.WithCancel(t.Context())
	stop()
	tr.done(stopping, errors.New("re-sent bytes did not reach the peer's receive point"))
	if rec, err := loadRecovery(path); err != nil || rec.Done {
		t.Errorf("after done while stopping: %+v, %v; want the record unfinished", rec, err)
	}

	tr.done(t.Context(), nil)
	rec, err := loadRecovery(path)
	if err != nil {
		t.Fatal(err)
	}
	if !rec.Done || rec.Error != "" || len(rec.Jobs) != 1 || rec.Jobs[0].Conns != nil {
		t.Errorf("after done: %+v; want done, no error, replays dropped", rec)
	}
}

// TestResumeRecoveryJobGone: the restarted agent finds a recorded job that does not run (its shim died
// with the agent, or CRIU never finished): the outcome is recorded as a failure that names the job.
func TestResumeRecoveryJobGone(t *testing.T) {
	a := resumeTestAgent(t)
	rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3",
		Jobs: []recoveryJob{{Job: "rank1-abc", Snapshot: "s", Phase: phaseRestored,
			Conns: []recoveryConn{{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:1")}, Resend: 10}}}}}
	if err := saveRecovery(a.cfg.StateDir, rec); err != nil {
		t.Fatal(err)
	}
	a.resumeRecoveries(t.Context(), a.pendingRecoveries())
	got, err := loadRecovery(recoveryPath(a.cfg.StateDir, rec.Failure))
	if err != nil {
		t.Fatal(err)
	}
	if !got.Done || !got.Resumed || !strings.Contains(got.Error, "rank1-abc") || !strings.Contains(got.Error, "does not run") {
		t.Errorf("resumed record %+v; want done, resumed, an error naming rank1-abc as not running", got)
	}
	if n := len(got.Stages); n != 1 || got.Stages[0].Job != "rank1-abc" || got.Stages[0].Error == "" {
		t.Errorf("resumed stages %+v; want one failed stage of rank1-abc", got.Stages)
	}
}

// TestResumeRecoveryJobGoneReleasesClamp: a restored job that the restarted agent finds gone has nothing
// left to replay: the ACK clamp of its connections is released, else it lowers their ACKs for as long as
// the host runs (releaseStaleClamps keeps the flows of every unfinished job, this one among them).
func TestResumeRecoveryJobGoneReleasesClamp(t *testing.T) {
	testenv.RequireKernel(t, "eBPF (the ACK clamp's maps)")
	a := resumeTestAgent(t)
	c, err := ackclamp.Load()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	a.clamp = c
	flow := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:1")}
	if err := c.Clamp(flow, 1000); err != nil {
		t.Fatal(err)
	}
	rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3",
		Jobs: []recoveryJob{{Job: "rank1-abc", Snapshot: "s", Phase: phaseRestored, Conns: []recoveryConn{{Tuple: flow, Resend: 10}}}}}
	if err := saveRecovery(a.cfg.StateDir, rec); err != nil {
		t.Fatal(err)
	}
	a.resumeRecoveries(t.Context(), a.pendingRecoveries())
	flows, err := c.Flows()
	if err != nil {
		t.Fatal(err)
	}
	if len(flows) != 0 {
		t.Errorf("the ACK clamp still holds %+v of a job that runs nowhere here", flows)
	}
}

// TestLoadRecoveryRejects: records are root's own files, but one renamed or damaged must not be resumed
// under another failure's name.
func TestLoadRecoveryRejects(t *testing.T) {
	a := resumeTestAgent(t)
	if err := saveRecovery(a.cfg.StateDir, &recoveryRecord{Failure: "f1"}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(a.cfg.StateDir, recoveriesDir)
	if err := os.Rename(filepath.Join(dir, "f1.json"), filepath.Join(dir, "f2.json")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "f3.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	recs, err := loadRecoveries(a.cfg.StateDir)
	if len(recs) != 0 || err == nil {
		t.Errorf("loadRecoveries = %v, %v; want nothing and an error", recs, err)
	}
	for _, id := range []string{"", ".", "..", "a/b", ".hidden", strings.Repeat("x", 256)} {
		if err := saveRecovery(a.cfg.StateDir, &recoveryRecord{Failure: id}); err == nil {
			t.Errorf("saveRecovery accepted failure id %q", id)
		}
	}
}

// TestResumeRecoveryKeepsEarlierFailures: the previous agent died after a job's restore had failed (the
// tracker drops a failed job from the record) or before it restored a job at all (after its fetch): the
// resumed recovery must not report success for jobs that run nowhere, as the coordinator takes a finished
// recovery without an error for all its jobs running.
func TestResumeRecoveryKeepsEarlierFailures(t *testing.T) {
	a := resumeTestAgent(t)
	req := RecoverRequest{Failure: "node2-20250101T000001.000", Source: "node3",
		Jobs: []RecoverJob{{Job: "rank1"}, {Job: "rank2"}}}
	tr := a.trackRecovery(req)
	emit := tr.wrap(func(Stage) {})
	emit(Stage{Name: StageFetched, Job: "rank1", Host: "spare1"})
	emit(Stage{Name: StageFetched, Job: "rank2", Host: "spare1"})
	tr.Persist([]*recovery.Job{testRecoveryJob("rank2")})
	emit(Stage{Name: StageRestored, Job: "rank2", Host: "spare1", Error: "criu restore failed"})
	tr.SetPhase("rank2", "", time.Time{}) // restoreJob drops a failed job; rank1 never got that far
	// The agent dies here.
	a.resumeRecoveries(t.Context(), a.pendingRecoveries())
	got, err := loadRecovery(recoveryPath(a.cfg.StateDir, req.Failure))
	if err != nil {
		t.Fatal(err)
	}
	if !got.Done || !strings.Contains(got.Error, "rank1") || !strings.Contains(got.Error, "rank2") {
		t.Errorf("resumed record: done %v, error %q; want done, with an error naming rank1 and rank2, which do not run", got.Done, got.Error)
	}
}

// TestResumeRecoveryRefuses: a resumed recovery that cannot go on with a restored job reports it "not
// transparently recoverable (killed)", and kills it: left running, it ran unverified and was never
// re-protected, or waited for ever.
func TestResumeRecoveryRefuses(t *testing.T) {
	flow := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	for _, tt := range []struct {
		name   string
		listen string      // the cluster address
		job    recoveryJob // its Job set by the test
		why    string      // in the record's error
	}{
		// What checking the job needs cannot be set up: no interface holds the cluster address.
		{"uncheckable", "192.0.2.77:7946", recoveryJob{Snapshot: "s", Phase: phaseRestored,
			Conns: []recoveryConn{{Tuple: flow, Resend: 10}}}, "(killed)"},
		// The rest of its receive bytes, which the previous agent's gate had not delivered, cannot be (the
		// snapshot's images are gone): its peers sent them before the failure and never send them again,
		// and a job that re-sends nothing had no replay to time out: its recovery reported success.
		{"receive bytes undelivered", "127.0.0.1:7946", recoveryJob{Snapshot: "20250101T000000.000-node2-1", Phase: phaseRestored,
			Deferred: []recovery.DeferredConn{{Tuple: flow, Inode: 7, InqSeq: 5000, InqLen: 100, OutqSeq: 900}}}, "receive bytes"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.cfg.Cluster.Listen = netip.MustParseAddrPort(tt.listen)
			sleep := exec.Command("sleep", "60")
			if err := sleep.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan struct{})
			go func() { sleep.Wait(); close(exited) }()
			t.Cleanup(func() { sleep.Process.Kill(); <-exited })
			job := ta.addJob(t, Job{ID: "rank1-00000001", State: JobRunning, PID: sleep.Process.Pid})
			rj := tt.job
			rj.Job = job.ID
			rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3", Asked: []string{job.ID}, Jobs: []recoveryJob{rj}}
			if err := saveRecovery(ta.cfg.StateDir, rec); err != nil {
				t.Fatal(err)
			}
			ta.resumeRecoveries(t.Context(), ta.pendingRecoveries())
			got, err := loadRecovery(recoveryPath(ta.cfg.StateDir, rec.Failure))
			if err != nil {
				t.Fatal(err)
			}
			if !got.Done || !strings.Contains(got.Error, "(killed)") || !strings.Contains(got.Error, tt.why) {
				t.Fatalf("resumed record: done %v, error %q; want the job refused (%s)", got.Done, got.Error, tt.why)
			}
			select {
			case <-exited:
			case <-time.After(10 * time.Second):
				t.Errorf("the record says job %s was killed (%q), but it still runs", job.ID, got.Error)
			}
		})
	}
}

// TestResumeKeepsClampOfDualStackSocket: a restored socket of a dual-stack listener (AF_INET6, an IPv4
// peer) has IPv4-mapped addresses in its snapshot, hence in the recovery record; the clamp keys every flow
// by its IPv4 form and lists it so. A restarted agent must still find that flow unfinished: neither
// release its clamp (the socket would drop every ACK of its peer as beyond what it sent, and stall) nor
// take its replay for complete.
func TestResumeKeepsClampOfDualStackSocket(t *testing.T) {
	mapped := tcpflow.Tuple{Local: netip.MustParseAddrPort("[::ffff:10.0.0.2]:7000"), Remote: netip.MustParseAddrPort("[::ffff:10.0.0.1]:40000")}
	rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3",
		Jobs: []recoveryJob{{Job: "rank1-abc", Snapshot: "s", Phase: phaseRestored, Conns: []recoveryConn{{Tuple: mapped, Resend: 10}}}}}
	// As the agent keeps it: through its JSON record.
	b, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var got recoveryRecord
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	flows := []ackclamp.ClampedFlow{{Flow: mapped.Unmap(), State: ackclamp.ClampState{SndNxt: 1000}}}
	if stale := staleClamps([]*recoveryRecord{&got}, flows); len(stale) != 0 {
		t.Errorf("a restarted agent releases the clamp of %v, whose replay is not done", stale)
	}
	r := resumedJob(got.Jobs[0], Job{ID: "rank1-abc"}, flows, true)
	if len(r.Replayed) != 0 {
		t.Errorf("the resumed replay takes %v for complete while the clamp still holds it", r.Replayed)
	}
}

// TestResumeRecoveryReplayedJobEnded: the previous agent verified a restored job's replay and died before
// re-protecting it; the job then ended (its shim recorded the exit). Its recovery is complete, as the live
// recovery counts a job that ends right after its replay (reprotect): reported failed, the coordinator
// would take the job for not recovered, and roll its run back (auto mode) after it had ended.
func TestResumeRecoveryReplayedJobEnded(t *testing.T) {
	a := resumeTestAgent(t)
	a.byID["rank1-abc"] = &Job{ID: "rank1-abc", State: JobExited}
	rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3", Asked: []string{"rank1-abc"},
		Jobs: []recoveryJob{{Job: "rank1-abc", Snapshot: "s", Phase: phaseReplayed}}}
	if err := saveRecovery(a.cfg.StateDir, rec); err != nil {
		t.Fatal(err)
	}
	a.resumeRecoveries(t.Context(), a.pendingRecoveries())
	got, err := loadRecovery(recoveryPath(a.cfg.StateDir, rec.Failure))
	if err != nil {
		t.Fatal(err)
	}
	if !got.Done || got.Error != "" {
		t.Errorf("resumed record: done %v, error %q; want done without an error (the job's replay was verified, and it ended)", got.Done, got.Error)
	}
}

// TestResumeRecoveryKillsUnrecordedRestore: the previous agent died while CRIU restored a job (in its
// shim, which outlives the agent), before it recorded the restored job: the job runs here with no record,
// so nothing watches it, checks its replay or re-protects it, and the incarnation stays claimed here. The
// resumed recovery must not report it as running nowhere and leave it so: it kills it, its refusal in its
// exit record, and says so.
func TestResumeRecoveryKillsUnrecordedRestore(t *testing.T) {
	cases := []struct {
		name   string
		record *Job // the job's record here, if any (an earlier copy's)
	}{
		{"no record", nil},
		{"earlier copy's record", &Job{State: JobExited}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			const id = "rank1-00000001"
			cg := ta.layout().cgroup(id)
			if err := os.MkdirAll(cg, 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.record != nil {
				j := *tc.record
				j.ID, j.Cgroup = id, cg
				ta.byID[id] = &j
			}
			// As the kernel shows a populated cgroup; cgroup.kill empties it.
			events, kill := filepath.Join(cg, "cgroup.events"), filepath.Join(cg, "cgroup.kill")
			if err := os.WriteFile(events, []byte("populated 1\nfrozen 0\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(kill, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			killed := make(chan struct{})
			stop := make(chan struct{})
			defer close(stop)
			go func() {
				for {
					if b, _ := os.ReadFile(kill); string(b) == "1" {
						close(killed) // before the cgroup shows empty, which the resume waits for
						os.WriteFile(events, []byte("populated 0\nfrozen 0\n"), 0o644)
						return
					}
					select {
					case <-stop:
						return
					case <-time.After(5 * time.Millisecond):
					}
				}
			}()
			rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3", Asked: []string{id},
				Jobs: []recoveryJob{{Job: id, Snapshot: "s", Phase: phaseRestoring}}}
			// The restore's claim of the copy's incarnation, which this host granted itself.
			if _, err := ta.grants.Grant(grant.Request{Job: id, Incarnation: 3, Holder: "failover:" + rec.Failure, Host: ta.cfg.Name}, time.Now()); err != nil {
				t.Fatal(err)
			}
			if err := saveRecovery(ta.cfg.StateDir, rec); err != nil {
				t.Fatal(err)
			}
			ta.resumeRecoveries(t.Context(), ta.pendingRecoveries())
			select {
			case <-killed:
			default:
				t.Fatalf("the job's cgroup still runs the copy the interrupted restore left (%s not written): it runs unwatched", kill)
			}
			got, err := loadRecovery(recoveryPath(ta.cfg.StateDir, rec.Failure))
			if err != nil {
				t.Fatal(err)
			}
			if !got.Done || !strings.Contains(got.Error, id) || !strings.Contains(got.Error, "killed") {
				t.Errorf("resumed record: done %v, error %q; want done, with an error saying %s was killed", got.Done, got.Error, id)
			}
			if b, err := os.ReadFile(ta.refusalMark(id, 3)); err != nil || !strings.Contains(string(b), "killed by ftkit") {
				t.Errorf("refusal mark of incarnation 3: %q, %v; want why ftkit killed the copy, for its exit record", b, err)
			}
		})
	}
}

// TestRecoveryRecordOfLargeReplays: a recovery record keeps, for every re-sent connection, its peer's
// record of what it received: up to recvdigest.MaxPieces pieces (256 KiB of base64) each. A recovery whose
// peers received much since the snapshot on a few dozen connections has a record larger than a recovery
// request, and a restarted agent must still read it: unread, the recovery is not resumed (its jobs run on
// unverified and never re-protected) and its coordinator is told the target has no record of it.
func TestRecoveryRecordOfLargeReplays(t *testing.T) {
	a := resumeTestAgent(t)
	full := make([]recvdigest.Piece, recvdigest.MaxPieces)
	for i := range full {
		full[i] = recvdigest.Piece{Seq: uint32(i) * recvdigest.BlockSize, Len: recvdigest.BlockSize, CRC: uint32(i)}
	}
	rj := recoveryJob{Job: "rank1-abc", Snapshot: "s", Phase: phaseRestored}
	for i := range 24 {
		flow := tcpflow.Tuple{Local: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.2"), uint16(7000+i)), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
		rj.Conns = append(rj.Conns, recoveryConn{Tuple: flow, Resend: 1 << 30,
			Check: recovery.Check{Received: &recvdigest.Received{Conn: flow, Pieces: full}}})
	}
	rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3", Asked: []string{rj.Job}, Jobs: []recoveryJob{rj}}
	if err := saveRecovery(a.cfg.StateDir, rec); err != nil {
		t.Fatal(err)
	}
	path := recoveryPath(a.cfg.StateDir, rec.Failure)
	if st, err := os.Stat(path); err != nil || st.Size() <= maxRecoverRequest {
		t.Fatalf("record of %v bytes (%v); the test wants one larger than a recovery request", st.Size(), err)
	}
	got, err := loadRecovery(path)
	if err != nil {
		t.Fatalf("loadRecovery of a recovery re-sending 24 GiB: %v; want the record", err)
	}
	if len(got.Jobs) != 1 || len(got.Jobs[0].Conns) != len(rj.Conns) || len(got.Jobs[0].Conns[0].Received.Pieces) != recvdigest.MaxPieces {
		t.Errorf("record read back with jobs %d; want the job and every connection's record", len(got.Jobs))
	}
	if st := a.serveRecoveryStatus("node3", clusterapi.RecoveryStatusRequest{Failure: rec.Failure}); !st.Known {
		t.Errorf("status answered to the coordinator %+v; want the recovery known", st)
	}
	if pending := a.pendingRecoveries(); len(pending) != 1 {
		t.Errorf("pending recoveries %d; want the unfinished one resumed", len(pending))
	}
}

// TestRecoveryKnownBeforeItsFirstStage: a target's recovery is on record from the moment it is accepted,
// not from its first stage (the fetch of a large snapshot may take minutes before it). A coordinator whose
// progress stream broke meanwhile (a network blip, or its request that timed out while the target ran it)
// asks the target; answered "no record", it reported the jobs as not running (and rolled their runs back,
// or gave up on them) while the target went on and restored them. A second request for the same failure
// is refused as one under way; an agent restarted before the first stage reports the jobs not restored.
func TestRecoveryKnownBeforeItsFirstStage(t *testing.T) {
	a := resumeTestAgent(t)
	req := RecoverRequest{Failure: "node2-20250101T000001.000", Source: "node3", Jobs: []RecoverJob{{Job: "rank1"}}}
	a.trackRecovery(req) // as recoverJobs does on accepting the request; the fetch goes on
	st := a.serveRecoveryStatus("node3", clusterapi.RecoveryStatusRequest{Failure: req.Failure, Jobs: []string{"rank1"}})
	if !st.Known || st.Done {
		t.Fatalf("status of a recovery under way before its first stage: known %v, done %v; want known and not done (the coordinator took its jobs for lost)", st.Known, st.Done)
	}
	if err := a.checkRecordFree(req.Failure, "node3"); err == nil {
		t.Error("a second request for a recovery under way was accepted: it would restore the jobs twice")
	}
	pending := a.pendingRecoveries()
	if len(pending) != 1 {
		t.Fatalf("pending recoveries %d after a restart before the first stage; want 1", len(pending))
	}
	if errs := notRestored(pending[0]); len(errs) != 1 || !strings.Contains(errs[0].Error(), "job rank1 was not restored") {
		t.Errorf("a resumed recovery that restored nothing reports %v; want rank1 not restored", errs)
	}
}
