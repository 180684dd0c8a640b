package agent

import (
	"errors"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestCheckCut: a cut is recorded only if every byte between its jobs is in exactly one place: in its
// sender's send queue (not acknowledged) or received by the other end.
func TestCheckCut(t *testing.T) {
	a := netip.MustParseAddrPort("10.77.1.2:7000")
	b := netip.MustParseAddrPort("10.77.1.3:41000")
	conn := func(local, remote netip.AddrPort, inq, outq, outqLen uint32) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, InqSeq: inq, OutqSeq: outq, OutqLen: outqLen}
	}
	connecting := func(local, remote netip.AddrPort) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, OutqSeq: 1001, Connecting: true}
	}
	cut := func(ca, cb ckpt.Conn) []clusterapi.CutPart {
		return []clusterapi.CutPart{{Job: "ja", Conns: []ckpt.Conn{ca}}, {Job: "jb", Conns: []ckpt.Conn{cb}}}
	}
	for _, tt := range []struct {
		name  string
		parts []clusterapi.CutPart
		torn  string // "" = consistent
		other string // a refusal that is not a torn cut
	}{
		// a wrote up to 1000, b received up to 1000; b wrote up to 5000, a received it all.
		{"quiet", cut(conn(a, b, 5000, 1000, 0), conn(b, a, 1000, 5000, 0)), "", ""},
		// a's last 200 bytes not acknowledged; b received 100 of them: the other 100 are re-sent by a.
		{"in flight, sender holds them", cut(conn(a, b, 5000, 1000, 200), conn(b, a, 900, 5000, 0)), "", ""},
		{"sequence numbers wrap", cut(conn(a, b, 5000, 100, 300), conn(b, a, 4294967200, 5000, 0)), "", ""},
		// b's dump came before 100 bytes arrived; a's after their acknowledgment: in neither.
		{"acknowledged after the receiver's dump", cut(conn(a, b, 5000, 1000, 0), conn(b, a, 900, 5000, 0)), "in neither snapshot", ""},
		{"received beyond what was written", cut(conn(a, b, 5000, 1000, 0), conn(b, a, 1100, 5000, 0)), "beyond what job ja had written", ""},
		{"a connection leaving the run", []clusterapi.CutPart{{Job: "ja", Conns: []ckpt.Conn{conn(a, b, 1, 1, 0)}}}, "", "not a job of the run"},
		{"no connections", []clusterapi.CutPart{{Job: "ja"}, {Job: "jb"}}, "", ""},
		// A connect pending at a's dump (InqSeq the kernel's 0): with b not yet holding the connection,
		// the restored a connects again; with b holding it accepted, the two snapshots disagree.
		{"a connect not yet accepted", []clusterapi.CutPart{{Job: "ja", Conns: []ckpt.Conn{connecting(a, b)}}, {Job: "jb"}}, "", ""},
		{"a connect accepted after the connecting end's dump", cut(connecting(a, b), conn(b, a, 1001, 3000000000, 0)), "still connecting in job ja's snapshot, accepted in job jb's", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := checkCut(tt.parts)
			var torn *tornCutError
			switch {
			case tt.torn == "" && tt.other == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tt.torn != "" && (!errors.As(err, &torn) || !strings.Contains(err.Error(), tt.torn)):
				t.Fatalf("got %v, want a torn cut naming %q", err, tt.torn)
			case tt.other != "" && (err == nil || errors.As(err, &torn) || !strings.Contains(err.Error(), tt.other)):
				t.Fatalf("got %v, want a refusal naming %q (not retried)", err, tt.other)
			}
		})
	}
}

// TestPlaceParts: a rollback restores each part where its job runs now, else on its host, else (its host
// failed) on the failure's target; never beside a copy that runs elsewhere, and never without knowing
// where every job of the run is.
func TestPlaceParts(t *testing.T) {
	cut := &Cut{Run: "r", ID: "cut-1", Parts: []clusterapi.CutPart{
		{Job: "a-00000001", Host: "n1", Snapshot: "s1"},
		{Job: "b-00000002", Host: "n2", Snapshot: "s2"},
	}}
	held := func(p clusterapi.CutPart) bool { return p.Job == "b-00000002" }
	type placed struct{ target, source string }
	for _, tt := range []struct {
		name   string
		where  map[string]string
		alive  []string
		target string
		want   map[string]placed // by job
		err    string
	}{
		{"both run on their hosts", map[string]string{"a-00000001": "n1", "b-00000002": "n2"}, []string{"n1", "n2", "n3"}, "",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"n2", ""}}, ""},
		{"b moved to n3 after the cut", map[string]string{"a-00000001": "n1", "b-00000002": "n3"}, []string{"n1", "n2", "n3"}, "",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"n3", "self"}}, ""},
		{"b ended: restored on its host", map[string]string{"a-00000001": "n1"}, []string{"n1", "n2"}, "",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"n2", ""}}, ""},
		{"n2 failed: b on the spare", map[string]string{"a-00000001": "n1"}, []string{"n1", "n3", "s1"}, "s1",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"s1", "self"}}, ""},
		{"n2 failed, no target", map[string]string{"a-00000001": "n1"}, []string{"n1", "n3"}, "", nil, "runs nowhere"},
		{"a job that started after the cut", map[string]string{"a-00000001": "n1", "b-00000002": "n2", "c-00000003": "n3"}, []string{"n1", "n2", "n3"}, "", nil, "started after its cut"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			byHost, hosts, err := placeParts(cut, tt.where, tt.alive, tt.target, "self", held)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("got %v, want an error naming %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]placed{}
			for _, h := range hosts {
				for _, p := range byHost[h] {
					if p.Target != h {
						t.Errorf("part %s listed under %s, target %s", p.Job, h, p.Target)
					}
					got[p.Job] = placed{p.Target, p.Source}
				}
			}
			if !maps.Equal(got, tt.want) {
				t.Errorf("placed %v, want %v", got, tt.want)
			}
		})
	}
}

// TestCutRecords: cut records are kept per run and user; a run name alone finds the one user's; two users'
// runs of one name need the user; a record whose content names another run or user, or a part that is no
// snapshot, is refused; retention keeps the snapshots a record names.
func TestCutRecords(t *testing.T) {
	a := newTestAgent(t)
	part := func(job, snap string) clusterapi.CutPart {
		return clusterapi.CutPart{Job: job, Host: "node1", Snapshot: snap}
	}
	const s1, s2 = "20260501T120000.000Z-node1-000001", "20260501T120100.000Z-node2-000002"
	mine := Cut{Run: "r1", UID: 1000, ID: "cut-1", Parts: []clusterapi.CutPart{part("a-00000001", s1)}}
	if err := a.saveCut(mine); err != nil {
		t.Fatal(err)
	}
	if _, err := a.loadCut("r2", nil); !errors.Is(err, ErrNoCut) {
		t.Errorf("a run without a cut: %v, want ErrNoCut", err)
	}
	if c, err := a.loadCut("r1", nil); err != nil || c.ID != "cut-1" || c.UID != 1000 {
		t.Errorf("the one user's cut of r1: %+v %v", c, err)
	}
	older := mine
	older.ID = "cut-0"
	if err := a.saveCut(older); err != nil { // a commit that arrives after a newer one's
		t.Fatal(err)
	}
	if c, err := a.loadCut("r1", nil); err != nil || c.ID != "cut-1" {
		t.Errorf("after an older cut's late commit: %+v %v, want cut-1 kept", c, err)
	}
	theirs := Cut{Run: "r1", UID: 2000, ID: "cut-2", Parts: []clusterapi.CutPart{part("b-00000002", s2)}}
	if err := a.saveCut(theirs); err != nil {
		t.Fatal(err)
	}
	if _, err := a.loadCut("r1", nil); err == nil || !strings.Contains(err.Error(), "name the user") {
		t.Errorf("r1 of two users without a user: %v, want a refusal asking for it", err)
	}
	uid := uint32(2000)
	if c, err := a.loadCut("r1", &uid); err != nil || c.ID != "cut-2" {
		t.Errorf("uid 2000's cut of r1: %+v %v", c, err)
	}
	if got := a.pinnedSnapshots("b-00000002"); !slices.Equal(got, []string{s2}) {
		t.Errorf("pinned snapshots of b: %v, want [%s]", got, s2)
	}
	if c, p := a.cutWith("a-00000001"); c == nil || c.UID != 1000 || p.Snapshot != s1 {
		t.Errorf("cut with job a: %+v %+v", c, p)
	}
	// A record is read as another member wrote it: a renamed or edited one is refused, never used.
	if err := os.Rename(a.cutPath("r1", 2000), a.cutPath("r1", 3000)); err != nil {
		t.Fatal(err)
	}
	other := uint32(3000)
	if _, err := a.loadCut("r1", &other); err == nil || !strings.Contains(err.Error(), "names run r1 of uid 2000") {
		t.Errorf("a record moved to another user's name: %v, want it refused", err)
	}
	bad := mine
	bad.Parts = []clusterapi.CutPart{part("a-00000001", "../../etc/passwd")}
	if err := atomicfile.WriteJSON(a.cutPath("r1", 1000), bad); err != nil {
		t.Fatal(err)
	}
	mineUID := uint32(1000)
	if _, err := a.loadCut("r1", &mineUID); err == nil || !strings.Contains(err.Error(), "snapshot") {
		t.Errorf("a record naming a path as a snapshot: %v, want it refused", err)
	}
	if got := a.pinnedSnapshots("a-00000001"); len(got) != 0 {
		t.Errorf("pinned from a refused record: %v", got)
	}
}

// TestHoldEndsWhenCoordinatorFails: a host holds a run's jobs frozen, and its snapshot lock, from the
// freeze of a cut to its coordinator's thaw. A view that declares the coordinator failed ends the hold at
// once (the old code waited coordHoldMax, a minute, and a rollback's stop waited with it); a view that fails
// another member does not.
func TestHoldEndsWhenCoordinatorFails(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	uid := uint32(0)
	j := ta.addJob(t, Job{ID: "farm-node1-1", UID: uid, State: JobRunning, PID: os.Getpid(),
		Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.events"), []byte("populated 1\nfrozen 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	freeze := clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: "cut-1", Phase: clusterapi.CoordFreeze}
	rep, err := ta.serveCoordinate(t.Context(), "node2", freeze)
	if err != nil || !slices.Equal(rep.Jobs, []string{j.ID}) {
		t.Fatalf("freeze from node2: %+v, %v", rep, err)
	}
	frozen := func() string {
		b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
		return string(b)
	}
	held := func() bool {
		if ta.ckptMu.TryLock() {
			ta.ckptMu.Unlock()
			return false
		}
		return true
	}
	if frozen() != "1" || !held() {
		t.Fatalf("after the freeze: cgroup.freeze %q, snapshot lock held %v; want 1, true", frozen(), held())
	}

	fail := func(name string) {
		t.Helper()
		v, err := ta.View().Fail(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ta.adoptView(v); err != nil {
			t.Fatal(err)
		}
	}
	fail("node3")
	if frozen() != "1" || !held() {
		t.Fatalf("node3 failed, not the coordinator: cgroup.freeze %q, snapshot lock held %v; want 1, true", frozen(), held())
	}

	fail("node2")
	if frozen() != "0" || held() {
		t.Fatalf("coordinator node2 failed: cgroup.freeze %q, snapshot lock held %v; want 0 (thawed), false", frozen(), held())
	}
	ta.coord.mu.Lock()
	left := len(ta.coord.m)
	ta.coord.mu.Unlock()
	if left != 0 {
		t.Errorf("%d holds left after the coordinator's failure", left)
	}
}
