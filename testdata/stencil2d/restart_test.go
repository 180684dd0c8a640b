package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/testenv"
)

// The test binary doubles as the program: with STENCIL2D_MAIN=1 it runs main, so the restart test kills
// and restarts real processes without a separate go build.
func TestMain(m *testing.M) {
	if os.Getenv("STENCIL2D_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// rankProc is a rank run as a child process; out may be read while it runs.
type rankProc struct {
	cmd  *exec.Cmd
	out  *testenv.SyncBuffer
	done chan error // its Wait's result, put back by every reader (wait)
}

// wait waits for the rank to end and returns how it ended.
func (p *rankProc) wait() error {
	err := <-p.done
	p.done <- err
	return err
}

func freePorts(t *testing.T, n int) []string {
	t.Helper()
	var addrs []string
	var lns []net.Listener
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		addrs = append(addrs, ln.Addr().String())
	}
	for _, ln := range lns {
		ln.Close()
	}
	return addrs
}

func startRanks(t *testing.T, addrs []string, args ...string) []*rankProc {
	t.Helper()
	var ps []*rankProc
	for r := range addrs {
		cmd := exec.Command(os.Args[0], append([]string{"--rank", fmt.Sprint(r), "--peers", strings.Join(addrs, ",")}, args...)...)
		cmd.Env = append(os.Environ(), "STENCIL2D_MAIN=1")
		p := &rankProc{cmd: cmd, out: &testenv.SyncBuffer{}, done: make(chan error, 1)}
		cmd.Stdout, cmd.Stderr = p.out, p.out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { p.done <- cmd.Wait() }()
		t.Cleanup(func() { cmd.Process.Kill(); p.wait() })
		ps = append(ps, p)
	}
	return ps
}

// checksums waits for every rank and returns the checksum they agree on.
func checksums(t *testing.T, ps []*rankProc) string {
	t.Helper()
	var sum string
	for r, p := range ps {
		if err := p.wait(); err != nil {
			t.Fatalf("rank %d: %v\n%s", r, err, p.out)
		}
		var got string
		for _, line := range strings.Split(p.out.String(), "\n") {
			if f := strings.Fields(line); len(f) == 4 && f[2] == "checksum" {
				got = f[3]
			}
		}
		if got == "" || (sum != "" && got != sum) {
			t.Fatalf("rank %d checksum %q, rank 0 %q\n%s", r, got, sum, p.out)
		}
		sum = got
	}
	return sum
}

// completedCheckpoint is the newest iteration for which every rank has a file in dir (0: none yet).
func completedCheckpoint(t *testing.T, dir string, ranks int) uint64 {
	t.Helper()
	var per [][]uint64
	for r := range ranks {
		its, err := listCheckpoints(dir, r)
		if err != nil {
			t.Fatal(err)
		}
		per = append(per, its)
	}
	return commonIteration(per)
}

func resumedFrom(t *testing.T, out string) int {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) >= 6 && f[2] == "resumed" {
			it, err := strconv.Atoi(f[5])
			if err != nil {
				t.Fatal(err)
			}
			return it
		}
	}
	t.Fatalf("no resumed line in %q", out)
	return -1
}

// TestKilledAndRestartedMatchesPlain: a run killed mid-way (every rank SIGKILLed) and restarted with
// --restart ends with the checksum of an uninterrupted run without checkpointing; with rank 0's newest
// checkpoint corrupted, the ranks fall back to an older recovery line and still agree.
func TestKilledAndRestartedMatchesPlain(t *testing.T) {
	const ranks, iters, every = 3, 400, 25
	grid := []string{"--grid", "96", "--iters", fmt.Sprint(iters)}
	want := checksums(t, startRanks(t, freePorts(t, ranks), grid...))

	tests := []struct {
		name    string
		corrupt bool
	}{
		{"clean checkpoints", false},
		{"newest checkpoint of rank 0 corrupted", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			ck := append(append([]string(nil), grid...), "--ckpt-dir", dir, "--ckpt-every", fmt.Sprint(every))
			ps := startRanks(t, freePorts(t, ranks), append(ck, "--delay", "3ms")...)
			deadline := time.Now().Add(30 * time.Second)
			for completedCheckpoint(t, dir, ranks) < 4*every {
				if time.Now().After(deadline) {
					t.Fatalf("no checkpoint of iteration %d by every rank within 30s; rank 0: %s", 4*every, ps[0].out)
				}
				time.Sleep(20 * time.Millisecond)
			}
			for _, p := range ps {
				p.cmd.Process.Kill()
				p.wait()
			}
			line := completedCheckpoint(t, dir, ranks)
			if line >= iters {
				t.Fatalf("the ranks finished before they were killed (checkpoint %d)", line)
			}
			newest := line
			if tt.corrupt {
				its, _ := listCheckpoints(dir, 0)
				p := filepath.Join(dir, ckptName(0, its[0]))
				b, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				b[len(b)/2] ^= 0xff
				if err := os.WriteFile(p, b, 0o644); err != nil {
					t.Fatal(err)
				}
				newest = its[0]
			}
			rs := startRanks(t, freePorts(t, ranks), append(ck, "--restart")...)
			if got := checksums(t, rs); got != want {
				t.Fatalf("restarted run checksum %s, uninterrupted run %s", got, want)
			}
			from := resumedFrom(t, rs[0].out.String())
			for r, p := range rs {
				if f := resumedFrom(t, p.out.String()); f != from {
					t.Fatalf("rank %d resumed from %d, rank 0 from %d", r, f, from)
				}
			}
			switch {
			case !tt.corrupt && uint64(from) != line:
				t.Fatalf("resumed from iteration %d, want the common checkpoint %d", from, line)
			case tt.corrupt && (uint64(from) >= newest || !strings.Contains(rs[0].out.String(), "ignoring checkpoint")):
				t.Fatalf("resumed from %d despite rank 0's corrupt checkpoint of %d:\n%s", from, newest, rs[0].out)
			}
			t.Logf("resumed from iteration %d of %d (newest written %d)", from, iters, newest)
		})
	}
}

// --end-after holds every rank after its last iteration, its checksum not printed, until the file exists;
// then the run ends with the checksum of a run without it.
func TestEndAfterHoldsTheEnd(t *testing.T) {
	const iters = 20
	args := []string{"--grid", "32", "--iters", fmt.Sprint(iters)}
	plain := checksums(t, startRanks(t, freePorts(t, 2), args...))

	file := filepath.Join(t.TempDir(), "go")
	ps := startRanks(t, freePorts(t, 2), append(args, "--report-at", fmt.Sprint(iters), "--end-after", file)...)
	for r, p := range ps {
		for !strings.Contains(p.out.String(), fmt.Sprintf("reached iteration %d", iters)) {
			select {
			case err := <-p.done:
				p.done <- err // for the cleanup
				t.Fatalf("rank %d ended (%v) before its last iteration: %s", r, err, p.out)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	for r, p := range ps {
		if strings.Contains(p.out.String(), "checksum") {
			t.Fatalf("rank %d ended before the file existed: %s", r, p.out)
		}
	}
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := checksums(t, ps); got != plain {
		t.Errorf("checksum %s after the hold, %s without it", got, plain)
	}
}
