// Package e2e holds the agent's end-to-end tests: real agents in lab hosts, real jobs, real CRIU.
package e2e

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/labtest"
)

var bins labcluster.Binaries

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "ftkit-e2e-bin")
	if err != nil {
		panic(err)
	}
	bins, err = labcluster.Build(context.Background(), dir)
	code := 0
	if err != nil {
		println(err.Error())
		code = 1
	} else {
		code = m.Run()
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func newCluster(t *testing.T, nodes, spares int, opts labcluster.Options) *labcluster.Cluster {
	t.Helper()
	l := labtest.New(t, nodes, spares)
	opts.AgentBin = bins.Ftagent
	c, err := labcluster.Start(context.Background(), l, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, h := range l.State().Hosts {
				if b, err := os.ReadFile(c.LogPath(h.Name)); err == nil {
					t.Logf("agent log of %s:\n%s", h.Name, b)
				}
			}
		}
	})
	return c
}

// ftwrap runs ftwrap against host's agent from the root namespace (a login node, not a lab host).
func ftwrap(c *labcluster.Cluster, host string, args ...string) *exec.Cmd {
	cmd := exec.Command(bins.Ftwrap, args...)
	cmd.Env = append(os.Environ(), "FTKIT_AGENT_SOCKET="+labcluster.Socket(c.Lab.State().ID, host))
	return cmd
}

func TestFtwrapOutputAndExitStatus(t *testing.T) {
	c := newCluster(t, 2, 0, labcluster.Options{})
	cmd := ftwrap(c, "node1", "--name", "counter", "--", "sh", "-c", `for i in 1 2 3; do echo out$i; echo err$i >&2; done; exit 3`)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Fatalf("ftwrap exit: %v, want status 3; stderr:\n%s", err, stderr.String())
	}
	if stdout.String() != "out1\nout2\nout3\n" {
		t.Errorf("stdout %q", stdout.String())
	}
	if !strings.HasPrefix(stderr.String(), "err1\nerr2\nerr3\n") {
		t.Errorf("stderr %q", stderr.String())
	}
	jobs, err := c.Client("node1").Jobs(context.Background())
	if err != nil || len(jobs) != 1 || jobs[0].Spec.Name != "counter" {
		t.Fatalf("jobs: %+v, %v", jobs, err)
	}
	// ftwrap reads the exit record itself; the agent notices it within its polling period.
	j, err := c.Client("node1").Wait(context.Background(), jobs[0].ID, 5*time.Second)
	if err != nil || j.State != "exited" || j.Exit == nil || j.Exit.Code != 3 {
		t.Fatalf("job after exit: state %s exit %+v, %v", j.State, j.Exit, err)
	}
	// The job ran in its own PID namespace: the program saw itself as PID 1.
	out, err := ftwrap(c, "node1", "sh", "-c", "echo $$").Output()
	if err != nil || strings.TrimSpace(string(out)) != "1" {
		t.Errorf("job's own PID: %q, %v; want 1 (own PID namespace)", out, err)
	}
	if err := ftwrap(c, "node1", "/no/such/program").Run(); !errors.As(err, &ee) || ee.ExitCode() != 125 {
		t.Errorf("missing program: %v, want exit 125", err)
	}
}

func TestAgentRestartAdoptsJob(t *testing.T) {
	c := newCluster(t, 2, 0, labcluster.Options{})
	cmd := ftwrap(c, "node2", "sh", "-c", `i=0; while [ $i -lt 30 ]; do echo tick$i; i=$((i+1)); sleep 0.1; done`)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if err := c.KillAgent("node2"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := c.StartAgent(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	jobs, err := c.Client("node2").Jobs(context.Background())
	if err != nil || len(jobs) != 1 || jobs[0].State != "running" {
		t.Fatalf("after restart the agent has jobs %+v, %v; want the running job adopted", jobs, err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("ftwrap: %v", err)
	}
	var want strings.Builder
	for i := 0; i < 30; i++ {
		want.WriteString("tick" + strconv.Itoa(i) + "\n")
	}
	if stdout.String() != want.String() {
		t.Errorf("output across the agent restart:\n%s", stdout.String())
	}
	j, err := c.Client("node2").Wait(context.Background(), jobs[0].ID, 5*time.Second)
	if err != nil || j.State != "exited" || j.Exit.Code != 0 {
		t.Errorf("adopted job after exit: %+v, %v", j, err)
	}
}
