package ackclamp

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOpenPinnedRefusesUnsafeDir: the pins a restarted agent trusts (the clamp's map with the flows of a
// replay under way, its TCX links) must lie where root alone can rename, remove or pre-create them. A user
// who can write a directory on the way can move the agent's pins aside (the next agent then finds no
// flow, while the moved links keep clamping for good) or pre-create the directory. Nothing is loaded:
// the directory is refused before.
func TestOpenPinnedRefusesUnsafeDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root, to own the directories checked")
	}
	tests := []struct {
		name  string
		setup func(t *testing.T, base string) string
		want  string
	}{
		{"parent writable by others", func(t *testing.T, b string) string {
			p := filepath.Join(b, "ww")
			if err := os.Mkdir(p, 0o777); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, 0o777); err != nil {
				t.Fatal(err)
			}
			return filepath.Join(p, "node1", "ackclamp")
		}, "has mode 0777"},
		{"parent owned by another user", func(t *testing.T, b string) string {
			p := filepath.Join(b, "u")
			if err := os.Mkdir(p, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(p, 65534, 65534); err != nil {
				t.Fatal(err)
			}
			return filepath.Join(p, "node1", "ackclamp")
		}, "uid 65534"},
		{"a user's directory in a sticky one", func(t *testing.T, b string) string {
			p := filepath.Join(b, "sticky")
			if err := os.Mkdir(p, 0o777); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, 0o777|os.ModeSticky); err != nil {
				t.Fatal(err)
			}
			u := filepath.Join(p, "ftkit")
			if err := os.Mkdir(u, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(u, 65534, 65534); err != nil {
				t.Fatal(err)
			}
			return filepath.Join(u, "node1", "ackclamp")
		}, "uid 65534"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.setup(t, t.TempDir())
			c, err := OpenPinned(dir)
			if err == nil {
				c.Close()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("OpenPinned(%s) = %v, want an error saying %q", dir, err, tc.want)
			}
			// Refused before root made anything in the unsafe directory (MkdirAll would follow a link).
			if _, err := os.Lstat(filepath.Dir(dir)); err == nil {
				t.Errorf("OpenPinned made %s before it refused the directory", filepath.Dir(dir))
			}
		})
	}
}
