package shim

import (
	"fmt"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
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
