package shim

import (
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
