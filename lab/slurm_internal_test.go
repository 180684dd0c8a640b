package lab

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/lab/slurm"
)

// upOneNodeLab brings up a one-node lab in stateDir on a free subnet (no Slurm), removed at the test's end.
func upOneNodeLab(t *testing.T, stateDir string) *Lab {
	t.Helper()
	for try := 0; try < 20; try++ {
		id := fmt.Sprintf("u%06x", rand.Uint32()&0xffffff)
		subnet := RandomTestSubnet()
		l, err := Up(context.Background(), Config{ID: id, Nodes: 1, Subnet: subnet}, Options{StateDir: stateDir})
		if errors.Is(err, ErrExists) || errors.Is(err, ErrSubnetInUse) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := l.Down(context.Background()); err != nil {
				t.Errorf("lab down: %v", err)
			}
		})
		return l
	}
	t.Fatal("no free lab id and subnet")
	return nil
}

// fakeDaemon starts a sleep standing in for a Slurm daemon (in host's namespace, or the root namespace).
func fakeDaemon(t *testing.T, l *Lab, name, host string) slurm.Proc {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var p slurm.Proc
	start := func() (err error) { p, err = slurm.StartDaemon(cmd, name, host); return err }
	var err error
	if host == "" {
		err = start()
	} else {
		err = l.Do(host, start)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	return p
}

// TestDownStopsRecordedSlurm: a later `lab down` (a fresh Open, as after a crashed test or ftctl) stops
// the daemons recorded in the state, munged in the root namespace included, and removes the Slurm
// directory; a munged still needed by another lab with Slurm is handed over, not stopped.
func TestDownStopsRecordedSlurm(t *testing.T) {
	testenv.RequireKernel(t, "network namespaces")
	stateDir := t.TempDir()
	a, b := upOneNodeLab(t, stateDir), upOneNodeLab(t, stateDir)
	munged := fakeDaemon(t, a, "munged", "")
	slurmd := fakeDaemon(t, a, "slurmd", "node1")
	dirA, dirB := t.TempDir()+"/a.slurm", t.TempDir()+"/b.slurm"
	for _, d := range []string{dirA, dirB} {
		if err := os.MkdirAll(d+"/spool/node1", 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.update(func(st *State) {
		st.Slurm = &SlurmState{Dir: dirA, Munged: &munged, Daemons: []slurm.Proc{slurmd}}
	}); err != nil {
		t.Fatal(err)
	}
	if err := b.update(func(st *State) { st.Slurm = &SlurmState{Dir: dirB} }); err != nil {
		t.Fatal(err)
	}

	again, err := Open(a.State().ID, Options{StateDir: stateDir})
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Down(context.Background()); err != nil {
		t.Fatal(err)
	}
	if slurmd.Alive() {
		t.Error("the recorded slurmd survives down")
	}
	if _, err := os.Stat(dirA); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Slurm directory left behind: %v", err)
	}
	if !munged.Alive() {
		t.Fatal("munged stopped although lab b still runs Slurm")
	}
	bAgain, err := Open(b.State().ID, Options{StateDir: stateDir})
	if err != nil {
		t.Fatal(err)
	}
	if m := bAgain.State().Slurm.Munged; m == nil || *m != munged {
		t.Fatalf("lab b did not inherit munged: %+v", bAgain.State().Slurm)
	}
	if err := bAgain.Down(context.Background()); err != nil {
		t.Fatal(err)
	}
	if munged.Alive() {
		t.Error("munged survives the down of the last lab with Slurm")
	}
}

// TestCrashForgetsSlurmDaemons: a crash kills the host's daemons and its slurmd spool, and records them
// as dead so that revive restarts them.
func TestCrashForgetsSlurmDaemons(t *testing.T) {
	testenv.RequireKernel(t, "network namespaces")
	l := upOneNodeLab(t, t.TempDir())
	slurmd := fakeDaemon(t, l, "slurmd", "node1")
	dir := t.TempDir()
	if err := os.MkdirAll(slurm.SpoolDir(dir, "node1"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := l.update(func(st *State) { st.Slurm = &SlurmState{Dir: dir, Daemons: []slurm.Proc{slurmd}} }); err != nil {
		t.Fatal(err)
	}
	if err := l.Crash(context.Background(), "node1"); err != nil {
		t.Fatal(err)
	}
	if slurmd.Alive() {
		t.Error("slurmd survives the crash of its host")
	}
	if d := l.State().Slurm.Daemons[0]; d.PID != 0 || d.Name != "slurmd" || d.Host != "node1" {
		t.Errorf("crashed host's slurmd recorded as %+v, want pid 0", d)
	}
	if _, err := os.Stat(slurm.SpoolDir(dir, "node1")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("crashed host's spool left behind: %v", err)
	}
}
