package ring

import (
	"os"
	"path/filepath"
	"testing"
)

// The saved view is the agent's state: root only, also over a world-readable file of an older version.
func TestSaveIsPrivate(t *testing.T) {
	p := filepath.Join(t.TempDir(), "view.json")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Save(p, replaced(t)); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("view saved with mode %v, want 0600", st.Mode().Perm())
	}
}
