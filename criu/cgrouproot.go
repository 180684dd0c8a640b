package criu

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"github.com/moby/sys/mountinfo"
	"google.golang.org/protobuf/proto"
)

// cgroupRoot is the path of cgroup v2 directory dir inside its hierarchy (what /proc/PID/cgroup shows, and
// what CRIU's --cgroup-root takes), from the cgroup2 mounts of mounts: dir's mount is the one with the
// longest mount point that contains it, and the path is the mount's root joined with what follows the
// mount point. Fails if dir is not absolute or on no cgroup2 mount.
func cgroupRoot(dir string, mounts []*mountinfo.Info) (string, error) {
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("cgroup %q: the path must be absolute", dir)
	}
	dir = filepath.Clean(dir)
	var best *mountinfo.Info
	for _, m := range mounts {
		if m.FSType != "cgroup2" || (dir != m.Mountpoint && !strings.HasPrefix(dir, strings.TrimSuffix(m.Mountpoint, "/")+"/")) {
			continue
		}
		if best == nil || len(m.Mountpoint) > len(best.Mountpoint) {
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

// restoreCgroupRoot is CRIU's cgroup_root option that restores the cgroup v2 part of a dumped tree into
// cgroup directory dir: the dumped root task's cgroup becomes dir, its sub-cgroups dir's, wherever the
// dumping host had them. Controller "" is how CRIU names cgroup v2 (cgroup_contains in criu/cgroup.c);
// cgroup v1 hierarchies keep the dumped paths.
func restoreCgroupRoot(dir string) (*rpc.CgroupRoot, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup2"))
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	path, err := cgroupRoot(dir, mounts)
	if err != nil {
		return nil, err
	}
	return &rpc.CgroupRoot{Ctrl: proto.String(""), Path: proto.String(path)}, nil
}
