package agent

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/outputs"
)

// TestSettleOutputJournals: an agent killed between cutting a job's outputs for a restore and the
// restore's outcome leaves the cut bytes in the restore's journal: the next agent drops the journal if the
// job runs here restored from that snapshot, and keeps it (reported) otherwise.
func TestSettleOutputJournals(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (the job user's files)")
	}
	const full, cut = "0123456789", "0123"
	for _, tc := range []struct {
		name        string
		restored    bool // the job's record runs restored from the snapshot
		keepJournal bool
	}{
		{name: "job runs from it", restored: true},
		{name: "no job runs from it", keepJournal: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			j := *ta.byID[ownersJob]
			if err := os.Mkdir(j.Dir, 0o755); err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(j.Dir, stdoutName)
			if err := os.WriteFile(out, []byte(full), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(out, int(j.UID), int(j.GID)); err != nil {
				t.Fatal(err)
			}
			m := &ckpt.Manifest{Job: j.ID, ID: ta.ownSnap}
			m.OpenFiles = []ckpt.OpenFile{{Path: out, Size: int64(len(cut))}}
			// What a restore killed after the cut leaves.
			work := filepath.Join(ta.cfg.StateDir, "restore", j.ID+"-"+ta.ownSnap+"-0123abcd")
			if err := os.MkdirAll(work, 0o700); err != nil {
				t.Fatal(err)
			}
			journal := filepath.Join(work, outputJournalDir)
			jr, err := ta.restoreOutputs(m, j, journal)
			if err != nil {
				t.Fatal(err)
			}
			jr.Close() // the killed agent's descriptors
			if tc.restored {
				ta.byID[j.ID].Restored = ta.ownSnap
			}

			ta.settleOutputJournals()

			if b, err := os.ReadFile(out); err != nil || string(b) != cut {
				t.Fatalf("stdout = %q (%v), want %q", b, err, cut)
			}
			_, err = os.Stat(filepath.Join(journal, outputs.IndexFile))
			if kept := err == nil; kept != tc.keepJournal {
				t.Fatalf("journal kept = %v, want %v (%v)", kept, tc.keepJournal, err)
			}
		})
	}
}

// TestParseWorkName: a restore's work directory is named <job>-<snapshot>-<8 hex> (workCopy); both ids hold
// dashes, and a name that splits into no valid pair, or into more than one, names nothing.
func TestParseWorkName(t *testing.T) {
	for _, tc := range []struct {
		name, job, snap string
		ok              bool
	}{
		{"rank1-00000001-20260101T000000.000Z-node2-000001-0123abcd", "rank1-00000001", "20260101T000000.000Z-node2-000001", true},
		{"rank1-00000001-20260101T000000.000Z-node2-000001-0123abcZ", "", "", false}, // not hex
		{"rank1-00000001-20260101T000000.000Z-node2-000001-0123abc", "", "", false},  // 7 digits
		{"rank1-00000001-0123abcd", "", "", false},                                   // no snapshot
		{"0123abcd", "", "", false},
	} {
		job, snap, ok := parseWorkName(tc.name)
		if job != tc.job || snap != tc.snap || ok != tc.ok {
			t.Errorf("parseWorkName(%q) = %q, %q, %v; want %q, %q, %v", tc.name, job, snap, ok, tc.job, tc.snap, tc.ok)
		}
	}
}
