package agent

import (
	"slices"
	"testing"
)

// TestStaleGuards is what an agent killed between a restore's guard and CRIU's start leaves: the restores'
// work directories, each with the run id of its guard. The guards of restores no shim runs any more go;
// those of a restore whose shim may still run CRIU stay (CRIU deletes its guard when it unlocks the
// network), and so does a run id that such a restore shares with a stale one.
func TestStaleGuards(t *testing.T) {
	const (
		idA = "7f05a1c5-eb5c-4010-8794-c7b4459a6353"
		idB = "0b9d6f3e-1c2a-4e5f-8a7b-9c0d1e2f3a4b"
		idC = "5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9"
	)
	left := []leftRestore{
		{Job: "gone-00000001", RunID: idA, Work: "/state/restore/a"},      // the agent died before CRIU's start
		{Job: "restoring-00000001", RunID: idB, Work: "/state/restore/b"}, // its shim still runs CRIU
		{Job: "other-00000001", RunID: idB, Work: "/state/restore/b2"},    // no shim, but the same run id as b's
		{Job: "ended-00000001", RunID: idC, Work: "/state/restore/c"},     // its CRIU failed after the agent died
	}
	restoring := func(job string) bool { return job == "restoring-00000001" }
	var got []string
	for _, l := range staleGuards(left, restoring) {
		got = append(got, l.Job)
	}
	if want := []string{"gone-00000001", "ended-00000001"}; !slices.Equal(got, want) {
		t.Errorf("stale guards of jobs %q, want %q", got, want)
	}
	if got := staleGuards(left, func(string) bool { return true }); len(got) != 0 {
		t.Errorf("with every job's shim running, %d guard(s) removed, want none", len(got))
	}
}
