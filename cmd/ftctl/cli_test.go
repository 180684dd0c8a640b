package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/ring"
)

// The test binary doubles as ftctl (FTKIT_E2E_ROLE=ftctl, see TestMain in lab_e2e_test.go), so these
// tests check real exit codes and messages without building anything.

// ftctl runs ftctl with args and returns its stdout, stderr and exit code.
func ftctl(t *testing.T, env []string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), "FTKIT_E2E_ROLE=ftctl", "FTKIT_AGENT_SOCKET="), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		<-done
		t.Fatalf("ftctl %v still runs after a minute", args)
	}
	code := 0
	if ee, ok := errors.AsType[*exec.ExitError](err); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

// With no agent on the socket, every command that needs one fails with exit 4 and names the socket, and
// the message holds no placeholder URL.
func TestNoAgent(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	for _, args := range [][]string{
		{"status"}, {"status", "--json"}, {"snapshots"}, {"events"}, {"jobs"}, {"jobs", "--json"},
		{"logs", "job-00000001"}, {"kill", "job-00000001"}, {"spare", "list"}, {"checkpoint"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			_, stderr, code := ftctl(t, nil, append(args, "--socket", sock)...)
			if code != cli.ExitUnavailable {
				t.Errorf("exit %d, want %d; stderr %q", code, cli.ExitUnavailable, stderr)
			}
			if !strings.Contains(stderr, sock) || strings.Contains(stderr, "http://") || strings.Contains(stderr, "error: :") {
				t.Errorf("stderr %q: want the socket %s named, and no URL", stderr, sock)
			}
		})
	}
}

// Bad flags are refused with exit 2 before anything is done.
func TestFlagValidation(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (lab commands check for root before their flags)")
	}
	stateDir := t.TempDir()
	id := "fv" + strconv.FormatInt(time.Now().UnixNano()%1e6, 36)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	for _, tt := range []struct {
		args []string
		msg  string
	}{
		{[]string{"lab", "up", "--lab", id, "--state-dir", stateDir, "--interval", "bogus"}, "--interval"},
		{[]string{"lab", "up", "--lab", id, "--state-dir", stateDir, "--interval", "-5s"}, "--interval"},
		{[]string{"lab", "up", "--lab", id, "--state-dir", stateDir, "--mode", "sometimes"}, "--mode"},
		{[]string{"lab", "up", "--lab", id, "--state-dir", stateDir, "--nodes", "0"}, "--nodes"},
		{[]string{"lab", "up", "--id", id, "--state-dir", stateDir, "--subnet", "nonsense"}, "--subnet"},
		{[]string{"status", "--log-level", "loud", "--socket", sock}, "log-level"},
		{[]string{"jobs", "--log-format", "xml", "--socket", sock}, "log-format"},
		{[]string{"kill", "job-00000001", "--signal", "BOGUS", "--socket", sock}, "--signal"},
		{[]string{"kill", "job-00000001", "--signal", "99", "--socket", sock}, "--signal"},
		{[]string{"logs", "../etc", "--socket", sock}, "job"},
		{[]string{"logs", "--socket", sock}, "arg"},
		{[]string{"jobs", "--bogus"}, "unknown flag"},
		{[]string{"bogus"}, "unknown command"},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			_, stderr, code := ftctl(t, nil, tt.args...)
			if code != cli.ExitUsage || !strings.Contains(stderr, tt.msg) {
				t.Errorf("exit %d, stderr %q; want %d and %q", code, stderr, cli.ExitUsage, tt.msg)
			}
		})
	}
	// Nothing was created: no lab state, no namespace of this id.
	if ents, _ := os.ReadDir(stateDir); len(ents) > 0 {
		t.Errorf("lab state was created: %v", ents)
	}
	if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), id) {
		t.Errorf("a namespace of lab %s exists:\n%s", id, out)
	}
}

// The exit codes are documented where an operator looks first.
func TestHelpDocumentsExitCodes(t *testing.T) {
	out, _, code := ftctl(t, nil, "--help")
	for _, want := range []string{"Exit codes:", "0  success", "2  bad command line", "3  not found", "4  unavailable"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("ftctl --help (exit %d) lacks %q", code, want)
		}
	}
}

// testBackend is one job, served by the real local API on a socket the test owns.
type testBackend struct {
	mu  sync.Mutex
	job agent.Job
}

func (b *testBackend) get() agent.Job { b.mu.Lock(); defer b.mu.Unlock(); return b.job }
func (b *testBackend) Status(uid uint32) agent.Status {
	return agent.Status{Node: "node1", Jobs: b.Jobs(uid)}
}
func (b *testBackend) Jobs(uint32) []agent.Job { return []agent.Job{b.get()} }
func (b *testBackend) Job(id string, _ uint32) (agent.Job, <-chan struct{}, error) {
	if j := b.get(); j.ID == id {
		return j, make(chan struct{}), nil
	}
	return agent.Job{}, nil, fmt.Errorf("%w: %s on node1", agent.ErrNoJob, id)
}
func (b *testBackend) StartJobOn(context.Context, string, agent.JobSpec, uint32, uint32) (*agent.Job, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) Checkpoint(context.Context, []string, uint32) ([]agent.SnapshotResult, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) CheckpointFloor() time.Duration { return time.Hour }
func (b *testBackend) Snapshots(string, uint32) ([]*ckpt.Manifest, error) {
	return []*ckpt.Manifest{{ID: "snap-1", Job: b.get().ID, Created: time.Now().Add(-time.Minute)}}, nil
}
func (b *testBackend) Restore(context.Context, agent.RestoreRequest, uint32) (*agent.Job, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) Migrate(context.Context, agent.MigrateRequest, uint32) (*agent.Migration, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) Drain(context.Context, agent.DrainRequest, uint32) (*agent.DrainResult, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) CoordinatedSnapshot(context.Context, coordinated.RunRequest, uint32) (*coordinated.Cut, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) Rollback(context.Context, coordinated.RunRequest, uint32) (*coordinated.Rollback, error) {
	return nil, errors.New("not here")
}
func (b *testBackend) AddSpare(context.Context, agent.SpareRequest) (ring.View, error) {
	return ring.View{}, errors.New("not here")
}
func (b *testBackend) Events(uint32) []*agent.Failure  { return nil }
func (b *testBackend) LoggedConns() []agent.LoggedConn { return nil }
func (b *testBackend) SignalElsewhere(context.Context, agent.Job, uint32, int) (string, error) {
	return "", nil
}

// jobs, logs and kill against the local API over one running job (a real process in a fake cgroup).
func TestJobCommands(t *testing.T) {
	dir := t.TempDir()
	sleep := exec.Command("sleep", "600")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleep.Process.Kill(); sleep.Wait() })
	j := agent.Job{ID: "sleeper-00000001", Node: "node1", UID: uint32(os.Getuid()), GID: uint32(os.Getgid()),
		State: agent.JobRunning, PID: sleep.Process.Pid, Cgroup: filepath.Join(dir, "cg"), Dir: filepath.Join(dir, "job"),
		Net: &agent.JobNet{Name: "ftj-x", Kind: "macvlan", Addr: netip.MustParsePrefix("10.1.0.201/24")}}
	for _, d := range []string{j.Cgroup, j.Dir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.procs"), []byte(strconv.Itoa(j.PID)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(j.StdoutPath(), []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(j.StderrPath(), []byte("oops\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	b := &testBackend{job: j}
	sock := filepath.Join(dir, "agent.sock")
	ctx, cancel := context.WithCancel(context.Background())
	srv, err := agentapi.Listen(ctx, sock, b, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close(); cancel() })

	out, stderr, code := ftctl(t, nil, "jobs", "--json", "--socket", sock)
	var rows []jobRow
	if code != 0 || json.Unmarshal([]byte(out), &rows) != nil || len(rows) != 1 || rows[0].ID != j.ID ||
		rows[0].State != agent.JobRunning || rows[0].Host != "node1" || rows[0].UID != j.UID || rows[0].LastSnapshot != "snap-1" ||
		rows[0].Address != "10.1.0.201" {
		t.Fatalf("jobs --json: exit %d, %q %q", code, out, stderr)
	}
	if out, _, code := ftctl(t, nil, "jobs", "--socket", sock); code != 0 || !strings.Contains(out, j.ID) || !strings.Contains(out, "snap-1") || !strings.Contains(out, "10.1.0.201") {
		t.Errorf("jobs: exit %d, %q", code, out)
	}
	if out, stderr, code := ftctl(t, nil, "logs", j.ID, "--socket", sock); code != 0 || out != "hello\n" {
		t.Errorf("logs: exit %d, %q %q", code, out, stderr)
	}
	if out, stderr, code := ftctl(t, nil, "logs", "--stderr", j.ID, "--socket", sock); code != 0 || out != "oops\n" {
		t.Errorf("logs --stderr: exit %d, %q %q", code, out, stderr)
	}
	if _, stderr, code := ftctl(t, nil, "logs", "nosuch-00000001", "--socket", sock); code != cli.ExitNotFound {
		t.Errorf("logs of an unknown job: exit %d, %q; want %d", code, stderr, cli.ExitNotFound)
	}
	if _, stderr, code := ftctl(t, nil, "kill", j.ID, "--signal", "KILL", "--socket", sock); code != 0 || !strings.Contains(stderr, "SIGKILL") {
		t.Fatalf("kill: exit %d, %q", code, stderr)
	}
	if err := sleep.Wait(); err == nil || err.(*exec.ExitError).Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the job ended with %v, want SIGKILL", err)
	}
	// Its process is gone: a second kill is refused (exit 1), and says why.
	if _, stderr, code := ftctl(t, nil, "kill", j.ID, "--socket", sock); code != cli.ExitFailure || !strings.Contains(stderr, "gone") {
		t.Errorf("kill of a gone job: exit %d, %q", code, stderr)
	}
}

func TestJobStateText(t *testing.T) {
	for _, tc := range []struct {
		row  jobRow
		want string
	}{
		{jobRow{State: agent.JobRunning}, "running"},
		{jobRow{State: agent.JobLost}, "lost"},
		{jobRow{State: agent.JobLost, Fenced: true}, "lost here (runs elsewhere)"},
		{jobRow{State: agent.JobExited, Fenced: true}, "exited"},
		{jobRow{State: agent.JobMoved}, "moved"},
	} {
		if got := tc.row.stateText(); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.row, got, tc.want)
		}
	}
}
