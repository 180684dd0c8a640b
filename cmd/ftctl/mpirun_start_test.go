package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/ring"
)

// memberBackend is an agent on node1, the one alive member of its cluster: enough for ftctl mpirun's plan
// of a run on node1.
type memberBackend struct{ testBackend }

func (b *memberBackend) Status(uint32) agent.Status {
	return agent.Status{Node: "node1", Members: []ring.Member{
		{Name: "node1", State: ring.StateAlive, Address: netip.MustParseAddrPort("10.9.0.1:7420")},
	}}
}

// mpiRunSetup serves a node1 agent, writes a hostfile naming node1, and puts a fake ftwrap (script) first on
// PATH. It returns the agent's socket and the hostfile.
func mpiRunSetup(t *testing.T, script string) (sock, hostfile string) {
	t.Helper()
	sock = filepath.Join(t.TempDir(), "agent.sock")
	srv, err := agentapi.Listen(t.Context(), sock, &memberBackend{}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	hostfile = filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hostfile, []byte("node1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "ftwrap"), []byte("#!/bin/sh\n"+script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	return sock, hostfile
}

// A run that fails before its job starts (here: no such MPI launcher) leaves no run directory behind: the
// user who fixes the cause and runs the same command again must not be told that a run of that name exists.
func TestMPIRunFailedStartFreesName(t *testing.T) {
	sock, hostfile := mpiRunSetup(t, "exit 0\n")
	dir := filepath.Join(t.TempDir(), "run1")
	for try := 1; try <= 2; try++ {
		f := &mpiRunFlags{hostfile: hostfile, socket: sock, dir: dir, name: "run1", impl: "openmpi", mpirun: "no-such-mpirun-ftkit"}
		err := f.run(t.Context(), true, []string{"--", "true"})
		if err == nil || !strings.Contains(err.Error(), "no-such-mpirun-ftkit not found") {
			t.Fatalf("try %d: %v; want the missing MPI launcher named", try, err)
		}
		if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("try %d: the failed run left its directory %s (%v): a retry under the same --name is refused", try, dir, err)
		}
	}
}

// A SIGTERM (a kill by PID, a supervisor stopping the run) or a Ctrl-C reaches the MPI job, and ftctl mpirun
// ends with the job's own end, its last output copied: it does not die at once and leave the job running
// behind an ftwrap nobody waits for. The fake ftwrap stands for the job: it ends with 143 when signalled.
func TestMPIRunSignalReachesJob(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			pidFile := filepath.Join(t.TempDir(), "ftwrap.pid")
			sock, hostfile := mpiRunSetup(t, "echo $$ > "+pidFile+"\ntrap 'echo job stopped; exit 143' TERM INT\necho started\n"+
				"i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\nexit 0\n")
			t.Cleanup(func() { // on failure, the fake job must not outlive the test
				if b, err := os.ReadFile(pidFile); err == nil {
					var pid int
					if _, err := fmt.Sscan(strings.TrimSpace(string(b)), &pid); err == nil && pid > 0 {
						syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			})
			out, err := os.Create(filepath.Join(t.TempDir(), "out"))
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			cmd := exec.Command(os.Args[0], "mpirun", "--hostfile", hostfile, "--socket", sock, "--dir", filepath.Join(t.TempDir(), "run1"),
				"--name", "run1", "--mpirun", "true", "--", "prog")
			cmd.Env = append(os.Environ(), "FTKIT_E2E_ROLE=ftctl")
			cmd.Stdout, cmd.Stderr = out, out // a file: Wait does not wait for a writer the fake job holds
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			output := func() string { b, _ := os.ReadFile(out.Name()); return string(b) }
			for deadline := time.Now().Add(time.Minute); !strings.Contains(output(), "started"); {
				select {
				case err := <-done:
					t.Fatalf("ftctl mpirun ended (%v) before the job started:\n%s", err, output())
				case <-time.After(20 * time.Millisecond):
				}
				if time.Now().After(deadline) {
					t.Fatalf("the job did not start within a minute:\n%s", output())
				}
			}
			cmd.Process.Signal(sig)
			var werr error
			select {
			case werr = <-done:
			case <-time.After(time.Minute):
				cmd.Process.Kill()
				t.Fatalf("ftctl mpirun still runs a minute after %v:\n%s", sig, output())
			}
			var ee *exec.ExitError
			if !errors.As(werr, &ee) || ee.ExitCode() != 143 || !strings.Contains(output(), "job stopped") {
				t.Fatalf("after %v ftctl mpirun ended with %v (exit %d), output:\n%s\nwant the job's end: exit 143 after its last words", sig, werr, exitCode(ee), output())
			}
		})
	}
}

func exitCode(ee *exec.ExitError) int {
	if ee == nil {
		return 0
	}
	return ee.ExitCode()
}
