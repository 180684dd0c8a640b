// Package labtest gives end-to-end tests a lab of their own, removed when the test ends, pass or fail.
package labtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/lab"
)

// RequireRoot skips a privileged test loudly when not run as root (CI and `make test` run as root), and in
// -short mode (`make unit`), which runs pure tests only.
func RequireRoot(t testing.TB) {
	t.Helper()
	testenv.RequireKernel(t, "network namespaces")
}

// New brings up a lab with a fresh id and a free subnet (lab.RandomTestSubnet) and registers its teardown.
func New(t testing.TB, nodes, spares int) *lab.Lab {
	t.Helper()
	return Up(t, lab.Config{Nodes: nodes, Spares: spares})
}

// Up brings up the lab cfg describes under a fresh id and a free subnet (lab.RandomTestSubnet), owned by
// this test binary, and registers its teardown. It first takes down the labs of test binaries that died
// without their cleanups (lab.SweepOrphans: a -timeout panic).
func Up(t testing.TB, cfg lab.Config) *lab.Lab {
	t.Helper()
	RequireRoot(t)
	ctx := context.Background()
	if swept, err := lab.SweepOrphans(ctx, lab.Options{}); err != nil {
		t.Logf("labs of exited test binaries not all taken down: %v", err)
	} else if len(swept) > 0 {
		t.Logf("took down the labs of exited test binaries: %v", swept)
	}
	owner, err := lab.Self()
	if err != nil {
		t.Fatal(err)
	}
	cfg.Owner = owner
	for try := 0; try < 20; try++ {
		cfg.ID = fmt.Sprintf("t%06x", rand.Uint32()&0xffffff)
		cfg.Subnet = lab.RandomTestSubnet()
		l, err := lab.Up(ctx, cfg, lab.Options{})
		if errors.Is(err, lab.ErrSubnetInUse) || errors.Is(err, lab.ErrExists) {
			continue
		}
		if err != nil {
			t.Fatalf("lab up: %v", err)
		}
		t.Cleanup(func() {
			if err := l.Down(context.Background()); err != nil {
				t.Errorf("lab down: %v", err)
			}
		})
		return l
	}
	t.Fatal("no free lab id and subnet after 20 tries; are stale labs left? run `ftctl lab status`")
	return nil
}
