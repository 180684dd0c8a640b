// Package filecopy copies the first n bytes of a file, or a range of it, for the snapshot's copy of a
// job's outputs (dump), their rewrite at a restore and its journal, and a snapshot fetched by copying. A
// file shorter than n is an error: the size was recorded when the file was that long.
package filecopy

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// Prefix copies exactly n bytes from src to dst.
func Prefix(dst io.Writer, src io.Reader, n int64) error {
	if _, err := io.CopyN(dst, src, n); err != nil {
		return fmt.Errorf("file shorter than its size at the dump (%d bytes): %w", n, err)
	}
	return nil
}

// PrefixToNew copies exactly n bytes from src to a new file dst (mode 0600, never through a link); on
// failure dst is removed. Only src's data is copied: dst has holes where src has them, so a job that made
// its output sparse (a seek past its end) costs root's disk only the bytes it wrote.
func PrefixToNew(dst string, src *os.File, n int64) error {
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if err := Range(out, src, 0, n); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}

// Range copies src's bytes [off, off+n) to dst's [0, n) and sets dst's size to n, copying only src's data
// (SEEK_DATA, SEEK_HOLE; a file system without holes reports all of a file as data): dst, new or empty,
// has holes where src has them. src shorter than off+n is an error.
func Range(dst, src *os.File, off, n int64) error {
	return RangeTo(dst, 0, src, off, n)
}

// RangeTo is Range to dst's [at, at+n), dst's size then at+n: dst, no longer than at, has holes where src
// has them.
func RangeTo(dst *os.File, at int64, src *os.File, off, n int64) error {
	return rangeTo(dst, at, src, off, n, nil)
}

// rangeTo is RangeTo; afterData, if set (tests), runs after each piece of data copied.
func rangeTo(dst *os.File, at int64, src *os.File, off, n int64, afterData func()) error {
	st, err := src.Stat()
	if err != nil {
		return err
	}
	end := off + n
	if st.Size() < end {
		return fmt.Errorf("file shorter than its size at the dump (%d bytes, now %d): %w", end, st.Size(), io.ErrUnexpectedEOF)
	}
	fd := int(src.Fd())
	for pos := off; pos < end; {
		data, err := unix.Seek(fd, pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // a hole up to the file's end
		}
		if err != nil {
			return fmt.Errorf("find data from %d: %w", pos, err)
		}
		if data >= end {
			break
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("find a hole from %d: %w", data, err)
		}
		hole = min(hole, end)
		if err := Prefix(io.NewOffsetWriter(dst, at+data-off), io.NewSectionReader(src, data, hole-data), hole-data); err != nil {
			return err
		}
		pos = hole
		if afterData != nil {
			afterData()
		}
	}
	// A source truncated during the copy reads as a hole to its new end (SEEK_DATA answers ENXIO): the
	// copy would hold zeros where the recorded bytes were, and pass.
	if st, err = src.Stat(); err != nil {
		return err
	}
	if st.Size() < end {
		return fmt.Errorf("file shorter than its size at the dump (%d bytes, now %d): truncated during the copy: %w", end, st.Size(), io.ErrUnexpectedEOF)
	}
	return dst.Truncate(at + n)
}
