package agent

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// rejoinViews are views of node1..node3 (nodes) and s1 (spare) seen by the test agent (node1): as
// configured, after node2 failed and s1 took its place (its jobs had job addresses), and after node2
// rejoined.
func rejoinViews(t *testing.T) (base, failed, rejoined ring.View) {
	t.Helper()
	m := func(name, addr string, role ring.Role) ring.Member {
		return ring.Member{Name: name, Address: netip.MustParseAddrPort(addr), Role: role}
	}
	base, err := ring.New([]ring.Member{m("node1", "127.0.0.1:1", ring.RoleNode), m("node2", "127.0.0.2:1", ring.RoleNode),
		m("node3", "127.0.0.3:1", ring.RoleNode), m("s1", "127.0.0.11:1", ring.RoleSpare)})
	if err != nil {
		t.Fatal(err)
	}
	if failed, err = base.ReplaceKeepingAddrs("node2", "s1"); err != nil {
		t.Fatal(err)
	}
	if rejoined, err = failed.Rejoin("node2", 0); err != nil {
		t.Fatal(err)
	}
	return base, failed, rejoined
}

// TestServeRejoin: a member is admitted back only by an alive node, only if its view lists it as failed as
// the incarnation it says, once the recovery of its jobs is over and only if it answers as idle; a retried
// request after it was admitted gets the view, not a second incarnation.
func TestServeRejoin(t *testing.T) {
	base, failed, rejoined := rejoinViews(t)
	selfFailed, err := base.ReplaceKeepingAddrs("node1", "s1")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		view     ring.View
		peer     string
		inc      uint64
		underWay bool   // a recovery of node2's jobs is not over
		err      string // "" for admitted
	}{
		{"this host is not an alive node", selfFailed, "node2", 0, false, "only an alive node of the ring admits"},
		{"not a member", failed, "node9", 0, false, "not a member"},
		{"alive member", base, "node2", 0, false, "lists it alive as incarnation 0"},
		{"another incarnation", failed, "node2", 3, false, "not failed as incarnation 3"},
		{"its recovery is under way", failed, "node2", 0, true, "is not over"},
		{"it does not answer", failed, "node2", 0, false, "does not answer a ping"},
		{"admitted already: a retried request", rejoined, "node2", 0, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.members.view = tc.view
			if tc.underWay {
				ta.failures.Update("node2-1", func(f *Failure) { f.Node, f.Detected = "node2", time.Now() })
			}
			got, err := ta.serveRejoin(t.Context(), tc.peer, clusterapi.RejoinRequest{Incarnation: tc.inc})
			if tc.err == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				v, err := ring.Decode(got.View)
				if err != nil || v.Epoch != tc.view.Epoch {
					t.Fatalf("answer: view %d (%v), want the current one, %d", v.Epoch, err, tc.view.Epoch)
				}
				return
			}
			if e := clusterapi.Refusal(err); e == nil || e.Code != clusterapi.CodeRefused || !strings.Contains(e.Message, tc.err) {
				t.Fatalf("err %v, want a refusal containing %q", err, tc.err)
			}
			if ta.View().Epoch != tc.view.Epoch {
				t.Errorf("the view changed to epoch %d on a refusal", ta.View().Epoch)
			}
		})
	}
}

// failedHere is a test agent (node1) whose view lists it as failed (s1 took its place), its member in that
// view, and the copy of rootsJob it still runs (a cut-off host that did not fence itself): a real process in
// a real cgroup (jobProcess).
func failedHere(t *testing.T) (*testAgent, ring.Member, *os.Process) {
	t.Helper()
	ta := newTestAgent(t)
	base, _, _ := rejoinViews(t)
	v, err := base.ReplaceKeepingAddrs("node1", "s1")
	if err != nil {
		t.Fatal(err)
	}
	ta.members.view = v
	cg, child := jobProcess(t)
	ta.byID[rootsJob].PID, ta.byID[rootsJob].Cgroup = child.Pid, cg
	self, _ := v.Member("node1")
	return ta, self, child
}

// TestDropFailedJobs: an agent whose view lists it as failed ends the jobs it still has as running: its
// copy still running is killed (the job's root process: its PID namespace), every record says lost (its
// job address stays held), none is left running, and a job that had ended stays as it was.
func TestDropFailedJobs(t *testing.T) {
	// ownersJob's record names this test's own process, which is in no job cgroup: not killed.
	ta, self, child := failedHere(t)
	if left := ta.dropFailedJobs(self); left != 0 {
		t.Fatalf("%d jobs left running", left)
	}
	waited := make(chan error, 1)
	go func() { _, err := child.Wait(); waited <- err }()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		t.Fatal("the running copy was not killed")
	}
	for _, id := range []string{ownersJob, rootsJob} {
		j, _, err := ta.Job(id, 0)
		if err != nil || j.State != JobLost {
			t.Errorf("job %s: state %q (%v), want lost", id, j.State, err)
		}
		var saved Job
		b, _ := os.ReadFile(filepath.Join(ta.jobs.dir, id+".json"))
		if json.Unmarshal(b, &saved); saved.State != JobLost || !saved.Fenced {
			t.Errorf("job %s's record on disk says %q (fenced %v), want lost and fenced: it goes on elsewhere, and ftwrap follows it there",
				id, saved.State, saved.Fenced)
		}
	}
	// The copy that ran was marked superseded before its kill: its shim records no end of the job.
	if _, err := os.Lstat(ta.supersededMark(rootsJob, 0)); err != nil {
		t.Errorf("the running copy was not marked superseded before it was killed: %v", err)
	}
	if j, _, _ := ta.Job(doneJob, 0); j.State != JobExited || j.Fenced {
		t.Errorf("a job that had ended changed: %q (fenced %v)", j.State, j.Fenced)
	}
}

// TestDropFailedJobsWithdrawsFirst: a host that learns it was declared failed reaches its peers again, so
// every job address of its failed incarnation leaves the wire before any copy is killed (as a self-fence
// does): a killed copy's sockets would otherwise send their FIN or reset to peers whose connections the
// restored copies go on with. The old code killed first and took the addresses away with the records' end.
// The withdrawal is seen through a job whose record names a network not this agent's (no namespace is made
// here): withdrawing it logs that it is left alone.
func TestDropFailedJobsWithdrawsFirst(t *testing.T) {
	ta, self, _ := failedHere(t)
	const netJob = "srv-00000001" // listed after rootsJob (created later)
	ta.addJob(t, Job{ID: netJob, State: JobRunning, Net: &JobNet{Name: "ftj-other", Kind: jobnet.MACVlan, Addr: netip.MustParsePrefix("127.0.0.200/8")}})
	var mu sync.Mutex
	seen, killedBefore := false, false
	ta.log = slog.New(hookHandler{func(r slog.Record) {
		mu.Lock()
		defer mu.Unlock()
		if seen || !strings.Contains(r.Message, "not this agent's for the job") {
			return
		}
		seen = true
		_, err := os.Lstat(ta.supersededMark(rootsJob, 0))
		killedBefore = err == nil
	}})
	if left := ta.dropFailedJobs(self); left != 0 {
		t.Fatalf("%d jobs left running", left)
	}
	mu.Lock()
	defer mu.Unlock()
	if !seen {
		t.Fatal("the job network of the failed incarnation's job was never taken off the wire")
	}
	if killedBefore {
		t.Error("a copy was killed before every job address of the failed incarnation was off the wire")
	}
}

// jobProcess starts a process in a cgroup v2 directory of its own, both removed at the end of the test
// (skipped without root or a cgroup v2 hierarchy).
func jobProcess(t *testing.T) (string, *os.Process) {
	t.Helper()
	return jobProcessOf(t, "/bin/sleep", "sleep", "600")
}

// jobProcessOf is jobProcess for the program at path with argv.
func jobProcessOf(t *testing.T, path string, argv ...string) (string, *os.Process) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root to create a cgroup")
	}
	var root string
	for _, r := range []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup"} {
		if _, err := os.Stat(filepath.Join(r, "cgroup.controllers")); err == nil {
			root = r
			break
		}
	}
	if root == "" {
		t.Skip("SKIP: no cgroup v2 hierarchy")
	}
	cg, err := os.MkdirTemp(root, "ftkit-rejoin-test-")
	if err != nil {
		t.Fatal(err)
	}
	p, err := os.StartProcess(path, argv, &os.ProcAttr{})
	if err != nil {
		os.Remove(cg)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Kill()
		p.Wait()
		for deadline := time.Now().Add(10 * time.Second); os.Remove(cg) != nil && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		}
	})
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(fmt.Sprint(p.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	return cg, p
}

// TestOwnCopyRuns: a job runs here only if its root process is alive, in its cgroup, and in this host's
// network namespace.
func TestOwnCopyRuns(t *testing.T) {
	ta := newTestAgent(t)
	cg, child := jobProcess(t)
	hp, err := cgroupv2.HierarchyPath(cg)
	if err != nil {
		t.Fatal(err)
	}
	cgUnnamed, unnamed := jobProcessOf(t, "/usr/bin/unshare", "unshare", "--net", "sleep", "600")
	for deadline := time.Now().Add(failAfter); ; time.Sleep(5 * time.Millisecond) {
		a, _ := os.Readlink("/proc/self/ns/net")
		if b, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", unnamed.Pid)); b != "" && b != a {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("unshare made no network namespace")
		}
	}
	// The same path in another tree ends like the job's (a lab host's neighbour restored the job there).
	elsewhere := filepath.Join(strings.TrimSuffix(cg, hp), "elsewhere", hp)
	for _, tc := range []struct {
		name string
		j    Job
		want bool
	}{
		{"this host's copy", Job{ID: rootsJob, PID: child.Pid, Cgroup: cg}, true},
		{"no pid", Job{ID: rootsJob, Cgroup: cg}, false},
		{"the process in a cgroup of the same name in another tree", Job{ID: rootsJob, PID: child.Pid, Cgroup: elsewhere}, false},
		{"a process in another cgroup (a reused pid)", Job{ID: rootsJob, PID: os.Getpid(), Cgroup: cg}, false},
		{"the process in another host's job network", Job{ID: rootsJob, PID: child.Pid, Cgroup: cg, Net: &JobNet{Name: "x"}}, false},
		{"a pid that does not exist", Job{ID: rootsJob, PID: 1 << 30, Cgroup: cg}, false},
		// Its network's name removed (`ip netns del`), the network held by the job's processes.
		{"this host's copy in its network, whose name is gone", Job{ID: rootsJob, PID: unnamed.Pid, Cgroup: cgUnnamed, Net: &JobNet{Name: jobNetName("node1", rootsJob)}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := ta.ownCopyRuns(tc.j); got != tc.want {
				t.Fatalf("ownCopyRuns = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestSettleGone: a record left running whose processes are gone is never adopted: it ended with its exit
// record if this host's shim wrote one for this copy (not for an older copy of the job here), else it is lost.
func TestSettleGone(t *testing.T) {
	for _, tc := range []struct {
		name string
		exit *shim.ExitStatus
		want JobState
	}{
		{"no exit record", nil, JobLost},
		{"an exit record of this host", &shim.ExitStatus{Code: 3, Node: "node1"}, JobExited},
		{"an exit record of another host's copy", &shim.ExitStatus{Code: 0, Node: "s1"}, JobLost},
		{"this copy's exit record", &shim.ExitStatus{Code: 3, Node: "node1", Incarnation: new(uint64(2))}, JobExited},
		{"an exit record of an older copy of this host", &shim.ExitStatus{Code: 137, Node: "node1", Incarnation: new(uint64(1))}, JobLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			j := ta.byID[rootsJob]
			j.Incarnation = 2
			if tc.exit != nil {
				b, _ := json.Marshal(tc.exit)
				if err := os.MkdirAll(filepath.Dir(j.ExitPath()), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(j.ExitPath(), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			ta.settleGone(j)
			if got, _, _ := ta.Job(rootsJob, 0); got.State != tc.want {
				t.Fatalf("state %q, want %q", got.State, tc.want)
			}
		})
	}
}

// TestPeerViewEpochBounded: a view a member pushes is refused if its epoch is at the top of the range, after
// which no membership change could be made again on any agent it reached, or far ahead of this host's.
// Before, any higher epoch was adopted and saved.
func TestPeerViewEpochBounded(t *testing.T) {
	for _, tc := range []struct {
		name  string
		epoch func(cur uint64) uint64
		want  bool // adopted
	}{
		{"the next view", func(cur uint64) uint64 { return cur + 1 }, true},
		{"at the top of the range", func(uint64) uint64 { return math.MaxUint64 }, false},
		{"far ahead", func(cur uint64) uint64 { return cur + maxEpochJump + 1 }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.members.view = testView(t, "node1", "node2", "node3")
			cur := ta.View()
			v, err := cur.Fail("node2")
			if err != nil {
				t.Fatal(err)
			}
			v.Epoch = tc.epoch(cur.Epoch)
			b, err := ring.Encode(v)
			if err != nil {
				t.Fatal(err)
			}
			ta.serveView("node3", viewMessage{View: b})
			if got := ta.View().Epoch == v.Epoch; got != tc.want {
				t.Errorf("view %d pushed at epoch %d: adopted %v, want %v", v.Epoch, cur.Epoch, got, tc.want)
			}
			if _, err := ta.View().AddSpare(ring.Member{Name: "spare9", Address: netip.MustParseAddrPort("127.0.0.19:1"), Role: ring.RoleSpare}); err != nil {
				t.Errorf("a membership change after it: %v", err)
			}
		})
	}
}
