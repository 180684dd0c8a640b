// Package filecopy copies the first n bytes of a file, for the snapshot's copy of a job's outputs (dump),
// their rewrite at a restore, and a snapshot fetched by copying. A file shorter than n is an error: the
// size was recorded when the file was that long.
package filecopy

import (
	"fmt"
	"io"
	"os"
	"syscall"
)

// Prefix copies exactly n bytes from src to dst.
func Prefix(dst io.Writer, src io.Reader, n int64) error {
	if _, err := io.CopyN(dst, src, n); err != nil {
		return fmt.Errorf("file shorter than its size at the dump (%d bytes): %w", n, err)
	}
	return nil
}

// PrefixToNew copies the first n bytes of src into a new file dst (0600: it may hold anything the job
// wrote), which must not exist yet and is not reached through a link. A failed copy leaves no dst.
func PrefixToNew(dst string, src io.Reader, n int64) error {
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if err := Prefix(out, src, n); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}
