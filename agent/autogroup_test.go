package agent

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// raiseAutogroup sets the nice value of the agent's autogroup when the agent leads its session, and
// leaves the group of a session it does not lead (a login shell's) alone.
func TestRaiseAutogroup(t *testing.T) {
	if os.Getenv("FTKIT_TEST_AUTOGROUP_CHILD") == "1" {
		// The child, in a session of its own: what an agent started by systemd or the lab does.
		err := raiseAutogroup(-5)
		b, _ := os.ReadFile("/proc/self/autogroup")
		fmt.Printf("err=%v autogroup=%s", err, b)
		return
	}
	before, err := os.ReadFile("/proc/self/autogroup")
	if err != nil {
		t.Skipf("SKIP: this kernel has no autogroup (%v): the threads' nice values are all there is to set", err)
	}
	if err := raiseAutogroup(-5); err == nil || !strings.Contains(err.Error(), "not the leader of its session") {
		t.Errorf("the test, which does not lead its session: %v, want refused", err)
	}
	if after, _ := os.ReadFile("/proc/self/autogroup"); string(after) != string(before) {
		t.Errorf("the session's autogroup changed from %q to %q", before, after)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestRaiseAutogroup$", "-test.count=1")
	cmd.Env = append(os.Environ(), "FTKIT_TEST_AUTOGROUP_CHILD=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "err=<nil> autogroup=/autogroup-") || !strings.Contains(string(out), " nice -5") {
		t.Errorf("a session leader's autogroup after raiseAutogroup(-5):\n%s\nwant nice -5 and no error", out)
	}
}
