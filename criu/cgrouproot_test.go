package criu

import (
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
)

func TestCgroupRoot(t *testing.T) {
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
			got, err := cgroupRoot(tc.dir, tc.mounts)
			switch {
			case tc.bad && err == nil:
				t.Fatalf("cgroupRoot(%q) = %q; want an error with %q", tc.dir, got, tc.want)
			case tc.bad && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("cgroupRoot(%q): error %q does not contain %q", tc.dir, err, tc.want)
			case !tc.bad && (err != nil || got != tc.want):
				t.Fatalf("cgroupRoot(%q) = %q, %v; want %q", tc.dir, got, err, tc.want)
			}
		})
	}
}
