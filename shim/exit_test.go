package shim

import (
	"bufio"
	"errors"
	"fmt"
	"github.com/ftkit/ftkit/internal/testenv"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The agent polls exit records as root: a link is not followed and a FIFO is not waited on.
func TestReadExitRefusesLinkAndFIFO(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte(`{"code": 77, "node": "forged"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "exit-link")
	fifo := filepath.Join(dir, "exit-fifo")
	if err := os.Symlink(secret, link); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{link, fifo} {
		done := make(chan error, 1)
		go func() {
			st, err := ReadExit(p)
			if err == nil {
				err = errors.New("read " + st.Node)
			} else {
				err = nil
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("ReadExit(%s): %v; want a refusal", p, err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("ReadExit(%s) still blocked after 30 s", p)
		}
	}
	if _, err := ReadExit(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing record: %v, want fs.ErrNotExist (the agent waits for it)", err)
	}
	if os.Geteuid() == 0 {
		forged := filepath.Join(dir, "exit-forged")
		os.WriteFile(forged, []byte(`{"code": 77, "node": "forged"}`), 0o644)
		os.Chown(forged, 65534, 65534)
		if st, err := ReadExit(forged); err == nil {
			t.Errorf("read a record the job's user wrote: %+v", st)
		}
	}
	good := filepath.Join(dir, "exit")
	os.WriteFile(good, []byte(`{"code": 3, "node": "n1"}`), 0o644)
	if st, err := ReadExit(good); err != nil || st.Code != 3 {
		t.Errorf("ReadExit of a real record: %+v, %v", st, err)
	}
}

// Signal itself on a real child: signalled while it runs in the job's cgroup; refused once it has
// exited and been reaped (its PID may then name anyone's process).
func TestSignalPidfd(t *testing.T) {
	cg := t.TempDir()
	cmd := testenv.StartSleep(t)
	pid := cmd.Process.Pid
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(pid)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Signal(pid, cg, unix.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP to the job: %v", err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WUNTRACED, nil); err != nil || !ws.Stopped() {
		t.Fatalf("after SIGSTOP: %v %v", ws, err)
	}
	if err := Signal(pid, cg, unix.SIGKILL); err != nil {
		t.Fatalf("SIGKILL to the job: %v", err)
	}
	testenv.WaitSignalled(t, cmd, syscall.SIGKILL)
	if err := Signal(pid, cg, unix.SIGTERM); !errors.Is(err, ErrJobGone) {
		t.Fatalf("signal after the process was reaped: %v, want ErrJobGone", err)
	}
	// The PID reused by a process outside the job: refused, and that process keeps running.
	other := testenv.StartSleep(t)
	if err := Signal(other.Process.Pid, cg, unix.SIGTERM); !errors.Is(err, ErrJobGone) {
		t.Fatalf("signal to a process outside the job's cgroup: %v, want ErrJobGone", err)
	}
	testenv.StillRuns(t, other)
	if err := Signal(0, cg, unix.SIGTERM); !errors.Is(err, ErrJobGone) {
		t.Fatalf("signal to pid 0: %v", err)
	}
}

func TestPidListed(t *testing.T) {
	for _, tt := range []struct {
		procs string
		pid   int
		want  bool
	}{
		{"", 1, false},
		{"42\n", 42, true},
		{"42", 42, true},
		{"7\n42\n99\n", 42, true},
		{"7\n420\n4\n2\n", 42, false},
		{"142\n", 42, false},
		{" 42 \n", 42, true},
		{"x\n42\n", 42, true},
		{"-42\n", 42, false},
	} {
		if got := pidListed([]byte(tt.procs), tt.pid); got != tt.want {
			t.Errorf("pidListed(%q, %d) = %v", tt.procs, tt.pid, got)
		}
	}
}

// The shim creates the job's outputs: a link planted at their names is neither followed nor truncated.
func TestShimRefusesPlantedOutput(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	const secretContent = "root's secret"
	if err := os.WriteFile(secret, []byte(secretContent), 0o600); err != nil {
		t.Fatal(err)
	}
	jobDir := filepath.Join(dir, "job")
	if err := os.Mkdir(jobDir, 0o755); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(jobDir, "stdout")
	if err := os.Symlink(secret, p); err != nil {
		t.Fatal(err)
	}
	// createOutput is where the shim opens the outputs: it must refuse the link itself.
	if f, err := createOutput(p, 65534, 65534); err == nil {
		f.Close()
		t.Error("createOutput opened a planted link")
	}
	_, err := startJob(Spec{
		JobID: "planted-00000001", Mode: ModeStart, Argv: []string{"/bin/true"}, UID: 65534, GID: 65534,
		Stdout: p, Stderr: filepath.Join(jobDir, "stderr"), Cgroup: filepath.Join(dir, "no-such-cgroup"),
	})
	if err == nil {
		t.Fatal("the shim started a job whose stdout was a planted link")
	}
	if got, _ := os.ReadFile(secret); string(got) != secretContent {
		t.Errorf("root's file changed: %q", got)
	}
}

// TestRecordEnd: a copy's end is recorded unless the agent superseded the copy first; a job the agent
// killed carries its reason, read without following a link and bounded.
func TestRecordEnd(t *testing.T) {
	dir := t.TempDir()
	mark := filepath.Join(dir, "job-00000001.2.superseded")
	refusal := filepath.Join(dir, "job-00000001.2.refused")
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("root's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	killed := ExitStatus{Code: 137, Signal: "SIGKILL", Node: "node2"}
	for _, tc := range []struct {
		name       string
		superseded string
		marked     bool
		refused    string // content of the refusal; "->" plants a link to secret
		st         ExitStatus
		want       bool
		reason     string
		planted    bool // the mark and the refusal are another user's (a sticky jobs_dir holds them)
	}{
		{"no mark given (a shim of an older agent)", "", false, "", killed, true, "", false},
		{"mark given, not made: the job ended", mark, false, "", killed, true, "", false},
		{"mark made: the copy was superseded", mark, true, "", killed, false, "", false},
		{"killed by the agent, which says why", mark, false, "killed by ftkit: re-sent bytes differ\n", killed, true, "killed by ftkit: re-sent bytes differ", false},
		{"ended by itself before the agent's kill", mark, false, "killed by ftkit", ExitStatus{Code: 0, Node: "node2"}, true, "", false},
		{"a link as the refusal is not followed", mark, false, "->", killed, true, "", false},
		{"a long reason is cut", mark, false, strings.Repeat("x", 10<<10), killed, true, strings.Repeat("x", maxRefusal), false},
		// The shim's own kill (its lazy-pages daemon failed) says why, though the agent wrote no refusal.
		{"killed by the shim, no refusal written", mark, false, "", ExitStatus{Code: 137, Signal: "SIGKILL", Node: "node2", Reason: "killed by ftkit: lazy"}, true, "killed by ftkit: lazy", false},
		// The records' directory is jobs_dir in the default layout, which users may write to (sticky): a user
		// who plants another user's job's mark must not have its end go unrecorded, nor its kill explained.
		{"a mark another user made is not the agent's", mark, true, "", killed, true, "", true},
		{"a refusal another user wrote is not the agent's", mark, false, "killed by ftkit: made up", killed, true, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exit := filepath.Join(t.TempDir(), "exit.json")
			if tc.marked {
				if err := os.WriteFile(mark, nil, 0o600); err != nil {
					t.Fatal(err)
				}
				defer os.Remove(mark)
				if tc.planted {
					chownOther(t, mark)
				}
			}
			switch tc.refused {
			case "":
			case "->":
				if err := os.Symlink(secret, refusal); err != nil {
					t.Fatal(err)
				}
				defer os.Remove(refusal)
			default:
				if err := os.WriteFile(refusal, []byte(tc.refused), 0o600); err != nil {
					t.Fatal(err)
				}
				defer os.Remove(refusal)
				if tc.planted {
					chownOther(t, refusal)
				}
			}
			spec := Spec{JobID: "job-00000001", ExitFile: exit, Superseded: tc.superseded, Refusal: refusal}
			if err := recordEnd(spec, tc.st); err != nil {
				t.Fatal(err)
			}
			st, err := ReadExit(exit)
			if got := err == nil; got != tc.want {
				t.Fatalf("exit record written %v (%+v, %v), want %v", got, st, err, tc.want)
			}
			if !tc.want {
				return
			}
			if st.Code != tc.st.Code || st.Reason != tc.reason {
				t.Errorf("exit record %+v, want code %d and reason %q", st, tc.st.Code, tc.reason)
			}
		})
	}
}

// chownOther gives path to a user other than root and this process (skipped where that is not allowed).
func chownOther(t *testing.T, path string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a file to another user")
	}
	if err := os.Chown(path, 1000, 1000); err != nil {
		t.Fatal(err)
	}
}

// TestRecordEndCarriesIncarnation: the record names the job's incarnation the copy was, for its readers to
// tell a superseded copy's kill from the job's end; a spec without one (an older agent's) gives a record
// without one, as an older shim wrote, which no reader takes for an older copy's.
func TestRecordEndCarriesIncarnation(t *testing.T) {
	two := uint64(2)
	for _, tc := range []struct {
		name string
		inc  *uint64
	}{{"incarnation given", &two}, {"none given", nil}} {
		t.Run(tc.name, func(t *testing.T) {
			exit := filepath.Join(t.TempDir(), "exit")
			spec := Spec{JobID: "job-00000001", ExitFile: exit, Incarnation: tc.inc}
			if err := recordEnd(spec, ExitStatus{Code: 137, Signal: "SIGKILL", Node: "node2"}); err != nil {
				t.Fatal(err)
			}
			st, err := ReadExit(exit)
			if err != nil {
				t.Fatal(err)
			}
			if (st.Incarnation == nil) != (tc.inc == nil) || (tc.inc != nil && *st.Incarnation != *tc.inc) {
				t.Fatalf("record's incarnation %v, want %v", st.Incarnation, tc.inc)
			}
			b, _ := os.ReadFile(exit)
			if got := strings.Contains(string(b), `"incarnation"`); got != (tc.inc != nil) {
				t.Fatalf("record %s names an incarnation: %v, want %v", b, got, tc.inc != nil)
			}
		})
	}
}

// TestExitStatusOlder: only a record naming an incarnation below the current one is an older copy's; one
// without (an older shim's) keeps being taken as it was. A record of incarnation 0 names it.
func TestExitStatusOlder(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		record string
		cur    uint64
		want   bool
	}{
		{`{"code": 137, "node": "n1", "incarnation": 0}`, 1, true},
		{`{"code": 137, "node": "n1", "incarnation": 1}`, 3, true},
		{`{"code": 0, "node": "n1", "incarnation": 3}`, 3, false},
		{`{"code": 0, "node": "n1", "incarnation": 4}`, 3, false},
		{`{"code": 137, "node": "n1"}`, 3, false},
	} {
		p := filepath.Join(dir, "exit")
		if err := os.WriteFile(p, []byte(tc.record), 0o644); err != nil {
			t.Fatal(err)
		}
		st, err := ReadExit(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := st.Older(tc.cur); got != tc.want {
			t.Errorf("%s at incarnation %d: older %v, want %v", tc.record, tc.cur, got, tc.want)
		}
	}
}

// TestSignalRefusesWhatTheNamespaceInitDrops: a job's root is the init of its PID namespace, and the kernel
// drops a signal sent to it from outside unless it handles it (SIGKILL and SIGSTOP excepted). Signal
// reported such a SIGTERM (ftwrap's, ftctl's) as sent while the job never got it: now it says so, and a
// root that handles the signal still gets it.
func TestSignalRefusesWhatTheNamespaceInitDrops(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: a new PID namespace needs root")
	}
	start := func(script string) *exec.Cmd {
		cmd := exec.Command("/bin/sh", "-c", script)
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
		})
		if _, err := bufio.NewReader(out).ReadString('\n'); err != nil { // its trap is in place
			t.Fatalf("%s: %v", script, err)
		}
		return cmd
	}
	cg := t.TempDir()
	plain := start(`echo ready; while :; do sleep 1; done`)
	trapped := start(`trap 'exit 7' TERM; echo ready; while :; do sleep 1; done`)
	procs := fmt.Sprintf("%d\n%d\n", plain.Process.Pid, trapped.Process.Pid)
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(procs), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Signal(plain.Process.Pid, cg, unix.SIGTERM); !errors.Is(err, ErrNotDelivered) {
		t.Fatalf("SIGTERM to a namespace init without a handler: %v, want ErrNotDelivered (the kernel drops it)", err)
	}
	testenv.StillRuns(t, plain)
	if err := Signal(trapped.Process.Pid, cg, unix.SIGTERM); err != nil {
		t.Fatalf("SIGTERM to a namespace init that handles it: %v", err)
	}
	if err := trapped.Wait(); trapped.ProcessState.ExitCode() != 7 {
		t.Fatalf("the init that traps SIGTERM ended with %v, want its exit 7", err)
	}
	if err := Signal(plain.Process.Pid, cg, unix.SIGKILL); err != nil {
		t.Fatalf("SIGKILL to a namespace init: %v", err)
	}
	testenv.WaitSignalled(t, plain, syscall.SIGKILL)
}
