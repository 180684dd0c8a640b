package agentapi

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
)

// TestAPIStartJobLimitsOnlyFromCallersProcess: a job gets the resource limits of the process that asked
// for it, read through the PID SO_PEERCRED gave at connect. That PID may name a process of another user by
// the time the request is served (the caller exec'd a set-uid program that raised its limits, as sudo
// does before it asks for a password; or it exited and the PID was reused): the job must not get that
// process's limits, which the user could never set itself.
func TestAPIStartJobLimitsOnlyFromCallersProcess(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (reads the limits of root's processes, as the agent does)")
	}
	start := func(t *testing.T, uid uint32, nofile uint64) *exec.Cmd {
		t.Helper()
		// Limits set by the process itself, then its program: prlimit(2) on another uid's process may
		// need CAP_SYS_RESOURCE, which a container may not give.
		cmd := exec.Command("sh", "-c", "ulimit -n "+strconv.FormatUint(nofile, 10)+" && exec sleep 60")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); { // until the limit is set (a loaded host starts sh late)
			var got unix.Rlimit
			if unix.Prlimit(cmd.Process.Pid, unix.RLIMIT_NOFILE, nil, &got) == nil && got.Max == nofile {
				return cmd
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("process %d did not set its RLIMIT_NOFILE to %d", cmd.Process.Pid, nofile)
		return nil
	}
	nofile := func(t *testing.T, j agent.Job) uint64 {
		for _, l := range j.Spec.Limits {
			if l.Resource == unix.RLIMIT_NOFILE {
				return l.Max
			}
		}
		return 0
	}
	h := Handler(newFakeBackend(t), DefaultLimits())
	post := func(t *testing.T, cred *unix.Ucred) agent.Job {
		t.Helper()
		w := call(t, h, cred, "POST", "/v1/jobs?host=node2", `{"name":"lim","argv":["true"]}`)
		if w.Code != http.StatusCreated {
			t.Fatalf("status %d: %s", w.Code, w.Body)
		}
		var j agent.Job
		if err := json.Unmarshal(w.Body.Bytes(), &j); err != nil {
			t.Fatal(err)
		}
		return j
	}
	// The caller's own process: its limits go to the job. (Root's: reading the limits of another uid's
	// process needs CAP_SYS_RESOURCE, which the agent has but a test's container may not.)
	own := start(t, 0, 4321)
	if got := nofile(t, post(t, &unix.Ucred{Uid: 0, Gid: 0, Pid: int32(own.Process.Pid)})); got != 4321 {
		t.Errorf("job of the caller's own process: RLIMIT_NOFILE hard limit %d, want 4321", got)
	}
	// The PID names root's process, with limits far above a session's.
	var mine unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &mine); err != nil || mine.Max <= 4321 {
		t.Skipf("SKIPPED: this process's RLIMIT_NOFILE hard limit %d (%v) is not above the user's", mine.Max, err)
	}
	rootsMax := mine.Max
	roots := start(t, 0, rootsMax)
	w := call(t, h, &unix.Ucred{Uid: asOwner.Uid, Gid: asOwner.Gid, Pid: int32(roots.Process.Pid)}, "POST", "/v1/jobs?host=node2", `{"name":"lim","argv":["true"]}`)
	if w.Code == http.StatusCreated {
		t.Errorf("job of uid %d started while its caller's PID names uid 0's process %d (RLIMIT_NOFILE hard limit %d): %s; want it refused",
			asOwner.Uid, roots.Process.Pid, rootsMax, w.Body)
	}
}

// TestAPIStartJobRefusedWithoutCallersLimits: a user's job whose caller's limits cannot be read (its
// process is gone: the user connected, sent the request and exited, leaving the answer to a child holding
// the socket) is refused. Started with a session's limits instead, it had a hard RLIMIT_NOFILE of 524288
// and the agent's own limits on everything else (processes, CPU time, file size, address space), above
// what the user's own could ever be raised to.
func TestAPIStartJobRefusedWithoutCallersLimits(t *testing.T) {
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	var started []agent.JobSpec
	fb := &startRecorder{fakeBackend: newFakeBackend(t), started: &started}
	h := Handler(fb, DefaultLimits())
	w := call(t, h, &unix.Ucred{Uid: asOwner.Uid, Gid: asOwner.Gid, Pid: int32(gone.Process.Pid)}, "POST", "/v1/jobs?host=node2", `{"name":"lim","argv":["true"]}`)
	if w.Code == http.StatusCreated || len(started) != 0 {
		t.Fatalf("job of uid %d whose process %d is gone: status %d %s, started with limits %v; want it refused",
			asOwner.Uid, gone.Process.Pid, w.Code, w.Body, started)
	}
}

// startRecorder is a fakeBackend that records the specs it is asked to start.
type startRecorder struct {
	*fakeBackend
	started *[]agent.JobSpec
}

func (s *startRecorder) StartJobOn(ctx context.Context, host string, spec agent.JobSpec, uid, gid uint32) (*agent.Job, error) {
	*s.started = append(*s.started, spec)
	return s.fakeBackend.StartJobOn(ctx, host, spec, uid, gid)
}

// TestAPIStartJobUmaskFromCallersProcess: a job gets the umask of the process that asked for it, read from
// that process, whatever the client sends: the shim gave the job none, and it ran with the agent's unit's
// UMask=0077 (every file it made 0600, every directory 0700, where its user's shell makes 0644 and 0755).
func TestAPIStartJobUmaskFromCallersProcess(t *testing.T) {
	for _, tc := range []struct {
		umask string
		want  uint32
	}{{"027", 0o027}, {"000", 0}, {"077", 0o077}} {
		t.Run(tc.umask, func(t *testing.T) {
			cmd := exec.Command("sh", "-c", "umask "+tc.umask+" && exec sleep 60")
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			for deadline := time.Now().Add(time.Minute); ; { // until sh has set it (a loaded host starts sh late)
				b, _ := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/status")
				if strings.Contains(string(b), "\nUmask:\t0"+tc.umask+"\n") && strings.Contains(string(b), "sleep") {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("process %d did not set its umask to %s: %s", cmd.Process.Pid, tc.umask, b)
				}
				time.Sleep(10 * time.Millisecond)
			}
			var started []agent.JobSpec
			fb := &startRecorder{fakeBackend: newFakeBackend(t), started: &started}
			h := Handler(fb, DefaultLimits())
			uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
			// The client's own umask is not taken.
			w := call(t, h, &unix.Ucred{Uid: uid, Gid: gid, Pid: int32(cmd.Process.Pid)}, "POST", "/v1/jobs?host=node2", `{"name":"um","argv":["true"],"umask":511}`)
			if w.Code != http.StatusCreated || len(started) != 1 {
				t.Fatalf("status %d: %s", w.Code, w.Body)
			}
			if got := started[0].Umask; got == nil {
				t.Errorf("job of a caller with umask %s: no umask, want %04o", tc.umask, tc.want)
			} else if *got != tc.want {
				t.Errorf("job of a caller with umask %s: umask %04o, want %04o", tc.umask, *got, tc.want)
			}
		})
	}
}
