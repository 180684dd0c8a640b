package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/lammps"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/lab/slurm"
)

// longMeltInput is meltInput run for 6000 steps with thermodynamic output every 1000 (the same 7 rows):
// twice as long, so that the crash, taken once every host is snapshotted after the first row, comes
// mid-run even when two runs share the machine.
func longMeltInput(t *testing.T) []byte {
	t.Helper()
	s := strings.Replace(string(meltInput(t)), "run 3000", "run 6000", 1)
	s = strings.Replace(s, "thermo 500", "thermo 1000", 1)
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
	slots.take(t, true) // its labs run MPI programs
	l := labtest.Up(t, lab.Config{Nodes: nodes, Spares: spares, Slurm: true})
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
	if opts.JobAddresses {
		t.Cleanup(func() { removeLabJobNets(t, c) })
	}
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

// sacctJob waits until Slurm's accounting (`sacct --completion`: the lab's job completion file, no
// slurmdbd) has job id's record and returns its state and exit code.
func sacctJob(t *testing.T, ctx context.Context, c *labcluster.Cluster, id string, timeout time.Duration) (state, exit string) {
	t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(500 * time.Millisecond) {
		out, err := labExec(ctx, c, "node1", "/", nil, "sacct", "--completion", "-j", id, "--noheader", "--parsable2", "--format=JobID,State,ExitCode").Output()
		// A job that lost a node has a RESIZING record first: with --no-kill, Slurm drops the failed node
		// from the allocation. The record of the job's end follows.
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if f := strings.Split(line, "|"); err == nil && len(f) == 3 && f[0] == id && f[1] != "RESIZING" {
				return f[1], f[2]
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("sacct --completion has no record of job %s within %s: %q %v", id, timeout, out, err)
		}
	}
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

// TestMPISlurmFailover: two Slurm batch jobs (sbatch --nodes=4 --no-kill) run LAMMPS at the same time
// under `ftctl mpirun --spares 1`, on disjoint allocations of an eight-host Slurm cluster (every host a
// ring node, as at a site): each takes its hosts from its allocation, ranks on the first three, the last
// its run's spare. Every rank's job of one is snapshotted to its protector, then that job's second host
// loses power. Its part is restored on its own allocation's spare and its output is the same as the
// other job's, which never noticed: none of its jobs was disturbed. Slurm records both as COMPLETED with
// exit code 0:0 (scontrol, and sacct from the job completion file). The batch scripts reach their
// host's agent through the lab's TaskProlog, not through an inherited socket. The failed one runs on job
// addresses (`ftctl mpirun --job-addresses`; its part moves with its address, the host's stays), the other
// on host addresses.
func TestMPISlurmFailover(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	requirePrograms(t, "mpirun.openmpi", "lmp")
	in := longMeltInput(t)
	c := newSlurmCluster(t, 8, 0, labcluster.Options{Interval: "1h", JobAddresses: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute) // a failure bound only
	defer cancel()

	type batch struct {
		name, id, dir string
		hosts, spares []string // the allocation: ranks' hosts, the run's spare
		jobs          map[string]agent.Job
	}
	submit := func(name, flags string) *batch {
		t.Helper()
		b := &batch{name: name, dir: t.TempDir(), jobs: map[string]agent.Job{}}
		os.Chmod(b.dir, 0o755)
		if err := os.WriteFile(filepath.Join(b.dir, "in.melt"), in, 0o644); err != nil {
			t.Fatal(err)
		}
		script := fmt.Sprintf("#!/bin/sh\necho \"agent socket: $FTKIT_AGENT_SOCKET\" >&2\nexec '%s' mpirun --spares 1 %s--name %s -- lmp -in in.melt\n", bins.Ftctl, flags, name)
		if err := os.WriteFile(filepath.Join(b.dir, "job.sh"), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		// A socket that is not there: the batch script must get its host's from the TaskProlog.
		out, err := labExec(ctx, c, "node1", b.dir, []string{"FTKIT_AGENT_SOCKET=/nonexistent/agent.sock"},
			"sbatch", "--parsable", "--nodes=4", "--no-kill", "--chdir="+b.dir,
			"--output="+filepath.Join(b.dir, "out"), "--error="+filepath.Join(b.dir, "err"), filepath.Join(b.dir, "job.sh")).CombinedOutput()
		if err != nil {
			t.Fatalf("sbatch: %v\n%s", err, out)
		}
		b.id, _, _ = strings.Cut(strings.TrimSpace(string(out)), ";")
		return b
	}
	// allocation waits until Slurm runs the batch job and reads its hosts, in Slurm's order.
	allocation := func(b *batch) {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
			kv, err := slurmJob(ctx, c, b.id)
			if err == nil && kv["JobState"] == "RUNNING" {
				out, err := labExec(ctx, c, "node1", "/", nil, "scontrol", "show", "hostnames", kv["NodeList"]).Output()
				if err != nil {
					t.Fatalf("scontrol show hostnames %s: %v", kv["NodeList"], err)
				}
				hosts := strings.Fields(string(out))
				if len(hosts) != 4 {
					t.Fatalf("Slurm job %s runs on %v; want 4 hosts", b.id, hosts)
				}
				b.hosts, b.spares = hosts[:3], hosts[3:]
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("Slurm job %s not running within 2m: %v %v", b.id, kv, err)
			}
		}
	}
	result := func(b *batch) (string, map[string]string) {
		t.Helper()
		kv := waitSlurmJob(t, ctx, c, b.id, 8*time.Minute)
		stdout, _ := os.ReadFile(filepath.Join(b.dir, "out"))
		stderr, _ := os.ReadFile(filepath.Join(b.dir, "err"))
		if kv["JobState"] != "COMPLETED" || kv["ExitCode"] != "0:0" {
			t.Fatalf("Slurm job %s: JobState=%s ExitCode=%s; want COMPLETED 0:0\nstdout:\n%s\nstderr:\n%s", b.id, kv["JobState"], kv["ExitCode"], tail(string(stdout)), tail(string(stderr)))
		}
		if state, exit := sacctJob(t, ctx, c, b.id, 30*time.Second); state != "COMPLETED" || exit != "0:0" {
			t.Errorf("sacct: job %s %s %s; want COMPLETED 0:0", b.id, state, exit)
		}
		if !strings.Contains(string(stderr), "agent socket: "+labcluster.Socket(c.Lab.State().ID, b.hosts[0])) {
			t.Errorf("the batch script of %s did not get %s's agent socket from the TaskProlog:\n%s", b.name, b.hosts[0], tail(string(stderr)))
		}
		return thermo(t, string(stdout)), kv
	}

	start := time.Now()
	ref, ft := submit("ref", ""), submit("ft", "--job-addresses ")
	for _, b := range []*batch{ref, ft} {
		allocation(b)
		placement := &agent.Placement{Hosts: b.hosts, Spares: b.spares}
		for _, h := range b.hosts {
			j := jobOn(t, c, h, b.name+"-"+h, 2*time.Minute, func(j agent.Job) bool { return j.State == agent.JobRunning })
			if !reflect.DeepEqual(j.Spec.Placement, placement) {
				t.Errorf("job %s's placement %+v; want the allocation's %+v", j.ID, j.Spec.Placement, placement)
			}
			if wantNet := b == ft; (j.Net != nil) != wantNet {
				t.Errorf("job %s's job network %+v; want one: %v", j.ID, j.Net, wantNet)
			}
			if j.Net != nil {
				t.Cleanup(func() { removeJobNets(t, j.ID) })
			}
			b.jobs[h] = j
		}
	}
	t.Logf("allocations: ref %v + spare %v, ft %v + spare %v", ref.hosts, ref.spares, ft.hosts, ft.spares)
	refHosts := append(slices.Clone(ref.hosts), ref.spares...)
	for _, h := range append(slices.Clone(ft.hosts), ft.spares...) {
		if slices.Contains(refHosts, h) {
			t.Fatalf("Slurm gave the two jobs overlapping allocations: %s in both", h)
		}
	}
	// The ranks compute (LAMMPS printed its first thermo row: every MPI connection is up, none waits in a
	// listen queue, where CRIU cannot dump it) and every job of ft has its first replica, taken as it started.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		b, _ := os.ReadFile(filepath.Join(ft.dir, "out"))
		if len(lammps.ThermoTable(string(b))) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no thermo row from the batch job within 2m:\n%s", tail(string(b)))
		}
	}
	// Every rank's job of ft snapshotted mid-run, and the snapshot on its protector, before the power cut.
	for _, h := range ft.hosts {
		waitProtected(t, c, h, ft.jobs[h].ID, time.Minute)
		if reply, err := c.Client(h).Checkpoint(ctx, ft.jobs[h].ID); err != nil || reply.Error != "" {
			t.Fatalf("checkpoint of %s: %+v %v", h, reply, err)
		}
	}
	if kv, err := slurmJob(ctx, c, ft.id); err != nil || kv["JobState"] != "RUNNING" {
		t.Fatalf("the batch job ended before the crash: %v %v", kv, err)
	}
	victim := ft.hosts[1]
	if err := c.Lab.Crash(ctx, victim); err != nil {
		t.Fatal(err)
	}
	crashed := time.Now()
	crashJobNet(t, ft.jobs[victim].Net.Name)
	// What Slurm does by itself after SlurmdTimeout (300 s by default), or a site's health check, now:
	// the host is DOWN. --no-kill keeps the job running without it.
	if out, err := labExec(ctx, c, ft.hosts[0], "/", nil, "scontrol", "update", "NodeName="+victim, "State=DOWN", "Reason=power cut").CombinedOutput(); err != nil {
		t.Fatalf("scontrol update %s down: %v\n%s", victim, err, out)
	}
	f := waitFailure(t, c, victim, 5*time.Minute)
	requireStages(t, f)
	if f.Target != ft.spares[0] {
		t.Errorf("%s's jobs went to %s; want %s, its allocation's spare", victim, f.Target, ft.spares[0])
	}
	got, kv := result(ft)
	t.Logf("batch job with %s crashed: %s (ended %s after the crash); Slurm: JobState=%s ExitCode=%s NodeList=%s",
		victim, time.Since(start).Round(time.Millisecond), time.Since(crashed).Round(time.Millisecond), kv["JobState"], kv["ExitCode"], kv["NodeList"])
	want, _ := result(ref)
	if got != want {
		t.Errorf("thermo output after fail-over:\n%s\nwithout failure (the concurrent job):\n%s", got, want)
	}
	// Only the failed host's job rolled back: every other rank of ft, and every job of ref, ran on
	// untouched.
	for _, b := range []*batch{ft, ref} {
		for h, before := range b.jobs {
			if h == victim {
				continue
			}
			a := jobOn(t, c, h, before.Spec.Name, 10*time.Second, func(agent.Job) bool { return true })
			if a.ID != before.ID || a.PID != before.PID || a.Restored != "" {
				t.Errorf("%s's job was disturbed: %s pid %d -> %s pid %d, restored from %q", h, before.ID, before.PID, a.ID, a.PID, a.Restored)
			}
		}
	}
	j := jobOn(t, c, ft.spares[0], "ft-"+victim, 30*time.Second, func(j agent.Job) bool { return j.Exit != nil })
	if j.Restored == "" || j.Exit == nil || j.Exit.Code != 0 || j.Net == nil || j.Net.Addr != ft.jobs[victim].Net.Addr {
		t.Errorf("%s's job on %s: restored from %q, exit %+v, net %+v; want %s's job address %s", victim, ft.spares[0], j.Restored, j.Exit, j.Net, victim, ft.jobs[victim].Net.Addr)
	}
	vh, _ := c.Lab.Host(victim)
	if slices.Contains(hostAddrs(t, c, ft.spares[0]), vh.Addr.Addr()) {
		t.Errorf("%s took %s's host address %s: with job addresses only the job's moves", ft.spares[0], victim, vh.Addr.Addr())
	}
}

// TestMPIHostfile: outside Slurm and without lab sockets, `ftctl mpirun --hostfile --job-addresses` in a
// lab host starts the other hosts' daemons through its own agent, which forwards them over the cluster
// protocol with the request for a job address; every job carries the run's placement and runs on a job
// address of its host's pool, and the run directory defaults to ./.ftkit-mpi/NAME.
func TestMPIHostfile(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	requirePrograms(t, "mpirun.openmpi", "lmp")
	in := meltInput(t)
	c := newMPICluster(t, 3, 1, labcluster.Options{Interval: "1h", JobAddresses: true})
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
	out, err := labExec(ctx, c, "node1", dir, nil, bins.Ftctl, "mpirun", "--hostfile", "hosts", "--spares", "1", "--job-addresses", "--name", "hf", "--",
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
		if pool := labcluster.JobPool(c.Lab.State(), h); j.Net == nil || !pool.Contains(j.Net.Addr.Addr()) {
			t.Errorf("job %s on %s: net %+v, want a job address of %s", j.ID, h, j.Net, pool)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ".ftkit-mpi", "hf", "tmp", "node2")); err != nil {
		t.Errorf("run directory: %v", err)
	}
}
