package criu

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os/exec"
	"strconv"
	"strings"
)

// patches are the changes `make setup` (scripts/setup.sh) applies to CRIU before it builds it, in name
// order. Each says in its header what it fixes and how it was measured.
//
//go:embed patches/*.patch
var patches embed.FS

// ErrUnpatched means the CRIU binary was not built with ftkit's patches (PatchLevel).
var ErrUnpatched = errors.New("criu lacks ftkit's patches")

// PatchLevel names the patches in the version of a CRIU that `make setup` built: scripts/setup.sh sets it
// as CRIU's extra version, so that `criu --version` says "Version: 4.2.1.<PatchLevel>". It is the first 7
// hex digits of the SHA-256 of the patches, concatenated in name order, read as a number, as setup.sh
// computes it. A number because CRIU's RPC carries the extra version as one; not the GitID, which go-criu
// takes for a build after the release (it adds one to the minor version).
func PatchLevel() uint32 {
	names, err := fs.Glob(patches, "patches/*.patch") // sorted, as the shell's glob in the C locale
	if err != nil {
		panic(err) // the pattern is a constant
	}
	h := sha256.New()
	for _, n := range names {
		b, err := patches.ReadFile(n)
		if err != nil {
			panic(err) // embedded: cannot fail
		}
		h.Write(b)
	}
	sum := h.Sum(nil)
	return binary.BigEndian.Uint32(sum) >> 4 // the first 7 hex digits
}

// BinaryPatchLevel returns the extra version (the fourth number) in what the CRIU binary at path reports
// in `criu --version`: PatchLevel when ftkit's setup built it; 0 if there is none.
func BinaryPatchLevel(path string) (uint32, error) {
	out, err := exec.Command(path, "--version").Output()
	if err != nil {
		return 0, fmt.Errorf("run %s --version: %w", path, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "Version: "); ok {
			parts := strings.Split(strings.TrimSpace(v), ".")
			if len(parts) != 4 {
				return 0, nil
			}
			n, err := strconv.ParseUint(parts[3], 10, 32)
			if err != nil {
				return 0, nil
			}
			return uint32(n), nil
		}
	}
	return 0, nil
}

// CheckPatches reports, as an error wrapping ErrUnpatched that says what it costs and what to do, whether
// the CRIU at path lacks ftkit's patches. Such a CRIU works, with the faults the patches fix: a live
// snapshot can make TCP count a job's unsent bytes as sent without transmitting them
// (patches/0001-soccr-select-no-queue-after-save.patch), which stalls the connection until the job's TCP
// retransmits them and leaves the sender-side log a hole that makes a recovery in that time refuse; and on
// a host whose /run is not a tmpfs, every dump and restore probes the kernel afresh, about 50 ms longer
// (patches/0002-kerndat-cache-on-any-filesystem.patch); and every snapshot and restore holds the job
// stopped while the kernel destroys the network lock's nftables table, about 10 ms
// (patches/0003-net-free-unlock-nft-context-after-resume.patch); and a restore binds, removes and chowns a
// job's named unix sockets as root, by paths in directories the job's user controls
// (patches/0006-unix-sockets-bound-as-the-job-user.patch), and opens the job's files and makes and
// removes copies of its deleted ones there as root (patches/0007-files-opened-and-named-as-the-job-user.patch),
// and rebuilds the job's mount namespace following links in the paths of its mounts
// (patches/0008-mounts-followed-with-no-link.patch).
func CheckPatches(path string) error {
	level, err := BinaryPatchLevel(path)
	if err != nil {
		return err
	}
	if want := PatchLevel(); level != want {
		return fmt.Errorf("%w: %s has patch level %d, not %d: a live snapshot can make TCP count unsent bytes as sent without transmitting them (the connection stalls until TCP retransmits them, and a recovery meanwhile is refused), where /run is not a tmpfs every dump and restore probes the kernel afresh (about 50 ms), every snapshot holds the job stopped about 10 ms longer, and a restore binds the job's named unix sockets, opens its files and binds its mounts as root through any link its user planted; run `make setup` (scripts/setup.sh criu) to build CRIU with them",
			ErrUnpatched, path, level, want)
	}
	return nil
}
