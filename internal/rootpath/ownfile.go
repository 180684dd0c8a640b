package rootpath

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
)

// OpenOwnFile opens path for writing (flag adds O_APPEND, say), created 0600 if missing, as a regular file
// of root's (Trusted) and never through a link. In a directory others may write to (a sticky jobs_dir), what
// stands at path may be another user's: a file, a link, a FIFO (O_NONBLOCK: no reader does not hold the
// open) or a directory. Root then neither writes into it nor truncates it: it is removed and the open tried
// again, a few times.
func OpenOwnFile(path string, flag int) (*os.File, error) {
	for range 3 {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|flag|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600)
		if err == nil {
			fi, serr := f.Stat()
			if serr == nil && fi.Mode().IsRegular() && Trusted(Owner(fi)) {
				return f, nil
			}
			f.Close()
			if serr != nil {
				return nil, serr
			}
		} else if fi, lerr := os.Lstat(path); lerr != nil || fi.Mode().IsRegular() && Trusted(Owner(fi)) {
			return nil, err // not something planted there: the open's own failure
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove %s, another user's file in place of root's: %w", path, err)
		}
	}
	return nil, fmt.Errorf("%s: another user's file keeps taking its place; remove it", path)
}
