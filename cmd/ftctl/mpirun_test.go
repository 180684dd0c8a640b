package main

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/ftkit/ftkit/internal/cli"
)

// genv is hydra's -genv NAME VALUE pairs of an mpiexec.mpich command line.
func genv(argv []string) map[string]string {
	env := map[string]string{}
	for i := 0; i+2 < len(argv); i++ {
		if argv[i] == "-genv" {
			env[argv[i+1]] = argv[i+2]
		}
	}
	return env
}

// TestMPICHLauncherArgv: every MPICH rank talks to every other over TCP only, whatever it thinks of their
// hostnames (lab hosts share one): no ch4 shared memory, no UCX shared-memory or cross-memory transport, and
// without --eager-only=false no UCX rendezvous. The program's words come last, untouched.
func TestMPICHLauncherArgv(t *testing.T) {
	for _, eager := range []bool{true, false} {
		f := &mpiRunFlags{impl: "mpich", mpirun: "true", eagerOnly: eager}
		p := &mpiPlan{ranks: []string{"node1", "node2", "node3"}, dir: t.TempDir(), cidrs: "10.0.0.0/24"}
		bin := t.TempDir() // where ftctl and libftkit-mpich.so are
		if err := os.WriteFile(filepath.Join(bin, mpichLibName), []byte("lib"), 0o644); err != nil {
			t.Fatal(err)
		}
		argv, err := f.launcherArgv(p, filepath.Join(bin, "ftctl"), []string{"ring", "-genv", "X", "1"})
		if err != nil {
			t.Fatal(err)
		}
		if got := argv[len(argv)-4:]; !slices.Equal(got, []string{"ring", "-genv", "X", "1"}) {
			t.Errorf("argv ends %q, want the program's words", got)
		}
		i := slices.Index(argv, "-hosts")
		if i < 0 || argv[i+1] != "localhost,node2,node3" {
			t.Errorf("argv %q: want -hosts localhost,node2,node3", argv)
		}
		env := genv(argv[:len(argv)-4])
		// The ranks preload the run directory's copy of the library (every host sees it), not ftctl's.
		lib := filepath.Join(p.dir, mpichLibName)
		want := map[string]string{"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "UCX_KEEPALIVE_INTERVAL": "inf",
			"LD_PRELOAD": lib}
		if eager {
			want["UCX_RNDV_THRESH"] = "inf"
		}
		for k, v := range want {
			if env[k] != v {
				t.Errorf("eager-only %v: -genv %s %q, want %q (argv %q)", eager, k, env[k], v, argv)
			}
		}
		if _, ok := env["UCX_RNDV_THRESH"]; !eager && ok {
			t.Errorf("--eager-only=false still sets UCX_RNDV_THRESH: %q", argv)
		}
		if b, err := os.ReadFile(lib); err != nil || string(b) != "lib" {
			t.Errorf("the run directory's %s: %q, %v; want ftctl's copied", mpichLibName, b, err)
		}
	}
}

// TestMPICHLauncherArgvNoLib: without libftkit-mpich.so MPICH's MPI_Finalize can hang, so the run does not
// start, and the error says how to get the library.
func TestMPICHLauncherArgvNoLib(t *testing.T) {
	old := mpichLibDirs
	mpichLibDirs = []string{t.TempDir()}
	t.Cleanup(func() { mpichLibDirs = old })
	f := &mpiRunFlags{impl: "mpich", mpirun: "true", eagerOnly: true}
	p := &mpiPlan{ranks: []string{"node1", "node2"}, dir: t.TempDir(), cidrs: "10.0.0.0/24"}
	_, err := f.launcherArgv(p, filepath.Join(t.TempDir(), "ftctl"), []string{"ring"})
	if err == nil || !strings.Contains(err.Error(), "make build") {
		t.Errorf("launcherArgv without the library: %v; want an error saying to run make build", err)
	}
}

// TestMPICHPreloadKeepsUsers: the user's own LD_PRELOAD still reaches the ranks, after ftkit's library.
func TestMPICHPreloadKeepsUsers(t *testing.T) {
	t.Setenv("LD_PRELOAD", "/opt/mine.so")
	env := map[string]string{}
	for _, kv := range mpichEnv(true, "/run/x/libftkit-mpich.so") {
		env[kv[0]] = kv[1]
	}
	if got, want := env["LD_PRELOAD"], "/run/x/libftkit-mpich.so /opt/mine.so"; got != want {
		t.Errorf("LD_PRELOAD %q, want %q", got, want)
	}
}

// TestWithPreload: the run's environment (mpiexec, the hydra proxies) preloads the library first and keeps
// the user's preloads, with one LD_PRELOAD.
func TestWithPreload(t *testing.T) {
	for _, c := range []struct {
		env  []string
		want string
	}{
		{[]string{"A=1"}, "LD_PRELOAD=/run/lib.so"},
		{[]string{"LD_PRELOAD=/opt/mine.so", "A=1"}, "LD_PRELOAD=/run/lib.so /opt/mine.so"},
	} {
		got := withPreload(c.env, "/run/lib.so")
		var preloads []string
		for _, kv := range got {
			if strings.HasPrefix(kv, "LD_PRELOAD=") {
				preloads = append(preloads, kv)
			}
		}
		if len(preloads) != 1 || preloads[0] != c.want || !slices.Contains(got, "A=1") {
			t.Errorf("withPreload(%q) = %q, want A=1 and %s", c.env, got, c.want)
		}
	}
}

func TestLabYield(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
		want []string
	}{
		{"unset", []string{"PATH=/bin"}, []string{"PATH=/bin", "OMPI_MCA_mpi_yield_when_idle=1"}},
		{"the user's 0 stays", []string{"OMPI_MCA_mpi_yield_when_idle=0", "PATH=/bin"}, []string{"OMPI_MCA_mpi_yield_when_idle=0", "PATH=/bin"}},
		{"a longer name is another", []string{"OMPI_MCA_mpi_yield_when_idle_x=0"}, []string{"OMPI_MCA_mpi_yield_when_idle_x=0", "OMPI_MCA_mpi_yield_when_idle=1"}},
		{"empty", nil, []string{"OMPI_MCA_mpi_yield_when_idle=1"}},
	} {
		if got := labYield(slices.Clone(tc.env)); !slices.Equal(got, tc.want) {
			t.Errorf("%s: labYield(%q) = %q, want %q", tc.name, tc.env, got, tc.want)
		}
	}
}

// TestMPIRunBadName: a --name that is no run's is refused as a usage error before anything is looked up or
// created, in a lab (no lab needed) as outside one (no agent needed): ../x must not become a run directory
// outside .ftkit-mpi or the lab's mpi directory.
func TestMPIRunBadName(t *testing.T) {
	work := t.TempDir()
	t.Chdir(work) // the default run directory is ./.ftkit-mpi/NAME
	hostfile := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hostfile, []byte("h1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "agent.sock") // nothing listens
	for _, name := range []string{"../x", "a/b", "..", ".hidden", "-x", "a b", "x;id", strings.Repeat("a", 49)} {
		for _, tt := range []struct {
			where string
			f     mpiRunFlags
		}{
			{"lab", mpiRunFlags{labID: "nosuchlab-mpiname", name: name, impl: "openmpi"}},
			{"hostfile", mpiRunFlags{hostfile: hostfile, socket: sock, name: name, impl: "openmpi"}},
		} {
			t.Run(tt.where+"/"+name, func(t *testing.T) {
				err := tt.f.run(t.Context(), true, []string{"--", "true"})
				ee, ok := errors.AsType[*cli.ExitError](err)
				if !ok || ee.Code != cli.ExitUsage || !strings.Contains(err.Error(), "--name") {
					t.Errorf("--name %q: %v; want a usage error (exit %d) naming --name", name, err, cli.ExitUsage)
				}
			})
		}
	}
	if ents, _ := os.ReadDir(work); len(ents) > 0 {
		t.Errorf("created %v", ents)
	}
}

// TestCheckJobNames: a valid run name whose jobs NAME-HOST would be too long for the agents is refused.
func TestCheckJobNames(t *testing.T) {
	for _, tt := range []struct {
		run   string
		ranks []string
		ok    bool
	}{
		{"mpi-abc", []string{"node1", "node2"}, true},
		{strings.Repeat("a", 42), []string{"node1"}, true}, // 48 bytes
		{strings.Repeat("a", 43), []string{"node1"}, false},
		{strings.Repeat("a", 40), []string{"n1", "node-long"}, false},
	} {
		err := checkJobNames(tt.run, tt.ranks)
		if (err == nil) != tt.ok {
			t.Errorf("checkJobNames(%q, %v) = %v, want ok %v", tt.run, tt.ranks, err, tt.ok)
		}
	}
}

// TestFollowDaemonExecFails: launch-daemon has started the MPI daemon's job when it re-execs itself as its
// follower; if that exec fails, the job runs on all the same, so it is followed in this process: its output
// is copied and its status is the launcher's, not the exec's error (which told MPI the daemon never started
// while it ran unfollowed).
func TestFollowDaemonExecFails(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("an exit record is read only if root wrote it")
	}
	dir := t.TempDir()
	for name, b := range map[string]string{"stdout": "out\n", "stderr": "err\n", "exit": `{"code":3,"node":"node2"}`} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(b), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var out, errOut strings.Builder
	execve := func(string, []string, []string) error { return syscall.ENOMEM }
	err := followDaemon(t.Context(), slog.New(slog.DiscardHandler), dir, &out, &errOut, execve)
	var ee *cli.ExitError
	if !errors.As(err, &ee) || ee.Code != 3 || !strings.Contains(err.Error(), "exited with status 3") {
		t.Fatalf("followDaemon with a failing exec: %v; want the job's status 3", err)
	}
	if out.String() != "out\n" || errOut.String() != "err\n" {
		t.Errorf("followDaemon copied stdout %q, stderr %q; want the job's %q, %q", out.String(), errOut.String(), "out\n", "err\n")
	}
}
