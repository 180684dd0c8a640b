package criu

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestKernelProbeCacheKeptOnAnyFilesystem: the CRIU `make setup` builds keeps what it probed of the kernel
// on any filesystem, tied to the boot id (patches/0002), so a dump or restore on a host whose /run is not a
// tmpfs does not probe the kernel afresh (iptables -L twice, a network namespace and a veth: about 50 ms of
// every dump, restore and lazy-pages daemon on this project's machines). CRIU 4.2.1 without the patch keeps
// no cache there, and leaves a criu.kdat.tmp behind that keeps every later CRIU from saving one.
//
// The cache goes to a directory of the test's own (an unprivileged CRIU's $XDG_RUNTIME_DIR), on the
// filesystem of the test's temporary files, so the host's /run/criu.kdat is not touched.
func TestKernelProbeCacheKeptOnAnyFilesystem(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	bootID, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		t.Fatal(err)
	}
	bootID = bytes.TrimSpace(bootID)
	dir := t.TempDir()
	cache := filepath.Join(dir, "criu.kdat")
	check := func(want string) {
		t.Helper()
		log := filepath.Join(t.TempDir(), "check.log")
		cmd := exec.CommandContext(t.Context(), bin, "check", "--unprivileged", "-v4", "-o", log)
		cmd.Env = append(os.Environ(), "XDG_RUNTIME_DIR="+dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("criu check: %v: %s", err, out)
		}
		b, err := os.ReadFile(log)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), want) {
			level, _ := BinaryPatchLevel(bin)
			t.Fatalf("criu check's log has no %q (%s: patch level %d, want %d; without patches/0002 CRIU keeps its kernel probes only on a tmpfs):\n%s",
				want, bin, level, PatchLevel(), b)
		}
	}

	check("File " + cache + " does not exist")
	check("Loaded kdat cache from " + cache)

	// The cache of another boot is refused and made afresh.
	b, err := os.ReadFile(cache)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(b, bootID)
	if i < 0 {
		t.Fatalf("%s does not hold the boot id %s", cache, bootID)
	}
	other := bytes.Clone(b)
	copy(other[i:], bytes.Repeat([]byte("0"), len(bootID)))
	if err := os.WriteFile(cache, other, 0o600); err != nil {
		t.Fatal(err)
	}
	check("Stale " + cache + " file")
	check("Loaded kdat cache from " + cache)
	if b2, err := os.ReadFile(cache); err != nil || !bytes.Contains(b2, bootID) {
		t.Fatalf("the cache made afresh does not hold this boot's id (%v)", err)
	}

	left, err := filepath.Glob(filepath.Join(dir, "*.tmp"))
	if err != nil || len(left) > 0 {
		t.Fatalf("temporary files left in the cache's directory: %v (%v)", left, err)
	}
}
