package image

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	"google.golang.org/protobuf/proto"
)

// magicMounts is mountpoints-<ns>.img's (CRIU's MNTS_MAGIC).
const magicMounts = 0x55563928

// mountsImage is a decoded mountpoints-<ns>.img; raw keeps every entry as CRIU wrote it.
type mountsImage struct {
	raw     [][]byte
	entries []*mnt.MntEntry
}

func decodeMounts(name string, b []byte) (*mountsImage, error) {
	raw, entries, err := decodeEntries(name, b, magicMounts, "MntEntry", func() *mnt.MntEntry { return &mnt.MntEntry{} }, proto.UnmarshalOptions{})
	if err != nil {
		return nil, err
	}
	return &mountsImage{raw: raw, entries: entries}, nil
}

func (m *mountsImage) encode() []byte { return encodeEntries(magicMounts, m.raw) }

// gone returns the indexes of the mounts to drop: each external mount (bound at restore from the
// restoring host's namespace) whose mount point does not exist under root, with every mount below it,
// unless one of those is in use (a mount a file of the job was opened on: CRIU then refuses the restore,
// naming it). used returns the IDs of the mounts in use, asked only once a mount point is missing; exists
// reports whether a path exists on this host.
func (m *mountsImage) gone(root string, used func() (map[uint32]bool, error), exists func(string) (bool, error)) ([]int, error) {
	byID := make(map[uint32]int, len(m.entries))
	for i, e := range m.entries {
		byID[e.GetMntId()] = i
	}
	// under reports whether mount i is candidate c or below it. Bounded by the number of mounts: a
	// corrupt image's parent cycle ends there.
	under := func(i, c int) bool {
		for range len(m.entries) {
			if i == c {
				return true
			}
			p, ok := byID[m.entries[i].GetParentMntId()]
			if !ok || p == i {
				return false
			}
			i = p
		}
		return false
	}
	var drop []int
	for c, e := range m.entries {
		if e.GetExtKey() == "" && !e.GetExtMount() {
			continue // the job's own (its /proc, its devpts): CRIU recreates it
		}
		ok, err := exists(filepath.Join(root, e.GetMountpoint()))
		if err != nil {
			return nil, err
		}
		if ok {
			continue
		}
		inUse, err := used()
		if err != nil {
			return nil, err
		}
		var subtree []int
		busy := false
		for i := range m.entries {
			if under(i, c) {
				subtree = append(subtree, i)
				busy = busy || inUse[m.entries[i].GetMntId()]
			}
		}
		if !busy {
			drop = append(drop, subtree...)
		}
	}
	slices.Sort(drop)
	return slices.Compact(drop), nil
}

// PruneGoneMounts drops from the mount images in dir the mounts that have gone from this host: a job's
// mount namespace is a copy of its host's (shim/jobinit.go), which CRIU rebuilds at restore by binding each
// of the host's mounts from the restoring host's namespace at the same path, and fails on one that is not
// there ("Can't stat mountpoint"). Mounts come and go on a host (another job's private /tmp, an automounted
// home, a user's FUSE mount); a mount the job did not open a file on is dropped from its namespace, where
// the job then sees what every process of this host sees at that path: nothing. root is the restore's
// root. It returns the mount points dropped.
func PruneGoneMounts(dir, root string) ([]string, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "mountpoints-*.img"))
	if err != nil || len(paths) == 0 {
		return nil, err // no mount namespace of the job's own in the images: nothing to rebuild
	}
	// The job's files name the mounts in use; read only if a mount point is missing, which is rare.
	used := sync.OnceValues(func() (map[uint32]bool, error) {
		files, err := readFiles(dir)
		if err != nil {
			return nil, err
		}
		used := map[uint32]bool{}
		for _, e := range files.entries {
			// A descriptor's or mapping's file (regular files, the cwd and root among them) and a unix
			// socket bound to a path name the mount they are on.
			if id := e.GetReg().GetMntId(); id >= 0 && e.GetReg() != nil {
				used[uint32(id)] = true
			}
			if id := e.GetUsk().GetMntId(); id >= 0 && e.GetUsk() != nil {
				used[uint32(id)] = true
			}
		}
		return used, nil
	})
	var dropped []string
	for _, p := range paths {
		name := filepath.Base(p)
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("read CRIU image: %w", err)
		}
		m, err := decodeMounts(name, b)
		if err != nil {
			return nil, err
		}
		drop, err := m.gone(root, used, pathExists)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", name, err)
		}
		if len(drop) == 0 {
			continue
		}
		for _, i := range slices.Backward(drop) {
			dropped = append(dropped, m.entries[i].GetMountpoint())
			m.raw = slices.Delete(m.raw, i, i+1)
			m.entries = slices.Delete(m.entries, i, i+1)
		}
		if err := writeFileAtomic(p, m.encode()); err != nil {
			return nil, err
		}
	}
	slices.Sort(dropped)
	return dropped, nil
}

// pathExists reports whether path exists (a final symbolic link is not followed: it exists as a link);
// a path through a file does not.
func pathExists(path string) (bool, error) {
	_, err := os.Lstat(path)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ENOTDIR):
		return false, nil
	default:
		return false, fmt.Errorf("look for mount point %s: %w", path, err)
	}
}
