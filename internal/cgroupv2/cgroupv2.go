// Package cgroupv2 maps between a cgroup v2 directory (/sys/fs/cgroup/unified/ftkit/JOB) and its path in
// the hierarchy (/ftkit/JOB), which is what /proc/PID/cgroup shows and what CRIU's cgroup root takes.
// Both sides come from this process's view: its mounts and its cgroup namespace.
package cgroupv2

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Of is the cgroup v2 hierarchy path of process pid (0: this process), from the "0::" line of its
// /proc/PID/cgroup.
func Of(pid int) (string, error) {
	file := "/proc/self/cgroup"
	if pid != 0 {
		file = fmt.Sprintf("/proc/%d/cgroup", pid)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("read the cgroup of a process: %w", err)
	}
	p, ok := parse(string(b))
	if !ok {
		return "", fmt.Errorf("%s has no cgroup v2 line (0::PATH)", file)
	}
	return p, nil
}

// ProcessDir is the cgroup v2 directory of process pid (0: this process): Of's path on this process's
// cgroup2 mounts.
func ProcessDir(pid int) (string, error) {
	p, err := Of(pid)
	if err != nil {
		return "", err
	}
	return Dir(p)
}

// parse returns the path of the cgroup v2 line ("0::PATH") of a /proc/PID/cgroup file.
func parse(s string) (string, bool) {
	for line := range strings.Lines(s) {
		if p, ok := strings.CutPrefix(strings.TrimSuffix(line, "\n"), "0::"); ok && strings.HasPrefix(p, "/") {
			return p, true
		}
	}
	return "", false
}

// HierarchyPath is the hierarchy path of cgroup v2 directory dir.
func HierarchyPath(dir string) (string, error) {
	mounts, err := mounts()
	if err != nil {
		return "", err
	}
	return hierarchyPath(dir, mounts)
}

// Dir is a directory of hierarchy path p on one of this process's cgroup2 mounts.
func Dir(p string) (string, error) {
	mounts, err := mounts()
	if err != nil {
		return "", err
	}
	return dirOf(p, mounts)
}

func mounts() ([]*mountinfo.Info, error) {
	m, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup2"))
	if err != nil {
		return nil, fmt.Errorf("read this process's cgroup2 mounts: %w", err)
	}
	return m, nil
}

// hierarchyPath: dir's mount is the cgroup2 mount with the longest mount point that contains it, and the
// path is the mount's root joined with what follows the mount point. Fails if dir is not absolute or on
// no cgroup2 mount.
func hierarchyPath(dir string, mounts []*mountinfo.Info) (string, error) {
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("cgroup %q: the path must be absolute", dir)
	}
	dir = filepath.Clean(dir)
	var best *mountinfo.Info
	for _, m := range mounts {
		if m.FSType == "cgroup2" && within(dir, m.Mountpoint) && (best == nil || len(m.Mountpoint) > len(best.Mountpoint)) {
			best = m
		}
	}
	if best == nil {
		return "", fmt.Errorf("cgroup %s is on no cgroup v2 mount", dir)
	}
	rel, err := filepath.Rel(best.Mountpoint, dir)
	if err != nil {
		return "", fmt.Errorf("cgroup %s under mount %s: %w", dir, best.Mountpoint, err)
	}
	return filepath.Join("/", best.Root, rel), nil
}

// dirOf: p's directory is below the cgroup2 mount whose root is the longest prefix of p.
func dirOf(p string, mounts []*mountinfo.Info) (string, error) {
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("cgroup path %q: the path must be absolute", p)
	}
	p = filepath.Clean(p)
	var best *mountinfo.Info
	for _, m := range mounts {
		if m.FSType == "cgroup2" && within(p, filepath.Join("/", m.Root)) && (best == nil || len(m.Root) > len(best.Root)) {
			best = m
		}
	}
	if best == nil {
		return "", fmt.Errorf("cgroup path %s: no cgroup v2 mount shows it", p)
	}
	rel, err := filepath.Rel(filepath.Join("/", best.Root), p)
	if err != nil {
		return "", fmt.Errorf("cgroup path %s under mount root %s: %w", p, best.Root, err)
	}
	return filepath.Join(best.Mountpoint, rel), nil
}

// within reports whether clean absolute path p is dir or below it.
func within(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// Open opens cgroup v2 directory dir without following symbolic links (it may lie under a tree a job's
// user can write) and checks that it is one: an O_RDONLY|O_DIRECTORY descriptor for BPF attachment,
// CLONE_INTO_CGROUP or fstat. The caller closes it.
func Open(dir string) (int, error) {
	fd, err := unix.Openat2(unix.AT_FDCWD, dir, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS,
	})
	if err != nil {
		return -1, fmt.Errorf("open %s (a cgroup v2 directory, no symbolic links): %w", dir, err)
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("statfs %s: %w", dir, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		unix.Close(fd)
		return -1, fmt.Errorf("%s is not in a cgroup v2 hierarchy (filesystem type %#x)", dir, st.Type)
	}
	return fd, nil
}

// ID is the id of cgroup v2 directory dir as BPF helpers report it (bpf_get_current_cgroup_id,
// bpf_skb_cgroup_id: the cgroup of a socket's creator): its inode number.
func ID(dir string) (uint64, error) {
	fd, err := Open(dir)
	if err != nil {
		return 0, fmt.Errorf("cgroup id: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("cgroup id: stat %s: %w", dir, err)
	}
	return st.Ino, nil
}
