package agent

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// raiseRecorder is the agent's raise for a test: it records what the job's cgroup.freeze said as the
// priority went up and as it came down.
type raiseRecorder struct {
	cgroup string
	held   int
	events []string
}

func (r *raiseRecorder) raise() func() {
	r.held++
	r.events = append(r.events, "raised, cgroup.freeze "+r.freeze())
	return sync.OnceFunc(func() {
		r.held--
		r.events = append(r.events, "lowered, cgroup.freeze "+r.freeze())
	})
}

func (r *raiseRecorder) freeze() string {
	b, err := os.ReadFile(filepath.Join(r.cgroup, "cgroup.freeze"))
	if err != nil {
		return "unset"
	}
	return strings.TrimSpace(string(b))
}

// frozenJob adds job, running as this process, whose (fake) cgroup reports frozen as soon as it is asked,
// and makes the agent's raise record that cgroup.
func frozenJob(t *testing.T, ta *testAgent, job Job) (*Job, *raiseRecorder) {
	t.Helper()
	job.State, job.PID = JobRunning, os.Getpid()
	j := ta.addJob(t, job)
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.events"), []byte("populated 1\nfrozen 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := &raiseRecorder{cgroup: j.Cgroup}
	ta.raise = r.raise
	return j, r
}

// The agent's work while it keeps a job frozen goes at the raised priority (checkpoint.dump_nice), not
// only CRIU's: from before the freeze until after the thaw, for a semi-coordinated snapshot and for a
// migration's stop. Both dumps fail here (the test agent has no CRIU), which thaws the job.
func TestFrozenWindowsAreRaised(t *testing.T) {
	want := []string{"raised, cgroup.freeze unset", "lowered, cgroup.freeze 0"}
	t.Run("semi-coordinated", func(t *testing.T) {
		ta := newTestAgent(t)
		j, r := frozenJob(t, ta, Job{ID: "semi-00000001"})
		if _, _, err := ta.semiCoordinated(t.Context(), []Job{*j}, false); err == nil {
			t.Fatal("a semi-coordinated snapshot without CRIU succeeded")
		}
		if !slices.Equal(r.events, want) || r.held != 0 {
			t.Errorf("priority changes %q, %d holds left; want %q, 0", r.events, r.held, want)
		}
	})
	t.Run("migration", func(t *testing.T) {
		ta := newTestAgent(t)
		j, r := frozenJob(t, ta, Job{ID: "move-00000001"})
		_, _, deleteNet, err := ta.stopForMigration(t.Context(), *j, "move-00000001-migrate-x", "node2", nil, nil, func(string, time.Time, string, error) {})
		deleteNet()
		if err == nil {
			t.Fatal("a migration without CRIU succeeded")
		}
		if !slices.Equal(r.events, want) || r.held != 0 {
			t.Errorf("priority changes %q, %d holds left; want %q, 0", r.events, r.held, want)
		}
	})
}
