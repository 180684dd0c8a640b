package lab

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/ftkit/ftkit/lab/slurm"
)

// A test's lab is taken down by the test's cleanup, which never runs when the test binary dies first (go
// test's -timeout panics it, a SIGKILL): its namespaces, agents and directories would outlive it and, on a
// developer's machine, every later run. Such a lab records its owner (Config.Owner), and the next test's
// SweepOrphans takes down the labs of owners that are gone.

// Self is the calling process as a lab's owner.
func Self() (*slurm.Proc, error) {
	p, err := slurm.Identify("lab owner", "", os.Getpid())
	if err != nil {
		return nil, err
	}
	return &p, nil
}

// SweepOrphans takes down every lab of this machine whose owner has exited, and returns their ids. Labs
// without an owner (the operator's, `ftctl lab up`, the benchmarks') are never touched.
func SweepOrphans(ctx context.Context, opts Options) ([]string, error) {
	labs, err := List(opts)
	if err != nil {
		return nil, err
	}
	var swept []string
	var errs []error
	for _, st := range labs {
		if st.Owner == nil || st.Owner.Alive() {
			continue
		}
		opts.logger().Warn("taking down a lab whose owner exited without taking it down", "lab", st.ID, "owner_pid", st.Owner.PID)
		l := &Lab{store: opts.store(), log: opts.logger().With("lab", st.ID), st: st}
		if err := l.Down(ctx); err != nil {
			errs = append(errs, fmt.Errorf("take down lab %s of exited process %d: %w", st.ID, st.Owner.PID, err))
			continue
		}
		swept = append(swept, st.ID)
	}
	return swept, errors.Join(errs...)
}
