package slurm

import (
	"context"
	"os/exec"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	rest := " S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 4242 20 21\n"
	for _, tc := range []struct {
		name      string
		line      string
		state     byte
		start     uint64
		wantError bool
	}{
		{"plain", "123 (slurmd)" + rest, 'S', 4242, false},
		{"name with blanks and parens", "123 (a) b (c)" + rest, 'S', 4242, false},
		{"zombie", "123 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 7 20\n", 'Z', 7, false},
		{"no name", "123 slurmd S 1", 0, 0, true},
		{"truncated", "123 (x) S 1 2 3", 0, 0, true},
		{"bad start", "123 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -1 20\n", 0, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			state, start, err := parseStat(tc.line)
			if tc.wantError {
				if err == nil {
					t.Fatalf("parseStat(%q) = %c %d, want an error", tc.line, state, start)
				}
				return
			}
			if err != nil || state != tc.state || start != tc.start {
				t.Fatalf("parseStat(%q) = %c %d %v, want %c %d", tc.line, state, start, err, tc.state, tc.start)
			}
		})
	}
}

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
