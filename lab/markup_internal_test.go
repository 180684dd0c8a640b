package lab

import (
	"context"
	"log/slog"
	"testing"

	"github.com/ftkit/ftkit/lab/slurm"
)

// TestMarkUpKeepsHandedOverMunged: a lab with Slurm that reuses the running munged (it records none) may
// be handed that munged by another lab's Down while it waits for its slurmds; the end of its Up must keep
// the record, else no lab stops munged at the last Down. Nothing here touches the kernel.
func TestMarkUpKeepsHandedOverMunged(t *testing.T) {
	store := stateStore{dir: t.TempDir()}
	a := &Lab{store: store, log: slog.Default(), st: State{Plan: Plan{ID: "a"}, Phase: PhaseUp}}
	b := &Lab{store: store, log: slog.Default(), st: State{Plan: Plan{ID: "b"}, Phase: PhaseCreating, Slurm: &SlurmState{Dir: t.TempDir()}}}
	for _, l := range []*Lab{a, b} {
		if err := store.save(l.st); err != nil {
			t.Fatal(err)
		}
	}
	// a's Down hands its munged over to b, which still needs it (no process is signalled: b takes it).
	munged := slurm.Proc{Name: "munged", PID: 1, Start: 1}
	if err := store.locked(func() error { return a.handOverMunged(context.Background(), munged) }); err != nil {
		t.Fatal(err)
	}
	// b's Up ends.
	if err := b.markUp(); err != nil {
		t.Fatal(err)
	}
	st, err := store.load("b")
	if err != nil {
		t.Fatal(err)
	}
	if st.Phase != PhaseUp {
		t.Errorf("lab b is in phase %q, want %q", st.Phase, PhaseUp)
	}
	if st.Slurm == nil || st.Slurm.Munged == nil || *st.Slurm.Munged != munged {
		t.Errorf("lab b's record of munged after its Up: %+v, want %+v (handed over by lab a's Down)", st.Slurm, munged)
	}
}
