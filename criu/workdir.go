package criu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/moby/sys/mount"
	"golang.org/x/sys/unix"
)

// RemoveWorkDir removes dir, a directory CRIU restored in (its images and work directory), with all it
// holds, and never anything outside it. A restore mounts CRIU's cgroup yard there (".criu.cgyard.*": a
// tmpfs holding a mount of each of the host's cgroup hierarchies, cgroup v2's whole tree among them) and
// unmounts it at its end, so a CRIU killed or still running leaves it mounted: os.RemoveAll walked into it
// and removed every empty cgroup of the host. Every mount under dir is detached first (MNT_DETACH), and a
// directory on another file system than dir's, mounted meanwhile, is detached instead of entered. The lab
// removes its directories with it too.
func RemoveWorkDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("remove %s: not a directory", dir)
	}
	if err := mount.RecursiveUnmount(filepath.Clean(dir)); err != nil { // deepest first, MNT_DETACH
		return fmt.Errorf("remove %s: detach what is mounted under it: %w", dir, err)
	}
	if err := unix.Lstat(dir, &st); err != nil { // dir itself may have been a mount point
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	if err := removeBelow(dir, st.Dev); err != nil {
		return err
	}
	if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}

// removeBelow removes what directory path holds, on device dev: symbolic links are removed, never
// followed, and a directory on another device (a mount) is detached before it is entered.
func removeBelow(path string, dev uint64) error {
	names, err := readNames(path)
	if err != nil {
		return err
	}
	for _, name := range names {
		p := filepath.Join(path, name)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			return fmt.Errorf("remove %s: %w", p, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			if err := unix.Unlink(p); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("remove %s: %w", p, err)
			}
			continue
		}
		for tries := 0; st.Dev != dev; tries++ {
			if tries == 8 {
				return fmt.Errorf("remove %s: still a mount point after %d detaches: left in place", p, tries)
			}
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
				return fmt.Errorf("remove %s: a mount point, and it cannot be detached: %w", p, err)
			}
			if err := unix.Lstat(p, &st); err != nil {
				return fmt.Errorf("remove %s: %w", p, err)
			}
		}
		if err := removeBelow(p, dev); err != nil {
			return err
		}
		if err := unix.Rmdir(p); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove %s: %w", p, err)
		}
	}
	return nil
}

// readNames lists directory path without following a link at path.
func readNames(path string) ([]string, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("remove %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, fmt.Errorf("remove %s: %w", path, err)
	}
	return names, nil
}
