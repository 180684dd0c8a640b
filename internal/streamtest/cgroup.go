//go:build linux

package streamtest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/testenv"
)

// ErrNoCgroup2 means no cgroup v2 hierarchy is mounted.
var ErrNoCgroup2 = errors.New("no cgroup2 hierarchy is mounted (mount one, e.g. at /sys/fs/cgroup/unified)")

// Cgroup2Mount returns where the cgroup v2 hierarchy is mounted.
func Cgroup2Mount() (string, error) {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return "", fmt.Errorf("find the cgroup2 mount: %w", err)
	}
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) > 2 && f[2] == "cgroup2" {
			return f[1], nil
		}
	}
	return "", ErrNoCgroup2
}

// Cgroup2MountT is Cgroup2Mount for a test; it skips the test loudly when no
// cgroup v2 hierarchy is mounted.
func Cgroup2MountT(t testing.TB) string {
	t.Helper()
	root, err := Cgroup2Mount()
	if errors.Is(err, ErrNoCgroup2) {
		t.Skip("SKIPPED: no cgroup2 hierarchy is mounted; filtering by cgroup v2 cannot be tested")
	}
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// Cgroup is a child of the cgroup v2 root, or of another Cgroup (Sub).
type Cgroup struct {
	Dir string
	ID  uint64 // the directory's inode number: what bpf_skb_cgroup_id returns
	fd  int    // for CLONE_INTO_CGROUP
}

// NewCgroup creates the cgroup name under the cgroup v2 root. Close removes
// it, once the processes started in it are dead.
func NewCgroup(name string) (*Cgroup, error) {
	root, err := Cgroup2Mount()
	if err != nil {
		return nil, err
	}
	return newCgroupAt(filepath.Join(root, name))
}

// Sub creates the cgroup name below c. Close it before c.
func (c *Cgroup) Sub(name string) (*Cgroup, error) {
	return newCgroupAt(filepath.Join(c.Dir, name))
}

// SubT is Sub for a test: the cgroup is removed at the end of the test,
// before c if c was made by NewCgroupT earlier in the same test.
func (c *Cgroup) SubT(t testing.TB, name string) *Cgroup {
	t.Helper()
	sub, err := c.Sub(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sub.Close(); err != nil {
			t.Error(err)
		}
	})
	return sub
}

func newCgroupAt(dir string) (*Cgroup, error) {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create cgroup: %w", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		_ = syscall.Rmdir(dir)
		return nil, fmt.Errorf("stat cgroup %s: %w", dir, err)
	}
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		_ = syscall.Rmdir(dir)
		return nil, fmt.Errorf("open cgroup %s: %w", dir, err)
	}
	return &Cgroup{Dir: dir, ID: st.Ino, fd: fd}, nil
}

// Close removes the cgroup; its processes must be dead by then. A cgroup whose
// last process was just reaped can stay busy for a moment, so removal is
// retried for up to 2 s. Removing a cgroup already gone is not an error.
func (c *Cgroup) Close() error {
	if c.fd >= 0 {
		syscall.Close(c.fd)
		c.fd = -1
	}
	var err error
	for range 100 {
		if err = syscall.Rmdir(c.Dir); err == nil || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("remove cgroup %s (kill the processes in its cgroup.procs, then rmdir it): %w", c.Dir, err)
}

// NewCgroupT creates a cgroup for a test, removed at the end of the test
// (after the processes started in it, whose cleanups run first). It skips the
// test loudly when no cgroup v2 hierarchy is mounted.
func NewCgroupT(t testing.TB, name string) *Cgroup {
	t.Helper()
	testenv.RequireKernel(t, "a cgroup of its own")
	Cgroup2MountT(t)
	cg, err := NewCgroup(fmt.Sprintf("ftkit-test-%d-%s", os.Getpid(), name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cg.Close(); err != nil {
			t.Error(err)
		}
	})
	return cg
}
