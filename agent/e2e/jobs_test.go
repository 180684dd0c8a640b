// Package e2e holds the agent's end-to-end tests: real agents in lab hosts, real jobs, real CRIU.
package e2e

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/labtest"
)

var bins labcluster.Binaries

// selfCopy is a copy of this test binary in bins.Dir, which other users can enter (TestPeerCredentials
// runs it as nobody). TestMain writes it before any test runs: an executable written while parallel tests
// fork is held open for writing by children between their fork and exec, and exec'ing it then fails
// with ETXTBSY (ci314: "fork/exec .../e2e-self: text file busy").
var selfCopy string

func TestMain(m *testing.M) {
	if sock := os.Getenv("FTKIT_E2E_LIST_JOBS"); sock != "" {
		// Re-executed as another user: list the jobs that user may see.
		jobs, err := agentapi.NewClient(sock).Jobs(context.Background())
		if err != nil {
			println(err.Error())
			os.Exit(1)
		}
		for _, j := range jobs {
			println(j.ID)
		}
		os.Exit(0)
	}
	testenv.EndPackageIfShort("labs, CRIU and eBPF")
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		flag.Set("test.parallel", "1000") // labSlots sets how many labs run at once
	}
	// Every lab host shares this machine's cores, but Open MPI sees one slot per host, so its ranks
	// busy-poll while they wait for a message and take the CPU from the rank that would send it. Told to
	// yield (an MCA parameter mpirun forwards to every rank, through ftctl, sbatch and the agents'
	// launches), LAMMPS's failure-free run in TestMPIFailover took 12 s instead of 51 s (measured alone).
	os.Setenv("OMPI_MCA_mpi_yield_when_idle", "1")
	dir, err := os.MkdirTemp("", "ftkit-e2e-bin")
	if err != nil {
		panic(err)
	}
	os.Chmod(dir, 0o755) // tests run ftwrap as other users too
	bins, err = labcluster.Build(context.Background(), dir)
	if err == nil {
		selfCopy, err = copySelf(bins.Dir)
	}
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

// copySelf copies this test binary into dir.
func copySelf(dir string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	data, err := os.ReadFile(self)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "e2e-self")
	return path, os.WriteFile(path, data, 0o755)
}

func newCluster(t *testing.T, nodes, spares int, opts labcluster.Options) *labcluster.Cluster {
	t.Helper()
	return startCluster(t, newLab(t, nodes, spares, false), opts)
}

// newMPICluster is newCluster for an MPI program's run (labSlots).
func newMPICluster(t *testing.T, nodes, spares int, opts labcluster.Options) *labcluster.Cluster {
	t.Helper()
	return startCluster(t, newLab(t, nodes, spares, true), opts)
}

// newLab is a lab of nodes and spares for t, once one of the package's lab slots is free (labSlots); mpi
// says that it runs an MPI program.
func newLab(t *testing.T, nodes, spares int, mpi bool) *lab.Lab {
	t.Helper()
	slots.take(t, mpi)
	return labtest.New(t, nodes, spares)
}

// startCluster starts the agents of lab l, for a test that prepares a host before its agent runs.
func startCluster(t *testing.T, l *lab.Lab, opts labcluster.Options) *labcluster.Cluster {
	t.Helper()
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
	if opts.JobAddresses {
		t.Cleanup(func() { removeLabJobNets(t, c) }) // before the lab's teardown, registered before this
	}
	return c
}

// removeLabJobNets removes the job networks of every job the lab's agents know, pass or fail: a job network
// outlives the lab's hosts, and one whose job ended with its last bytes unacknowledged lingers up to
// job_network.linger, longer than a test that started the job through ftctl mpirun may run on (ci132 left
// TestMPIHostfile's node1 network behind). A job restored elsewhere has the same id on its new host.
func removeLabJobNets(t *testing.T, c *labcluster.Cluster) {
	seen := map[string]bool{}
	for _, h := range c.Lab.State().Hosts {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		jobs, err := c.Client(h.Name).Jobs(ctx)
		cancel()
		if err != nil {
			continue // a crashed host: its jobs are restored elsewhere, under the same ids, or their test removes them
		}
		for _, j := range jobs {
			if j.Net != nil && !seen[j.ID] {
				seen[j.ID] = true
				removeJobNets(t, j.ID)
			}
		}
	}
}

// mountStore makes host's snapshot store a tmpfs of size (a tmpfs size= value) and returns its path; it is
// unmounted before the lab's teardown. Called before host's agent starts: an agent restarted over a new
// mount would be declared failed while away, and rejoin as a spare.
func mountStore(t *testing.T, l *lab.Lab, host, size string) string {
	t.Helper()
	store := filepath.Join(labcluster.StateDir(l.State().ID, host), "snapshots")
	if err := os.MkdirAll(store, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("ftkit-test", store, "tmpfs", 0, "size="+size+",mode=0700"); err != nil {
		t.Fatalf("mount a tmpfs on %s: %v", store, err)
	}
	t.Cleanup(func() { // registered after the lab's teardown, so it runs before it
		if err := unix.Unmount(store, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount the tmpfs on %s: %v", store, err)
		}
		// Removing the (now empty) mount point at once detaches the copies of the tmpfs held by the jobs of
		// tests running beside this one: they would otherwise hold a copy the host no longer has until the
		// lab's teardown removes the directory.
		os.Remove(store)
	})
	return store
}

// ftwrap runs ftwrap against host's agent from the root namespace (a login node, not a lab host).
func ftwrap(c *labcluster.Cluster, host string, args ...string) *exec.Cmd {
	cmd := exec.Command(bins.Ftwrap, args...)
	cmd.Env = append(os.Environ(), "FTKIT_AGENT_SOCKET="+labcluster.Socket(c.Lab.State().ID, host))
	return cmd
}

// TestJobGetsItsCallersLimits: a job starts with the resource limits of the program that asked for it, as
// Slurm's tasks get their submitter's, not with the agent's (whose unit raises the open-files and
// locked-memory limits); and one asked for without an environment gets a PATH, not the agent's environment.
func TestJobGetsItsCallersLimits(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{})
	cmd := ftwrap(c, "node1", "--name", "limits", "--", "sh", "-c", "ulimit -Sn; ulimit -Hn; ulimit -Sl; ulimit -Hl")
	// The caller lowers its limits below the agent's (the lab's agents have this test's), then becomes
	// ftwrap, whose Go runtime raises its own soft open-files limit to about the hard one.
	cmd.Args = append([]string{"sh", "-c", `ulimit -n 600 && ulimit -l 1024 && exec "$0" "$@"`, cmd.Path}, cmd.Args[1:]...)
	cmd.Path = "/bin/sh"
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ftwrap: %v\n%s", err, stderr.String())
	}
	var soft, hard, lockSoft, lockHard int
	if n, _ := fmt.Sscan(string(out), &soft, &hard, &lockSoft, &lockHard); n != 4 || soft > 600 || hard != 600 || lockSoft != 1024 || lockHard != 1024 {
		t.Errorf("the job's limits (open files soft, hard; locked KiB soft, hard): %q; want its caller's: at most 600, 600, 1024, 1024", out)
	}

	j, err := c.Client("node1").StartJob(context.Background(), agent.JobSpec{Name: "noenv", Argv: []string{"/usr/bin/env"}})
	if err != nil {
		t.Fatal(err)
	}
	end := waitExited(t, c, "node1", j.ID)
	env, _ := os.ReadFile(j.StdoutPath())
	if want := "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nGODEBUG=multipathtcp=0\n"; end.Exit == nil || end.Exit.Code != 0 || string(env) != want {
		t.Errorf("a job without an environment ended %+v and saw %q; want %q", end.Exit, env, want)
	}
}

func TestFtwrapOutputAndExitStatus(t *testing.T) {
	t.Parallel() // each test has its own lab
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
	// ftwrap's one line naming the job, then the job's own stderr.
	first, rest, _ := strings.Cut(stderr.String(), "\n")
	if !strings.HasPrefix(rest, "err1\nerr2\nerr3\n") {
		t.Errorf("stderr %q", stderr.String())
	}
	jobs, err := c.Client("node1").Jobs(context.Background())
	if err != nil || len(jobs) != 1 || jobs[0].Spec.Name != "counter" {
		t.Fatalf("jobs: %+v, %v", jobs, err)
	}
	if want := "ftwrap: job " + jobs[0].ID + " on node1"; first != want {
		t.Errorf("ftwrap's first stderr line %q, want %q", first, want)
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

// restartTimeout is the heartbeat timeout of a lab whose test restarts an agent while its host is a member:
// an agent starting again on a loaded machine outlasted the lab's default (1 s, and as long to confirm) in
// CI, and its host was declared failed while it was away.
const restartTimeout = 5 * time.Second

func TestAgentRestartAdoptsJob(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{HeartbeatTimeout: restartTimeout})
	// The job runs until the test has seen it adopted: a job of a fixed length (3 s) ended while a loaded
	// machine restarted its agent (ci273's successor), and there was nothing left to adopt.
	stop := filepath.Join(t.TempDir(), "stop")
	cmd := ftwrap(c, "node2", "sh", "-c", fmt.Sprintf(
		`i=0; while [ ! -e %s ]; do echo tick$i; i=$((i+1)); sleep 0.1; done; echo done`, stop))
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var jobs []agent.Job
	var err error
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) { // until ftwrap's job is there
		if jobs, err = c.Client("node2").Jobs(context.Background()); err == nil && len(jobs) > 0 || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || len(jobs) != 1 {
		t.Fatalf("jobs before the restart: %v, %v", jobs, err)
	}
	// The job's first snapshot, taken as it started, comes before the one this test takes.
	waitProtected(t, c, "node2", jobs[0].ID, 2*time.Minute)
	reply, err := c.Client("node2").Checkpoint(context.Background(), jobs[0].ID)
	if err != nil || len(reply.Results) != 1 {
		t.Fatalf("checkpoint before the restart: %+v, %v", reply, err)
	}
	snap := reply.Results[0].Manifest.ID
	if err := c.KillAgent("node2"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := c.StartAgent(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	// Newest first; the snapshot the agent took as the job started may be listed after it.
	if ms, err := c.Client("node2").Snapshots(context.Background(), ""); err != nil || len(ms) == 0 || ms[0].ID != snap {
		t.Errorf("after restart the agent lists snapshots %v, %v; want %s first", ms, err, snap)
	}
	jobs, err = c.Client("node2").Jobs(context.Background())
	if err != nil || len(jobs) != 1 || jobs[0].State != "running" {
		t.Fatalf("after restart the agent has jobs %+v, %v; want the running job adopted", jobs, err)
	}
	if err := os.WriteFile(stop, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("ftwrap: %v", err)
	}
	// Every tick once and in order, across the restart, then the job's own end.
	lines := strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n")
	ok := len(lines) >= 2 && lines[len(lines)-1] == "done"
	for i := 0; ok && i < len(lines)-1; i++ {
		ok = lines[i] == "tick"+strconv.Itoa(i)
	}
	if !ok {
		t.Errorf("output across the agent restart:\n%s", stdout.String())
	}
	j, err := c.Client("node2").Wait(context.Background(), jobs[0].ID, 5*time.Second)
	if err != nil || j.State != "exited" || j.Exit.Code != 0 {
		t.Errorf("adopted job after exit: %+v, %v", j, err)
	}
}

// The local API identifies callers by SO_PEERCRED: a user's job runs as that user, and a user sees and
// acts on its own jobs only, while root sees everything.
func TestPeerCredentials(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{})
	const nobody = 65534
	cmd := ftwrap(c, "node1", "--name", "mine", "--", "sh", "-c", "id -u; sleep 3")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	cmd.Dir = "/"
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	rootJob := ftwrap(c, "node1", "--name", "roots", "--", "sleep", "3")
	if err := rootJob.Start(); err != nil {
		t.Fatal(err)
	}
	// Both jobs are listed before nobody asks (their records stay after they end).
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if all, err := c.Client("node1").Jobs(context.Background()); err == nil && len(all) == 2 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("node1 lists %d jobs a minute after both started, want 2 (%v)", len(all), err)
		}
	}
	// Ask the agent as nobody: only nobody's job is listed.
	// The test binary lives in a directory other users cannot enter: run a copy from the shared bin dir.
	list := exec.Command(selfCopy, "-test.run=^$")
	list.Env = append(os.Environ(), "FTKIT_E2E_LIST_JOBS="+labcluster.Socket(c.Lab.State().ID, "node1"))
	list.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	got, err := list.CombinedOutput()
	if err != nil {
		t.Fatalf("listing as nobody: %v\n%s", err, got)
	}
	if !strings.Contains(string(got), "mine-") || strings.Contains(string(got), "roots-") {
		t.Errorf("nobody sees jobs %q; want only its own", got)
	}
	all, err := c.Client("node1").Jobs(context.Background())
	if err != nil || len(all) != 2 {
		t.Errorf("root sees %d jobs, want 2 (%v)", len(all), err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	rootJob.Wait()
	if strings.TrimSpace(out.String()) != "65534" {
		t.Errorf("the job of uid %d ran as uid %q", nobody, out.String())
	}
}
