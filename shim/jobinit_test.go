package shim

import (
	"reflect"
	"testing"
)

func TestParseMountinfoAndPrune(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		want   []mountEntry
		pruned []bool
		bad    bool
	}{
		{
			name: "host mounts, another lab's netns, a restore's cgroup yard",
			in: `26 1 254:0 / / rw,relatime - ext4 /dev/vda rw
21 26 0:20 / /proc rw,relatime - proc proc rw
25 23 0:23 / /dev/pts rw,relatime shared:3 master:1 - devpts devpts rw,mode=600
41 26 0:4 net:[4026532181] /run/netns/tc46b0a-node1 rw - nsfs nsfs rw
42 26 0:38 / /var/lib/ftkit/labs/x/restore/j-1/.criu.cgyard.nlTEiT rw,relatime - tmpfs none rw
45 42 0:35 / /var/lib/ftkit/labs/x/restore/j-1/.criu.cgyard.nlTEiT/pids rw,relatime - cgroup none rw,pids
`,
			want: []mountEntry{
				{"/", "ext4", "rw"}, {"/proc", "proc", "rw"}, {"/dev/pts", "devpts", "rw,mode=600"}, {"/run/netns/tc46b0a-node1", "nsfs", "rw"},
				{"/var/lib/ftkit/labs/x/restore/j-1/.criu.cgyard.nlTEiT", "tmpfs", "rw"},
				{"/var/lib/ftkit/labs/x/restore/j-1/.criu.cgyard.nlTEiT/pids", "cgroup", "rw,pids"},
			},
			pruned: []bool{false, false, false, true, true, true},
		},
		{
			name:   "escaped mount point",
			in:     `50 26 0:40 / /mnt/a\040b\134c rw - tmpfs tmpfs rw` + "\n",
			want:   []mountEntry{{`/mnt/a b\c`, "tmpfs", "rw"}},
			pruned: []bool{false},
		},
		{name: "no separator", in: "50 26 0:40 / /mnt rw tmpfs tmpfs rw\n", bad: true},
		{
			name:   "no super options",
			in:     "50 26 0:40 / /mnt rw - tmpfs tmpfs\n",
			want:   []mountEntry{{"/mnt", "tmpfs", ""}},
			pruned: []bool{false},
		},
		{name: "nothing after the separator", in: "50 26 0:40 / /mnt rw -\n", bad: true},
		{name: "short", in: "50 26\n", bad: true},
		{name: "empty", in: "", want: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseMountinfo([]byte(tt.in))
			if tt.bad {
				if err == nil {
					t.Fatalf("parsed %+v, want an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
			for i, m := range got {
				if p := prunedMount(m); p != tt.pruned[i] {
					t.Errorf("prunedMount(%+v) = %v, want %v", m, p, tt.pruned[i])
				}
			}
		})
	}
}

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`: "/plain", `/a\040b`: "/a b", `/tab\011x`: "/tab\tx", `/nl\012`: "/nl\n",
		`/trailing\04`: `/trailing\04`, `/not\999octal`: `/not\999octal`, `\`: `\`,
	} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}

// Mount points in mountinfo may carry names a user chose (a FUSE mount under the user's home): the parser
// must not panic on any line, and every entry it returns has a mount point and a file system type.
func FuzzParseMountinfo(f *testing.F) {
	f.Add([]byte("26 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"))
	f.Add([]byte("41 26 0:4 net:[4026532181] /run/netns/a\\040b rw shared:1 - nsfs nsfs rw\n"))
	f.Add([]byte("50 26 0:40 / /mnt rw -\n"))
	f.Add([]byte("\\\\\\0 - - - - - - -\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, err := parseMountinfo(b)
		if err != nil {
			return
		}
		for _, m := range ms {
			if m.FSType == "" {
				t.Fatalf("entry %+v without a file system type from %q", m, b)
			}
		}
	})
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
