package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// labFenceScript writes the lab's stand-in for an IPMI power-off at p (labcluster.WriteFenceScript), or, if
// broken, one that cannot reach the host's BMC: it records its arguments and exits 4.
//
// The power-off is wrapped: once it has confirmed, and before the agent can learn so, the wrapper looks at
// the process whose pid the test wrote to watch (if any) and appends "PID STATE" to seen, STATE being its
// network namespace or "none" once it has none (gone, a zombie, or past exit_files and exit_task_namespaces
// in do_exit: no memory, no sockets, it can send nothing). A watcher polling from the test could only say
// when it noticed the death: on a loaded machine that was 17 ms after the fence command confirmed it (the
// project's CI on 9be7691), and the check failed on a correct fence.
func labFenceScript(t *testing.T, st lab.State, p, record, watch, seen string, broken bool) {
	t.Helper()
	if broken {
		body := fmt.Sprintf("#!/bin/sh\necho \"$1 $2\" >> %s\necho \"lab BMC of $1 unreachable\" >&2\nexit 4\n", record)
		if err := os.WriteFile(p, []byte(body), 0o700); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err := labcluster.WriteFenceScript(st, p+".lab", record); err != nil {
		t.Fatal(err)
	}
	body := fmt.Sprintf(`#!/bin/sh
%[1]s.lab "$@" || exit $?
if [ -s %[2]s ]; then
	pid=$(cat %[2]s)
	echo "$pid $(readlink /proc/$pid/ns/net 2>/dev/null || echo none)" >> %[3]s
fi
`, p, watch, seen)
	if err := os.WriteFile(p, []byte(body), 0o700); err != nil {
		t.Fatal(err)
	}
}

// TestPartitionFenceCommand cuts node2's link mid-run, its processes alive, in a lab whose agents have a
// fence command. node3 (node2's protector) declares node2 failed and runs the command before the takeover.
//
// "confirms": the command powers node2 off (kills its agent and rank) and confirms. The "fenced" stage
// says so with the command's output, and it ends before fence_timeout has passed since node2's last
// heartbeat: the self-fence wait, which cannot end before fence_timeout + margin after it, was skipped.
//
// "fails": the command cannot reach the host's BMC and exits 4. The stage says so, with the command's
// output, and that the protector fell back to the self-fence wait: it ends no earlier than fence_timeout
// after the last heartbeat, node2 having fenced itself.
//
// "agent stopped, confirms": node2's link stays up and only its agent stops (a hung agent). Its host answers,
// so without a fence command node3 would not fail it over (TestHungAgentNotFailedOver); with one, it does,
// as in "confirms".
//
// In all, the old copy is dead before the fenced stage ends and so before the new copy comes up on the
// spare, every rank's checksum equals the failure-free run's, the command ran once with node2's name and
// cluster address, and `ftctl events` shows its outcome, as JSON and in the SVG timeline.
func TestPartitionFenceCommand(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	args := ringArgs(3000, 64<<10, 10*time.Millisecond)
	want := reference(t, 3, args)
	for _, tc := range []struct {
		name      string
		agentOnly bool // the agent stops; the link stays up
		broken    bool
		// Confirming: long, so that node2 cannot fence itself before the command has, and a stage ended
		// by the wait could not pass the check. Failing: short, the wait is the test's cost.
		fenceTimeout time.Duration
		detail       []string // in the fenced stage's detail
		notDetail    string
	}{
		{"confirms", false, false, 20 * time.Second, []string{"fence command confirmed the host is off", "lab host node2 is off"}, "waited until"},
		{"fails", false, true, 5 * time.Second, []string{"fence command failed (exit status 4)", "lab BMC of node2 unreachable", "waited until fence_timeout 5s"}, "confirmed"},
		{"agent stopped, confirms", true, false, 20 * time.Second, []string{"fence command confirmed the host is off", "lab host node2 is off"}, "waited until"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each row has its own lab
			partitionFenceCommand(t, args, want, tc.agentOnly, tc.broken, tc.fenceTimeout, tc.detail, tc.notDetail)
		})
	}
}

func partitionFenceCommand(t *testing.T, args []string, want string, agentOnly, broken bool, fenceTimeout time.Duration, detail []string, notDetail string) {
	dir := t.TempDir()
	record := filepath.Join(dir, "fenced")
	// The agents' configuration names the script; it is written once the lab exists (it names the lab's
	// namespaces), before any failure runs it.
	script := filepath.Join(dir, "fence")
	watch, seen := filepath.Join(dir, "watch"), filepath.Join(dir, "seen")
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", MetricsListen: metricsAddr, FenceCommand: []string{script, "{host}", "{address}"}, FenceTimeout: fenceTimeout})
	labFenceScript(t, c.Lab.State(), script, record, watch, seen, broken)
	logEventsOnFailure(t, c)
	rg := startRing(t, c, 3, 7390, args)
	rg.waitProtected(t, 2*time.Minute)
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	rg.checkpoint(t, "node2")
	rg.waitProgress(t, 50, 2*time.Minute)
	old := rg.job(t, "node2", 1)

	// The fence command, once it confirms, says whether the old copy's process can still act.
	if err := os.WriteFile(watch, []byte(strconv.Itoa(old.PID)), 0o600); err != nil {
		t.Fatal(err)
	}

	if agentOnly {
		// The fence command kills the stopped agent with the rest of the host.
		waitIdle(t, c, "node3", "node2")
		stopAgent(t, c, "node2")
	} else {
		// node2 stays cut off to the end (powered off, or fenced with its address still up): the lab's
		// teardown removes it.
		setLink(t, c, "node2", false)
	}

	f := waitRecovery(t, c, "node2", 2*time.Minute)
	requireStages(t, f)
	if f.Target != "spare1" || f.Basic {
		t.Errorf("restored on %s (basic %v), want spare1", f.Target, f.Basic)
	}
	var fence *agent.Stage
	for i, s := range f.Stages {
		if s.Name == agent.StageFenced {
			fence = &f.Stages[i]
		}
	}
	if fence == nil {
		t.Fatal("no fenced stage in the recovery timeline")
	}
	t.Logf("fenced stage on %s: %s, %s", fence.Host, fence.Duration().Round(time.Millisecond), fence.Detail)
	for _, d := range detail {
		if !strings.Contains(fence.Detail, d) {
			t.Errorf("fenced stage detail %q lacks %q", fence.Detail, d)
		}
	}
	if strings.Contains(fence.Detail, notDetail) || fence.Error != "" {
		t.Errorf("fenced stage %+v: %q in its detail, or an error", fence, notDetail)
	}
	// The self-fence wait ends at the earliest fence_timeout + margin after the last heartbeat: a stage
	// that ended before fence_timeout did not wait, one that waited ended after it.
	if f.LastBeat.IsZero() {
		t.Fatalf("the failure has no last heartbeat: %+v", f)
	}
	if waited := !fence.End.Before(f.LastBeat.Add(fenceTimeout)); waited != broken {
		t.Errorf("fenced stage ended %s after node2's last heartbeat (fence_timeout %s): waited %v, want %v",
			fence.End.Sub(f.LastBeat).Round(time.Millisecond), fenceTimeout, waited, broken)
	}
	if broken {
		st := selfFence(t, c, "node2", time.Minute)
		t.Logf("node2 fenced itself: %s", st.Detail)
		if !strings.Contains(st.Detail, old.ID) || !st.End.Before(fence.End) {
			t.Errorf("node2 fenced itself at %s (%s), the fence wait ended at %s: want job %s killed before",
				st.End.Format(time.StampMicro), st.Detail, fence.End.Format(time.StampMicro), old.ID)
		}
	}
	h2, err := c.Lab.Host("node2")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(record)
	if err != nil {
		t.Fatalf("the fence command left no record: %v", err)
	}
	if got, want := string(b), "node2 "+netip.AddrPortFrom(h2.Addr.Addr(), labcluster.AgentPort).String()+"\n"; got != want {
		t.Errorf("fence command runs: %q, want one with {host} {address} = %q", got, want)
	}
	if !broken {
		// Written by the command before it exited, so before the fenced stage ended.
		b, err := os.ReadFile(seen)
		if err != nil || string(b) != fmt.Sprintf("%d none\n", old.PID) {
			t.Errorf("when the fence command confirmed node2 off, node2's copy of rank 1 (pid %d) was in network namespace %q (%v), want none: the new copy could go live first",
				old.PID, b, err)
		}
	}
	for _, s := range f.Stages {
		if s.Name == agent.StageRestored && s.Start.Before(fence.End) {
			t.Errorf("stage %s started at %s, before the fenced stage ended at %s", s.Name, s.Start.Format(time.StampMicro), fence.End.Format(time.StampMicro))
		}
	}

	outs := []string{rg.waitExitOn(t, 0, "node1", 3*time.Minute), rg.waitExitOn(t, 1, "spare1", 3*time.Minute), rg.waitExitOn(t, 2, "node3", 3*time.Minute)}
	checkRanks(t, outs, want)

	// The operator's view: ftctl events, as JSON and drawn, from the protector: the log is replicated, and
	// asking every lab host would also ask the partitioned node2, which does not answer (exit 4).
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bins.Ftctl, "events", "--lab", c.Lab.State().ID, "--host", f.Protector, "--json", "--failure", f.ID).Output()
	if err != nil {
		t.Fatalf("ftctl events --json: %v\n%s", err, out)
	}
	var fs []agent.Failure
	if err := json.Unmarshal(out, &fs); err != nil || len(fs) != 1 {
		t.Fatalf("ftctl events --json: %v, %d failures in %s", err, len(fs), out)
	}
	found := false
	for _, s := range fs[0].Stages {
		found = found || s.Name == agent.StageFenced && s.Detail == fence.Detail
	}
	if !found {
		t.Errorf("ftctl events --json has no fenced stage with the command's outcome %q: %s", fence.Detail, out)
	}
	svgPath := filepath.Join(dir, "events.svg")
	if out, err := exec.CommandContext(ctx, bins.Ftctl, "events", "--lab", c.Lab.State().ID, "--host", f.Protector, "--failure", f.ID, "--svg", svgPath).CombinedOutput(); err != nil {
		t.Fatalf("ftctl events --svg: %v\n%s", err, out)
	}
	svg, err := os.ReadFile(svgPath)
	if err != nil {
		t.Fatal(err)
	}
	// The stage's row: its name, and under its bar the start of its detail (the command's outcome).
	if !strings.Contains(string(svg), ">"+agent.StageFenced+"</text>") || !strings.Contains(string(svg), detail[0]) {
		t.Errorf("the SVG timeline does not draw the fenced stage with %q:\n%s", detail[0], svg)
	}
}
