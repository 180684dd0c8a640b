// Package criu is ftkit's thin typed layer over CRIU's RPC interface (go-criu): finding the binary, refusing
// versions that cannot work on this kernel, and running dumps and restores in the right namespace.
package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"

	"github.com/checkpoint-restore/go-criu/v7/rpc"

	"github.com/ftkit/ftkit/internal/sitecmd"
)

// Version is CRIU's version as major*10000 + minor*100 + sublevel, as CRIU's RPC reports it.
type Version int

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v/10000, v/100%100, v%100) }

// MinVersion is the oldest CRIU ftkit runs with: 4.1.1 and older abort every dump of a TCP socket on
// Linux >= 6.16 (SO_PASSCRED on inet sockets, CRIU issue #2705), and Debian bookworm's 3.17 fails on the vDSO.
const MinVersion Version = 40200

// TestedVersion is the release `make setup` builds and the test suite runs against.
const TestedVersion Version = 40201

// DefaultBinary is where `make setup` installs CRIU.
const DefaultBinary = "/usr/local/sbin/criu"

// ErrTooOld means the CRIU found is older than MinVersion.
var ErrTooOld = errors.New("criu too old")

// FindBinary resolves the CRIU binary: the given path, else DefaultBinary, else `criu` on PATH.
func FindBinary(path string) (string, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return "", fmt.Errorf("criu binary %s: %w", path, err)
		}
		return path, nil
	}
	if _, err := os.Stat(DefaultBinary); err == nil {
		return DefaultBinary, nil
	}
	p, err := exec.LookPath("criu")
	if err != nil {
		return "", fmt.Errorf("no CRIU found (looked at %s and on PATH): run `make setup` to build CRIU %s", DefaultBinary, TestedVersion)
	}
	return p, nil
}

// BinaryVersion asks the CRIU binary at path for its version over RPC (criu swrk; needs root). A CRIU built
// from a git tree also reports its git id: it is the release it names, not the next minor one, as go-criu
// takes it (a CRIU 4.1.1 built from its tag passed for 4.2.0, and every dump of a TCP socket aborted).
func BinaryVersion(path string) (Version, error) {
	cr, err := startSwrk(path, false)
	if err != nil {
		return 0, fmt.Errorf("ask %s for its version: %w", path, err)
	}
	var v *rpc.CriuVersion
	if err := cr.do(context.Background(), func() (err error) { v, err = cr.version(); return err }); err != nil {
		return 0, fmt.Errorf("ask %s for its version: %w", path, err)
	}
	return Version(v.GetMajorNumber()*10000 + v.GetMinorNumber()*100 + v.GetSublevel()), nil
}

// Require finds CRIU and checks that it is at least MinVersion, with an error that says what to do.
func Require(path string) (string, Version, error) {
	bin, err := FindBinary(path)
	if err != nil {
		return "", 0, err
	}
	// The agent runs it as root at every dump and restore, and asking its version runs it already: a
	// binary another user could change (an operator's own build under a home directory, a user's directory
	// on the agent's PATH) would run that user's code as root.
	if err := sitecmd.CheckProgram("criu binary", bin); err != nil {
		return bin, 0, fmt.Errorf("%w: the agent runs CRIU as root", err)
	}
	v, err := BinaryVersion(bin)
	if err != nil {
		return bin, 0, err
	}
	if v < MinVersion {
		return bin, v, fmt.Errorf("%w: %s is CRIU %s, ftkit needs %s or newer (%s is tested): run `make setup` to build it",
			ErrTooOld, bin, v, MinVersion, TestedVersion)
	}
	return bin, v, nil
}
