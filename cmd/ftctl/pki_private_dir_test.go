package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPKIRefusesAnotherUsersDirectory: the CA's and members' keys go only into a directory of the user who
// runs ftctl pki (root, on a site). A directory of mode 0700 that another user owns passed the mode check,
// and root wrote the cluster CA's key where that user reads it.
func TestPKIRefusesAnotherUsersDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to give the directory to another user")
	}
	dir := filepath.Join(t.TempDir(), "pki")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	_, code, err := runFtctl(t, "pki", "init", "--dir", dir)
	if code == 0 || err == nil || !strings.Contains(err.Error(), "owned by uid 65534") {
		t.Fatalf("pki init into a directory of uid 65534: exit %d, %v; want a refusal naming its owner", code, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("pki init wrote %d files into another user's directory", len(ents))
	}
}
