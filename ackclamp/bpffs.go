package ackclamp

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// DefaultBPFFS is where Linux distributions mount the BPF file system that pins live in.
const DefaultBPFFS = "/sys/fs/bpf"

// IsBPFFS reports whether dir is on a BPF file system.
func IsBPFFS(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return st.Type == unix.BPF_FS_MAGIC, nil
}

// MountBPFFS mounts a BPF file system (root only, 0700) at dir unless one is there already, as systemd
// does at boot on most distributions.
func MountBPFFS(dir string) error {
	if ok, err := IsBPFFS(dir); err == nil && ok {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s for the BPF file system: %w", dir, err)
	}
	if err := unix.Mount("bpf", dir, "bpf", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0700"); err != nil {
		return fmt.Errorf("mount the BPF file system on %s: %w", dir, err)
	}
	return nil
}
