package criu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/internal/testenv"
)

// TestMain lets the test binary play a CRIU of any version: go-criu runs `criu swrk FD` and asks for
// the version over the inherited socket. It also plays the TCP sender that TestLiveDumpSelectsNoRepairQueue
// dumps, the process TestSharedMappingRemappedWritable dumps, the listener TestBindAsOwner dumps and
// the FIFO holder TestOpenAsOwner dumps.
func TestMain(m *testing.M) {
	switch os.Getenv("FTKIT_CRIU_TEST_ROLE") {
	case senderRole:
		os.Exit(runSender(os.Getenv("FTKIT_ADDR")))
	case remapRole:
		os.Exit(runRemap(os.Getenv("FTKIT_DIR")))
	case listenerRole:
		os.Exit(runListener(os.Getenv("FTKIT_SOCK"), os.Getenv("FTKIT_DIR")))
	case fifoRole:
		os.Exit(runFIFOHolder(os.Getenv("FTKIT_FIFO"), os.Getenv("FTKIT_DIR")))
	case restorerRole:
		os.Exit(runRestorer(os.Getenv("FTKIT_DIR")))
	}
	if v := os.Getenv("FTKIT_FAKE_CRIU_VERSION"); v != "" && len(os.Args) == 3 && os.Args[1] == "swrk" {
		os.Exit(fakeSwrk(v, os.Args[2]))
	}
	if d := os.Getenv("FTKIT_FAKE_CRIU_DUMP"); d != "" && len(os.Args) == 3 && os.Args[1] == "swrk" {
		os.Exit(fakeDumpSwrk(d, os.Args[2]))
	}
	if d := os.Getenv("FTKIT_FAKE_CRIU_SLOW"); d != "" && len(os.Args) == 3 && os.Args[1] == "swrk" {
		os.Exit(fakeSlowSwrk(d, os.Args[2]))
	}
	if d := os.Getenv("FTKIT_FAKE_CRIU_LOCKED"); d != "" && len(os.Args) == 3 && os.Args[1] == "swrk" {
		os.Exit(fakeLockedSwrk(d, os.Args[2]))
	}
	os.Exit(m.Run())
}

// fakeRequest reads go-criu's one request on the swrk socket fdArg names.
func fakeRequest(fdArg string) (*os.File, error) {
	fd, err := strconv.Atoi(fdArg)
	if err != nil {
		return nil, err
	}
	sk := os.NewFile(uintptr(fd), "swrk")
	_, err = sk.Read(make([]byte, 4096))
	return sk, err
}

func fakeSwrk(version, fdArg string) int {
	sk, err := fakeRequest(fdArg)
	if err != nil {
		return 3
	}
	parts := strings.Split(version, ".")
	num := func(i int) *int32 { n, _ := strconv.Atoi(parts[i]); return proto.Int32(int32(n)) }
	resp, _ := proto.Marshal(&rpc.CriuResp{
		Type:    rpc.CriuReqType_VERSION.Enum(),
		Success: proto.Bool(true),
		Version: &rpc.CriuVersion{MajorNumber: num(0), MinorNumber: num(1), Sublevel: num(2)},
	})
	if g := os.Getenv("FTKIT_FAKE_CRIU_GITID"); g != "" { // a CRIU built from a git tree
		resp, _ = proto.Marshal(&rpc.CriuResp{
			Type:    rpc.CriuReqType_VERSION.Enum(),
			Success: proto.Bool(true),
			Version: &rpc.CriuVersion{MajorNumber: num(0), MinorNumber: num(1), Sublevel: num(2), Gitid: proto.String(g)},
		})
	}
	if _, err := sk.Write(resp); err != nil {
		return 4
	}
	return 0
}

func TestVersionString(t *testing.T) {
	for v, want := range map[Version]string{40201: "4.2.1", 31701: "3.17.1", 40200: "4.2.0", 100000: "10.0.0"} {
		if got := v.String(); got != want {
			t.Errorf("Version(%d) = %q, want %q", int(v), got, want)
		}
	}
}

func TestRequireVersions(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		fake    string
		wantErr string
	}{
		{fake: "3.17.1", wantErr: "is CRIU 3.17.1, ftkit needs 4.2.0 or newer (4.2.1 is tested): run `make setup`"},
		{fake: "4.1.1", wantErr: "is CRIU 4.1.1, ftkit needs 4.2.0"},
		{fake: "4.2.1"},
		{fake: "5.0.0"},
	}
	for _, tt := range tests {
		t.Run(tt.fake, func(t *testing.T) {
			t.Setenv("FTKIT_FAKE_CRIU_VERSION", tt.fake)
			_, v, err := Require(self)
			if v.String() != tt.fake {
				t.Errorf("version %s, want %s", v, tt.fake)
			}
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrTooOld) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want ErrTooOld saying %q", err, tt.wantErr)
			}
		})
	}
}

// TestRequireVersionOfAGitBuild: a CRIU built from a git tree reports its release and a git id (`git
// describe`, "v4.1.1" for the release's tag). go-criu took such a build for the next minor release, and
// Require accepted a CRIU 4.1.1 built from its tag as 4.2.0: every dump of a TCP socket then aborted on
// Linux 6.16+.
func TestRequireVersionOfAGitBuild(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		fake, gitid string
		tooOld      bool
	}{
		{"4.1.1", "v4.1.1", true},
		{"4.1.1", "v4.1.1-12-g0123abc", true},
		{"4.2.1", "v4.2.1", false},
	} {
		t.Run(tt.gitid, func(t *testing.T) {
			t.Setenv("FTKIT_FAKE_CRIU_VERSION", tt.fake)
			t.Setenv("FTKIT_FAKE_CRIU_GITID", tt.gitid)
			_, v, err := Require(self)
			if v.String() != tt.fake {
				t.Errorf("CRIU %s built from git (%s) is taken for %s", tt.fake, tt.gitid, v)
			}
			if errors.Is(err, ErrTooOld) != tt.tooOld {
				t.Fatalf("Require of CRIU %s built from git (%s) = %v, want ErrTooOld: %v", tt.fake, tt.gitid, err, tt.tooOld)
			}
		})
	}
}

// A binary that is not CRIU must give a clear error, not a version.
func TestRequireRejectsNonCriu(t *testing.T) {
	fake := filepath.Join(t.TempDir(), "criu")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Require(fake); err == nil {
		t.Fatal("Require accepted a binary that is not CRIU")
	}
	if _, err := FindBinary(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("FindBinary accepted a missing path")
	}
}

func TestRequireInstalled(t *testing.T) {
	testenv.RequireKernel(t, "CRIU, which needs root to say its version")
	bin, v, err := Require("")
	if err != nil {
		t.Fatalf("installed CRIU not usable: %v", err)
	}
	if v < MinVersion || errors.Is(err, ErrTooOld) {
		t.Fatalf("%s reports %s", bin, v)
	}
	t.Logf("%s is CRIU %s", bin, v)
}

// TestDumpInNetns: a dump with DumpOptions.Netns runs CRIU inside that namespace, so a namespace that
// cannot be entered fails the dump before CRIU is started, naming it.
func TestDumpInNetns(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-such-netns")
	_, err := Client{Binary: "/nonexistent/criu"}.Dump(t.Context(), DumpOptions{PID: 1, ImagesDir: t.TempDir(), Netns: missing})
	if err == nil || !strings.Contains(err.Error(), "open network namespace "+missing) {
		t.Fatalf("Dump in %s = %v, want an error opening that namespace", missing, err)
	}
}

// fakeDumpSwrk answers one request, a dump, with a failure, after it left a file named ran in dir.
func fakeDumpSwrk(dir, fdArg string) int {
	sk, err := fakeRequest(fdArg)
	if err != nil {
		return 3
	}
	if err := os.WriteFile(filepath.Join(dir, "ran"), nil, 0o600); err != nil {
		return 4
	}
	resp, _ := proto.Marshal(&rpc.CriuResp{Type: rpc.CriuReqType_DUMP.Enum(), Success: proto.Bool(false)})
	if _, err := sk.Write(resp); err != nil {
		return 5
	}
	return 0
}

// A dump raises the caller's priority (Client.Raise) before CRIU runs and lowers it once CRIU is done,
// also when the dump fails.
func TestDumpRaisesWhileCRIURuns(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	t.Setenv("FTKIT_FAKE_CRIU_DUMP", work)
	ran := filepath.Join(work, "ran")
	var raised, lowered int
	c := Client{Binary: self, Raise: func() func() {
		raised++
		if _, err := os.Stat(ran); err == nil {
			t.Error("raised after CRIU ran")
		}
		return func() {
			lowered++
			if _, err := os.Stat(ran); err != nil {
				t.Errorf("lowered before CRIU ran: %v", err)
			}
		}
	}}
	_, err = c.Dump(t.Context(), DumpOptions{PID: os.Getpid(), ImagesDir: t.TempDir(), LeaveRunning: true})
	if err == nil {
		t.Fatal("the fake CRIU's failed dump returned no error")
	}
	if raised != 1 || lowered != 1 {
		t.Errorf("raised %d and lowered %d times, want 1 and 1", raised, lowered)
	}
}

// fakeSlowSwrk answers one request, a dump, with a failure once a file named stop exists in dir; it leaves a
// file named ran there as it starts (holding its pid), and one named done as it answers.
func fakeSlowSwrk(dir, fdArg string) int {
	sk, err := fakeRequest(fdArg)
	if err != nil {
		return 3
	}
	if err := os.WriteFile(filepath.Join(dir, "ran"), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return 4
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "stop")); err == nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := os.WriteFile(filepath.Join(dir, "done"), nil, 0o600); err != nil {
		return 4
	}
	resp, _ := proto.Marshal(&rpc.CriuResp{Type: rpc.CriuReqType_DUMP.Enum(), Success: proto.Bool(false)})
	if _, err := sk.Write(resp); err != nil {
		return 5
	}
	return 0
}

// TestDumpCancelledKillsCRIU: a dump whose context ends while CRIU runs kills CRIU and returns only once it
// is gone, and the priority raised for it (and the cgroup yard it reads) is held until then. The old code
// returned at once and left CRIU running in the background: its caller (dump.Take) then thawed the job and
// removed the images directory under a CRIU that went on dumping, and could freeze the job again.
func TestDumpCancelledKillsCRIU(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	fake := newSlowCRIU(t)
	lowered := make(chan bool, 1) // whether CRIU still ran when the priority was lowered
	c := Client{Binary: self, Raise: func() func() {
		return func() { lowered <- running(fake.pid()) }
	}}
	if _, err := c.Dump(fake.cancelOnceStarted(t), DumpOptions{PID: os.Getpid(), ImagesDir: t.TempDir(), LeaveRunning: true}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Dump with its context cancelled while CRIU runs = %v, want context.Canceled", err)
	}
	fake.checkKilled(t, "dump")
	select {
	case running := <-lowered:
		if running {
			t.Fatal("the priority raised for CRIU was lowered while CRIU still ran")
		}
	default:
		t.Fatal("the dump returned before the priority raised for its CRIU was lowered")
	}
}

// TestTimeoutSeconds: CRIU's Timeout option bounds only its freeze of the tasks: a dump's deadline minutes
// away (checkpoint.dump_timeout) leaves it at CRIU's default 10 s, where the old code raised it to the whole
// deadline and a freeze that hung kept the job half stopped that long.
func TestTimeoutSeconds(t *testing.T) {
	for _, tc := range []struct {
		in   time.Duration // 0: no deadline
		want uint32
	}{{0, 0}, {10 * time.Minute, 0}, {11 * time.Second, 0}, {5 * time.Second, 4}, {100 * time.Millisecond, 1}} {
		ctx := t.Context()
		if tc.in > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, tc.in)
			defer cancel()
		}
		if got := timeoutSeconds(ctx); got != tc.want {
			t.Errorf("timeoutSeconds with a deadline in %s = %d, want %d", tc.in, got, tc.want)
		}
	}
}

// The agent runs CRIU as root at every dump and restore (and --check-config asks it for its version): a
// binary another user can change (`criu =` pointing at an operator's own build, a directory of a user's on
// the agent's PATH) would run that user's code as root. Require refuses it, as sitecmd.CheckProgram refuses
// a site's command, before running it at all.
func TestRequireRefusesACRIUOthersCanChange(t *testing.T) {
	for _, tt := range []struct {
		name    string
		setup   func(t *testing.T, dir, bin string)
		wantErr string
	}{
		{"writable by others", func(t *testing.T, dir, bin string) {
			if err := os.Chmod(bin, 0o777); err != nil {
				t.Fatal(err)
			}
		}, "chmod go-w"},
		{"in a directory others can write", func(t *testing.T, dir, bin string) {
			if err := os.Chmod(dir, 0o777); err != nil {
				t.Fatal(err)
			}
		}, "chmod go-w"},
		{"owned by another user", func(t *testing.T, dir, bin string) {
			if os.Geteuid() != 0 {
				t.Skip("SKIPPED: giving a file to another user needs root")
			}
			if err := os.Chown(bin, 65534, 65534); err != nil {
				t.Fatal(err)
			}
		}, "owned by uid 65534"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "criu")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			ran := filepath.Join(t.TempDir(), "ran")
			bin := filepath.Join(dir, "criu")
			if err := os.WriteFile(bin, []byte("#!/bin/sh\ntouch "+ran+"\nexit 1\n"), 0o755); err != nil {
				t.Fatal(err)
			}
			tt.setup(t, dir, bin)
			_, _, err := Require(bin)
			if _, statErr := os.Stat(ran); statErr == nil {
				t.Errorf("Require ran %s, which others can change, as this process (root in the agent)", bin)
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want a refusal saying %q", err, tt.wantErr)
			}
		})
	}
}
