package agent

import (
	"os"
	"os/exec"
	"testing"
)

// TestAllEnded: re-protection is skipped only when every restored job has really ended: a job whose record
// says running and whose process lives is waited for (briefly) and then counts as running.
func TestAllEnded(t *testing.T) {
	a := resumeTestAgent(t)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	a.byID["ended"] = &Job{ID: "ended", State: JobExited, PID: os.Getpid()}
	a.byID["gone"] = &Job{ID: "gone", State: JobRunning, PID: gone.Process.Pid} // exited, not yet noticed
	a.byID["alive"] = &Job{ID: "alive", State: JobRunning, PID: os.Getpid()}
	tests := []struct {
		ids  []string
		want bool
	}{
		{[]string{"ended"}, true},
		{[]string{"gone", "ended"}, true},
		{[]string{"unknown"}, true},
		{[]string{"ended", "alive"}, false},
	}
	for _, tt := range tests {
		if got := a.allEnded(tt.ids); got != tt.want {
			t.Errorf("allEnded(%v) = %v, want %v", tt.ids, got, tt.want)
		}
	}
}
