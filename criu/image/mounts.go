package image

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
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
//
// The image comes from another node, with up to maxEntries mounts: the tree is walked a bounded number of
// times, never from every mount up to every missing one (cubic in the mounts: a few thousand nested ones
// held the restore for minutes).
func (m *mountsImage) gone(root string, used func() (map[uint32]bool, error), exists func(string) (bool, error)) ([]int, error) {
	n := len(m.entries)
	missing := make([]bool, n)
	anyMissing := false
	for c, e := range m.entries {
		if e.GetExtKey() == "" && !e.GetExtMount() {
			continue // the job's own (its /proc, its devpts): CRIU recreates it
		}
		ok, err := exists(filepath.Join(root, e.GetMountpoint()))
		if err != nil {
			return nil, err
		}
		if !ok {
			missing[c], anyMissing = true, true
		}
	}
	if !anyMissing {
		return nil, nil
	}
	inUse, err := used()
	if err != nil {
		return nil, err
	}
	byID := make(map[uint32]int, n)
	for i, e := range m.entries {
		byID[e.GetMntId()] = i
	}
	parent := make([]int, n) // -1: a mount whose parent is itself or not in the image
	for i, e := range m.entries {
		parent[i] = -1
		if p, ok := byID[e.GetParentMntId()]; ok && p != i {
			parent[i] = p
		}
	}
	// A corrupt image's parents may form a cycle, every mount of which is below every other: a cycle counts as
	// one mount, its group (the index of its first mount found), with no parent. Any other mount is its own
	// group.
	group := make([]int, n)
	state := make([]byte, n) // 0 not seen yet, 1 on the walk under way, 2 done
	var walk []int
	for i := range n {
		walk = walk[:0]
		j := i
		for j >= 0 && state[j] == 0 {
			state[j] = 1
			walk = append(walk, j)
			j = parent[j]
		}
		for _, k := range walk {
			group[k] = k
		}
		if j >= 0 && state[j] == 1 { // the walk came back to j: j and what follows it are a cycle
			for _, k := range walk[slices.Index(walk, j):] {
				group[k] = j
				parent[k] = -1
			}
		}
		for _, k := range walk {
			state[k] = 2
		}
	}
	missingG, busy := make([]bool, n), make([]bool, n) // by group: busy once for the group and what is below it
	children := make([][]int, n)
	var order []int // the groups, every one after its parent
	for i := range n {
		g := group[i]
		missingG[g] = missingG[g] || missing[i]
		busy[g] = busy[g] || inUse[m.entries[i].GetMntId()]
		if g != i {
			continue
		}
		if p := parent[i]; p >= 0 {
			children[group[p]] = append(children[group[p]], i)
		} else {
			order = append(order, i)
		}
	}
	for k := 0; k < len(order); k++ {
		order = append(order, children[order[k]]...)
	}
	for _, g := range slices.Backward(order) {
		if p := parent[g]; p >= 0 {
			busy[group[p]] = busy[group[p]] || busy[g]
		}
	}
	dropped := make([]bool, n)
	for _, g := range order {
		dropped[g] = missingG[g] && !busy[g] || parent[g] >= 0 && dropped[group[parent[g]]]
	}
	var drop []int
	for i := range n {
		if dropped[group[i]] {
			drop = append(drop, i)
		}
	}
	return drop, nil
}

// PruneGoneMounts drops from the mount images in dir the mounts that have gone from this host: a job's
// mount namespace is a copy of its host's (shim/jobinit.go), which CRIU rebuilds at restore by binding each
// of the host's mounts from the restoring host's namespace at the same path, and fails on one that is not
// there ("Can't stat mountpoint"). Mounts come and go on a host (another job's private /tmp, an automounted
// home, a user's FUSE mount); a mount the job did not open a file on is dropped from its namespace, where
// the job then sees what every process of this host sees at that path: nothing. root is the restore's
// root. It returns the mount points dropped.
func PruneGoneMounts(dir, root string) ([]string, error) {
	// Listed, not globbed: dir is a path, and a state directory named with "[" or "*" made it a pattern
	// that missed the job's images and matched other directories', which were rewritten.
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read CRIU images: %w", err)
	}
	var paths []string
	for _, e := range ents {
		if n := e.Name(); strings.HasPrefix(n, "mountpoints-") && strings.HasSuffix(n, ".img") {
			paths = append(paths, filepath.Join(dir, n))
		}
	}
	if len(paths) == 0 {
		return nil, nil // no mount namespace of the job's own in the images: nothing to rebuild
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
