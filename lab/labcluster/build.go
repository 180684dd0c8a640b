package labcluster

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
)

// Binaries are the programs an end-to-end test runs.
type Binaries struct {
	Dir, Ftagent, Ftwrap, Ftctl, Ringstencil, Memcounter, Nondet string
}

// Build compiles ftkit's commands and the demo program into dir (the go build cache makes repeats cheap).
func Build(ctx context.Context, dir string) (Binaries, error) {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+"/",
		"github.com/ftkit/ftkit/cmd/ftagent", "github.com/ftkit/ftkit/cmd/ftwrap",
		"github.com/ftkit/ftkit/cmd/ftctl", "github.com/ftkit/ftkit/testdata/ringstencil",
		"github.com/ftkit/ftkit/testdata/memcounter", "github.com/ftkit/ftkit/testdata/nondet")
	if out, err := cmd.CombinedOutput(); err != nil {
		return Binaries{}, fmt.Errorf("go build: %w\n%s", err, out)
	}
	return Binaries{
		Dir: dir, Ftagent: filepath.Join(dir, "ftagent"), Ftwrap: filepath.Join(dir, "ftwrap"),
		Ftctl: filepath.Join(dir, "ftctl"), Ringstencil: filepath.Join(dir, "ringstencil"), Memcounter: filepath.Join(dir, "memcounter"),
		Nondet: filepath.Join(dir, "nondet"),
	}, nil
}
