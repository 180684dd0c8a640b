package ckpt

import (
	"errors"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// lockDir opens dir and takes an exclusive flock on it. The kernel drops the
// lock when the process dies, which is how Open tells a crashed writer's
// temp directory from a live one (in this process or another).
func lockDir(dir string, wait bool) (*os.File, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	how := unix.LOCK_EX
	if !wait {
		how |= unix.LOCK_NB
	}
	for {
		err = unix.Flock(int(d.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// writeFileSync writes data to path and fsyncs it (not its directory).
func writeFileSync(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// removeHidden removes path by first renaming it to a hidden name in the same
// directory, so a crash mid-removal never leaves a visible half snapshot.
func removeHidden(path, hiddenName string) error {
	dir := filepath.Dir(path)
	hidden := filepath.Join(dir, hiddenName)
	if err := os.Rename(path, hidden); err != nil {
		return err
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return err
	}
	return os.RemoveAll(hidden)
}
