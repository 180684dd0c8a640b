package labcluster

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"runtime"
)

// Binaries are the programs an end-to-end test runs.
type Binaries struct {
	Dir, Ftagent, Ftwrap, Ftctl, Ringstencil, Memcounter, Nondet string
	// MPICHLib is libftkit-mpich.so, next to ftctl as `make build` puts it: `ftctl mpirun --impl mpich`
	// preloads it into the ranks.
	MPICHLib string
}

// Build compiles ftkit's commands, the demo programs and libftkit-mpich.so into dir (the go build cache
// makes repeats cheap).
func Build(ctx context.Context, dir string) (Binaries, error) {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+"/",
		"github.com/ftkit/ftkit/cmd/ftagent", "github.com/ftkit/ftkit/cmd/ftwrap",
		"github.com/ftkit/ftkit/cmd/ftctl", "github.com/ftkit/ftkit/testdata/ringstencil",
		"github.com/ftkit/ftkit/testdata/memcounter", "github.com/ftkit/ftkit/testdata/nondet")
	if out, err := cmd.CombinedOutput(); err != nil {
		return Binaries{}, fmt.Errorf("go build: %w\n%s", err, out)
	}
	// The library's C source is found from this file's path: tests run in the source tree.
	_, self, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(self), "..", "..", "scripts", "mpi", "ftkit-mpich-finalize.c")
	lib := filepath.Join(dir, "libftkit-mpich.so")
	if out, err := exec.CommandContext(ctx, "cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", lib, src).CombinedOutput(); err != nil {
		return Binaries{}, fmt.Errorf("compile %s (apt-get install gcc): %w\n%s", src, err, out)
	}
	return Binaries{
		Dir: dir, Ftagent: filepath.Join(dir, "ftagent"), Ftwrap: filepath.Join(dir, "ftwrap"),
		Ftctl: filepath.Join(dir, "ftctl"), Ringstencil: filepath.Join(dir, "ringstencil"), Memcounter: filepath.Join(dir, "memcounter"),
		Nondet: filepath.Join(dir, "nondet"), MPICHLib: lib,
	}, nil
}
