package cgroupv2

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

func TestHierarchyPath(t *testing.T) {
	hybrid := []*mountinfo.Info{
		{Mountpoint: "/sys/fs/cgroup/memory", Root: "/", FSType: "cgroup"},
		{Mountpoint: "/sys/fs/cgroup/unified", Root: "/", FSType: "cgroup2"},
	}
	v2 := []*mountinfo.Info{{Mountpoint: "/sys/fs/cgroup", Root: "/", FSType: "cgroup2"}}
	// A container's view: its cgroup namespace's root is a sub-tree, mounted again below it.
	nested := []*mountinfo.Info{
		{Mountpoint: "/sys/fs/cgroup", Root: "/", FSType: "cgroup2"},
		{Mountpoint: "/sys/fs/cgroup/jobs", Root: "/slice/jobs", FSType: "cgroup2"},
	}
	for _, tc := range []struct {
		name   string
		dir    string
		mounts []*mountinfo.Info
		want   string // or, with bad, a part of the error
		bad    bool
	}{
		{"hybrid", "/sys/fs/cgroup/unified/ftkit/rank1-0123abcd", hybrid, "/ftkit/rank1-0123abcd", false},
		{"lab host", "/sys/fs/cgroup/unified/ftkit-lab-t1/spare1/rank1-0123abcd", hybrid, "/ftkit-lab-t1/spare1/rank1-0123abcd", false},
		{"v2 only", "/sys/fs/cgroup/ftkit/a-00000000", v2, "/ftkit/a-00000000", false},
		{"unclean", "/sys/fs/cgroup/ftkit//a-00000000/", v2, "/ftkit/a-00000000", false},
		{"the root itself", "/sys/fs/cgroup", v2, "/", false},
		{"longest mount point wins", "/sys/fs/cgroup/jobs/a-00000000", nested, "/slice/jobs/a-00000000", false},
		{"a v1 hierarchy", "/sys/fs/cgroup/memory/ftkit", hybrid, "on no cgroup v2 mount", true},
		{"a name that only starts like the mount", "/sys/fs/cgroup/unifiedx/a", hybrid, "on no cgroup v2 mount", true},
		{"relative", "ftkit/a-00000000", v2, "must be absolute", true},
		{"no mounts", "/sys/fs/cgroup/ftkit", nil, "on no cgroup v2 mount", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := hierarchyPath(tc.dir, tc.mounts)
			switch {
			case tc.bad && err == nil:
				t.Fatalf("hierarchyPath(%q) = %q; want an error with %q", tc.dir, got, tc.want)
			case tc.bad && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("hierarchyPath(%q): error %q does not contain %q", tc.dir, err, tc.want)
			case !tc.bad && (err != nil || got != tc.want):
				t.Fatalf("hierarchyPath(%q) = %q, %v; want %q", tc.dir, got, err, tc.want)
			}
		})
	}
}

func TestDirOf(t *testing.T) {
	hybrid := []*mountinfo.Info{
		{Mountpoint: "/sys/fs/cgroup/memory", Root: "/", FSType: "cgroup"},
		{Mountpoint: "/sys/fs/cgroup/unified", Root: "/", FSType: "cgroup2"},
	}
	nested := []*mountinfo.Info{
		{Mountpoint: "/sys/fs/cgroup", Root: "/", FSType: "cgroup2"},
		{Mountpoint: "/sys/fs/cgroup/jobs", Root: "/slice/jobs", FSType: "cgroup2"},
	}
	// A container that sees only its own sub-tree.
	container := []*mountinfo.Info{{Mountpoint: "/sys/fs/cgroup", Root: "/slice/c1", FSType: "cgroup2"}}
	for _, tc := range []struct {
		name, path string
		mounts     []*mountinfo.Info
		want       string // or, with bad, a part of the error
		bad        bool
	}{
		{"hybrid", "/ftkit/rank1-0123abcd", hybrid, "/sys/fs/cgroup/unified/ftkit/rank1-0123abcd", false},
		{"the root", "/", hybrid, "/sys/fs/cgroup/unified", false},
		{"longest root wins", "/slice/jobs/a", nested, "/sys/fs/cgroup/jobs/a", false},
		{"outside the longest root", "/slice/other", nested, "/sys/fs/cgroup/slice/other", false},
		{"a container's own tree", "/slice/c1/a", container, "/sys/fs/cgroup/a", false},
		{"outside a container's tree", "/slice/c2/a", container, "no cgroup v2 mount shows it", true},
		{"a name that only starts like the root", "/slice/c1x", container, "no cgroup v2 mount shows it", true},
		{"relative", "ftkit", hybrid, "must be absolute", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := dirOf(tc.path, tc.mounts)
			switch {
			case tc.bad && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("dirOf(%q) = %q, %v; want an error with %q", tc.path, got, err, tc.want)
			case !tc.bad && (err != nil || got != tc.want):
				t.Fatalf("dirOf(%q) = %q, %v; want %q", tc.path, got, err, tc.want)
			}
		})
	}
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name, file, want string
		ok               bool
	}{
		{"v2 only", "0::/user.slice/a\n", "/user.slice/a", true},
		{"hybrid", "12:memory:/x\n1:name=systemd:/y\n0::/ftkit/job\n", "/ftkit/job", true},
		{"no newline at the end", "0::/", "/", true},
		{"v1 only", "4:cpu,cpuacct:/x\n", "", false},
		{"empty", "", "", false},
		{"a v1 hierarchy named 0", "0:cpu:/x\n", "", false},
		{"no path", "0::\n", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, ok := parse(tc.file); got != tc.want || ok != tc.ok {
				t.Fatalf("parse(%q) = %q, %v; want %q, %v", tc.file, got, ok, tc.want, tc.ok)
			}
		})
	}
}

// This process's cgroup maps to a directory that exists and back to itself.
func TestOwnCgroup(t *testing.T) {
	p, err := Of(os.Getpid())
	if err != nil {
		t.Skipf("SKIPPED: this process is in no cgroup v2 hierarchy: %v", err)
	}
	d, err := Dir(p)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(d); err != nil || !st.IsDir() {
		t.Fatalf("the directory of cgroup %s: %s: %v", p, d, err)
	}
	if back, err := HierarchyPath(d); err != nil || back != p {
		t.Fatalf("HierarchyPath(%s) = %q, %v; want %q", d, back, err, p)
	}
	if self, err := Of(0); err != nil || self != p {
		t.Fatalf("Of(0) = %q, %v; want %q", self, err, p)
	}
	if pd, err := ProcessDir(0); err != nil || pd != d {
		t.Fatalf("ProcessDir(0) = %q, %v; want %q", pd, err, d)
	}
}

func TestID(t *testing.T) {
	ms, err := mounts()
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) == 0 {
		t.Skip("SKIPPED: no cgroup v2 hierarchy is mounted")
	}
	root := ms[0].Mountpoint
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(root, link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, dir, wantErr string
	}{
		{"the cgroup2 root", root, ""},
		{"not a cgroup", t.TempDir(), "not in a cgroup v2 hierarchy"},
		{"missing", filepath.Join(root, "ftkit-no-such-cgroup"), "no such file"},
		{"a file", filepath.Join(root, "cgroup.procs"), "not a directory"},
		{"a link to a cgroup", link, "symbolic links"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := ID(tc.dir)
			switch {
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("ID(%s) = %d, %v; want an error containing %q", tc.dir, id, err, tc.wantErr)
			case tc.wantErr == "" && (err != nil || id != st.Ino):
				t.Fatalf("ID(%s) = %d, %v; want the directory's inode %d", tc.dir, id, err, st.Ino)
			}
		})
	}
}

// FuzzParse: /proc/PID/cgroup names cgroups a user may have made (a delegated sub-tree). Whatever it holds,
// parse gives the absolute path of one of its "0::" lines, and no part of another line.
func FuzzParse(f *testing.F) {
	f.Add("0::/user.slice/a\n")
	f.Add("12:memory:/x\n1:name=systemd:/y\n0::/ftkit/job\n")
	f.Add("0::/ftkit/job (deleted)\n")
	f.Add("0:cpu:/x\n0::\n")
	f.Fuzz(func(t *testing.T, file string) {
		p, ok := parse(file)
		if !ok {
			return
		}
		if !strings.HasPrefix(p, "/") || strings.Contains(p, "\n") {
			t.Fatalf("parse(%q) = %q: not an absolute path on one line", file, p)
		}
		if line := "0::" + p; !strings.HasPrefix(file, line+"\n") && file != line && !strings.Contains(file, "\n"+line+"\n") && !strings.HasSuffix(file, "\n"+line) {
			t.Fatalf("parse(%q) = %q: no line %q", file, p, line)
		}
	})
}
