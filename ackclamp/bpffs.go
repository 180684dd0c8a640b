package ackclamp

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/rootpath"
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

// checkPinDir checks that root alone can rename, remove or pre-create what the existing directory dir
// holds: every directory from / down to dir is a real directory (no symbolic link) of root's (or of this
// process's user), writable by its owner alone, but for one that is sticky and not the pin directory itself
// (pins: dir is; like a bpffs mounted without a mode, 1777: others cannot touch root's entries there, and
// the next one is checked). A user who could write one of them could move the agent's pins aside, and the
// next agent would find no flow while the moved links go on clamping.
func checkPinDir(dir string, pins bool) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	comps := []string{abs}
	for p := abs; filepath.Dir(p) != p; p = filepath.Dir(p) {
		comps = append([]string{filepath.Dir(p)}, comps...)
	}
	for i, p := range comps {
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory (mode %v)", p, fi.Mode())
		}
		if uid := rootpath.Owner(fi); !rootpath.Trusted(uid) {
			return fmt.Errorf("%s is owned by uid %d, who could move the pins aside: chown root it or choose a path of root's", p, uid)
		}
		if fi.Mode().Perm()&0o022 != 0 && (fi.Mode()&fs.ModeSticky == 0 || pins && i == len(comps)-1) {
			return fmt.Errorf("%s has mode %04o, so others could move the pins aside: chmod go-w it or choose another path", p, fi.Mode().Perm())
		}
	}
	return nil
}
