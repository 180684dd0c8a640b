package cli

import (
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Progress prints one line per stage of a long operation (a checkpoint, a restore, lab up) for a person
// watching a terminal. It prints nothing when w is not a terminal or the output is JSON, so that scripts
// see only the result.
type Progress struct {
	w     io.Writer // nil: silent
	start time.Time
}

// NewProgress returns a Progress writing to w if w is a terminal and quiet is false.
func NewProgress(w io.Writer, quiet bool) *Progress {
	if quiet || !IsTerminal(w) {
		return &Progress{}
	}
	return &Progress{w: w, start: time.Now()}
}

// Stage prints one line: the time since the operation started and what it does now.
func (p *Progress) Stage(format string, args ...any) {
	if p == nil || p.w == nil {
		return
	}
	fmt.Fprintf(p.w, "[%6.1fs] %s\n", time.Since(p.start).Seconds(), fmt.Sprintf(format, args...))
}

// IsTerminal reports whether w is a file open on a terminal.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
