package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/cgroupv2"
)

func TestPrunedMount(t *testing.T) {
	// What the host's mountinfo holds: its own mounts, another lab's network namespace, a restore's
	// cgroup yard running at that instant.
	in := `26 1 254:0 / / rw,relatime - ext4 /dev/vda rw
21 26 0:20 / /proc rw,relatime - proc proc rw
25 23 0:23 / /dev/pts rw,relatime shared:3 master:1 - devpts devpts rw,mode=600
41 26 0:4 net:[4026532181] /run/netns/tc46b0a-node1 rw - nsfs nsfs rw
42 26 0:38 / /var/lib/ftkit/labs/x/restore/j-1/.criu.cgyard.nlTEiT rw,relatime - tmpfs none rw
45 42 0:35 / /var/lib/ftkit/labs/x/restore/j-1/.criu.cgyard.nlTEiT/pids rw,relatime - cgroup none rw,pids
50 26 0:40 / /mnt/a\040b rw - tmpfs tmpfs rw
`
	mounts, err := mountinfo.GetMountsFromReader(strings.NewReader(in), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []bool{false, false, false, true, true, true, false}
	if len(mounts) != len(want) {
		t.Fatalf("%d mounts, want %d", len(mounts), len(want))
	}
	for i, m := range mounts {
		if p := prunedMount(m); p != want[i] {
			t.Errorf("prunedMount(%s %s) = %v, want %v", m.FSType, m.Mountpoint, p, want[i])
		}
	}
}

func TestWithoutMPTCP(t *testing.T) {
	tests := []struct {
		name    string
		in, out []string
	}{
		{"no GODEBUG", []string{"PATH=/bin"}, []string{"PATH=/bin", "GODEBUG=multipathtcp=0"}},
		{"empty GODEBUG", []string{"GODEBUG="}, []string{"GODEBUG=multipathtcp=0"}},
		{"other settings kept", []string{"GODEBUG=gctrace=1", "A=b"}, []string{"GODEBUG=multipathtcp=0,gctrace=1", "A=b"}},
		{"the job's own choice kept", []string{"GODEBUG=gctrace=1,multipathtcp=1"}, []string{"GODEBUG=gctrace=1,multipathtcp=1"}},
		{"only the first GODEBUG, the one Go reads", []string{"GODEBUG=x=1", "GODEBUG=y=1"}, []string{"GODEBUG=multipathtcp=0,x=1", "GODEBUG=y=1"}},
		{"nil", nil, []string{"GODEBUG=multipathtcp=0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := withoutMPTCP(tt.in); !reflect.DeepEqual(got, tt.out) {
				t.Fatalf("withoutMPTCP(%q) = %q, want %q", tt.in, got, tt.out)
			}
		})
	}
}

// TestResetOOMScoreAdj: a negative OOM score adjustment (the agent's unit gives the agent -500, which its
// jobs inherited) is raised to 0; a positive one is kept (lowering it needs CAP_SYS_RESOURCE). Run in a
// child process: the adjustment is the process's.
func TestResetOOMScoreAdj(t *testing.T) {
	if v := os.Getenv("OOM_TEST_START"); v != "" {
		if err := os.WriteFile("/proc/self/oom_score_adj", []byte(v), 0); err != nil {
			t.Skipf("cannot set this process's adjustment to %s: %v", v, err) // -500 without CAP_SYS_RESOURCE
		}
		if err := resetOOMScoreAdj(); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile("/proc/self/oom_score_adj")
		fmt.Print("OOM_ADJ=" + strings.TrimSpace(string(b)))
		return
	}
	ran := 0
	for _, tc := range []struct{ start, want string }{{"300", "300"}, {"-500", "0"}} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestResetOOMScoreAdj$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "OOM_TEST_START="+tc.start)
		out, err := cmd.CombinedOutput()
		switch {
		case err != nil:
			t.Errorf("child starting at %s: %v\n%s", tc.start, err, out)
		case strings.Contains(string(out), "SKIP"):
			t.Logf("from %s: not run here (%s)", tc.start, strings.TrimSpace(string(out)))
		case !strings.Contains(string(out), "OOM_ADJ="+tc.want):
			t.Errorf("from %s: child says %q, want OOM_ADJ=%s", tc.start, out, tc.want)
		default:
			ran++
		}
	}
	if ran == 0 {
		t.Error("no case could run: this process cannot even raise its own OOM score adjustment")
	}
}

// jobStatus runs the shim as the agent would, through wrap (a command that execs its last argument, the
// shim, as the agent's unit does: with what the unit gives it), on a job of uid 65534 with umask umask that
// prints its /proc/self/status line field; it returns the line's value. It skips where the shim cannot run.
func jobStatus(t *testing.T, wrap []string, field string, umask *uint32) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: the shim starts a job in new PID and mount namespaces and drops to uid 65534: needs root")
	}
	parent, err := cgroupv2.ProcessDir(0)
	if err != nil {
		t.Skipf("SKIPPED: no cgroup v2 directory of this process to start the job in: %v", err)
	}
	cg, err := os.MkdirTemp(parent, "ftkit-shim-status-")
	if err != nil {
		t.Skipf("SKIPPED: cannot make a cgroup for the job under %s: %v", parent, err)
	}
	t.Cleanup(func() { os.Remove(cg) })
	jobDir := filepath.Join(t.TempDir(), "job")
	if err := os.Mkdir(jobDir, 0o755); err != nil {
		t.Fatal(err)
	}
	spec := Spec{
		JobID: "status-00000001", Mode: ModeStart, Argv: []string{"/bin/grep", "^" + field + ":", "/proc/self/status"},
		Dir: "/", UID: 65534, GID: 65534, Stdout: filepath.Join(jobDir, "stdout"), Stderr: filepath.Join(jobDir, "stderr"),
		Cgroup: cg, ExitFile: filepath.Join(jobDir, "exit"), Node: "n", Umask: umask,
	}
	in, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(wrap[0], append(wrap[1:], self)...)
	cmd.Env = append(os.Environ(), roleEnv+"="+shimRole)
	cmd.Stdin = bytes.NewReader(in)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("shim: %v (report %q)", err, out.String())
	}
	if st, err := ReadExit(spec.ExitFile); err != nil || st.Code != 0 {
		b, _ := os.ReadFile(spec.Stderr)
		t.Fatalf("job ended with %+v, %v (report %q, stderr %q)", st, err, out.String(), b)
	}
	b, err := os.ReadFile(spec.Stdout)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(strings.TrimPrefix(string(b), field+":"))
}

// TestJobStartsWithDefaultSignals: the shim ignores SIGHUP and SIGINT (cmd/ftagent: it outlives the agent's
// terminal), and an ignored signal stays ignored across fork and exec: the job's program must not start
// with them ignored, or Ctrl-C forwarded by ftwrap and every SIGINT or SIGHUP inside the job go nowhere (a
// shell cannot even trap a signal ignored on entry, and Python installs no KeyboardInterrupt). Run as the
// shim is, with those two signals ignored, on a real job of uid 65534.
func TestJobStartsWithDefaultSignals(t *testing.T) {
	// The shim with SIGHUP and SIGINT ignored, as `ftagent shim` ignores them (signal.Ignore).
	got := jobStatus(t, []string{"/bin/sh", "-c", `trap "" HUP INT; exec "$0"`}, "SigIgn", nil)
	mask, err := strconv.ParseUint(got, 16, 64)
	if err != nil {
		t.Fatalf("job's SigIgn %q: %v", got, err)
	}
	for _, sig := range []unix.Signal{unix.SIGHUP, unix.SIGINT} {
		if mask&(1<<(sig-1)) != 0 {
			t.Errorf("the job's program started with %s ignored (SigIgn %016x): the shim's own disposition leaked into the job", unix.SignalName(sig), mask)
		}
	}
}

// TestJobStartsWithTheCallersUmask: the job's program starts with the umask of the program that asked for
// it (Spec.Umask), 022 if none is given, never the shim's: the agent's unit sets UMask=0077, which the job
// inherited, so every file and directory it made was 0600 or 0700 where the user's shell makes them 0644
// and 0755 (results other users of the group or the next stage of a pipeline could not read). Run as the
// shim is, with umask 0077, on a real job of uid 65534.
func TestJobStartsWithTheCallersUmask(t *testing.T) {
	umask := func(m uint32) *uint32 { return &m }
	for _, tc := range []struct {
		name  string
		umask *uint32
		want  string
	}{
		{"the caller's", umask(0o027), "0027"},
		{"the caller's, none masked", umask(0), "0000"},
		{"none given: login's default", nil, "0022"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The shim with the agent's umask (its unit's UMask=0077).
			if got := jobStatus(t, []string{"/bin/sh", "-c", `umask 077; exec "$0"`}, "Umask", tc.umask); got != tc.want {
				t.Errorf("the job's program started with umask %s, want %s", got, tc.want)
			}
		})
	}
}

// TestJobStartsWithNoInheritableCapability: a set-uid to the job's user clears root's permitted, effective
// and ambient capabilities, not its inheritable ones: a job of an agent that has some (its unit, or the
// session that started it) kept them, and gained them in full by running a program with those file
// capabilities; and a restore refuses a job whose images hold any (checkImageCreds). Run as the shim is,
// with CAP_NET_RAW inheritable, on a real job of uid 65534.
func TestJobStartsWithNoInheritableCapability(t *testing.T) {
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skipf("SKIPPED: no setpriv (util-linux) to give the shim an inheritable capability: %v", err)
	}
	if got := jobStatus(t, []string{"setpriv", "--inh-caps", "+net_raw", "--"}, "CapInh", nil); got != "0000000000000000" {
		t.Errorf("the job's program started with inheritable capabilities %s: root's leaked into the job", got)
	}
}
