package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/slurm"
)

// longMeltInput is meltInput run for 9000 steps with thermodynamic output every 1500 (the same 7 rows):
// long enough to snapshot every host and crash one mid-run under load.
func longMeltInput(t *testing.T) []byte {
	t.Helper()
	s := strings.Replace(string(meltInput(t)), "run 3000", "run 9000", 1)
	s = strings.Replace(s, "thermo 500", "thermo 1500", 1)
	return []byte(s)
}

// newSlurmCluster is a lab of nodes and spares running Slurm (a slurmd in every host) and an agent in
// every host, removed when the test ends.
func newSlurmCluster(t *testing.T, nodes, spares int, opts labcluster.Options) *labcluster.Cluster {
	t.Helper()
	if missing := slurm.Missing(); len(missing) > 0 {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s not installed and CI is set: run scripts/setup.sh packages", strings.Join(missing, ", "))
		}
		t.Skipf("SKIPPED LOUDLY: %s not installed (scripts/setup.sh packages)", strings.Join(missing, ", "))
	}
	var l *lab.Lab
	for try := 0; try < 20 && l == nil; try++ {
		id := fmt.Sprintf("t%06x", rand.Uint32()&0xffffff)
		subnet := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(210 + rand.IntN(40)), byte(rand.IntN(256)), 0}), 24)
		var err error
		l, err = lab.Up(context.Background(), lab.Config{ID: id, Nodes: nodes, Spares: spares, Subnet: subnet, Slurm: true}, lab.Options{})
		if errors.Is(err, lab.ErrSubnetInUse) || errors.Is(err, lab.ErrExists) {
			continue
		}
		if err != nil {
			t.Fatalf("lab up --slurm: %v", err)
		}
		t.Cleanup(func() {
			if err := l.Down(context.Background()); err != nil {
				t.Errorf("lab down: %v", err)
			}
		})
	}
	if l == nil {
		t.Fatal("no free lab id and subnet after 20 tries")
	}
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
			if st := l.State(); st.Slurm != nil {
				b, _ := os.ReadFile(filepath.Join(slurm.LogDir(st.Slurm.Dir), "slurmctld.log"))
				t.Logf("slurmctld log:\n%s", tail(string(b)))
			}
		}
	})
	return c
}

// labExec runs argv inside a lab host, as `ftctl lab exec` does (SLURM_CONF and the host's agent socket
// set unless env sets them).
func labExec(ctx context.Context, c *labcluster.Cluster, host, dir string, env []string, argv ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, bins.Ftctl, append([]string{"lab", "--lab", c.Lab.State().ID, "exec", host, "--"}, argv...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	return cmd
}

// jobOn waits until host's agent runs a job of that name and returns it.
func jobOn(t *testing.T, c *labcluster.Cluster, host, name string, timeout time.Duration, ok func(agent.Job) bool) agent.Job {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		jobs, err := c.Client(host).Jobs(context.Background())
		for _, j := range jobs {
			if j.Spec.Name == name && ok(j) {
				return j
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no job %s on %s within %s (%v): %+v", name, host, timeout, err, jobs)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// slurmJob is `scontrol show job ID`'s fields.
func slurmJob(ctx context.Context, c *labcluster.Cluster, id string) (map[string]string, error) {
	out, err := labExec(ctx, c, "node1", "/", nil, "scontrol", "show", "job", id).Output()
	if err != nil {
		return nil, fmt.Errorf("scontrol show job %s: %w %s", id, err, out)
	}
	kv := map[string]string{}
	for _, f := range strings.Fields(string(out)) {
		if k, v, ok := strings.Cut(f, "="); ok {
			kv[k] = v
		}
	}
	return kv, nil
}

// waitSlurmJob waits until Slurm's job ends (not pending, running or completing) and returns its fields.
func waitSlurmJob(t *testing.T, ctx context.Context, c *labcluster.Cluster, id string, timeout time.Duration) map[string]string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		kv, err := slurmJob(ctx, c, id)
		if err == nil {
			switch kv["JobState"] {
			case "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "":
			default:
				return kv
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("Slurm job %s did not end within %s: %v %v", id, timeout, kv, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// TestMPISlurmFailover: a Slurm batch job (sbatch --nodes=4 --no-kill) runs LAMMPS under `ftctl mpirun
// --spares 1`, which takes its hosts from the allocation: ranks on node1..node3, spare1 the run's spare.
// Every rank's job is snapshotted to its protector, then node2 loses power. The job's output is the same
// as a failure-free batch job's, Slurm records both as COMPLETED with exit code 0:0, node2's job was
// restored on spare1 (the allocation's spare), and node1's and node3's jobs were never touched. The
// batch script reaches its host's agent through the lab's TaskProlog, not through an inherited socket.
func TestMPISlurmFailover(t *testing.T) {
	requirePrograms(t, "mpirun.openmpi", "lmp")
	in := longMeltInput(t)
	c := newSlurmCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute) // a failure bound only
	defer cancel()

	submit := func(name string) (id, dir string) {
		t.Helper()
		dir = t.TempDir()
		os.Chmod(dir, 0o755)
		if err := os.WriteFile(filepath.Join(dir, "in.melt"), in, 0o644); err != nil {
			t.Fatal(err)
		}
		script := fmt.Sprintf("#!/bin/sh\necho \"agent socket: $FTKIT_AGENT_SOCKET\" >&2\nexec '%s' mpirun --spares 1 --name %s -- lmp -in in.melt\n", bins.Ftctl, name)
		if err := os.WriteFile(filepath.Join(dir, "job.sh"), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		// A socket that is not there: the batch script must get its host's from the TaskProlog.
		out, err := labExec(ctx, c, "node1", dir, []string{"FTKIT_AGENT_SOCKET=/nonexistent/agent.sock"},
			"sbatch", "--parsable", "--nodes=4", "--no-kill", "--chdir="+dir,
			"--output="+filepath.Join(dir, "out"), "--error="+filepath.Join(dir, "err"), filepath.Join(dir, "job.sh")).CombinedOutput()
		if err != nil {
			t.Fatalf("sbatch: %v\n%s", err, out)
		}
		id, _, _ = strings.Cut(strings.TrimSpace(string(out)), ";")
		return id, dir
	}
	result := func(id, dir string) (string, map[string]string) {
		t.Helper()
		kv := waitSlurmJob(t, ctx, c, id, 5*time.Minute)
		stdout, _ := os.ReadFile(filepath.Join(dir, "out"))
		stderr, _ := os.ReadFile(filepath.Join(dir, "err"))
		if kv["JobState"] != "COMPLETED" || kv["ExitCode"] != "0:0" {
			t.Fatalf("Slurm job %s: JobState=%s ExitCode=%s; want COMPLETED 0:0\nstdout:\n%s\nstderr:\n%s", id, kv["JobState"], kv["ExitCode"], tail(string(stdout)), tail(string(stderr)))
		}
		return thermo(t, string(stdout)), kv
	}

	start := time.Now()
	refID, refDir := submit("ref")
	want, _ := result(refID, refDir)
	t.Logf("failure-free batch job: %s", time.Since(start).Round(time.Millisecond))
	if b, _ := os.ReadFile(filepath.Join(refDir, "err")); !strings.Contains(string(b), "agent socket: "+labcluster.Socket(c.Lab.State().ID, "node1")) {
		t.Errorf("the batch script did not get node1's agent socket from the TaskProlog:\n%s", tail(string(b)))
	}

	start = time.Now()
	id, dir := submit("ft")
	placement := &agent.Placement{Hosts: []string{"node1", "node2", "node3"}, Spares: []string{"spare1"}}
	before := map[string]agent.Job{}
	for _, h := range []string{"node1", "node2", "node3"} {
		j := jobOn(t, c, h, "ft-"+h, 2*time.Minute, func(j agent.Job) bool { return j.State == agent.JobRunning })
		if !reflect.DeepEqual(j.Spec.Placement, placement) {
			t.Errorf("job %s's placement %+v; want the allocation's %+v", j.ID, j.Spec.Placement, placement)
		}
		before[h] = j
	}
	// The ranks compute (LAMMPS printed its first thermo row: every MPI connection is up, none waits in a
	// listen queue, where CRIU cannot dump it) and every job has its first replica, taken as it started.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		b, _ := os.ReadFile(filepath.Join(dir, "out"))
		if len(thermoTable(string(b))) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no thermo row from the batch job within 2m:\n%s", tail(string(b)))
		}
	}
	for _, h := range []string{"node1", "node2", "node3"} {
		waitProtected(t, c, h, before[h].ID, time.Minute)
	}
	// Every rank's job snapshotted mid-run, and the snapshot on its protector, before the power cut.
	for _, h := range []string{"node1", "node2", "node3"} {
		if reply, err := c.Client(h).Checkpoint(ctx); err != nil || reply.Error != "" {
			t.Fatalf("checkpoint of %s: %+v %v", h, reply, err)
		}
		jobOn(t, c, h, "ft-"+h, time.Minute, func(j agent.Job) bool { return j.Replica != nil })
	}
	if kv, err := slurmJob(ctx, c, id); err != nil || kv["JobState"] != "RUNNING" {
		t.Fatalf("the batch job ended before the crash: %v %v", kv, err)
	}
	if err := c.Lab.Crash(ctx, "node2"); err != nil {
		t.Fatal(err)
	}
	crashed := time.Now()
	// What Slurm does by itself after SlurmdTimeout (300 s by default), or a site's health check, now:
	// node2 is DOWN. --no-kill keeps the job running without it.
	if out, err := labExec(ctx, c, "node1", "/", nil, "scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=power cut").CombinedOutput(); err != nil {
		t.Fatalf("scontrol update node2 down: %v\n%s", err, out)
	}
	f := waitFailure(t, c, "node2", 2*time.Minute)
	requireStages(t, f)
	if f.Target != "spare1" {
		t.Errorf("node2's jobs went to %s; want spare1, the allocation's spare", f.Target)
	}
	got, kv := result(id, dir)
	t.Logf("batch job with node2 crashed: %s (ended %s after the crash); Slurm: JobState=%s ExitCode=%s NodeList=%s",
		time.Since(start).Round(time.Millisecond), time.Since(crashed).Round(time.Millisecond), kv["JobState"], kv["ExitCode"], kv["NodeList"])
	if got != want {
		t.Errorf("thermo output after fail-over:\n%s\nwithout failure:\n%s", got, want)
	}
	for _, h := range []string{"node1", "node3"} {
		b := before[h]
		a := jobOn(t, c, h, b.Spec.Name, 10*time.Second, func(agent.Job) bool { return true })
		if a.ID != b.ID || a.PID != b.PID || a.Restored != "" {
			t.Errorf("%s's job was disturbed: %s pid %d -> %s pid %d, restored from %q", h, b.ID, b.PID, a.ID, a.PID, a.Restored)
		}
	}
	j := jobOn(t, c, "spare1", "ft-node2", 30*time.Second, func(j agent.Job) bool { return j.Exit != nil })
	if j.Restored == "" || j.Exit == nil || j.Exit.Code != 0 {
		t.Errorf("node2's job on spare1: restored from %q, exit %+v", j.Restored, j.Exit)
	}
}

// TestMPIHostfile: outside Slurm and without lab sockets, `ftctl mpirun --hostfile` in a lab host starts
// the other hosts' daemons through its own agent, which forwards them over the cluster protocol; every
// job carries the run's placement, and the run directory defaults to ./.ftkit-mpi/NAME.
func TestMPIHostfile(t *testing.T) {
	requirePrograms(t, "mpirun.openmpi", "lmp")
	in := meltInput(t)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute) // a failure bound only
	defer cancel()
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	if err := os.WriteFile(filepath.Join(dir, "in.melt"), in, 0o644); err != nil {
		t.Fatal(err)
	}
	hostfile := "# the run\nnode1 slots=1\nnode2 slots=1\nnode3\nspare1 # its spare\n"
	if err := os.WriteFile(filepath.Join(dir, "hosts"), []byte(hostfile), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := labExec(ctx, c, "node1", dir, nil, bins.Ftctl, "mpirun", "--hostfile", "hosts", "--spares", "1", "--name", "hf", "--",
		"lmp", "-in", "in.melt").CombinedOutput()
	if err != nil {
		t.Fatalf("ftctl mpirun --hostfile: %v\n%s", err, tail(string(out)))
	}
	thermo(t, string(out))
	placement := &agent.Placement{Hosts: []string{"node1", "node2", "node3"}, Spares: []string{"spare1"}}
	for _, h := range []string{"node1", "node2", "node3"} {
		// The agent records the exit moments after ftwrap and the followers read it.
		j := jobOn(t, c, h, "hf-"+h, 30*time.Second, func(j agent.Job) bool { return j.Exit != nil })
		if !reflect.DeepEqual(j.Spec.Placement, placement) || j.Exit.Code != 0 {
			t.Errorf("job %s: placement %+v, exit %+v; want %+v and 0", j.ID, j.Spec.Placement, j.Exit, placement)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ".ftkit-mpi", "hf", "tmp", "node2")); err != nil {
		t.Errorf("run directory: %v", err)
	}
}
