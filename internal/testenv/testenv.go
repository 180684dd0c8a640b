// Package testenv decides whether a test may use the kernel (network namespaces, CRIU, eBPF, cgroups) or
// must skip. One rule for every such suite, so that `go test -short` (`make unit`) runs only the pure
// tests even as root, and a plain run as root (`make test`, CI) runs all of them.
package testenv

import (
	"flag"
	"fmt"
	"os"
	"testing"
)

// RequireKernel skips the test loudly in -short mode, and when not root; needs says what it uses, e.g.
// "network namespaces" or "CRIU".
func RequireKernel(t testing.TB, needs string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("SKIPPED in -short mode (pure tests only): this test needs %s; run it without -short, as root (`make test`)", needs)
	}
	if os.Geteuid() != 0 {
		t.Skipf("SKIPPED: this test needs root (%s); run `make test` as root", needs)
	}
}

// EndPackageIfShort ends a test binary in -short mode when every test in it needs the kernel, before its
// TestMain builds or starts anything (an end-to-end package's set-up alone takes minutes). Call it first
// in TestMain; it says so loudly and exits 0.
func EndPackageIfShort(needs string) {
	flag.Parse()
	if testing.Short() {
		fmt.Printf("SKIPPED in -short mode (pure tests only): every test of this package needs %s; run it without -short, as root (`make test`)\n", needs)
		os.Exit(0)
	}
}
