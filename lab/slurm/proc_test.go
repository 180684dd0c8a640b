package slurm

import (
	"context"
	"os/exec"
	"testing"
	"time"
)

// TestStopAndIdentity: a recorded process is alive until stopped; a record whose start time does not
// match (a reused pid) is never signalled.
func TestStopAndIdentity(t *testing.T) {
	cmd := exec.Command("sleep", "300")
	p, err := StartDaemon(cmd, "sleep", "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	if !p.Alive() {
		t.Fatal("a running process is not Alive")
	}
	stranger := p
	stranger.Start++ // the same pid, started at another time: another process
	if stranger.Alive() {
		t.Fatal("a record with another start time is Alive")
	}
	if err := Stop(context.Background(), stranger, time.Second); err != nil {
		t.Fatal(err)
	}
	if !p.Alive() {
		t.Fatal("Stop of a stale record killed the process that now has its pid")
	}
	if err := StopAll(context.Background(), []Proc{p, {Name: "never started"}}, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if p.Alive() {
		t.Fatal("process alive after Stop")
	}
}
