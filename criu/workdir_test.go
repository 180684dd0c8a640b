package criu

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/testenv"
)

// TestRemoveWorkDirStaysInside: a restore's work directory with what a CRIU that did not finish leaves
// there (its cgroup yard, mounts of file systems that hold more than the work directory) is removed, and
// nothing outside it. os.RemoveAll, which the agent used until 2026-11-30, emptied the mounted
// directories: with the cgroup yard, every empty cgroup of the host.
func TestRemoveWorkDirStaysInside(t *testing.T) {
	testenv.RequireKernel(t, "mounts")
	outside := t.TempDir()
	keep := filepath.Join(outside, "keep")
	if err := os.WriteFile(keep, []byte("not the work directory's"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(outside, "empty"), 0o700); err != nil { // as an empty cgroup
		t.Fatal(err)
	}
	work := filepath.Join(t.TempDir(), "work")
	for _, d := range []string{"images/sub", ".criu.cgyard.x/unified", "bound"} {
		if err := os.MkdirAll(filepath.Join(work, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(work, "images", "sub", "pages-1.img"), []byte("pages"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(work, "images", "link")); err != nil {
		t.Fatal(err)
	}
	// The yard: a tmpfs with a mount of a tree that is not the work directory's inside (here the outside
	// directory, where CRIU mounts cgroup2); and a bind mount of the same file system as the work directory.
	yard := filepath.Join(work, ".criu.cgyard.x")
	mounts := []struct{ src, dst, fstype string }{
		{"none", yard, "tmpfs"},
		{outside, filepath.Join(yard, "unified"), ""},
		{outside, filepath.Join(work, "bound"), ""},
	}
	for _, m := range mounts {
		if m.fstype == "tmpfs" {
			if err := unix.Mount(m.src, m.dst, "tmpfs", 0, "size=1m"); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(filepath.Join(yard, "unified"), 0o700); err != nil {
				t.Fatal(err)
			}
		} else if err := unix.Mount(m.src, m.dst, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(m.dst, unix.MNT_DETACH) })
	}
	if err := RemoveWorkDir(work); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(work); !os.IsNotExist(err) {
		t.Errorf("work directory %s: %v, want it removed", work, err)
	}
	for _, p := range []string{keep, filepath.Join(outside, "empty")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s, outside the work directory: %v", p, err)
		}
	}
	left, err := mountinfo.GetMounts(mountinfo.PrefixFilter(work))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range left {
		t.Errorf("mount %s left in place", m.Mountpoint)
	}
	if err := RemoveWorkDir(work); err != nil {
		t.Errorf("a second removal: %v", err)
	}
}
