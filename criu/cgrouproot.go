package criu

import (
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/internal/cgroupv2"
)

// restoreCgroupRoot is CRIU's cgroup_root option that restores the cgroup v2 part of a dumped tree into
// cgroup directory dir: the dumped root task's cgroup becomes dir, its sub-cgroups dir's, wherever the
// dumping host had them. Controller "" is how CRIU names cgroup v2 (cgroup_contains in criu/cgroup.c);
// cgroup v1 hierarchies keep the dumped paths.
func restoreCgroupRoot(dir string) (*rpc.CgroupRoot, error) {
	path, err := cgroupv2.HierarchyPath(dir)
	if err != nil {
		return nil, err
	}
	return &rpc.CgroupRoot{Ctrl: proto.String(""), Path: proto.String(path)}, nil
}
