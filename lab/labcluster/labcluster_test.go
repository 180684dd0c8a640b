package labcluster_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/labtest"
)

// TestClusterRevive: a revived host runs its agent again, inside its own namespace, and it answers.
func TestClusterRevive(t *testing.T) {
	l := labtest.New(t, 2, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a failure bound only
	defer cancel()
	bin := filepath.Join(t.TempDir(), "ftagent")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/ftkit/ftkit/cmd/ftagent").CombinedOutput(); err != nil {
		t.Fatalf("go build ftagent: %v\n%s", err, out)
	}
	id := l.State().ID
	kernelDirs := []string{labcluster.CgroupDir(id), labcluster.PinDir(id)}
	var absent []string // what Start may create, Down must remove: the lab's cgroup and pins, and any parent
	for _, d := range kernelDirs {
		for ; d != "/"; d = filepath.Dir(d) {
			if _, err := os.Lstat(d); errors.Is(err, fs.ErrNotExist) {
				absent = append(absent, d)
			}
		}
	}
	// Manual fail-over: an automatic one would move node2's address to the spare, and revive refuses
	// a host whose address another holds.
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: bin, ManualFailover: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range kernelDirs {
		if _, err := os.Stat(d); err != nil {
			t.Fatalf("the lab's agents run without their directory %s: %v", d, err)
		}
	}
	if err := l.Crash(ctx, "node2"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client("node2").Status(ctx); err == nil {
		t.Fatal("node2's agent answers after the crash")
	}
	if err := c.Revive(ctx, "node2"); err != nil {
		if b, rerr := os.ReadFile(c.LogPath("node2")); rerr == nil {
			t.Logf("agent log of node2:\n%s", b)
		}
		t.Fatal(err)
	}
	if _, err := c.Client("node2").Status(ctx); err != nil {
		t.Fatalf("revived node2's agent does not answer: %v", err)
	}
	p, _ := l.NetnsPath("node2")
	if pids, err := lab.PIDsInNetns(p); err != nil || len(pids) == 0 {
		t.Fatalf("no process in revived node2's namespace (%v, %v): the agent runs elsewhere", pids, err)
	}
	if err := l.Down(ctx); err != nil {
		t.Fatal(err)
	}
	for _, d := range absent {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s, which the lab created, is still there after Down (%v)", d, err)
		}
	}
}
