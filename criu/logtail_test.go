package criu

import (
	"bufio"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestLogTail: a failed CRIU run's error carries the log's last error lines and, for a mapping the
// restorer could not make, what the log says of that mapping.
func TestLogTail(t *testing.T) {
	log := `(00.010000) Opening 0x007f90ec427000-0x007f90ec428000 0000000000000000 (41) vma
(00.010001) 6: vma 7f90ec427000 file /tmp/run/tmp/node2/hwloc.sm shared
(00.020000) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.134093) pie: 7: Error (criu/pie/restorer.c:1883): Can't restore 0x7f90ec427000 mapping with 0xfffffffffffffff3
(00.154100) Error (criu/cr-restore.c:2331): Restoring FAILED.
`
	path := filepath.Join(t.TempDir(), "restore.log")
	if err := os.WriteFile(path, []byte(log), 0o600); err != nil {
		t.Fatal(err)
	}
	got := logTail(path)
	if strings.Contains(got, "RLIMIT_NOFILE") {
		t.Errorf("logTail carries the rlimit line CRIU logs at every start without CAP_SYS_RESOURCE:\n%s", got)
	}
	for _, want := range []string{"Restoring FAILED", "Can't restore 0x7f90ec427000", "hwloc.sm shared", "Opening 0x007f90ec427000", "full log: " + path} {
		if !strings.Contains(got, want) {
			t.Errorf("logTail lacks %q:\n%s", want, got)
		}
	}
	if err := os.WriteFile(path, []byte("(00.1) pie: 7: Error (x): Can't restore \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := logTail(path); !strings.Contains(got, "Can't restore") {
		t.Errorf("logTail of a truncated line: %q", got)
	}
	// No error line (CRIU killed mid-run): the last lines say where it stopped.
	if err := os.WriteFile(path, []byte("(00.1) one\n(00.2) two\n(00.3) three\n(00.4) Restoring 7 mappings\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := logTail(path); !strings.Contains(got, "Restoring 7 mappings") || strings.Contains(got, "one") || !strings.Contains(got, "full log: "+path) {
		t.Errorf("logTail of a log without errors: %q", got)
	}
}

// TestDumpErrorInFlight: a dump CRIU refused for a connection waiting in a listen queue is ErrInFlight
// (the agent snapshots the job again once it has accepted: ci of 577c21d, TestUnprotectedPeerOnMember);
// another failure is not.
func TestDumpErrorInFlight(t *testing.T) {
	for _, tc := range []struct {
		name, log string
		inFlight  bool
	}{
		{"in-flight", `(00.020000) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.065527) Error (criu/sk-inet.c:185): inet: In-flight connection (l) for 1f5505
(00.065531) Error (criu/sk-inet.c:186): inet: In-flight connections can be ignored with the --skip-in-flight option.
(00.065628) Error (criu/cr-dump.c:1545): Dump files (pid: 2731) failed with -1
(00.077372) Error (criu/cr-dump.c:1976): Dumping FAILED.
`, true},
		{"another failure", `(00.065628) Error (criu/files-reg.c:1): Can't lookup mount=22 for fd=3 path=/x
(00.077372) Error (criu/cr-dump.c:1976): Dumping FAILED.
`, false},
		{"no log", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "dump.log")
			if tc.log != "" {
				if err := os.WriteFile(path, []byte(tc.log), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			cause := errors.New("criu swrk failed: exit status 1")
			err := dumpError(2731, cause, path)
			if got := errors.Is(err, ErrInFlight); got != tc.inFlight {
				t.Errorf("errors.Is(%v, ErrInFlight) = %v, want %v", err, got, tc.inFlight)
			}
			if !errors.Is(err, cause) || !strings.Contains(err.Error(), "criu dump of pid 2731") {
				t.Errorf("error %q does not carry the dump's pid and cause", err)
			}
		})
	}
}

// TestMountpointGone: a restore CRIU failed on a mount point that went from the host after the images were
// pruned is told apart (the agent prunes again and restores once more: ci231, TestRestoredPtyIndexIsFree,
// when a parallel test removed its mount during the restore); another failure is not.
func TestMountpointGone(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"a mount point gone", errors.New(`job pty-63d4266b: criu restore from /var/lib/ftkit/x: operation failed (msg:Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
 err:0)
criu swrk failed: exit status 1
  (00.126673)      1: Error (criu/mount-v2.c:634): mnt-v2: Can't stat mountpoint /tmp/.criu.mntns.RIuFmj/mnt-0000000158/run/ftkit-test-gone-t35a90c: No such file or directory
  (00.137085) Error (criu/cr-restore.c:2332): Restoring FAILED.`), true},
		{"another failure", errors.New(`criu swrk failed: exit status 1
  (00.137085) Error (criu/cr-restore.c:2332): Restoring FAILED.`), false},
		{"none", nil, false},
	} {
		if got := MountpointGone(tc.err); got != tc.want {
			t.Errorf("%s: MountpointGone = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestStartLazyPagesWaitsForItsDaemon: the socket a killed daemon of an earlier restore from the same
// directory left (the agent restores again once a mount went) is not taken for the new daemon's, and a
// daemon that ends before it listens fails the start at once, not after the deadline.
func TestStartLazyPagesWaitsForItsDaemon(t *testing.T) {
	for _, tc := range []struct {
		name   string
		script string // the daemon; $3 is the images directory
		stale  bool   // an earlier daemon's socket is there
		want   string // "" if it starts
	}{
		{"listens", "touch \"$3/lazy-pages.socket\"\nexec sleep 600\n", true, ""},
		{"fails, an earlier socket there", "echo 'Error (criu/uffd.c:1): no images' >\"$3/lazy-pages.log\"\nexit 1\n", true, "ended (exit status 1) before it listened"},
		{"fails", "exit 1\n", false, "ended (exit status 1) before it listened"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			fake := filepath.Join(t.TempDir(), "criu")
			if err := os.WriteFile(fake, []byte("#!/bin/sh\n"+tc.script), 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.stale {
				l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, lazyPagesSocket), Net: "unix"})
				if err != nil {
					t.Fatal(err)
				}
				l.SetUnlinkOnClose(false) // as a killed daemon leaves it
				l.Close()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // below the 10 s deadline
			defer cancel()
			cmd, err := Client{Binary: fake}.StartLazyPages(ctx, dir)
			if cmd != nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("StartLazyPages: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("StartLazyPages = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

// TestLogTailHoldsNotTheLog: reading a failed run's log for its error holds what the error carries, not
// the log. At log level 4 CRIU logs each file of the job by its name, and a job holding many files with long
// names makes a log of gigabytes (which a job's user can make fail at will, an unaccepted connection): the
// old code held every line of it (logTail) or the whole file (dumpError) in the root daemon's memory.
func TestLogTailHoldsNotTheLog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "dump.log")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	line := "(00.010001) fdinfo: Dumping path for 5 fd via self 17 [/home/u/" + strings.Repeat("x", 200) + "]\n"
	w := bufio.NewWriter(f)
	w.WriteString("(00.000100) pie: 7: Error (criu/pie/restorer.c:1883): Can't restore 0x7f90ec427000 mapping with 0xfffffffffffffff3\n")
	for n := 0; n < 32<<20; n += len(line) {
		w.WriteString(line)
	}
	w.WriteString("(00.065527) Error (criu/sk-inet.c:185): inet: In-flight connection (l) for 1f5505\n")
	w.WriteString("(00.077372) Error (criu/cr-dump.c:1976): Dumping FAILED.\n")
	if err := errors.Join(w.Flush(), f.Close()); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		read func() string
		want string
	}{
		{"logTail", func() string { return logTail(path) }, "Dumping FAILED"},
		{"dumpError", func() string {
			err := dumpError(1, errors.New("criu swrk failed"), path)
			if !errors.Is(err, ErrInFlight) {
				t.Errorf("dumpError of a log naming an in-flight connection = %v, want ErrInFlight", err)
			}
			return err.Error()
		}, "Dumping FAILED"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			got := tc.read()
			runtime.ReadMemStats(&after)
			if !strings.Contains(got, tc.want) {
				t.Errorf("%s lacks %q:\n%s", tc.name, tc.want, got)
			}
			if n := after.TotalAlloc - before.TotalAlloc; n > 4<<20 {
				t.Errorf("%s of a 32 MiB log allocated %d MiB: it holds the log, not what it says", tc.name, n>>20)
			}
		})
	}
}
